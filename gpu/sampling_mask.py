"""The step's token bitmask (gpu/messages.py StepInput.token_mask*) applied to the logits: masked
tokens get -inf before logprobs, bias, penalties, temperature and the draw (as vLLM applies its
grammar bitmask before the sampler), so no sampling mode can pick one.

Bits travel packed (1 bit per token, only constrained rows); they are unpacked here: with numpy
on the host for CPU logits (one C loop), with shifts on the device for CUDA logits (the packed
bytes are what crosses to the device).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class TokenMask:
    rows: list[int]  # sampler rows the mask applies to, in order
    bits: bytes  # int32 words, [len(rows), ceil(vocab / 32)] row-major

    def apply(self, logits: Tensor) -> None:
        """Set logits of disallowed tokens of the masked rows to -inf, in place."""
        if not self.rows:
            return
        n, vocab = len(self.rows), logits.shape[1]
        allowed = unpack_bitmask(self.bits, n, vocab, logits.device)
        if n == logits.shape[0] and self.rows == list(range(n)):
            logits.masked_fill_(~allowed, float("-inf"))
            return
        idx = torch.tensor(self.rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bits: bytes, rows: int, vocab: int, device: torch.device) -> Tensor:
    """Bool [rows, vocab] (True = allowed). Tokens past the mask's width are disallowed."""
    words = len(bits) // 4 // rows if rows else 0
    width = words * 32
    if device.type == "cpu":
        packed = np.frombuffer(bits, dtype=np.uint8).reshape(rows, words * 4)
        unpacked = np.unpackbits(packed, axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked).view(torch.bool)
    else:
        w = torch.frombuffer(bytearray(bits), dtype=torch.int32).view(rows, words).to(device)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((w.unsqueeze(-1) >> shifts) & 1).view(rows, width).bool()
    if width >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(rows, vocab - width, dtype=torch.bool, device=allowed.device)
    return torch.cat([allowed, pad], dim=1)
