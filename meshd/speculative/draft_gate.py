"""Whether the draft model can pay on a route, whatever its acceptance: `auto`'s cost gate.

A real draft costs a sizeable share of the target per token (a 0.5B beside a 1.5B: a fifth to
a third, or more on a starved CPU), and where there is no round trip to hide it behind (one
node) its passes run beside the target's on the same cores. The pipelined search
(`policy.search`) overlaps drafting with the target's pass and prices a window from the
route's measured line; before any window wider than one token was measured that line is flat,
and a window of eight drafts looks as cheap as a plain token. So `auto` weighs the draft twice:
the search picks the plan, and this gate, from the same acceptance, prices it one window at a
time with nothing overlapped and the verify pass priced honestly, and lets the draft compete
only where that beats plain decoding by `AutoTuning.draft_min_gain`. Figures and the command
behind the prior: docs/speculative.md ("`auto`'s cost gate for the draft").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from meshd.speculative.auto_tuning import AutoTuning
from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import LinkModel, Search


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


def serial_gain(link: LinkModel, acceptance: Sequence[float], config: SpecConfig) -> float:
    """Plain decoding's seconds per token ÷ the draft's best seconds per token when each
    window waits for the one before and the draft's time overlaps nothing: per window the
    round trip, the (loaded) verify pass and `draft_per_token_s` per draft, for the expected
    tokens a window commits at `acceptance`."""
    load = max(1, link.concurrent_sessions)
    rtt = max(0.0, link.rtt_s)
    plain = rtt + load * link.compute_s(0)
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


def gate(found: Search, config: SpecConfig, tuning: AutoTuning) -> Search:
    """`found` (the draft's search) as is where the draft pays one window at a time by
    `draft_min_gain`, else the same search speculating nowhere (its plan: plain decoding)."""
    inputs = found.inputs
    link = priced_link(inputs.link, tuning)
    if serial_gain(link, inputs.acceptance, config) >= tuning.draft_min_gain:
        return found
    return Search(inputs, (found.baseline, 0, 1, 1.0), found.baseline, found.products)
