"""A mixture-of-experts block's decode step in one C call (csrc/moe_cpu.c), through ctypes.

Why: at batch 1 the eager block (gpu/models/moe.py) spent more time in the ~25 torch ops around its
kernel calls (routing, sort, gather, SiLU, scatter) than in the kernels (loadtest/PERF.md, "Where a
token goes"). ``MoeStep`` resolves once what the call needs (every expert's weight addresses and
the address of the kernel that reads each, as kernels/abi.py LinearSpecs), so a step is one ctypes
call: the linears run in the existing kernels (fused_cpu.c's fp32 GEMV, qgemm's q8_0 / q4_1 ones),
and routing, SiLU and the weighted sum run in C between them.

Optional like every fused op: off without a C compiler, with ``PAGEDSERVE_FUSED=0``, or where
fused_cpu (whose fp32 GEMV it calls) is off; then ``library()`` is None and the eager block runs.
It takes fp32 activations of 1 to ``MAX_M`` rows, an fp32 router, fp32 or q8_0 / q4_1 experts;
``MoeStep.build`` returns None for anything else.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess

import torch

from pagedserve.contracts import env
from pagedserve.kernels import abi, cbuild, fused
from pagedserve.kernels import isa as isa_table

logger = logging.getLogger(__name__)

MAX_M = 16  # csrc/moe_cpu.c MOE_MAX_M: decode batches; prefill runs the eager block
_BAD_ARGS, _NO_MEMORY = -1, -2
_ISA = {0: "scalar", 2: "avx2", 3: "avx512"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled step, or None (PAGEDSERVE_FUSED=0, no compiler, a failed build, fused_cpu off)."""
    choice = isa_table.choose("moe_cpu")
    if not env.FUSED.get() or choice is None or fused.library() is None:
        return None
    try:
        lib = cbuild.build_kernel("moe_cpu", choice)
    except cbuild.CompilerMissing as e:
        logger.info("C MoE step off: %s", e)
        return None
    except (OSError, cbuild.KernelBuildError, subprocess.SubprocessError) as e:
        logger.warning("C MoE step off: building %s failed: %s", isa_table.KERNELS["moe_cpu"].source, e)
        return None
    lib = abi.bind(lib, "moe_cpu")
    assert lib.moe_max_m() == MAX_M
    return lib


def isa() -> str | None:
    """'avx512', 'avx2' or 'scalar': the build that runs (None: off)."""
    lib = library()
    return None if lib is None else _ISA.get(lib.moe_isa(), "scalar")


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def plain_spec(w: torch.Tensor) -> abi.LinearSpec | None:
    """A contiguous fp32 [N, K] weight, read by fused_cpu.c's fz_gemv_f32 (1 to 16 rows)."""
    if w.dtype is not torch.float32 or w.device.type != "cpu" or w.dim() != 2 or not w.is_contiguous():
        return None
    return abi.LinearSpec(0, 0, w.data_ptr(), None, None, _address(fused.library().fz_gemv_f32), None)


def packed_spec(linear) -> abi.LinearSpec | None:
    """A kernels.qgemm.PackedLinear (q8_0 / q4_1, either layout) read by its own small-batch kernel."""
    entry = linear.fused_entry()
    if entry is None:
        return None
    tensors, small, _amx, most_rows = entry  # (AMX takes bf16 rows only: never these fp32 ones)
    if most_rows < MAX_M:
        return None
    q4 = linear.mode == "q4_1"
    return abi.LinearSpec(2 if q4 else 1, 0, tensors[0].data_ptr(), tensors[1].data_ptr(),
                          tensors[2].data_ptr() if q4 else None, small, None)


class MoeStep:
    """One block's routing and experts, resolved for ``library().moe_decode``. It holds the weight
    tensors (``keep``) so the addresses stay valid; the block rebuilds it when a weight is replaced."""

    __slots__ = ("hidden", "inter", "num_experts", "top_k", "renorm", "_router", "_w13", "_w2", "_keep", "_fn")

    def __init__(self, router: abi.LinearSpec, w13: list, w2: list, hidden: int, inter: int, top_k: int,
                 renorm: bool, keep: tuple):
        n = len(w13)
        self.hidden, self.inter, self.num_experts, self.top_k, self.renorm = hidden, inter, n, top_k, renorm
        self._router = router
        self._w13, self._w2 = (abi.LinearSpec * n)(*w13), (abi.LinearSpec * n)(*w2)
        self._keep, self._fn = keep, library().moe_decode

    @classmethod
    def build(cls, router_weight: torch.Tensor, experts: list, hidden: int, inter: int, top_k: int,
              renorm: bool) -> "MoeStep | None":
        """``experts``: per expert (gate/up [2I, H], down [H, I]), each an fp32 tensor or a PackedLinear.
        None where the library is off or any weight is of a kind the step does not take."""
        if library() is None:
            return None
        router = plain_spec(router_weight)
        specs = [(plain_spec(a) if isinstance(a, torch.Tensor) else packed_spec(a),
                  plain_spec(b) if isinstance(b, torch.Tensor) else packed_spec(b)) for a, b in experts]
        if router is None or any(s is None for pair in specs for s in pair):
            return None
        return cls(router, [a for a, _ in specs], [b for _, b in specs], hidden, inter, top_k, renorm,
                   (router_weight, experts))

    def supports(self, x: torch.Tensor) -> bool:
        return (x.dtype is torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.device.type == "cpu"
                and x.shape[1] == self.hidden and x.is_contiguous())

    def _run(self, x: torch.Tensor, route: bool):
        m = x.shape[0]
        out = torch.empty_like(x)
        w = torch.empty((m, self.top_k), dtype=torch.float32) if route else None
        ids = torch.empty((m, self.top_k), dtype=torch.int64) if route else None
        rc = self._fn(x.data_ptr(), m, self.hidden, ctypes.byref(self._router), self.num_experts, self.top_k,
                      int(self.renorm), self._w13, self._w2, self.inter, out.data_ptr(),
                      None if w is None else w.data_ptr(), None if ids is None else ids.data_ptr(),
                      torch.get_num_threads())
        if rc == _BAD_ARGS:
            raise ValueError(f"the C MoE step takes 1 to {MAX_M} rows and top_k <= experts")
        if rc:
            raise MemoryError("the C MoE step found no memory for its scratch")
        return out, w, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for ``x`` [M, H] (``supports(x)``); this rank's partial sum under TP."""
        return self._run(x, False)[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [M, k] fp32, expert ids [M, k]) as the step routes ``x`` (tests)."""
        _, w, ids = self._run(x, True)
        return w, ids
