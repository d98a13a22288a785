"""GGUF byte-level BPE vocabularies under each pre-tokenizer name we know that transformers' GGUF
conversion also knows: a vocabulary trained here with `tokenizers`, written into a GGUF file per
name, tokenized by us and by transformers (``get_gguf_tokenizer`` + ``convert_gguf_tokenizer``, the
oracle) on the same >= 200 strings: the same ids on every one, and decode round trips. The names
transformers does not cover (smollm / starcoder / refact, gpt-2) are tested in
tests/engine/test_tokenizer.py against the default model; llama.cpp's own "default" split in
tests/engine/test_gguf_llama_cpp_rules.py."""
from __future__ import annotations


import pytest

from pagedserve.engine.tokenizer import _SPLITS, Tokenizer
from tests.engine.gguf_bpe_files import bpe_vocabulary, write_bpe_gguf
from tests.engine.test_gguf_spm import corpus

pytest.importorskip("transformers")
from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    GGUF_PRE_TOKENIZER_SPLITS, convert_gguf_tokenizer, get_gguf_tokenizer)

NAMES = sorted(name for name in _SPLITS if name in GGUF_PRE_TOKENIZER_SPLITS)


@pytest.fixture(scope="module")
def vocabulary():
    return bpe_vocabulary()


write = write_bpe_gguf


def test_the_names_cover_the_families():
    assert {"llama-bpe", "qwen2", "tekken", "gpt-4o"} <= set(NAMES)


@pytest.mark.parametrize("pre", NAMES)
def test_the_same_ids_as_transformers_gguf_conversion(vocabulary, tmp_path, pre):
    tokens, merges = vocabulary
    path = tmp_path / f"{pre}.gguf"
    write(path, pre, tokens, merges)
    ours = Tokenizer.from_model(str(path))
    arch, tdict, _ = get_gguf_tokenizer(str(path))
    ref, _ = convert_gguf_tokenizer(arch, tdict)
    strings = corpus()
    wrong = [s for s in strings if ours.encode(s, add_special_tokens=False) != ref.encode(s, add_special_tokens=False).ids]
    assert wrong == [], f"{pre}: {len(wrong)} of {len(strings)} differ; first: {wrong[:3]!r}"
    for s in strings:
        assert ours.decode(ours.encode(s, add_special_tokens=False)) == s
