"""The step's token bitmask (contracts/messages.py StepInput.token_mask*) applied to the logits: masked
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

from pagedserve.gpu.sampling_host import on_device, to_device


@dataclass(slots=True)
class TokenMask:
    rows: list[int]  # sampler rows the mask applies to, in order
    bits: bytes  # int32 words, [len(rows), ceil(vocab / 32)] row-major

    def apply(self, logits: Tensor) -> None:
        """Set logits of disallowed tokens of the masked rows to -inf, in place."""
        if not self.rows:
            return
        n, vocab = len(self.rows), logits.shape[1]
        # Inverted while packed (1/32 of the work), so the logits see one masked_fill pass.
        banned = unpack_bitmask(self.bits, n, vocab, logits.device, invert=True)
        if n == logits.shape[0] and self.rows == list(range(n)):
            logits.masked_fill_(banned, float("-inf"))
            return
        idx = on_device(logits, self.rows)
        logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


def unpack_bitmask(bits: bytes, rows: int, vocab: int, device: torch.device,
                   invert: bool = False) -> Tensor:
    """Bool [rows, vocab]: True = allowed (``invert``: True = banned). Tokens past the mask's
    width are not allowed."""
    words = len(bits) // 4 // rows if rows else 0
    width = words * 32
    if device.type == "cpu":
        packed = np.frombuffer(bits, dtype=np.uint8).reshape(rows, words * 4)
        if invert:
            packed = ~packed
        flags = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")).view(torch.bool)
    else:
        w = to_device(torch.frombuffer(bytearray(bits), dtype=torch.int32).view(rows, words), device)
        if invert:
            w = ~w
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        flags = ((w.unsqueeze(-1) >> shifts) & 1).view(rows, width).bool()
    if width >= vocab:
        return flags[:, :vocab]
    pad = torch.full((rows, vocab - width), invert, dtype=torch.bool, device=flags.device)
    return torch.cat([flags, pad], dim=1)
