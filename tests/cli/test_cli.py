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


def test_help_of_a_subcommand_lists_its_own_options(capsys) -> None:
    import pytest

    from meshd.cli.main import BENCHES

    for name in ("pipeline", "spec", "chaos"):
        assert name in BENCHES
        with pytest.raises(SystemExit) as done:
            main(["bench", name, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert f"meshd bench {name}" in out and "--quick" in out and "--json" in out
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    assert "pipeline" in capsys.readouterr().out
