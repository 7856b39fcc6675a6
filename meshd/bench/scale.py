"""`meshd bench scale`: membership, failure detection and planning at 10, 100 and 1000 nodes.

Runs the real sans-IO code on a virtual clock over a seeded geography (LAN, metro and
continental round trips, 1 % loss): `meshd.sim.membership_scale` for membership and failure
detection, `meshd.sim.plan_scale` for the planner. Simulated seconds are cheap at 10 and 100
nodes; at 1000 a mass join costs a few CPU-minutes, so `--quick` stops at 100 nodes for
membership (the planner still runs at every size). docs/scale.md has the results.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

from meshd.mesh.membership_config import MembershipConfig
from meshd.sim.membership_scale import MembershipScale, run_membership
from meshd.sim.plan_scale import PlanScale, run_planner

GOALS = "goals at 1000 nodes: death known everywhere < 5 s, no false death at 1 % loss, "
GOALS += "gossip < 10 kB/s per node, a plan < 100 ms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench scale`."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="finish in under a minute")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="mesh sizes")
    parser.add_argument("--membership-max-n", type=int, default=None, help="skip bigger sims")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settle-s", type=float, default=None, help="simulated, after join")
    parser.add_argument(
        "--window-s",
        type=float,
        default=None,
        help="simulated, for bytes (at least a record cycle)",
    )
    parser.add_argument("--kills", type=int, default=None, help="crashes timed per size")
    parser.add_argument("--coordinators", type=int, default=None, help="plans per model")
    parser.add_argument("--random-plans", type=int, default=None, help="per plan, for quality")


def run(args: argparse.Namespace) -> int:
    """Run the study and print a table or JSON."""
    sizes = args.sizes or [10, 100, 1000]
    max_n = args.membership_max_n or (100 if args.quick else max(sizes))
    settle_s = args.settle_s if args.settle_s is not None else 10.0
    window_s = args.window_s or (20.0 if args.quick else 30.0)
    kills = args.kills or (2 if args.quick else 3)
    coordinators = args.coordinators or (3 if args.quick else 5)
    samples = args.random_plans or (300 if args.quick else 2000)
    started = time.perf_counter()
    members: list[MembershipScale] = []
    plans: list[PlanScale] = []
    for n in sizes:
        plans += run_planner(n, seed=args.seed, coordinators=coordinators, random_samples=samples)
        if not args.json:
            _print_plans(n, [p for p in plans if p.n == n])
        if n <= max_n:
            # A byte count means little unless every node re-signed its record in the window
            # (once per capacity interval × 1-1.5): stretch it to a whole cycle.
            window = max(window_s, 1.5 * MembershipConfig().capacity_interval_s(n))
            members.append(
                run_membership(n, seed=args.seed, settle_s=settle_s, window_s=window, kills=kills)
            )
            if not args.json:
                _print_membership(members[-1])
    result = _summary(members, plans, time.perf_counter() - started)
    if args.json:
        print(json.dumps(result, default=_finite))
    else:
        print(f"\n{GOALS}; whole run {result['wall_s']:.0f} s wall")
    return 0


def _finite(value: Any) -> Any:
    raise TypeError(f"not JSON: {value!r}")


def _clean(value: Any) -> Any:
    """inf and nan as null, so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _summary(
    members: list[MembershipScale], plans: list[PlanScale], wall_s: float
) -> dict[str, Any]:
    plan_rows = []
    for p in plans:
        row = asdict(p)
        row["vs_lower_bound"] = p.vs_lower_bound
        row["vs_best_random"] = p.vs_best_random
        plan_rows.append(row)
    out = {"membership": [asdict(m) for m in members], "plans": plan_rows, "wall_s": wall_s}
    return dict(_clean(out))


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value * 1e3:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print_plans(n: int, rows: list[PlanScale]) -> None:
    print(f"\nplanner, n = {n}")
    print("  model              stages  cpu ms  wall ms  ms/token  vs bound  vs best random")
    for p in rows:
        print(
            f"  {p.model_id:18s} {p.stages or '-':>6}  {_ms(p.cpu_s):>6}  {_ms(p.wall_s):>7}  "
            f"{_ms(p.predicted_s):>8}  {_ratio(p.vs_lower_bound):>8}  "
            f"{_ratio(p.vs_best_random):>8} ({p.random_feasible}/{p.random_samples} fit)"
        )
    cpu = [p.cpu_s for p in rows]
    print(f"  CPU per plan: median {_ms(statistics.median(cpu))} ms, max {_ms(max(cpu))} ms")
    sys.stdout.flush()


def _print_membership(m: MembershipScale) -> None:
    deaths = ", ".join(f"{d:.2f}" if math.isfinite(d) else "never" for d in m.death_known_s)
    print(
        f"membership, n = {m.n} (seed {m.seed}): mass join converged in {m.mass_join_s:.1f} s; "
        f"a late join seen by all in {m.join_converge_s:.2f} s; crashes known dead everywhere "
        f"in {deaths} s; gossip {m.bytes_per_node_s / 1e3:.2f} kB/s per node (busiest "
        f"{m.max_bytes_per_node_s / 1e3:.2f}) with load churn over {m.window_s:.0f} s; "
        f"{m.false_suspicions} false suspicions and {m.false_deaths} false deaths in "
        f"{m.observed_s:.0f} s at 1 % loss; {m.simulated_s:.0f} s simulated in "
        f"{m.cpu_s:.0f} s CPU",
        flush=True,
    )
