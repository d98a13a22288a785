"""A GGUF's SentencePiece vocabulary as a ``tokenizers.Tokenizer``, tokenizing as llama.cpp does.

``tokenizer.ggml.model = "llama"`` (Llama 2, Mistral 7B, Gemma, Phi-3, TinyLlama, ...): llama.cpp's SPM
tokenizer repeatedly joins the adjacent pair whose joined piece is a normal token of the highest
score (SentencePiece BPE's encoding), falling back to ``<0xNN>`` byte tokens. That is a BPE whose
merge ranks are the joined pieces' scores, built here from the file's tokens and scores the way
transformers' GGUF conversion derives merges (``tokenization_utils_base.generate_merges``), without
importing transformers. ``add_space_prefix`` prepends "▁" to each text run (llama.cpp does so at the
start and after every special token), spaces become "▁".

``tokenizer.ggml.model = "t5"`` (a Unigram SentencePiece; llama.cpp's UGM): Viterbi over the scores,
``tokenizers``' Unigram (one difference left: the literal text of a byte piece, "<0x41>", holding a
character the vocabulary lacks, comes out as that byte piece). Only files without a precompiled normalization map are built; one with a
map is refused by name (none of the tests' references covers it).

Why not transformers' GGUF conversion (a test-only dependency here anyway): measured on the
tests' vocabularies and corpus, its "llama" tokenizer differs from sentencepiece on 74 of 260
strings (runs of spaces, leading spaces) and its "t5" one on 250 of 260.

Checked against the ``sentencepiece`` package on vocabularies the tests train (tests/engine/test_gguf_spm.py).
"""
from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, normalizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE, Unigram

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class SpmError(ValueError):
    pass


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split (left, right) of a normal piece into
    two normal pieces, ranked by the joined piece's score (highest first), then by the pieces' ids."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == NORMAL}
    found = []
    for piece, i in normal.items():
        score = scores[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = normal.get(left), normal.get(right)
            if li is not None and ri is not None:
                found.append((-score, li, ri, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _normalizer(add_space_prefix: bool, remove_extra_whitespaces: bool = False):
    steps = []
    if remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if add_space_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _decoder(add_space_prefix: bool):
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


def build_spm(path: str, model_type: str, tokens: list[str], scores: list[float] | None, types: list[int] | None,
              unk_id: int | None, add_space_prefix: bool, remove_extra_whitespaces: bool,
              precompiled_charsmap) -> HFTokenizer:
    """The tokenizer (model, normalizer, decoder, control and user-defined tokens) of a "llama" or
    "t5" GGUF vocabulary."""
    n = len(tokens)
    types = list(types) if types is not None else [NORMAL] * n
    scores = list(scores) if scores is not None else [0.0] * n
    if len(types) != n or len(scores) != n:
        raise SpmError(f"{path}: tokenizer.ggml.scores / token_type do not have one entry per token ({n})")
    if precompiled_charsmap is not None and len(precompiled_charsmap):
        raise SpmError(f"{path}: a SentencePiece vocabulary with a precompiled normalization map "
                       f"(tokenizer.ggml.precompiled_charsmap) is not supported")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
    has_bytes = any(ty == BYTE for ty in types)
    if model_type == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            raise SpmError(f"{path}: the SentencePiece vocabulary repeats a token")
        model = BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                    byte_fallback=has_bytes, dropout=None)
    else:  # "t5": Unigram
        if unk_id is None:
            raise SpmError(f"{path}: a Unigram vocabulary needs tokenizer.ggml.unknown_token_id")
        # Pieces SentencePiece keeps out of the lattice (control, unused, byte) cannot be left out of
        # tokenizers' Unigram, so they score far below every normal piece: the text "<0x41>" is then
        # spelled by its characters, as SentencePiece does, whenever the vocabulary knows them. Not
        # -inf: tokenizers scores an unknown character from the lowest score.
        floor = min((s for s, ty in zip(scores, types) if ty == NORMAL), default=0.0) - 1e4
        pieces = [(t, s if ty in (NORMAL, USER_DEFINED, UNKNOWN) else floor) for t, s, ty in zip(tokens, scores, types)]
        model = Unigram(pieces, unk_id=unk_id, byte_fallback=has_bytes)
    backend = HFTokenizer(model)
    backend.normalizer = _normalizer(add_space_prefix, remove_extra_whitespaces)
    backend.pre_tokenizer = None
    backend.decoder = _decoder(add_space_prefix)
    # Control tokens are special (matched whole, skipped when decoding); user-defined ones are
    # matched whole in the text (SentencePiece and llama.cpp both do) and decoded as text.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return backend
