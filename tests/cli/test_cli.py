import subprocess
import sys

import meshd
from meshd.cli.main import main


def test_version_prints_package_and_protocol(capsys) -> None:
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    assert meshd.__version__ in out and "protocol" in out


def test_console_script_runs_as_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "meshd.cli.main", "version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("meshd ")
