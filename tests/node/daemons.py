"""Real `meshd serve` daemons as child processes on loopback, for the multi-process tests.

The process handling is the demo's (`meshd.cli.demo_daemons`); a test daemon is numbered:
daemon N binds 127.0.0.N for lanes, API and mDNS, keeps its state under the test's tmp dir,
declares a silent lane dead after 1.2 s, and is stopped by the caller's finally (`stop_all`).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterable

from meshd.cli.demo_daemons import DemoDaemon, ServeProcess, write_secret_file

REPO = pathlib.Path(__file__).resolve().parents[2]
SECRET = "meshd-test-secret-0123456789abcdef"
OTHER_SECRET = "another-mesh-secret-0123456789abcd"
START_TIMEOUT_S = 60.0


class Daemon(DemoDaemon):
    """Test daemon number `index` (2..254) on 127.0.0.`index`."""

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
        secret_file = write_secret_file(tmp / f"n{index}.secret", secret)
        lane = ("--lane-dead-after-s", "1.2")
        host = f"127.0.0.{index}"
        super().__init__(tmp, f"n{index}", host, secret_file, budget, None, extra=(*lane, *extra))


def started(daemons: Iterable[ServeProcess], timeout_s: float = START_TIMEOUT_S) -> float:
    """Wait until every daemon listens; returns when the last one did (time.monotonic)."""
    deadline = time.monotonic() + timeout_s
    return max(d.wait_listening(deadline) for d in daemons)


def stop_all(daemons: Iterable[ServeProcess]) -> None:
    """SIGKILL and reap every daemon (a test's finally)."""
    daemons = list(daemons)
    for d in daemons:
        d.kill()
    deadline = time.monotonic() + 10
    for d in daemons:
        d.wait_stopped(deadline)
