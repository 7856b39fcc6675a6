"""A strategy at fixed window widths and depths, measured and as the window policy predicts.

    python scripts/spec_widths.py                          # draft-ngram, completion + prose
    python scripts/spec_widths.py --combos 8x1 5x1 3x2 --kinds prose --rounds 3

Runs `meshd bench spec`'s prompts on a local pipeline of the built-in model with its shipped
draft (greedy, 96 tokens) with `window_min_tokens = window_max_tokens = K` and
`max_pipeline_depth = D` for each `KxD`, the combos alternating order by round, and prints the
median decode tok/s of each. Beside it: what `policy.search` predicts for that width at depths
up to D, from the route's measured costs and the per-position acceptance the widest depth-1
combo measured (every one of its positions is tried in every window that reaches it), so
the cost model can be checked apart from the acceptance estimates the adaptive policy learns.
"""

from __future__ import annotations

import argparse
import statistics

import msgspec
import trio

from meshd.bench.spec import BENCH_LANES, generate
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_draft_dir, builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative import proposer
from meshd.speculative.config import SpecConfig
from meshd.speculative.draft import DraftModel
from meshd.speculative.policy import PolicyInputs, search

verdicts: list[tuple[int, int]] = []


def _patch() -> None:
    record = proposer.AccountedProposer.record

    def traced(self: proposer.AccountedProposer, drafted: int, accepted: int) -> None:
        verdicts.append((drafted, accepted))
        record(self, drafted, accepted)

    proposer.AccountedProposer.record = traced  # type: ignore[method-assign]


def _alphas(windows: list[tuple[int, int]], positions: int) -> tuple[float, ...]:
    """α_j: of the windows whose drafts 1..j−1 were all accepted and that drafted a j-th,
    the share that had the j-th accepted too."""
    out = []
    for j in range(positions):
        reached = [a for drafted, a in windows if drafted > j and a >= j]
        out.append(sum(1 for a in reached if a > j) / len(reached) if reached else 0.5)
    return tuple(out)


async def _run(args: argparse.Namespace) -> None:
    model = str(builtin_model_dir())
    tok = open_tokenizer(model)
    base = msgspec.structs.replace(SpecConfig(), draft_model=str(builtin_draft_dir()))
    draft = DraftModel.load(base.draft_model)
    combos = [tuple(int(x) for x in c.split("x")) for c in args.combos]
    widest = max((c for c in combos if c[1] == 1), default=None)
    if widest is None:
        raise SystemExit("--combos needs a depth-1 combo to measure acceptance with")
    async with open_local_pipeline(
        model,
        args.stages,
        rtt_s=args.rtt_ms / 1000,
        wire_dtype="f16",
        eos_ids=frozenset(tok.eos_ids),
        draft=draft,
        lane_config=BENCH_LANES,
    ) as pipe:
        loads = [w for w in workloads(2) if w.kind in args.kinds]
        await generate(pipe, tok.encode(loads[0].prompt), 8, "disabled", 2, base)
        for load in loads:
            ids = tok.encode(load.prompt)
            speeds: dict[tuple[int, ...], list[float]] = {}
            costs: list[float] = []
            measured: list[tuple[int, int]] = []
            for rnd in range(args.rounds):
                for k, d in combos if rnd % 2 == 0 else combos[::-1]:
                    spec = msgspec.structs.replace(
                        base, window_min_tokens=k, window_max_tokens=k, max_pipeline_depth=d
                    )
                    verdicts.clear()
                    r = await generate(pipe, ids, args.tokens, args.strategy, 2, spec)
                    speeds.setdefault((k, d), []).append(r["tok_s"])
                    if r["draft_s_per_token"]:
                        costs.append(r["draft_s_per_token"])
                    if (k, d) == widest:
                        measured += verdicts
            alphas = _alphas(measured, widest[0])
            link = pipe.coordinator.costs(pipe.route).link_model()
            if costs:
                link = link.with_draft_cost(statistics.median(costs))
            print(
                f"{load.kind} {load.name}: α {' '.join(f'{a:.2f}' for a in alphas)}; "
                f"rtt {link.rtt_s * 1e3:.1f} ms, pass {link.pass_fixed_s * 1e3:.1f} + "
                f"{link.pass_per_token_s * 1e3:.2f}/token ms, draft "
                f"{link.draft_per_token_s * 1e3:.2f} ms/token"
            )
            for (k, d), values in speeds.items():
                spec = msgspec.structs.replace(
                    base, window_min_tokens=k, window_max_tokens=k, max_pipeline_depth=d
                )
                found = search(PolicyInputs(link, alphas), spec)
                print(
                    f"   {k}x{d}: measured {statistics.median(values):6.1f} tok/s, "
                    f"predicted {1 / found.best[0]:6.1f} (depth {found.best[2]})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="draft-ngram")
    parser.add_argument("--combos", nargs="+", default=["8x1", "5x1", "3x2", "5x2", "3x1"])
    parser.add_argument("--kinds", nargs="+", default=["completion", "prose"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rtt-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    _patch()
    trio.run(_run, args)


if __name__ == "__main__":
    main()
