"""--step-timeout values that cannot be a limit (review of issue 10). A negative timeout (or NaN)
was taken as is: the first steps ran on the startup timeout, then every step "timed out" at
once and the engine died (or, with --restart-workers, restarted until its policy gave up) with
"no reply to step N within -1 s". It is a configuration mistake: refuse it at start, naming the
flag, before any worker is spawned."""
from __future__ import annotations

import math

import pytest

from pagedserve.contracts.config import ConfigError, EngineConfig


@pytest.mark.parametrize("bad", [-1.0, -0.001, math.nan])
def test_a_step_timeout_that_is_no_limit_is_refused_at_start(bad):
    """ParallelConfig refuses it when built, so no executor (mp or ray) ever sees it."""
    with pytest.raises(ConfigError, match=r"--step-timeout must be >= 0"):
        EngineConfig.from_options(executor="mp", num_gpu_blocks_override=9, step_timeout=bad)


def test_the_default_step_timeout_has_one_owner():
    """pagedserve.contracts.config owns the default; the CLI flag and a Namespace without it take that value
    (three copies of 300.0 could drift apart)."""
    import argparse

    from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
    from pagedserve.contracts.config import DEFAULT_STEP_TIMEOUT_S, ParallelConfig

    assert ParallelConfig().step_timeout_s == DEFAULT_STEP_TIMEOUT_S
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([])
    assert args.step_timeout == DEFAULT_STEP_TIMEOUT_S
    assert engine_config_from_args(args).parallel.step_timeout_s == DEFAULT_STEP_TIMEOUT_S
    del args.step_timeout  # a command that does not offer the flag
    assert engine_config_from_args(args).parallel.step_timeout_s == DEFAULT_STEP_TIMEOUT_S
