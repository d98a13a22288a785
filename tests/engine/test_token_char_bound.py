"""``Tokenizer.max_token_chars``: the most characters of a text one token can stand for, so that a
text longer than max_model_len x it cannot fit the context and is refused before it is encoded
(issue 22 follow-up: encoding a multi-MB text holds the interpreter for seconds). None where the
tokenizer may drop characters (no sound bound exists)."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers, pre_tokenizers
from tokenizers.models import BPE

from pagedserve.engine.tokenizer import Tokenizer, _Specials
from tests.engine.test_tokenizer import TEXTS


@pytest.fixture(scope="module")
def default_tok(default_model_path):
    return Tokenizer.from_model(default_model_path)


def test_default_tokenizer_bound_is_its_longest_token(default_tok):
    vocab = default_tok._tok.get_vocab(with_added_tokens=True)
    assert default_tok.max_token_chars == max(len(t) for t in vocab)  # 81 for SmolLM2


def test_the_bound_holds_for_any_text(default_tok):
    bound = default_tok.max_token_chars
    rng = random.Random(0)
    alphabet = "ab c\n\t  1234567890.,;{}<>|_-héΩ日本🙂\u0301" + "".join(chr(rng.randrange(32, 0x2FFF))
                                                                for _ in range(200))
    texts = list(TEXTS) + [" " * 5000, "\n" * 3000, "a" * 4000, "=" * 3000, "<|im_start|>" * 50]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3000))) for _ in range(50)]
    for text in texts:
        ids = default_tok.encode(text, add_special_tokens=False)
        assert len(text) <= len(ids) * bound, (len(text), len(ids))


def _tok(backend: HFTokenizer) -> Tokenizer:
    return Tokenizer(backend, _Specials(), None, "test")


def _bpe(**kw) -> HFTokenizer:
    return HFTokenizer(BPE(vocab={"a": 0, "b": 1, "ab": 2, "[UNK]": 3, "abab": 4}, merges=[("a", "b"), ("ab", "ab")],
                           **kw))


def test_tokenizers_that_may_drop_text_have_no_bound():
    plain = _tok(_bpe(unk_token="[UNK]"))
    assert plain.max_token_chars == 5  # "[UNK]": an unknown character is one token of its own
    whitespace = _bpe(unk_token="[UNK]")
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish: "a" + 1 MB + "b" is 2 tokens
    assert _tok(whitespace).max_token_chars is None
    fused = _bpe(unk_token="[UNK]", fuse_unk=True)  # a run of unknown characters is one token
    assert _tok(fused).max_token_chars is None
    stripped = _bpe(unk_token="[UNK]")
    stripped.normalizer = normalizers.Strip()
    assert _tok(stripped).max_token_chars is None
    composed = _bpe(unk_token="[UNK]")
    composed.normalizer = normalizers.NFC()  # up to 4 characters compose into one
    assert _tok(composed).max_token_chars == 5 * 4
    lower = _bpe(unk_token="[UNK]")
    lower.normalizer = normalizers.Sequence([normalizers.Lowercase(), normalizers.Replace(" ", "▁")])
    assert _tok(lower).max_token_chars == 5
    from tokenizers import AddedToken

    swallowing = _bpe(unk_token="[UNK]")
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # takes any run of spaces before it
    assert _tok(swallowing).max_token_chars is None
