"""`pagedserve --version` prints what GET /version answers, without loading any subcommand."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.app.cli import main
from pagedserve.app.info_routes import server_version


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main([flag])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedserve {server_version()}"


def test_version_is_quick_and_imports_no_server():
    code = ("import sys; from pagedserve.app.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "assert 'starlette' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("pagedserve ")
