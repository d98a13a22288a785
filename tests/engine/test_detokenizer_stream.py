"""The detokenizer on tokenizers' DecodeStream against the old two-decodes path and full decodes,
over many random token sequences of the default model's byte-level tokenizer: multi-byte
characters cut anywhere, stray continuation bytes, special tokens skipped or kept, prompts that
end mid-character, stop strings (held back, cut, included) and min_tokens (stop checks off).
"""
from __future__ import annotations

import random

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from tests.engine.detok_reference import ReferenceDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé — naïve café, Straße, Ærøskøbing; “quotes” and ‘ticks’…",
    "日本語のテキスト、中文字符，한국어 문장.",
    "emoji 😀🎉👩‍👩‍👧 flags 🇫🇷 and math ∑∫√∞ ≠ ≤ ≥",
    "code: def f(x):\n    return x ** 2  # ok\n\n\tindent",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nsure",
]


@pytest.fixture(scope="module")
def tok():
    from pagedserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_model(None)  # the default model's tokenizer (GGUF)


def _random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """A mix: real text tokens, arbitrary vocabulary ids (byte pieces included), special ids."""
    pool = [t for text in TEXTS for t in tok.encode(text, add_special_tokens=False)]
    specials = sorted(tok.all_special_ids)
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.5:
            start = rng.randrange(len(pool))
            out.extend(pool[start:start + rng.randint(1, 6)])
        elif r < 0.9:
            out.append(rng.randrange(tok.vocab_size))
        else:
            out.append(rng.choice(specials))
    return out[:n]


def _clean_ids(tok, rng: random.Random) -> list[int]:
    """Tokens of real text: what a model emits, multi-byte characters split across tokens."""
    text = "".join(rng.choice(TEXTS)[rng.randrange(5):] for _ in range(3))
    return tok.encode(text, add_special_tokens=False)


def _run(detok, ids, check_from: int) -> list:
    trace = []
    for i, t in enumerate(ids):
        trace.append((detok.add_token(t, check_stop=i >= check_from), detok.take_delta()))
        if detok.stopped:
            break
    detok.flush()
    trace.append(("flush", detok.take_delta(), detok.text, detok.stopped))
    return trace


def test_decode_stream_is_available(tok):
    """The installed tokenizers has DecodeStream(ids=...): the fast path is the one in use."""
    assert tok.decode_stream([1, 2, 3], True) is not None
    d = IncrementalDetokenizer(tok, [1, 2, 3])
    assert d._stream is not None


@pytest.mark.parametrize("seed", range(6))
def test_stream_equals_old_path_on_random_sequences(tok, seed):
    rng = random.Random(seed)
    for case in range(150):
        ids = _random_ids(tok, rng, rng.randint(1, 40))
        prompt = _random_ids(tok, rng, rng.randint(0, 8))
        skip = rng.random() < 0.7
        text = tok.decode(ids, skip_special_tokens=skip)
        stop = None
        if rng.random() < 0.6 and text:
            stop = []
            for _ in range(rng.randint(1, 3)):  # substrings of the output (they will match) or not
                a = rng.randrange(len(text))
                stop.append(text[a:a + rng.randint(1, 4)] if rng.random() < 0.7 else "zq§" + str(a))
        include = rng.random() < 0.3
        check_from = rng.choice([0, 0, 3])
        kw = dict(stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip)
        want = _run(ReferenceDetokenizer(tok, prompt, **kw), ids, check_from)
        fast = IncrementalDetokenizer(tok, prompt, **kw)
        got_fast = _run(fast, ids, check_from)
        got_python = _run(IncrementalDetokenizer(tok, prompt, use_decode_stream=False, **kw), ids, check_from)
        detail = f"seed {seed} case {case}: prompt {prompt} ids {ids} {kw}"
        assert got_fast == want, detail
        assert got_python == want, detail


@pytest.mark.parametrize("skip", [True, False])
def test_stream_output_equals_full_decode(tok, skip):
    """Streamed deltas joined = one decode of all generated ids (clean prompt context)."""
    rng = random.Random(7 + skip)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(300):
        ids = _clean_ids(tok, rng) if rng.random() < 0.5 else _random_ids(tok, rng, rng.randint(1, 60))
        d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert d._stream is not None
        deltas = []
        for t in ids:
            d.add_token(t)
            deltas.append(d.take_delta())
        d.flush()
        deltas.append(d.take_delta())
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_multibyte_characters_split_byte_by_byte(tok):
    """Each byte of é / 日 / 😀 as its own byte-level token: nothing until the character is whole."""
    from pagedserve.engine.tokenizer import _bytes_to_unicode

    byte_token = {b: tok.token_to_id(c) for b, c in _bytes_to_unicode().items()}
    for ch in ["é", "日", "😀"]:
        ids = [byte_token[b] for b in ("a" + ch + "b").encode()]
        d = IncrementalDetokenizer(tok, tok.encode("x"))
        assert d._stream is not None
        out = []
        for t in ids:
            d.add_token(t)
            out.append(d.take_delta())
        n = len(ch.encode())
        assert out == ["a"] + [""] * (n - 1) + [ch, "b"]


def test_prompt_ending_mid_character_takes_the_python_path(tok):
    """DecodeStream would restart from an empty prefix and repeat the prompt's text; our
    window starts at the prompt's tail, so such a request decodes in Python, as before."""
    ids = tok.encode("café", add_special_tokens=False)
    partial = None
    for cut in range(1, len(ids)):
        if tok.decode(ids[:cut]).endswith("\ufffd"):
            partial = ids[:cut]
            break
    if partial is None:  # é is one token here: build the cut from byte tokens instead
        partial = [tok.token_to_id("Ã")]
    assert tok.decode(partial).endswith("\ufffd")
    d = IncrementalDetokenizer(tok, partial)
    assert d._stream is None
    gen = tok.encode(" ok", add_special_tokens=False)
    assert _run(d, gen, 0) == _run(ReferenceDetokenizer(tok, partial), gen, 0)


def test_invalid_prefix_error_falls_back_to_python(tok):
    """A DecodeStream that raises (tokenizers' "Invalid prefix encountered") does not fail the
    request: it continues on the Python path with the same output."""
    ids = tok.encode(" hello wörld and more", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [1, 2])
    real = d._stream
    calls = []

    def flaky(token_id):
        calls.append(token_id)
        if len(calls) == 3:
            raise Exception("Invalid prefix encountered while decoding stream")
        return real(token_id)

    d._stream = flaky
    got = _run(d, ids, 0)
    assert d._stream is None and len(calls) == 3
    assert got == _run(ReferenceDetokenizer(tok, [1, 2]), ids, 0)
