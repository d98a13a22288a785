"""The MoE block's decode step in one C call (kernels/moe_cpu.py, csrc/moe_cpu.c) computes what the
eager block (gpu/models/moe.py: torch routing, grouped experts, index_add_) computes: for 1 to 16
rows, renormalised or raw top-k, fp32 and packed (q4_1, q8_0) experts, every ISA build this CPU runs
(each forced in a fresh process), and ties in the router."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedserve.gpu.models.moe import SparseMoeBlock, quantize_experts
from pagedserve.kernels import isa, moe_cpu
from tests.needs import needs_library

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_c = needs_library(moe_cpu.library(), "moe_cpu", "the C MoE block is not built here")


def make_block(mode="fp32", renorm=True, experts=8, hidden=64, inter=64, top_k=3, seed=0) -> SparseMoeBlock:
    """A random block; ``mode`` fp32, or int4 (q4_1) / int8 (q8_0) packed experts."""
    block = SparseMoeBlock(hidden, inter, experts, top_k, renorm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g))
        block.experts.w13.copy_(torch.randn(block.experts.w13.shape, generator=g) * 0.2)
        block.experts.w2.copy_(torch.randn(block.experts.w2.shape, generator=g) * 0.2)
    if mode != "fp32":
        holder = nn.Module()
        holder.experts = block.experts
        quantize_experts(holder, mode)
    return block


def eager(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    weights, ids = block.route(x)
    return block.experts.forward(x, weights, ids)


@needs_c
@pytest.mark.parametrize("mode", ["fp32", "int4", "int8"])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_the_c_block_equals_the_eager_block(mode, renorm, m):
    block = make_block(mode, renorm, seed=m)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(100 + m))
    step = block.c_step()
    assert step is not None
    with torch.inference_mode():
        got_w, got_ids = step.route(x)
        want_w, want_ids = block.route(x)
        got, want, via_forward = step(x), eager(block, x), block(x)
    # the same experts in the same order, the same weights (no tie at the cut in these rows)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(via_forward, got)  # forward takes the C step for these rows


@needs_c
def test_packed_experts_give_the_eager_results_bit_for_bit_up_to_the_router():
    """With the routing fixed, an expert's rows go through the same kernel calls as in the eager
    block (the kernels' rows do not depend on the batch): the outputs differ only by the router's
    rounding (weights within an ulp or two)."""
    block = make_block("int4", True, seed=7)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        w, ids = block.c_step().route(x)
        want = block.experts.forward(x, w, ids)
        got = block.c_step()(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6 * want.abs().max().item())


@needs_c
@pytest.mark.parametrize("renorm", [True, False])
def test_ties_inside_the_top_k_change_nothing(renorm):
    """Experts 2 and 5 have the same router row and win every token: both are chosen either way."""
    block = make_block("fp32", renorm, top_k=3, seed=3)
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[2]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    x = x + 3 * block.gate.weight[2] / block.gate.weight[2].norm()  # experts 2 and 5 on top
    with torch.inference_mode():
        got_w, got_ids = block.c_step().route(x)
        want_w, want_ids = block.route(x)
        got, want = block.c_step()(x), eager(block, x)
    assert (got_ids[:, :2].sort(-1).values == torch.tensor([2, 5])).all()
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_c
def test_a_tie_at_the_cut_goes_to_the_lower_expert():
    """Every router row equal: all experts tie, the C step takes experts 0..k-1 (torch.topk's choice
    among equals is unspecified) with equal weights, and computes those experts' sum."""
    block = make_block("int4", False, experts=6, top_k=2, seed=5)
    with torch.no_grad():
        block.gate.weight.copy_(block.gate.weight[0].expand_as(block.gate.weight))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        w, ids = block.c_step().route(x)
        got = block.c_step()(x)
        want = block.experts.forward(x, torch.full((4, 2), 1 / 6), torch.tensor([[0, 1]] * 4))
    assert torch.equal(ids, torch.tensor([[0, 1]] * 4))
    torch.testing.assert_close(w, torch.full((4, 2), 1 / 6))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_c
def test_what_the_c_step_does_not_take_runs_eagerly():
    block = make_block("int4", True)
    with torch.inference_mode():
        big = torch.randn(moe_cpu.MAX_M + 1, 64)
        torch.testing.assert_close(block(big), eager(block, big))  # a prefill-sized batch
        assert block.c_step().supports(torch.randn(3, 64).bfloat16()) is False  # bf16 rows: eager
        assert block.c_step().supports(torch.randn(64, 3).t()) is False  # not contiguous
    bf16_router = make_block("fp32")
    bf16_router.gate.weight.data = bf16_router.gate.weight.data.bfloat16()
    assert bf16_router.c_step() is None


@needs_c
def test_replaced_weights_are_seen():
    """The step holds weight addresses: when a stack is replaced (packing after a first forward),
    the block builds a new one."""
    block = make_block("fp32")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        first = block.c_step()
        holder = nn.Module()
        holder.experts = block.experts
        quantize_experts(holder, "int4")
        assert block.c_step() is not first
        torch.testing.assert_close(block(x), eager(block, x), rtol=1e-5, atol=1e-5)


def test_fused_ops_off_turns_the_c_step_off():
    code = ("from pagedserve.kernels import moe_cpu\n"
            "assert moe_cpu.library() is None\n"
            "print('ok')\n")
    env = {**os.environ, "PAGEDSERVE_FUSED": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_every_build_is_right(tmp_path, level):
    """Each ISA build of the C step (and of the kernels it calls) in a fresh process, where the CPU has it."""
    if level not in isa.levels_here("moe_cpu"):
        pytest.skip(f"this CPU cannot run the {level} build")
    code = (
        "import torch\n"
        "from pagedserve.kernels import moe_cpu, qgemm\n"
        f"assert moe_cpu.isa() == {level!r}, moe_cpu.isa()\n"
        f"assert qgemm.isa() == {level!r}, qgemm.isa()\n"
        "from tests.gpu.test_moe_c import make_block, eager\n"
        "for mode in ('fp32', 'int4', 'int8'):\n"
        "    for renorm in (True, False):\n"
        "        for m in (1, 2, 5, 16):\n"
        "            block = make_block(mode, renorm, seed=m)\n"
        "            x = torch.randn(m, 64, generator=torch.Generator().manual_seed(100 + m))\n"
        "            with torch.inference_mode():\n"
        "                got, want = block.c_step()(x), eager(block, x)\n"
        "            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PAGEDSERVE_ISA": level, "PAGEDSERVE_KERNEL_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
