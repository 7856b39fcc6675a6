"""Real `meshd serve` daemons as child processes on loopback, for the multi-process tests.

Each daemon binds its own loopback address (127.0.0.N) for lanes and mDNS, keeps its state
(identity, control socket) under the test's tmp dir, and is killed by the caller's finally.
"""

from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from typing import Any

from meshd.node.control_client import ControlError, StatusOp, call

REPO = pathlib.Path(__file__).resolve().parents[2]
SECRET = "meshd-test-secret-0123456789abcdef"
OTHER_SECRET = "another-mesh-secret-0123456789abcd"


class Daemon:
    """One `meshd serve` process."""

    def __init__(
        self,
        tmp: pathlib.Path,
        index: int,
        *,
        secret: str,
        budget: int,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.index = index
        self.host = f"127.0.0.{index}"
        self.state = tmp / f"n{index}"
        self.socket = str(self.state / "control.sock")
        self.log_path = tmp / f"n{index}.log"
        self.address = ""
        self._key = ""
        self.api_url = ""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        env["MESHD_MESH_SECRET"] = secret
        args = [
            sys.executable, "-m", "meshd.cli.main", "serve",
            "--state-dir", str(self.state),
            "--listen-host", self.host, "--listen-port", "0",  # a later --listen-port wins
            "--mdns-interfaces", self.host,
            "--api-host", self.host, "--api-port", "0",
            "--memory-budget-bytes", str(budget),
            "--device", "cpu", "--dtype", "float32",
            "--lane-dead-after-s", "1.2",
            *extra,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log
            )

    def wait_listening(self, timeout_s: float) -> float:
        """Block until the daemon says it listens; returns when (time.monotonic)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline().decode()
                if "listening on" in line:
                    self.address = line.rsplit(" ", 1)[1].strip()
                    self.api_url = line.split(" api ", 1)[1].split(" ", 1)[0]
                    return time.monotonic()
                if not line:
                    break
        raise AssertionError(f"daemon {self.index} did not start:\n{self.log()}")

    def status(self) -> dict[str, Any]:
        """The daemon's status over its control socket."""
        return call(self.socket, StatusOp(), timeout_s=10)["status"]

    def try_status(self) -> dict[str, Any] | None:
        """The status, or None while the socket does not answer."""
        try:
            return self.status()
        except (OSError, ControlError):
            return None

    @property
    def key(self) -> str:
        """The daemon's node key (hex; asked once, so it is known after the daemon dies)."""
        if not self._key:
            self._key = str(self.status()["key"])
        return self._key

    def log(self) -> str:
        """What the daemon logged (for failure messages)."""
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process (SIGKILL by default, as a crash would) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_for(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `predicate()` until true; returns the seconds it took (AssertionError on timeout)."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
