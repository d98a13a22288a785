"""--step-timeout values that cannot be a limit (review of issue 10). A negative timeout (or NaN)
was taken as is: the first steps ran on the startup timeout, then every step "timed out" at
once and the engine died (or, with --restart-workers, restarted until its policy gave up) with
"no reply to step N within -1 s". It is a configuration mistake: refuse it at start, naming the
flag, before any worker is spawned."""
from __future__ import annotations

import math

import pytest

from gpu.config import EngineConfig
from gpu.executor import ExecutorError

RUNNER = "tests.gpu.test_mp_executor:FakeRunner"


@pytest.mark.parametrize("bad", [-1.0, -0.001, math.nan])
def test_a_step_timeout_that_is_no_limit_is_refused_at_start(bad):
    from gpu.mp_executor import MultiprocExecutor

    config = EngineConfig.from_options(executor="mp", num_blocks=9, step_timeout_s=bad)
    with pytest.raises(ExecutorError, match=r"--step-timeout must be >= 0"):
        ex = MultiprocExecutor(config, runner_factory=RUNNER, startup_timeout=60)
        ex.shutdown()  # reached only when the value was accepted
