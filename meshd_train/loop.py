"""The training loop: four phases, resumable from a checkpoint at any step, seeded so a
resumed or re-started run gives the same bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from meshd_train.config import TrainConfig
from meshd_train.corpus import (
    batch_at,
    build_documents,
    encode_edit_stream,
    encode_stream,
    load_corpus,
    phase3_batch,
    train_tokenizer,
)
from meshd_train.export import save_directory
from meshd_train.losses import losses, phase2_loss
from meshd_train.model import BuiltinModel, llama_config, load_exported, round_to_bf16


def phase3_start(cfg: TrainConfig) -> int:
    """The first step of phase 3 (code edits, long context)."""
    return cfg.steps + cfg.ul_steps


def phase4_start(cfg: TrainConfig) -> int:
    """The first step of phase 4 (unlikelihood beside the edits)."""
    return phase3_start(cfg) + cfg.edit_steps


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Phases 1 and 3: linear warmup, then cosine decay to lr_final_fraction of their peak;
    phases 2 and 4 are flat."""
    if step >= phase4_start(cfg):
        return cfg.ul_lr
    if step >= phase3_start(cfg):
        return _warmup_cosine(
            step - phase3_start(cfg), cfg.edit_steps, cfg.edit_warmup_steps, cfg.edit_lr, cfg
        )
    if step >= cfg.steps:
        return cfg.ul_lr
    return _warmup_cosine(step, cfg.steps, cfg.warmup_steps, cfg.lr_peak, cfg)


def _warmup_cosine(step: int, steps: int, warmup: int, peak: float, cfg: TrainConfig) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    floor = cfg.lr_final_fraction
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def tokens_at(step: int, cfg: TrainConfig) -> int:
    """Tokens predicted (main head) in one step of the phase that `step` belongs to."""
    if step >= phase3_start(cfg):
        return (cfg.edit_plain_sequences + cfg.edit_sample_sequences) * cfg.edit_context_tokens
    if step >= cfg.steps:
        return cfg.ul_mle_batch_sequences * cfg.context_tokens
    return cfg.batch_sequences * cfg.context_tokens


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # No decay on norms (1-D gains); embedding and matrices decay.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr_peak, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class RunState:
    step: int = 0
    elapsed_s: float = 0.0
    last_losses: tuple[float, ...] = ()
    phase1_losses: tuple[float, ...] = ()
    phase2_losses: tuple[float, ...] = ()
    phase3_losses: tuple[float, ...] = ()


