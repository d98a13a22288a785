"""`bench serve --plot` checks that it can draw before the run starts (issue 40 item 4): without
matplotlib, or into a folder that does not exist, it says so and exits 2 having sent nothing,
instead of losing the whole run to an ImportError at its end."""
from __future__ import annotations

import sys

import pytest

from pagedserve.app.cli import main as cli_main
from pagedserve.loadtest.bench_run import PlotUnavailable, run_benchmark
from tests.loadtest.mock_server import MockServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.delitem(sys.modules, "pagedserve.loadtest.plot", raising=False)


def test_without_matplotlib_the_cli_refuses_before_sending(no_matplotlib, tmp_path, capsys):
    with MockServer(mode="ok") as srv:
        rc = cli_main(["bench", "serve", "--base-url", srv.base_url, "--num-prompts", "4", "--disable-tqdm",
                       "--random-input-len", "8", "--random-output-len", "4", "--plot", str(tmp_path / "p.png")])
        sent = len(srv.state.usage)
    err = capsys.readouterr().err
    assert rc == 2 and sent == 0, err
    assert "--plot needs matplotlib" in err and "pagedserve[bench]" in err
    assert not (tmp_path / "p.png").exists()


def test_run_benchmark_checks_first_too(no_matplotlib, tmp_path):
    with pytest.raises(PlotUnavailable, match="matplotlib"):
        run_benchmark(dict(base_url="http://127.0.0.1:9", num_prompts=1, plot=str(tmp_path / "p.png")))


def test_a_plot_into_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    rc = cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
                   "--plot", str(tmp_path / "nowhere" / "p.png")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
