"""The bytes each token stands for. Decoding one token alone gives U+FFFD when it is part of a
character (a byte-level BPE piece such as "âĢ", a byte-fallback piece such as ``<0xE2>``);
logprobs' ``bytes`` must carry the token's real bytes so a client can join them back into
the exact text. Pure Python, no torch."""
from __future__ import annotations

import re
from collections.abc import Callable

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


def token_bytes_fn(backend, byte_to_char: dict[int, str], decode_one: Callable[[int], str]) -> Callable[[int], bytes]:
    """``token_id -> bytes`` for a ``tokenizers.Tokenizer``. Byte-level decoders (GPT-2 family)
    map each character of a piece back through the byte table; others (SentencePiece style) read
    ``<0xNN>`` pieces as that byte and the rest as text, with the word marker as a space.
    Added tokens are their decoded text."""
    decoder = backend.decoder
    byte_level = type(decoder).__name__ == "ByteLevel" if decoder is not None else False
    char_to_byte = {c: b for b, c in byte_to_char.items()}
    added = set(backend.get_added_tokens_decoder())

    def token_bytes(token_id: int) -> bytes:
        piece = backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in added:
            return decode_one(token_id).encode("utf-8")
        m = _BYTE_PIECE.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        if byte_level:
            try:
                return bytes(char_to_byte[c] for c in piece)
            except KeyError:
                return decode_one(token_id).encode("utf-8")
        return piece.replace(_METASPACE, " ").encode("utf-8")

    return token_bytes
