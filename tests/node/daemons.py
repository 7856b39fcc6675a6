"""Numbered test daemons for the multi-process tests, on the supervisor (`meshd.cli.supervisor`).

Daemon N binds `loopback(N)` for lanes, API and mDNS, keeps its state under the test's tmp dir
and declares a silent lane dead after 1.2 s; the caller's finally stops it (`kill_all`).
`tasks_of` and `wait_tasks_back` check that a daemon's trio tasks return to a baseline.
"""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from meshd.cli.supervisor import (
    DaemonError,
    LoopbackDaemon,
    ServeProcess,
    settled_plan,
    wait_until,
    write_secret_file,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
# Fresh per test process (each xdist worker imports this module): daemons of two workers or of
# two runs on one machine (mDNS on loopback) never join each other's mesh.
SECRET = "meshd-test-secret-" + secrets.token_hex(8)
OTHER_SECRET = "another-mesh-secret-" + secrets.token_hex(8)
# The two serial groups of tests/conftest.py run side by side on two workers, so each has a
# block of loopback addresses of its own: a module numbers its addresses 2..LAST_INDEX and
# `loopback(N)` is 127.0.0.N in the first group's block, 127.0.0.(BLOCK_SPAN + N) in the
# second's. A module outside the serial groups runs beside anything and gets none (`_block`
# None: `loopback` raises). conftest sets the block before each test's set-up (`use_block`).
BLOCK_SPAN = 128
LAST_INDEX = BLOCK_SPAN - 2
_block: int | None = 0


def use_block(block: int | None) -> None:
    """Give the tests that run next the addresses of serial group `block` (None: none)."""
    global _block
    _block = block


def host_number(index: int) -> int:
    """The last octet of loopback address number `index` (2..LAST_INDEX) of this group (a
    `--first-host` counts up from it: the numbers it takes must stay within 2..LAST_INDEX)."""
    if _block is None:
        raise AssertionError("only a module of a serial group (tests/conftest.py) binds 127.0.0.N")
    if not 2 <= index <= LAST_INDEX:
        raise ValueError(f"loopback address number {index}: a module numbers them 2..{LAST_INDEX}")
    return _block * BLOCK_SPAN + index


def loopback(index: int) -> str:
    """Loopback address number `index` of the serial group now running (see BLOCK_SPAN)."""
    return f"127.0.0.{host_number(index)}"


# Every test daemon declares a silent lane dead after this long (`lane.dead_after_s`).
LANE_DEAD_AFTER_S = 1.2


class Daemon(LoopbackDaemon):
    """Test daemon number `index` (2..LAST_INDEX) on `loopback(index)`."""

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
        lane = ("--lane-dead-after-s", str(LANE_DEAD_AFTER_S))
        host = loopback(index)
        super().__init__(tmp, f"n{index}", host, secret_file, budget, None, extra=(*lane, *extra))


# The tasks a loaded stage runs for as long as it is loaded (its host and its lease timer): a
# spare that took a dead node's stage holds them on top of its count from before.
STAGE_TASKS = {
    "meshd.node.stage_slot.StageSlot._serve": 1,
    "meshd.stage.host.StageHost._expire_leases": 1,
}
# What can keep a survivor's transient tasks up after a peer dies: the dead lane's verdict
# (1.2 s here), a session lease, and one failed dial to the dead node by gossip, which
# tries the address (handshake timeout 3 s), waits for the peer to dial (nat.yield_s 2 s)
# and asks up to 3 introducers (2 s each).
TASKS_SETTLE_S = 30.0


# A lane's reader task: one per open lane.
LANE_READER = "meshd.net.lane_table.LaneTable._read"


def tasks_of(daemons: Iterable[ServeProcess]) -> dict[str, dict[str, int]]:
    """Each daemon's live trio tasks, counted by task name."""
    return {d.name: dict(d.status()["tasks_by_name"]) for d in daemons}


def wait_tasks_back(
    daemons: Iterable[ServeProcess],
    before: Mapping[str, Mapping[str, int]],
    *,
    took_stage: Iterable[ServeProcess] = (),
    timeout_s: float = TASKS_SETTLE_S,
) -> float:
    """Wait until no daemon runs more tasks of any name than it did in `before` (plus a
    loaded stage's for those in `took_stage`, and a lane reader for each lane open now, since
    lanes open on demand and stay: a pair of members that first spoke meanwhile is no leak);
    seconds it took. A per-session or per-lane task that outlives its session or lane fails
    this, naming the task."""
    daemons = list(daemons)
    allowed = {d.name: dict(before[d.name]) for d in daemons}
    for d in took_stage:
        for name, count in STAGE_TASKS.items():
            allowed[d.name][name] = max(allowed[d.name].get(name, 0), count)
    grown: dict[str, dict[str, int]] = {}

    def back() -> bool:
        grown.clear()
        for d in daemons:
            status = d.status()
            now = dict(status["tasks_by_name"])
            lanes = sum(1 for m in status["members"] if m["lane_up"])
            ok = dict(allowed[d.name])
            ok[LANE_READER] = max(ok.get(LANE_READER, 0), lanes)
            extra = {n: c - ok.get(n, 0) for n, c in now.items()}
            extra = {n: c for n, c in extra.items() if c > 0}
            if extra:
                grown[d.name] = extra
        return not grown

    try:
        return wait_until(back, timeout_s, "every daemon's tasks back to their count from before")
    except DaemonError as exc:
        raise AssertionError(f"{exc}; tasks left behind: {grown}") from None


def stable_plan(daemons: list[Daemon]) -> list[dict[str, Any]]:
    """The settled plan, once it stays the same for a second (RTT rows arriving re-plan)."""
    seen: list[Any] = []

    def stable() -> bool:
        seen.append(settled_plan(daemons))
        return len(seen) > 4 and seen[-1] is not None and all(p == seen[-1] for p in seen[-5:])

    try:
        wait_until(stable, 40, "a stable settled plan", poll_s=0.25)
    except DaemonError:
        # What each daemon saw, for the failure report: which view or stage disagreed.
        for d in daemons:
            status = d.try_status() or {}
            print(d.name, {k: status.get(k) for k in ("key", "plan", "stage_layers")})
        raise
    return list(seen[-1])
