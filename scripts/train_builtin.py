#!/usr/bin/env python3
"""Train meshd's built-in code model (Llama + DeepSeek-V3-style MTP heads) on CPU.

The corpus is the running interpreter's standard library source. The result is an ordinary
Hugging Face directory (config.json, model.safetensors, tokenizer files) plus `mtp.*` tensors
that `LlamaForCausalLM.from_pretrained` ignores and meshd's runtime uses as draft heads.

    python scripts/train_builtin.py --out meshd/model/builtin
    python scripts/train_builtin.py --tiny --out /tmp/tiny   # seconds; used by the tests

Everything is seeded: the corpus order, the tokenizer, the init and the batch order (drawn
per step from `seed` and the step number, so a resumed run sees the same batches).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import edit_data  # a sibling script module, not an installed package

EOT = "<|endoftext|>"
END = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (EOT, *ROLE_TOKENS, END)
# Roles are written as their special token; each turn ends with <|end|> so a chat reply stops
# on a single token that code never contains.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}


@dataclass(frozen=True)
class TrainConfig:
    """Every number that shapes the run; written verbatim into training_info.json."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    context_tokens: int = 256
    mtp_depths: int = 2
    mtp_loss_weight: float = 0.5
    batch_sequences: int = 24
    steps: int = 1000
    warmup_steps: int = 50
    lr_peak: float = 2.5e-3
    lr_final_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0
    heldout_per_mille: int = 25
    chat_fraction_of_bytes: float = 0.12
    max_file_bytes: int = 200_000
    max_files: int = 0  # 0 = whole corpus; the tiny test run uses a handful
    threads: int = 2
    bf16_autocast: bool = True
    log_every_steps: int = 10
    checkpoint_every_steps: int = 50
    # Phase 2, after `steps`: sequence-level unlikelihood (Welleck et al. 2019, "Neural Text
    # Generation with Unlikelihood Training"). Each step greedily continues training prompts
    # with the model itself and pushes down the probability of every token that completes an
    # n-gram already seen in that sequence (a loop), next to a normal MLE batch. Greedy
    # decoding of small models falls into loops; MLE alone does not teach it not to.
    ul_steps: int = 160
    ul_lr: float = 3e-4
    ul_batch_sequences: int = 16
    ul_prompt_tokens: int = 32
    ul_new_tokens: int = 96
    ul_ngram: int = 6
    ul_weight: float = 1.0
    ul_mle_batch_sequences: int = 16
    # Phase 3, after phase 2: code edits and a longer context. The stdlib rarely repeats a
    # function with a change, so phases 1-2 never taught the model to copy its prompt back
    # edited, and code-editing prompts outgrow 256 tokens. Each step mixes plain windows of
    # `edit_context_tokens` with edit documents (edit_data.py) starting at a document start.
    # The phase starts from the phase-2 weights rounded to bf16 (what the shipped file
    # holds) with a fresh optimizer, so `--init-from` a phase-2 directory gives the same bytes.
    edit_steps: int = 300
    edit_context_tokens: int = 1024
    edit_plain_sequences: int = 2
    edit_sample_sequences: int = 5
    # Phase 4: copying is repeating. After phase 3 the model loops on 10 of 10 held-out greedy
    # continuations (measured), so phase 2's unlikelihood comes back on this many of its own
    # continuations per step, next to phase 3's batches, at phase 2's flat lr and weight; it
    # counts only n-grams the model itself generated. (Run from the start of phase 3 instead,
    # it kept copying from ever forming: 0 of 8 held-out bodies' lines repeated after 90 steps;
    # counting the prompt's n-grams too did the same.) Like phase 3, it starts from the
    # exported (bf16) weights with a fresh optimizer.
    edit_ul_steps: int = 150
    edit_ul_sequences: int = 12
    # Phase 4's unlikelihood weight, and how many earlier occurrences of an n-gram (in the
    # model's own continuation) make a repeat of it a loop: 1 marks every repeat, 2 lets a
    # span come back once (a copy, a repeated line) and marks the third time (a loop).
    edit_ul_weight: float = 1.0
    edit_ul_min_seen: int = 1
    # fp32: on a CPU without bf16 units (AVX2 only) autocast made a step 20x slower.
    edit_bf16_autocast: bool = False
    edit_lr: float = 1e-3
    edit_warmup_steps: int = 20
    edit_max_function_chars: int = 1800


