"""Tokenizer.token_bytes: the bytes a token stands for (logprobs' ``bytes``), also for tokens that
are part of a character and decode alone to U+FFFD; and a per-call chat template."""
from __future__ import annotations

import pytest

TEXT = "héllo — naïve café, Ωmega ∑ 日本語のテキスト 🙂🚀 👩‍👩‍👧 €"
REPLACEMENT = "\ufffd".encode()


@pytest.fixture(scope="module")
def ours(default_model_path):
    from pagedserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_model(default_model_path)


def test_default_model_token_bytes_join_into_the_text(ours):
    ids = ours.encode(TEXT, add_special_tokens=False)
    pieces = [ours.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode("utf-8")
    partial = [i for i in ids if ours.decode([i]).endswith("\ufffd")]
    assert partial, "the text should have tokens that are parts of characters"
    for i in partial:
        assert REPLACEMENT not in ours.token_bytes(i)


def test_a_character_split_across_tokens(ours):
    # "日" is E6 97 A5; with a space in front the model splits it after the first byte.
    ids = ours.encode(" 日", add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids) == " 日".encode()
    assert ours.token_bytes(ids[0])[-1:] == b"\xe6"


def test_every_token_has_bytes_and_specials_are_their_text(ours):
    for i in range(ours.vocab_size):
        assert isinstance(ours.token_bytes(i), bytes)
    im_start = ours.token_to_id("<|im_start|>")
    assert ours.token_bytes(im_start) == b"<|im_start|>"


def test_byte_fallback_tokens_are_their_byte():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    from tokenizers.models import BPE

    from pagedserve.engine.tokenizer import Tokenizer, _Specials

    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "▁a": 4, "é": 5}
    backend = HFTokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(backend, _Specials(unk_token="<unk>"), None, "test")
    assert tok.decode([1]) == "\ufffd"
    assert [tok.token_bytes(i) for i in (1, 2, 3)] == [b"\xe2", b"\x82", b"\xac"]
    assert tok.token_bytes(4) == b" a"
    assert tok.token_bytes(5) == "é".encode()  # not the byte-level table's 0xE9


def test_chat_template_per_call_and_extra_variables(ours):
    messages = [{"role": "user", "content": "Hi"}]
    out = ours.apply_chat_template(messages, add_generation_prompt=False,
                                   chat_template="{{ messages[0]['content'] }}|{{ flavour }}",
                                   flavour="mint")
    assert out == "Hi|mint"
    assert ours.apply_chat_template(messages) != out  # the model's own template otherwise
