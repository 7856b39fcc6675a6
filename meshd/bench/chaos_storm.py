"""The storm of `meshd bench chaos`: a seeded load on every node's API while nodes are
SIGKILLed, SIGTERMed and started again; then the leak check.

One trio run: `reference` sends every job undisturbed (the texts to compare with), `storm`
runs the load workers and the chaos loop side by side until `duration_s` (the loop finishes
its last restart, the workers their last request), `leak_check` waits up to the lease for
every node to hold no session, and `after_storm` checks that each node serves again. All
blocking calls (control socket, waiting for a daemon) run in threads; daemons are spawned from
the trio thread (see `chaos_mesh`).
"""

from __future__ import annotations

import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import trio

from meshd.bench.chaos_mesh import ChaosMesh, Slot, note
from meshd.bench.chaos_requests import ChaosJob, Disruption, Seen, Timeouts, stream_once
from meshd.cli.supervisor import DaemonError

T = TypeVar("T")


@dataclass(frozen=True)
class StormConfig:
    """How hard and how long the storm blows (seconds)."""

    seed: int = 0
    duration_s: float = 120.0
    concurrency: int = 8
    # Time between the mesh being whole again and the next SIGKILL/SIGTERM.
    gap_s: tuple[float, float] = (4.0, 12.0)
    # Time a node stays down before it is started again.
    down_s: tuple[float, float] = (1.0, 5.0)
    # A SIGTERMed daemon gets this long to exit (its graceful stop included) before SIGKILL.
    term_wait_s: float = 20.0
    # Before each disruption the mesh must be whole and settled again, within this long.
    settle_timeout_s: float = 90.0
    # After the storm: how long every node may take to hold no session.
    leak_wait_s: float = 30.0
    # End the storm early once this many SIGKILL/SIGTERMs (one of them of a coordinator of
    # open streams) have been restarted and the mesh has served whole again; 0: no count.
    disruptions: int = 0
    timeouts: Timeouts = field(default_factory=Timeouts)


@dataclass
class StormLog:
    """What happened: every request as its client saw it, every disruption."""

    seen: list[Seen] = field(default_factory=list)
    disruptions: list[Disruption] = field(default_factory=list)
    open_streams: Counter[str] = field(default_factory=Counter)  # node name -> open requests
    skipped_unsettled: int = 0  # disruptions skipped: the mesh did not settle in time
    restart_failures: list[str] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)  # restart until listening again
    started_at: float = 0.0
    ended_at: float = 0.0
    stop_at: float = 0.0  # the load stops here (the duration, or earlier: `disruptions`)


async def in_thread(fn: Callable[[], T]) -> T:
    """Run a blocking call off the trio thread (abandoned on Ctrl-C: every such call is
    bounded, and the daemons are stopped right after)."""
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


# The API closes a connection idle for 5 s (hypercorn's keep-alive timeout); a client that
# reused one just then would see "disconnected without a response" from a healthy node.
CLIENT_KEEPALIVE_S = 2.0


def _client(concurrency: int, nodes: int) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=concurrency * nodes + nodes, keepalive_expiry=CLIENT_KEEPALIVE_S
    )
    return httpx.AsyncClient(limits=limits)


