"""The set search: which k nodes of a segment's pool serve it, in which order.

For each stage count k, from the fewest that fit upward:

1. Candidate sets. Every k-subset of the pool when there are at most `exhaustive_max_sets`
   (small meshes). Otherwise local search from seeds:
   - greedy constructions that add, step by step, the node (or the node with its fastest
     site-mates) whose cheapest insertion most lowers the cost, unplaced layers charged at
     a penalty rate; run over the whole pool (free start, from the node closest to the
     segment's ends, from the fastest large node) and over each remote site with the home
     site;
   - the best (k−1)-set plus its best addition; for the fewest stages, the k largest nodes.
   Each seed improves by swapping one member for one outsider (reinserted at its cheapest
   position) while that helps. Outsiders beaten on speed and capacity by a site-mate are
   skipped, and a lower bound on compute skips most exact splits.
2. Cheap score: (layers short, compute of the split for that order + its hop cost).
3. The best few sets are evaluated exactly: order by Held-Karp, taking into account the
   embedding/head memory of the first and last stages, and the split for that order.

A further stage is kept only if it cuts the segment's time by `extra_stage_min_gain_fraction`;
the search looks two stage counts past the last improvement, since a second co-located fast
node can pay for a hop that one alone does not.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from meshd.plan.cost_model import Candidate, HopCosts, compute_s, split_layers
from meshd.plan.inputs import PlannerConfig
from meshd.plan.order import exact_path, exact_paths, heuristic_path, path_cost
from meshd.plan.segment import Segment, SegmentPlan, SegmentResult, min_stages
from meshd.plan.sites import group_sites, pareto_outsiders, site_mates

# Stage counts tried past the last one that improved the plan.
_LOOKAHEAD = 2
# Sets per stage count given the exact evaluation after the cheap ranking.
_EXACT_FINALISTS = 3
# Unpinned seeds (best by cheap score) improved by local search per stage count.
_POLISHED_SEEDS = 2
# Site-mates a greedy step may add together with a node.
_BLOCK_MATES = 2
# Up to this many stages the cheap score orders stages exactly.
_CHEAP_EXACT_MAX = 4

Order = tuple[int, ...]
Score = tuple[int, float]


class SegmentSearch:
    """Searches node sets and orders for one segment over a fixed candidate pool."""

    def __init__(
        self,
        segment: Segment,
        pool: Sequence[Candidate],
        hops: HopCosts,
        config: PlannerConfig,
    ) -> None:
        self.segment = segment
        self.pool = list(pool)
        self.config = config
        self.h = hops.matrix([c.key for c in self.pool] + [segment.before, segment.after])
        self.start = len(self.pool)
        self.end = len(self.pool) + 1
        self.speeds = [c.s_per_layer for c in self.pool]
        self.mid_caps = [c.cap_mid for c in self.pool]
        self.only_caps = [c.cap(segment.model_first, segment.model_last) for c in self.pool]
        # Unplaced layers cost more than any node would charge, plus a round trip's worth.
        worst_hop = max((max(row) for row in self.h), default=0.0)
        self.penalty_s = 2.0 * max(self.speeds, default=0.0) + 2.0 * worst_hop
        self._cheap: dict[Order, Score] = {}
        self._polished: dict[Order, tuple[Score, Order]] = {}
        near = config.colocated_rtt_s / 2.0 + config.hop_cost_s
        self._site_list = group_sites(self.h, len(self.pool), near)
        self._mates = site_mates(self._site_list, self.speeds, self.mid_caps, _BLOCK_MATES)

    # -- cheap scores ------------------------------------------------------------------------

    def _compute(self, order: Order) -> Score:
        """(layers short, compute) with the ends' role caps; short layers cost `penalty_s`."""
        seg = self.segment
        layers = seg.layers
        if len(order) > layers:
            return 1, math.inf
        if len(order) == 1:
            caps = [self.only_caps[order[0]]]
        else:
            caps = [self.mid_caps[i] for i in order]
            if seg.model_first:
                caps[0] = self.pool[order[0]].cap_first
            if seg.model_last:
                caps[-1] = self.pool[order[-1]].cap_last
        speeds = [self.speeds[i] for i in order]
        counts = split_layers(layers, speeds, caps, self.config.speed_tie_fraction)
        if counts is not None:
            return 0, compute_s(counts, speeds)
        placed = sum(caps)
        return max(1, layers - placed), compute_s(caps, speeds) + (layers - placed) * self.penalty_s

    def cheap(self, members: Order) -> Score:
        """Score of a sorted member tuple with a near-exact order (exhaustive search)."""
        known = self._cheap.get(members)
        if known is None:
            net, order = self._reorder(members)
            known = self._cheap[members] = self._score(order, net)
        return known

    def _insert_at(self, order: Order, node: int) -> tuple[float, int]:
        """(added hop cost, position) inserting `node` where it adds the least hop cost."""
        h = self.h
        into = h[node]
        best_at, best_delta = 0, math.inf
        prev = self.start
        for at, nxt in enumerate((*order, self.end)):
            from_prev = h[prev]
            delta = from_prev[node] + into[nxt] - from_prev[nxt]
            if delta < best_delta:
                best_at, best_delta = at, delta
            prev = nxt
        return best_delta, best_at

    def _insert(self, order: Order, node: int) -> tuple[float, Order]:
        """(added hop cost, order) inserting `node` where it adds the least hop cost."""
        delta, at = self._insert_at(order, node)
        return delta, (*order[:at], node, *order[at:])

    def _score(self, order: Order, net: float) -> Score:
        short, comp = self._compute(order)
        return short, comp + net

    def _reorder(self, order: Order) -> tuple[float, Order]:
        if len(order) <= _CHEAP_EXACT_MAX:
            return exact_path(self.h, self.start, self.end, order)
        return heuristic_path(self.h, self.start, self.end, order, or_opt=False)

    # -- candidate sets ----------------------------------------------------------------------

    def _greedy(
        self, k_max: int, start: Order, allowed: Sequence[int] | None = None
    ) -> dict[int, Order]:
        """Orders grown from `start`: each step adds the move that lowers cost most.

        A move adds one node at its cheapest position, or a node with its one or two
        fastest site-mates (`_BLOCK_MATES`): the first node in a remote site pays the whole
        detour, so alone it may never look worth it while a group from that site is.
        """
        order = start
        out: dict[int, Order] = {len(order): order} if order else {}
        net = path_cost(self.h, self.start, self.end, order)
        nodes = range(len(self.pool)) if allowed is None else allowed
        usable = set(nodes)
        while len(order) < k_max:
            best: tuple[float, float, list[Order]] | None = None
            for node in nodes:
                if node in order:
                    continue
                steps: list[Order] = []
                trial, trial_net = order, net
                for extra in (node, *self._mates[node]):
                    if extra in trial or len(trial) >= k_max or extra not in usable:
                        continue
                    delta, trial = self._insert(trial, extra)
                    trial_net += delta
                    steps.append(trial)
                    _, cost = self._score(trial, trial_net)
                    if best is None or cost < best[0]:
                        best = (cost, trial_net, list(steps))
            if best is None:
                break
            net = best[1]
            # A block's partial orders seed the sizes it steps over.
            for step in best[2]:
                out[len(step)] = step
            order = best[2][-1]
        return out

    def _greedy_runs(self, k_max: int) -> tuple[list[dict[int, Order]], list[dict[int, Order]]]:
        """Greedy constructions: (over the whole pool with a free start, from the node closest
        to the segment's ends and from the fastest node holding a fair share; over each
        remote site together with the home site, the site closest to the ends)."""
        n = range(len(self.pool))
        ends = [self.h[self.start][i] + self.h[i][self.end] for i in n]
        closest = min(n, key=lambda i: (ends[i], -self.mid_caps[i], self.speeds[i]))
        share = self.segment.layers / max(1, k_max)
        big = [i for i in n if self.mid_caps[i] >= share] or list(n)
        fastest_big = min(big, key=lambda i: (self.speeds[i], -self.mid_caps[i]))
        whole = [self._greedy(k_max, ())]
        for first in (closest, fastest_big):
            if whole[0].get(1) != (first,):
                whole.append(self._greedy(k_max, (first,)))
        home = next(site for site in self._site_list if closest in site)
        by_site = [
            self._greedy(k_max, (), sorted({*home, *site}))
            for site in self._site_list
            if site is not home
        ]
        return whole, by_site

    def _fill_bound(self, ranked: Sequence[int], extra: int) -> float:
        """A lower bound on the compute of `ranked` (members by speed) plus `extra`: the
        fastest-first fill with middle-stage caps and no one-layer minimum; inf if short."""
        left = self.segment.layers
        total = 0.0
        extra_speed = self.speeds[extra]
        pending = True
        for i in ranked:
            if pending and extra_speed <= self.speeds[i]:
                take = min(left, self.mid_caps[extra])
                total += take * extra_speed
                left -= take
                pending = False
            take = min(left, self.mid_caps[i])
            total += take * self.speeds[i]
            left -= take
            if left == 0:
                return total
        if pending:
            take = min(left, self.mid_caps[extra])
            total += take * extra_speed
            left -= take
        return total if left == 0 else math.inf

    def _improve(self, order: Order) -> tuple[Score, Order]:
        """Swap one member for one outsider (at its cheapest position) while that helps.

        Best improvement per round. Every set passed through is remembered with the local
        optimum it led to, so seeds that meet an earlier search stop there.
        """
        h = self.h
        net = path_cost(h, self.start, self.end, order)
        score = self._score(order, net)
        visited: list[Order] = []
        for _ in range(self.config.search_max_rounds):
            members = tuple(sorted(order))
            known = self._polished.get(members)
            if known is not None:
                score, order = known
                break
            visited.append(members)
            best: tuple[Score, float, Order] | None = None
            inside = set(order)
            outsiders = pareto_outsiders(self._site_list, inside, self.speeds, self.mid_caps)
            for pos, node in enumerate(order):
                before = self.start if pos == 0 else order[pos - 1]
                after = self.end if pos == len(order) - 1 else order[pos + 1]
                reduced = order[:pos] + order[pos + 1 :]
                reduced_net = net - h[before][node] - h[node][after] + h[before][after]
                ranked = sorted(reduced, key=self.speeds.__getitem__)
                for out in outsiders:
                    target = score if best is None else best[0]
                    delta, at = self._insert_at(reduced, out)
                    trial_net = reduced_net + delta
                    # The plain fastest-first fill bounds the split from below: skip the
                    # exact split when even that cannot beat the best so far.
                    if target[0] == 0 and trial_net + self._fill_bound(ranked, out) >= target[1]:
                        continue
                    trial = (*reduced[:at], out, *reduced[at:])
                    trial_score = self._score(trial, trial_net)
                    if trial_score < target:
                        best = (trial_score, trial_net, trial)
            if best is None:
                break
            net, order = self._reorder(best[2])
            score = self._score(order, net)
        for members in visited:
            self._polished[members] = (score, order)
        return score, order

    def sets_for(self, k: int, pinned: Sequence[Order], seeds: Sequence[Order]) -> list[Order]:
        """The best few k-sets (sorted member tuples) by the cheap score.

        Every `pinned` seed is improved, and the best `_POLISHED_SEEDS` of the others.
        """
        n = len(self.pool)
        if k > n:
            return []
        if math.comb(n, k) <= self.config.exhaustive_max_sets:
            return sorted(itertools.combinations(range(n), k), key=self.cheap)[:_EXACT_FINALISTS]
        scored: dict[Order, tuple[Score, Order]] = {}
        for seed in (*pinned, *seeds):
            members = tuple(sorted(seed))
            if len(seed) == k and members not in scored:
                net, order = self._reorder(seed)
                scored[members] = (self._score(order, net), order)
        pinned_sets = {tuple(sorted(seed)) for seed in pinned}
        ranked = sorted(scored, key=lambda members: (members not in pinned_sets, scored[members]))
        found: dict[Order, Score] = {}
        for members in ranked[: len(pinned_sets) + _POLISHED_SEEDS]:
            score, order = self._improve(scored[members][1])
            found.setdefault(tuple(sorted(order)), score)
        return sorted(found, key=lambda members: found[members])[:_EXACT_FINALISTS]

    def _seeds(
        self,
        k: int,
        greedy: tuple[list[dict[int, Order]], list[dict[int, Order]]],
        previous: Order | None,
        first: bool,
    ) -> tuple[list[Order], list[Order]]:
        """(pinned, other) seeds: the best (k−1)-set plus one node and the whole-pool greedy
        runs are always improved; per-site runs and the k largest nodes compete for the
        remaining slots."""
        whole, by_site = greedy
        pinned = [run[k] for run in whole if k in run]
        if previous is not None:
            net = path_cost(self.h, self.start, self.end, previous)
            options = [
                self._insert(previous, n) for n in range(len(self.pool)) if n not in previous
            ]
            if options:
                pinned.append(min((self._score(o, net + d), o) for d, o in options)[1])
        seeds = [run[k] for run in by_site if k in run]
        if first:
            largest = sorted(
                range(len(self.pool)), key=lambda i: (-self.mid_caps[i], self.speeds[i])
            )
            seeds.append(tuple(largest[:k]))
        return pinned, seeds

    # -- exact evaluation of one set ---------------------------------------------------------

    def _split_for(
        self, members: Sequence[int], first: int, last: int
    ) -> tuple[float, dict[int, int]] | None:
        seg = self.segment
        caps = [
            self.pool[i].cap(seg.model_first and i == first, seg.model_last and i == last)
            for i in members
        ]
        speeds = [self.speeds[i] for i in members]
        counts = split_layers(seg.layers, speeds, caps, self.config.speed_tie_fraction)
        if counts is None:
            return None
        return compute_s(counts, speeds), dict(zip(members, counts, strict=True))

    def _plan(
        self, order: Sequence[int], counts_by_member: dict[int, int], net: float
    ) -> SegmentPlan:
        counts = tuple(counts_by_member[i] for i in order)
        speeds = [self.speeds[i] for i in order]
        nodes = tuple(self.pool[i] for i in order)
        return SegmentPlan(nodes, counts, compute_s(counts, speeds), net)

    def exact(self, members: Order) -> SegmentPlan | None:
        """The best order and split for this set, or None when it cannot hold the segment."""
        if len(members) > self.config.exact_order_max_stages:
            return self._heuristic_exact(members)
        splits: dict[tuple[int, int], tuple[float, dict[int, int]] | None] = {}

        def split(first: int, last: int) -> tuple[float, dict[int, int]] | None:
            if (first, last) not in splits:
                splits[(first, last)] = self._split_for(members, first, last)
            return splits[(first, last)]

        by_last = exact_paths(self.h, self.start, self.end, members)
        best: tuple[float, Order, float, dict[int, int]] | None = None
        for net, order in by_last.values():
            got = split(order[0], order[-1])
            if got is not None and (best is None or net + got[0] < best[0]):
                best = (net + got[0], order, net, got[1])
        net_floor = min(cost for cost, _ in by_last.values())
        # Another (first, last) pair can win only if its split beats `best` even on the
        # cheapest path; those pairs get a first-fixed Held-Karp.
        pairs = [(f, last) for f in members for last in members if f != last or len(members) == 1]
        ranked = sorted(
            (got[0], f, last) for f, last in pairs if (got := split(f, last)) is not None
        )
        fixed: dict[int, dict[int, tuple[float, Order]]] = {}
        for comp, f, last in ranked:
            if best is not None and comp + net_floor >= best[0]:
                break
            if f not in fixed:
                fixed[f] = exact_paths(self.h, self.start, self.end, members, first=f)
            got = split(f, last)
            if last in fixed[f] and got is not None:
                net, order = fixed[f][last]
                if best is None or net + comp < best[0]:
                    best = (net + comp, order, net, got[1])
        return None if best is None else self._plan(best[1], best[3], best[2])

    def _heuristic_exact(self, members: Order) -> SegmentPlan | None:
        _, order = heuristic_path(self.h, self.start, self.end, members)
        best: SegmentPlan | None = None
        for candidate in (order, order[::-1]):
            got = self._split_for(members, candidate[0], candidate[-1])
            if got is None:
                continue
            net = path_cost(self.h, self.start, self.end, candidate)
            plan = self._plan(candidate, got[1], net)
            if best is None or plan.total_s < best.total_s:
                best = plan
        return best

    # -- the search --------------------------------------------------------------------------

    def run(self) -> SegmentResult:
        """Best plan per stage count from the fewest that fit; the chosen one by the gain rule."""
        seg, config = self.segment, self.config
        limit = min(config.max_stages, len(self.pool), seg.layers)
        caps_desc = sorted(self.mid_caps, reverse=True)
        single_fits = any(cap >= seg.layers for cap in self.only_caps)
        k_min = 1 if single_fits else max(2, min_stages(seg.layers, caps_desc, limit))
        result = SegmentResult(best=None, min_stages=k_min)
        if k_min > limit:
            return result
        greedy = self._greedy_runs(min(limit, k_min + 2 * _LOOKAHEAD + 2))
        previous: Order | None = None
        since_improved = 0
        for k in range(k_min, limit + 1):
            pinned, seeds = self._seeds(k, greedy, previous, first=k == k_min)
            finalists = self.sets_for(k, pinned, seeds)
            plans = [p for s in finalists if (p := self.exact(s)) is not None]
            best_k = min(plans, key=lambda p: p.total_s, default=None)
            result.by_stages[k] = best_k
            if best_k is not None:
                index = {c.key: i for i, c in enumerate(self.pool)}
                previous = tuple(index[c.key] for c in best_k.nodes)
            if result.best is None:
                result.best = best_k
                continue
            gain = config.extra_stage_min_gain_fraction
            if best_k is not None and best_k.total_s < result.best.total_s * (1.0 - gain):
                result.best, since_improved = best_k, 0
                continue
            since_improved += 1
            if since_improved >= _LOOKAHEAD:
                break
        return result
