"""Every node of a mesh serving a real GGUF file can die at any moment: real daemons on loopback.

One mesh serves the module (SmolLM2-135M-Instruct.Q4_1, as stored): two stage daemons (a
budget that rules out one), a spare (whichever capable node the plan leaves out), and a
coordinator that can hold no stage (a 1-byte budget), every one with a short `session_lease_s`
and `graceful_timeout_s`, and a prompt-cache index of PREFIX_ENTRIES entries per route
(`stage.prefix_cache_entries`); the harness is test_stop.py's (`tests/node/stop_mesh.py`).
Each test first restarts what an earlier one stopped that it needs (`StopMesh.ready`), so the
tests pass alone and in any order. After each stop, crash or closed lid nothing is left
behind: no session or KV on any survivor, no prompt-cache entry that depends on the lost node,
none on a node that woke, every survivor's trio tasks back to their count from before, and in
a stopped daemon's state dir only its identity and the start-up caches.

1. SIGTERM of a stage mid-request: the stage serves its open session until the grace runs out,
   then stops it (`stage_stopped`) and the coordinator continues at once on the spare, which
   took the layers meanwhile: the request completes with the same tokens (it never fails). The
   stage after it drops the prompt-cache entry it kept on the route through it.
2. SIGKILL of the coordinator mid-stream (the node whose API got the request): the client's
   stream breaks off without `[DONE]`, the stages free its session, KV and the prompt-cache
   entries it had them keep within the lease, and another node's API gives the same text.
3. SIGKILL or SIGTERM of the spare mid-request: the same tokens, no recovery, the plan
   untouched (a stopped spare exits with status 0).
4. A closed lid (SIGSTOP past the dead-lane verdict, then SIGCONT) on a stage holding
   prompt-cache entries: the request completes on the spare with the same tokens, and the
   stage before it drops the entry it kept on the route through it; awake, the node rejoins
   every view and holds no session, KV or entry.
5. SIGTERM of the coordinator mid-stream: the stream ends with an error event and `[DONE]` when
   the grace runs out, the daemon exits with status 0, and the stages free its session, KV and
   the prompt-cache entry they kept for it (the others' entries stay).
6. Three prompts through one coordinator whose index holds two: every stage frees the first
   prompt's entry (`dropped` in `meshctl status` and /metrics), holds two more entries than
   before, and the first prompt again, prefilled in full, gives the same tokens.
7. With a draft model (the coordinator's `--speculative-draft-model`, the served file itself,
   strategy `draft-ngram`): SIGKILL of a stage mid-request recovers on the spare to the text
   plain greedy decoding gives, and 1., 2., 3. and 5. run with the draft as without; the
   draft drafts (its session open mid-request in `meshctl status`'s `draft`), the
   leftover checks above hold, and the coordinator's draft holds no session or KV once a
   request ends or recovers, its threads back to their count from before.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from meshd.cli.supervisor import (
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
)
from meshd.model.files import open_tokenizer
from meshd.node.control_client import request_lines
from tests.node.daemons import Daemon, tasks_of, wait_tasks_back
from tests.node.stop_mesh import (
    SseStream,
    StopMesh,
    Stream,
    complete,
    completion_body,
    left_only_identity,
    no_sessions_left,
    op,
    streamed_text,
    threads_of,
    wait_threads_back,
)

pytestmark = pytest.mark.slow

MODEL = (
    pathlib.Path(os.environ.get("MESHD_MODEL_CACHE", "~/.cache/meshd/models")).expanduser()
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPT = "Write a short story about a robot who learns to paint."
LEASE_S = 3.0
# Short, so that even on an idle machine a stream of STREAM_TOKENS outlasts a stop's grace.
GRACE_S = 0.5
# Prompt-cache entries each coordinator has a route's stages keep (`stage.prefix_cache_entries`):
# few, so that three prompts overflow the index.
PREFIX_ENTRIES = 2
FLAGS = (
    "--session-lease-s", str(LEASE_S), "--graceful-timeout-s", str(GRACE_S),
    "--stage-prefix-cache-entries", str(PREFIX_ENTRIES),
)  # fmt: skip
# Address numbers 71-74 (`loopback`) and a secret of its own: no other mesh joins this one.
SECRET = "meshd-gguf-kills-" + secrets.token_hex(8)
STAGE_NODES = (71, 72)
SPARE = 73
COORDINATOR_ONLY = 74
# A prompt of three whole prefill chunks (128 tokens) and a tail: every stage keeps an entry.
LONG_PROMPT_TOKENS = 400
# One whole chunk and a tail: every stage keeps an entry of one chunk's positions.
CHUNK_PROMPT_TOKENS = 140
# Long enough that a signal lands mid-request and the request outlives a stop's grace (GRACE_S):
# seconds even on an idle machine.
STREAM_TOKENS = 200


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StopMesh]:
    if not MODEL.exists():
        pytest.skip(f"{MODEL.name} is not cached (scripts/fetch_models)")
    m = StopMesh(
        tmp_path_factory.mktemp("gguf-kills"),
        secret=SECRET,
        budget=stage_budget(str(MODEL), len(STAGE_NODES)),
        extra=("--model", str(MODEL), *FLAGS),
        stage_nodes=STAGE_NODES,
        spare=SPARE,
        coordinator_only=COORDINATOR_ONLY,
        # The file itself as the draft: the one small model of its tokenizer the tests use.
        coordinator_extra=("--speculative-draft-model", str(MODEL)),
    )
    try:
        # All at once: the budget lets two nodes hold the model and rules out one, so the plan
        # has two stages and whichever capable node it leaves out is the spare.
        started([m.start(i) for i in (*STAGE_NODES, SPARE, COORDINATOR_ONLY)])
        keys = {d.key() for d in m.alive()}
        wait_until(lambda: all(d.alive_members() == keys for d in m.alive()), 30, "four members")
        assert len(m.in_plan()) == len(STAGE_NODES)
        yield m
    finally:
        kill_all(m.daemons.values())


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return open_tokenizer(MODEL).encode(PROMPT)


@pytest.fixture(scope="module")
def long_prompt(prompt: list[int]) -> list[int]:
    return (prompt * LONG_PROMPT_TOKENS)[:LONG_PROMPT_TOKENS]


def _generate(d: Daemon, prompt: list[int], max_tokens: int) -> list[int]:
    final = list(request_lines(d.socket, op(prompt, max_tokens), timeout_s=60))[-1]
    assert final["ok"], final
    return list(final["tokens"])


def _held(d: Daemon) -> tuple[int, int, int]:
    """(sessions, KV bytes of sessions, prompt-cache entries) the daemon's stage holds."""
    s = d.status()
    return s["sessions_hosted"], s["kv_used_bytes"], s["prefix_cache"]["entries"]


