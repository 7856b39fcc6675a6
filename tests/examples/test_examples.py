"""The examples a user copies still parse and mean what their prose says."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from meshd.config import load_config
from tests.node.daemons import REPO

EXAMPLES = REPO / "examples"


def test_lan_node_config_loads_with_the_secret_from_the_home_dir(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" in paths expands from the process's HOME
    secret = tmp_path / ".config" / "meshd" / "mesh.secret"
    secret.parent.mkdir(parents=True)
    secret.write_text("lan-mesh-secret-0123456789abcdef")
    secret.chmod(0o600)
    env = {"HOME": str(tmp_path)}
    config = load_config({}, env, str(EXAMPLES / "lan-node.toml"))
    assert config.read_mesh_secret() == "lan-mesh-secret-0123456789abcdef"
    assert config.listen_host == "192.168.1.20" and config.mdns.interfaces == ("192.168.1.20",)
    assert config.api.is_loopback and config.log_format == "json"
    assert str(config.control_socket_path()) == f"{tmp_path}/.local/state/meshd/control.sock"


def test_the_install_script_parses_and_writes_a_config_that_loads(tmp_path: pathlib.Path) -> None:
    script = EXAMPLES / "systemd_install.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    toml = re.search(r"meshd\.toml <<'EOF'\n(.*?)\nEOF\n", script.read_text(), re.DOTALL)
    assert toml is not None
    path = tmp_path / "meshd.toml"
    path.write_text(toml.group(1))
    # As the service sees it: systemd sets STATE_DIRECTORY, the env file the secret.
    env = {"STATE_DIRECTORY": "/var/lib/meshd", "MESHD_MESH_SECRET": "s" * 32}
    config = load_config({}, env, str(path))
    assert config.state_dir == "/var/lib/meshd"
    assert str(config.control_socket_path()) == "/var/lib/meshd/control.sock"
    assert config.read_mesh_secret() == "s" * 32 and config.api.is_loopback


def test_every_shell_example_parses() -> None:
    scripts = sorted(EXAMPLES.glob("*.sh"))
    # The README sends users to these two; a rename must not silently empty this test.
    assert {"curl.sh", "systemd_install.sh"} <= {s.name for s in scripts}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
