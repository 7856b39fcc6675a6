"""The daemons of `meshd bench chaos`: real `meshd serve` processes on loopback, each in a
numbered slot that survives its process (same address, state dir and so node key), so a node
can be SIGKILLed or SIGTERMed and started again as itself.

Processes are spawned from the main thread only: a daemon dies with the thread that spawned it
(PR_SET_PDEATHSIG), and a worker thread would take it down when it exits. `stop()` is
idempotent, SIGKILLs what SIGTERM did not stop, and removes the work dir.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.cli.supervisor import (
    LoopbackDaemon,
    fresh_secret_file,
    settled_plan,
    stage_budget,
    stop_all,
    wait_stable,
)

START_TIMEOUT_S = 240.0  # four daemons starting at once on a busy 2-core machine
_T0 = time.monotonic()
# A plan counts as settled once every node reports it, loaded, unchanged this long.
PLAN_STABLE_S = 0.5


def note(text: str) -> None:
    """One line of progress on stderr (stdout stays the report's)."""
    print(f"[{time.monotonic() - _T0:7.1f} s] {text}", file=sys.stderr, flush=True)


@dataclass
class Slot:
    """One node of the mesh across its runs; `daemon` is None while it is down."""

    name: str
    host: str
    daemon: LoopbackDaemon | None = None
    incarnation: int = 0
    # Process ids of every run, so the caller can check that none outlived the bench.
    pids: list[int] = field(default_factory=list)

    @property
    def up(self) -> bool:
        """Running and listening (its API address is known)."""
        d = self.daemon
        return d is not None and bool(d.api_url) and d.proc.poll() is None


class ChaosMesh:
    """`nodes` daemons with budgets that force `stages` stages (the rest are spares)."""

    def __init__(
        self,
        model_dir: str,
        model: str | None,
        nodes: int,
        stages: int,
        first_host: int,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = model_dir
        self.model = model
        self.stages = stages
        self.extra_flags = extra_flags
        self.work = Path(tempfile.mkdtemp(prefix="meshd-chaos-"))
        self.secret_file = fresh_secret_file(self.work)
        self.budget = 0
        self.slots = [Slot(f"n{i + 1}", f"127.0.0.{first_host + i}") for i in range(nodes)]
        self.keys: dict[str, str] = {}  # slot name -> node key (hex), stable across restarts

    # -- processes (main thread) -------------------------------------------------------------
    def spawn(self, slot: Slot) -> LoopbackDaemon:
        """Start the slot's daemon (not yet listening: see `LoopbackDaemon.wait_listening`)."""
        old_log = self.work / f"{slot.name}.log"
        if old_log.exists():  # keep every run's log
            old_log.rename(self.work / f"{slot.name}.run{slot.incarnation}.log")
        slot.incarnation += 1
        daemon = LoopbackDaemon(
            self.work,
            slot.name,
            slot.host,
            self.secret_file,
            self.budget,
            self.model,
            extra=self.extra_flags,
        )
        slot.daemon = daemon
        slot.pids.append(daemon.proc.pid)
        note(f"{slot.name}: run {slot.incarnation}, pid {daemon.proc.pid}, work dir {self.work}")
        return daemon

    def start(self) -> None:
        """Spawn every daemon; wait until they listen, know each other and agree on a plan.

        The stage nodes start first and plan among themselves, then the spares join: plans
        are sticky (loaded stages stay where they are), so the mesh keeps `stages` stages and
        the spares stay spare. Started all at once, the first plan could take a spare in as
        an extra stage when RTTs were not yet measured, and keep it.
        """
        self.budget = stage_budget(self.model_dir, self.stages)
        deadline = time.monotonic() + START_TIMEOUT_S
        for end in sorted({self.stages, len(self.slots)}):
            group = self.slots[len(self.keys) : end]
            daemons = [self.spawn(slot) for slot in group]
            for d in daemons:
                d.wait_listening(deadline)
            for slot in group:
                assert slot.daemon is not None
                self.keys[slot.name] = slot.daemon.key()
            self.wait_settled(max(1.0, deadline - time.monotonic()), self.slots[:end])

    def _running(self, slots: list[Slot]) -> list[LoopbackDaemon]:
        return [s.daemon for s in slots if s.up and s.daemon is not None]

    # -- observation (any thread; blocking) --------------------------------------------------
    def up_daemons(self) -> list[LoopbackDaemon]:
        """The daemons running and listening now."""
        return self._running(self.slots)

    def settled(self, slots: list[Slot] | None = None) -> list[dict[str, Any]] | None:
        """The plan every node (of `slots`, default all) agrees on and has loaded, once those
        nodes are up and see each other alive; None before."""
        slots = self.slots if slots is None else slots
        daemons = self._running(slots)
        if len(daemons) != len(slots):
            return None
        keys = {self.keys[s.name] for s in slots}
        if any(d.alive_members() != keys for d in daemons):
            return None
        plan = settled_plan(daemons)
        return plan if plan is not None and len(plan) == self.stages else None

    def wait_settled(
        self, timeout_s: float, slots: list[Slot] | None = None
    ) -> list[dict[str, Any]]:
        """Block until `settled(slots)` holds for `PLAN_STABLE_S` (DaemonError at the timeout)."""
        return wait_stable(
            lambda: self.settled(slots), timeout_s, PLAN_STABLE_S, "a settled plan on every node"
        )

    def role(self, slot: Slot) -> str:
        """ "stage" when the slot's node holds a stage of the current plan, else "spare"."""
        for d in self.up_daemons():
            status = d.try_status()
            if status is not None and status["plan"]:
                stage_keys = {stage["key"] for stage in status["plan"]}
                return "stage" if self.keys.get(slot.name) in stage_keys else "spare"
        return "spare"

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each live node's sessions and KV as `meshctl status --json` reports them."""
        snap: dict[str, dict[str, Any]] = {}
        for slot in self.slots:
            status = slot.daemon.try_status() if slot.up and slot.daemon is not None else None
            if status is None:
                continue
            figures = {
                "sessions_hosted": int(status["sessions_hosted"]),
                "kv_used_bytes": int(status["kv_used_bytes"]),
                "sessions_coordinated": int(status["sessions_coordinated"]),
                "recoveries": int(status["recoveries"]),
            }
            if "sessions_expired" in status:  # reported by daemons with session leases
                figures["sessions_expired"] = status["sessions_expired"]
            snap[slot.name] = figures
        return snap

    def logs(self, chars: int) -> str:
        """The tail of each slot's current log."""
        return "\n".join(
            f"--- {s.name} ---\n{s.daemon.log_tail(chars)}" for s in self.slots if s.daemon
        )

    # -- teardown ------------------------------------------------------------------------
    def stop(self, keep_logs: bool = False) -> None:
        """SIGTERM every daemon, SIGKILL stragglers, reap them, remove the work dir."""
        daemons = [s.daemon for s in self.slots if s.daemon is not None]
        if daemons:
            note(f"stopping {len(daemons)} daemons")
        for slot in self.slots:
            slot.daemon = None
        stop_all(daemons, 15)
        if not keep_logs:
            shutil.rmtree(self.work, ignore_errors=True)
        note(f"stopped; work dir {self.work} {'kept' if keep_logs else 'removed'}")
