"""Stages: exact splits, positional KV (incremental = full, rollback), sessions, budget, laziness."""

from __future__ import annotations

import pathlib
import struct

import msgspec
import pytest
import torch

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.single_node import generate
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import InvalidInput, KVBudgetExceeded, SessionError
from meshd.model.stage import StageModel, kv_bytes_per_token, layer_bytes

PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211]
SPLITS = {
    1: [(0, 4)],
    2: [(0, 2), (2, 4)],
    3: [(0, 1), (1, 3), (3, 4)],
    4: [(0, 1), (1, 2), (2, 3), (3, 4)],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    # Mistral: its sliding window (6) makes rollback and chunking exercise the window too.
    directory = tmp_path_factory.mktemp("mistral")
    make_checkpoint(directory, "mistral", seed=11)
    return Checkpoint.open(directory)


@pytest.fixture(scope="module")
def whole(checkpoint: Checkpoint) -> StageModel:
    return StageModel.load(checkpoint, 0, 4, device="cpu")


def run(stages: list[StageModel], session: str, base_pos: int, ids: list[int]) -> torch.Tensor:
    x: torch.Tensor = torch.tensor(ids)
    for stage in stages:
        out = stage.forward(session, base_pos, x)
        x = out.hidden
    assert out.logits is not None
    return out.logits


@pytest.mark.parametrize("n_stages", sorted(SPLITS))
def test_any_split_gives_bit_identical_logits(
    checkpoint: Checkpoint, whole: StageModel, n_stages: int
) -> None:
    stages = [StageModel.load(checkpoint, a, b) for a, b in SPLITS[n_stages]]
    assert stages[0].is_first and stages[-1].is_last
    assert not any(s.is_last for s in stages[:-1]) and not any(s.is_first for s in stages[1:])
    for s in [*stages, whole]:
        s.open_session("split", 32)
    # A prefill window then two single-token steps, as a decode would run them.
    for base, ids in ((0, PROMPT), (len(PROMPT), [77]), (len(PROMPT) + 1, [3])):
        assert torch.equal(run(stages, "split", base, ids), run([whole], "split", base, ids))
    for s in [*stages, whole]:
        s.close_session("split")


def test_incremental_decode_equals_full_recomputation(whole: StageModel) -> None:
    tokens = generate([whole], PROMPT, 16).tokens
    sequence = PROMPT + tokens
    whole.open_session("full", len(sequence))
    full = run([whole], "full", 0, sequence)
    whole.close_session("full")
    # Greedy continuation read off the full pass must be what the cached loop produced.
    assert full[len(PROMPT) - 1 : -1].argmax(-1).tolist() == tokens

    whole.open_session("inc", len(sequence))
    rows = [run([whole], "inc", 0, PROMPT[:4]), run([whole], "inc", 4, PROMPT[4:])]
    rows += [run([whole], "inc", pos, [sequence[pos]]) for pos in range(len(PROMPT), len(sequence))]
    whole.close_session("inc")
    assert torch.allclose(torch.cat(rows), full, atol=1e-5, rtol=0)


def test_rollback_by_position_equals_fresh_run(whole: StageModel) -> None:
    accepted = [*PROMPT, 42, 43, 44]
    garbage = [200, 201, 202, 203, 204, 205, 206, 207]
    whole.open_session("fresh", 32)
    whole.open_session("spec", 32)
    run([whole], "fresh", 0, accepted)
    run([whole], "spec", 0, accepted)
    # A speculative window writes garbage at 13..20 and is rejected: the retry at the same
    # base_pos simply overwrites, with the same windows as a session that never saw garbage.
    run([whole], "spec", len(accepted), garbage)
    for base, ids in ((len(accepted), [50, 51]), (len(accepted) + 2, [52])):
        assert torch.equal(run([whole], "spec", base, ids), run([whole], "fresh", base, ids))
    # Rolling back into the prompt and replaying from there is exact too.
    run([whole], "spec", len(accepted), garbage)
    replay = [*accepted[2:], 50, 51]
    assert torch.equal(run([whole], "spec", 2, replay), run([whole], "fresh", 2, replay))
    whole.close_session("fresh")
    whole.close_session("spec")


def test_sessions_are_isolated(whole: StageModel) -> None:
    for sid in ("a", "b", "lone_b"):
        whole.open_session(sid, 16)
    alone = run([whole], "a", 0, PROMPT)
    # Interleave a and b; each must compute what it computes alone.
    b_windows = [(0, list(reversed(PROMPT))), (len(PROMPT), [9, 9, 9])]
    lone = [run([whole], "lone_b", base, ids) for base, ids in b_windows]
    assert torch.equal(run([whole], "b", *b_windows[0]), lone[0])
    whole.close_session("a")
    whole.open_session("a", 16)
    assert torch.equal(run([whole], "a", 0, PROMPT), alone)
    assert torch.equal(run([whole], "b", *b_windows[1]), lone[1])
    for sid in ("a", "b", "lone_b"):
        whole.close_session(sid)


def test_decode_steps_compute_what_a_batched_pass_computes(checkpoint: Checkpoint) -> None:
    # A one-position window runs through the session's reusable scratch rows; a batched pass
    # takes the general path. Both must give the same bits, and what a step returned must not
    # change when later steps reuse the scratch.
    stepped, batched = StageModel.load(checkpoint, 0, 4), StageModel.load(checkpoint, 0, 4)
    for stage in (stepped, batched):
        stage.open_session("s", 32)
        stage.forward("s", 0, torch.tensor(PROMPT))
    kept = []
    for pos, token in enumerate([5, 9, 77, 3, 3], start=len(PROMPT)):
        ids = torch.tensor([token])
        step = stepped.forward("s", pos, ids)
        (ref,) = batched.forward_batch([("s", pos, ids)])
        assert step.logits is not None and ref.logits is not None
        assert torch.equal(step.logits, ref.logits) and torch.equal(step.hidden, ref.hidden)
        kept.append((step.logits.clone(), step.hidden.clone(), step))
    for logits, hidden, step in kept:
        assert torch.equal(step.logits, logits) and torch.equal(step.hidden, hidden)


def test_session_errors_are_typed(whole: StageModel) -> None:
    with pytest.raises(SessionError, match="not open"):
        whole.forward("nobody", 0, torch.tensor([1]))
    whole.open_session("e", 8)
    with pytest.raises(SessionError, match="already open"):
        whole.open_session("e", 8)
    with pytest.raises(SessionError, match="gap"):
        whole.forward("e", 3, torch.tensor([1]))
    with pytest.raises(SessionError, match="max_positions"):
        whole.forward("e", 0, torch.tensor(list(range(9))))
    with pytest.raises(InvalidInput, match="vocabulary"):
        whole.forward("e", 0, torch.tensor([1, 256]))
    with pytest.raises(InvalidInput, match="vocabulary"):
        whole.forward("e", 0, torch.tensor([-1]))
    with pytest.raises(InvalidInput, match="token ids"):
        whole.forward("e", 0, torch.zeros(2, 64))
    whole.close_session("e")


def test_closing_frees_kv_and_budget_is_enforced(checkpoint: Checkpoint) -> None:
    per_token = kv_bytes_per_token(checkpoint.config, 2, torch.float32)
    stage = StageModel.load(checkpoint, 0, 2, kv_budget_bytes=100 * per_token)
    assert stage.kv_bytes_per_token == per_token
    stage.open_session("a", 60)
    assert stage.kv.used_bytes == 60 * per_token
    with pytest.raises(KVBudgetExceeded, match="'b'"):
        stage.open_session("b", 41)
    stage.open_session("b", 40)
    stage.close_session("a")
    assert stage.kv.used_bytes == 40 * per_token and len(stage.kv) == 1
    stage.open_session("c", 60)
    with pytest.raises(SessionError):
        stage.forward("a", 0, torch.tensor([1]))
    stage.close_session("a")  # closing twice is harmless
    assert stage.kv.used_bytes == 100 * per_token
    # Without a budget the device is the limit: an impossible session is refused, typed.
    unbounded = StageModel.load(checkpoint, 0, 1)
    with pytest.raises(KVBudgetExceeded, match="cannot allocate"):
        unbounded.open_session("huge", 10**13)
    assert len(unbounded.kv) == 0 and unbounded.kv.used_bytes == 0


def test_planner_sizes(checkpoint: Checkpoint) -> None:
    cfg = checkpoint.config
    stage = StageModel.load(checkpoint, 1, 3)
    params = sum(t.numel() for t in stage.layers[0].tensors())
    assert stage.bytes_per_layer == layer_bytes(cfg, torch.float32) == params * 4
    assert stage.kv_bytes_per_token == 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert StageModel.load(checkpoint, 1, 3, dtype=torch.bfloat16).bytes_per_layer == params * 2


def _poison(path: pathlib.Path, names: list[str]) -> None:
    """Overwrite these tensors' bytes in place with NaN (0xFF...) patterns."""
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = msgspec.json.decode(raw[8 : 8 + header_len])
    for name in names:
        begin, end = header[name]["data_offsets"]
        raw[8 + header_len + begin : 8 + header_len + end] = b"\xff" * (end - begin)
    path.write_bytes(bytes(raw))


def test_a_middle_stage_reads_only_its_layers(tmp_path: pathlib.Path) -> None:
    clean_dir, poisoned_dir = tmp_path / "clean", tmp_path / "poisoned"
    make_checkpoint(clean_dir, "llama", seed=4, num_hidden_layers=6)
    make_checkpoint(poisoned_dir, "llama", seed=4, num_hidden_layers=6)
    mine = ("model.layers.2.", "model.layers.3.")
    poisoned = Checkpoint.open(poisoned_dir)
    _poison(
        poisoned_dir / "model.safetensors", [n for n in poisoned.tensors if not n.startswith(mine)]
    )

    stage = StageModel.load(poisoned, 2, 4)
    assert not stage.is_first and not stage.is_last
    assert poisoned.loaded_names == {n for n in poisoned.tensors if n.startswith(mine)}
    clean = StageModel.load(Checkpoint.open(clean_dir), 2, 4)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for s in (stage, clean):
        s.open_session("s", 5)
    ours = stage.forward("s", 0, hidden).hidden
    assert ours.isfinite().all()
    assert torch.equal(ours, clean.forward("s", 0, hidden).hidden)
