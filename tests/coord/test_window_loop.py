"""The window loop on a virtual clock, against the built-in model's real stages.

`WindowLoop` is driven as the trio driver drives it (`virtual_route.drive`), with `now` a plain
float: replies arrive when the virtual network says, so pipelining, rollback, stale replies
and the costs charged to the policy are checked exactly, with no wall clock involved.
"""

from __future__ import annotations

import ast
import functools
import itertools
import pathlib
from collections.abc import Sequence
from dataclasses import replace

import msgspec
import pytest

import meshd.coord.generation as generation_module
import meshd.coord.window_loop as session_module
from meshd.coord.generation import (
    REPLAY_WINDOW_TOKENS,
    GenerationRequest,
    RouteFailed,
    StageOverloaded,
)
from meshd.coord.route_costs import RouteCosts
from meshd.coord.window_loop import WindowLoop
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.model.llama import ROW_ATTENTION_MAX
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.auto import AutoProposer
from meshd.speculative.config import DRAFT_STRATEGIES, STRATEGIES, SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.mtp import MtpHybrid, MtpProposer
from meshd.speculative.ngram import NgramSimple
from meshd.speculative.proposer import Proposer
from meshd.speculative.strategies import make_proposer
from protocol.messages import OpenSession, Rollback, StageError, VerifyWindow
from tests.coord.virtual_route import VirtualRoute, drive, load_stages, plain_decode
from tests.speculative.test_auto_cost import TimedDraft

MODEL = builtin_model_dir()
DRAFT = builtin_draft_dir()
TWO_STAGES = [(0, 3), (3, 6)]
# An editing request: the model copies much of the function back, then strays from it, so
# n-gram drafts are accepted for stretches and then rejected.
EDIT_SOURCE = '''def _can_use(method):
    """Check if we can use the selector depending upon the
    operating system. """
    selector_obj = getattr(select, method, None)
    if selector_obj is None:
        return False
    try:
        selector_obj.close()
    except OSError:
        return False
    else:
        return True


# The same function as _can_use, renamed to _can_use_v2.
def _can_use_v2(method):'''
REPEATING = Tokenizer.open(MODEL).encode(EDIT_SOURCE, add_special_tokens=False)
NOVEL = list(range(100, 124))


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): plain_decode(MODEL, p, 40) for p in (REPEATING, NOVEL)}


@functools.cache
def shipped_draft() -> DraftModel:
    return DraftModel.load(DRAFT)


def make_loop(
    net: VirtualRoute,
    request: GenerationRequest,
    *,
    costs: RouteCosts | None = None,
    session: str = "s1",
    reply_timeout_s: float = 30.0,
    proposer: Proposer | None = None,
) -> WindowLoop:
    costs = costs if costs is not None else RouteCosts(stages=len(net.stages))
    if proposer is None:
        proposer = make_proposer(
            request.spec.strategy,
            request.spec,
            link=costs.link_model(),
            draft=shipped_draft() if request.spec.draft_model else None,
        )
    return WindowLoop(
        session=session,
        route=net.route,
        request=request,
        proposer=proposer,
        costs=costs,
        coordinator_key=b"c" * 32,
        prefill_chunk_tokens=16,
        wire_dtype="f32",
        reply_timeout_s=reply_timeout_s,
    )


def spec_request(
    prompt: list[int],
    n: int,
    strategy: str,
    *,
    width: int = 4,
    depth: int = 2,
    eos_ids: frozenset[int] = frozenset(),
) -> GenerationRequest:
    spec = SpecConfig(
        strategy=strategy,
        window_min_tokens=1,
        window_max_tokens=width,
        max_pipeline_depth=depth,
        draft_model=str(DRAFT) if strategy in DRAFT_STRATEGIES else "",
    )
    return GenerationRequest(prompt=prompt, max_tokens=n, spec=spec, mtp_depth=2, eos_ids=eos_ids)


def windows(net: VirtualRoute) -> list[VerifyWindow]:
    return [m for _, m in net.sent if isinstance(m, VerifyWindow)]


