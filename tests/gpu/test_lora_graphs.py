"""Multi-LoRA decode steps under the decode graph runner (on CPU its padded static-buffer path runs
eagerly, so these cover what CUDA captures): a step with adapter rows takes the graph runner, the
step's slots travel in static buffers (mask [max_size, max_loras], rows int32 [max_size]) that keep
their addresses, padding rows and base-only steps read zeros / -1, and greedy tokens equal the eager
engine's row for row."""
from __future__ import annotations

import pytest
import torch

from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from tests.gpu.test_lora_peft import _count_fused_lora_steps
from tests.lora_fixtures import save_adapter, save_base

N_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=3)
PROMPTS = [[1, 520, 3311, 42, 9001, 77], [1, 4242, 4243, 300, 12000], [1, 88, 301, 12, 7, 9, 10]]
SIZES = [1, 2, 4, 8]  # 3 rows pad to 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-graphs")
    base = save_base(root / "base")
    adapters = [save_adapter(base, root / "a0", r=8, alpha=16, seed=1),
                save_adapter(base, root / "a1", r=4, alpha=8, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
                save_adapter(base, root / "a2", r=8, alpha=8, seed=3, targets=["o_proj", "up_proj"])]
    return root, [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]


def _llm(root, eager: bool, **options):
    from pagedserve.engine.llm import LLM

    return LLM(model=str(root / "base"), dtype="float32", kv_cache_dtype="float32", kv_cache_memory=1 / 16,
               enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=eager,
               cuda_graph_batch_sizes=SIZES, **options)


def _spy_runs(monkeypatch) -> list[int]:
    """Rows of every DecodeGraphRunner.run call."""
    from pagedserve.gpu.graphs import DecodeGraphRunner

    calls: list[int] = []
    real = DecodeGraphRunner.run

    def spy(self, input_ids, positions, meta, *a, **kw):
        calls.append(meta.num_requests)
        return real(self, input_ids, positions, meta, *a, **kw)

    monkeypatch.setattr(DecodeGraphRunner, "run", spy)
    return calls


def _gen(llm, loras):
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)]


def _same(got, want):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            for tok, entry in lw.items():
                assert abs(lg[tok].logprob - entry.logprob) < 1e-4


def test_an_adapter_decode_step_takes_the_graph_runner(models, monkeypatch):
    root, loras = models
    calls = _spy_runs(monkeypatch)
    llm = _llm(root, eager=False)
    try:
        assert llm.parts.executor.runner.graph_runner is not None
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[0])
    finally:
        llm.shutdown()
    assert calls.count(1) >= N_TOKENS - 1, calls


# fp32 weights: 3-row steps run the per-linear torch path (dense mask); int8 weights: the fused C
# stack (it reads the static rows buffer by address)
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_padded_mixed_adapter_steps_equal_eager_and_base_steps_after_them(models, monkeypatch, weights):
    """3 rows padded to 4: two adapters and a base row; one adapter on every row (a None mask);
    then base-only steps at the same size (the buffers were reset): tokens equal eager's."""
    root, loras = models
    options = {"quantization": "int8"} if weights == "int8" else {}
    mixes = [[loras[0], loras[1], None], [loras[0]] * 3, [None] * 3]
    results = {}
    for eager in (True, False):
        calls = _spy_runs(monkeypatch)
        fused = _count_fused_lora_steps(monkeypatch)
        llm = _llm(root, eager=eager, **options)
        try:
            results[eager] = [_gen(llm, mix) for mix in mixes]
        finally:
            llm.shutdown()
        assert (calls == []) if eager else calls.count(3) >= 3 * (N_TOKENS - 1), calls
        if weights == "int8":  # the C stack took the steps, padded (4 rows) under the graph runner
            assert (3 if eager else 4, True) in fused and (4, False) not in fused, fused
    for got, want in zip(results[False], results[True]):
        _same(got, want)
    assert results[True][0][0].token_ids != results[True][2][0].token_ids  # the adapters do move tokens


def test_static_buffers_and_slots_keep_their_storage(models):
    root, loras = models
    llm = _llm(root, eager=False)
    try:
        runner = llm.parts.executor.runner
        gr = runner.graph_runner
        holders = [h for hs in runner.lora.layers.values() for h in hs]
        ptrs = lambda: ([gr.lora.mask.data_ptr(), gr.lora.rows.data_ptr()]  # noqa: E731
                        + [t.data_ptr() for h in holders for t in (h.a, h.b)])
        before = ptrs()
        _gen(llm, [loras[0], loras[1], None])
        _gen(llm, [loras[2], loras[0], loras[2]])  # 3 adapters over 2 slots: a slot is reloaded
        assert ptrs() == before
        assert runner.lora.slots[0] is not None and runner.lora.slots[1] is not None
        _gen(llm, [None] * 3)  # base-only: static buffers hold zeros / -1
        assert not gr.lora.mask.any() and bool((gr.lora.rows == -1).all())
        assert ptrs() == before
    finally:
        llm.shutdown()


def test_static_lora_batch_fill():
    """Every form of a step's LoRABatch lands in the static buffers; padding rows read base."""
    from pagedserve.gpu.models.lora_layers import LoRABatch, StaticLoRABatch

    s = StaticLoRABatch(max_size=8, max_loras=3, dtype=torch.float32, device=torch.device("cpu"))
    mask_ptr, rows_ptr = s.mask.data_ptr(), s.rows.data_ptr()
    rows = torch.tensor([1, -1, 0], dtype=torch.int32)
    batch = s.fill(LoRABatch((rows.unsqueeze(1) == torch.arange(2)).float(), 2, rows), 3, 4)
    assert batch.k == 3 and batch.mask.shape == (4, 3) and batch.rows.shape == (4,)
    assert batch.mask.tolist() == [[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert batch.rows.tolist() == [1, -1, 0, -1]
    batch = s.fill(LoRABatch(None, 1, torch.zeros(3, dtype=torch.int32)), 3, 4)  # every row on slot 0
    assert batch.mask.tolist() == [[1, 0, 0]] * 3 + [[0, 0, 0]] and batch.rows.tolist() == [0, 0, 0, -1]
    batch = s.fill(LoRABatch(torch.tensor([[0., 0.], [0., 1.]]), 2), 2, 2)  # a mask without rows
    assert batch.rows.tolist() == [-1, 1] and batch.mask.tolist() == [[0, 0, 0], [0, 1, 0]]
    batch = s.fill(None, 2, 2)  # base-only step: the rows the step reads are reset
    assert not batch.mask.any() and batch.rows.tolist() == [-1] * 2 and batch.mask.shape == (2, 3)
    assert (s.mask.data_ptr(), s.rows.data_ptr()) == (mask_ptr, rows_ptr)


def test_set_slot_copies_in_place():
    from pagedserve.gpu.models.lora_layers import LoRALinear, Section

    h = LoRALinear.__new__(LoRALinear)
    h.sections, h.rank, h.row_parallel, h.in_local, h.out_local = [Section("q_proj", 0, 6, 0)], 4, False, 5, 6
    h.a, h.b = torch.zeros(2, 4, 5), torch.zeros(2, 4, 6)
    ptrs = (h.a.data_ptr(), h.b.data_ptr())
    h.set_slot(1, {"q_proj": (torch.ones(2, 5), torch.ones(6, 2))})
    assert (h.a.data_ptr(), h.b.data_ptr()) == ptrs and h.a[1, :2].eq(1).all() and h.b[1, :2].eq(1).all()
    h.set_slot(1, {})
    assert (h.a.data_ptr(), h.b.data_ptr()) == ptrs and not h.a.any()
