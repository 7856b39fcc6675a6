"""The shipped draft on the built-in model, over real lanes: exact output, and what it accepts.

`meshd/model/builtin_draft` (distilled from the built-in model, docs/model.md) drafts on the
coordinator; greedy output over 1-3 stages and a seeded sampled request equal `disabled`'s.
However a drafting request ends (done, a stage lost, a draft pass failing, the client gone),
its draft session is closed: the draft's KV table holds nothing afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
import trio

from meshd.coord.coordinator import GenerationRequest, GenerationResult, RouteFailed
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.draft_gate import pass_weights
from meshd.speculative.draft_vocab import DraftVocab
from protocol.messages import Sampling

MODEL = builtin_model_dir()
DRAFT = str(builtin_draft_dir())
TOKENIZER = Tokenizer.open(MODEL)
PROSE = TOKENIZER.encode(
    'def merge(a, b):\n    """Merge two sorted lists into one sorted list."""\n    ',
    add_special_tokens=False,
)
STRATEGIES = ("disabled", "draft", "draft-ngram", "auto")


async def run(
    stages: int, requests: list[GenerationRequest], rtt_s: float = 0.0
) -> list[GenerationResult]:
    results = []
    async with open_local_pipeline(MODEL, stages, rtt_s=rtt_s, wire_dtype="f32") as pipe:
        for request in requests:
            streamed: list[int] = []

            async def on_tokens(tokens: list[int], streamed: list[int] = streamed) -> None:
                streamed.extend(tokens)

            with trio.fail_after(120):
                result = await pipe.coordinator.generate(pipe.route, request, on_tokens)
            assert streamed == result.tokens
            results.append(result)
        # Every request closed its draft session: the draft's KV holds nothing.
        draft = pipe.coordinator.draft_model(SpecConfig(draft_model=DRAFT))
        assert draft is not None and len(draft.stage.kv) == 0
    return results


def request(strategy: str, sampling: Sampling | None = None, n: int = 32) -> GenerationRequest:
    sampling = sampling if sampling is not None else Sampling()
    spec = SpecConfig(strategy=strategy, window_max_tokens=6, draft_model=DRAFT)
    return GenerationRequest(prompt=PROSE, max_tokens=n, sampling=sampling, spec=spec, mtp_depth=2)


@pytest.mark.parametrize("stages", [1, 2, 3])
async def test_greedy_output_with_the_shipped_draft_equals_disabled(stages: int) -> None:
    results = await run(stages, [request(s) for s in STRATEGIES], rtt_s=0.005)
    plain = results[0].tokens
    assert len(plain) == 32
    for strategy, result in zip(STRATEGIES, results, strict=True):
        assert result.tokens == plain, f"{strategy} changed the output"
    drafted = results[1].telemetry
    assert drafted.proposers["draft"].drafted > 0 and drafted.draft_s > 0


async def test_a_seeded_sampled_request_gives_the_same_text_as_disabled() -> None:
    sampling = Sampling(temperature=0.8, top_p=0.95, seed=2026)
    results = await run(2, [request(s, sampling) for s in STRATEGIES])
    texts = [TOKENIZER.decode(r.tokens) for r in results]
    assert all(t == texts[0] for t in texts), texts


async def test_the_shipped_draft_accepts_the_built_in_models_greedy_text() -> None:
    (result,) = await run(1, [request("draft", n=96)])
    counts = result.telemetry.proposers["draft"]
    acceptance = counts.acceptance
    assert acceptance is not None
    print(
        f"shipped draft, greedy acceptance: {acceptance:.2f} ({counts.accepted}/{counts.drafted})"
    )
    assert acceptance > 0.2  # a sanity floor: a draft that learnt nothing accepts ~0


async def test_auto_prices_an_untimed_draft_by_its_share_of_the_targets_weights() -> None:
    # Before the draft's passes were timed, `auto` weighs it by the weights a pass of each model
    # reads: the coordinator must hand the served model's shape to the book, or the draft would
    # be priced at the generic prior whatever its size.
    async with open_local_pipeline(MODEL, 1, wire_dtype="f32") as pipe:
        spec = SpecConfig(draft_model=DRAFT)
        book = pipe.coordinator.book("builtin", spec)
        draft = pipe.coordinator.draft_model(spec)
        assert draft is not None and pipe.coordinator.target_config is not None
        expected = pass_weights(draft.stage.config) / pass_weights(pipe.coordinator.target_config)
        assert book.draft_size_ratio == pytest.approx(expected)
        assert 0 < expected < 1  # the shipped draft is smaller than the built-in model


async def test_stages_given_one_thread_keep_one_after_a_draft_loaded_on_more_drafted() -> None:
    """A local pipeline's stages stand for one-core machines (one thread each). A draft loaded
    on two threads drafts on the threads the stages were given: after it drafted, a worker
    thread started then (as a stage's may be) still computes on one thread. A draft governed
    on two threads had set torch's count to two for every thread started after its pass."""

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        draft = DraftModel.load(DRAFT)
        async with open_local_pipeline(MODEL, 2, draft=draft, torch_threads=1):
            session = draft.open(16)
            draft.next_logits(session, 0, PROSE[:4])
            draft.close(session)
            seen: list[int] = []
            worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
            worker.start()
            worker.join()
            assert seen == [1]
    finally:
        torch.set_num_threads(previous)


class SlowDraft(DraftModel):
    """The shipped draft, each pass taking at least `pass_s` more (a long prefill's seconds)."""

    def __init__(self, inner: DraftModel, pass_s: float) -> None:
        super().__init__(inner.stage, inner.path, sorted(inner.eos_ids))
        self.pass_s = pass_s

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        time.sleep(self.pass_s)
        return super().rows(session, base_pos, tokens, last_n, vocab)


async def test_the_drafts_passes_leave_the_coordinators_event_loop_free() -> None:
    """A draft model's pass can take seconds (a long prompt's prefill on a slow machine). Made
    on the event loop it held the node's lanes: peers heard no keep-alive past dead_after_s,
    declared the node dead and the request failed. The loop must keep running meanwhile."""
    draft = SlowDraft(DraftModel.load(DRAFT), 0.4)
    gaps: list[float] = []

    async def tick(done: trio.Event) -> None:
        last = trio.current_time()
        while not done.is_set():
            await trio.sleep(0.01)
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    async with open_local_pipeline(MODEL, 2, draft=draft) as pipe:
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick, done)

            async def on_tokens(tokens: list[int]) -> None:
                pass

            started = trio.current_time()
            with trio.fail_after(120):
                result = await pipe.coordinator.generate(
                    pipe.route, request("draft", n=8), on_tokens
                )
            took = trio.current_time() - started
            done.set()
    assert len(result.tokens) == 8
    assert took > 4 * 0.4  # several passes of the draft ran in the request
    assert max(gaps) < 0.3, max(gaps)  # none of them held the event loop