def _expired(d: Daemon) -> int:
    return sum(d.status()["sessions_expired"].values())


def _route_failures_since(coordinator: Daemon, since_unix_s: float) -> list[str]:
    return [
        e["detail"]
        for e in coordinator.status()["events"]
        if e["kind"] == "route-failed" and e["at_unix_s"] >= since_unix_s
    ]


def _plan_without(daemons: list[Daemon], key: str) -> bool:
    plan = settled_plan(daemons)
    return plan is not None and key not in {s["key"] for s in plan}


@pytest.fixture(scope="module")
def expected(mesh: StopMesh, prompt: list[int]) -> list[int]:
    """What the mesh answers to the streams' request with every node up."""
    mesh.ready(spares=1)
    return _generate(mesh.in_plan()[0], prompt, STREAM_TOKENS)


def _stream_until_tokens(coordinator: Daemon, prompt: list[int], strategy: str) -> Stream:
    stream = Stream(coordinator, op(prompt, STREAM_TOKENS, strategy))
    wait_until(lambda: len(stream.token_times()) >= 10, 60, "the first tokens", poll_s=0.02)
    return stream


def _draft_held(coordinator: Daemon) -> tuple[int, int]:
    """(sessions, KV bytes) the coordinator's draft model holds (`draft` in its status)."""
    draft = coordinator.status()["draft"]
    return draft["sessions"], draft["kv_used_bytes"]


