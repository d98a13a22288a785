"""pagedserve's GGUF tokenizer against llama.cpp's own on the same GGUF files (issue 39 item 1, outside
the suite, run once).

    .venv/bin/python -m tests.engine.tokenizer_vs_llama_cpp \\
        [--anchor-python ~/.cache/pagedserve-anchors/llama-cpp-venv/bin/python] [--gguf FILE ...] \\
        [--no-default] [--no-test-vocabs] [--show 3] [--keep DIR]

Files: the bundled default model (SmolLM2-135M, gpt2 BPE, pre-tokenizer "smollm"); the SentencePiece BPE
(byte fallback, split digits: ``tokenizer.ggml.model = "llama"``) and Unigram (``"t5"``) vocabularies
tests/engine/test_gguf_spm.py trains with the ``sentencepiece`` package and writes into GGUF files; a
byte-level BPE vocabulary trained as tests/engine/test_gguf_bpe_pre.py trains it, written once per
pre-tokenizer name pagedserve knows; and any ``--gguf`` file. Corpus: the tests' 260 strings
(``test_gguf_spm.corpus``).

pagedserve tokenizes in this process (``engine.tokenizer.Tokenizer``); llama.cpp in a subprocess of
the anchor venv's python (llama-cpp-python, ``Llama(path, vocab_only=True).tokenize``, built by
``/work/shared/anchors/llama-cpp.sh setup``) that prints JSON. Two settings per file, the same on both
sides:

- ``file``: the file's own BOS/EOS rule (pagedserve ``encode(s)``; llama.cpp ``add_bos=True``, which
  adds what the vocabulary says) and special tokens parsed in the text (``special=True``; pagedserve
  always matches control tokens in text);
- ``bare``: no BOS/EOS (``encode(s, add_special_tokens=False)``; ``add_bos=False``), specials parsed.

Prints per file and setting: strings equal / total, and the first ``--show`` differences.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ANCHOR_PYTHON = Path.home() / ".cache/pagedserve-anchors/llama-cpp-venv/bin/python"
SETTINGS = {"file": (True, True), "bare": (False, True)}  # name -> (add_bos / add specials, parse special)

# Runs under the anchor venv: {"files": [...], "strings": [...], "settings": {name: [add_bos, special]}} on
# stdin, {path: {setting: [ids | "error: ..."]}} on stdout.
_WORKER = r"""
import json, sys
from llama_cpp import Llama
job = json.load(sys.stdin)
out = {}
for path in job["files"]:
    try:
        llm = Llama(model_path=path, vocab_only=True, verbose=False)
    except Exception as e:
        out[path] = {"error": f"{type(e).__name__}: {e}"}
        continue
    res = {}
    for name, (add_bos, special) in job["settings"].items():
        ids = []
        for s in job["strings"]:
            try:
                ids.append(llm.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special))
            except Exception as e:
                ids.append(f"error: {type(e).__name__}: {e}")
        res[name] = ids
    out[path] = res
    del llm