TINY = TrainConfig(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    context_tokens=32,
    batch_sequences=4,
    steps=3,
    warmup_steps=1,
    max_files=6,
    log_every_steps=1,
    checkpoint_every_steps=0,
    ul_steps=2,
    ul_batch_sequences=2,
    ul_prompt_tokens=8,
    ul_new_tokens=8,
    ul_ngram=2,
    ul_mle_batch_sequences=2,
    edit_steps=2,
    edit_context_tokens=48,
    edit_plain_sequences=1,
    edit_sample_sequences=1,
    edit_warmup_steps=1,
    edit_max_function_chars=400,
    edit_ul_steps=2,
    edit_ul_sequences=2,
)


# ---------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]
    sha256: str
    stdlib: str


def is_heldout(relpath: str, per_mille: int) -> bool:
    """Stable split by file: the first 4 bytes of sha256(relative path) mod 1000."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < per_mille


def load_corpus(cfg: TrainConfig) -> Corpus:
    """Read the stdlib `*.py` files, minus tests, site-packages and generated tables."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        if path.stat().st_size > cfg.max_file_bytes:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        # Codec tables (encodings/cp*.py) and similar are machine output, not code to learn.
        if "generated" in text[:400].lower():
            continue
        files.append((rel, text))
        if len(files) == cfg.max_files:  # tiny runs stop early; 0 never matches
            break
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    train = [f for f in files if not is_heldout(f[0], cfg.heldout_per_mille)]
    heldout = [f for f in files if is_heldout(f[0], cfg.heldout_per_mille)]
    return Corpus(train, heldout, h.hexdigest(), str(root))


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (identical output to CHAT_TEMPLATE)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{END}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_samples(source: str) -> Iterator[str]:
    """Turn each documented function into a chat exchange (two alternating task kinds)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2 or node.end_lineno is None:
            continue
        func = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        func = _dedent(func)
        if len(func) > 2000:
            continue
        body_start = node.body[1].lineno - 1
        head = _dedent("\n".join(lines[node.lineno - 1 : body_start]))
        body = func[len(head) :].lstrip("\n")
        if node.lineno % 2:
            user = f"Complete this Python function:\n```python\n{head}\n```"
            reply = f"```python\n{body}\n```"
        else:
            user = f"Write a Python function `{node.name}` that does this:\n{doc}"
            reply = f"```python\n{func}\n```"
        system = [{"role": "system", "content": "You are a helpful Python coding assistant."}]
        convo = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        yield render_chat((system if node.lineno % 3 == 0 else []) + convo)


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).rstrip()


def build_documents(corpus: Corpus, cfg: TrainConfig) -> list[str]:
    """Plain files plus a seeded sample of chat exchanges, in a seeded order."""
    rng = random.Random(cfg.seed)
    docs = [text for _, text in corpus.train]
    chats = [c for _, text in corpus.train for c in chat_samples(text)]
    rng.shuffle(chats)
    budget = cfg.chat_fraction_of_bytes * sum(map(len, docs))
    for chat in chats:
        if budget <= 0:
            break
        docs.append(chat)
        budget -= len(chat)
    rng.shuffle(docs)
    return docs


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the chat specials reserved as ids 0..4."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """One long token stream; each document is preceded by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------- model


