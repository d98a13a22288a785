"""build_engine: the tokenizer is built while the workers start (cold start pays for the slower
of the two, not their sum), and a failure of either leaves nothing running."""
from __future__ import annotations

import threading

import pytest

import pagedserve.engine.bootstrap

from pagedserve import engine
import pagedserve.gpu.executor_factory
from pagedserve import gpu
from pagedserve.contracts.errors import ExecutorError
from tests.engine.fakes import FakeExecutor, FakeTokenizer, make_config

WAIT_S = 10.0  # generous: only a sequential start (a bug) ever waits this long


def _config():
    config = make_config(block_size=16)
    config.model.model = engine.bootstrap.default_model_path()  # the path must exist; never loaded
    config.model.hf_config = {"max_position_embeddings": 256}
    return config


class _Executor(FakeExecutor):
    def __init__(self, config):
        super().__init__(config.cache.num_gpu_blocks_override, config.cache.block_size)
        self.shut = False

    def shutdown(self):
        self.shut = True


def test_tokenizer_loads_while_the_executor_starts(monkeypatch):
    executor_started = threading.Event()
    tokenizer_started = threading.Event()
    seen = {}

    def load_tokenizer(config):
        tokenizer_started.set()
        seen["executor running meanwhile"] = executor_started.wait(WAIT_S)
        return FakeTokenizer()

    def create_executor(config, cancel=None):
        executor_started.set()
        seen["tokenizer running meanwhile"] = tokenizer_started.wait(WAIT_S)
        return _Executor(config)

    monkeypatch.setattr(engine.bootstrap, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(gpu.executor_factory, "create_executor", create_executor)
    parts = engine.bootstrap.build_engine(_config())
    assert seen == {"executor running meanwhile": True, "tokenizer running meanwhile": True}
    assert isinstance(parts.tokenizer, FakeTokenizer) and not parts.executor.shut


def test_tokenizer_failure_shuts_the_started_executor_down(monkeypatch):
    made = []

    def load_tokenizer(config):
        raise engine.bootstrap.ConfigError("no tokenizer here")

    def create_executor(config, cancel=None):
        made.append(_Executor(config))
        return made[-1]

    monkeypatch.setattr(engine.bootstrap, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(gpu.executor_factory, "create_executor", create_executor)
    with pytest.raises(engine.bootstrap.ConfigError, match="no tokenizer here"):
        engine.bootstrap.build_engine(_config())
    assert len(made) == 1 and made[0].shut


def test_executor_failure_waits_for_the_tokenizer_and_raises(monkeypatch):
    done = threading.Event()

    def load_tokenizer(config):
        done.set()
        return FakeTokenizer()

    def create_executor(config, cancel=None):
        raise ExecutorError("worker 0 failed to start")

    monkeypatch.setattr(engine.bootstrap, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(gpu.executor_factory, "create_executor", create_executor)
    with pytest.raises(ExecutorError, match="failed to start"):
        engine.bootstrap.build_engine(_config())
    assert done.is_set()  # joined, not left running behind the error


def test_dummy_model_without_path_fails_before_any_worker_starts(monkeypatch):
    def create_executor(config, cancel=None):
        raise AssertionError("no worker may start without a tokenizer path")

    monkeypatch.setattr(gpu.executor_factory, "create_executor", create_executor)
    config = make_config(block_size=16)
    config.model.load_format = "dummy"
    config.model.hf_config = {"max_position_embeddings": 256}
    with pytest.raises(engine.bootstrap.ConfigError, match="no tokenizer"):
        engine.bootstrap.build_engine(config)