async def model_name(mesh: ChaosMesh) -> str:
    """The model id the nodes serve."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(mesh.up_daemons()[0].api_url + "/models")
        return str(response.json()["data"][0]["id"])


async def reference(
    mesh: ChaosMesh, model: str, jobs: list[ChaosJob], cfg: StormConfig, rounds: int
) -> list[list[Seen]]:
    """Every job `rounds` times with no disruption, round r on node (job + r) mod nodes."""
    results: list[list[Seen]] = []
    slots = mesh.slots
    limiter = trio.CapacityLimiter(cfg.concurrency)
    async with _client(cfg.concurrency, len(slots)) as client:

        async def one(job: ChaosJob, slot: Slot, out: list[Seen]) -> None:
            async with limiter:
                assert slot.daemon is not None
                s = Seen(job.index, slot.name, slot.incarnation, time.monotonic())
                url = slot.daemon.api_url
                out.append(await stream_once(client, url, model, job, s, cfg.timeouts))

        for r in range(rounds):
            seen: list[Seen] = []
            async with trio.open_nursery() as nursery:
                for job in jobs:
                    nursery.start_soon(one, job, slots[(job.index + r) % len(slots)], seen)
            results.append(sorted(seen, key=lambda s: s.job))
    return results


async def storm(
    mesh: ChaosMesh, model: str, jobs: list[ChaosJob], cfg: StormConfig, log: StormLog
) -> None:
    """The load and the chaos loop until `cfg.duration_s`; returns with every node up."""
    log.started_at = time.monotonic()
    log.stop_at = log.started_at + cfg.duration_s
    note(f"storm: {cfg.duration_s:.0f} s, {cfg.concurrency} streams")
    async with _client(cfg.concurrency, len(mesh.slots)) as client, trio.open_nursery() as n:
        for worker in range(cfg.concurrency):
            n.start_soon(_load_worker, mesh, client, model, jobs, cfg, log, worker)
        n.start_soon(_chaos_loop, mesh, cfg, log)
    log.ended_at = time.monotonic()
    note(f"storm over: {len(log.seen)} requests, {len(log.disruptions)} disruptions")


async def _load_worker(
    mesh: ChaosMesh,
    client: httpx.AsyncClient,
    model: str,
    jobs: list[ChaosJob],
    cfg: StormConfig,
    log: StormLog,
    worker: int,
) -> None:
    """Send seeded jobs to random live nodes until `log.stop_at`; back off after a refusal."""
    rng = random.Random(cfg.seed * 7919 + worker + 1)
    while time.monotonic() < log.stop_at:
        job = rng.choice(jobs)
        slots = [s for s in mesh.slots if s.up]
        if not slots:
            await trio.sleep(0.2)
            continue
        slot = rng.choice(slots)
        assert slot.daemon is not None
        seen = Seen(job.index, slot.name, slot.incarnation, time.monotonic())
        log.seen.append(seen)
        log.open_streams[slot.name] += 1
        try:
            await stream_once(client, slot.daemon.api_url, model, job, seen, cfg.timeouts)
        finally:
            log.open_streams[slot.name] -= 1
        if seen.status in (429, 503):
            await trio.sleep(min(seen.retry_after_s or 1.0, 2.0))
        elif seen.status == -1 or seen.cut:
            await trio.sleep(0.2)


async def _chaos_loop(mesh: ChaosMesh, cfg: StormConfig, log: StormLog) -> None:
    """SIGKILL or SIGTERM a random node, start it again, wait for the mesh to settle; repeat.

    Only one node is down at a time (the mesh has one spare), and the next disruption waits
    until the mesh is whole and settled, so enough nodes are always there to serve. Kinds
    come in pairs, so every storm long enough for two has both: the first pair SIGKILL then
    SIGTERM (a SIGKILL's cycle is the shorter one, no drain), later pairs shuffled. With
    `cfg.disruptions` the storm ends one gap after the mesh settled from the last one counted.
    """
    rng = random.Random(cfg.seed)
    kinds = ["sigterm", "sigkill"]  # popped from the end
    while True:
        gap = rng.uniform(*cfg.gap_s)
        if time.monotonic() + gap >= log.stop_at:
            return
        await trio.sleep(gap)
        try:
            await in_thread(lambda: mesh.wait_settled(cfg.settle_timeout_s))
        except DaemonError:
            log.skipped_unsettled += 1
            continue
        if _enough(cfg, log):
            # Requests run one more gap on the whole mesh, then the load stops.
            log.stop_at = min(log.stop_at, time.monotonic() + rng.uniform(*cfg.gap_s))
            return
        if time.monotonic() >= log.stop_at:
            return
        if not kinds:
            kinds = ["sigkill", "sigterm"]
            rng.shuffle(kinds)
        victim = _pick_victim(mesh, log, rng)
        await _disrupt(mesh, cfg, log, victim, kinds.pop())
        await trio.sleep(rng.uniform(*cfg.down_s))
        await _restart(mesh, log, victim)


def _enough(cfg: StormConfig, log: StormLog) -> bool:
    """Whether the storm has had the `cfg.disruptions` it asked for, a coordinator's among them."""
    hits = [d for d in log.disruptions if d.kind != "restart"]
    return (
        cfg.disruptions > 0 and len(hits) >= cfg.disruptions and any(d.coordinating for d in hits)
    )


def _pick_victim(mesh: ChaosMesh, log: StormLog, rng: random.Random) -> Slot:
    """Half the time a node that coordinates open streams (when one does), else any node."""
    up = [s for s in mesh.slots if s.up]
    coordinating = [s for s in up if log.open_streams[s.name] > 0]
    if coordinating and rng.random() < 0.5:
        return rng.choice(coordinating)
    return rng.choice(up)


async def _disrupt(mesh: ChaosMesh, cfg: StormConfig, log: StormLog, slot: Slot, kind: str) -> None:
    """Signal the slot's daemon and reap it (a SIGTERM that does not end it in time: SIGKILL)."""
    daemon = slot.daemon
    assert daemon is not None
    role = await in_thread(lambda: mesh.role(slot))
    coordinating = log.open_streams[slot.name]
    at = time.monotonic()
    escalated_at = None
    if kind == "sigkill":
        daemon.kill()
    else:
        daemon.terminate()
        exited = await in_thread(lambda: _wait_exit(daemon.proc, cfg.term_wait_s))
        if not exited:
            escalated_at = time.monotonic()
            daemon.kill()
    how = await in_thread(lambda: daemon.wait_stopped(time.monotonic() + 10))
    slot.daemon = None
    escalated = ", then SIGKILL" if escalated_at is not None else ""
    note(f"{kind} {slot.name} ({role}, {coordinating} streams){escalated}: {how}")
    log.disruptions.append(
        Disruption(kind, slot.name, slot.incarnation, at, role, coordinating, escalated_at)
    )


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


async def _restart(mesh: ChaosMesh, log: StormLog, slot: Slot) -> None:
    """Start the slot's node again, as itself, and wait until it listens."""
    role = log.disruptions[-1].role if log.disruptions else "spare"
    at = time.monotonic()
    daemon = mesh.spawn(slot)  # the trio thread: see chaos_mesh
    log.disruptions.append(Disruption("restart", slot.name, slot.incarnation, at, role, 0))
    try:
        ready = await in_thread(lambda: daemon.wait_listening(time.monotonic() + 180))
        log.restart_s.append(ready - at)
        note(f"{slot.name} listens again after {ready - at:.1f} s")
    except DaemonError as exc:
        log.restart_failures.append(str(exc))


async def leak_check(mesh: ChaosMesh, wait_s: float) -> tuple[dict[str, dict[str, Any]], float]:
    """Poll every node until none holds a session or KV, at most `wait_s`.

    Returns the last snapshot and how long it took (`wait_s` when something stayed).
    """
    t0 = time.monotonic()
    note(f"leak check: up to {wait_s:.0f} s for every node to hold no session")
    while True:
        snap = await in_thread(mesh.snapshot)
        waited = time.monotonic() - t0
        clean = len(snap) == len(mesh.slots) and all(
            f["sessions_hosted"] == 0 and f["kv_used_bytes"] == 0 and f["sessions_coordinated"] == 0
            for f in snap.values()
        )
        if clean or waited >= wait_s:
            return snap, waited
        await trio.sleep(1.0)


async def after_storm(mesh: ChaosMesh, model: str, job: ChaosJob, cfg: StormConfig) -> list[Seen]:
    """One request to each node, after the storm and the leak check."""
    out: list[Seen] = []
    async with _client(1, len(mesh.slots)) as client:
        for slot in mesh.slots:
            if slot.daemon is None:
                continue
            s = Seen(job.index, slot.name, slot.incarnation, time.monotonic())
            out.append(await stream_once(client, slot.daemon.api_url, model, job, s, cfg.timeouts))
    return out
