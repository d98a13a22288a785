"""An AsyncEngine whose core runs over tests/engine/fakes.FakeExecutor: the real event-loop
engine (queues, merging, death handling) in milliseconds, without a model."""
from __future__ import annotations

import pytest

from tests.engine.fakes import FakeExecutor, FakeTokenizer, make_config


def patch_build_engine(monkeypatch) -> list:
    """Make AsyncEngine.start build its parts over FakeExecutor; returns the list of parts
    built (the test reaches the executor through it)."""
    import pagedserve.engine.bootstrap
    from pagedserve import engine
    from pagedserve.engine.bootstrap import EngineParts
    from pagedserve.engine.core import EngineCore

    built: list = []

    def build_engine(config):
        tok = FakeTokenizer()
        executor = FakeExecutor(config.cache.num_gpu_blocks_override, config.cache.block_size)
        parts = EngineParts(config, {}, tok, executor, EngineCore(config, executor, tok))
        built.append(parts)
        return parts

    monkeypatch.setattr(engine.bootstrap, "build_engine", build_engine)
    return built


async def started_engine(**config_kw):
    from pagedserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_config(**{"num_blocks": 128, **config_kw}))
    await engine.start()
    return engine


@pytest.fixture
async def fake_engine(monkeypatch):
    """A started AsyncEngine over the fake executor and tokenizer, shut down after the test."""
    patch_build_engine(monkeypatch)
    eng = await started_engine()
    yield eng
    await eng.shutdown()