@pytest.mark.parametrize("hop_s", [0.0005, 0.02], ids=["near", "far"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_output_equals_plain_decoding(
    strategy: str, hop_s: float, reference: dict[tuple[int, ...], list[int]]
) -> None:
    for prompt in (REPEATING, NOVEL):
        net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=hop_s)
        loop = make_loop(net, spec_request(prompt, 24, strategy))
        run = drive(loop, net, prompt)
        want = reference[tuple(prompt)][:24]
        assert loop.committed == want, f"{strategy} changed the output"
        assert run.streamed == want and loop.result().tokens == want
        assert loop.finish_reason == "length"
        # The session opened on every stage with its layer range, before any window.
        opens = [m for _, m in net.sent[:2] if isinstance(m, OpenSession)]
        assert [m.stage_index for m in opens] == [0, 1]


def test_windows_pipeline_on_a_far_route(reference: dict[tuple[int, ...], list[int]]) -> None:
    # 40 ms of network per window against 2 ms of compute: once the loop has measured that,
    # the policy sends the next window before the previous reply is back.
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.001)
    loop = make_loop(net, spec_request(REPEATING, 40, "ngram-simple", depth=2))
    run = drive(loop, net, REPEATING)
    assert loop.committed == reference[tuple(REPEATING)][:40]
    assert run.most_in_flight == 2
    # Pipelined windows continue where the window before them would end if fully accepted.
    sent = windows(net)
    chained = [
        (a, b)
        for a, b in itertools.pairwise(sent)
        if a.epoch == b.epoch and b.base_pos == a.base_pos + len(a.tokens)
    ]
    assert chained
    # Fewer round trips than tokens: the far route paid off.
    telemetry = loop.result().telemetry
    assert telemetry.verify_round_trips < len(loop.committed)
    assert run.now < 40 * (2 * 0.02 + 0.002)


def test_a_rejected_window_rolls_back_the_ones_behind_it(
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.001)
    loop = make_loop(net, spec_request(REPEATING, 40, "ngram-simple", depth=2))
    run = drive(loop, net, REPEATING)
    assert loop.committed == reference[tuple(REPEATING)][:40]
    rollbacks = [(key, m) for key, m in net.sent if isinstance(m, Rollback)]
    assert rollbacks, "the model leaves the repeated pattern: some draft must be rejected"
    # Every rollback reaches every stage, and epochs only grow, one per rollback.
    epochs = [m.epoch for _, m in rollbacks]
    assert epochs == sorted(epochs)
    assert {key for key, _ in rollbacks} == set(net.keys)
    assert loop.epoch == len(rollbacks) // len(net.keys)
    # The windows behind a rejected one were computed anyway (the rollback came too late) and
    # their replies were ignored; windows after a rollback carry the new epoch.
    assert run.stale_replies > 0
    assert loop.result().telemetry.windows_stale >= run.stale_replies


def test_a_stale_reply_changes_nothing() -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.001)
    loop = make_loop(net, spec_request(REPEATING, 40, "ngram-simple", depth=2))
    now = 0.0
    net.deliver(loop.start(REPEATING, now), now)
    while True:
        at, reply = net.next_reply()
        now = max(now, at)
        if reply.epoch < loop.epoch:
            break  # the first reply made stale by a rollback
        net.deliver(loop.on_reply(reply, now), now)
        if loop.tokens_to_stream:
            net.deliver(loop.on_streamed(now), now)
        assert not loop.done, "no rollback happened"
    before = (loop.committed, loop.epoch, loop.windows_in_flight, len(net.sent))
    assert loop.on_reply(reply, now) == []
    assert loop.tokens_to_stream == []
    assert (loop.committed, loop.epoch, loop.windows_in_flight, len(net.sent)) == before


def test_a_reply_for_another_window_fails_the_route() -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    loop = make_loop(net, spec_request(NOVEL, 10, "disabled"))
    now = 0.0
    net.deliver(loop.start(NOVEL, now), now)
    at, reply = net.next_reply()  # the prefill's: commits the first token
    net.deliver(loop.on_reply(reply, at), at)
    net.deliver(loop.on_streamed(at), at)
    at, reply = net.next_reply()
    wrong = msgspec.structs.replace(reply, window_id=reply.window_id + 5)
    with pytest.raises(RouteFailed, match="reply for window") as failed:
        loop.on_reply(wrong, at)
    assert failed.value.committed == loop.committed and len(loop.committed) == 1
    assert loop.done


