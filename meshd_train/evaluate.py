#!/usr/bin/env python3
"""Evaluate the built-in model: held-out bits per byte, MTP agreement, loops, samples.

    python scripts/eval_builtin.py                       # prints a markdown report
    python scripts/eval_builtin.py --docs docs/model.md --update-info

Uses transformers' LlamaForCausalLM for generation and the MTP code of `meshd_train.model` for
the draft depths (meshd's own runtime is cross-checked against these figures separately).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from meshd_train import edits
from meshd_train.config import TrainConfig
from meshd_train.corpus import SPECIAL_TOKENS, encode_stream, load_corpus, render_chat
from meshd_train.export import write_json
from meshd_train.model import BuiltinModel

DOCS_BEGIN = "<!-- eval:begin -->"
DOCS_END = "<!-- eval:end -->"
# Code prompts end at the end of a line, not after its newline: byte-level BPE joins a newline
# with the next line's indentation, so a prompt ending in a bare newline token puts the answer
# at a token boundary training never shows (the model then starts a new top-level statement,
# or closes a chat code fence, instead of writing the body).
CODE_PROMPTS = (
    "def fibonacci(n):",
    'import os\n\n\ndef list_python_files(root):\n    """Return the paths of all .py files under root."""',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):',
)
CHAT_PROMPT = "Write a Python function `is_palindrome` that does this:\nReturn True if the string reads the same backwards."


@dataclass(frozen=True)
class EvalConfig:
    """Knobs of the evaluation; the report states them."""

    seed: int = 0
    batch_windows: int = 16
    loop_prompts: int = 50
    loop_prompt_tokens: int = 32  # + 200 new stays inside the 256-token context
    loop_new_tokens: int = 200
    loop_threshold: float = 0.5
    sample_new_tokens: int = 96
    temperature: float = 0.8
    edit_prompts: int = 20
    edit_max_function_chars: int = 1800


def load_builtin(directory: Path) -> tuple[BuiltinModel, Tokenizer, LlamaConfig]:
    """The shipped directory as a float32 BuiltinModel (main model + MTP depths)."""
    config = LlamaConfig.from_pretrained(str(directory))
    model = BuiltinModel(config)
    weights = {k: v.float() for k, v in load_file(str(directory / "model.safetensors")).items()}
    main = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    model.lm.load_state_dict(main, strict=False)  # lm_head is tied to embed_tokens
    model.mtp.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("mtp.")})
    model.eval()
    return model, Tokenizer.from_file(str(directory / "tokenizer.json")), config


def heldout_stream(directory: Path, tok: Tokenizer) -> tuple[torch.Tensor, str]:
    """Held-out files (same split as training) as one <|endoftext|>-separated stream."""
    info = json.loads((directory / "training_info.json").read_text())
    cfg = TrainConfig(**info["hyperparameters"])
    corpus = load_corpus(cfg)
    note = "" if corpus.sha256 == info["corpus_sha256"] else " (corpus differs from training!)"
    return encode_stream(tok, [text for _, text in corpus.heldout]), note


def token_bytes(tok: Tokenizer) -> torch.Tensor:
    """UTF-8 bytes each id stands for (byte-level BPE: one char per byte; specials 0)."""
    specials = {tok.token_to_id(s) for s in SPECIAL_TOKENS}
    sizes = torch.zeros(tok.get_vocab_size(), dtype=torch.long)
    for piece, i in tok.get_vocab().items():
        sizes[i] = 0 if i in specials else len(piece)
    return sizes


@torch.no_grad()
def teacher_forced(
    model: BuiltinModel, stream: torch.Tensor, tok: Tokenizer, cfg: EvalConfig
) -> dict[str, float]:
    """Bits per byte of the main head and each depth's agreement with the main argmax."""
    depths, ctx = len(model.mtp), model.lm.config.max_position_embeddings
    span = ctx + 1 + depths
    starts = list(range(0, len(stream) - depths - 1, ctx))
    sizes = token_bytes(tok)
    nats, nbytes, ntok = 0.0, 0, 0
    agree = [0] * depths
    correct = [0] * depths
    total = [0] * depths
    for b in range(0, len(starts), cfg.batch_windows):
        group = [stream[s : s + span].long() for s in starts[b : b + cfg.batch_windows]]
        if len({len(g) for g in group}) > 1:  # the ragged tail window goes alone
            batches = [g.unsqueeze(0) for g in group]
        else:
            batches = [torch.stack(group)]
        for seq in batches:
            t = seq.shape[1] - 1 - depths
            logits = model(seq)
            target = seq[:, 1 : 1 + t]
            nats += F.cross_entropy(
                logits[0].flatten(0, 1), target.flatten(), reduction="sum"
            ).item()
            nbytes += int(sizes[target].sum())
            ntok += target.numel()
            greedy = logits[0].argmax(-1)
            for d in range(1, depths + 1):
                if t <= d:
                    continue
                draft = logits[d].argmax(-1)
                agree[d - 1] += int((draft[:, : t - d] == greedy[:, d:]).sum())
                correct[d - 1] += int((draft == seq[:, d + 1 : d + 1 + t]).sum())
                total[d - 1] += draft[:, : t - d].numel()
    out = {
        "heldout_tokens": float(ntok),
        "heldout_bytes": float(nbytes),
        "bits_per_byte": nats / math.log(2) / nbytes,
        "nats_per_token": nats / ntok,
    }
    for d in range(depths):
        out[f"mtp_depth_{d + 1}_agreement"] = agree[d] / total[d]
        out[f"mtp_depth_{d + 1}_accuracy"] = correct[d] / total[d]
    return out


