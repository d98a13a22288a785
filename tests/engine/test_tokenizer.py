"""Our tokenizer (rebuilt from the GGUF metadata, or from a tokenizer.json directory) against
transformers' tokenizer for the same model: ids, BOS handling, decoding and chat templates."""
from __future__ import annotations

import os
import sys

import pytest

TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "Numbers: 12345, 3.14159, -42, 1e10, 2024-01-01 and x1y22z333",
    "héllo wörld — naïve café, Ωmega ∑ 日本語のテキスト 🙂🚀 👩‍👩‍👧",
    "def f(x):\n    return x ** 2 + 1  # comment\n\nclass A:\n    pass\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't won't I'm you're we've they'll she'd",
    "",
    " ",
    "a" * 50 + " " + "ab" * 20,
    "{\"key\": [1, 2, 3], 'x': None}",
    "x²+y³=z½;٣٤४Ⅻ",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本."}],
]


@pytest.fixture(scope="module")
def gguf_parts(default_model_path):
    return os.path.split(default_model_path)


@pytest.fixture(scope="module")
def reference(gguf_parts):
    from transformers import AutoTokenizer

    d, f = gguf_parts
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="module")
def ours(default_model_path):
    from pagedserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_model(default_model_path)


def test_no_torch_import():
    import subprocess

    code = ("import sys; from pagedserve.engine.tokenizer import Tokenizer; from pagedserve.contracts.hf_config import load_hf_config;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, reference, add_special_tokens):
    for text in TEXTS:
        want = reference.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == want, text


def test_non_ascii_numerals_split_like_llama_cpp(ours, reference):
    """The one known divergence from transformers: its GGUF converter has no entry for the
    'smollm' pre-tokenizer and falls back to GPT-2's split, which glues a space to a numeral
    (" ²" -> "Ġ²"). llama.cpp (and SmolLM2's own tokenizer.json, Digits(individual_digits)) put
    every \\p{N} character in its own piece, which is what we do. ASCII digits never differ."""
    text = "area ² and ½"
    pieces = ours.convert_ids_to_tokens(ours.encode(text))
    assert "Ġ" in pieces and "Â²" in pieces  # the space and the numeral are separate
    assert reference.convert_ids_to_tokens(reference.encode(text)) != pieces
    assert ours.decode(ours.encode(text)) == text
    for text in (" 2024", "v1.2.3 and 10,000", "x=10**9 y = 007"):
        assert ours.encode(text) == reference.encode(text), text


def test_special_tokens_and_decode(ours, reference):
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.eos_token_ids == [reference.eos_token_id] == [2]
    assert ours.vocab_size == len(reference) == 49152
    assert set(reference.all_special_ids) <= ours.all_special_ids
    # Control tokens stay whole and are not split into pieces.
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert ours.encode(" Paris.") == [7042, 30]
    ids = ours.encode(TEXTS[5] + TEXTS[6])
    assert ours.decode(ids) == reference.decode(ids) == TEXTS[5] + TEXTS[6]
    mixed = [1] + ids[:5] + [2, 0]
    for skip in (True, False):
        assert ours.decode(mixed, skip_special_tokens=skip) == reference.decode(mixed, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids[:10]) == reference.convert_ids_to_tokens(ids[:10])


def test_chat_template_matches_transformers(ours, reference):
    for chat in CHATS:
        for gen in (True, False):
            want = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == want
    # The GGUF's template adds SmolLM's default system prompt when the chat has none.
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(CHATS[0])
    partial = CHATS[0] + [{"role": "assistant", "content": "The capital is"}]
    want = reference.apply_chat_template(partial, tokenize=False, add_generation_prompt=False,
                                         continue_final_message=True)
    got = ours.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith("The capital is")


def test_directory_tokenizer_matches(reference, tmp_path):
    from pagedserve.engine.tokenizer import Tokenizer

    reference.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    ref_dir = AutoTokenizer.from_pretrained(tmp_path)
    ours_dir = Tokenizer.from_model(str(tmp_path))
    for text in TEXTS:
        assert ours_dir.encode(text) == ref_dir.encode(text), text
    assert ours_dir.eos_token_ids[0] == ref_dir.eos_token_id
    chat = CHATS[2]
    assert ours_dir.apply_chat_template(chat) == ref_dir.apply_chat_template(chat, tokenize=False,
                                                                             add_generation_prompt=True)


def test_bos_added_when_file_says_so(default_model_path):
    """A GGUF with add_bos_token=True prepends BOS only when special tokens are requested."""
    from pagedserve.engine.tokenizer import Tokenizer, _Specials

    tok = Tokenizer.from_model(default_model_path)
    Tokenizer._set_post_processor(tok._tok, _Specials(bos_token="<|im_start|>"), True, False)
    assert tok.encode("Hi there")[0] == 1
    assert tok.encode("Hi there", add_special_tokens=False)[0] != 1


def test_errors(tmp_path):
    from pagedserve.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

    with pytest.raises(TokenizerError, match="no such"):
        Tokenizer.from_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_model(str(tmp_path))
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="not a GGUF"):
        Tokenizer.from_model(str(bad))
    import tokenizers
    from pagedserve.engine.tokenizer import _Specials

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok = Tokenizer(backend, _Specials(), "{{ raise_exception('no system role') }}", "mem")
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(backend, _Specials(), None, "mem").apply_chat_template([])