def test_the_coordinators_turnaround_is_charged_to_the_policy() -> None:
    # A slow stream consumer makes every window dearer, plain decoding included: the policy
    # must see the time between a reply and the next window beside the network.
    def rtt_after(stream_s: float) -> tuple[float, float | None]:
        net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.001, compute_s=0.002)
        costs = RouteCosts(stages=2)
        loop = make_loop(net, spec_request(NOVEL, 12, "disabled"), costs=costs)
        drive(loop, net, NOVEL, stream_s=stream_s)
        return costs.link_model().rtt_s, costs.local_s

    fast_rtt, fast_local = rtt_after(0.0)
    slow_rtt, slow_local = rtt_after(0.03)
    assert fast_local == pytest.approx(0.0)
    assert slow_local == pytest.approx(0.03)  # every one of the 11 turnarounds took 30 ms
    assert slow_rtt == pytest.approx(fast_rtt + 0.03)
    assert fast_rtt == pytest.approx(0.002)  # two hops of 1 ms; compute is not network


def test_max_tokens_ends_with_length(reference: dict[tuple[int, ...], list[int]]) -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    loop = make_loop(net, spec_request(REPEATING, 7, "ngram-simple", width=4))
    drive(loop, net, REPEATING)
    assert loop.committed == reference[tuple(REPEATING)][:7]
    assert loop.finish_reason == "length"
    # No window ever asked for positions past max_tokens.
    assert all(w.base_pos + len(w.tokens) <= len(REPEATING) + 7 for w in windows(net))


def test_eos_ends_with_stop_and_is_not_streamed(
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    ref = reference[tuple(NOVEL)]
    eos = ref[9]
    first = ref.index(eos)
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), eos_ids=frozenset({eos}))
    request = spec_request(NOVEL, 30, "ngram-simple", eos_ids=frozenset({eos}))
    loop = make_loop(net, request)
    run = drive(loop, net, NOVEL)
    assert loop.committed == run.streamed == ref[:first]
    assert loop.finish_reason == "stop"


def test_a_client_stop_ends_with_stop_and_sends_no_more_windows(
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.001)
    loop = make_loop(net, spec_request(REPEATING, 40, "ngram-simple", depth=2))
    run = drive(loop, net, REPEATING, stop_after=6)
    assert loop.done and loop.finish_reason == "stop"
    assert 6 <= len(run.streamed) < 40
    assert run.streamed == reference[tuple(REPEATING)][: len(run.streamed)]
    # After the batch that reached 6 tokens nothing new was sent but a rollback of what was
    # still in flight.
    last_window = max(i for i, (_, m) in enumerate(net.sent) if isinstance(m, VerifyWindow))
    after = [m for _, m in net.sent[last_window + 1 :]]
    assert all(isinstance(m, Rollback) for m in after)


def test_a_lost_stage_fails_the_route_and_a_new_route_recovers(
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    # What the node does on RouteFailed: keep what was committed, re-prefill prompt +
    # committed on a new route, and generate the rest.
    want = reference[tuple(REPEATING)][:30]
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.001)
    loop = make_loop(net, spec_request(REPEATING, 30, "ngram-simple"))
    now = 0.0
    net.deliver(loop.start(REPEATING, now), now)
    while len(loop.committed) < 10:
        at, reply = net.next_reply()
        now = max(now, at)
        net.deliver(loop.on_reply(reply, now), now)
        if loop.tokens_to_stream:
            net.deliver(loop.on_streamed(now), now)
    assert loop.on_stage_failed(b"elsewhere" + bytes(23), now) == []  # not on this route
    with pytest.raises(RouteFailed, match="unreachable") as failed:
        loop.on_stage_failed(net.keys[1], now)
    assert failed.value.node_key == net.keys[1]
    kept = failed.value.committed
    assert loop.done and kept == want[: len(kept)] and len(kept) >= 10
    assert loop.on_reply(net.next_reply()[1], now) == []  # a done loop ignores late replies

    spare = VirtualRoute(load_stages(MODEL, [(0, 2), (2, 4), (4, 6)]), name=b"m")
    again = make_loop(spare, spec_request([*REPEATING, *kept], 30 - len(kept), "ngram-simple"))
    drive(again, spare, [*REPEATING, *kept], now=now)
    assert [*kept, *again.committed] == want


