"""The coordinator's prefix index and the window loop's hit and miss, sans-IO (plain `now`)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from meshd.coord.coordinator import MAX_PREFIX_ROUTES, Coordinator
from meshd.coord.generation import GenerationRequest, RouteFailed
from meshd.coord.prefix_index import BLOCK_TOKENS, KeepPlan, PrefixHit, PrefixIndex
from meshd.coord.route_costs import RouteCosts
from meshd.coord.window_loop import WindowLoop
from meshd.plan.route import Route, RouteStage
from meshd.speculative.config import SpecConfig
from meshd.speculative.strategies import make_proposer
from protocol.messages import (
    MAX_DROP_ENTRIES,
    PREFIX_MISS,
    PREFIX_MISS_EPOCH,
    DropEntries,
    OpenSession,
    Rollback,
    StageError,
    VerifyReply,
    VerifyWindow,
)

CHUNK = 64


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_exact_lookup_reuses_whole_prompt_chunks_of_the_longest_match() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK)
    short, long = tokens(100), tokens(300)
    index.record(1, index.plan_keep(short, len(short), None) or pytest.fail())
    # A prompt of 300 tokens that ran 20 more: positions of whole prompt chunks are exact.
    plan = index.plan_keep(long + tokens(20, 9000), len(long), None)
    assert plan is not None and plan.exact == 256
    assert len(plan.tokens) == 256  # exact reuse keeps no position it would never reuse
    index.record(2, plan)
    hit = index.lookup([*long, *tokens(50, 7000)])
    assert hit == PrefixHit(2, 256, 256)
    # A prompt that strays at 150 reuses the two whole chunks before it, from either entry.
    stray = [*long[:150], *tokens(60, 5000)]
    found = index.lookup(stray)
    assert found is not None and found.positions == 128


def test_a_hit_leaves_at_least_one_token_and_needs_a_whole_block() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK, exact=False)
    prompt = tokens(200)
    index.record(7, KeepPlan(tuple(prompt), exact=192))
    assert index.lookup(prompt) == PrefixHit(7, 199, 192)  # the same prompt again
    assert index.lookup([*prompt[: BLOCK_TOKENS - 1], 5]) is None
    assert index.lookup(tokens(200, 1)) is None  # nothing in common


def test_not_exact_reuses_decoded_tokens_too() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK, exact=False)
    prompt, reply = tokens(100), tokens(30, 8000)
    plan = index.plan_keep([*prompt, *reply], len(prompt), None)
    assert plan is not None and plan.exact == 64
    index.record(3, plan)
    turn2 = [*prompt, *reply, *tokens(10, 6000)]
    assert index.lookup(turn2) == PrefixHit(3, 130, 64)
    exact = PrefixIndex(chunk_tokens=CHUNK)
    exact.record(3, plan)
    assert exact.lookup(turn2) == PrefixHit(3, 64, 64)


def test_keep_after_a_hit_replaces_the_entry_it_covers() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK)
    turn1 = tokens(150)
    index.record(1, index.plan_keep(turn1, 150, None) or pytest.fail())
    turn2 = [*turn1, *tokens(90, 4000)]
    hit = index.lookup(turn2)
    assert hit == PrefixHit(1, 128, 128)
    plan = index.plan_keep(turn2, len(turn2), hit)
    assert plan is not None and plan.replaces == 1 and plan.exact == 192
    assert index.record(2, plan) == [1]
    assert 1 not in index and 2 in index and len(index) == 1
    # A hit that was not chunk-aligned (not exact) keeps only its exact part as exact.
    loose = PrefixIndex(chunk_tokens=CHUNK, exact=False)
    plan = loose.plan_keep(turn2, len(turn2), PrefixHit(9, 149, 128))
    assert plan is not None and plan.exact == 128 and plan.replaces == 0


def test_index_is_bounded_least_recently_used_first_and_forgets() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK, max_entries=2)
    a, b, c = tokens(80, 100), tokens(80, 300), tokens(80, 500)
    for entry, prompt in ((1, a), (2, b)):
        index.record(entry, KeepPlan(tuple(prompt), 64))
    assert index.lookup([*a, 1]) is not None  # 1 is now the most recently used
    assert index.record(3, KeepPlan(tuple(c), 64)) == [2]
    assert index.lookup([*b, 1]) is None
    assert index.forget(1) and not index.forget(1)
    assert index.lookup([*a, 1]) is None and index.lookup([*c, 1]) is not None


def test_every_way_out_of_the_index_reports_the_entry() -> None:
    index = PrefixIndex(chunk_tokens=CHUNK, max_entries=2)
    turn1 = tokens(150)
    assert index.record(1, index.plan_keep(turn1, 150, None) or pytest.fail()) == []
    turn2 = [*turn1, *tokens(90, 4000)]
    plan = index.plan_keep(turn2, len(turn2), index.lookup(turn2))
    assert plan is not None and plan.replaces == 1
    assert index.record(2, plan) == [1]  # replaced by the longer prefix
    assert index.record(3, KeepPlan(tuple(tokens(80, 300)), 64)) == []
    # The least recently used goes (the hit on 3 made 2 the oldest), then the replaced one.
    turn3 = [*tokens(80, 300), *tokens(70, 6000)]
    plan = index.plan_keep(turn3, len(turn3), index.lookup(turn3))
    assert plan is not None and plan.replaces == 3
    assert index.record(4, KeepPlan(tuple(tokens(80, 500)), 64)) == [2]
    assert index.record(5, plan) == [3]
    assert index.record(6, KeepPlan(tuple(tokens(80, 700)), 64)) == [4]
    assert index.forget(5) and not index.forget(5)
    assert index.clear() == [6] and len(index) == 0 and index.clear() == []
    assert index.lookup(turn3) is None


ROUTE = Route("m", (RouteStage(b"a" * 32, 0, 3), RouteStage(b"b" * 32, 3, 6)))


def make_loop(prompt_len: int, hit: PrefixHit | None, mtp_depth: int = 0) -> WindowLoop:
    spec = SpecConfig(strategy="auto")
    request = GenerationRequest(prompt=tokens(prompt_len), max_tokens=4, mtp_depth=mtp_depth)
    return WindowLoop(
        session="s",
        route=ROUTE,
        request=request,
        proposer=make_proposer("auto", spec),
        costs=RouteCosts(stages=2),
        coordinator_key=b"c" * 32,
        prefill_chunk_tokens=CHUNK,
        prefix=hit,
    )


def test_a_hit_opens_from_the_entry_and_prefills_the_rest_in_aligned_chunks() -> None:
    loop = make_loop(200, PrefixHit(5, 128, 128), mtp_depth=2)
    sends = loop.start(tokens(200), now=0.0)
    opens = [m for _, m in sends if isinstance(m, OpenSession)]
    assert [(o.prefix_entry, o.prefix_positions) for o in opens] == [(5, 128)] * 2
    assert all(o.mtp_depth == 0 for o in opens)  # MTP KV is not kept: a hit runs without
    windows = [m for _, m in sends if isinstance(m, VerifyWindow)]
    assert [(w.base_pos, len(w.tokens), w.sample) for w in windows] == [
        (128, 64, False),
        (192, 8, True),
    ]
    reply = VerifyReply("s", windows[-1].window_id, 0, 0, 42, [], [])
    loop.on_reply(reply, now=0.5)
    assert loop.cached_tokens == 128 and loop.committed == [42]
    # Cold: chunks from 0, as before.
    cold = make_loop(200, None).start(tokens(200), now=0.0)
    bases = [m.base_pos for _, m in cold if isinstance(m, VerifyWindow)]
    assert bases == [0, 64, 128, 192]


def test_a_miss_rolls_every_stage_to_epoch_1_and_prefills_in_full() -> None:
    loop = make_loop(200, PrefixHit(5, 128, 128))
    loop.start(tokens(200), now=0.0)
    miss = StageError("s", PREFIX_MISS, "gone")
    sends = loop.on_reply(miss, now=0.1)
    rollbacks = [(k, m) for k, m in sends if isinstance(m, Rollback)]
    assert rollbacks == [(k, Rollback("s", PREFIX_MISS_EPOCH)) for k in ROUTE.keys]
    windows = [m for _, m in sends if isinstance(m, VerifyWindow)]
    assert [w.base_pos for w in windows] == [0, 64, 128, 192]
    assert {w.epoch for w in windows} == {PREFIX_MISS_EPOCH}
    # The other stage's miss, and a stale reply of the hit's epoch, change nothing.
    assert loop.on_reply(StageError("s", PREFIX_MISS, "gone"), now=0.2) == []
    assert loop.on_reply(VerifyReply("s", 2, 0, 0, 9, [], []), now=0.3) == []
    loop.on_reply(VerifyReply("s", windows[-1].window_id, 1, 0, 42, [], []), now=0.4)
    assert loop.committed == [42] and loop.cached_tokens == 0 and loop.prefix_missed


def test_an_older_stage_gap_error_on_a_hit_window_is_a_miss_other_errors_fail() -> None:
    loop = make_loop(200, PrefixHit(5, 128, 128))
    sent = loop.start(tokens(200), now=0.0)
    first = next(m for _, m in sent if isinstance(m, VerifyWindow))
    gap = StageError("s", "SessionError", "would leave a gap", window_id=first.window_id)
    assert any(isinstance(m, Rollback) for _, m in loop.on_reply(gap, now=0.1))
    with pytest.raises(RouteFailed):
        loop.on_reply(StageError("s", "InvalidInput", "bad"), now=0.2)


class _NoNetwork:
    """The coordinator's sender, never used by what these tests call."""

    async def send(self, key: bytes, message: object, stream: int = 1) -> None:
        raise AssertionError("no message is sent here")


