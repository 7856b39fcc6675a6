"""Whether the draft model can pay on a route, whatever its acceptance: `auto`'s cost gate.

A real draft costs a sizeable share of the target per token, and where there is no round
trip to hide it behind (one node) its passes run beside the target's on the same cores. The pipelined search
(`policy.search`) overlaps drafting with the target's pass and prices a window from the
route's measured line; before any window wider than one token was measured that line is flat,
and a window of eight drafts looks as cheap as a plain token. So `auto` weighs the draft twice:
the search picks the plan, and this gate, from the same acceptance, prices it one window at a
time with nothing overlapped and the verify pass priced honestly, and lets the draft compete
only where that beats plain decoding by `AutoTuning.draft_min_gain`. And before its first
proposal the draft writes the log its cache lacks (the whole prompt, once per request: its
prefill), a price per-pass costs leave out; the gate lets it in only where what the rest of
the request saves at that gain pays the price back (`AutoTuning.draft_start_payback`).
Figures and the commands behind the priors: docs/speculative.md ("`auto`'s cost gate for the
draft").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import LinkModel, Search

if TYPE_CHECKING:
    from meshd.model.config import ModelConfig


def pass_weights(config: ModelConfig, head_rows: int | None = None) -> int:
    """The weights one token's pass multiplies by: every layer's attention and MLP matrices
    and the vocabulary head's `head_rows` rows (default all; the embedding is a lookup). A
    CPU pass reads each once, so the ratio of two models' is the ratio of their passes'
    costs."""
    hidden, heads = config.hidden_size, config.head_dim
    attention = 2 * hidden * config.num_heads * heads + 2 * hidden * config.num_kv_heads * heads
    mlp = 3 * hidden * config.intermediate_size
    rows = config.vocab_size if head_rows is None else head_rows
    return config.num_layers * (attention + mlp) + rows * hidden


def priced_link(link: LinkModel, tuning: AutoTuning) -> LinkModel:
    """`link` with its verify pass priced: where no window wider than one token was measured
    (a flat line: no cost per token), each draft costs `verify_token_prior` of a one-token
    pass on top of it, not nothing."""
    if link.pass_per_token_s > 0:
        return link
    plain = link.compute_s(0)
    per_draft = tuning.verify_token_prior * plain
    # compute_s(k) = fixed + per_token·(k+1) = plain + per_draft·k
    return replace(link, pass_fixed_s=plain - per_draft, pass_per_token_s=per_draft)


def plain_s(link: LinkModel) -> float:
    """Seconds per token of plain decoding on `link`: a round trip and a (loaded) pass."""
    return max(0.0, link.rtt_s) + max(1, link.concurrent_sessions) * link.compute_s(0)


def serial_gain(link: LinkModel, acceptance: Sequence[float], config: SpecConfig) -> float:
    """Plain decoding's seconds per token ÷ the draft's best seconds per token when each
    window waits for the one before and the draft's time overlaps nothing: per window the
    round trip, the (loaded) verify pass and `draft_per_token_s` per draft, for the expected
    tokens a window commits at `acceptance`."""
    load = max(1, link.concurrent_sessions)
    rtt = max(0.0, link.rtt_s)
    plain = plain_s(link)
    alphas = [min(max(float(a), 0.0), 0.999) for a in acceptance] or [0.0]
    best = plain
    expected, chance = 1.0, 1.0
    for k in range(1, config.window_max_tokens + 1):
        chance *= alphas[min(k - 1, len(alphas) - 1)]
        expected += chance
        if k < config.window_min_tokens:
            continue
        window = rtt + load * link.compute_s(k) + link.drafting_s(k)
        best = min(best, window / expected)
    return plain / best if best > 0 else 1.0


def start_pays(
    link: LinkModel, gain: float, start_s: float, remaining: int | None, tuning: AutoTuning
) -> bool:
    """Whether `remaining` tokens decoded `gain` times faster than plainly save
    `draft_start_payback` times `start_s`, the draft's price of starting (its writes of the
    log its cache lacks). Yes where the request's length is not known."""
    return pays_back(plain_s(link), gain, start_s, remaining, tuning)


def pays_back(
    plain_token_s: float, gain: float, start_s: float, remaining: int | None, tuning: AutoTuning
) -> bool:
    """`start_pays` with plain decoding's seconds a token given (`plain_s` of the route)."""
    if remaining is None or start_s <= 0:
        return True
    saved = max(0, remaining) * plain_token_s * (1 - 1 / gain) if gain > 0 else 0.0
    return saved >= tuning.draft_start_payback * start_s


def gate(
    found: Search,
    config: SpecConfig,
    tuning: AutoTuning,
    *,
    start_s: float = 0.0,
    remaining: int | None = None,
) -> Search:
    """`found` (the draft's search) as is where the draft pays one window at a time by
    `draft_min_gain` and the rest of the request (`remaining` tokens) pays back its start
    (`start_s`, `start_pays`), else the same search speculating nowhere (plain decoding)."""
    inputs = found.inputs
    link = priced_link(inputs.link, tuning)
    gain = serial_gain(link, inputs.acceptance, config)
    if gain >= tuning.draft_min_gain and start_pays(link, gain, start_s, remaining, tuning):
        return found
    return Search(inputs, (found.baseline, 0, 1, 1.0), found.baseline, found.products)
