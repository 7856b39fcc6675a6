"""Membership measurements on the simulator (`meshd.sim.simnet`), for tests and docs: the
gossip load per node and the join and crash-detection times that docs/membership.md quotes
(`python -m meshd.sim.gossip_load`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshd.mesh.membership import LocalCapacity
from meshd.sim.simnet import Sim, SimLink, SimNode, signer, verify_ed25519
from protocol.gossip import Status

__all__ = [
    "GossipLoad",
    "Sim",
    "SimLink",
    "SimNode",
    "join_and_crash_times",
    "measure_gossip_load",
    "signer",
    "verify_ed25519",
]


@dataclass(frozen=True)
class GossipLoad:
    """Bytes and messages each node sent per second, averaged over nodes and a window."""

    n: int
    window_s: float
    join_s: float  # from the last node's join until everyone saw everyone alive
    bytes_per_node_s: float
    messages_per_node_s: float
    records_published: int


def measure_gossip_load(
    n: int,
    *,
    window_s: float,
    churn: bool,
    loss: float = 0.01,
    seed: int = 17,
    settle_s: float = 0.0,
) -> GossipLoad:
    """Join n nodes, let them run settle_s, then count what they send over window_s.

    With `churn`, every node's load figure changes every second (the worst case for capacity
    gossip: each node re-signs its record as often as the rate limit allows).
    """
    sim = Sim(n, seed=seed, link=SimLink(loss=loss))
    sim.start_all(stagger_s=0.01)
    join_s = sim.wait_for(sim.converged, timeout_s=max(30.0, 0.5 * n), step_s=0.5)
    if join_s == math.inf:
        raise AssertionError(f"{n} nodes did not converge")
    sim.run_for(settle_s)
    sim.reset_counters()
    published = sum(node.m.stats.records_published for node in sim.nodes)

    def load_changes() -> None:
        for node in sim.up_nodes():
            node.m.set_capacity(LocalCapacity(sessions=sim.rng.randrange(8)), sim.now)
        sim.at(sim.now + 1.0, load_changes)

    if churn:
        load_changes()
    sim.run_for(window_s)
    if not sim.converged():
        raise AssertionError("membership diverged during the window")
    return GossipLoad(
        n=n,
        window_s=window_s,
        join_s=join_s,
        bytes_per_node_s=sum(node.bytes_sent for node in sim.nodes) / n / window_s,
        messages_per_node_s=sum(node.messages_sent for node in sim.nodes) / n / window_s,
        records_published=sum(node.m.stats.records_published for node in sim.nodes) - published,
    )


def join_and_crash_times(n: int, seed: int, *, lanes: bool) -> tuple[float, float]:
    """(seconds to converge after the last join, seconds until a crash is known everywhere).

    1 % loss. With lanes, the crash comes after 12 s of running, when probes have opened lanes
    between the members; without, after 5 s.
    """
    sim = Sim(n, seed=seed, link=SimLink(loss=0.01), lanes=lanes)
    sim.start_all()
    joined = sim.wait_for(sim.converged, timeout_s=30.0)
    sim.run_for(12.0 if lanes else 5.0)
    sim.kill(n // 2)
    dead = sim.wait_for(lambda: sim.all_see(n // 2, (Status.DEAD,)), 30.0, step_s=0.01)
    return joined, dead


def print_bounds(sizes: list[int], seeds: int) -> None:
    """Min, median and max of join and crash-detection times over `seeds` seeds."""
    for n in sizes:
        for lanes in (True, False):
            runs = sorted(join_and_crash_times(n, s, lanes=lanes) for s in range(seeds))
            joins = sorted(r[0] for r in runs)
            deaths = sorted(r[1] for r in runs)
            mid = len(runs) // 2
            print(
                f"N={n:4d} {'lanes   ' if lanes else 'no lanes'}: join {joins[0]:.2f}/"
                f"{joins[mid]:.2f}/{joins[-1]:.2f} s, crash known everywhere "
                f"{deaths[0]:.2f}/{deaths[mid]:.2f}/{deaths[-1]:.2f} s (min/median/max, "
                f"{seeds} seeds)",
                flush=True,
            )


def main() -> None:
    """`python -m meshd.sim.gossip_load N [N ...]`: print the gossip load (or, with --bounds, the
    join and crash-detection times) for each mesh size."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("sizes", type=int, nargs="+")
    parser.add_argument("--window-s", type=float, default=0.0, help="default: max(60, 0.75 n)")
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--settle-s", type=float, default=0.0, help="run this long first")
    parser.add_argument("--churn-only", action="store_true", help="skip the quiet run")
    parser.add_argument(
        "--bounds", type=int, default=0, metavar="SEEDS", help="time joins and crashes instead"
    )
    args = parser.parse_args()
    if args.bounds:
        print_bounds(args.sizes, args.bounds)
        return
    for n in args.sizes:
        for churn in (True,) if args.churn_only else (False, True):
            started = time.perf_counter()
            window_s = args.window_s or max(60.0, 0.75 * n)  # ≥ 2 capacity intervals
            load = measure_gossip_load(
                n, window_s=window_s, churn=churn, loss=args.loss, settle_s=args.settle_s
            )
            print(
                f"N={n:5d} settled {args.settle_s:.0f} s, "
                f"{'load churn' if churn else 'quiet     '}: "
                f"{load.bytes_per_node_s:7.0f} B/s, {load.messages_per_node_s:5.1f} msg/s per node, "
                f"{load.records_published} records signed in {load.window_s:.0f} s; "
                f"joined in {load.join_s:.1f} s "
                f"(simulated in {time.perf_counter() - started:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
