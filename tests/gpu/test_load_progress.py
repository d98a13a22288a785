"""A progress bar while weights load (issue 40 item 4): drawn on a terminal for a large checkpoint,
advanced per tensor, and never written when stderr is not a terminal (a log file, a pipe) or the
checkpoint is small."""
from __future__ import annotations

import io
import sys

import pytest
import torch

from pagedserve.contracts.config import ModelConfig
from pagedserve.gpu.models import load_progress
from pagedserve.gpu.models.load_progress import LoadProgress
from pagedserve.gpu.models.loader import load_model
from tests.gpu.test_models import ARCHS, save_hf_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_only_for_large_loads(monkeypatch):
    monkeypatch.setattr(load_progress, "MIN_BYTES", 1000)
    tty, log = Terminal(), io.StringIO()
    for stream in (tty, log):
        with LoadProgress(4000, file=stream) as p:
            for _ in range(3):
                p.update(1000)
    assert "Loading weights" in tty.getvalue() and "100%" in tty.getvalue()
    assert log.getvalue() == ""  # not a terminal: nothing
    small = Terminal()
    with LoadProgress(999, file=small) as p:
        p.update(999)
    assert small.getvalue() == "" and not p.shown


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model(ARCHS["llama"], path)
    return path


@pytest.mark.parametrize("terminal", [True, False])
def test_safetensors_load_draws_the_bar_on_a_terminal(llama_dir, monkeypatch, terminal):
    monkeypatch.setattr(load_progress, "MIN_BYTES", 0)
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    load_model(ModelConfig(model=str(llama_dir)), "cpu", torch.float32)
    out = stream.getvalue()
    if terminal:
        assert "Loading weights" in out and "100%" in out, out
    else:
        assert "Loading weights" not in out


def test_gguf_load_draws_the_bar_on_a_terminal(default_model_path, monkeypatch):
    monkeypatch.setattr(load_progress, "MIN_BYTES", 0)
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    load_model(ModelConfig(model=default_model_path), "cpu", torch.float32)  # quantization auto: packed
    out = stream.getvalue()
    assert "Loading weights" in out and "100%" in out, out[-500:]
