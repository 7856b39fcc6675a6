"""systemd/meshd.service: systemd accepts it, it asks for what the daemon does, and the
daemon speaks the notify protocol the unit relies on (READY, WATCHDOG, STOPPING)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from meshd.config import NodeConfig
from tests.node.daemons import REPO, SECRET, loopback

UNIT = REPO / "systemd" / "meshd.service"
needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


def unit_settings() -> dict[str, list[str]]:
    """key -> values, in order (systemd allows a key more than once)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: pathlib.Path) -> None:
    unit = tmp_path / "meshd.service"
    shutil.copy(UNIT, unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    # Unknown or misspelt keys are only warnings on stderr: any mention of our unit fails.
    assert result.returncode == 0, result.stderr
    assert "meshd.service" not in result.stderr, result.stderr


@needs_systemd_analyze
def test_hardening_keeps_the_exposure_score_low(tmp_path: pathlib.Path) -> None:
    unit = tmp_path / "meshd.service"
    shutil.copy(UNIT, unit)
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for meshd\.service: ([0-9.]+)", result.stdout)
    if result.returncode != 0 and found is None:
        pytest.skip(f"this systemd-analyze has no offline security check: {result.stderr[:200]}")
    assert found is not None, result.stdout[-2000:]
    assert float(found.group(1)) <= 3.0, result.stdout  # "OK" is below 4.0


def test_unit_runs_the_daemon_as_a_hardened_notify_service() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"] and s["Restart"] == ["on-failure"]
    assert s["ExecStart"] == ["/usr/bin/env meshd serve --config /etc/meshd/meshd.toml"]
    assert s["EnvironmentFile"] == ["-/etc/meshd/env"]
    assert s["StateDirectory"] == ["meshd"] and s["DynamicUser"] == ["yes"]
    assert int(s["WatchdogSec"][0].removesuffix("s")) >= 10
    families = set(s["RestrictAddressFamilies"][0].split())
    assert families == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "RestrictSUIDSGID"):
        assert s[key] == ["yes"], key
    assert s["ProtectSystem"] == ["strict"]


def test_stop_timeout_leaves_room_for_the_graceful_stop() -> None:
    # systemd SIGKILLs a unit that outlasts TimeoutStopSec: the grace, then ending requests
    # and handing the stage over (a few seconds), must fit.
    stop_s = int(unit_settings()["TimeoutStopSec"][0].removesuffix("s"))
    assert stop_s >= NodeConfig(state_dir="/var/lib/meshd").graceful_timeout_s + 10


def _datagrams(server: socket.socket, until: float, stop: str = "") -> list[str]:
    """What arrives before `until` (or up to the first message starting with `stop`)."""
    got: list[str] = []
    while time.monotonic() < until:
        server.settimeout(max(until - time.monotonic(), 0.01))
        try:
            got.append(server.recv(4096).decode())
        except TimeoutError:
            break
        if stop and got[-1].startswith(stop):
            break
    return got


def test_daemon_notifies_ready_pings_the_watchdog_and_stops_on_sigterm() -> None:
    # A short path: Unix socket paths are limited to ~108 bytes.
    with tempfile.TemporaryDirectory(prefix="meshd-notify-") as tmp:
        path = os.path.join(tmp, "notify.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        server.bind(path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        env |= {"MESHD_MESH_SECRET": SECRET, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
        host = loopback(41)
        args = [
            sys.executable, "-m", "meshd.cli.main", "serve", "--state-dir", f"{tmp}/state",
            "--listen-host", host, "--listen-port", "0", "--mdns-interfaces",
            host, "--api-host", host, "--api-port", "0", "--log-format", "json",
        ]  # fmt: skip
        log_path = os.path.join(tmp, "stderr.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                    stderr=log)  # fmt: skip
        try:
            got = _datagrams(server, time.monotonic() + 60, stop="READY=1")
            assert got and got[-1].startswith("READY=1"), got
            ready = got[-1]
            assert "STATUS=node " in ready and f"serving on http://{host}:" in ready
            # Pings every WATCHDOG_USEC/2 = 0.2 s, before READY and after it.
            assert "WATCHDOG=1" in got[: got.index(ready)]
            after = _datagrams(server, time.monotonic() + 1.0)
            assert after.count("WATCHDOG=1") >= 3, after
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert "STOPPING=1" in _datagrams(server, time.monotonic() + 0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            server.close()
        lines = [json.loads(line) for line in pathlib.Path(log_path).read_text().splitlines()]
        assert lines and all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
        assert any(line["msg"] == "SIGTERM: stopping" for line in lines)
