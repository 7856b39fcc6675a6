"""The last stage's answer to a window it computed (`window_verdict`): the drafts it accepts,
the next token, the MTP heads' drafts for the next window and the log-probs asked for.
"""

from __future__ import annotations

import time

from meshd.model.errors import ModelError
from meshd.model.stage import StageOutput
from meshd.speculative.sampling import SamplingParams, token_logprobs, unpack_masks, verify
from meshd.stage.mtp_drafter import MtpDrafter
from protocol.messages import TokenLogprobs, VerifyWindow

# The last stage's verdict on a sampled window: (accepted drafts, next token, MTP drafts,
# log-probs when asked).
WindowVerdict = tuple[int, int, list[int], list[TokenLogprobs]]


def window_verdict(
    w: VerifyWindow, out: StageOutput, eos_ids: frozenset[int], drafter: MtpDrafter | None
) -> tuple[WindowVerdict | None, float]:
    """The last stage's answer to a window it computed, and the MTP heads' seconds.

    A sampled window gets its verdict (accepted drafts, next token) and, with `drafter`, the
    heads' drafts for the next window from the accepted prefix; a window that only fills the
    KV (no sample) gets None, its positions still run through the heads so their KV keeps up.
    """
    started = time.perf_counter()
    if not w.sample:
        if drafter is not None:
            drafter.after_window(w.session, w.base_pos, w.tokens, out.hidden, None, 0)
        return None, time.perf_counter() - started
    assert out.logits is not None
    s = w.sampling
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
    allowed = None
    if w.mask:
        try:
            allowed = unpack_masks(w.mask, w.n_draft + 1, out.logits.shape[-1])
        except ValueError as exc:
            raise ModelError(str(exc)) from None
    verdict = verify(out.logits, w.tokens, w.n_draft, w.base_pos, params, eos_ids, allowed)
    logprobs: list[TokenLogprobs] = []
    if w.logprobs >= 0:
        # Rows aligned to the window's end (see `verify`): the first needed row chose the
        # first draft, and each committed token has its own row.
        first = out.logits.shape[0] - w.n_draft - 1
        rows = out.logits[first : first + len(verdict.committed)]
        logprobs = token_logprobs(rows, verdict.committed, w.logprobs)
    drafts: list[int] = []
    mtp_s = 0.0
    if drafter is not None:
        known = w.tokens[: len(w.tokens) - w.n_draft + verdict.accepted_len]
        started = time.perf_counter()
        drafts = drafter.after_window(
            w.session, w.base_pos, known, out.hidden, verdict.next_token, w.mtp_tokens
        )
        mtp_s = time.perf_counter() - started
    return (verdict.accepted_len, verdict.next_token, drafts, logprobs), mtp_s
