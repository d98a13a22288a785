"""Tokenizer and chat template, from a GGUF file's embedded vocabulary or a model directory.

No torch import (the engine loop tokenizes). A GGUF carries the vocabulary, merges, token types,
special ids and the chat template as llama.cpp metadata; we rebuild a ``tokenizers.Tokenizer``
from them with the pre-tokenizer the file's ``tokenizer.ggml.pre`` names. A directory brings its
own ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens, chat template).

Chat templates are rendered with jinja2 configured the way transformers configures it
(sandboxed, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII), so prompts match transformers exactly.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

logger = logging.getLogger(__name__)


def _decode_stream_with_prefill() -> bool:
    """tokenizers >= 0.22: ``decoders.DecodeStream(ids=..., skip_special_tokens=...)``."""
    try:
        decoders.DecodeStream(ids=[], skip_special_tokens=True)
    except (AttributeError, TypeError):
        return False
    return True


_HAS_DECODE_STREAM = _decode_stream_with_prefill()


class TokenizerError(ValueError):
    """The model's tokenizer cannot be built; the message says which file and why."""


class ChatTemplateError(ValueError):
    """The chat template is missing or refused the conversation (e.g. raise_exception)."""


# Split patterns of the byte-level BPE families, by the GGUF's tokenizer.ggml.pre name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo's "tekken" and Phi-4's "gpt-4o" (llama.cpp's llama-vocab.cpp, the same text as
# transformers' GGUF conversion: tests/engine/test_gguf_bpe_pre.py holds them to it).
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "falcon-h1": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT, "llama4": _GPT4O_SPLIT,
}
# Pre-tokenizers that put every digit in its own piece before GPT-2's byte-level split.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact"}
# llama.cpp's own split for "default" (and a file without tokenizer.ggml.pre): these rules one after the
# other, each keeping what it does not match as pieces too (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEFAULT).
# Not GPT-2's: punctuation runs come apart from the space before them, digits go in threes.
_LLAMA_CPP_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# Names for which llama.cpp's loader adds BOS unless the file's tokenizer.ggml.add_bos_token says not,
# and takes a pre-token that is itself a vocabulary entry whole, before any merge (its ignore_merges,
# as Llama 3's tokenizer.json says).
_LLAMA_CPP_BOS_AND_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "tekken"}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@functools.cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_bytes_to_unicode().values())


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _render_env(bounded: bool = False):
    """The model's template renders in Jinja's immutable sandbox; a request's own (``bounded``)
    in engine/template_sandbox.py's, which also bounds what it may build."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    if bounded:
        from pagedserve.engine.template_sandbox import BoundedSandbox

        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    else:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    if bounded:
        env.prepare()
    return env


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    return _render_env().from_string(source)


@functools.lru_cache(maxsize=8)
def _compile_request_template(source: str):
    return _render_env(bounded=True).from_string(source)


def template_variables(source: str) -> set[str]:
    """The variables a chat template reads without setting them (``tools``, ``documents``...).
    Parsed in the bounded sandbox: Jinja folds constant expressions while it analyses a template,
    and in a plain environment ``{{ 7**30000000 }}`` was computed right there (issue 37).
    TemplateSyntaxError when it does not parse."""
    from jinja2 import meta

    return meta.find_undeclared_variables(_render_env(bounded=True).parse(source))


# What a request's own template may raise besides TemplateError: its fault, a 400 (the sandbox's
# "range too big" is an OverflowError, a template recursing for ever a RecursionError, ...).
_TEMPLATE_FAULTS = (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError,
                    MemoryError)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(slots=True)
class _Specials:
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    extra_eos_ids: list[int] = field(default_factory=list)


class Tokenizer:
    """Encode/decode plus chat template rendering, matching transformers for the same model."""

    def __init__(self, backend: HFTokenizer, specials: _Specials, chat_template: str | None, source: str):
        self._tok = backend
        self.source = source
        self.chat_template = chat_template
        self.bos_token = specials.bos_token
        self.eos_token = specials.eos_token
        self.unk_token = specials.unk_token
        self.pad_token = specials.pad_token
        self.bos_token_id = self._id(specials.bos_token)
        self.eos_token_id = self._id(specials.eos_token)
        self.pad_token_id = self._id(specials.pad_token)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos + specials.extra_eos_ids))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        named = {self._id(t) for t in (self.bos_token, self.eos_token, self.unk_token, self.pad_token)}
        self.all_special_ids: set[int] = special | (named - {None}) | set(self.eos_token_ids)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_model(cls, path: str | None = None) -> "Tokenizer":
        """From a .gguf file or a directory with tokenizer.json; None = the default model."""
        if path is None:
            from pagedserve.contracts.config import default_model_path

            path = default_model_path()
        if os.path.isdir(path):
            return cls._from_directory(path)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic == b"GGUF":
                return cls._from_gguf(path)
            raise TokenizerError(f"{path}: not a GGUF file nor a model directory")
        raise TokenizerError(f"{path}: no such model file or directory")

    @classmethod
    def _from_gguf(cls, path: str) -> "Tokenizer":
        from pagedserve.contracts.errors import ModelLoadError
        from pagedserve.contracts.gguf_file import read_gguf

        try:
            reader = read_gguf(path)
        except ModelLoadError as e:
            raise TokenizerError(str(e)) from None

        def get(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model_type = get("tokenizer.ggml.model")
        if model_type in ("llama", "t5"):
            return cls._from_gguf_spm(path, model_type, get)
        if model_type != "gpt2":
            raise TokenizerError(f"{path}: GGUF tokenizer type {model_type!r} is not supported (byte-level BPE "
                                 "'gpt2', SentencePiece 'llama' and 't5'); load the model from a directory "
                                 "with tokenizer.json instead")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        merges: list[str] = get("tokenizer.ggml.merges") or []
        types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        alphabet = _byte_alphabet()
        to_unicode = _bytes_to_unicode()

        def spell(tok: str) -> str:  # a few files store raw text instead of the byte alphabet
            return tok if set(tok) <= alphabet else "".join(to_unicode[b] for b in tok.encode("utf-8"))

        vocab = {spell(t): i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        pre = get("tokenizer.ggml.pre")
        if pre is None:
            logger.warning("%s: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer, as llama.cpp "
                           "does (it warns that generation quality will be degraded)", path)
            pre = "default"
        backend = HFTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False,
                                  ignore_merges=pre in _LLAMA_CPP_BOS_AND_IGNORE_MERGES))
        if pre not in _SPLITS and pre not in _DIGIT_SPLIT and pre not in ("default", "gpt-2", "gpt2"):
            known = sorted(set(_SPLITS) | _DIGIT_SPLIT | {"default", "gpt-2"})
            raise TokenizerError(f"{path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known to pagedserve "
                                 f"(known: {', '.join(known)}); its split rule is not guessed: load the model "
                                 f"from a directory with tokenizer.json instead")
        # tokenizer.ggml.add_space_prefix is not read: llama.cpp's byte-level BPE never prefixes a space.
        if pre in _SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in _DIGIT_SPLIT:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre == "default":
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(rule), behavior="isolated") for rule in _LLAMA_CPP_DEFAULT_SPLITS]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in ("gpt-2", "gpt2"):
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        # Control tokens are special (kept whole, skipped when decoding); user-defined are kept whole.
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in zip(tokens, types)
                                    if ty == _TOKEN_TYPE_CONTROL and set(t) <= alphabet])
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens(user)

        specials = _gguf_specials(tokens, get)
        add_bos = get("tokenizer.ggml.add_bos_token", pre in _LLAMA_CPP_BOS_AND_IGNORE_MERGES)
        cls._set_post_processor(backend, specials, bool(add_bos), bool(get("tokenizer.ggml.add_eos_token", False)))
        return cls(backend, specials, get("tokenizer.chat_template"), path)

    @classmethod
    def _from_gguf_spm(cls, path: str, model_type: str, get) -> "Tokenizer":
        """A SentencePiece vocabulary (engine/gguf_spm.py). Where the file is silent, llama.cpp's defaults:
        "llama" adds BOS and the space prefix, "t5" (its UGM) EOS and no space prefix."""
        from pagedserve.engine.gguf_spm import SpmError, build_spm

        tokens: list[str] = get("tokenizer.ggml.tokens")
        try:
            backend = build_spm(path, model_type, tokens, get("tokenizer.ggml.scores"), get("tokenizer.ggml.token_type"),
                                get("tokenizer.ggml.unknown_token_id"),
                                bool(get("tokenizer.ggml.add_space_prefix", model_type == "llama")),
                                bool(get("tokenizer.ggml.remove_extra_whitespaces", False)),
                                get("tokenizer.ggml.precompiled_charsmap"))
        except SpmError as e:
            raise TokenizerError(str(e)) from None

        specials = _gguf_specials(tokens, get)
        cls._set_post_processor(backend, specials, bool(get("tokenizer.ggml.add_bos_token", model_type == "llama")),
                                bool(get("tokenizer.ggml.add_eos_token", model_type == "t5")))
        return cls(backend, specials, get("tokenizer.chat_template"), path)

    @staticmethod
    def _set_post_processor(backend: HFTokenizer, specials: _Specials, add_bos: bool, add_eos: bool) -> None:
        single, used = ["$A"], []
        if add_bos and specials.bos_token is not None:
            single.insert(0, specials.bos_token)
            used.append(specials.bos_token)
        if add_eos and specials.eos_token is not None:
            single.append(specials.eos_token)
            used.append(specials.eos_token)
        pair = single + [s if s != "$A" else "$B:1" for s in single]
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair,
            special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(used)])

    @classmethod
    def _from_directory(cls, path: str) -> "Tokenizer":
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"{path}: no tokenizer.json in the model directory")
        try:
            backend = HFTokenizer.from_file(tj)
        except Exception as e:
            raise TokenizerError(f"{tj}: cannot load: {e}") from None
        cfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}

        def token(key):
            v = cfg.get(key)
            return v.get("content") if isinstance(v, dict) else v

        specials = _Specials(bos_token=token("bos_token"), eos_token=token("eos_token"),
                             unk_token=token("unk_token"), pad_token=token("pad_token"))
        gen = _read_json(os.path.join(path, "generation_config.json")) or {}
        model_cfg = _read_json(os.path.join(path, "config.json")) or {}
        for source in (gen, model_cfg):
            eos = source.get("eos_token_id")
            specials.extra_eos_ids += [eos] if isinstance(eos, int) else list(eos or [])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, specials, template, path)

    # ---- API --------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True):
        """``step(token_id) -> str | None``: tokenizers' incremental decoder (Rust) primed with
        ``context_ids``, for engine/detokenizer.py. None where it cannot reproduce our
        incremental decoding: a tokenizers without ``DecodeStream(ids=...)`` (before 0.22), or a
        context whose text ends mid-character (DecodeStream would then start from an empty
        prefix and repeat the context's text)."""
        if not _HAS_DECODE_STREAM:
            return None
        if context_ids and self.decode(context_ids, skip_special_tokens).endswith("\ufffd"):
            return None
        stream = decoders.DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._tok)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, also when it is part of a character
        (engine/token_bytes.py): what logprobs' ``bytes`` carry."""
        fn = self.__dict__.get("_token_bytes")
        if fn is None:
            from pagedserve.engine.token_bytes import token_bytes_fn

            fn = self._token_bytes = token_bytes_fn(
                self._tok, _bytes_to_unicode(), lambda i: self.decode([i], skip_special_tokens=False))
        return fn(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of an input text one token can stand for, or None where the
        tokenizer may drop characters (then no such bound exists). A text longer than
        ``max_model_len x max_token_chars`` cannot fit the context: the server refuses it before
        encoding it (encoding holds the interpreter, ~0.75 s per MiB). Computed once (start-up).

        The longest vocabulary entry in characters bounds what one token covers: a byte-level
        token's string has one character per byte (a byte is never more than a character), a
        Metaspace or WordPiece token spells its text (plus markers). That holds as long as every
        character of the input reaches some token: a pre-tokenizer that drops text (Whitespace,
        BERT's, a Split that removes), a normalizer that may delete text (Strip, BERT's, a
        precompiled map, a shrinking Replace) or unknown characters fused into one token leave no
        bound. NFC/NFKC compose at most 4 characters into one (a canonical decomposition is at
        most 4 long), so they multiply the bound by 4."""
        factor = _text_shrink_factor(self._tok)
        if factor is None:
            logger.info("%s: the tokenizer may drop characters; text prompts get no length bound "
                        "before tokenizing", self.source)
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        longest = max((len(t) for t in vocab), default=1)
        return max(1, longest) * factor

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            **kwargs) -> str:
        """The prompt text for ``messages`` (no tokenization), as transformers renders it.
        ``kwargs`` (e.g. tools) are passed to the template; ``chat_template`` replaces the
        model's (a request's own template, rendered in a sandbox that also bounds what it may
        build: engine/template_sandbox.py)."""
        import jinja2

        template = chat_template or self.chat_template
        if not template:
            raise ChatTemplateError(f"{self.source}: the model has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        final = None
        if continue_final_message:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message needs a final message with text content")
            final = chat[-1]["content"]
            chat[-1] = dict(chat[-1], content=final + _CONTINUE_TAG)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                     "pad_token": self.pad_token}
        variables = {k: v for k, v in variables.items() if v is not None}
        variables.update(kwargs)
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        try:
            if chat_template is None:
                rendered = _compile_template(template).render(
                    messages=chat, add_generation_prompt=add_generation_prompt, **variables)
            else:
                from pagedserve.engine.template_sandbox import render_budget

                with render_budget():
                    rendered = _compile_request_template(template).render(
                        messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        except _TEMPLATE_FAULTS as e:
            if chat_template is None:
                raise
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in rendered or tag not in rendered:
                raise ChatTemplateError("the chat template dropped part of the final message to continue")
            loc = rendered.rindex(tag)
            # The template may have trimmed the space of our tag (and the message's trailing space).
            rendered = rendered[:loc] if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
                else rendered[:loc].rstrip()
        return rendered


# Normalizers that never shorten a text; NFC/NFKC shorten it at most 4 times.
_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
# Pre-tokenizers that keep every character in some piece.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts", "Split", "Punctuation",
                           "FixedLength"}


def _text_shrink_factor(backend: HFTokenizer) -> int | None:
    """How many input characters at most become one character the model sees (normalizers), or
    None when the tokenizer may drop input text (see Tokenizer.max_token_chars)."""
    def state(component) -> dict | None:
        if component is None:
            return None
        return json.loads(component.__getstate__())

    def normalizer_factor(node: dict | None) -> int | None:
        if node is None:
            return 1
        kind = node.get("type")
        if kind == "Sequence":
            factor = 1
            for child in node.get("normalizers", []):
                f = normalizer_factor(child)
                if f is None:
                    return None
                factor *= f
            return factor
        if kind in _KEEPING_NORMALIZERS:
            return 1
        if kind in _COMPOSING_NORMALIZERS:
            return 4
        if kind == "Replace":
            pattern = node.get("pattern", {})
            if "String" in pattern and pattern["String"] and len(node.get("content", "")) >= len(pattern["String"]):
                return 1
        return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex Replace...: may delete

    def keeps_text(node: dict | None) -> bool:
        if node is None:
            return True
        kind = node.get("type")
        if kind == "Sequence":
            return all(keeps_text(child) for child in node.get("pretokenizers", []))
        if kind not in _KEEPING_PRE_TOKENIZERS:
            return False  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit...
        return str(node.get("behavior", "Isolated")).lower() != "removed"

    try:
        factor = normalizer_factor(state(backend.normalizer))
        if factor is None or not keeps_text(state(backend.pre_tokenizer)):
            return None
        model = backend.model
        if type(model).__name__ != "BPE":
            return None  # WordPiece / WordLevel / Unigram: one unknown token may stand for a long run
        if model.unk_token is not None and model.fuse_unk and not model.byte_fallback:
            return None  # a run of unknown characters becomes one token
        if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
            return None  # an added token that swallows the whitespace beside it (any amount)
    except Exception:  # noqa: BLE001 - a component we cannot read: no bound rather than a wrong one
        logger.debug("cannot inspect the tokenizer's pipeline", exc_info=True)
        return None
    return factor


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from None


def _gguf_specials(tokens: list[str], get) -> "_Specials":
    """BOS / EOS / UNK / PAD by the GGUF file's ids, EOT and EOM as extra EOS ids (every vocabulary type)."""
    def tok_of(key):
        i = get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    specials = _Specials(bos_token=tok_of("tokenizer.ggml.bos_token_id"),
                         eos_token=tok_of("tokenizer.ggml.eos_token_id"),
                         unk_token=tok_of("tokenizer.ggml.unknown_token_id"),
                         pad_token=tok_of("tokenizer.ggml.padding_token_id"))
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if get(key) is not None:
            specials.extra_eos_ids.append(int(get(key)))
    return specials
