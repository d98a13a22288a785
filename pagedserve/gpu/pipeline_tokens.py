"""The sampled-tokens message: how stages before the last learn the tokens the last one sampled.

Only the last pipeline stage samples; the first needs each sequence's newest token as input
for its next step. The executor forwards the (seq id, token) pairs of every reply to the
workers on the step ring, ahead of the next step (gpu/pipeline.py explains why that is always
in time). No torch here: the executor's process encodes it.
"""
from __future__ import annotations

import msgspec

from pagedserve.contracts.messages import StepOutput

TAG_SAMPLED = ord("T")  # first byte of the message on the step ring


class SampledTokens(msgspec.Struct, array_like=True):
    """StepOutput's own buffers (int64 seq ids, int32 tokens), of one or more replies concatenated."""

    seq_ids_buf: bytes
    token_ids_buf: bytes


_DECODER = msgspec.msgpack.Decoder(SampledTokens)


def encode_sampled_tokens(seq_ids_buf: bytes, token_ids_buf: bytes) -> bytes:
    return bytes([TAG_SAMPLED]) + msgspec.msgpack.encode(SampledTokens(seq_ids_buf, token_ids_buf))


def decode_sampled_tokens(msg) -> tuple[list[int], list[int]]:
    st = _DECODER.decode(memoryview(msg)[1:])
    out = StepOutput(0, st.seq_ids_buf, st.token_ids_buf)
    return out.seq_ids.tolist(), out.token_ids.tolist()


class SampledTokenRelay:
    """The executor's side (mp ring and Ray calls alike): the sampled tokens of every reply
    collected, held until they go out ahead of the next step."""

    def __init__(self):
        self._parts: list[tuple[bytes, bytes]] = []

    def record(self, out: StepOutput) -> None:
        if out.seq_ids_buf:
            self._parts.append((out.seq_ids_buf, out.token_ids_buf))

    def take(self) -> bytes | None:
        """The message carrying every token recorded since the last take, or None."""
        if not self._parts:
            return None
        msg = encode_sampled_tokens(b"".join(s for s, _ in self._parts), b"".join(t for _, t in self._parts))
        self._parts.clear()
        return msg
