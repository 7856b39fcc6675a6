"""The prefix cache over a real 2-stage pipeline of the built-in model (lanes on loopback).

Turn 2 of a chat reuses turn 1's KV on both stages and computes only the new tokens; its
output equals a cold run's (greedy and seeded); a small cache evicts; an entry gone from one
stage only falls back to a full prefill with the same tokens; a failed request leaves nothing;
whatever the coordinator's index drops (least recently used, missed, its route forgotten) leaves
the stages too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import trio

from meshd.coord.coordinator import GenerationRequest, GenerationResult, RouteFailed
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint
from meshd.node.prefix_status import collect_status
from meshd.plan.route import Route, RouteStage
from meshd.speculative.config import SpecConfig
from meshd.stage.host import StageHostConfig
from protocol.messages import CloseSession, Message, Sampling

MODEL = builtin_model_dir()
CHUNK = 128  # the coordinator's prefill chunk: exact hits reuse whole chunks of it


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


TURN1 = words(600, 1)


async def ask(
    pipe: LocalPipeline,
    prompt: Sequence[int],
    max_tokens: int = 12,
    sampling: Sampling | None = None,
    route: Route | None = None,
) -> GenerationResult:
    request = GenerationRequest(
        prompt=list(prompt),
        max_tokens=max_tokens,
        sampling=sampling or Sampling(),
        spec=SpecConfig(strategy="auto"),
        mtp_depth=pipe.checkpoint.config.num_mtp_layers,
    )

    async def ignore(tokens: list[int]) -> None:
        pass

    with trio.fail_after(120):
        result = await pipe.coordinator.generate(route or pipe.route, request, ignore)
    await settle(pipe)
    return result


async def settle(pipe: LocalPipeline) -> None:
    """Wait until every stage has taken the close (and kept what it was asked to)."""
    with trio.fail_after(10):
        while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
            await trio.sleep(0.01)


async def cold(pipe: LocalPipeline, prompt: Sequence[int], **kw: object) -> GenerationResult:
    """The same request with the prefix cache off: every position prefilled."""
    pipe.coordinator.prefix_cache = False
    try:
        return await ask(pipe, prompt, **kw)  # type: ignore[arg-type]
    finally:
        pipe.coordinator.prefix_cache = True


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds (the coordinator sends drops in the background)."""
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


def computed(pipe: LocalPipeline) -> list[int]:
    return [h.stats.tokens_computed for h in pipe.hosts]


async def test_turn_two_computes_only_new_tokens_and_equals_a_cold_run() -> None:
    async with open_local_pipeline(MODEL, 2) as pipe:
        first = await ask(pipe, TURN1)
        assert first.cached_tokens == 0
        turn2 = [*TURN1, *first.tokens, *words(40, 2)]
        before = computed(pipe)
        hit = await ask(pipe, turn2, max_tokens=1)
        # Both stages computed only the positions after the reused whole chunks.
        reused = len(TURN1) // CHUNK * CHUNK
        assert hit.cached_tokens == reused == 512
        assert [a - b for a, b in zip(computed(pipe), before, strict=True)] == [
            len(turn2) - reused
        ] * 2
        for host in pipe.hosts:
            stats = host.stage.kv.cache_stats
            assert (stats.hits, stats.reused_tokens, stats.misses) == (1, reused, 0)
        counters = pipe.coordinator.prefix_counters
        assert (counters.hits, counters.reused_tokens, counters.misses) == (1, reused, 0)

        # That request kept turn 2's own whole chunks: the same prompt now reuses those.
        again = len(turn2) // CHUNK * CHUNK
        warm = await ask(pipe, turn2)
        assert warm.cached_tokens == again > reused
        reference = await cold(pipe, turn2)
        assert warm.tokens == reference.tokens and reference.cached_tokens == 0
        seeded = Sampling(temperature=0.9, top_p=0.95, seed=7)
        warm_sampled = await ask(pipe, turn2, sampling=seeded)
        assert warm_sampled.cached_tokens == again
        assert warm_sampled.tokens == (await cold(pipe, turn2, sampling=seeded)).tokens


def route_over(pipe: LocalPipeline, index: int) -> Route:
    """The one-stage route over node `index`'s stage (a spare the pipeline's route leaves out)."""
    node = pipe.nodes[index]
    assert node.host is not None
    stage = node.host.stage
    return Route(
        pipe.checkpoint.model_id, (RouteStage(node.key, stage.layer_start, stage.layer_end),)
    )