def test_the_coordinator_prefers_the_route_holding_the_longest_prefix() -> None:
    coordinator = Coordinator(_NoNetwork(), b"c" * 32, prefill_chunk_tokens=CHUNK)
    other = Route("m", (RouteStage(b"x" * 32, 0, 6),))
    prompt = tokens(300)
    assert coordinator.prefer_route([ROUTE, other], prompt) is ROUTE  # none holds any
    index = coordinator.prefix_index(other)
    index.record(1, index.plan_keep(prompt, len(prompt), None) or pytest.fail())
    assert coordinator.cached_prefix(other, [*prompt, 5]) == 256
    assert coordinator.prefer_route([ROUTE, other], [*prompt, 5]) is other
    # A lost node's routes forget what their stages held.
    coordinator.peer_lost(b"x" * 32)
    assert coordinator.prefer_route([ROUTE, other], [*prompt, 5]) is ROUTE


def test_choose_route_takes_an_earlier_route_only_while_it_serves_and_holds_more() -> None:
    coordinator = Coordinator(_NoNetwork(), b"c" * 32, prefill_chunk_tokens=CHUNK)
    planned = Route("m", (RouteStage(b"x" * 32, 0, 6),), "q4")
    earlier = Route("m", (RouteStage(b"y" * 32, 0, 6),), "q4")
    other_quant = Route("m", (RouteStage(b"z" * 32, 0, 6),), "q8")
    prompt = tokens(300)
    for route in (earlier, other_quant):
        index = coordinator.prefix_index(route)
        index.record(len(index) + 1, index.plan_keep(prompt, len(prompt), None) or pytest.fail())
    turn2 = [*prompt, 5]
    assert coordinator.choose_route(planned, turn2, lambda r: True) is earlier
    # Not while its stages no longer hold their layers, and never at another quantization.
    assert coordinator.choose_route(planned, turn2, lambda r: r is not earlier) is planned
    assert coordinator.choose_route(planned, tokens(300, start=9), lambda r: True) is planned


