"""GGUF byte-level BPE vocabularies under each pre-tokenizer name we know that transformers' GGUF
conversion also knows: a vocabulary trained here with `tokenizers`, written into a GGUF file per
name, tokenized by us and by transformers (``get_gguf_tokenizer`` + ``convert_gguf_tokenizer``, the
oracle) on the same >= 200 strings: the same ids on every one, and decode round trips. The names
transformers does not cover (smollm / starcoder / refact, gpt-2) are tested in
tests/engine/test_tokenizer.py against the default model; llama.cpp's own "default" split in
tests/engine/test_gguf_llama_cpp_rules.py."""
from __future__ import annotations

import json
import random

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pagedserve.engine.tokenizer import _SPLITS, Tokenizer
from tests.engine.test_gguf_spm import corpus, training_text

pytest.importorskip("transformers")
from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: E402
    GGUF_PRE_TOKENIZER_SPLITS, convert_gguf_tokenizer, get_gguf_tokenizer)

NAMES = sorted(name for name in _SPLITS if name in GGUF_PRE_TOKENIZER_SPLITS)


@pytest.fixture(scope="module")
def vocabulary():
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(training_text(random.Random(1)) + corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write(path, pre: str, tokens: list[str], merges: list[str]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