async def test_the_next_turn_goes_to_the_route_holding_its_prefix() -> None:
    layers = open_checkpoint(MODEL).config.num_layers
    # Two nodes holding the whole model: two one-stage routes to choose from.
    async with open_local_pipeline(MODEL, 2, split=[(0, layers), (0, layers)]) as pipe:
        a, b = route_over(pipe, 0), route_over(pipe, 1)
        served = {a, b}
        choose = pipe.coordinator.choose_route
        assert choose(b, TURN1, served.__contains__) == b  # no route holds anything: the plan's
        first = await ask(pipe, TURN1, route=b)
        turn2 = [*TURN1, *first.tokens, *words(40, 2)]
        # The plan moved to `a` while `b`'s stage still holds its layers and turn 1's prefix.
        assert choose(a, turn2, served.__contains__) == b
        hit = await ask(pipe, turn2, route=b)
        assert hit.cached_tokens == 512
        # `b` no longer serves (its node left): the plan's route, prefilled in full.
        served.discard(b)
        assert choose(a, turn2, served.__contains__) == a
        plain = await ask(pipe, turn2, route=a)
        assert plain.cached_tokens == 0 and plain.tokens == hit.tokens
        pipe.coordinator.prefix_cache = False  # off: always the plan's route
        assert choose(a, turn2, {a, b}.__contains__) == a


async def test_a_small_cache_evicts_and_a_gone_entry_falls_back_to_a_full_prefill() -> None:
    per_position = 2 * 3 * 2 * 64 * 4  # 3 layers a stage, 2 KV heads of 64, fp32
    config = StageHostConfig(prefix_cache_bytes=per_position * 700)  # one conversation
    async with open_local_pipeline(MODEL, 2, stage_config=config) as pipe:
        first = await ask(pipe, TURN1)
        other = words(600, 3)
        await ask(pipe, other)  # its entry pushes the first one out on both stages
        for host in pipe.hosts:
            kv = host.stage.kv
            assert kv.entries == 1 and kv.cache_stats.evictions == 1
            assert 0 < kv.cache_bytes <= config.prefix_cache_bytes
        turn2 = [*TURN1, *first.tokens, *words(40, 2)]
        before = computed(pipe)
        missed = await ask(pipe, turn2)
        assert missed.cached_tokens == 0 and pipe.coordinator.prefix_counters.misses == 1
        assert all(h.stage.kv.cache_stats.misses == 1 for h in pipe.hosts)
        assert all(c - b >= len(turn2) for c, b in zip(computed(pipe), before, strict=True))
        assert missed.tokens == (await cold(pipe, turn2)).tokens


async def test_an_entry_gone_from_one_stage_only_gives_the_same_tokens() -> None:
    async with open_local_pipeline(MODEL, 2) as pipe:
        first = await ask(pipe, TURN1)
        assert pipe.hosts[1].stage.kv.clear_entries() == 1  # evicted on the last stage only
        turn2 = [*TURN1, *first.tokens, *words(40, 2)]
        before = computed(pipe)
        result = await ask(pipe, turn2, max_tokens=1)
        assert result.cached_tokens == 0
        first_stage, last_stage = (h.stage.kv.cache_stats for h in pipe.hosts)
        assert (first_stage.hits, last_stage.misses) == (1, 1)
        # The last stage computed the whole prompt once (its epoch-0 windows were dropped).
        assert computed(pipe)[1] - before[1] == len(turn2)
        # The index forgot the missed entry and named turn 2's instead: the first stage, which
        # still held the missed one, frees it.
        await until(lambda: [h.stage.kv.entries for h in pipe.hosts] == [1, 1])
        assert first_stage.dropped == 1
        again = await ask(pipe, turn2)
        assert again.tokens == (await cold(pipe, turn2)).tokens


