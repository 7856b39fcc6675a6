"""MTP drafts after each window equal a from-scratch recomputation, through rollbacks."""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from meshd.bench.checkpoints import add_mtp, make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.stage.mtp_drafter import MtpDrafter

DEPTH = 3


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> StageModel:
    directory = tmp_path_factory.mktemp("mtp_ckpt")
    model = make_checkpoint(directory, "llama", seed=3, num_hidden_layers=2)
    add_mtp(directory, model, DEPTH, seed=4)
    return StageModel.load(Checkpoint.open(directory), 0, 2, device="cpu")


def reference_drafts(stage: StageModel, tokens: list[int], depth: int) -> list[int]:
    """Drafts after `tokens` (t[0..P]), computed in one pass over fresh sessions."""
    sid = f"ref{random.random()}"
    p = len(tokens) - 1
    stage.open_session(sid, 256)
    try:
        h = stage.forward(sid, 0, torch.tensor(tokens[:p])).hidden  # positions 0..P-1
        drafts: list[int] = []
        for k in range(1, depth + 1):
            chain = tokens + drafts
            ids = torch.tensor([chain[i + k] for i in range(p)])
            out = stage.mtp_forward(sid, k, 0, h, ids)
            drafts.append(int(out.logits[-1].argmax()))
            h = out.hidden
        return drafts
    finally:
        stage.close_session(sid)


def test_drafts_match_recomputation_through_prefill_windows_and_rollbacks(
    stage: StageModel,
) -> None:
    rng = random.Random(0)
    vocab = stage.config.vocab_size
    truth = [rng.randrange(3, vocab) for _ in range(120)]  # the "committed" sequence
    drafter = MtpDrafter(stage)
    sid = "s"
    stage.open_session(sid, 256)
    drafter.open(sid)
    # Prefill in three chunks; only the last one samples.
    prompt = 23
    chunks = [(0, 9), (9, 17), (17, prompt)]
    for lo, hi in chunks:
        out = stage.forward(sid, lo, torch.tensor(truth[lo:hi]))
        sampled = hi == prompt
        drafts = drafter.after_window(
            sid, lo, truth[lo:hi], out.hidden, truth[hi] if sampled else None, DEPTH
        )
    assert drafts == reference_drafts(stage, truth[: prompt + 1], DEPTH)
    committed = prompt  # position of the last committed token
    checks = 0
    while committed < 100:
        n_draft = rng.randint(0, 5)
        accepted = rng.randint(0, n_draft)
        # Drafts: right for the accepted part, wrong after it.
        window = truth[committed : committed + 1 + accepted]
        window += [(t + 1) % vocab for t in truth[committed + 1 + accepted :]][: n_draft - accepted]
        out = stage.forward(sid, committed, torch.tensor(window))
        if rng.random() < 0.3:
            # A stale pipelined window, assumed after this one, runs before the rollback.
            garbage_base = committed + len(window)
            garbage = [rng.randrange(3, vocab) for _ in range(3)]
            out_g = stage.forward(sid, garbage_base, torch.tensor(garbage))
            drafter.after_window(sid, garbage_base, garbage[:1], out_g.hidden, 5, DEPTH)
        known = window[: 1 + accepted]
        next_token = truth[committed + 1 + accepted]
        drafts = drafter.after_window(sid, committed, known, out.hidden, next_token, DEPTH)
        committed += 1 + accepted
        assert drafts == reference_drafts(stage, truth[: committed + 1], DEPTH)
        checks += 1
    assert checks > 10


@pytest.mark.parametrize("want", [DEPTH, 1])
def test_drafts_stay_exact_when_they_come_true(stage: StageModel, want: int) -> None:
    # Windows draft with the MTP heads' own drafts and the "truth" accepts them in part or in
    # full, so most rows of every depth ran on a draft that came true: the drafter skips them,
    # and what it sends must still equal a from-scratch recomputation.
    rng = random.Random(1)
    vocab = stage.config.vocab_size
    truth = [rng.randrange(3, vocab) for _ in range(12)]
    drafter = MtpDrafter(stage)
    sid = f"true{want}"
    stage.open_session(sid, 256)
    drafter.open(sid)
    out = stage.forward(sid, 0, torch.tensor(truth[:-1]))
    drafts = drafter.after_window(sid, 0, truth[:-1], out.hidden, truth[-1], want)
    skipped_rows_possible = 0
    for _ in range(40):
        committed = len(truth) - 1
        accepted = rng.choice([len(drafts), len(drafts), rng.randint(0, len(drafts))])
        window = [truth[-1], *drafts]
        out = stage.forward(sid, committed, torch.tensor(window))
        truth += drafts[:accepted]
        # The token after the accepted drafts: the next draft when all came true (a bonus the
        # heads foresaw), else anything but the rejected draft.
        wrong = drafts[accepted] if accepted < len(drafts) else -1
        truth.append(next(t for t in (rng.randrange(3, vocab) for _ in range(9)) if t != wrong))
        skipped_rows_possible += accepted
        drafts = drafter.after_window(
            sid, committed, window[: 1 + accepted], out.hidden, truth[-1], want
        )
        assert drafts == reference_drafts(stage, truth, DEPTH)[:want]
    assert skipped_rows_possible > 20


def test_only_the_last_stage_drafts(tmp_path: pathlib.Path) -> None:
    model = make_checkpoint(tmp_path, "llama", seed=1, num_hidden_layers=2)
    add_mtp(tmp_path, model, 1)
    first = StageModel.load(Checkpoint.open(tmp_path), 0, 1, device="cpu")
    with pytest.raises(ValueError, match="last stage"):
        MtpDrafter(first)


def test_the_hidden_ring_wraps_and_forgets_overwritten_positions() -> None:
    from meshd.stage.mtp_drafter import MtpStateLost, _Ring

    ring = _Ring(torch.zeros(4, 2), [-1] * 4)
    ring.put(2, torch.tensor([[2.0, 2], [3, 3], [4, 4]]))  # slots 2, 3, then 0
    assert [ring.get(p)[0, 0].item() for p in (2, 3, 4)] == [2.0, 3.0, 4.0]
    ring.put(5, torch.arange(12.0).reshape(6, 2))  # more rows than slots: the last 4 stay
    assert [ring.get(p)[0, 0].item() for p in (7, 8, 9, 10)] == [4.0, 6.0, 8.0, 10.0]
    for gone in (2, 4, 6):
        with pytest.raises(MtpStateLost):
            ring.get(gone)