async def test_concurrent_requests_drafting_with_one_draft_model_each_give_plain_text() -> None:
    """Several requests share the node's draft model, whose passes run on worker threads: one
    step at a time, so each keeps its own draft session and gets plain decoding's text."""
    strategies = ("draft", "draft-ngram", "auto", "draft")
    async with open_local_pipeline(MODEL, 2, rtt_s=0.002, wire_dtype="f32") as pipe:
        results: dict[int, GenerationResult] = {}

        async def one(index: int, strategy: str) -> None:
            async def on_tokens(tokens: list[int]) -> None:
                await trio.lowlevel.checkpoint()

            generated = pipe.coordinator.generate(pipe.route, request(strategy), on_tokens)
            results[index] = await generated

        with trio.fail_after(120):
            plain = (await run_one(pipe, request("disabled"))).tokens
            async with trio.open_nursery() as nursery:
                for index, strategy in enumerate(strategies):
                    nursery.start_soon(one, index, strategy)
        draft = pipe.coordinator.draft_model(SpecConfig(draft_model=DRAFT))
        assert draft is not None and len(draft.stage.kv) == 0
    assert [results[i].tokens for i in range(len(strategies))] == [plain] * len(strategies)
    assert results[0].telemetry.proposers["draft"].drafted > 0


async def run_one(pipe: LocalPipeline, req: GenerationRequest) -> GenerationResult:
    async def on_tokens(tokens: list[int]) -> None:
        pass

    return await pipe.coordinator.generate(pipe.route, req, on_tokens)