json.dump(out, sys.stdout)
"""


def llama_cpp_ids(anchor_python: str, files: list[str], strings: list[str]) -> dict:
    job = json.dumps({"files": files, "strings": strings, "settings": SETTINGS})
    proc = subprocess.run([anchor_python, "-c", _WORKER], input=job, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"llama.cpp worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def test_vocab_files(tmp: Path) -> list[tuple[str, str]]:
    """(label, path) of the tests' SentencePiece files and one BPE file per known pre-tokenizer name."""
    from pagedserve.engine.tokenizer import _DIGIT_SPLIT, _SPLITS
    from tests.engine.test_gguf_spm import spm, train, write_gguf

    out = []
    for model_type, ggml_model in (("bpe", "llama"), ("unigram", "t5")):
        d = tmp / model_type
        d.mkdir(exist_ok=True)
        model_file = train(d, model_type)
        path = d / f"{model_type}.gguf"
        write_gguf(model_file, path, ggml_model)
        out.append((f"sentencepiece {model_type} ({ggml_model})", str(path)))
    # The Unigram one again without byte fallback (T5's own vocabularies have none; 180 pieces, the most it
    # allows then): llama.cpp's Unigram
    # never falls back to bytes, it gives <unk> (see PERF.md).
    d = tmp / "unigram-nobytes"
    d.mkdir(exist_ok=True)
    real_train = spm.SentencePieceTrainer.train
    spm.SentencePieceTrainer.train = lambda **kw: real_train(**dict(kw, byte_fallback=False, vocab_size=180))
    try:
        model_file = train(d, "unigram")
    finally:
        spm.SentencePieceTrainer.train = real_train
    write_gguf(model_file, d / "unigram.gguf", "t5")
    out.append(("sentencepiece unigram (t5), no byte fallback", str(d / "unigram.gguf")))

    # The byte-level BPE vocabulary of tests/engine/test_gguf_bpe_pre.py, one file per pre-tokenizer name.
    from tests.engine.gguf_bpe_files import bpe_vocabulary, write_bpe_gguf

    tokens, merges = bpe_vocabulary()
    for pre in sorted(set(_SPLITS) | _DIGIT_SPLIT | {"default", "gpt-2"}):
        path = tmp / f"bpe-{pre}.gguf"
        write_bpe_gguf(path, pre, tokens, merges)
        out.append((f"bpe pre={pre}", str(path)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--anchor-python", default=str(ANCHOR_PYTHON))
    ap.add_argument("--gguf", nargs="*", default=[], help="more GGUF files")
    ap.add_argument("--no-default", action="store_true", help="leave out the bundled default model")
    ap.add_argument("--no-test-vocabs", action="store_true", help="leave out the tests' vocabularies")
    ap.add_argument("--show", type=int, default=3, help="differences shown per file and setting")
    ap.add_argument("--keep", help="write the test vocabularies here (kept) instead of a temporary folder")
    args = ap.parse_args()

    from pagedserve.engine.tokenizer import Tokenizer
    from tests.engine.test_gguf_spm import corpus

    strings = corpus()
    files: list[tuple[str, str]] = []
    if not args.no_default:
        from pagedserve.contracts.config import default_model_path

        files.append(("default model (SmolLM2-135M Q4_1, gpt2/smollm)", default_model_path()))
    files += [(Path(f).name, f) for f in args.gguf]
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(args.keep or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        if not args.no_test_vocabs:
            files += test_vocab_files(tmp)
        ref = llama_cpp_ids(args.anchor_python, [p for _, p in files], strings)

        total_equal = total = 0
        print(f"corpus: {len(strings)} strings (tests/engine/test_gguf_spm.corpus); llama.cpp via {args.anchor_python}")
        for label, path in files:
            if "error" in ref[path]:
                print(f"\n{label}: llama.cpp cannot load it: {ref[path]['error']}")
                continue
            ours = Tokenizer.from_model(path)
            line = []
            diffs = {}
            for name, (add, _special) in SETTINGS.items():
                mine = [ours.encode(s, add_special_tokens=add) for s in strings]
                theirs = ref[path][name]
                bad = [(s, m, t) for s, m, t in zip(strings, mine, theirs) if m != t]
                equal = len(strings) - len(bad)
                total_equal += equal
                total += len(strings)
                line.append(f"{name} {equal}/{len(strings)}")
                diffs[name] = bad
            print(f"\n{label}: " + ", ".join(line))
            for name, bad in diffs.items():
                for s, m, t in bad[:args.show]:
                    print(f"  [{name}] {s!r}\n    pagedserve {m}\n    llama.cpp  {t}")
                    if isinstance(t, list):
                        print(f"    pieces     {ours.convert_ids_to_tokens(m)}\n"
                              f"    llama.cpp  {ours.convert_ids_to_tokens(t)}")
        print(f"\nall files: {total_equal}/{total} tokenizations equal")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
