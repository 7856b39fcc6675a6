"""Acceptance of sampled drafts: Gumbel-coupled vs greedy vs the textbook rule, offline.

    python scripts/coupling_acceptance.py               # built-in model, 2 held-out files
    python scripts/coupling_acceptance.py --tokens 300 --seeds 64 --temperatures 0.7 1.0

Target: the built-in model (meshd's StageModel, fp32), teacher-forced over real text it never
saw in training (the held-out stdlib files heapq.py and selectors.py, meshd_train/corpus.py).
Drafts, each giving a distribution q for the position whose target distribution is p:
- `int4`: the same model with int4 (q4_k) weights (a close draft, like a quantized copy);
- `mtp1`: the model's first MTP head, predicting token t+2 from the hidden state at t and the
  real token t+1 (a weaker draft: about 62 % greedy agreement at temperature 0).
Per position, with p and q filtered by the same SamplingParams:
- coupled: the draft proposes `coupled_draft_token` (argmax log q + g, the target's keyed
  noise) and is accepted when it equals the target's own sample (`sample_token`); measured
  over `--seeds` seeds;
- greedy: the draft proposes argmax q; accepted when the target samples it: p[argmax q];
- textbook (Leviathan et al. 2023, Chen et al. 2023): the draft samples from q, accepted with
  probability min(1, p/q): Σ min(p_i, q_i) = 1 - TV(p, q); exact in distribution, but the
  text then depends on the drafts, not only on the seed;
- independent: the draft samples from q with its own noise, accepted while equal: Σ p_i q_i.
`tokens/window (k=4)` chains the per-position rates along the text: the expected tokens one
window of 4 drafts commits (accepted drafts plus the target's token), averaged over starts.
"""

from __future__ import annotations

import argparse
import inspect
import statistics

import torch

from meshd.bench.sampling_reference import filtered_probs
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel
from meshd.speculative.sampling import (
    SamplingParams,
    coupled_draft_token,
    keyed_gumbel,
    sample_token,
)

HELD_OUT = ("heapq", "selectors")


def text_tokens(tokenizer_dir: str, per_file: int) -> list[list[int]]:
    """The first `per_file` tokens of each held-out module's source."""
    tokenizer = open_tokenizer(tokenizer_dir)
    out = []
    for name in HELD_OUT:
        source = inspect.getsource(__import__(name))
        out.append(tokenizer.encode(source)[:per_file])
    return out


def rows(stage: StageModel, tokens: list[int], *, mtp: bool = False) -> tuple[torch.Tensor, int]:
    """Logits rows and the absolute position row 0 predicts.

    Main model: row j predicts position j+1. MTP depth 1: row j predicts position j+2.
    """
    sid = f"acc-{id(stage)}-{mtp}"
    stage.open_session(sid, len(tokens) + 1)
    try:
        out = stage.forward(sid, 0, torch.tensor(tokens))
        assert out.logits is not None
        if not mtp:
            return out.logits.float(), 1
        m = stage.mtp_forward(sid, 1, 0, out.hidden[:-1], torch.tensor(tokens[1:]))
        return m.logits.float(), 2
    finally:
        stage.close_session(sid)


def window_tokens(rates: list[float], k: int) -> float:
    """Mean over starts of Σ_{j=0..k} Π_{i<j} rate[start+i] (accepted drafts + 1)."""
    totals = []
    for start in range(len(rates) - k):
        total, alive = 1.0, 1.0
        for i in range(k):
            alive *= rates[start + i]
            total += alive
        totals.append(total)
    return statistics.fmean(totals)


