"""Sessions never outlive their coordinator, and stops lose nothing: real daemons on loopback.

One mesh serves the module: three stage daemons (memory budgets rule out fewer stages), a
spare, and a coordinator that can hold no stage (a 1-byte budget), every one with a short
`session_lease_s` and `graceful_timeout_s`. Each test first restarts what an earlier one
stopped that it needs (`StopMesh.ready`), so the tests pass alone and in any order.

1. SIGKILL of the coordinator with streams open: every stage frees their sessions and KV
   within the lease, counts them in `sessions_expired`, and the next request succeeds.

After every stop, crash or closed lid each surviving daemon's trio tasks return to their
count from before the request (`wait_tasks_back`): nothing a lost peer, its lanes or its
sessions started stays behind.
2. SIGTERM of a middle stage mid-generation, then (the node restarted as the new spare)
   SIGKILL of the middle stage mid-generation: both give single-node greedy output, the
   SIGTERM one stalls the stream no longer than the SIGKILL one, and no stage keeps a session.
3. SIGTERM of a coordinator mid-stream (it is a stage too): tokens keep coming after the
   signal, a new request gets 503 with Retry-After, the stream ends with an error event and
   `[DONE]` when the grace runs out (never a silent cut), a request in flight that is not
   streamed gets an OpenAI-shaped 503, no stage keeps a session, and the daemon exits with
   status 0.
4. SIGKILL and SIGTERM of the spare mid-generation: the same tokens, the plan untouched, every
   view drops the spare, a stopped spare leaves no control socket, no stage keeps a session.
   A closed lid on the spare mid-generation: the same tokens, every view drops it within
   seconds, and opened again it rejoins as the spare, holding no stage, session or KV, and
   serves a request with the same tokens.
5. A closed lid (SIGSTOP) on a middle stage mid-generation: the generation completes on the
   spare with the same tokens; opened again (SIGCONT), the node rejoins every view, holds no
   session, and the mesh answers with the same tokens.
6. A closed lid on the coordinator with streams open: every stage frees their sessions and KV
   (`coordinator_lost`); opened again, its streams end with the same tokens as ever, it
   serves the next request at once, and no session is left anywhere.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from meshd.cli.supervisor import kill_all, settled_plan, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import request_lines
from tests.node.daemons import Daemon, stable_plan, tasks_of, wait_tasks_back
from tests.node.stop_mesh import StopMesh, Stream, left_only_identity, no_sessions_left, op
from tests.node.test_daemon import meshctl, reference, three_stage_budget

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
LEASE_S = 3.0
GRACE_S = 2.0
FLAGS = ("--session-lease-s", str(LEASE_S), "--graceful-timeout-s", str(GRACE_S))
# Address numbers 61-65 (`loopback`) and a secret of its own: another mesh started by another test
# run on this machine (mDNS on loopback) can never join this one.
SECRET = "meshd-stop-test-" + secrets.token_hex(8)
STAGE_NODES = (61, 62, 63)
SPARE = 64
COORDINATOR_ONLY = 65


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StopMesh]:
    m = StopMesh(
        tmp_path_factory.mktemp("stop"),
        secret=SECRET,
        budget=three_stage_budget(),
        extra=FLAGS,
        stage_nodes=STAGE_NODES,
        spare=SPARE,
        coordinator_only=COORDINATOR_ONLY,
    )
    try:
        for i in STAGE_NODES:
            m.start(i)
        started(m.daemons.values())
        wait_until(lambda: settled_plan(m.alive()) is not None, 40, "a three-stage plan")
        # The spare and the coordinator join after the plan, so neither takes a stage.
        m.start(SPARE)
        m.start(COORDINATOR_ONLY)
        started([m.daemons[SPARE], m.daemons[COORDINATOR_ONLY]])
        keys = {d.key() for d in m.alive()}
        wait_until(lambda: all(d.alive_members() == keys for d in m.alive()), 20, "five members")
        m.in_plan()
        yield m
    finally:
        kill_all(m.daemons.values())


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return Tokenizer.open(builtin_model_dir()).encode(PROMPT)


def _expired(d: Daemon) -> dict[str, int]:
    return dict(d.status()["sessions_expired"])


# ---- 1. a coordinator crashes with streams open -----------------------------------------------


def test_sigkill_of_a_coordinator_frees_its_sessions_on_every_stage(
    mesh: StopMesh, prompt: list[int]
) -> None:
    mesh.ready(spares=0)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    stages = mesh.in_plan()
    before = {d.index: _expired(d) for d in stages}
    survivors = [d for d in mesh.alive() if d is not coordinator]
    tasks_before = tasks_of(survivors)
    streams = [Stream(coordinator, op(prompt, 400)) for _ in range(4)]
    wait_until(
        lambda: all(d.status()["sessions_hosted"] == len(streams) for d in stages),
        30,
        "every stream's session open on every stage",
        poll_s=0.05,
    )
    assert all(d.status()["kv_used_bytes"] > 0 for d in stages)
    killed_at = time.monotonic()
    coordinator.kill()
    mesh.gone.add(COORDINATOR_ONLY)
    freed_s = wait_until(lambda: no_sessions_left(stages), LEASE_S + 10, "sessions freed")
    print(f"coordinator SIGKILL: stages freed every session {freed_s:.2f} s later")
    assert time.monotonic() - killed_at <= LEASE_S + 1.0  # + one status round per stage
    for d in stages:
        after = _expired(d)
        freed = sum(after.values()) - sum(before[d.index].values())
        assert freed == len(streams), (d.name, before[d.index], after)
    for s in streams:
        s.thread.join(30)
        assert s.error is not None  # the coordinator's socket went with it
    # Nor any task: the sessions' and the dead coordinator's lanes' tasks end.
    settled_s = wait_tasks_back(survivors, tasks_before)
    print(f"coordinator SIGKILL: survivors' tasks back {settled_s:.2f} s after the sessions")
    # The operator sees them: meshctl status (JSON above, and the table) and /metrics.
    stage = stages[0]
    expired = _expired(stage)
    table = meshctl("status", "--socket", stage.socket)
    assert f"coordinator_lost {expired['coordinator_lost']}" in table
    metrics = httpx.get(stage.api_url.removesuffix("/v1") + "/metrics", timeout=30).text
    line = 'meshd_stage_sessions_expired_total{cause="coordinator_lost"} '
    assert f"{line}{float(expired['coordinator_lost'])}" in metrics
    # The task count too (the HTTP request's own tasks differ from the control socket's).
    gauge = next(x for x in metrics.splitlines() if x.startswith("meshd_trio_tasks "))
    assert abs(float(gauge.split()[1]) - stage.status()["tasks"]) <= 5, gauge
    # The mesh serves at once: nothing is held for the dead coordinator.
    final = list(request_lines(stages[0].socket, op(prompt, 20), timeout_s=60))[-1]
    assert final["ok"] and final["tokens"] == reference(prompt, 20)
    # Restarted on its state dir, it comes back as the same node and serves.
    left_only_identity(coordinator, signal.SIGKILL)
    key = coordinator.key()
    mesh.ready(spares=0)
    back = mesh.daemons[COORDINATOR_ONLY]
    assert back.key() == key
    final = list(request_lines(back.socket, op(prompt, 20), timeout_s=60))[-1]
    assert final["ok"] and final["tokens"] == reference(prompt, 20), final


# ---- 2. a middle stage stops: SIGTERM against SIGKILL -----------------------------------------


def _stop_middle_stage(
    mesh: StopMesh, prompt: list[int], expected: list[int], how: signal.Signals
) -> tuple[float, float, Daemon]:
    """Stop the route's middle stage mid-generation; (to next token, stall, victim).

    The stall is the longest gap between tokens that began within `GRACE_S + 2` s of the
    signal: a crash's recovery starts at once, a stop's hand-over at the end of its grace; later
    gaps are the shared machine's noise, not the signal's doing.
    """
    route = mesh.in_plan()
    victim, downstream = route[1], route[2]
    coordinator = route[0]
    lapsed_before = _expired(downstream)["lease_lapsed"]
    survivors = [d for d in mesh.alive() if d is not victim]
    tasks_before = tasks_of(survivors)
    stream = Stream(coordinator, op(prompt, len(expected)))
    wait_until(lambda: len(stream.token_times()) >= 10, 60, "the first tokens", poll_s=0.02)
    stopped_at = time.monotonic()
    victim.proc.send_signal(how)
    final = stream.final()
    assert final["ok"], final
    assert final["tokens"] == expected
    after = [t for t in stream.token_times() if t > stopped_at]
    assert after, "the generation ended before the signal"
    starts = [stopped_at, *after]
    gaps = [b - a for a, b in zip(starts, after, strict=False) if a <= stopped_at + GRACE_S + 2]
    wait_until(lambda: victim.proc.poll() is not None, GRACE_S + 20, f"{victim.name} to exit")
    mesh.gone.add(victim.index)
    if how is signal.SIGTERM:
        assert victim.proc.returncode == 0, victim.log_tail(2000)
    left_only_identity(victim, how)
    others = [d for d in mesh.alive() if d.index != COORDINATOR_ONLY]
    wait_until(lambda: no_sessions_left(others), LEASE_S + 10, "no session on any stage")
    # The stage after the stopped one was told to close: its lease never had to lapse.
    assert _expired(downstream)["lease_lapsed"] == lapsed_before
    spares = [d for d in survivors if d not in route]
    wait_tasks_back(survivors, tasks_before, took_stage=spares)
    return after[0] - stopped_at, max(gaps), victim


def test_sigterm_of_a_middle_stage_is_no_slower_than_sigkill(
    mesh: StopMesh, prompt: list[int]
) -> None:
    mesh.ready(spares=1)
    expected = reference(prompt, 150)
    term_next, term_stall, victim = _stop_middle_stage(mesh, prompt, expected, signal.SIGTERM)
    # The stopped node comes back as the spare for the SIGKILL round.
    back = mesh.start(victim.index)
    started([back])
    keys = {d.key() for d in mesh.alive()}
    wait_until(lambda: all(d.alive_members() == keys for d in mesh.alive()), 30, "it rejoins")
    kill_next, kill_stall, _ = _stop_middle_stage(mesh, prompt, expected, signal.SIGKILL)
    print(
        f"middle stage: SIGTERM -> next token {term_next:.3f} s, stall "
        f"{term_stall:.3f} s; SIGKILL -> next token {kill_next:.3f} s, stall "
        f"{kill_stall:.3f} s"
    )
    # A crash costs at least the dead-lane verdict (1.2 s here) on top of what a stop's
    # hand-over costs; 20 % margin for a shared machine's noise (medians of two runs of
    # scripts/stop_timings.py: 0.49 s against 1.84 s, and 1.22 s against 2.68 s at load 20).
    # The next token alone says little: one already computed may still arrive after a kill.
    assert term_stall <= 1.2 * kill_stall


# ---- 3. a coordinator stops mid-stream ---------------------------------------------------------


def _sse(api: str, body: dict[str, Any], events: list[tuple[float, str]]) -> None:
    with httpx.stream("POST", f"{api}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line.removeprefix("data: ")))


def test_sigterm_of_a_coordinator_ends_its_stream_with_an_error_and_admits_nothing(
    mesh: StopMesh, prompt: list[int]
) -> None:
    mesh.ready(spares=0)
    route = mesh.in_plan()
    coordinator = route[0]
    survivors = [d for d in mesh.alive() if d is not coordinator]
    tasks_before = tasks_of(survivors)
    body = {
        "model": "meshd-builtin", "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
        "stream": True,
        "meshd": {"speculative": {"strategy": "disabled"}, "ignore_eos": True},
    }  # fmt: skip
    events: list[tuple[float, str]] = []
    thread = threading.Thread(target=_sse, args=(coordinator.api_url, body, events), daemon=True)
    thread.start()
    whole: list[httpx.Response] = []
    whole_thread = threading.Thread(
        target=lambda: whole.append(
            httpx.post(f"{coordinator.api_url}/completions", json={**body, "stream": False},
                       timeout=60)
        ),
        daemon=True,
    )  # fmt: skip
    whole_thread.start()
    wait_until(lambda: len(events) >= 10, 60, "the stream's first chunks", poll_s=0.02)
    wait_until(
        lambda: coordinator.status()["sessions_coordinated"] == 2, 30, "both requests running"
    )
    signalled_at = time.monotonic()
    coordinator.proc.send_signal(signal.SIGTERM)
    refused = httpx.post(
        f"{coordinator.api_url}/completions",
        json={**body, "stream": False, "max_tokens": 5},
        timeout=30,
    )
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "service_unavailable"
    thread.join(GRACE_S + 30)
    assert not thread.is_alive()
    payloads = [p for _, p in events]
    assert payloads[-1] == "[DONE]", payloads[-3:]
    last = json.loads(payloads[-2])
    finished = last.get("choices") and last["choices"][0].get("finish_reason") == "length"
    assert finished or last["error"]["code"] == "service_unavailable", last
    # The request that was not streamed gets an OpenAI-shaped 503 instead of its text.
    whole_thread.join(30)
    assert whole and whole[0].status_code == 503, whole
    assert whole[0].json()["error"]["code"] == "service_unavailable"
    assert int(whole[0].headers["Retry-After"]) >= 1
    # Tokens kept coming after the signal while the grace lasted.
    assert any(t > signalled_at and '"text":"' in p for t, p in events[:-2])
    wait_until(lambda: coordinator.proc.poll() is not None, GRACE_S + 20, "the daemon to exit")
    mesh.gone.add(coordinator.index)
    assert coordinator.proc.returncode == 0, coordinator.log_tail(2000)
    others = [d for d in mesh.alive() if d.index != COORDINATOR_ONLY]
    wait_until(lambda: no_sessions_left(others), LEASE_S + 10, "no session on any stage")
    wait_tasks_back(survivors, tasks_before, took_stage=[d for d in survivors if d not in route])


# ---- 4. the spare dies, and a stage's lid closes ----------------------------------------------


def _noted_gone_at(d: Daemon, key: str, since_unix: float) -> float:
    """When `d` first noted member `key` suspected or dead at or after `since_unix`."""
    return min(
        e["at_unix_s"]
        for e in d.status()["events"]
        if e["node"] == key[:16]
        and e["kind"] in ("member-suspected", "member-died")
        and e["at_unix_s"] >= since_unix
    )


def _plan_keys(mesh: StopMesh) -> list[str]:
    return [d.key() for d in mesh.in_plan()]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_the_spare_dying_mid_generation_changes_nothing_the_user_sees(
    mesh: StopMesh, prompt: list[int], how: signal.Signals
) -> None:
    mesh.ready(spares=1)
    route = _plan_keys(mesh)
    spare = next(d for d in mesh.alive() if d.index != COORDINATOR_ONLY and d.key() not in route)
    expected = reference(prompt, 150)
    survivors = [d for d in mesh.alive() if d is not spare]
    tasks_before = tasks_of(survivors)
    stream = Stream(mesh.in_plan()[0], op(prompt, len(expected)))
    wait_until(lambda: len(stream.token_times()) >= 10, 60, "the first tokens", poll_s=0.02)
    spare.proc.send_signal(how)
    final = stream.final()
    assert final.get("ok") and final["tokens"] == expected, final
    wait_until(lambda: spare.proc.poll() is not None, GRACE_S + 20, f"{spare.name} to exit")
    mesh.gone.add(spare.index)
    if how is signal.SIGTERM:
        assert spare.proc.returncode == 0, spare.log_tail(2000)
        # A stopped daemon leaves its identity for the next start, not its control socket.
        assert not pathlib.Path(spare.socket).exists()
    left = {d.key() for d in mesh.alive()}
    wait_until(
        lambda: all(d.alive_members() == left for d in mesh.alive()), 30, "the spare seen gone"
    )
    assert _plan_keys(mesh) == route  # a spare holds no stage: nothing was re-planned
    wait_until(lambda: no_sessions_left(mesh.alive()), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(survivors, tasks_before)
    # What it left in its state dir; it comes back as the same node.
    left_only_identity(spare, how)
    key = spare.key()
    mesh.ready(spares=1)
    assert mesh.daemons[spare.index].key() == key
    assert mesh.daemons[spare.index].status()["stage_layers"] is None


def test_a_spare_whose_lid_closes_mid_generation_is_dropped_and_rejoins_as_the_spare(
    mesh: StopMesh, prompt: list[int]
) -> None:
    # Frozen, the spare answers no ping: every peer's lane to it goes silent, its relays
    # cannot reach it either, and it is declared dead; the generation never touched it.
    mesh.ready(spares=1)
    route = _plan_keys(mesh)
    spare = next(d for d in mesh.alive() if d.index != COORDINATOR_ONLY and d.key() not in route)
    # Long enough (900 tokens, 3-4 s alone) to run on past the verdict on the frozen spare.
    expected = reference(prompt, 900)
    nodes = mesh.alive()
    others = [d for d in nodes if d is not spare]
    tasks_before = tasks_of(nodes)
    stream = Stream(mesh.in_plan()[0], op(prompt, len(expected)))
    wait_until(lambda: len(stream.token_times()) >= 10, 60, "the first tokens", poll_s=0.02)
    spare.proc.send_signal(signal.SIGSTOP)
    frozen_at, frozen_unix = time.monotonic(), time.time()
    try:
        left = {d.key() for d in others}
        wait_until(
            lambda: all(d.alive_members() == left for d in others), 30, "the frozen spare dropped"
        )
        # When each peer noted it (its own clock, not this test's polling): its lanes'
        # verdict (1.2 s) and the relays' probe (0.5 s), plus gossip and a shared machine's
        # noise: seconds, not a suspicion timeout's tens.
        dropped_s = max(_noted_gone_at(d, spare.key(), frozen_unix) for d in others) - frozen_unix
        assert dropped_s <= 1.2 + 0.5 + 3.0
        final = stream.final()
        assert final.get("ok") and final["tokens"] == expected, final
        ended_s = stream.lines[-1][0] - frozen_at
        assert ended_s > dropped_s  # the generation ran on across the verdict
        print(
            f"spare lid closed: every peer dropped it {dropped_s:.2f} s after SIGSTOP, "
            f"the stream ended {ended_s:.2f} s after it"
        )
        stable = stable_plan([d for d in others if d.index != COORDINATOR_ONLY])
        assert [s["key"] for s in stable] == route  # a spare holds no stage: nothing re-planned
        assert no_sessions_left(others)
    finally:
        spare.proc.send_signal(signal.SIGCONT)
    # It wakes: every view counts it alive again, as the spare it was, holding nothing.
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 30, "it rejoins")
    assert spare.proc.poll() is None, spare.log_tail(2000)
    assert _plan_keys(mesh) == route
    status = spare.status()
    assert status["stage_layers"] is None
    assert status["sessions_hosted"] == 0 and status["kv_used_bytes"] == 0, status
    final = list(request_lines(spare.socket, op(prompt, 40), timeout_s=60))[-1]
    assert final["ok"] and final["tokens"] == reference(prompt, 40), final
    wait_until(lambda: no_sessions_left(nodes), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(nodes, tasks_before)


def test_a_stage_whose_lid_closes_is_replaced_and_rejoins_holding_nothing_when_it_opens(
    mesh: StopMesh, prompt: list[int]
) -> None:
    # SIGSTOP freezes the process as a suspended laptop is frozen: no packet, no timer, until
    # SIGCONT, when it wakes to a mesh that moved on without it.
    mesh.ready(spares=1)
    route = mesh.in_plan()
    victim, coordinator = route[1], route[0]
    expected = reference(prompt, 150)
    tasks_before = tasks_of(mesh.alive())
    spares = [d for d in mesh.alive() if d not in route]
    stream = Stream(coordinator, op(prompt, len(expected)))
    wait_until(lambda: len(stream.token_times()) >= 10, 60, "the first tokens", poll_s=0.02)
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        final = stream.final()
        assert final.get("ok") and final["tokens"] == expected, final
        others = [d for d in mesh.alive() if d is not victim]
        wait_until(
            lambda: (
                (plan := settled_plan(others)) is not None
                and victim.key() not in {s["key"] for s in plan}
            ),
            30,
            "a plan without the frozen node",
        )
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    # It wakes: every view counts it alive again, it keeps no session of the generation that
    # moved on, and the mesh answers with the same tokens as before.
    keys = {d.key() for d in mesh.alive()}
    wait_until(lambda: all(d.alive_members() == keys for d in mesh.alive()), 30, "it rejoins")
    assert victim.proc.poll() is None, victim.log_tail(2000)
    wait_until(lambda: no_sessions_left(mesh.alive()), LEASE_S + 10, "no session anywhere")
    final = list(request_lines(coordinator.socket, op(prompt, 40), timeout_s=60))[-1]
    assert final["ok"] and final["tokens"] == reference(prompt, 40), final
    wait_until(lambda: no_sessions_left(mesh.alive()), LEASE_S + 10, "no session anywhere")
    # The woken node, a spare now, holds no more tasks than before; the spare that took its
    # stage holds that stage's.
    wait_tasks_back(mesh.alive(), tasks_before, took_stage=spares)


# ---- 6. a coordinator's lid closes mid-stream -------------------------------------------------


def test_a_coordinator_whose_lid_closes_mid_stream_is_freed_and_wakes_without_wedging(
    mesh: StopMesh, prompt: list[int]
) -> None:
    mesh.ready(spares=0)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    stages = mesh.in_plan()
    nodes = mesh.alive()
    before = {d.index: _expired(d) for d in stages}
    tasks_before = tasks_of(nodes)
    expected = reference(prompt, 200)
    streams = [Stream(coordinator, op(prompt, len(expected))) for _ in range(2)]
    wait_until(
        lambda: all(d.status()["sessions_hosted"] == len(streams) for d in stages),
        30,
        "every stream's session open on every stage",
        poll_s=0.05,
    )
    # Frozen, it renews no lease and answers no ping: every stage frees its sessions.
    coordinator.proc.send_signal(signal.SIGSTOP)
    try:
        freed_s = wait_until(lambda: no_sessions_left(stages), LEASE_S + 10, "sessions freed")
        print(f"coordinator lid closed: stages freed every session {freed_s:.2f} s later")
        for d in stages:
            freed = sum(_expired(d).values()) - sum(before[d.index].values())
            assert freed == len(streams), (d.name, before[d.index], _expired(d))
    finally:
        coordinator.proc.send_signal(signal.SIGCONT)
    # Awake, it finds every lane dead on its side (its clock ran on while it was frozen): it
    # dials again and re-routes its requests, which end as if nothing happened, and it serves
    # the next one at once (it once refused every request for `suspect_hold_s`, 10 s).
    woke = time.monotonic()
    for s in streams:
        final = s.final()
        assert final.get("ok") and final["tokens"] == expected, final
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 30, "it rejoins")
    final = list(request_lines(coordinator.socket, op(prompt, 40), timeout_s=60))[-1]
    assert final["ok"] and final["tokens"] == reference(prompt, 40), final
    print(f"coordinator lid opened: streams done and a new request served in "
          f"{time.monotonic() - woke:.2f} s")  # fmt: skip
    wait_until(lambda: no_sessions_left(nodes), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(nodes, tasks_before)
