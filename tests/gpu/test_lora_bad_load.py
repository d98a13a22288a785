"""A bad adapter breaks only itself (issue 37, finding 5). An adapter passes the engine's check,
then its weights file is truncated before a worker loads it (a swap after the check): only that
adapter's requests fail (a 400-kind error, code ``adapter_load_failed``); the other adapter's and
the base model's requests in the same step get exactly their tokens; the slot is emptied on both
sides, so the adapter's next request reloads it instead of running whatever that slot held; the
workers stay up (in-process, and at tp = 2 where a raising rank used to tear the group down)."""
from __future__ import annotations

import pytest

from pagedserve.engine.lora_request import LoRARequest
from pagedserve.engine.sampling_params import SamplingParams
from tests.lora_fixtures import write_adapter_files
from tests.tiny import TINY_CONFIG, tiny_llm

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [1, 520, 3311, 42, 9001, 77, 1204, 5, 88, 301, 12, 4000, 17, 2, 999, 31, 8, 650, 44]
WEIGHTS = "adapter_model.safetensors"


def _adapter(path, seed):
    import numpy as np

    path = write_adapter_files(path, hf_config=TINY_CONFIG, r=2, modules=("q_proj", "v_proj", "down_proj"))
    # write_adapter_files draws from one seed: make the two adapters differ
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / WEIGHTS))
    rng = np.random.default_rng(seed)
    save_file({k: (v * 0 + rng.standard_normal(v.shape)).astype(np.float32) for k, v in tensors.items()},
              str(path / WEIGHTS))
    return path


def _tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_truncated_adapter_fails_only_its_requests_and_frees_its_slot(tmp_path, tp):
    a_dir, b_dir = _adapter(tmp_path / "a", 1), _adapter(tmp_path / "b", 2)
    good_b = (b_dir / WEIGHTS).read_bytes()
    a, b = LoRARequest("a", 1, str(a_dir)), LoRARequest("b", 2, str(b_dir))
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=4)  # prefix caching on: no block of the
    # failed rows (computed without B's weights) may be found by B's next request
    if tp > 1:
        options.update(tensor_parallel_size=tp, executor="mp")
    llm = tiny_llm(**options)
    try:
        ref = dict(zip(("a", "b", "base"), _tokens(llm.generate([PROMPT] * 3, GREEDY, use_tqdm=False,
                                                                 lora_request=[a, b, None]))))
        assert len({tuple(t) for t in ref.values()}) == 3  # the adapters change the tokens
        # B again under a new id (the workers hold id 2's weights in memory): read from disk
        llm.core.forget_lora(2)

        execute = llm.parts.executor.execute

        def swap_then_execute(step):  # the file changes after the engine's check, before the workers read it
            if any(load.lora_id == 3 for load in step.lora_loads or ()):
                (b_dir / WEIGHTS).write_bytes(good_b[:-64])
            return execute(step)

        llm.parts.executor.execute = swap_then_execute
        b2 = LoRARequest("b", 3, str(b_dir))
        outs = llm.generate([PROMPT] * 3, GREEDY, use_tqdm=False, lora_request=[a, b2, None])
        llm.parts.executor.execute = execute
        got_a, got_b, got_base = outs
        assert got_b.outputs[0].finish_reason == "error" and got_b.error_from_request
        assert got_b.error_code == "adapter_load_failed" and "'b'" in got_b.error
        assert list(got_a.outputs[0].token_ids) == ref["a"]
        assert list(got_base.outputs[0].token_ids) == ref["base"]
        assert (3, str(b_dir)) not in llm.core.lora_slots._slots  # the engine's slot is free again

        (b_dir / WEIGHTS).write_bytes(good_b)  # the file is whole again: B reloads, A unharmed
        hits = llm.core.stats().prefix_cache_hits
        assert _tokens(llm.generate([PROMPT] * 3, GREEDY, use_tqdm=False, lora_request=[b2, a, None])) == [
            ref["b"], ref["a"], ref["base"]]
        # A and the base model hit their own cached first blocks; B (id 3) had none to find
        assert llm.core.stats().prefix_cache_hits - hits == 2 * 16
    finally:
        llm.shutdown()


def test_an_adapter_path_with_newlines_cannot_forge_worker_log_lines(tmp_path, caplog):
    """Issue 37, finding 8: the worker logs the path it loads, escaped."""
    import logging

    path = _adapter(tmp_path / "x\n2025-01-01 00:00:00 ERROR gpu.worker: forged", 1)
    llm = tiny_llm(enable_lora=True, max_loras=1, max_lora_rank=4)
    caplog.set_level(logging.INFO)
    try:
        out = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(path)))
        assert out[0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
    loaded = [r.getMessage() for r in caplog.records if "loaded LoRA adapter" in r.getMessage()]
    assert loaded and all("\n" not in m for m in loaded), loaded