def distinct_4gram_ratio(ids: list[int]) -> float:
    """Unique 4-grams / 4-grams: 1.0 for text that never repeats, near 0 for a loop."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(1, len(grams))


@torch.no_grad()
def loop_check(lm: LlamaForCausalLM, stream: torch.Tensor, cfg: EvalConfig) -> dict[str, object]:
    """Greedy continuations of evenly spaced held-out prompts, scored for repetition."""
    n, plen = cfg.loop_prompts, cfg.loop_prompt_tokens
    step = (len(stream) - plen) // n
    prompts = torch.stack([stream[i * step : i * step + plen] for i in range(n)]).long()
    out = lm.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=cfg.loop_new_tokens,
        min_new_tokens=cfg.loop_new_tokens,  # suppress EOS so every continuation is scored
    )
    ratios = [distinct_4gram_ratio(row[plen:].tolist()) for row in out]
    return {
        "ratios": ratios,
        "mean": sum(ratios) / n,
        "min": min(ratios),
        "fraction_below_threshold": sum(r < cfg.loop_threshold for r in ratios) / n,
    }


def edit_prompt(fn: edits.Function) -> tuple[str, str] | None:
    """The code-editing prompt of `meshd bench spec` for `fn`, and the body it should repeat.

    The function, a comment asking for it renamed to `<name>_v2`, and the renamed header line
    (without its newline: byte-level BPE joins a newline with the next line's indentation, so
    a prompt ending in a bare newline would start the answer at a token boundary training never
    shows); the answer is the rest of the renamed function, from that newline.
    """
    new = f"{fn.name}_v2"
    edited = edits.rename(fn, fn.name, new)
    if edited is None:
        return None
    header, _, body = edited.partition("\n")
    comment = f"# The same function as {fn.name}, renamed to {new}."
    return f"{fn.source}\n\n\n{comment}\n{header}", "\n" + body + "\n"


def held_out_functions(directory: Path, cfg: EvalConfig) -> list[edits.Function]:
    """`cfg.edit_prompts` functions evenly spaced over the held-out files."""
    info = json.loads((directory / "training_info.json").read_text())
    corpus = load_corpus(TrainConfig(**info["hyperparameters"]))
    every = [
        fn
        for _, text in corpus.heldout
        for fn in edits.functions(text, cfg.edit_max_function_chars)
        if edit_prompt(fn) is not None
    ]
    step = max(1, len(every) // cfg.edit_prompts)
    return every[::step][: cfg.edit_prompts]


@torch.no_grad()
def edit_check(
    lm: LlamaForCausalLM, tok: Tokenizer, directory: Path, cfg: EvalConfig
) -> dict[str, object]:
    """Greedy answers to the code-editing prompt on held-out functions: how much is copied.

    Per function: the length of the answer's longest prefix equal to the expected body, as a
    fraction of the body's characters (1.0 = the whole body came back unchanged), and the
    fraction of the body's lines that the answer holds (a copy with a slip still repeats most
    lines, which is what prompt-lookup speculation feeds on).
    """
    fractions = []
    lines = []
    for fn in held_out_functions(directory, cfg):
        made = edit_prompt(fn)
        assert made is not None
        prompt, body = made
        ids = torch.tensor([tok.encode(prompt).ids])
        out = lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=len(tok.encode(body).ids) + 4,
        )
        text = tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)
        same = next((i for i, (a, b) in enumerate(zip(text, body, strict=False)) if a != b), None)
        fractions.append(
            min(len(text), len(body)) / len(body) if same is None else same / len(body)
        )
        wanted = [line for line in body.split("\n") if line.strip()]
        got = set(text.split("\n"))
        lines.append(sum(line in got for line in wanted) / max(1, len(wanted)))
    n = max(1, len(fractions))
    return {
        "functions": len(fractions),
        "fractions": fractions,
        "mean_copied_fraction": sum(fractions) / n,
        "fraction_copied_whole": sum(f == 1.0 for f in fractions) / n,
        "mean_lines_repeated": sum(lines) / n,
    }


def generate_text(
    lm: LlamaForCausalLM, tok: Tokenizer, prompt: str, cfg: EvalConfig, sample: bool
) -> str:
    ids = torch.tensor([tok.encode(prompt).ids])
    torch.manual_seed(cfg.seed)
    kwargs = {"temperature": cfg.temperature, "top_k": 0, "top_p": 1.0} if sample else {}
    out = lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=cfg.sample_new_tokens,
        do_sample=sample,
        **kwargs,
    )
    return tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=False)


def evaluate(directory: Path, cfg: EvalConfig) -> dict[str, object]:
    """Every figure of the report, as a JSON-able dict."""
    torch.set_num_threads(2)
    model, tok, _ = load_builtin(directory)
    stream, note = heldout_stream(directory, tok)
    lm = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    chat = render_chat([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True)
    samples = [
        {
            "prompt": p,
            "greedy": generate_text(lm, tok, p, cfg, False),
            "sampled": generate_text(lm, tok, p, cfg, True),
        }
        for p in (*CODE_PROMPTS, chat)
    ]
    return {
        "eval_config": dataclasses.asdict(cfg),
        "corpus_note": note,
        "teacher_forced": teacher_forced(model, stream, tok, cfg),
        "loops": loop_check(lm, stream, cfg),
        "edits": edit_check(lm, tok, directory, cfg),
        "samples": samples,
    }


def markdown(result: dict[str, object], cfg: EvalConfig) -> str:
    """The report as markdown (what --docs writes between the eval markers)."""
    tf = result["teacher_forced"]
    loops = result["loops"]
    edits = result["edits"]
    assert isinstance(tf, dict) and isinstance(loops, dict) and isinstance(edits, dict)
    lines = [
        f"Held-out: {int(tf['heldout_tokens'])} tokens, {int(tf['heldout_bytes'])} bytes"
        f"{result['corpus_note']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| held-out bits per byte (main head) | {tf['bits_per_byte']:.3f} |",
        f"| held-out nats per token | {tf['nats_per_token']:.3f} |",
    ]
    depth = 1
    while f"mtp_depth_{depth}_agreement" in tf:
        lines.append(
            f"| MTP depth {depth}: top-1 agreement with main greedy (teacher-forced) | "
            f"{tf[f'mtp_depth_{depth}_agreement']:.3f} |"
        )
        lines.append(
            f"| MTP depth {depth}: top-1 accuracy vs the true token | "
            f"{tf[f'mtp_depth_{depth}_accuracy']:.3f} |"
        )
        depth += 1
    lines += [
        f"| distinct 4-gram ratio, mean over {cfg.loop_prompts} greedy {cfg.loop_new_tokens}-token"
        f" continuations | {loops['mean']:.3f} |",
        f"| ... minimum | {loops['min']:.3f} |",
        f"| ... fraction below {cfg.loop_threshold} (a loop) | {loops['fraction_below_threshold']:.2f} |",
        f"| code edit: body characters repeated correctly, mean over {edits['functions']} held-out"
        f" functions asked back renamed | {edits['mean_copied_fraction']:.3f} |",
        f"| ... functions repeated whole | {edits['fraction_copied_whole']:.2f} |",
        f"| ... body lines found in the answer, mean | {edits['mean_lines_repeated']:.3f} |",
        "",
        f"Samples ({cfg.sample_new_tokens} new tokens; sampled = T={cfg.temperature}, "
        f"seed {cfg.seed}, no top-k/top-p):",
        "",
    ]
    samples = result["samples"]
    assert isinstance(samples, list)
    for s in samples:
        for kind in ("greedy", "sampled"):
            lines += [f"**{kind}**, prompt {s['prompt'][:40]!r}...:", "", "```text"]
            lines += [s["prompt"] + s[kind], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_docs(path: Path, text: str) -> None:
    """Replace the block between the eval markers of `path` with `text`."""
    doc = path.read_text()
    head, _, rest = doc.partition(DOCS_BEGIN)
    _, _, tail = rest.partition(DOCS_END)
    path.write_text(f"{head}{DOCS_BEGIN}\n{text}{DOCS_END}{tail}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("meshd/model/builtin"))
    p.add_argument("--docs", type=Path, default=None, help="markdown file with eval markers")
    p.add_argument("--update-info", action="store_true", help="store figures in training_info")
    args = p.parse_args(argv)
    cfg = EvalConfig()
    result = evaluate(args.dir, cfg)
    text = markdown(result, cfg)
    print(text)
    if args.docs is not None:
        write_docs(args.docs, text)
    if args.update_info:
        info_path = args.dir / "training_info.json"
        info = json.loads(info_path.read_text())
        loops = dict(result["loops"])  # type: ignore[call-overload]
        loops.pop("ratios")
        edits = dict(result["edits"])  # type: ignore[call-overload]
        edits.pop("fractions")
        info["eval"] = {
            "teacher_forced": result["teacher_forced"],
            "loops": loops,
            "edits": edits,
            "eval_config": result["eval_config"],
        }
        write_json(info_path, info)


if __name__ == "__main__":
    main()