def train(
    cfg: TrainConfig,
    out: Path,
    checkpoint: Path | None = None,
    quiet: bool = False,
    stop_step: int | None = None,
    init_from: Path | None = None,
) -> dict[str, object]:
    """Build corpus, tokenizer and model, train, and write the HF directory to `out`.

    `init_from` is an exported directory of the same configuration at the end of phase 2 or
    3: training goes on from its weights at the next phase (the tokenizer must be the one
    rebuilt here).
    """
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    corpus = load_corpus(cfg)
    docs = build_documents(corpus, cfg)
    tok = train_tokenizer(docs, cfg.vocab_size)
    stream = encode_stream(tok, docs)
    edits = encode_edit_stream(tok, corpus, cfg) if cfg.edit_steps else None
    prep_s = time.monotonic() - t0
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    log(
        f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files, "
        f"{len(docs)} docs, {len(stream)} tokens, "
        f"{edits.documents if edits else 0} edit docs ({len(edits.ids) if edits else 0} tokens), "
        f"prep {prep_s:.1f}s"
    )

    config = llama_config(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = BuiltinModel(config)
    opt = make_optimizer(model, cfg)
    state = RunState()
    resumed_from: int | None = None
    initialised_from: str | None = None
    if checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        resumed_from = state.step
        if state.step == cfg.steps and not state.phase1_losses:
            state.phase1_losses = state.last_losses  # a checkpoint taken at the boundary
        log(f"resumed from {checkpoint} at step {state.step}")
    elif init_from is not None:
        if Tokenizer.from_file(str(init_from / "tokenizer.json")).to_str() != tok.to_str():
            raise SystemExit(f"{init_from}: its tokenizer is not the one this corpus gives")
        load_exported(model, init_from)
        previous = json.loads((init_from / "training_info.json").read_text())
        done = previous.get("steps_completed")
        if done not in (phase3_start(cfg), phase4_start(cfg)):
            raise SystemExit(
                f"{init_from} stopped at step {done}: --init-from takes the end of phase 2 "
                f"(step {phase3_start(cfg)}) or of phase 3 (step {phase4_start(cfg)})"
            )
        depths = cfg.mtp_depths
        state = RunState(
            step=done,
            phase1_losses=_loss_tuple(previous.get("final_train_losses"), depths, False),
            phase2_losses=_loss_tuple(previous.get("final_phase2_losses"), depths, True),
            phase3_losses=_loss_tuple(previous.get("final_phase3_losses"), depths, False),
        )
        resumed_from = state.step
        initialised_from = str(init_from)
        phase = 3 if done == phase3_start(cfg) else 4
        log(f"initialised from {init_from} at step {state.step} (phase {phase})")
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"params: {n_params / 1e6:.2f} M (main {sum(p.numel() for p in model.lm.parameters()) / 1e6:.2f} M)"
    )

    model.train()
    t_run = time.monotonic()
    start_step = state.step
    tokens_seen = 0
    # stop_step exports an unfinished run (e.g. from a checkpoint); training_info says so.
    total_steps = phase4_start(cfg) + cfg.edit_ul_steps
    last_step = total_steps if stop_step is None else min(stop_step, total_steps)
    # The bar only draws: it reads no random state, so the weights are the same with or without it.
    with step_bar(start_step, last_step, enabled=not quiet and sys.stdout.isatty()) as bar:
        while state.step < last_step:
            if state.step in (phase3_start(cfg), phase4_start(cfg)):
                # Phases 3 and 4 start from the model as exported (bf16), optimizer anew.
                round_to_bf16(model)
                opt = make_optimizer(model, cfg)
            for group in opt.param_groups:
                group["lr"] = lr_at(state.step, cfg)
            if state.step < cfg.steps or phase3_start(cfg) <= state.step < phase4_start(cfg):
                if state.step < cfg.steps:
                    seq = batch_at(stream, state.step, cfg)
                    autocast = cfg.bf16_autocast
                else:
                    assert edits is not None
                    seq = phase3_batch(stream, edits, state.step, cfg)
                    autocast = cfg.edit_bf16_autocast
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    parts = losses(model, seq)
                loss = parts[0] + cfg.mtp_loss_weight / max(1, len(parts) - 1) * sum(parts[1:])
                logged = tuple(round(p.item(), 4) for p in parts)
            elif state.step < phase3_start(cfg):
                loss, logged = phase2_loss(model, stream, state.step, cfg)
            else:
                assert edits is not None
                loss, logged = phase2_loss(model, stream, state.step, cfg, edits)
            tokens_seen += tokens_at(state.step, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
            opt.step()
            state.step += 1
            state.last_losses = logged
            if state.step == cfg.steps:
                state.phase1_losses = logged
            if state.step == phase3_start(cfg) and cfg.ul_steps:
                state.phase2_losses = logged
            if state.step == phase4_start(cfg) and cfg.edit_steps:
                state.phase3_losses = logged
            bar(state.step, state.last_losses)
            run_s = time.monotonic() - t_run
            boundaries = (cfg.steps, phase3_start(cfg), phase4_start(cfg), total_steps)
            if state.step % cfg.log_every_steps == 0 or state.step in boundaries:
                done = state.step - start_step
                tps = tokens_seen / run_s
                eta = (total_steps - state.step) * run_s / done
                log(
                    f"step {state.step}/{total_steps} loss {' '.join(map(str, state.last_losses))} "
                    f"lr {lr_at(state.step - 1, cfg):.2e} {tps:.0f} tok/s eta {eta / 60:.1f} min"
                )
            if (
                checkpoint is not None
                and cfg.checkpoint_every_steps
                and (state.step % cfg.checkpoint_every_steps == 0)
            ):
                state.elapsed_s = time.monotonic() - t_run
                blob = {"model": model.state_dict(), "opt": opt.state_dict(), "state": state}
                torch.save(blob, checkpoint)

    train_s = time.monotonic() - t_run
    info: dict[str, object] = {
        "python": sys.version,
        "stdlib": corpus.stdlib,
        "corpus_sha256": corpus.sha256,
        "corpus_files": {"train": len(corpus.train), "heldout": len(corpus.heldout)},
        "heldout_files": [rel for rel, _ in corpus.heldout],
        "train_documents": len(docs),
        "train_stream_tokens": len(stream),
        "steps_completed": state.step,
        "resumed_from_step": resumed_from,
        "initialised_from": initialised_from,
        "tokens_per_step": {
            "phase1": tokens_at(0, cfg),
            "phase2": tokens_at(cfg.steps, cfg),
            "phase3": tokens_at(phase3_start(cfg), cfg),
            "phase4": tokens_at(phase4_start(cfg), cfg),
        },
        "edit_documents": edits.documents if edits else 0,
        "edit_stream_tokens": len(edits.ids) if edits else 0,
        "tokens_seen_this_process": tokens_seen,
        "hyperparameters": dataclasses.asdict(cfg),
        "parameters": n_params,
        "train_seconds_this_process": round(train_s, 1),
        "final_train_losses": (
            _named_losses(state.phase1_losses, cfg.mtp_depths, phase2=False)
            if state.phase1_losses
            else _named_losses(state.last_losses, cfg.mtp_depths, phase2=False)
            if state.step <= cfg.steps
            else None  # resumed inside phase 2 from a checkpoint that did not keep them
        ),
        "final_phase2_losses": (
            _named_losses(state.phase2_losses, cfg.mtp_depths, phase2=True)
            if state.phase2_losses
            else _named_losses(state.last_losses, cfg.mtp_depths, phase2=True)
            if cfg.steps < state.step <= phase3_start(cfg)
            else None
        ),
        "final_phase3_losses": (
            _named_losses(state.phase3_losses, cfg.mtp_depths, phase2=False)
            if state.phase3_losses
            else _named_losses(state.last_losses, cfg.mtp_depths, phase2=False)
            if phase3_start(cfg) < state.step <= phase4_start(cfg)
            else None
        ),
        "final_phase4_losses": (
            _named_losses(state.last_losses, cfg.mtp_depths, phase2=True)
            if state.step > phase4_start(cfg)
            else None
        ),
        "torch": torch.__version__,
    }
    save_directory(model, tok, config, out, info)
    log(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
    return info


def _loss_names(depths: int, phase2: bool) -> list[str]:
    """Phases 1 and 3 log main + MTP depths; phases 2 and 4 add unlikelihood and the repeat
    fraction."""
    names = ["main", *(f"mtp_depth_{d}" for d in range(1, depths + 1))]
    return names + (["unlikelihood", "generated_repeat_fraction"] if phase2 else [])


def _named_losses(values: tuple[float, ...], depths: int, phase2: bool) -> dict[str, float]:
    return dict(zip(_loss_names(depths, phase2), values, strict=True))


def _loss_tuple(named: object, depths: int, phase2: bool) -> tuple[float, ...]:
    """`_named_losses` undone (a training_info.json dict back to the logged order)."""
    if not isinstance(named, dict):
        return ()
    return tuple(float(named[k]) for k in _loss_names(depths, phase2))


@contextlib.contextmanager
def step_bar(
    start_step: int, last_step: int, *, enabled: bool
) -> Iterator[Callable[[int, tuple[float, ...]], None]]:
    """A rich progress bar over the training steps (on a terminal); a no-op otherwise.

    The periodic `log` lines still print (above the bar), so log files look the same.
    """
    if not enabled:
        yield lambda _step, _losses: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    task = progress.add_task("train", total=last_step, completed=start_step, loss="-")

    def advance(step: int, losses: tuple[float, ...]) -> None:
        progress.update(task, completed=step, loss=f"{losses[0]:.3f}" if losses else "-")

    with progress:
        yield advance
