"""Where `auto` loses against single strategies: a per-window trace of its choices.

    python scripts/auto_trace.py                      # 2 stages, 20 ms, every bench prompt
    python scripts/auto_trace.py --kinds completion --rounds 2
    python scripts/auto_trace.py --model TARGET.gguf --speculative-draft-model DRAFT.gguf \
        --stages 1 --rtt-ms 0 --tokens 64 --prompts 3 --kinds completion --decisions \
        --strategies disabled ngram-simple draft-ngram auto

Runs the bench's prompts in `meshd bench spec`'s order (a local pipeline of the built-in model
with its shipped draft, or `--model` with `--speculative-draft-model` as stored, greedy, 96 tokens, strategies interleaved, one `AcceptanceBook` per
pipeline as the bench has), and for each `auto` request prints one line per window: the
strategy that drafted it, whether the MTP heads still ran, drafts sent / accepted, and the
time `auto` spent in `observe` (shadow drafting, the draft model's passes, scoring, deciding)
before it (`AutoProposer.trace` tells each decision; the script wraps only public methods).
The summary per request: decode tok/s beside the single strategies', tokens per
round trip, windows per strategy, the MTP heads' measured time per window, the draft model's
passes and time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import msgspec
import torch
import trio

from meshd.bench.harness import load_draft, resolve_quantization
from meshd.bench.spec import BENCH_LANES, encode_workload, generate
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative import auto
from meshd.speculative.auto_decision import Decision
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel

trace: list[dict[str, Any]] = []
decisions: list[str] = []
observe_s = [0.0]
draft_time = collections.Counter[str]()


def _patch() -> None:
    propose = auto.AutoProposer.propose
    observe = auto.AutoProposer.observe
    set_link = auto.AutoProposer.set_link
    reset = auto.AutoProposer.reset
    forward = DraftModel.rows

    def told(decision: Decision) -> None:
        times = " ".join(
            f"{name[:8]}={s * 1e3:.1f}/{width}" for name, (s, width) in decision.candidates.items()
        )
        decisions.append(f"@{decision.log_length} {decision.choice[:8]}: {times}")

    def traced_reset(self: auto.AutoProposer, prompt: Any) -> None:
        self.trace = told
        reset(self, prompt)

    def traced_propose(self: auto.AutoProposer, max_tokens: int, mtp_draft: Any = ()) -> Any:
        out = propose(self, max_tokens, mtp_draft)
        trace.append(
            {
                "choice": self.active,
                "heads": bool(mtp_draft),  # the coordinator hands the heads' draft while they run
                "drafts": len(out),
                "observe_ms": observe_s[0] * 1e3,
                "mtp_ms": self.link.mtp_s * 1e3,
            }
        )
        observe_s[0] = 0.0
        return out

    def traced_observe(self: auto.AutoProposer, committed: Any) -> None:
        t0 = time.perf_counter()
        observe(self, committed)
        observe_s[0] += time.perf_counter() - t0
        if trace:
            trace[-1].setdefault("committed", len(committed))

    def traced_link(self: auto.AutoProposer, link: Any) -> None:
        set_link(self, link)

    def traced_forward(
        self: DraftModel, session: str, base_pos: int, tokens: Any, last_n: int, vocab: Any = None
    ) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(self, session, base_pos, tokens, last_n, vocab)
        finally:
            draft_time["s"] += time.perf_counter() - t0  # type: ignore[assignment]
            draft_time["passes"] += 1

    auto.AutoProposer.propose = traced_propose  # type: ignore[method-assign]
    auto.AutoProposer.observe = traced_observe  # type: ignore[method-assign]
    auto.AutoProposer.set_link = traced_link  # type: ignore[method-assign]
    DraftModel.rows = traced_forward  # type: ignore[method-assign]
    auto.AutoProposer.reset = traced_reset  # type: ignore[method-assign]


async def _run(args: argparse.Namespace) -> None:
    model = args.model or str(builtin_model_dir())
    quantization = resolve_quantization("auto", model)
    tok = open_tokenizer(model)
    loads = workloads(args.prompts, tuple(args.kinds))
    eos = frozenset(tok.eos_ids)
    draft_path = args.speculative_draft_model or str(builtin_draft_dir())
    spec = msgspec.structs.replace(SpecConfig(), draft_model=draft_path)
    draft = load_draft(spec.draft_model, quantization)  # as `meshd bench spec`
    strategies = args.strategies
    # As `meshd bench spec` runs it: one stage computes on all the cores, as a daemon does;
    # several stand for several machines, one core each.
    cores = torch.get_num_threads()
    async with open_local_pipeline(
        model,
        args.stages,
        rtt_s=args.rtt_ms / 1000,
        torch_threads=cores if args.stages == 1 else 1,
        wire_dtype="f16",
        eos_ids=eos,
        quantization=quantization,
        draft=draft,
        lane_config=BENCH_LANES,
    ) as pipe:
        await generate(pipe, encode_workload(tok, loads[0]), 8, "disabled", 2, spec)
        ratios: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        for load in loads:
            ids = encode_workload(tok, load)
            for rnd in range(args.rounds):
                turn = rnd % len(strategies)
                results = {}
                for strategy in strategies[turn:] + strategies[:turn]:
                    trace.clear()
                    decisions.clear()
                    draft_time.clear()
                    results[strategy] = r = await generate(
                        pipe, ids, args.tokens, strategy, 2, spec
                    )
                    if strategy == "auto":
                        windows = list(trace)
                        decided = list(decisions)
                        passes, dsec = draft_time["passes"], draft_time["s"]
                    if strategy.startswith("draft"):
                        r["passes"] = draft_time["passes"]
                base = results["disabled"]["tok_s"]
                print(f"\n== {load.kind} {load.name} round {rnd}")
                for s, r in results.items():
                    ratios[(load.kind, s)].append(r["tok_s"] / base)
                    print(
                        f"  {s:13} {r['tok_s']:6.1f} tok/s {r['tok_s'] / base:5.2f}x "
                        f"tpr {r['tpr'] or 0:4.2f} stale {r['stale']}"
                        + (f" draft passes {r['passes']}" if "passes" in r else "")
                    )
                by = collections.Counter(w["choice"] for w in windows)
                heads = sum(1 for w in windows if w["heads"])
                obs = [w["observe_ms"] for w in windows]
                print(
                    f"  auto windows {len(windows)}: {dict(by)}; heads on in {heads}; "
                    f"mtp {statistics.median(w['mtp_ms'] for w in windows):.2f} ms/window; "
                    f"observe median {statistics.median(obs):.2f} ms, sum {sum(obs):.1f} ms; "
                    f"draft passes {passes} ({dsec * 1e3:.1f} ms)"
                )
                if args.verbose:
                    line = " ".join(
                        f"{w['choice'][:6]}{'+' if w['heads'] else ''}:{w['drafts']}/{w.get('committed', 1) - 1}"
                        for w in windows
                    )
                    print("   ", line)
                if args.decisions:
                    for line in decided:
                        print("     ", line)
        print("\nmedian ratio to disabled")
        for (kind, s), values in ratios.items():
            print(f"  {kind:10} {s:13} {statistics.median(values):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target checkpoint or GGUF file (default: built-in)")
    parser.add_argument(
        "--speculative-draft-model", help="draft checkpoint or GGUF file (default: built-in's)"
    )
    parser.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=["edit", "completion", "prose"])
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["disabled", "ngram-simple", "mtp-simple", "draft", "draft-ngram", "auto"],
    )
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--decisions",
        action="store_true",
        help="each decision: log length, choice, every candidate's ms/token and width",
    )
    args = parser.parse_args()
    _patch()
    trio.run(_run, args)


if __name__ == "__main__":
    main()
