"""--scheduling-policy / --preemption-mode / --swap-space reach the engine config, and values
that cannot work are refused with a message naming the flag before any worker starts."""
from __future__ import annotations

import argparse

import pytest

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.engine.bootstrap import resolve_config
from pagedserve.contracts.config import ConfigError, default_model_path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_defaults_keep_recompute_and_a_4_gib_pool():
    config = engine_config_from_args(parse([]))
    assert config.scheduler.preemption_mode == "recompute" and config.cache.swap_space == 4.0


def test_flags_reach_the_config():
    config = engine_config_from_args(parse(["--scheduling-policy", "priority", "--preemption-mode", "swap",
                                            "--swap-space", "0.5"]))
    assert config.scheduler.policy == "priority"
    assert config.scheduler.preemption_mode == "swap" and config.cache.swap_space == 0.5


def test_unknown_mode_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parse(["--preemption-mode", "discard"])


@pytest.mark.parametrize("options, flag", [({"preemption_mode": "discard"}, "--preemption-mode"),
                                           ({"swap_space": -1.0}, "--swap-space"),
                                           ({"swap_space": float("nan")}, "--swap-space")])
def test_bad_values_are_config_errors(options, flag):
    from pagedserve.contracts.config import EngineConfig

    with pytest.raises(ConfigError, match=flag):  # SchedulerConfig / CacheConfig refuse it when built
        resolve_config(EngineConfig.from_options(model=default_model_path(),
                                                 hf_config={"max_position_embeddings": 256}, **options))