def _drafting(coordinator: Daemon, strategy: str) -> None:
    """Mid-request: the coordinator's draft holds one session for it, or none without a draft."""
    sessions, kv = _draft_held(coordinator)
    assert (sessions, kv > 0) == ((0, False) if strategy == "disabled" else (1, True))


def _wait_draft_freed(coordinator: Daemon) -> None:
    """The request ended: its draft session and the KV it held are freed."""
    wait_until(lambda: _draft_held(coordinator) == (0, 0), 10, "the draft's session freed")


def _recoveries(d: Daemon) -> int:
    return int(d.status()["recoveries"])


# ---- 4. a stage's lid closes ------------------------------------------------------------------


def test_a_stage_whose_lid_closes_is_replaced_and_rejoins_holding_nothing(
    mesh: StopMesh, prompt: list[int], long_prompt: list[int], expected: list[int]
) -> None:
    # SIGSTOP freezes the process as a suspended laptop is frozen: no packet, no timer, until
    # SIGCONT, when it wakes to a mesh that moved on without it.
    mesh.ready(spares=1)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    route = mesh.in_plan()
    victim, spare = route[-1], mesh.spare()
    _generate(coordinator, long_prompt, 4)
    assert _held(victim)[2] >= 1  # it keeps a prompt-cache entry of the long prompt
    nodes = mesh.alive()
    others = [d for d in nodes if d is not victim]
    tasks_before = tasks_of(nodes)
    stream = _stream_until_tokens(coordinator, prompt, "disabled")
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        final = stream.final()
        assert final.get("ok") and final["tokens"] == expected, final
        gone = {d.key() for d in others}
        wait_until(lambda: all(d.alive_members() == gone for d in others), 30, "it is dropped")
        wait_until(
            lambda: _plan_without([d for d in mesh.capable() if d is not victim], victim.key()),
            30,
            "a plan without the frozen node",
        )
        assert spare.status()["stage_layers"] is not None
        # The stage before it drops the entry it kept on the route through it: the coordinator
        # forgot that route's index, so nothing would ever name the entry again.
        wait_until(lambda: _held(route[0])[2] == 0, 10, "the survivor's entry dropped")
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    # Awake, it rejoins every view and keeps nothing of the generation that moved on: no
    # session, no KV, no prompt-cache entry. (It woke still holding its layers, as the spare
    # that took them over does: the plans keep one of the two, and it may be the woken node.)
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 30, "it rejoins")
    assert victim.proc.poll() is None, victim.log_tail(2000)
    wait_until(lambda: _held(victim) == (0, 0, 0), LEASE_S + 10, "the woken node holding nothing")
    assert _generate(coordinator, prompt, 40) == expected[:40]
    wait_until(lambda: no_sessions_left(nodes), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(nodes, tasks_before, took_stage=[spare])


# ---- 1. a stage is stopped mid-request -------------------------------------------------------


@pytest.mark.parametrize("strategy", ["disabled", "draft-ngram"])
def test_sigterm_of_a_stage_mid_request_hands_it_over_with_the_same_tokens(
    mesh: StopMesh, prompt: list[int], long_prompt: list[int], expected: list[int], strategy: str
) -> None:
    mesh.ready(spares=1)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    route = mesh.in_plan()
    victim, spare = route[0], mesh.spare()
    _generate(coordinator, long_prompt, 4)
    assert _held(route[-1])[2] >= 1  # the last stage keeps an entry of the long prompt
    survivors = [d for d in mesh.alive() if d is not victim]
    tasks_before = tasks_of(survivors)
    recoveries_before = _recoveries(coordinator)
    started_at = time.time()
    stream = _stream_until_tokens(coordinator, prompt, strategy)
    _drafting(coordinator, strategy)
    signalled = time.monotonic()
    victim.proc.send_signal(signal.SIGTERM)
    final = stream.final()
    # The request never fails: the stage serves it through its grace, then stops it
    # (`stage_stopped`) and the coordinator goes on at once on the spare, which loaded the
    # layers meanwhile, to the same tokens.
    assert final.get("ok") and final["tokens"] == expected, final
    took_s = stream.lines[-1][0] - signalled
    print(f"stage SIGTERM: the request ended {took_s:.2f} s after the signal")
    assert took_s > GRACE_S, "the request ended within the grace"
    # Handed over, not drained: the stage stopped the session, and the coordinator recovered.
    failures = _route_failures_since(coordinator, started_at)
    assert any("stage_stopped" in f for f in failures), failures
    assert _recoveries(coordinator) > recoveries_before
    # The request's draft sessions, before and after the hand-over, are closed.
    _wait_draft_freed(coordinator)
    wait_until(lambda: victim.proc.poll() is not None, GRACE_S + 20, f"{victim.name} to exit")
    mesh.gone.add(victim.index)
    assert victim.proc.returncode == 0, victim.log_tail(2000)
    left_only_identity(victim, signal.SIGTERM)
    wait_until(lambda: _plan_without(mesh.capable(), victim.key()), 30, "a plan without it")
    assert spare in mesh.in_plan()
    # The stage after it drops the entry it kept on the route through it (the coordinator
    # forgot that route's index when the route failed).
    wait_until(lambda: _held(route[-1])[2] == 0, 10, "the survivor's entry dropped")
    wait_until(lambda: no_sessions_left(survivors), LEASE_S + 10, "no session anywhere")
    assert _generate(coordinator, prompt, 40) == expected[:40]
    wait_until(lambda: no_sessions_left(survivors), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(survivors, tasks_before, took_stage=[spare])
    assert _draft_held(coordinator) == (0, 0)


# ---- 3. the spare dies or stops ----------------------------------------------------------------


# The spare holds nothing of the request, so a draft model cannot meet its death: one draft
# variant (the harsher signal) checks that, not both (the suite's time is budgeted).
@pytest.mark.parametrize(
    ("how", "strategy"),
    [
        (signal.SIGKILL, "disabled"),
        (signal.SIGTERM, "disabled"),
        (signal.SIGKILL, "draft-ngram"),
    ],
    ids=["sigkill-disabled", "sigterm-disabled", "sigkill-draft-ngram"],
)
def test_the_spare_dying_or_stopping_mid_request_changes_nothing(
    mesh: StopMesh, prompt: list[int], expected: list[int], how: signal.Signals, strategy: str
) -> None:
    mesh.ready(spares=1)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    route = [d.key() for d in mesh.in_plan()]
    spare = mesh.spare()
    survivors = [d for d in mesh.alive() if d is not spare]
    tasks_before = tasks_of(survivors)
    recoveries_before = _recoveries(coordinator)
    started_at = time.time()
    stream = _stream_until_tokens(coordinator, prompt, strategy)
    _drafting(coordinator, strategy)
    spare.proc.send_signal(how)
    final = stream.final()
    assert final.get("ok") and final["tokens"] == expected, final
    _wait_draft_freed(coordinator)
    # Nothing in flight noticed: no route failed, nothing was recovered.
    assert _route_failures_since(coordinator, started_at) == []
    assert _recoveries(coordinator) == recoveries_before
    wait_until(lambda: spare.proc.poll() is not None, GRACE_S + 20, f"{spare.name} to exit")
    mesh.gone.add(spare.index)
    if how is signal.SIGTERM:
        assert spare.proc.returncode == 0, spare.log_tail(2000)
    left = {d.key() for d in survivors}
    wait_until(lambda: all(d.alive_members() == left for d in survivors), 30, "the spare seen gone")
    assert [d.key() for d in mesh.in_plan()] == route  # it held no stage: nothing re-planned
    wait_until(lambda: no_sessions_left(survivors), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(survivors, tasks_before)
    left_only_identity(spare, how)


# ---- 2. the coordinator dies mid-stream -------------------------------------------------------


def _draft_seconds(d: Daemon) -> float:
    """Seconds the daemon's coordinator spent in its draft model (`meshd_spec_draft_seconds`)."""
    metrics = httpx.get(d.api_url.removesuffix("/v1") + "/metrics", timeout=30).text
    lines = [ln for ln in metrics.splitlines() if ln.startswith("meshd_spec_draft_seconds_total ")]
    return float(lines[0].split()[1]) if lines else 0.0


@pytest.fixture(scope="module")
def expected_text(mesh: StopMesh, prompt: list[int]) -> str:
    """What the mesh's API answers to the streams' request without speculation (asked of a
    stage's API: the coordinator-only node's index stays untouched)."""
    mesh.ready(spares=1)
    return complete(mesh.in_plan()[0], prompt, STREAM_TOKENS, "disabled")


@pytest.mark.parametrize("strategy", ["disabled", "draft-ngram"])
def test_sigkill_of_the_coordinator_mid_stream_frees_its_sessions_and_entries(
    mesh: StopMesh, long_prompt: list[int], strategy: str
) -> None:
    coordinator = _fresh_coordinator(mesh)
    stages = mesh.in_plan()
    survivors = [d for d in mesh.alive() if d is not coordinator]
    expired_before = {d.name: _expired(d) for d in stages}
    # Entries other coordinators had the stages keep stay (another run's request through a
    # stage's API below); the ones the dead coordinator owns go with it.
    others = {d.name: _held(d)[2] for d in stages}
    # A first request through its API: every stage keeps an entry of the prompt for it.
    text = complete(coordinator, long_prompt, 40, "disabled")
    wait_until(lambda: all(_held(d)[2] == others[d.name] + 1 for d in stages), 10, "its entry kept")
    tasks_before = tasks_of(survivors)
    body = {**completion_body(coordinator, long_prompt, STREAM_TOKENS, strategy), "stream": True}
    stream = SseStream(coordinator, body)
    thread, events, errors = stream.thread, stream.events, stream.errors
    assert all(_held(d)[0] == 1 for d in stages)
    _drafting(coordinator, strategy)
    killed_at = time.monotonic()
    coordinator.kill()
    mesh.gone.add(COORDINATOR_ONLY)
    # The client's stream breaks off: an error, never a `[DONE]` that would pass it as whole.
    thread.join(30)
    assert not thread.is_alive()
    assert errors and "[DONE]" not in events, (errors, events[-3:])
    # What it streamed before is what plain greedy decoding gives, draft or not (the shorter
    # of the two texts begins the other).
    streamed = streamed_text(events)
    assert text.startswith(streamed) or streamed.startswith(text), (streamed, text)
    # Within the lease every stage frees the session, its KV and the entries kept for the dead
    # coordinator (nothing could ever name them again).
    wait_until(
        lambda: all(_held(d) == (0, 0, others[d.name]) for d in stages),
        LEASE_S + 10,
        "the dead coordinator's session and entries freed",
    )
    assert time.monotonic() - killed_at <= LEASE_S + 1.0  # + one status round per stage
    assert all(_expired(d) == expired_before[d.name] + 1 for d in stages)
    wait_tasks_back(survivors, tasks_before)
    left_only_identity(coordinator, signal.SIGKILL)
    # Another node's API serves the same prompt with the same text.
    assert complete(stages[0], long_prompt, 40, "disabled") == text


def _fresh_coordinator(mesh: StopMesh) -> Daemon:
    """The coordinator-only node, alive and with an empty prompt-cache index (it never looked a
    prompt up): restarted, after every survivor saw it go (which frees what the stages kept
    for it), when it has served a request since it started."""
    mesh.ready(spares=0)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    if coordinator.status()["prefix_cache"]["lookups"] == 0:
        return coordinator
    coordinator.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: coordinator.proc.poll() is not None, GRACE_S + 20, "the coordinator to stop")
    mesh.gone.add(COORDINATOR_ONLY)
    left = {d.key() for d in mesh.alive()}
    wait_until(lambda: all(d.alive_members() == left for d in mesh.alive()), 30, "it is gone")
    mesh.ready(spares=0)
    return mesh.daemons[COORDINATOR_ONLY]


def _entries(d: Daemon) -> tuple[int, int]:
    """(prompt-cache entries held, entries dropped since start) of the daemon's stage."""
    cache = d.status()["prefix_cache"]
    return cache["entries"], cache["dropped"]


# ---- 5. the coordinator stops mid-stream ------------------------------------------------------


@pytest.mark.parametrize("strategy", ["disabled", "draft-ngram"])
def test_sigterm_of_the_coordinator_mid_stream_frees_its_sessions_and_entries(
    mesh: StopMesh, prompt: list[int], long_prompt: list[int], expected_text: str, strategy: str
) -> None:
    coordinator = _fresh_coordinator(mesh)
    stages = mesh.in_plan()
    survivors = [d for d in mesh.alive() if d is not coordinator]
    # Entries other coordinators had the stages keep stay; the ones it owns go with it.
    others = {d.name: _held(d)[2] for d in stages}
    _generate(coordinator, long_prompt, 4)
    wait_until(lambda: all(_held(d)[2] == others[d.name] + 1 for d in stages), 10, "its entry kept")
    if strategy != "disabled":
        complete(coordinator, prompt, 16, strategy)
        assert _draft_seconds(coordinator) > 0  # its draft model drafts
        _wait_draft_freed(coordinator)
    tasks_before = tasks_of(survivors)
    body = {**completion_body(coordinator, prompt, STREAM_TOKENS, strategy), "stream": True}
    stream = SseStream(coordinator, body)
    thread, events, errors = stream.thread, stream.events, stream.errors
    assert all(_held(d)[0] == 1 for d in stages)
    _drafting(coordinator, strategy)
    coordinator.proc.send_signal(signal.SIGTERM)
    # The stream ends when the grace runs out, with an error event and `[DONE]`: never a silent
    # cut, never a stream that passes as whole.
    thread.join(GRACE_S + 30)
    assert not thread.is_alive() and not errors, errors
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["code"] == "service_unavailable", events[-3:]
    # What it streamed before is what plain greedy decoding gives, draft or not.
    streamed = streamed_text(events[:-2])
    assert streamed and expected_text.startswith(streamed), (streamed, expected_text)
    wait_until(lambda: coordinator.proc.poll() is not None, GRACE_S + 20, "the daemon to exit")
    mesh.gone.add(COORDINATOR_ONLY)
    assert coordinator.proc.returncode == 0, coordinator.log_tail(2000)
    left_only_identity(coordinator, signal.SIGTERM)
    # Every stage frees the stopped coordinator's session, its KV and the entry it kept for it
    # (nothing could ever name it again).
    wait_until(
        lambda: all(_held(d) == (0, 0, others[d.name]) for d in stages),
        LEASE_S + 10,
        "the stopped coordinator's session and entry freed",
    )
    wait_tasks_back(survivors, tasks_before)


# ---- 6. the coordinator's index overflows -----------------------------------------------------


def test_an_entry_the_coordinators_index_drops_is_freed_on_every_stage(mesh: StopMesh) -> None:
    coordinator = _fresh_coordinator(mesh)
    stages = mesh.in_plan()
    tokenizer = open_tokenizer(MODEL)
    first, second, third = (
        (tokenizer.encode(text) * CHUNK_PROMPT_TOKENS)[:CHUNK_PROMPT_TOKENS]
        for text in ("The tide came in at noon. ", "A fox ran past the mill. ", "def f(x): ")
    )
    before = {d.name: _entries(d) for d in stages}

    def each_stage(entries: int, dropped: int) -> bool:
        return all(
            _entries(d) == (before[d.name][0] + entries, before[d.name][1] + dropped)
            for d in stages
        )

    answer = _generate(coordinator, first, 8)
    _generate(coordinator, second, 8)
    _generate(coordinator, third, 8)
    # The index holds PREFIX_ENTRIES (`stage.prefix_cache_entries`): the third prompt's entry
    # pushed the first prompt's out, and every stage freed it when told.
    wait_until(lambda: each_stage(PREFIX_ENTRIES, 1), 10, "the first prompt's entry dropped")
    hits = coordinator.status()["prefix_cache"]["hits"]
    # The first prompt again: prefilled in full (its entry is gone), to the same tokens; its
    # new entry pushes the second prompt's out in turn.
    assert _generate(coordinator, first, 8) == answer
    assert coordinator.status()["prefix_cache"]["hits"] == hits
    wait_until(lambda: each_stage(PREFIX_ENTRIES, 2), 10, "the second prompt's entry dropped")
    # /metrics counts them as `meshctl status` does.
    stage = stages[0]
    metrics = httpx.get(stage.api_url.removesuffix("/v1") + "/metrics", timeout=30).text
    assert f"meshd_prefix_cache_dropped_total {float(_entries(stage)[1])}" in metrics


# ---- 7. a stage dies mid-request under a coordinator that drafts with a draft model ------------


def test_sigkill_of_a_stage_mid_request_with_a_draft_model_recovers_to_the_same_text(
    mesh: StopMesh, prompt: list[int], long_prompt: list[int], expected_text: str
) -> None:
    mesh.ready(spares=1)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    route = mesh.in_plan()
    victim, spare = route[-1], mesh.spare()
    _generate(coordinator, long_prompt, 4)
    assert _held(route[0])[2] >= 1  # the first stage keeps an entry of the long prompt
    survivors = [d for d in mesh.alive() if d is not victim]
    tasks_before = tasks_of(survivors)
    threads_before = threads_of(coordinator)
    draft_s = _draft_seconds(coordinator)
    recoveries_before = _recoveries(coordinator)
    started_at = time.time()
    body = {**completion_body(coordinator, prompt, STREAM_TOKENS, "draft-ngram"), "stream": True}
    stream = SseStream(coordinator, body)
    thread, events, errors = stream.thread, stream.events, stream.errors
    _drafting(coordinator, "draft-ngram")
    victim.kill()
    mesh.gone.add(victim.index)
    # The request never fails: the coordinator re-routes it through the spare (a crash costs
    # the dead-lane verdict), and the draft, which lives on the coordinator, drafts on.
    thread.join(90)
    assert not thread.is_alive() and not errors, errors
    assert events[-1] == "[DONE]", events[-3:]
    assert streamed_text(events[:-1]) == expected_text
    assert _route_failures_since(coordinator, started_at)
    assert _recoveries(coordinator) > recoveries_before
    assert _draft_seconds(coordinator) > draft_s  # the draft model drafted for it
    # Its draft sessions, on the failed route and on the spare's, are closed.
    _wait_draft_freed(coordinator)
    wait_until(lambda: victim.proc.poll() is not None, 10, f"{victim.name} to exit")
    left_only_identity(victim, signal.SIGKILL)
    wait_until(lambda: _plan_without(mesh.capable(), victim.key()), 30, "a plan without it")
    assert spare in mesh.in_plan()
    # The stage before it drops the entry it kept on the route through it.
    wait_until(lambda: _held(route[0])[2] == 0, 10, "the survivor's entry dropped")
    wait_until(lambda: no_sessions_left(survivors), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(survivors, tasks_before, took_stage=[spare])
    # Nothing the draft's passes started outlives the request (on a node given one thread, the
    # draft computes on one: no OpenMP workers either).
    wait_threads_back(coordinator, threads_before)


def test_a_draft_model_prefilling_a_long_prompt_keeps_the_coordinators_lanes(
    mesh: StopMesh, long_prompt: list[int]
) -> None:
    mesh.ready(spares=1)
    coordinator = mesh.daemons[COORDINATOR_ONLY]
    nodes = mesh.alive()
    tasks_before = tasks_of(nodes)
    threads_before = threads_of(coordinator)
    started_at = time.time()
    done: list[str] = []

    def run() -> None:
        with contextlib.suppress(httpx.HTTPError, AssertionError):  # the module ends it
            done.append(complete(coordinator, long_prompt, 8, "draft-ngram"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    # A draft pass over the prompt's LONG_PROMPT_TOKENS positions takes seconds on one thread.
    wait_until(
        lambda: bool(done) or bool(_route_failures_since(coordinator, started_at)),
        60,
        "the request to end or its route to fail",
    )
    assert _route_failures_since(coordinator, started_at) == []
    thread.join(60)
    assert done
    _wait_draft_freed(coordinator)
    wait_until(lambda: no_sessions_left(nodes), LEASE_S + 10, "no session anywhere")
    wait_tasks_back(nodes, tasks_before)
    wait_threads_back(coordinator, threads_before)