async def test_a_request_that_fails_mid_hit_leaves_nothing_behind() -> None:
    async with open_local_pipeline(MODEL, 2) as pipe:
        first = await ask(pipe, TURN1)
        turn2 = [*TURN1, *first.tokens, *words(40, 2)]
        kept = [h.stage.kv.cache_stats.kept for h in pipe.hosts]
        lost = pipe.route.keys[1]

        async def stage_dies(tokens: list[int]) -> None:
            pipe.coordinator.peer_lost(lost)  # as the lane's death reports it

        request = GenerationRequest(prompt=turn2, max_tokens=50)
        with pytest.raises(RouteFailed), trio.fail_after(60):
            await pipe.coordinator.generate(pipe.route, request, stage_dies)
        await settle(pipe)
        for host, before in zip(pipe.hosts, kept, strict=True):
            assert host.stage.kv.used_bytes == 0 and len(host.stage.kv) == 0
            assert host.stage.kv.cache_stats.kept == before  # nothing kept from it
        # The route's index is forgotten, so the stage still reachable frees turn 1's entry (the
        # lost one freed it when it lost this coordinator: here it only seems lost).
        await until(lambda: pipe.hosts[0].stage.kv.entries == 0)
        assert pipe.hosts[0].stage.kv.cache_bytes == 0
        # The route's index is forgotten: the next request prefills in full.
        assert (await ask(pipe, turn2)).cached_tokens == 0
        # A stopped stage frees its entries with its sessions.
        for host in pipe.hosts:
            host.close_all()
            assert host.stage.kv.cache_bytes == 0 and host.stage.kv.entries == 0


async def test_entries_the_index_evicts_leave_every_stage() -> None:
    config = StageHostConfig(prefix_cache_entries=2)  # the index's size: `[stage]`'s setting
    async with open_local_pipeline(MODEL, 2, stage_config=config) as pipe:
        coordinator = pipe.coordinator
        prompts = [words(150, seed) for seed in range(10, 15)]  # each keeps one 128-chunk
        per_entry = 2 * 3 * 2 * 64 * 4 * CHUNK  # 3 layers a stage, 2 KV heads of 64, fp32
        for n, prompt in enumerate(prompts, 1):
            await ask(pipe, prompt, max_tokens=2)
            named = len(coordinator.prefix_index(pipe.route))
            assert named == min(n, 2)
            # Every stage holds what the index names, and no more: what it evicted is freed.
            await until(lambda: all(h.stage.kv.entries <= 2 for h in pipe.hosts))
            for host in pipe.hosts:
                kv = host.stage.kv
                reported = collect_status([], [kv])  # the node's `meshctl status`, /metrics
                assert (reported.entries, reported.bytes_held) == (named, named * per_entry)
                assert kv.cache_stats.dropped == reported.dropped == n - named
                assert kv.cache_stats.evictions == 0  # freed by the coordinator, not for room
        # The entries the stages still hold are the ones the index names: the last two hit.
        for prompt in prompts[-2:]:
            assert (await ask(pipe, [*prompt, 7], max_tokens=1)).cached_tokens == CHUNK
        assert (await ask(pipe, [*prompts[0], 7], max_tokens=1)).cached_tokens == 0
        assert all(h.stage.kv.cache_stats.misses == 0 for h in pipe.hosts)


class _HeldKeeps:
    """The coordinator's sender (the pipeline's lane table), holding the closes that keep an
    entry on one node until `release` is set: a slow lane to that stage."""

    def __init__(self, inner: object, held: bytes) -> None:
        self.inner, self.held = inner, held
        self.release = trio.Event()

    async def send(self, key: bytes, message: Message, stream: int = 1) -> None:
        if key == self.held and isinstance(message, CloseSession) and message.keep_entry:
            await self.release.wait()
        await self.inner.send(key, message, stream)  # type: ignore[attr-defined]


async def test_a_drop_never_overtakes_the_close_that_keeps_the_entry() -> None:
    async with open_local_pipeline(MODEL, 2) as pipe:
        coordinator = pipe.coordinator
        coordinator.prefix_max_entries = 1
        sender = coordinator.sender = _HeldKeeps(coordinator.sender, pipe.route.keys[1])
        async with trio.open_nursery() as nursery:
            counters = coordinator.prefix_counters
            nursery.start_soon(ask, pipe, words(150, 20), 2)
            await until(lambda: counters.kept == 1)
            nursery.start_soon(ask, pipe, words(150, 21), 2)
            await until(lambda: counters.kept == 2)
            # The second request's entry evicted the first's from the index while the close
            # keeping it is still on its way to the last stage: its drop must wait for it.
            await trio.sleep(0.2)
            sender.release.set()
        await until(lambda: all(h.stage.kv.entries <= 1 for h in pipe.hosts))
        assert [h.stage.kv.entries for h in pipe.hosts] == [1, 1]
        assert [h.stage.kv.cache_stats.dropped for h in pipe.hosts] == [1, 1]