class _Outbox:
    """The coordinator's sender: records what it sends (the lane table's part in these tests)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    async def send(self, key: bytes, message: object, stream: int = 1) -> None:
        self.sent.append((key, message))


def _drops(outbox: _Outbox) -> dict[bytes, list[int]]:
    found: dict[bytes, list[int]] = {}
    for key, message in outbox.sent:
        assert isinstance(message, DropEntries)
        found.setdefault(key, []).extend(message.entries)
    outbox.sent.clear()
    return found


async def test_a_forgotten_route_s_entries_are_dropped_on_its_stages_but_the_lost_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outbox = _Outbox()
    coordinator = Coordinator(outbox, b"c" * 32, prefill_chunk_tokens=CHUNK)
    a, b, x = b"a" * 32, b"b" * 32, b"x" * 32
    routes = [Route("m", (RouteStage(a, 0, 3), RouteStage(b, 3, 6)))]
    routes += [Route("m", (RouteStage(x, 0, 3), RouteStage(bytes([i]) * 32, 3, 6)))
               for i in range(MAX_PREFIX_ROUTES)]  # fmt: skip
    for entry, route in enumerate(routes[:MAX_PREFIX_ROUTES], 1):
        coordinator.prefix_index(route).record(entry, KeepPlan(tuple(tokens(80)), 64))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(coordinator.keep_alive)
        await trio.testing.wait_all_tasks_blocked()
        assert outbox.sent == []  # nothing dropped yet
        # One route more than the coordinator keeps: the least recently used one's stages drop
        # its entry, at once (not at the next keep-alive).
        coordinator.prefix_index(routes[-1])
        await trio.testing.wait_all_tasks_blocked()
        assert _drops(outbox) == {a: [1], b: [1]}
        # A lost node: every route through it is forgotten; the lost node is not told.
        coordinator.peer_lost(x)
        await trio.testing.wait_all_tasks_blocked()
        dropped = _drops(outbox)
        assert x not in dropped and sorted(dropped) == sorted(r.keys[1] for r in routes[1:-1])
        assert sorted(e for ids in dropped.values() for e in ids) == list(range(2, 9))
        nursery.cancel_scope.cancel()


async def test_drops_for_one_stage_are_batched_1024_to_a_message() -> None:
    outbox = _Outbox()
    coordinator = Coordinator(outbox, b"c" * 32, prefill_chunk_tokens=CHUNK)
    coordinator._drop_on_stages(ROUTE, list(range(1, MAX_DROP_ENTRIES + 6)))
    await coordinator.send_drops()
    sent = [(k, len(m.entries)) for k, m in outbox.sent if isinstance(m, DropEntries)]
    assert sorted(sent) == [(k, n) for k in ROUTE.keys for n in (5, MAX_DROP_ENTRIES)]
    await coordinator.send_drops()  # sent once: nothing queued any more
    assert len(outbox.sent) == 4
