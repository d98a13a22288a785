"""The step transport is chosen in one place: the shm ring only where stores are seen in order
(x86), the pipe channel elsewhere; PAGEDSERVE_STEP_TRANSPORT overrides (tests run the pipe on x86)."""
from __future__ import annotations

import platform

import pytest

from pagedserve.gpu.pipe_channel import PipeChannel
from pagedserve.gpu.shm_ring import RingUnsupported, ShmRing
from pagedserve.gpu.transport import ENV_TRANSPORT, TransportError, attach_channel, create_channel, pick_transport


@pytest.fixture
def aarch64(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(ENV_TRANSPORT, raising=False)


def test_ring_refuses_weakly_ordered_cpus_with_a_clear_message(aarch64):
    with pytest.raises(RingUnsupported) as e:
        ShmRing.create(1, 4, 64, role="writer")
    msg = str(e.value)
    assert "aarch64" in msg and "memory ordering" in msg and "pipe" in msg


def test_factory_picks_the_pipe_on_aarch64(aarch64):
    assert pick_transport() == "pipe"
    with create_channel(2, 4, 64, role="writer") as w:
        assert isinstance(w, PipeChannel)
        r = attach_channel(w.spec, 1)
        assert isinstance(r, PipeChannel)
        w.send(b"hello")
        assert r.recv(timeout=1) == b"hello"
        r.close()


def test_forcing_the_ring_on_aarch64_is_refused(aarch64, monkeypatch):
    monkeypatch.setenv(ENV_TRANSPORT, "shm")
    with pytest.raises(RingUnsupported, match="aarch64"):
        create_channel(1, 4, 64, role="writer")


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "i686"])
def test_factory_picks_the_ring_on_x86(monkeypatch, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.delenv(ENV_TRANSPORT, raising=False)
    assert pick_transport() == "shm"
    monkeypatch.setenv(ENV_TRANSPORT, "pipe")
    assert pick_transport() == "pipe"
    with create_channel(1, 4, 64, role="writer") as w:
        assert isinstance(w, PipeChannel)


def test_unknown_transport_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV_TRANSPORT, "carrier-pigeon")
    with pytest.raises(TransportError, match="PAGEDSERVE_STEP_TRANSPORT.*shm.*pipe"):
        pick_transport()


def test_the_config_choice_comes_before_the_environment(monkeypatch):
    """--step-transport (ParallelConfig.step_transport) is the user's choice; the variable is the
    default it overrides."""
    monkeypatch.setenv(ENV_TRANSPORT, "shm")
    assert pick_transport("pipe") == "pipe"
    with pytest.raises(TransportError, match="unknown transport"):
        pick_transport("carrier-pigeon")


def test_the_mp_executor_takes_its_transport_from_the_config(monkeypatch):
    from pagedserve.contracts.config import EngineConfig
    from pagedserve.gpu.mp_executor import MultiprocExecutor
    from pagedserve.gpu.pipe_channel import PipeChannel

    monkeypatch.delenv(ENV_TRANSPORT, raising=False)
    config = EngineConfig.from_options(executor="mp", num_gpu_blocks_override=9, step_transport="pipe")
    ex = MultiprocExecutor(config, runner_factory="tests.gpu.test_mp_executor:FakeRunner", startup_timeout=60)
    try:
        assert isinstance(ex._res.step_ring, PipeChannel) and isinstance(ex._res.reply_ring, PipeChannel)
    finally:
        ex.shutdown()
