"""The multi-process executor over the pipe transport (what runs on aarch64) gives the outputs of
inproc, and a killed worker still fails the engine with a clear error instead of a hang."""
from __future__ import annotations

import os
import signal

import pytest

from pagedserve.contracts.errors import ExecutorError
from pagedserve.gpu.pipe_channel import PipeChannel
from pagedserve.gpu.transport import ENV_TRANSPORT
from tests.gpu.test_mp_equivalence import GREEDY, UNTIED, prompts, seeded_params, shutdown_clean, token_ids
from tests.tiny import tiny_llm


@pytest.fixture
def pipe_mp(monkeypatch):
    monkeypatch.setenv(ENV_TRANSPORT, "pipe")
    llm = tiny_llm(hf_config=UNTIED, executor="mp")
    res = llm.parts.executor._res
    assert isinstance(res.step_ring, PipeChannel) and isinstance(res.reply_ring, PipeChannel)
    yield llm
    shutdown_clean(llm)


def test_mp_over_pipes_equals_inproc(pipe_mp):
    inproc = tiny_llm(hf_config=UNTIED, executor="inproc")
    try:
        ref = token_ids(inproc.generate(prompts(), GREEDY, use_tqdm=False))
        ref_seeded = inproc.generate(prompts(4, seed=3), seeded_params(), use_tqdm=False)
    finally:
        inproc.shutdown()
    assert token_ids(pipe_mp.generate(prompts(), GREEDY, use_tqdm=False)) == ref
    got = pipe_mp.generate(prompts(4, seed=3), seeded_params(), use_tqdm=False)
    for ra, rb in zip(ref_seeded, got):
        assert [c.token_ids for c in ra.outputs] == [c.token_ids for c in rb.outputs]


def test_killed_worker_over_pipes_is_a_clear_error(pipe_mp):
    pipe_mp.generate(prompts(2), GREEDY, use_tqdm=False)
    os.kill(pipe_mp.parts.executor.worker_pids[0], signal.SIGKILL)
    with pytest.raises(ExecutorError, match="killed by SIGKILL"):
        pipe_mp.generate(prompts(2), GREEDY, use_tqdm=False)