def measure(
    target: torch.Tensor, draft: torch.Tensor, first_pos: int, params: SamplingParams, seeds: int
) -> dict[str, list[float]]:
    """Per-position acceptance of each rule; target and draft rows aligned (same position)."""
    rates: dict[str, list[float]] = {"coupled": [], "greedy": [], "textbook": [], "independent": []}
    for j in range(target.shape[0]):
        position = first_pos + j
        p = filtered_probs(target[j], params)
        p = p / p.sum()
        q = filtered_probs(draft[j], params)
        q = q / q.sum()
        rates["greedy"].append(float(p[int(q.argmax())]))
        rates["textbook"].append(float(torch.minimum(p, q).sum()))
        rates["independent"].append(float((p * q).sum()))
        # Both draws reuse one noise row per seed: the product functions' own rule (checked
        # against them on the first seed of every position).
        log_p = torch.log(p)
        log_q = torch.log(q)
        agree = 0
        for seed in range(seeds):
            g = keyed_gumbel(seed, position, torch.arange(p.shape[0]))
            target_token = int((log_p + g).argmax())
            draft_token = int((log_q + g).argmax())
            if seed == 0:
                keyed = SamplingParams(
                    temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
                )
                assert target_token == sample_token(target[j], keyed, position)
                assert draft_token == coupled_draft_token(draft[j], keyed, position)
            agree += target_token == draft_token
        rates["coupled"].append(agree / seeds)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(builtin_model_dir()))
    parser.add_argument("--tokens", type=int, default=300, help="tokens of text per file")
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 0.8, 1.0])
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--drafts", nargs="*", default=["int4", "mtp1"])
    args = parser.parse_args()
    torch.manual_seed(0)
    checkpoint = open_checkpoint(args.dir)
    layers = checkpoint.config.num_layers
    target_stage = StageModel.load(checkpoint, 0, layers, device="cpu")
    int4_stage = StageModel.load(checkpoint, 0, layers, device="cpu", quantization="int4")
    texts = text_tokens(args.dir, args.tokens)
    pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]] = {d: [] for d in args.drafts}
    for tokens in texts:
        target, first = rows(target_stage, tokens)
        if "int4" in pairs:
            draft, _ = rows(int4_stage, tokens)
            pairs["int4"].append((target[:-1], draft[:-1], first))
        if "mtp1" in pairs:
            draft, first_mtp = rows(target_stage, tokens, mtp=True)
            # MTP row j predicts position j+2, as main row j+1 does.
            pairs["mtp1"].append((target[1:-1], draft[:-1], first_mtp))
    positions = sum(t.shape[0] for t, _, _ in next(iter(pairs.values())))
    print(f"{len(texts)} held-out texts, {positions} positions, {args.seeds} seeds, ", end="")
    print(f"top_p {args.top_p}")
    header = "| draft | T | coupled | greedy | textbook | independent | tokens/window k=4 "
    print(header + "(coupled / greedy / textbook) |")
    print("|---|---|---|---|---|---|---|")
    for name, items in pairs.items():
        for temperature in args.temperatures:
            params = SamplingParams(temperature=temperature, top_p=args.top_p)
            merged: dict[str, list[float]] = {}
            windows: dict[str, list[float]] = {}
            for target, draft, first in items:
                rates = measure(target, draft, first, params, args.seeds)
                for rule, values in rates.items():
                    merged.setdefault(rule, []).extend(values)
                    windows.setdefault(rule, []).append(window_tokens(values, 4))
            mean = {rule: statistics.fmean(v) for rule, v in merged.items()}
            per_window = {rule: statistics.fmean(v) for rule, v in windows.items()}
            print(
                f"| {name} | {temperature} | {mean['coupled']:.3f} | {mean['greedy']:.3f} "
                f"| {mean['textbook']:.3f} | {mean['independent']:.3f} "
                f"| {per_window['coupled']:.2f} / {per_window['greedy']:.2f} / "
                f"{per_window['textbook']:.2f} |",
                flush=True,
            )
    for name, items in pairs.items():
        agree = [
            float(int(t.argmax()) == int(d.argmax()))
            for target, draft, _ in items
            for t, d in zip(target, draft, strict=True)
        ]
        print(f"greedy requests, {name}: argmax agreement {statistics.fmean(agree):.3f}")


if __name__ == "__main__":
    main()
