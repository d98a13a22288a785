"""Prepare what the GPU check (loadtest/micro/gpu_check.py) carries to the lent GPU machine, which
has no network: run HERE, where PyPI is reachable, before the call (docs/gpu-check.md).

    python -m pagedserve.loadtest.micro.gpu_check_prepare [--dir .gpu_check]

It fills the ignored folder ``.gpu_check/`` (the run tool's ``carry`` names it):

- ``wheels/``: the server's packages that the machine's image lacks, as binary wheels for its
  Python (3.12, x86-64 manylinux), each at the version installed here (the version the suite
  passes on), with the packages they need that the image lacks too;
- ``model/``: the default model's tokenizer exported from its GGUF by engine/tokenizer.py
  (tokenizer.json, tokenizer_config.json with the chat template) plus loadtest/tiny_model.py's
  config.json, a model directory that ``LLM(model=..., load_format="dummy")`` and ``serve`` take
  (the GGUF itself is too big to carry).

It checks the exported tokenizer encodes and renders chat exactly as the GGUF's does, and prints
the folder's size: the whole working tree that travels must stay under 64 MiB.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# What the GPU machine's image lacks (KINDS.md lists what it holds), with what these need and it
# lacks or may hold too old: pydantic's core, annotated-types, typing-inspection and a
# typing-extensions as new as pydantic asks; xgrammar's apache-tvm-ffi; an anyio as new as
# sse-starlette asks (the image's version is not recorded).
PACKAGES = ("starlette", "uvicorn", "sse-starlette", "orjson", "pydantic", "pydantic-core", "annotated-types",
            "typing-inspection", "typing-extensions", "msgspec", "httptools", "gguf", "xgrammar", "apache-tvm-ffi",
            "anyio")
PYTHON_VERSION = "3.12"  # the machine's python3 (KINDS.md: Python 3.12.3)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 << 20  # the run tool's limit on everything that travels
SAMPLE_TEXTS = ("Hello, world! How are you today?", "def f(x):\n    return x ** 2  # 12345",
                "Ünïcödé — 日本語のテキスト 🚀", "  leading spaces and\ttabs\n\nnew lines")


def pinned(name: str) -> str:
    """name==the version installed here (the suite passes on it), or the bare name."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def download_wheels(dest: Path) -> list[str]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two stop the install there
        old.unlink()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    specs = [pinned(name) for name in PACKAGES]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def export_model_dir(dest: Path) -> None:
    """The default model's tokenizer (from its GGUF, through engine/tokenizer.py) and the tiny
    config, as a model directory; checked against the GGUF's tokenizer."""
    from pagedserve.contracts.config import default_model_path
    from pagedserve.engine.tokenizer import Tokenizer
    from pagedserve.loadtest.tiny_model import TINY_CONFIG

    source = Tokenizer.from_model(default_model_path())
    dest.mkdir(parents=True, exist_ok=True)
    source._tok.save(str(dest / "tokenizer.json"))
    config = {"bos_token": source.bos_token, "eos_token": source.eos_token, "unk_token": source.unk_token,
              "pad_token": source.pad_token, "chat_template": source.chat_template}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (dest / "config.json").write_text(json.dumps({**TINY_CONFIG, "eos_token_id": source.eos_token_ids[0],
                                                  "bos_token_id": source.bos_token_id}, indent=1))
    exported = Tokenizer.from_model(str(dest))
    for text in SAMPLE_TEXTS:
        if exported.encode(text) != source.encode(text):
            raise SystemExit(f"the exported tokenizer encodes {text!r} differently")
    chat = [{"role": "user", "content": SAMPLE_TEXTS[0]}]
    if exported.apply_chat_template(chat) != source.apply_chat_template(chat):
        raise SystemExit("the exported tokenizer renders the chat template differently")
    if exported.eos_token_ids != source.eos_token_ids or exported.vocab_size != source.vocab_size:
        raise SystemExit("the exported tokenizer's special tokens or vocabulary differ")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".gpu_check", help="the folder to fill (carried by the run call)")
    parser.add_argument("--skip-wheels", action="store_true", help="export the model directory only")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if not args.skip_wheels:
        wheels = download_wheels(root / "wheels")
        print(f"{len(wheels)} wheels: {' '.join(wheels)}")
    shutil.rmtree(root / "model", ignore_errors=True)
    export_model_dir(root / "model")
    size = folder_bytes(root)
    print(f"{root}: {size / 2**20:.1f} MiB (the whole tree that travels must stay under "
          f"{CARRY_LIMIT >> 20} MiB)")
    return 0 if size < CARRY_LIMIT else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