def test_an_overdue_reply_fails_the_route_on_the_timer() -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    loop = make_loop(net, spec_request(NOVEL, 10, "disabled"), reply_timeout_s=5.0)
    net.deliver(loop.start(NOVEL, 100.0), 100.0)
    # The prefill's two 16-token windows may take the timeout each (only the last replies).
    assert loop.timer == pytest.approx(110.0)
    assert loop.on_timer(109.9) == []
    _, reply = net.next_reply()
    net.deliver(loop.on_reply(reply, 101.0), 101.0)
    assert loop.timer is None  # waiting for the client, not for a stage
    net.deliver(loop.on_streamed(102.0), 102.0)
    assert loop.timer == pytest.approx(107.0)  # each event restarts the wait
    assert loop.on_timer(106.0) == []
    with pytest.raises(RouteFailed, match=r"no reply within 5\.0 s") as failed:
        loop.on_timer(107.0)
    assert failed.value.committed == loop.committed and len(loop.committed) == 1


def test_a_long_prefill_has_the_reply_timeout_per_window_then_fails() -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    prompt = list(range(100, 200))  # 7 windows of 16 tokens
    loop = make_loop(net, spec_request(prompt, 4, "disabled"), reply_timeout_s=5.0)
    sends = loop.start(prompt, 0.0)
    assert sum(isinstance(m, VerifyWindow) for _, m in sends) == 7
    assert loop.on_timer(34.9) == []  # a busy machine, not a lost reply
    with pytest.raises(RouteFailed, match="no reply within"):
        loop.on_timer(35.0)


def test_stage_errors_fail_the_route_and_overload_says_when_to_retry() -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    loop = make_loop(net, spec_request(NOVEL, 10, "disabled"))
    net.deliver(loop.start(NOVEL, 0.0), 0.0)
    busy = StageError(loop.session, "overloaded", "stage holds 8 sessions", retry_after_s=2.5)
    with pytest.raises(StageOverloaded) as refused:
        loop.on_reply(busy, 0.01)
    assert refused.value.retry_after_s == 2.5 and refused.value.committed == []

    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    loop = make_loop(net, spec_request(NOVEL, 10, "disabled"))
    net.deliver(loop.start(NOVEL, 0.0), 0.0)
    with pytest.raises(RouteFailed, match="stage error KVBudgetExceeded") as failed:
        loop.on_reply(StageError(loop.session, "KVBudgetExceeded", "full"), 0.01)
    assert not isinstance(failed.value, StageOverloaded)


def test_mtp_heads_run_only_for_strategies_that_draft_with_them() -> None:
    heads_by_strategy = {
        "disabled": 0,
        "ngram-simple": 0,
        "ngram-cache": 0,
        "mtp": 2,
        "mtp-simple": 2,
        "mtp-cache": 2,
        "draft": 0,
        "draft-ngram": 0,
        "auto": 2,  # it weighs the MTP strategies, so it needs their drafts
    }
    assert set(heads_by_strategy) == set(STRATEGIES)
    for strategy, heads in heads_by_strategy.items():
        net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
        loop = make_loop(net, spec_request(NOVEL, 4, strategy))
        opens = [m for _, m in loop.start(NOVEL, 0.0) if isinstance(m, OpenSession)]
        assert [m.mtp_depth for m in opens] == [0, heads], strategy


class _HeadsPayUntil(MtpHybrid):
    """mtp-simple whose judgement of the MTP heads turns after `tokens` committed tokens (as
    `auto`'s does when its book says they stopped paying)."""

    def __init__(self, config: SpecConfig, tokens: int) -> None:
        super().__init__("mtp-simple", config, MtpProposer(config), NgramSimple(config))
        self.tokens = tokens
        self.seen = 0
        self.stops = 0

    def observe(self, committed: Sequence[int]) -> None:
        super().observe(committed)
        self.seen += len(committed)

    @property
    def wants_mtp(self) -> bool:
        return self.seen < self.tokens

    def stop_mtp(self) -> None:
        self.stops += 1


