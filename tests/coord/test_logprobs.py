"""Log-probs through the window loop, against the built-in model's real stages.

Each generated token's log-prob comes from the row of the last stage's logits that chose it,
so it must not depend on how the token was committed: with speculation (several tokens per
window, pipelined windows, rejections) it equals plain one-token windows to 1e-4.
"""

from __future__ import annotations

import pytest

from meshd.coord.generation import GenerationRequest
from meshd.coord.route_costs import RouteCosts
from meshd.coord.window_loop import WindowLoop
from meshd.speculative.config import SpecConfig
from meshd.speculative.strategies import make_proposer
from protocol.messages import (
    Sampling,
    TokenLogprobs,
    VerifyReply,
    VerifyWindow,
    decode,
    encode,
)
from tests.coord.test_window_loop import MODEL, REPEATING, TWO_STAGES
from tests.coord.virtual_route import VirtualRoute, drive, load_stages

N = 24


def run(
    strategy: str, sampling: Sampling, top: int
) -> tuple[list[int], list[TokenLogprobs], VirtualRoute]:
    net = VirtualRoute(load_stages(MODEL, TWO_STAGES), hop_s=0.02)
    spec = SpecConfig(
        strategy=strategy, window_min_tokens=1, window_max_tokens=4, max_pipeline_depth=2
    )
    request = GenerationRequest(
        prompt=REPEATING, max_tokens=N, spec=spec, sampling=sampling, logprobs=top
    )
    costs = RouteCosts(stages=2)
    loop = WindowLoop(
        session="s",
        route=net.route,
        request=request,
        proposer=make_proposer(strategy, spec, link=costs.link_model()),
        costs=costs,
        coordinator_key=b"c" * 32,
        prefill_chunk_tokens=16,
        wire_dtype="f32",
    )
    streamed = drive(loop, net, REPEATING)
    result = loop.result()
    assert streamed.streamed == result.tokens
    return result.tokens, result.logprobs, net


def assert_close(a: list[TokenLogprobs], b: list[TokenLogprobs]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert x.top_ids == y.top_ids
        assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [Sampling(), Sampling(temperature=0.9, top_p=0.9, seed=7)],
    ids=["greedy", "sampled"],
)
def test_logprobs_with_speculation_equal_plain_windows(sampling: Sampling) -> None:
    plain_tokens, plain, _ = run("disabled", sampling, 5)
    spec_tokens, spec, net = run("ngram-simple", sampling, 5)
    assert spec_tokens == plain_tokens
    assert len(plain) == N
    assert_close(spec, plain)
    # The speculative run did commit several tokens per window.
    assert any(isinstance(m, VerifyWindow) and m.n_draft > 0 for _, m in net.sent)


def test_top_1_is_the_chosen_token_at_temperature_0() -> None:
    tokens, logprobs, _ = run("ngram-simple", Sampling(), 3)
    for token, lp in zip(tokens, logprobs, strict=True):
        assert lp.top_ids[0] == token
        assert lp.top_logprobs[0] == lp.logprob
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.logprob <= 0.0


def test_no_logprobs_and_no_masks_unless_asked() -> None:
    tokens, logprobs, net = run("ngram-simple", Sampling(), -1)
    assert len(tokens) == N and logprobs == []
    windows = [m for _, m in net.sent if isinstance(m, VerifyWindow)]
    assert all(w.logprobs == -1 and w.mask == b"" for w in windows)


def test_a_count_of_zero_gives_each_tokens_logprob_without_alternatives() -> None:
    _, logprobs, _ = run("disabled", Sampling(), 0)
    assert len(logprobs) == N
    assert all(lp.top_ids == [] and lp.top_logprobs == [] for lp in logprobs)


def test_the_reply_shape_round_trips_on_the_wire() -> None:
    reply = VerifyReply("s", 1, 0, 1, 5, [], [], [TokenLogprobs(-0.5, [5, 6], [-0.5, -1.5])])
    assert decode(encode(reply)) == reply
