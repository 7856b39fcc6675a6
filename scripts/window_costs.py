"""Stage compute per verify-window size, as the coordinator measures it.

    python scripts/window_costs.py                 # 2 stages of the built-in model, RTT 0
    python scripts/window_costs.py --stages 1 --dir /path/to/checkpoint

Runs each `meshd bench spec` prompt once per strategy (disabled, ngram-simple, mtp-simple,
mtp: together they send windows of every size) over a local pipeline and records, for every
reply, the stages' compute (MTP heads excluded, as `RouteCosts` keeps them apart) by the
number of tokens the window carried. Prints median and 10th/90th percentiles per size, and
the MTP heads' time. This is the evidence for pricing plain decoding at the measured
one-token pass (docs/speculative.md, "Where the costs come from").
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import trio

from meshd.bench.spec import generate
from meshd.coord import route_costs as costs
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.sim.workloads import workloads
from meshd.speculative.config import SpecConfig

STRATEGIES = ("disabled", "ngram-simple", "mtp-simple", "mtp")


async def _measure(model_dir: str, stages: int, tokens: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = defaultdict(list)
    observe = costs.RouteCosts.observe

    def recording(
        self: costs.RouteCosts,
        size: int,
        round_trip_s: float,
        compute_s: float,
        queue_s: float,
        mtp_s: float = 0.0,
    ) -> None:
        samples[f"{size} tokens"].append((compute_s - mtp_s) * 1e3)
        if mtp_s > 0:
            samples["MTP heads"].append(mtp_s * 1e3)
        observe(self, size, round_trip_s, compute_s, queue_s, mtp_s)

    costs.RouteCosts.observe = recording  # type: ignore[method-assign,assignment]
    tok = open_tokenizer(model_dir)
    eos = frozenset(tok.eos_ids)
    async with open_local_pipeline(
        model_dir, stages, rtt_s=0.0, wire_dtype="f16", eos_ids=eos
    ) as pipe:
        for load in workloads(2):
            ids = tok.encode(load.prompt)
            for strategy in STRATEGIES:
                await generate(pipe, ids, tokens, strategy, 2, SpecConfig())
    costs.RouteCosts.observe = observe  # type: ignore[method-assign]
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(builtin_model_dir()), help="HF checkpoint dir")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request")
    args = parser.parse_args()
    samples = trio.run(_measure, args.dir, args.stages, args.tokens)
    print(f"{args.stages} stage(s), compute summed over the stages (ms), MTP heads apart\n")
    print("| window | windows | median | p10 | p90 |")
    print("| --- | --- | --- | --- | --- |")

    def order(key: str) -> tuple[int, int]:
        head = key.split()[0]
        return (0, int(head)) if head.isdigit() else (1, 0)

    for key in sorted(samples, key=order):
        values = sorted(samples[key])
        p10, p90 = values[len(values) // 10], values[len(values) * 9 // 10]
        print(
            f"| {key} | {len(values)} | {statistics.median(values):.2f} | {p10:.2f} | {p90:.2f} |"
        )


if __name__ == "__main__":
    main()
