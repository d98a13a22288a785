"""GGUF byte-level BPE vocabularies read by llama.cpp's vocabulary loader's rules (llama-vocab.cpp), where
they differ from a plain reading of the file. Found by tests/engine/tokenizer_vs_llama_cpp.py
(pagedserve against llama-cpp-python's ``Llama(path, vocab_only=True).tokenize`` on the same files), and
each expectation here checked against llama.cpp once on these very files:

- a file without ``tokenizer.ggml.add_bos_token`` gets BOS where llama.cpp's loader defaults to it
  (the Llama 3 family's names and tekken); the key, where present, decides;
- pre-tokenizer ``default`` (and a file without ``tokenizer.ggml.pre``) is llama.cpp's own default split
  (punctuation runs, GPT-2's rule, digit runs, then groups of three digits), not GPT-2's;
- the Llama 3 family's names and tekken take a pre-token that is itself a vocabulary entry as that
  token, before any merge (llama.cpp's ``ignore_merges``, as Llama 3's tokenizer.json says);
- a SentencePiece Unigram ("t5") file without the keys gets EOS and no space prefix (llama.cpp's UGM
  defaults), a "llama" one BOS and the space prefix;
- a byte-level BPE file's ``tokenizer.ggml.add_space_prefix`` changes nothing (llama.cpp's BPE never reads it)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedserve.engine.tokenizer import Tokenizer, _bytes_to_unicode

EOT = "<|endoftext|>"


def write(path, pre: str | None, extra: list[str], merges: list[str], add_bos: bool | None = None,
          add_space_prefix: bool | None = None) -> list[str]:
    """A byte-level BPE GGUF: the 256 byte characters, ``extra`` tokens, ``merges``, EOT as BOS and EOS."""
    tokens = [EOT] + sorted(set(_bytes_to_unicode().values())) + extra
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def pieces(tok: Tokenizer, text: str, add_special_tokens: bool = False) -> list[str]:
    return tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=add_special_tokens))


@pytest.mark.parametrize("pre,bos", [("llama-bpe", True), ("llama3", True), ("llama-v3", True), ("falcon3", True),
                                     ("falcon-h1", True), ("tekken", True), ("qwen2", False), ("smollm", False),
                                     ("gpt-4o", False), ("gpt-2", False), ("default", False)])
def test_bos_by_llama_cpp_default_when_the_file_is_silent(tmp_path, pre, bos):
    path = tmp_path / "v.gguf"
    write(path, pre, ["xy"], ["x y"])  # llama.cpp wants merges
    assert pieces(Tokenizer.from_model(str(path)), "hi", add_special_tokens=True) == [EOT] * bos + ["h", "i"]
    write(path, pre, ["xy"], ["x y"], add_bos=not bos)  # the file's key decides
    assert pieces(Tokenizer.from_model(str(path)), "hi", add_special_tokens=True) == [EOT] * (not bos) + ["h", "i"]


@pytest.mark.parametrize("pre", ["default", None])
def test_the_default_pre_tokenizer_is_llama_cpp_s(tmp_path, pre):
    path = tmp_path / "v.gguf"
    write(path, pre, ["Ġ.", "12", "123", "1234", "Ġ,", "hi", "Ġhi"], ["Ġ .", "1 2", "12 3", "123 4", "Ġ ,", "h i", "Ġ hi"])
    tok = Tokenizer.from_model(str(path))
    # punctuation runs first: " ." is not one piece; digits in runs, then in threes
    assert pieces(tok, "a .b") == ["a", "Ġ", ".", "b"]
    assert pieces(tok, "1234") == ["123", "4"]
    assert pieces(tok, "x 1234567 , hi!") == ["x", "Ġ", "123", "4", "5", "6", "7", "Ġ", ",", "Ġhi", "!"]
    # GPT-2's own split under its own name
    write(path, "gpt-2", ["Ġ.", "12", "123", "1234", "Ġ,", "hi", "Ġhi"], ["Ġ .", "1 2", "12 3", "123 4", "Ġ ,", "h i", "Ġ hi"])
    gpt2 = Tokenizer.from_model(str(path))
    assert pieces(gpt2, "a .b") == ["a", "Ġ.", "b"]
    assert pieces(gpt2, "1234") == ["1234"]


@pytest.mark.parametrize("pre,whole", [("llama-bpe", True), ("tekken", True), ("falcon3", True), ("qwen2", False),
                                       ("gpt-4o", False), ("smollm", False)])
def test_a_pre_token_in_the_vocabulary_is_taken_whole_where_llama_cpp_ignores_merges(tmp_path, pre, whole):
    path = tmp_path / "v.gguf"
    # "abc" is a token, but the merges reach "a" + "bc" first and never join them
    write(path, pre, ["bc", "ab", "abc"], ["b c", "a b", "ab c"])
    tok = Tokenizer.from_model(str(path))
    assert pieces(tok, "abc") == (["abc"] if whole else ["a", "bc"])
    assert pieces(tok, "abcabc") == ["a", "bc", "a", "bc"]  # not a vocabulary entry: merges as ever


def write_spm(path, model: str, add_bos: bool | None = None, add_eos: bool | None = None) -> None:
    """A tiny SentencePiece vocabulary ("llama" or "t5") written without or with the BOS / EOS keys."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h", "▁hi"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -0.5])
    w.add_token_types([2, 3, 3, 1, 1, 1, 1, 1])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("model,bos,eos,body", [("llama", True, False, ["▁hi"]), ("t5", False, True, ["h", "i"])])
def test_sentencepiece_defaults_of_llama_cpp_when_the_file_is_silent(tmp_path, model, bos, eos, body):
    """Without tokenizer.ggml.add_bos_token / add_eos_token / add_space_prefix: "llama" adds BOS and the
    space prefix, "t5" (llama.cpp's UGM) adds EOS and no space prefix."""
    path = tmp_path / "v.gguf"
    write_spm(path, model)
    assert pieces(Tokenizer.from_model(str(path)), "hi", add_special_tokens=True) == ["<s>"] * bos + body + ["</s>"] * eos
    write_spm(path, model, add_bos=not bos, add_eos=not eos)  # the file's keys decide
    assert pieces(Tokenizer.from_model(str(path)), "hi", add_special_tokens=True) == \
        ["<s>"] * (not bos) + body + ["</s>"] * (not eos)



@pytest.mark.parametrize("pre", ["gpt-2", "default", "smollm", "llama-bpe"])
def test_a_bpe_file_s_add_space_prefix_is_ignored_as_llama_cpp_does(tmp_path, pre):
    path = tmp_path / "v.gguf"
    write(path, pre, ["hi", "Ġhi"], ["h i", "Ġ hi"], add_space_prefix=True)
    assert pieces(Tokenizer.from_model(str(path)), "hi") == ["hi"]
