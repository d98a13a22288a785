"""Shared fixtures. The real default model is loaded once per session where a test asks for it.

The suite runs on the CPU unless ``--device cuda`` is given: ``--device cpu`` (the default) hides
every GPU from this session and the servers and workers it starts (CUDA_VISIBLE_DEVICES="" before
CUDA is first used), so device="auto" means the CPU and no test takes 90 % of a GPU's memory on a
GPU machine. Tests marked ``gpu`` run only with ``--device cuda``."""
from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=("cpu", "cuda"), default="cpu",
                     help="cpu (default): hide the GPUs, skip tests marked gpu; cuda: keep the GPUs "
                          "and run the gpu tests too")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("device") == "cpu":
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
            raise pytest.UsageError("CUDA was initialized before the suite could hide the GPUs")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA starts: after this, in every child too
        return
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"--device cuda, but torch {torch.__version__} sees no CUDA device (a CPU "
                                "build of torch, a driver older than its CUDA, or CUDA_VISIBLE_DEVICES)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: it must see the isa marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.isa_tests import ISA_TESTS

    isa_files = {config.rootpath / f for f in ISA_TESTS}
    for item in items:
        if item.path in isa_files:
            item.add_marker(pytest.mark.isa)
    if config.getoption("device") == "cuda":
        return
    skip = pytest.mark.skip(reason="a GPU test: run with --device cuda")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds "gpu" for tests/gpu/
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_device(pytestconfig: pytest.Config) -> str:
    """The device the suite runs on: "cpu" or "cuda" (--device)."""
    return pytestconfig.getoption("device")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from pagedserve.contracts.config import default_model_path

    return default_model_path()
