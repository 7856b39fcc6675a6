"""Session leases: the sans-IO bookkeeping on a virtual `now`, the stage host's driver on
trio's mock clock, and a real in-process pipeline where a slow client keeps its session only
because its coordinator renews the lease."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import pytest
import torch
import trio
import trio.testing

from meshd.coord.coordinator import Coordinator, GenerationRequest, RouteFailed
from meshd.coord.local import open_local_pipeline
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.plan.route import Route
from meshd.speculative.config import SpecConfig
from meshd.stage.host import COORDINATOR_LOST, LEASE_LAPSED, StageHost
from meshd.stage.leases import Leases
from protocol.messages import Message, OpenSession, SessionKeepAlive, StageError
from tests.stage.outbox import Outbox

COORD = b"c" * 32
OTHER = b"o" * 32
NEXT = b"n" * 32


# ---- the state machine, on a plain virtual now ----------------------------------------------


def test_a_lease_lapses_lease_s_after_its_last_touch() -> None:
    leases = Leases(10.0)
    assert leases.next_deadline() is None and leases.expired(1e9) == []
    leases.touch("a", now=0.0)
    leases.touch("b", now=4.0)
    assert leases.next_deadline() == 10.0
    assert leases.expired(9.99) == []
    leases.touch("a", now=9.0)  # renewed just in time
    assert leases.next_deadline() == 14.0
    assert leases.expired(14.0) == ["b"]
    assert "b" not in leases and "a" in leases and len(leases) == 1
    assert leases.expired(18.99) == []
    assert leases.expired(19.0) == ["a"]
    assert leases.next_deadline() is None


def test_expired_lists_the_oldest_deadline_first_and_forgets_them() -> None:
    leases = Leases(1.0)
    for i, sid in enumerate(["c", "a", "b"]):
        leases.touch(sid, now=float(i))
    assert leases.expired(100.0) == ["c", "a", "b"]
    assert leases.expired(100.0) == [] and len(leases) == 0


def test_a_late_or_repeated_touch_never_shortens_a_lease() -> None:
    leases = Leases(5.0)
    leases.touch("a", now=10.0)
    leases.touch("a", now=3.0)  # a message stamped earlier, handled later
    assert leases.deadline("a") == 15.0


def test_a_dropped_session_never_expires() -> None:
    leases = Leases(1.0)
    leases.touch("a", now=0.0)
    leases.drop("a")
    leases.drop("never-held")
    assert leases.expired(10.0) == [] and leases.next_deadline() is None


@pytest.mark.parametrize("lease_s", [0.0, -1.0, float("inf"), float("nan")])
def test_a_lease_must_be_a_positive_finite_time(lease_s: float) -> None:
    with pytest.raises(ValueError, match="lease_s"):
        Leases(lease_s)


# ---- the stage host's driver, on trio's mock clock ------------------------------------------


def _host(model_dir: pathlib.Path, lease_s: float) -> tuple[StageHost, Outbox]:
    stage = StageModel.load(Checkpoint.open(model_dir), 0, 3, device="cpu")
    outbox = Outbox()
    return StageHost(stage, outbox, use_thread=False, session_lease_s=lease_s), outbox


def _open(host: StageHost, sid: str, coordinator: bytes = COORD) -> None:
    message = OpenSession(sid, host.stage.model_id, 32, stage_index=0, coordinator=coordinator)
    host.handle(message, coordinator)


async def test_host_frees_a_session_whose_lease_lapses_and_keeps_a_renewed_one(
    model_dir: pathlib.Path, autojump_clock: trio.testing.MockClock
) -> None:
    host, outbox = _host(model_dir, lease_s=30.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run)
        _open(host, "renewed")
        _open(host, "silent")
        assert host.stage.kv.used_bytes > 0
        start = trio.current_time()
        for _ in range(30):  # 300 s of keep-alives every 10 s, for one of the two
            await trio.sleep(10.0)
            host.handle(SessionKeepAlive(["renewed"]), COORD)
            if host.has_session("silent"):
                assert trio.current_time() - start <= 30.0
        assert host.session_coordinators() == {"renewed": COORD}
        assert host.stats.sessions_expired == {COORDINATOR_LOST: 0, LEASE_LAPSED: 1}
        # Without keep-alives the renewed one lapses too, and its KV is freed.
        await trio.sleep(30.5)
        assert host.sessions == 0 and host.stage.kv.used_bytes == 0
        assert host.stats.sessions_expired[LEASE_LAPSED] == 2
        nursery.cancel_scope.cancel()
    assert not outbox.sent  # nobody asked about them: nothing to say


async def test_keep_alive_for_a_session_the_stage_no_longer_holds_answers_session_expired(
    model_dir: pathlib.Path, autojump_clock: trio.testing.MockClock
) -> None:
    host, outbox = _host(model_dir, lease_s=5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run)
        _open(host, "a")
        await trio.sleep(6.0)
        assert not host.has_session("a")
        host.handle(SessionKeepAlive(["a"]), COORD)
        await trio.testing.wait_all_tasks_blocked()  # the host has answered it
        nursery.cancel_scope.cancel()
    assert [(k, m.session, m.code) for k, m in outbox.sent if isinstance(m, StageError)] == [
        (COORD, "a", "session_expired")
    ]


async def test_a_lost_coordinator_s_sessions_are_freed_and_counted(
    model_dir: pathlib.Path,
) -> None:
    host, _ = _host(model_dir, lease_s=30.0)
    _open(host, "mine-1")
    _open(host, "theirs", coordinator=OTHER)
    _open(host, "mine-2")
    assert sorted(host.free_coordinator(COORD)) == ["mine-1", "mine-2"]
    assert host.session_coordinators() == {"theirs": OTHER}
    assert host.stats.sessions_expired == {COORDINATOR_LOST: 2, LEASE_LAPSED: 0}
    assert host.free_coordinator(COORD) == []
    # An explicit close is not an expiry.
    from protocol.messages import CloseSession

    host.handle(CloseSession("theirs"), OTHER)
    assert host.sessions == 0 and host.stage.kv.used_bytes == 0
    assert host.stats.sessions_expired == {COORDINATOR_LOST: 2, LEASE_LAPSED: 0}


async def test_prompt_cache_entries_are_dropped_with_a_lost_coordinator_or_next_stage(
    model_dir: pathlib.Path,
) -> None:
    # Only a coordinator's own index names the entries it asked for, and it forgets a route's
    # entries when a stage of it is lost: after either, nothing will ever hit them, and they
    # would hold the stage's memory until evicted.
    from protocol.messages import CloseSession

    host, _ = _host(model_dir, lease_s=30.0)
    host.stage.kv.cache_limit_bytes = 1 << 30
    prompt = torch.arange(3, 19)
    kept = (("mine", COORD, None, 7), ("theirs", OTHER, None, 8), ("routed", OTHER, NEXT, 9))
    for sid, coordinator, next_hop, entry in kept:
        message = OpenSession(sid, host.stage.model_id, 32, stage_index=0,
                              coordinator=coordinator, next_hop=next_hop)  # fmt: skip
        host.handle(message, coordinator)
        host.stage.forward(sid, 0, prompt)
        host.handle(CloseSession(sid, keep_entry=entry, keep_positions=16), coordinator)
    _open(host, "live", COORD)
    kv = host.stage.kv
    assert [kv.entry_positions(e) for e in (7, 8, 9)] == [16, 16, 16]
    one = kv.cache_bytes // 3
    assert host.free_coordinator(COORD) == ["live"]
    assert [kv.entry_positions(e) for e in (7, 8, 9)] == [0, 16, 16]
    assert host.free_coordinator(NEXT) == []  # the stage after this one on entry 9's route
    assert [kv.entry_positions(e) for e in (7, 8, 9)] == [0, 16, 0]
    assert kv.used_bytes == 0 and kv.cache_bytes == one
    assert kv.cache_stats.evictions == 0  # dropped with a lost node, not evicted for room
    # The other coordinator still opens from its entry.
    message = OpenSession("again", host.stage.model_id, 32, stage_index=0, coordinator=OTHER,
                          prefix_entry=8, prefix_positions=16)  # fmt: skip
    host.handle(message, OTHER)
    assert kv.cache_stats.hits == 1


# ---- a real pipeline (lanes, worker threads), a short lease and a slow client ---------------

LEASE_S = 0.6
SLOW_S = 4 * LEASE_S  # the client stops reading for four leases


def _request() -> GenerationRequest:
    return GenerationRequest(
        prompt=list(range(3, 20)), max_tokens=24, spec=SpecConfig(strategy="disabled")
    )


async def _ignore(tokens: list[int]) -> None:
    pass


async def _generate_with_a_pause(
    coordinator: Coordinator,
    route: Route,
    pause: trio.Event | None,
    paused: trio.Event | None = None,
) -> list[int]:
    """Generate; after the first tokens, `on_tokens` blocks until `pause` is set (or SLOW_S),
    setting `paused` as it starts to block."""
    got: list[int] = []
    blocked = False

    async def on_tokens(tokens: list[int]) -> None:
        nonlocal blocked
        got.extend(tokens)
        if not blocked:
            blocked = True
            if paused is not None:
                paused.set()
            if pause is None:
                await trio.sleep(SLOW_S)  # the slow client: what is being tested, not a wait
            else:
                await pause.wait()

    result = await coordinator.generate(route, _request(), on_tokens)
    assert result.tokens == got
    return got


async def test_keep_alives_keep_a_slow_client_s_session_beyond_the_lease(
    model_dir: pathlib.Path,
) -> None:
    async with open_local_pipeline(model_dir, 2, session_lease_s=LEASE_S) as pipe:
        with trio.fail_after(30):
            undisturbed = await pipe.coordinator.generate(pipe.route, _request(), _ignore)
            slow = await _generate_with_a_pause(pipe.coordinator, pipe.route, None)
        assert slow == undisturbed.tokens
        assert all(h.stats.sessions_expired[LEASE_LAPSED] == 0 for h in pipe.hosts)
        await _wait(lambda: all(h.sessions == 0 for h in pipe.hosts))


async def test_without_keep_alives_the_idle_session_is_freed_on_every_stage(
    model_dir: pathlib.Path,
) -> None:
    async with open_local_pipeline(model_dir, 2, session_lease_s=LEASE_S, keep_alive=False) as pipe:
        pipe.coordinator.reply_timeout_s = 2.0
        pause = trio.Event()
        failed: list[BaseException] = []

        async def run() -> None:
            try:
                await _generate_with_a_pause(pipe.coordinator, pipe.route, pause)
            except RouteFailed as exc:
                failed.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await _wait(
                lambda: all(h.stats.sessions_expired[LEASE_LAPSED] == 1 for h in pipe.hosts)
            )
            assert all(h.sessions == 0 and h.stage.kv.used_bytes == 0 for h in pipe.hosts)
            pause.set()
        assert failed, "the generation went on over freed sessions"


async def test_a_coordinator_learns_at_the_next_keep_alive_that_a_stage_freed_its_session(
    model_dir: pathlib.Path,
) -> None:
    async with open_local_pipeline(model_dir, 2, session_lease_s=LEASE_S) as pipe:
        pipe.coordinator.reply_timeout_s = 60.0  # only the keep-alive's answer can end it fast
        pause, paused = trio.Event(), trio.Event()
        failed: list[RouteFailed] = []

        async def run() -> None:
            try:
                await _generate_with_a_pause(pipe.coordinator, pipe.route, pause, paused)
            except RouteFailed as exc:
                failed.append(exc)

        last = pipe.hosts[-1]
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                # The client stops reading after the prefill's reply: nothing is in flight.
                await paused.wait()
                assert last.sessions == 1 and pipe.hosts[0].sessions == 1
                # The last stage loses the session (as if it had restarted) while the client
                # waits; within a lease the keep-alive tells the coordinator, before any window
                # could reach the stage and be refused.
                last.free_coordinator(pipe.route.keys[0])
                await trio.sleep(LEASE_S)
                pause.set()
        assert failed and "session_expired" in str(failed[0])
        await _wait(lambda: all(h.sessions == 0 for h in pipe.hosts))


class _DeadNode:
    """A sender whose messages to one node never arrive (a stage that died mid-request)."""

    def __init__(self, inner: object, dead: bytes) -> None:
        self.inner = inner
        self.dead = dead
        self.alive = True

    async def send(self, key: bytes, message: Message, stream: int = 1) -> None:
        if key == self.dead and not self.alive:
            await trio.sleep_forever()  # a dial that never completes
        await self.inner.send(key, message, stream)  # type: ignore[attr-defined]


async def test_the_close_reaches_the_stages_after_one_that_died(model_dir: pathlib.Path) -> None:
    async with open_local_pipeline(model_dir, 3, session_lease_s=60.0) as pipe:
        middle = pipe.route.keys[1]
        sender = _DeadNode(pipe.coordinator.sender, middle)
        pipe.coordinator.sender = sender
        scope = trio.CancelScope()

        async def on_tokens(tokens: Sequence[int]) -> None:
            sender.alive = False  # the middle stage dies ...
            scope.cancel()  # ... and the request ends (here: its client went away)

        with scope, trio.fail_after(30):
            await pipe.coordinator.generate(pipe.route, _request(), on_tokens)
        first, _, last = pipe.hosts
        # The dead stage cannot be told; the ones before and after it are, within the close's
        # bound, long before any lease would lapse.
        await _wait(lambda: first.sessions == 0 and last.sessions == 0, timeout_s=5.0)
        assert last.stage.kv.used_bytes == 0
        assert last.stats.sessions_expired == {COORDINATOR_LOST: 0, LEASE_LAPSED: 0}


class _SlowOpen:
    """A sender whose OpenSession to one node waits for `release` (a slow lane)."""

    def __init__(self, inner: object, slow: bytes) -> None:
        self.inner = inner
        self.slow = slow
        self.held = trio.Event()
        self.release = trio.Event()

    async def send(self, key: bytes, message: Message, stream: int = 1) -> None:
        if key == self.slow and isinstance(message, OpenSession):
            self.held.set()
            await self.release.wait()
        await self.inner.send(key, message, stream)  # type: ignore[attr-defined]


async def test_a_keep_alive_never_overtakes_the_open_it_renews(model_dir: pathlib.Path) -> None:
    async with open_local_pipeline(model_dir, 2, session_lease_s=60.0) as pipe:
        sender = _SlowOpen(pipe.coordinator.sender, pipe.route.keys[1])
        pipe.coordinator.sender = sender
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                result: list[list[int]] = []

                async def run() -> None:
                    done = await pipe.coordinator.generate(pipe.route, _request(), _ignore)
                    result.append(done.tokens)

                nursery.start_soon(run)
                await sender.held.wait()  # opened on stage 0, not yet on stage 1
                await pipe.coordinator.renew_leases()
                await _wait(lambda: pipe.hosts[0].sessions == 1)
                sender.release.set()
        assert result and len(result[0]) == _request().max_tokens


async def _wait(predicate: object, timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110
            await trio.sleep(0.01)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> object:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