async def test_passes_run_ahead_while_windows_are_out_take_drafting_off_the_windows_path() -> None:
    # 2 stages 60 ms apart and a draft whose passes take 15 ms more (a real draft's share of a
    # real target): while each window is out, the coordinator writes its last draft, guesses
    # the bonus token and drafts past it. Where the guess holds, the next window leaves with
    # no pass to wait for, so the drafting the windows wait for shrinks; the text is the same.
    draft = SlowDraft(DraftModel.load(DRAFT), 0.015)

    def drafting(ahead: int) -> GenerationRequest:
        spec = SpecConfig(
            strategy="draft", window_max_tokens=2, draft_model=DRAFT, draft_ahead_tokens=ahead
        )
        return GenerationRequest(prompt=PROSE, max_tokens=32, spec=spec, mtp_depth=2)

    results = []
    async with open_local_pipeline(MODEL, 2, rtt_s=0.06, wire_dtype="f32", draft=draft) as pipe:
        for ahead in (0, 4, 0, 4):

            async def on_tokens(tokens: list[int]) -> None:
                pass

            with trio.fail_after(120):
                results.append(
                    await pipe.coordinator.generate(pipe.route, drafting(ahead), on_tokens)
                )
        assert len(draft.stage.kv) == 0  # every request closed its draft session
    assert all(r.tokens == results[0].tokens for r in results)
    tel = [r.telemetry for r in results]
    recalled = [t.draft_recalled_tokens for t in tel]
    waited = [t.draft_s / max(1, t.draft_model_tokens) for t in tel]
    print("recalled", recalled, "of", [t.draft_model_tokens for t in tel], "waited", waited)
    assert recalled[0] == recalled[2] == 0
    assert min(recalled[1], recalled[3]) > 0.2 * tel[1].draft_model_tokens
    # Without: at least a 15 ms pass per drafted token. With: less by the share recalled.
    assert min(waited[0], waited[2]) > 0.015, waited
    assert max(waited[1], waited[3]) < min(waited[0], waited[2]), waited


@pytest.fixture(scope="module")
def shipped_draft() -> DraftModel:
    return DraftModel.load(DRAFT)


class FailingDraft(DraftModel):
    """The shipped draft, whose pass number `fail_at` raises (a bug in a draft pass)."""

    def __init__(self, inner: DraftModel, fail_at: int) -> None:
        super().__init__(inner.stage, inner.path, sorted(inner.eos_ids))
        self.fail_at = fail_at
        self.passes = 0

    def rows(
        self,
        session: str,
        base_pos: int,
        tokens: Sequence[int],
        last_n: int,
        vocab: DraftVocab | None = None,
    ) -> torch.Tensor:
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError("draft pass failed")
        return super().rows(session, base_pos, tokens, last_n, vocab)


# How a request ends mid-window: the last stage's lane dies, the last stage lost the session
# (it answers the next keep-alive with an error), a draft pass raises, the client goes away.
ENDINGS = ("stage_lost", "stage_error", "draft_raises", "client_gone")


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("strategy", ["draft", "draft-ngram"])
async def test_a_request_ending_mid_window_leaves_no_draft_session_open(
    shipped_draft: DraftModel, strategy: str, ending: str
) -> None:
    """However a drafting request ends, its draft session is closed once `generate` returns or
    raises: the draft's KV table is empty, as after a request that completed."""
    draft = FailingDraft(shipped_draft, 10**9)
    async with open_local_pipeline(MODEL, 2, rtt_s=0.002, draft=draft) as pipe:
        last = pipe.route.keys[-1]
        streamed: list[int] = []
        open_then: list[int] = []
        scope = trio.CancelScope()

        async def on_tokens(tokens: list[int]) -> None:
            streamed.extend(tokens)
            if len(streamed) < 4 or open_then:
                return
            open_then.append(draft.sessions)  # mid-request: its session is open
            if ending == "stage_lost":
                pipe.coordinator.peer_lost(last)
            elif ending == "stage_error":
                pipe.hosts[-1].free_coordinator(pipe.coordinator.own_key)
                await pipe.coordinator.renew_leases()  # answered `session_expired`
            elif ending == "draft_raises":
                draft.fail_at = draft.passes + 1
            else:
                scope.cancel()

        failure: Exception | None = None
        with scope, trio.fail_after(60):
            try:
                await pipe.coordinator.generate(pipe.route, request(strategy, n=64), on_tokens)
            except (RouteFailed, RuntimeError) as exc:
                failure = exc
        assert open_then == [1]
        if ending == "client_gone":
            assert scope.cancelled_caught and failure is None
        else:
            expected = RouteFailed if ending.startswith("stage") else RuntimeError
            assert type(failure) is expected, failure
        assert len(streamed) < 64
        assert draft.sessions == 0 and draft.kv_used_bytes == 0
