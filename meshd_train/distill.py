"""`python -m meshd_train distill`: the built-in model's draft, distilled from its logits.

The draft is a small Llama (no MTP depths) with the built-in model's tokenizer, trained to
match the built-in model's next-token distribution (KL(teacher || student) on the training
corpus of phase 1: the standard library plus chat samples, the same held-out split). A draft
is worth its acceptance rate, i.e. how often its argmax equals the target's, and matching the
whole distribution (not the corpus' one-hot tokens) is what teaches it that.

    python -m meshd_train distill --out meshd/model/builtin_draft --minutes 25

The embedding starts from the teacher's, projected onto its top principal directions (the
student is narrower): the tied lm_head then already ranks tokens like the teacher's.

The run is bounded by wall time as well as steps (a shared CPU): the learning rate decays on
max(step / steps, elapsed / budget), so a run cut short by the clock still ends cooled down.
That makes a timed run depend on the machine's speed; training_info.json records the steps done.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig

from meshd_train.config import TrainConfig
from meshd_train.corpus import END, EOT, build_documents, encode_stream, load_corpus
from meshd_train.export import save_directory
from meshd_train.model import BuiltinModel, load_exported


@dataclass(frozen=True)
class DistillConfig:
    """Every number that shapes the distillation; written into training_info.json."""

    seed: int = 1234
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    context_tokens: int = 128
    batch_sequences: int = 16
    steps: int = 3000
    warmup_steps: int = 30
    lr_peak: float = 3e-3
    lr_final_fraction: float = 0.05
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    minutes: float = 25.0
    threads: int = 1
    max_files: int = 0
    log_every_steps: int = 20
    eval_windows: int = 32
    eval_every_steps: int = 0
    # Windows of a batch that continue a corpus prompt with the teacher's own greedy tokens
    # (what a draft must predict at inference is the target's text, not the corpus').
    generated_fraction: float = 0.5
    prompt_tokens_min: int = 16
    prompt_tokens_max: int = 64


TINY_DISTILL = DistillConfig(
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    context_tokens=16,
    batch_sequences=2,
    steps=3,
    warmup_steps=1,
    max_files=4,
    log_every_steps=1,
    eval_windows=2,
    prompt_tokens_min=4,
    prompt_tokens_max=8,
)


def log(msg: str) -> None:
    print(f"[distill] {msg}", flush=True)


def load_teacher(directory: Path) -> BuiltinModel:
    config = LlamaConfig.from_pretrained(str(directory))
    config.num_nextn_predict_layers = getattr(config, "num_nextn_predict_layers", 0) or 0
    teacher = BuiltinModel(config)
    load_exported(teacher, directory)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def student_config(cfg: DistillConfig, teacher: LlamaConfig, tok: Tokenizer) -> LlamaConfig:
    eot = tok.token_to_id(EOT)
    return LlamaConfig(
        vocab_size=teacher.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=teacher.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=[eot, tok.token_to_id(END)],
        pad_token_id=eot,
        num_nextn_predict_layers=0,
        attn_implementation="sdpa",
    )


def init_embedding(student: BuiltinModel, teacher: BuiltinModel) -> None:
    """The teacher's embedding on its top principal directions (student width)."""
    e = teacher.lm.model.embed_tokens.weight.detach().float()
    width = student.lm.model.embed_tokens.weight.shape[1]
    _, _, vh = torch.linalg.svd(e, full_matrices=False)
    with torch.no_grad():
        student.lm.model.embed_tokens.weight.copy_(e @ vh[:width].T)
    student.lm.tie_weights()


def window_batch(stream: torch.Tensor, step: int, cfg: DistillConfig, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 900_001 + step)
    starts = torch.randint(0, len(stream) - cfg.context_tokens, (n,), generator=gen)
    return torch.stack([stream[s : s + cfg.context_tokens] for s in starts.tolist()]).long()


def generated_batch(
    teacher: BuiltinModel, stream: torch.Tensor, step: int, cfg: DistillConfig, n: int
) -> torch.Tensor:
    """`n` windows that start with a corpus prompt and continue with the teacher's greedy
    tokens up to `context_tokens` (EOS suppressed: the window stays full)."""
    if n <= 0:
        return torch.empty(0, cfg.context_tokens, dtype=torch.long)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 700_001 + step)
    lo, hi = cfg.prompt_tokens_min, max(cfg.prompt_tokens_min, cfg.prompt_tokens_max)
    prompt_len = int(torch.randint(lo, hi + 1, (1,), generator=gen))
    prompts = window_batch(stream, step + 7_000_000, cfg, n)[:, :prompt_len]
    new = cfg.context_tokens - prompt_len
    with torch.inference_mode():
        out = teacher.lm.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, : cfg.context_tokens].clone()


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student)."""
    t = teacher_logits.float().log_softmax(-1).flatten(0, 1)
    s = student_logits.float().log_softmax(-1).flatten(0, 1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.inference_mode()
def agreement(
    student: BuiltinModel, teacher: BuiltinModel, seq: torch.Tensor, skip: int = 0
) -> float:
    """Fraction of positions (from `skip` on) of the windows `seq` where the student's argmax
    equals the teacher's: the greedy per-token acceptance a draft of depth 1 would see."""
    student.eval()
    agree = student.lm(seq).logits.argmax(-1) == teacher.lm(seq).logits.argmax(-1)
    student.train()
    return float(agree[:, skip:].float().mean())


