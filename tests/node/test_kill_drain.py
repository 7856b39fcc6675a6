"""`meshctl kill --drain` and `meshctl kill` while a generation runs, with real daemons.

One mesh of four daemons (three stages and a spare; memory budgets rule out fewer stages)
serves the module; each test first recovers whatever node an earlier one left drained or
killed (`_ready`), so the tests pass alone and in any order. A drained stage finishes the
running generation undisturbed (same tokens as single-node greedy, no recovery) and only then
stops, `meshctl status` showing it draining meanwhile; the next request runs on the re-planned
route with the spare. A stage killed at once mid-generation is survived like a crash: the
request completes on the spare with identical output. A drain that outlasts
`drain_timeout_s` (short on the fourth daemon, moved onto a stage first if it is the spare)
stops the stage anyway, says so in the event log and `meshctl status`, and the request it cut
completes on the spare.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from meshd.cli.supervisor import DaemonError, kill_all, settled_plan, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import GenerateOp, request_lines
from tests.node.daemons import SECRET, Daemon
from tests.node.test_daemon import meshctl, reference, run_generation, three_stage_budget

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
# Long enough that meshctl (a fresh Python process) lands while the generation runs.
MAX_TOKENS = 200
# The drain-timeout test's generation: it must outlast meshctl's start plus the short drain
# timeout even on a quiet machine, where 200 tokens take about as long as those two.
LONG_TOKENS = 900
# The fourth daemon's drain timeout: far shorter than a generation of LONG_TOKENS.
SHORT_DRAIN_TIMEOUT_S = 1.0


class Mesh:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.budget = three_stage_budget()
        self.daemons: list[Daemon] = []


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(tmp_path_factory.mktemp("drain"))
    try:
        # Start three, let them plan, then add the spare, so the spare is the one left out.
        for i in (2, 3, 4):
            m.daemons.append(Daemon(m.tmp, i, secret=SECRET, budget=m.budget))
        started(m.daemons)
        wait_until(lambda: settled_plan(m.daemons) is not None, 40, "a three-stage plan")
        short_drain = ("--drain-timeout-s", str(SHORT_DRAIN_TIMEOUT_S))
        m.daemons.append(Daemon(m.tmp, 5, secret=SECRET, budget=m.budget, extra=short_drain))
        started(m.daemons[-1:])
        keys = {d.key() for d in m.daemons}
        wait_until(lambda: all(d.alive_members() == keys for d in m.daemons), 15, "four members")
        wait_until(lambda: settled_plan(m.daemons) is not None, 30, "a plan with a spare")
        yield m
    finally:
        kill_all(m.daemons)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return reference(Tokenizer.open(builtin_model_dir()).encode(PROMPT), MAX_TOKENS)


@pytest.fixture(scope="module")
def expected_long() -> list[int]:
    return reference(Tokenizer.open(builtin_model_dir()).encode(PROMPT), LONG_TOKENS)


def _op(max_tokens: int = MAX_TOKENS) -> GenerateOp:
    prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
    return GenerateOp(prompt=prompt, max_tokens=max_tokens, strategy="disabled", ignore_eos=True)


def _start(
    d: Daemon, max_tokens: int = MAX_TOKENS
) -> tuple[threading.Thread, list[tuple[float, dict[str, Any]]]]:
    lines: list[tuple[float, dict[str, Any]]] = []
    first = threading.Event()
    thread = threading.Thread(target=run_generation, args=(d, _op(max_tokens), lines, first))
    thread.start()
    assert first.wait(60)
    return thread, lines


def _streamed(lines: list[tuple[float, dict[str, Any]]]) -> int:
    return sum(len(line.get("tokens", [])) for _, line in list(lines) if "ok" not in line)


def _stable_plan(mesh: Mesh) -> list[dict[str, Any]]:
    """The settled plan, once it stays the same for a second (RTT rows arriving re-plan)."""
    seen: list[Any] = []

    def stable() -> bool:
        seen.append(settled_plan(mesh.daemons))
        return len(seen) > 4 and seen[-1] is not None and all(p == seen[-1] for p in seen[-5:])

    wait_until(stable, 40, "a stable settled plan", poll_s=0.25)
    return list(seen[-1])


def _ready(mesh: Mesh) -> None:
    """Four serving nodes, whatever an earlier test left: every drained or killed node is
    recovered, every node sees every member offering the model, and they agree on a plan."""
    coordinator = mesh.daemons[0]
    for d in mesh.daemons:
        if d.status()["disabled"]:
            meshctl("recover", d.key()[:12], "--socket", coordinator.socket)
    wait_until(lambda: not any(d.status()["disabled"] for d in mesh.daemons), 10, "the recover")

    def views() -> list[tuple[str, str, str, bool]]:
        """(viewer, member, health, offers the model) for every member every node sees."""
        return [
            (d.name, m["name"], m["status"], m["offers_model"])
            for d in mesh.daemons
            for m in d.status()["members"]
        ]

    def all_offer() -> bool:
        rows = views()
        return len(rows) == len(mesh.daemons) ** 2 and all(
            health == "alive" and offers for _, _, health, offers in rows
        )

    try:
        wait_until(all_offer, 30, "every member offering the model")
    except DaemonError as exc:
        raise AssertionError(f"{exc}; views: {views()}") from exc
    wait_until(lambda: settled_plan(mesh.daemons) is not None, 30, "a plan with a spare")


def _roles(mesh: Mesh) -> tuple[Daemon, Daemon, Daemon]:
    """(coordinator, a stage node that is not the coordinator, the spare) of the settled plan."""
    in_plan = {s["key"] for s in _stable_plan(mesh)}
    coordinator = mesh.daemons[0]
    victim = next(d for d in mesh.daemons[1:] if d.key() in in_plan)
    spare = next(d for d in mesh.daemons if d.key() not in in_plan)
    return coordinator, victim, spare


def _event_at(d: Daemon, kind: str) -> float | None:
    found = [e["at_unix_s"] for e in d.status()["events"] if e["kind"] == kind]
    return float(found[-1]) if found else None


def _route_failures_since(coordinator: Daemon, since_unix_s: float) -> list[str]:
    """Every route failure the coordinator recorded since `since_unix_s`."""
    return [
        e["detail"]
        for e in coordinator.status()["events"]
        if e["kind"] == "route-failed" and e["at_unix_s"] >= since_unix_s
    ]


def _failures_from_the_kill(coordinator: Daemon, since_unix_s: float) -> list[str]:
    """Route failures the coordinator saw because a stage was stopped by the operator."""
    return [
        e["detail"]
        for e in coordinator.status()["events"]
        if e["kind"] == "route-failed"
        and e["at_unix_s"] >= since_unix_s
        and "killed by the operator" in e["detail"]
    ]


def test_drain_finishes_the_running_generation_then_stops_the_stage(
    mesh: Mesh, expected: list[int]
) -> None:
    _ready(mesh)
    coordinator, victim, spare = _roles(mesh)
    started_at = time.time()
    thread, lines = _start(coordinator)
    out = meshctl("kill", victim.key()[:12], "--drain", "--socket", coordinator.socket)
    assert "draining" in out
    status = json.loads(meshctl("status", "--json", "--socket", victim.socket))
    still_running = thread.is_alive()
    thread.join(60)
    assert not thread.is_alive()

    final = lines[-1][1]
    assert final["ok"], final
    assert still_running, "the drain did not land mid-generation"
    # While the generation ran, the node said it was draining and still served its stage.
    assert status["draining"] and not status["disabled"]
    assert status["stage_layers"] is not None and status["sessions_hosted"] == 1
    assert status["kv_used_bytes"] > 0  # the open session's KV, reported to the operator
    # The generation was not disturbed by the drain: same tokens, and the drained stage never
    # failed it. (The planner may still move other stages as RTTs arrive, which the
    # coordinator survives: that is not the drain's doing, so it is not asserted here.)
    assert final["tokens"] == expected
    assert not _failures_from_the_kill(coordinator, started_at)

    # The node logs "killed" once its stage has stopped, so a status read between the two shows
    # no stage and no entry yet: wait for both.
    def stopped_and_logged() -> bool:
        now = victim.status()
        logged = any(e["kind"] == "killed" and e["at_unix_s"] >= started_at for e in now["events"])
        return now["stage_layers"] is None and logged

    wait_until(stopped_and_logged, 10, "the drained stage to stop and say so")
    after = victim.status()
    assert after["disabled"] and not after["draining"]
    # The stage stopped only once the session ended: at the last token, or earlier if the
    # planner moved another stage meanwhile (the coordinator then closed it to re-plan).
    stopped_at = _event_at(victim, "killed")
    session_ended_at = min(
        [max(t for t, line in lines if "ok" not in line)]
        + [e["at_unix_s"] for e in coordinator.status()["events"]
           if e["kind"] == "route-failed" and e["at_unix_s"] >= started_at]
    )  # fmt: skip
    assert stopped_at is not None and stopped_at >= session_ended_at - 0.05
    kinds = [(e["kind"], e["detail"]) for e in after["events"]]
    assert kinds.index(("killed", "drained")) > kinds.index(("draining", "1 sessions open"))

    # New requests run on the re-planned route, with the spare instead of the drained node.
    def spare_serves() -> bool:
        agreed = settled_plan(mesh.daemons)
        return agreed is not None and spare.key() in {s["key"] for s in agreed}

    wait_until(spare_serves, 20, "a plan with the spare")
    agreed = settled_plan(mesh.daemons)
    assert agreed is not None and victim.key() not in {s["key"] for s in agreed}
    again = list(request_lines(coordinator.socket, _op(), timeout_s=60))[-1]
    assert again["ok"] and again["tokens"] == expected


def test_kill_during_a_generation_completes_on_the_spare(mesh: Mesh, expected: list[int]) -> None:
    _ready(mesh)
    coordinator, victim, spare = _roles(mesh)
    recoveries_before = coordinator.status()["recoveries"]
    started_at = time.time()
    thread, lines = _start(coordinator)
    assert "killed" in meshctl("kill", victim.key()[:12], "--socket", coordinator.socket)
    killed_after = _streamed(lines)
    thread.join(60)
    assert not thread.is_alive()

    final = lines[-1][1]
    assert final["ok"], final
    assert killed_after < MAX_TOKENS, "the kill did not land mid-generation"
    assert final["tokens"] == expected
    assert coordinator.status()["recoveries"] > recoveries_before
    assert _failures_from_the_kill(coordinator, started_at)  # it did hit the running request
    agreed = settled_plan(mesh.daemons)
    assert agreed is not None and spare.key() in {s["key"] for s in agreed}
    assert victim.key() not in {s["key"] for s in agreed}


def test_a_drain_that_times_out_stops_the_stage_anyway_and_says_so(
    mesh: Mesh, expected_long: list[int]
) -> None:
    # The drain must outlast its timeout because the session stays: should the session leave the
    # stage sooner (a route lost to CPU starvation on a loaded machine, then recovered without
    # it), the stage rightly says "drained" before the deadline; that run proves nothing about
    # the timeout, so it is run again (at most three times).
    said = f"drain timed out after {SHORT_DRAIN_TIMEOUT_S:g} s"
    for _attempt in range(3):
        drain_took, detail = _drain_a_long_generation(mesh, expected_long)
        if detail == said or drain_took >= SHORT_DRAIN_TIMEOUT_S:
            break
    assert detail == said, (detail, drain_took)
    short = mesh.daemons[3]
    assert said in meshctl("status", "--events", "100", "--socket", short.socket)


def _drain_a_long_generation(mesh: Mesh, expected_long: list[int]) -> tuple[float, str]:
    """Drain the short-drain daemon's stage under a long generation; (seconds from `draining`
    to `killed`, the `killed` event's detail)."""
    coordinator, short = mesh.daemons[0], mesh.daemons[3]
    _ready(mesh)
    in_plan = {s["key"] for s in _stable_plan(mesh)}
    if short.key() not in in_plan:  # the short-drain daemon is the spare: put it on a stage
        moved = next(d for d in mesh.daemons[1:3] if d.key() in in_plan)
        assert "killed" in meshctl("kill", moved.key()[:12], "--socket", coordinator.socket)

        def short_serves() -> bool:
            agreed = settled_plan(mesh.daemons)
            return agreed is not None and short.key() in {s["key"] for s in agreed}

        wait_until(short_serves, 20, "the short-drain daemon to take the stage")
        _ready(mesh)  # the moved node comes back as the spare
        in_plan = {s["key"] for s in _stable_plan(mesh)}
    assert short.key() in in_plan, "the short-drain daemon serves no stage"
    assert len(in_plan) == 3, "no spare left to take over"
    started_at = time.time()
    recoveries_before = coordinator.status()["recoveries"]
    thread, lines = _start(coordinator, LONG_TOKENS)
    out = meshctl("kill", short.key()[:12], "--drain", "--socket", coordinator.socket)
    assert "draining" in out
    wait_until(lambda: short.status()["stage_layers"] is None, 15, "the drain to time out")
    cut_short = thread.is_alive()
    thread.join(60)
    assert not thread.is_alive()

    final = lines[-1][1]
    assert cut_short, "the generation ended before the drain timed out"
    # The stage stopped with the session still open: the coordinator lost it and recovered.
    assert final["ok"], final
    assert final["tokens"] == expected_long
    assert coordinator.status()["recoveries"] > recoveries_before
    # The route failed after the kill: usually the stage's own `stage_stopped` ("killed by the
    # operator"), but with leases the coordinator may hear of the freed session another way first.
    assert _route_failures_since(coordinator, started_at)
    after = short.status()
    assert after["disabled"] and not after["draining"]
    events = [e for e in after["events"] if e["at_unix_s"] >= started_at]
    began = next(e["at_unix_s"] for e in events if e["kind"] == "draining")
    killed = [e for e in events if e["kind"] == "killed"][-1]
    return killed["at_unix_s"] - began, killed["detail"]