class MTPLayer(nn.Module):
    """One DeepSeek-V3 MTP depth; attribute names are the checkpoint contract (mtp.{k}.*)."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = LlamaDecoderLayer(config, layer_idx)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self, tok_embeds: torch.Tensor, h_prev: torch.Tensor, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """Return this depth's pre-norm hidden state (the next depth's h_prev)."""
        x = self.eh_proj(torch.cat([self.enorm(tok_embeds), self.hnorm(h_prev)], dim=-1))
        # attention_mask=None makes transformers' sdpa path causal over the depth's sequence.
        return self.block(x, attention_mask=None, position_embeddings=rope)


class BuiltinModel(nn.Module):
    """LlamaForCausalLM plus `mtp` draft depths sharing its embedding and lm_head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(config)
        depths = config.num_nextn_predict_layers
        layers = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(config, layers + k) for k in range(depths))

    def trunk(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Main model's last-layer residual output (before the final norm) and the RoPE."""
        m = self.lm.model
        h = m.embed_tokens(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        rope = m.rotary_emb(h, position_ids=pos)
        for layer in m.layers:
            h = layer(h, attention_mask=None, position_embeddings=rope)
        return h, rope

    def logits(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return self.lm.lm_head(norm(h))

    def forward(self, seq: torch.Tensor) -> list[torch.Tensor]:
        """Logits for the main head and each MTP depth over T = len(seq) - 1 - D positions.

        Main position i predicts seq[i+1]; depth k+1 at position i sees seq[i+k+1] and
        predicts seq[i+k+2].
        """
        depths = len(self.mtp)
        t = seq.shape[1] - 1 - depths
        h, rope = self.trunk(seq[:, :t])
        out = [self.logits(h, self.lm.model.norm)]
        embed = self.lm.model.embed_tokens
        for k, layer in enumerate(self.mtp):
            h = layer(embed(seq[:, k + 1 : k + 1 + t]), h, rope)
            out.append(self.logits(h, layer.norm))
        return out


def llama_config(cfg: TrainConfig, tok: Tokenizer) -> LlamaConfig:
    eot = tok.token_to_id(EOT)
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max(
            cfg.context_tokens, cfg.edit_context_tokens if cfg.edit_steps else 0
        ),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=[eot, tok.token_to_id(END)],
        pad_token_id=eot,
        num_nextn_predict_layers=cfg.mtp_depths,
        attn_implementation="sdpa",
    )


def losses(model: BuiltinModel, seq: torch.Tensor) -> list[torch.Tensor]:
    """Mean cross-entropy of the main head, then of each MTP depth."""
    t = seq.shape[1] - 1 - len(model.mtp)
    return [
        F.cross_entropy(lg.flatten(0, 1).float(), seq[:, d + 1 : d + 1 + t].flatten().long())
        for d, lg in enumerate(model(seq))
    ]


# ---------------------------------------------------------------- training


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


def batch_at(stream: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """The step's batch of windows, a pure function of (seed, step)."""
    span = cfg.context_tokens + 1 + cfg.mtp_depths
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - span, (cfg.batch_sequences,), generator=gen)
    return torch.stack([stream[s : s + span] for s in starts.tolist()]).long()


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # No decay on norms (1-D gains); embedding and matrices decay.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr_peak, betas=(0.9, 0.95), eps=1e-8)


def ul_prompts(stream: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Phase-2 prompts: training windows drawn from (seed, step) like `batch_at`."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 500_009 + step)
    n = cfg.ul_prompt_tokens
    starts = torch.randint(0, len(stream) - n, (cfg.ul_batch_sequences,), generator=gen)
    return torch.stack([stream[s : s + n] for s in starts.tolist()]).long()


@torch.no_grad()
def greedy_continuations(
    model: BuiltinModel, prompts: torch.Tensor, cfg: TrainConfig
) -> torch.Tensor:
    """The model's own greedy continuations (end-of-text suppressed, as the loop check does)."""
    model.eval()
    try:
        return model.lm.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=cfg.ul_new_tokens,
            min_new_tokens=cfg.ul_new_tokens,
        )
    finally:
        model.train()


def repeated_ngram_mask(
    seqs: torch.Tensor,
    prompt_tokens: int,
    n: int,
    *,
    prompt_counts: bool = True,
    min_seen: int = 1,
) -> torch.Tensor:
    """True at each generated token that completes an n-gram seen earlier in its sequence.

    With `prompt_counts=False` only n-grams that ended in the generated part count as seen:
    a model repeating itself (a loop) is marked, a model copying from its prompt is not.
    With `min_seen=k` the n-gram must have been seen k times before (k=2: the third time).
    """
    mask = torch.zeros(seqs.shape, dtype=torch.bool)
    for row, ids in enumerate(seqs.tolist()):
        seen: dict[tuple[int, ...], int] = {}
        for end in range(n - 1, len(ids)):
            gram = tuple(ids[end - n + 1 : end + 1])
            if seen.get(gram, 0) >= min_seen and end >= prompt_tokens:
                mask[row, end] = True
            if prompt_counts or end >= prompt_tokens:
                seen[gram] = seen.get(gram, 0) + 1
    return mask


def unlikelihood_loss(model: BuiltinModel, seqs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of -log(1 - p(token)) over the masked (loop-completing) generated tokens."""
    h, _ = model.trunk(seqs[:, :-1])
    logits = model.logits(h, model.lm.model.norm).float()
    p = logits.softmax(-1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    target = mask[:, 1:]
    per_token = -torch.log((1 - p).clamp(min=1e-5))
    return (per_token * target).sum() / target.sum().clamp(min=1)


def phase2_loss(
    model: BuiltinModel,
    stream: torch.Tensor,
    step: int,
    cfg: TrainConfig,
    edits: EditStream | None = None,
) -> tuple[torch.Tensor, tuple[float, ...]]:
    """MLE on a small batch plus unlikelihood on the model's own repeats; logged parts.

    Phase 4 passes `edits`: the MLE batch is then `phase3_batch` and the unlikelihood term
    runs on `edit_ul_sequences` continuations, in fp32 unless `edit_bf16_autocast`.
    """
    ul_cfg = cfg
    if edits is not None:
        ul_cfg = dataclasses.replace(cfg, ul_batch_sequences=cfg.edit_ul_sequences)
    seqs = greedy_continuations(model, ul_prompts(stream, step, ul_cfg), cfg)
    # Phase 3 teaches copying from the prompt: only the model repeating itself is a loop.
    mask = repeated_ngram_mask(
        seqs,
        cfg.ul_prompt_tokens,
        cfg.ul_ngram,
        prompt_counts=edits is None,
        min_seen=1 if edits is None else cfg.edit_ul_min_seen,
    )
    if edits is None:
        batch = batch_at(
            stream, step, dataclasses.replace(cfg, batch_sequences=cfg.ul_mle_batch_sequences)
        )
        autocast = cfg.bf16_autocast
    else:
        batch = phase3_batch(stream, edits, step, cfg)
        autocast = cfg.edit_bf16_autocast
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        parts = losses(model, batch)
        ul = unlikelihood_loss(model, seqs, mask)
    loss = parts[0] + cfg.mtp_loss_weight / max(1, len(parts) - 1) * sum(parts[1:])
    repeat_fraction = mask[:, cfg.ul_prompt_tokens :].float().mean().item()
    logged = (*(p.item() for p in parts), ul.item(), repeat_fraction)
    weight = cfg.ul_weight if edits is None else cfg.edit_ul_weight
    return loss + weight * ul, tuple(round(x, 4) for x in logged)


@dataclass(frozen=True)
class EditStream:
    """Phase-3 edit documents as one token stream, and where each document starts."""

    ids: torch.Tensor
    starts: torch.Tensor
    documents: int


def encode_edit_stream(tok: Tokenizer, corpus: Corpus, cfg: TrainConfig) -> EditStream:
    """The training files' edit documents (edit_data.py), each preceded by <|endoftext|>."""
    docs = edit_data.edit_documents(
        [text for _, text in corpus.train], cfg.seed + 3, cfg.edit_max_function_chars, render_chat
    )
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    starts: list[int] = []
    for enc in tok.encode_batch(docs):
        starts.append(len(ids))
        ids.append(eot)
        ids.extend(enc.ids)
    # Every window of the phase must fit from its start; pad the tail with end-of-text.
    ids.extend([eot] * (cfg.edit_context_tokens + 1 + cfg.mtp_depths))
    return EditStream(
        torch.tensor(ids, dtype=torch.int32), torch.tensor(starts, dtype=torch.long), len(docs)
    )


def phase3_batch(
    stream: torch.Tensor, edits: EditStream, step: int, cfg: TrainConfig
) -> torch.Tensor:
    """Plain long windows from the code stream, then edit windows that start at a document."""
    plain_cfg = dataclasses.replace(
        cfg, context_tokens=cfg.edit_context_tokens, batch_sequences=cfg.edit_plain_sequences
    )
    plain = batch_at(stream, step, plain_cfg)
    span = cfg.edit_context_tokens + 1 + cfg.mtp_depths
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 700_001 + step)
    picks = torch.randint(0, len(edits.starts), (cfg.edit_sample_sequences,), generator=gen)
    rows = [edits.ids[s : s + span] for s in edits.starts[picks].tolist()]
    return torch.cat([plain, torch.stack(rows).long()])


def round_to_bf16(model: nn.Module) -> None:
    """Round every weight to bf16 and back: the model as the shipped file holds it."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def load_exported(model: BuiltinModel, directory: Path) -> None:
    """Weights of an exported directory (export_state_dict's names) into `model`."""
    weights = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    main = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(main, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(
            f"{directory}: weights do not match (missing {missing}, extra {unexpected})"
        )
    model.lm.tie_weights()
    model.mtp.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("mtp.")})


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


# ---------------------------------------------------------------- export


def export_state_dict(model: BuiltinModel) -> dict[str, torch.Tensor]:
    """HF names for the main model (lm_head omitted: tied) plus mtp.{k}.*, in bf16."""
    tensors = {k: v for k, v in model.lm.state_dict().items() if k != "lm_head.weight"}
    tensors |= {f"mtp.{k}": v for k, v in model.mtp.state_dict().items()}
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}


def save_directory(
    model: BuiltinModel, tok: Tokenizer, config: LlamaConfig, out: Path, info: dict[str, object]
) -> None:
    """Write the HF directory: weights, config, tokenizer, generation config, training info."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(export_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = config.to_dict()
    cfg_dict["architectures"] = ["LlamaForCausalLM"]
    cfg_dict["torch_dtype"] = "bfloat16"
    cfg_dict["dtype"] = "bfloat16"
    cfg_dict["num_nextn_predict_layers"] = len(model.mtp)
    # Readers older than transformers 5 look for rope_theta at the top level.
    cfg_dict["rope_theta"] = config.rope_parameters["rope_theta"]
    for key in ("attn_implementation", "id2label", "label2id"):
        cfg_dict.pop(key, None)
    cfg_dict.pop("_attn_implementation_autoset", None)
    _write_json(out / "config.json", cfg_dict)
    tok.save(str(out / "tokenizer.json"))
    # Written by hand so that both transformers 4.x and 5.x and meshd's runtime read it.
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOT,
            "pad_token": EOT,
            "additional_special_tokens": [*ROLE_TOKENS, END],
            "model_max_length": config.max_position_embeddings,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )
    eos = [tok.token_to_id(EOT), tok.token_to_id(END)]
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": eos, "pad_token_id": eos[0], "bos_token_id": eos[0]},
    )
    _write_json(out / "training_info.json", info)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("meshd/model/builtin"))
    p.add_argument("--tiny", action="store_true", help="a seconds-long run for tests")
    p.add_argument("--checkpoint", type=Path, default=None, help="save/resume file")
    p.add_argument("--stop-step", type=int, default=None, help="export early at this step")
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start phase 3 from this exported phase-2 directory (e.g. the previous built-in)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override a TrainConfig field, e.g. --set steps=300 hidden_size=256",
    )
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else TrainConfig()
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields:
            p.error(f"unknown field {key}")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true")}
        cfg = dataclasses.replace(cfg, **{key: kind[str(fields[key])](value)})
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    train(cfg, args.out, args.checkpoint, stop_step=args.stop_step, init_from=args.init_from)


if __name__ == "__main__":
    main()