def eval_sets(
    teacher: BuiltinModel, heldout: torch.Tensor, cfg: DistillConfig
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Held-out corpus windows, and the teacher's greedy continuations of held-out prompts
    (the prompt's length: agreement is measured on the continuation only)."""
    corpus = window_batch(heldout, -1, cfg, cfg.eval_windows)
    fixed = dataclasses.replace(cfg, prompt_tokens_max=cfg.prompt_tokens_min)
    generated = generated_batch(teacher, heldout, -1, fixed, cfg.eval_windows)
    return corpus, generated, cfg.prompt_tokens_min


def lr_at(step: int, elapsed: float, cfg: DistillConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr_peak * (step + 1) / cfg.warmup_steps
    progress = max(step / cfg.steps, elapsed / (cfg.minutes * 60))
    floor = cfg.lr_final_fraction
    return cfg.lr_peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def distill(
    cfg: DistillConfig, teacher_dir: Path, out: Path, init: Path | None = None
) -> dict[str, object]:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.monotonic()
    tok = Tokenizer.from_file(str(teacher_dir / "tokenizer.json"))
    corpus_cfg = dataclasses.replace(TrainConfig(), max_files=cfg.max_files)
    corpus = load_corpus(corpus_cfg)
    stream = encode_stream(tok, build_documents(corpus, corpus_cfg))
    heldout = encode_stream(tok, [text for _, text in corpus.heldout])
    if len(heldout) <= cfg.context_tokens:  # a tiny run's few files may hold none
        heldout = stream
    teacher = load_teacher(teacher_dir)
    config = student_config(cfg, teacher.lm.config, tok)
    student = BuiltinModel(config)
    if init is not None:  # go on from an earlier draft of this shape (its weights as saved)
        load_exported(student, init)
        student.lm.tie_weights()
    else:
        init_embedding(student, teacher)
    n_params = sum(p.numel() for p in student.parameters())
    log(f"{len(stream)} train tokens, {len(heldout)} held-out; student {n_params / 1e6:.2f} M")
    eval_corpus, eval_generated, eval_skip = eval_sets(teacher, heldout, cfg)

    def agreements() -> tuple[float, float]:
        return (
            agreement(student, teacher, eval_corpus),
            agreement(student, teacher, eval_generated, eval_skip),
        )

    at_start = agreements()
    log(
        f"prep {time.monotonic() - t0:.1f}s; agreement at start "
        f"{at_start[0]:.3f} / {at_start[1]:.3f}"
    )
    decay = [p for p in student.parameters() if p.dim() >= 2]
    rest = [p for p in student.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
        lr=cfg.lr_peak,
        betas=(0.9, 0.95),
    )
    student.train()
    t_run = time.monotonic()
    step = 0
    loss_value = float("nan")
    while step < cfg.steps:
        elapsed = time.monotonic() - t_run
        if elapsed > cfg.minutes * 60:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, elapsed, cfg)
        n_gen = round(cfg.batch_sequences * cfg.generated_fraction)
        seq = torch.cat(
            [
                window_batch(stream, step, cfg, cfg.batch_sequences - n_gen),
                generated_batch(teacher, stream, step, cfg, n_gen),
            ]
        )
        with torch.inference_mode():
            teacher_logits = teacher.lm(seq).logits
        teacher_logits = teacher_logits.clone()  # an ordinary tensor for the loss's autograd
        loss = kl_loss(student.lm(seq).logits, teacher_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip_norm)
        opt.step()
        step += 1
        loss_value = round(loss.item(), 4)
        if step % cfg.log_every_steps == 0:
            log(
                f"step {step} kl {loss_value} lr {lr_at(step - 1, elapsed, cfg):.2e} {elapsed:.0f}s"
            )
        if cfg.eval_every_steps and step % cfg.eval_every_steps == 0:
            log(f"step {step} agreement {'{:.3f} / {:.3f}'.format(*agreements())}")
            # A snapshot to try while training goes on (export_state_dict writes bf16 copies).
            save_directory(student, tok, config, out.with_name(out.name + "-snapshot"), {})
    train_s = time.monotonic() - t_run
    # The file holds bf16: measure what ships.
    with torch.no_grad():
        for p in student.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    agree, agree_generated = agreements()
    log(
        f"{step} steps in {train_s:.0f}s; held-out argmax agreement {agree:.3f} (corpus), "
        f"{agree_generated:.3f} (the teacher's greedy continuations)"
    )
    info: dict[str, object] = {
        "distilled_from": str(teacher_dir.name),
        "initialised_from": str(init) if init is not None else None,
        "command": "python -m meshd_train distill " + " ".join(sys.argv[2:]),
        "corpus_sha256": corpus.sha256,
        "hyperparameters": dataclasses.asdict(cfg),
        "parameters": n_params,
        "steps_completed": step,
        "train_seconds": round(train_s, 1),
        "final_kl": loss_value,
        "heldout_argmax_agreement": round(agree, 4),
        "heldout_generated_argmax_agreement": round(agree_generated, 4),
        "train_tokens": step * cfg.batch_sequences * cfg.context_tokens,
        "torch": torch.__version__,
        "python": sys.version,
    }
    save_directory(student, tok, config, out, info)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"wrote {out} ({size / 1e6:.2f} MB)")
    return info


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m meshd_train distill", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("meshd/model/builtin_draft"))
    p.add_argument("--teacher", type=Path, default=Path("meshd/model/builtin"))
    p.add_argument("--minutes", type=float, default=None, help="wall-time budget of the loop")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run for tests")
    p.add_argument("--init", type=Path, default=None, help="start from this draft's weights")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    cfg = TINY_DISTILL if args.tiny else DistillConfig()
    if args.minutes is not None:
        cfg = dataclasses.replace(cfg, minutes=args.minutes)
    types = {f.name: f.type for f in dataclasses.fields(DistillConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in types:
            p.error(f"unknown field {key}")
        cfg = dataclasses.replace(
            cfg, **{key: {"int": int, "float": float}[str(types[key])](value)}
        )
    distill(cfg, args.teacher, args.out, args.init)
