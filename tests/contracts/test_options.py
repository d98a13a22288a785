"""One name and one default per engine option (issue 26 items 2 and 9): ``LLM(...)``, the CLI
flags and the config fields agree, each default is written on its config field, each check made
once in the config's ``__post_init__``, and an option's old name is refused naming the new one."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedserve.app.engine_args import add_engine_args, engine_config_from_args
from pagedserve.contracts.config import (OPTION_FIELDS, PARTS, RENAMED_OPTIONS, CacheConfig, ConfigError,
                              EngineConfig, ParallelConfig, SchedulerConfig, option_default, option_field)


def engine_parser(serve: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    if serve:
        from pagedserve.app.serve_cmd import add_arguments

        add_arguments(parser)
    else:
        add_engine_args(parser)
    return parser


def engine_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    out = []
    for action in parser._actions:
        try:
            option_field(action.dest)
        except ConfigError:
            continue
        out.append(action)
    return out


def test_no_flags_give_the_config_defaults():
    assert engine_config_from_args(engine_parser().parse_args([])) == EngineConfig()


@pytest.mark.parametrize("serve", [False, True])
def test_every_engine_flag_defaults_to_its_field(serve):
    parser = engine_parser(serve)
    actions = engine_actions(parser)
    assert len(actions) >= (32 if serve else 29)
    overridden = {"prompt_admit_tokens": 256} if serve else {}  # serve's own default, on purpose
    for action in actions:
        assert parser.get_default(action.dest) == overridden.get(action.dest, option_default(action.dest)), \
            action.option_strings


def test_every_flag_dest_is_the_option_name_llm_takes():
    """``--num-gpu-blocks-override N`` is ``LLM(num_gpu_blocks_override=N)``, and so on."""
    for action in engine_actions(engine_parser(serve=True)):
        long_names = [s[2:].replace("-", "_") for s in action.option_strings if s.startswith("--")]
        assert action.dest in long_names or long_names == ["no_prefix_caching"], action.option_strings


@pytest.mark.parametrize("old, new", sorted(RENAMED_OPTIONS.items()))
def test_old_option_names_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ConfigError, match=f"'{old}' is now '{new}'"):
        EngineConfig.from_options(**{old: 1})


def test_llm_refuses_an_old_name_before_loading_anything():
    from pagedserve.engine.llm import LLM

    with pytest.raises(ConfigError, match="num_gpu_blocks_override"):
        LLM(num_blocks=64)
    with pytest.raises(ConfigError, match="'swap_space'"):
        LLM(swap_space_gib=1.0)


def test_options_round_trip_through_the_flat_names():
    config = EngineConfig.from_options(num_gpu_blocks_override=9, swap_space=0.5, kv_cache_memory=0.25,
                                       kv_cache_dtype="fp8", scheduling_policy="priority", model_seed=3,
                                       step_timeout=7.0, distributed_executor_backend="ray")
    assert config.cache.num_gpu_blocks_override == 9 and config.cache.swap_space == 0.5
    assert config.cache.kv_cache_memory_gib == 0.25 and config.cache.cache_dtype == "fp8"
    assert config.scheduler.policy == "priority" and config.model.seed == 3
    assert config.parallel.step_timeout_s == 7.0 and config.parallel.executor == "ray"
    assert EngineConfig.from_options(**config.options()) == config


def test_option_names_map_onto_fields():
    fields = {f.name for part in PARTS for f in dataclasses.fields(part)}
    assert set(OPTION_FIELDS.values()) <= fields
    assert not set(RENAMED_OPTIONS.values()) - set(OPTION_FIELDS) - fields  # each new name is taken


@pytest.mark.parametrize("make, flag", [
    (lambda: SchedulerConfig(preemption_mode="discard"), "--preemption-mode"),
    (lambda: SchedulerConfig(policy="lifo"), "--scheduling-policy"),
    (lambda: SchedulerConfig(max_num_seqs=0), "--max-num-seqs"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "--max-num-batched-tokens"),
    (lambda: CacheConfig(swap_space=-1.0), "--swap-space"),
    (lambda: ParallelConfig(step_timeout_s=-1.0), "--step-timeout"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "--tensor-parallel-size"),
    (lambda: ParallelConfig(pipeline_parallel_size=0), "--pipeline-parallel-size"),
    (lambda: ParallelConfig(worker_threads=0), "--worker-threads"),
    (lambda: ParallelConfig(step_transport="carrier-pigeon"), "--step-transport"),
    (lambda: CacheConfig(swap_space=float("nan")), "--swap-space"),
])
def test_each_config_checks_its_values_when_built(make, flag):
    with pytest.raises(ConfigError, match=flag):
        make()


def test_a_bad_value_on_the_command_line_is_one_line_not_a_traceback(capsys):
    from pagedserve.app.serve_cmd import run

    args = engine_parser(serve=True).parse_args(["--max-num-seqs", "0", "--port", "0"])
    assert run(args) == 1