def test_the_heads_stop_for_good_once_the_proposer_no_longer_wants_them(
    reference: dict[tuple[int, ...], list[int]],
) -> None:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES))
    request = spec_request(REPEATING, 30, "mtp-simple")
    proposer = _HeadsPayUntil(request.spec, tokens=10)
    costs = RouteCosts(stages=2)
    loop = WindowLoop(
        session="s",
        route=net.route,
        request=request,
        proposer=proposer,
        costs=costs,
        coordinator_key=b"c" * 32,
        wire_dtype="f32",
    )
    drive(loop, net, REPEATING)
    assert loop.committed == reference[tuple(REPEATING)][:30]
    heads = [w.mtp_tokens for w in windows(net)]
    assert heads[0] == 2 and heads[-1] == 0 and proposer.stops == 1
    first_off = heads.index(0)
    assert set(heads[first_off:]) == {0}  # never again for this request
    assert first_off > 1  # the heads drafted for a while first


def test_the_window_loop_reads_no_clock_and_does_no_io() -> None:
    imported: set[str] = set()
    for module in (session_module, generation_module):
        source = pathlib.Path(module.__file__ or "").read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                imported.add(node.module.split(".")[0])
    assert not imported & {"trio", "time", "asyncio", "socket", "threading", "anyio"}


def test_a_recovery_replays_the_generated_tokens_in_windows_that_decode_to_the_same_bits() -> None:
    # A CPU stage gives a row the same bits alone or in a window of up to ROW_ATTENTION_MAX
    # rows, and a longer prefill window differs in the last bits (enough to change a greedy
    # token on a real quantized model). So the client's prompt is prefilled in its own chunks,
    # as in the first attempt, and the tokens generated before the failure in short windows.
    assert REPLAY_WINDOW_TOKENS == ROW_ATTENTION_MAX
    prompt, generated = NOVEL[:20], list(range(200, 240))
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.0005)
    request = spec_request([*prompt, *generated], 4, "disabled")
    loop = make_loop(net, replace(request, replay_from=len(prompt)))
    loop.prefill_chunk_tokens = 64
    net.deliver(loop.start([*prompt, *generated], 0.0), 0.0)
    sent = windows(net)
    assert [(w.base_pos, w.base_pos + len(w.tokens)) for w in sent] == [
        (0, 20), (20, 36), (36, 52), (52, 60)
    ]  # fmt: skip
    assert [w.sample for w in sent] == [False, False, False, True]


def test_the_drafts_scoring_passes_are_not_the_coordinators_turnaround() -> None:
    # `auto` scores the draft model teacher-forced while another strategy decodes: a pass
    # of its own, bounded by its own budget, not a turnaround every token pays. Counted as
    # one, a single pass over the prompt priced every strategy's token as slow (for five
    # windows of the average) and so favoured the strategy with the widest windows.
    draft = TimedDraft(shipped_draft(), 0.05)
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02, compute_s=0.002)
    costs = RouteCosts(stages=2)
    request = spec_request(NOVEL, 24, "auto", depth=1)
    spec = msgspec.structs.replace(request.spec, draft_model=str(DRAFT))
    request = replace(request, spec=spec)
    proposer = make_proposer("auto", request.spec, link=costs.link_model(), draft=draft)
    assert isinstance(proposer, AutoProposer) and proposer._draft is not None
    proposer._draft.clock = lambda: draft.now
    loop = make_loop(net, request, costs=costs, proposer=proposer)
    now = 0.0
    net.deliver(loop.start(NOVEL, now), now)
    scored_idle = 0
    while not loop.done:
        at, reply = net.next_reply()
        now = max(now, at)
        before, idle = draft.now, loop.windows_in_flight == 1
        net.deliver(loop.on_reply(reply, now), now)
        now += draft.now - before  # the coordinator's clock runs on while the draft computes
        scored_idle += idle and draft.now > before
        if loop.tokens_to_stream:
            net.deliver(loop.on_streamed(now), now)
    assert scored_idle > 0  # the draft was scored between a reply and the next window
    assert costs.local_s == pytest.approx(0.0, abs=1e-9)
