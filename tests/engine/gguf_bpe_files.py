"""A byte-level BPE vocabulary trained here with `tokenizers`, and its GGUF file under a given
pre-tokenizer name: shared by tests/engine/test_gguf_bpe_pre.py and the llama.cpp comparison
(tests/engine/tokenizer_vs_llama_cpp.py), which must not need transformers."""
from __future__ import annotations

import json
import random

import gguf
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from tests.engine.test_gguf_spm import corpus, training_text


def bpe_vocabulary() -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a 700-token byte-level BPE trained on the tests' text and corpus."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(training_text(random.Random(1)) + corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_bpe_gguf(path, pre: str, tokens: list[str], merges: list[str]) -> None:
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
