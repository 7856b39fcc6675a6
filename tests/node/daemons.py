"""Numbered test daemons for the multi-process tests, on the supervisor (`meshd.cli.supervisor`).

Daemon N binds 127.0.0.N for lanes, API and mDNS, keeps its state under the test's tmp dir and
declares a silent lane dead after 1.2 s; the caller's finally stops it (`kill_all`).
"""

from __future__ import annotations

import pathlib
import secrets

from meshd.cli.supervisor import LoopbackDaemon, write_secret_file

REPO = pathlib.Path(__file__).resolve().parents[2]
# Fresh per test run: daemons of two runs on one machine (mDNS on loopback, the same
# 127.0.0.N addresses) never join each other's mesh.
SECRET = "meshd-test-secret-" + secrets.token_hex(8)
OTHER_SECRET = "another-mesh-secret-" + secrets.token_hex(8)


class Daemon(LoopbackDaemon):
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
