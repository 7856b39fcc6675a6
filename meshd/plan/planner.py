"""The topology planner: which nodes serve which layers, in which order, and how fast.

`plan()` is pure: model shape, node capacities and the pairwise RTT matrix in, a `Plan` out
(or `NoFeasiblePlan` saying why). The cost model is in cost_model.py, the set search in
search.py, the stage order in order.py; docs/planner.md has the whole picture.

Re-planning after a failure passes `exclude` (dead nodes) and `prefer` (the current route,
or node → layer range each node holds now). Surviving preferred stages and nodes with a fixed
range become *anchors* that keep their layers; the gaps between them are searched like a
small plan of their own. That anchored plan competes with a full re-plan, and the one that
reloads fewer layers wins while it is at most `reuse_tolerance_fraction` slower (always, when
that is infinite: the daemon's sticky plans, where only lost stages move) and has no more
stages than the full re-plan (`_choose`). Stages move only for a gain the measurements show:
when the plan that keeps more in place is judged, its hops between pairs not measured yet
cost only the protocol (a node that just joined or just took a stage has no round trips yet,
and the pessimistic guess for them would otherwise move every stage to keep it at the edge,
then back once they arrive).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from meshd.plan.cost_model import Candidate, HopCosts, make_candidate, stage_bytes
from meshd.plan.inputs import ModelShape, NodeCapacity, NoFeasiblePlan, PlannerConfig
from meshd.plan.result import Alternative, Census, Hop, Plan, PlannedStage
from meshd.plan.route import Route
from meshd.plan.search import SegmentSearch
from meshd.plan.segment import Segment, SegmentResult, min_stages, select_pool
from meshd.plan.units import format_bytes, format_delta_ms, format_ms, short_key

Prefer = Route | Mapping[bytes, tuple[int, int]]
Stages = tuple[tuple[Candidate, int, int], ...]

_FULL = "full plan"


@dataclass(frozen=True, slots=True)
class _Inputs:
    model: ModelShape
    coordinator: bytes
    context_tokens: int
    config: PlannerConfig
    hops: HopCosts
    held: Mapping[bytes, tuple[int, int]]


@dataclass(frozen=True, slots=True)
class _Option:
    label: str
    stages: Stages
    kept: int
    predicted_s: float
    reload_layers: int
    # predicted_s with every unmeasured hop at its protocol cost alone (its best case).
    measured_s: float
    # predicted_s with every hop at its protocol cost alone: compute and hop count.
    round_trip_free_s: float


def plan(
    model: ModelShape,
    nodes: Iterable[NodeCapacity],
    rtt_s: Mapping[tuple[bytes, bytes], float],
    coordinator: bytes,
    *,
    context_tokens: int,
    exclude: Collection[bytes] = frozenset(),
    prefer: Prefer | None = None,
    config: PlannerConfig | None = None,
) -> Plan:
    """Plan a route for `model` from the coordinator over healthy `nodes`.

    `rtt_s[(a, b)]` is the measured round trip between two nodes (either order; unknown pairs
    cost `config.unknown_rtt_s`). `context_tokens` sizes the KV cache. `exclude` removes
    nodes (dead ones when re-planning); `prefer` is the current route (or node → layer range
    held) whose surviving stages should keep their layers. Raises `NoFeasiblePlan`.
    """
    if context_tokens < 0:
        raise ValueError("context_tokens must be >= 0")
    config = config or PlannerConfig()
    offered = list({n.key: n for n in nodes}.values())
    held = _held_ranges(model, prefer, offered)
    inputs = _Inputs(model, coordinator, context_tokens, config, HopCosts(rtt_s, config), held)
    census, free, fixed = _classify(offered, inputs, exclude)

    options: list[_Option] = []
    free_result: SegmentResult | None = None
    full: _Option | None = None
    if free:
        whole = Segment(0, model.num_layers, coordinator, coordinator, True, True)
        free_result = _search(inputs, whole, free)
        if free_result.best is not None:
            best = free_result.best
            full = _option(inputs, _FULL, _stages_from(best.nodes, best.counts, 0), 0)
            options.append(full)
    survivors = [c for c in free if prefer is not None and c.key in held]
    for label, anchors in _anchor_chains(inputs, survivors, fixed):
        option = _anchored(inputs, label, anchors, [c for c in free if c.key not in anchors])
        if option is not None:
            options.append(option)
    if not options:
        raise _infeasible(inputs, census, free, fixed)
    chosen = _choose(options, full, config)
    return _build(inputs, chosen, census, free, fixed, free_result, options)


def _choose(options: Sequence[_Option], full: _Option | None, config: PlannerConfig) -> _Option:
    """The option loading the fewest layers among those eligible, then the fastest.

    Eligible: at most `reuse_tolerance_fraction` slower than the best (any, when infinite),
    and no more stages than the full plan unless faster than it on compute and protocol cost
    alone. Kept stages save their loads once; a stage more than the full plan needs costs a
    hop on every token for as long as the plan lasts. Such a stage fills a gap between kept
    stages of different plans (made at start-up on partial member lists, each loaded by some
    node), or a lost range that the spares fill only in pieces. Stage counts and compute
    figures are not noisy, round trips are: this rule never moves a stage on a round trip, and
    it only ever moves a plan to fewer stages, so it cannot flap.
    """
    best_t = min(o.predicted_s for o in options)
    tolerance = config.reuse_tolerance_fraction
    eligible = [
        o
        for o in options
        if (math.isinf(tolerance) or o.measured_s <= best_t * (1.0 + tolerance))
        and not _extra_stages(o, full)
    ]
    return min(eligible or [o for o in options if o is full], key=_cost_to_move)


def _extra_stages(option: _Option, full: _Option | None) -> bool:
    """Whether `option` has more stages than the full plan and is no faster for them."""
    if full is None or len(option.stages) <= len(full.stages):
        return False
    return option.round_trip_free_s >= full.round_trip_free_s


def _cost_to_move(option: _Option) -> tuple[int, float]:
    return option.reload_layers, option.predicted_s


def _held_ranges(
    model: ModelShape, prefer: Prefer | None, offered: Sequence[NodeCapacity]
) -> dict[bytes, tuple[int, int]]:
    """What each node holds now: the preferred route's ranges, then fixed ranges."""
    held: dict[bytes, tuple[int, int]] = {}
    if isinstance(prefer, Route):
        if prefer.model_id == model.model_id:
            held.update({s.node_key: (s.layer_start, s.layer_end) for s in prefer.stages})
    elif prefer is not None:
        held.update(prefer)
    held = {k: r for k, r in held.items() if 0 <= r[0] < r[1] <= model.num_layers}
    for node in offered:
        if node.fixed_layers is not None:
            held[node.key] = node.fixed_layers
    return held


def _classify(
    offered: Sequence[NodeCapacity], inputs: _Inputs, exclude: Collection[bytes]
) -> tuple[Census, list[Candidate], list[Candidate]]:
    """Split nodes into free candidates, fixed-range candidates and the rest (counted)."""
    counts = {"unhealthy": 0, "excluded": 0, "without_model": 0, "too_small": 0}
    free: list[Candidate] = []
    fixed: list[Candidate] = []
    for node in offered:
        if node.key in exclude:
            counts["excluded"] += 1
        elif not node.healthy:
            counts["unhealthy"] += 1
        elif not node.holds_model:
            counts["without_model"] += 1
        else:
            c = make_candidate(node, inputs.model, inputs.context_tokens, inputs.config)
            if c.fixed_layers is not None:
                start, end = c.fixed_layers
                if end <= inputs.model.num_layers and _fits(inputs, c, start, end):
                    fixed.append(c)
                else:
                    counts["too_small"] += 1
            elif c.cap_mid >= 1:
                free.append(c)
            else:
                counts["too_small"] += 1
    census = Census(
        offered=len(offered),
        fixed_range=len(fixed),
        usable=len(free) + len(fixed),
        **counts,
    )
    return census, free, fixed


def _fits(inputs: _Inputs, c: Candidate, start: int, end: int) -> bool:
    return stage_bytes(inputs.model, inputs.context_tokens, start, end) <= c.usable_bytes


def _search(inputs: _Inputs, segment: Segment, candidates: Sequence[Candidate]) -> SegmentResult:
    pool = select_pool(segment, candidates, inputs.hops, inputs.config)
    return SegmentSearch(segment, pool, inputs.hops, inputs.config).run()


def _stages_from(nodes: Sequence[Candidate], counts: Sequence[int], start: int) -> Stages:
    out = []
    for node, count in zip(nodes, counts, strict=True):
        out.append((node, start, start + count))
        start += count
    return tuple(out)


def _option(inputs: _Inputs, label: str, stages: Stages, kept: int) -> _Option:
    compute = sum(c.s_per_layer * (end - start) for c, start, end in stages)
    path = [inputs.coordinator, *(c.key for c, _, _ in stages), inputs.coordinator]
    network = sum(inputs.hops.cost(a, b) for a, b in itertools.pairwise(path))
    reload_layers = sum(_reload(inputs, c.key, s, e) for c, s, e in stages)
    guessed = sum(
        inputs.hops.rtt(a, b)[0] / 2.0
        for a, b in itertools.pairwise(path)
        if not inputs.hops.rtt(a, b)[1]
    )
    hops = sum(a != b for a, b in itertools.pairwise(path))
    return _Option(
        label,
        stages,
        kept,
        compute + network,
        reload_layers,
        compute + network - guessed,
        compute + hops * inputs.config.hop_cost_s,
    )


def _reload(inputs: _Inputs, key: bytes, start: int, end: int) -> int:
    """Layers the node loads to serve [start, end): none if it holds exactly that range, else
    all of them. A stage whose range changes restarts (its sessions end, its layers load
    again), so growing a surviving stage by one layer costs as much as a new stage."""
    return 0 if inputs.held.get(key) == (start, end) else end - start


def _anchor_chains(
    inputs: _Inputs, survivors: Sequence[Candidate], fixed: Sequence[Candidate]
) -> list[tuple[str, dict[bytes, tuple[Candidate, tuple[int, int]]]]]:
    """Non-overlapping anchors: survivors (then fixed nodes), and fixed nodes alone."""
    kept = [c for c in survivors if _fits(inputs, c, *inputs.held[c.key])]
    by_speed = sorted(fixed, key=lambda c: (c.s_per_layer, c.key))
    chains: list[list[Candidate]] = []
    if kept:
        chains.append([*kept, *by_speed])
    if fixed:
        chains.append(by_speed)
    out = []
    for ranked in chains:
        chosen: dict[bytes, tuple[Candidate, tuple[int, int]]] = {}
        for c in ranked:
            start, end = inputs.held[c.key]
            if all(end <= s or start >= e for _, (s, e) in chosen.values()):
                chosen[c.key] = (c, (start, end))
        # The survivors kept (one that overlaps another kept first is not).
        survived = sum(c in kept for c in ranked if c.key in chosen)
        label = f"keep {survived} surviving stage(s)" if survived else "use fixed-range nodes"
        out.append((label, chosen))
    return out


def _anchored(
    inputs: _Inputs,
    label: str,
    anchors: Mapping[bytes, tuple[Candidate, tuple[int, int]]],
    free: Sequence[Candidate],
) -> _Option | None:
    """Anchors keep their ranges; each gap between them is searched between its neighbours."""
    last_layer = inputs.model.num_layers
    chain: list[tuple[Candidate | None, tuple[int, int]]] = sorted(
        anchors.values(), key=lambda item: item[1][0]
    )
    chain.append((None, (last_layer, last_layer)))
    stages: list[tuple[Candidate, int, int]] = []
    available = list(free)
    at, before = 0, inputs.coordinator
    for anchor, (start, end) in chain:
        if start > at:
            after = anchor.key if anchor is not None else inputs.coordinator
            gap = Segment(at, start, before, after, at == 0, start == last_layer)
            result = _search(inputs, gap, available)
            if result.best is None:
                return None
            stages.extend(_stages_from(result.best.nodes, result.best.counts, at))
            used = {c.key for c in result.best.nodes}
            available = [c for c in available if c.key not in used]
        if anchor is None:
            break
        stages.append((anchor, start, end))
        at, before = end, anchor.key
    if len(stages) > inputs.config.max_stages:
        return None
    return _option(inputs, label, tuple(stages), len(anchors))


def _build(
    inputs: _Inputs,
    chosen: _Option,
    census: Census,
    free: Sequence[Candidate],
    fixed: Sequence[Candidate],
    free_result: SegmentResult | None,
    options: Sequence[_Option],
) -> Plan:
    model, hops = inputs.model, inputs.hops
    stages = tuple(
        PlannedStage(
            node_key=c.key,
            layer_start=start,
            layer_end=end,
            s_per_layer_token=c.s_per_layer,
            compute_s=c.s_per_layer * (end - start),
            memory_bytes=stage_bytes(model, inputs.context_tokens, start, end),
            weight_bytes=stage_bytes(model, 0, start, end),
            usable_bytes=c.usable_bytes,
            reload_layers=_reload(inputs, c.key, start, end),
        )
        for c, start, end in chosen.stages
    )
    keys = [inputs.coordinator, *(s.node_key for s in stages), inputs.coordinator]
    cycle = tuple(_hop(hops, a, b) for a, b in itertools.pairwise(keys))
    # mesh-llm's view: order by RTT to the coordinator only.
    naive = sorted(keys[1:-1], key=lambda k: (hops.rtt(inputs.coordinator, k)[0], k))
    naive_s = hops.cycle_s(inputs.coordinator, naive)
    k_min = len(chosen.stages)
    if free_result is not None and free_result.fewest_feasible is not None:
        k_min = free_result.fewest_feasible
    k_estimate = free_result.min_stages if free_result is not None else k_min
    return Plan(
        model_id=model.model_id,
        num_layers=model.num_layers,
        coordinator=inputs.coordinator,
        context_tokens=inputs.context_tokens,
        stages=stages,
        hops=cycle,
        hop_cost_s=inputs.config.hop_cost_s,
        min_stages=k_min,
        min_stages_reason=_min_stages_reason(inputs, [*free, *fixed], k_min, k_estimate),
        census=census,
        alternatives=_alternatives(inputs, chosen, free, free_result, options),
        naive_order_network_s=naive_s,
        kept_stages=chosen.kept,
        quantization=model.quantization,
    )


def _hop(hops: HopCosts, a: bytes, b: bytes) -> Hop:
    rtt, measured = hops.rtt(a, b)
    return Hop(a, b, rtt, measured, hops.cost(a, b))


def _whole_model(inputs: _Inputs) -> str:
    model, ctx = inputs.model, inputs.context_tokens
    whole = stage_bytes(model, ctx, 0, model.num_layers)
    weights = stage_bytes(model, 0, 0, model.num_layers)
    kv = whole - weights
    return (
        f"the whole model needs {format_bytes(whole)} ({format_bytes(weights)} weights + "
        f"{format_bytes(kv)} KV for {ctx} tokens)"
    )


def _min_stages_reason(
    inputs: _Inputs, usable: Sequence[Candidate], k_min: int, k_estimate: int
) -> str:
    """Why the fewest stages that fit is `k_min`, with the deciding figures."""
    if not usable:
        return "no usable node"
    largest = max(usable, key=lambda c: (c.usable_bytes, c.key))
    if k_min <= 1:
        return (
            f"{_whole_model(inputs)} and node {short_key(largest.key)} offers "
            f"{format_bytes(largest.usable_bytes)}: one stage fits"
        )
    reason = (
        f"{_whole_model(inputs)}; the largest node, {short_key(largest.key)}, offers "
        f"{format_bytes(largest.usable_bytes)} ({largest.cap_mid} of {inputs.model.num_layers} "
        f"layers, {largest.cap(True, True)} with embedding and head), so at least {k_min} "
        "stages are needed"
    )
    if k_estimate < k_min:
        reason += (
            f" ({k_estimate} would hold the layers alone; the embedding and head on the end "
            "stages do not fit then)"
        )
    return reason


def _alternatives(
    inputs: _Inputs,
    chosen: _Option,
    free: Sequence[Candidate],
    free_result: SegmentResult | None,
    options: Sequence[_Option],
) -> tuple[Alternative, ...]:
    """The options weighed, each with its predicted time and why it lost (or won)."""
    out: list[Alternative] = []
    chosen_t = chosen.predicted_s
    if free_result is not None:
        if 1 not in free_result.by_stages:
            out.append(Alternative("1 stage", None, "no single node holds the whole model"))
        gain = inputs.config.extra_stage_min_gain_fraction
        prefix = "full plan, " if len(options) > 1 else ""
        for k, seg_plan in sorted(free_result.by_stages.items()):
            label = f"{prefix}{k} stage{'s' if k > 1 else ''}"
            if seg_plan is None:
                out.append(Alternative(label, None, "no set of this size holds the model"))
            elif chosen.label == _FULL and len(chosen.stages) == k:
                out.append(Alternative(label, seg_plan.total_s, "chosen"))
            else:
                note = f"{format_delta_ms(seg_plan.total_s - chosen_t)} vs chosen"
                if free_result.fewest_feasible is not None and k > free_result.fewest_feasible:
                    note += f" (a further stage must gain at least {gain:.0%})"
                out.append(Alternative(label, seg_plan.total_s, note))
    if len(options) > 1:
        tolerance = inputs.config.reuse_tolerance_fraction
        full = next((o for o in options if o.label == _FULL), None)
        for option in options:
            label = f"{option.label}, {option.reload_layers} layer(s) to load"
            note = "chosen"
            if option is not chosen:
                note = f"{format_delta_ms(option.predicted_s - chosen_t)} vs chosen"
                if full is not None and _extra_stages(option, full):
                    note += (
                        f", {len(option.stages)} stages where the full plan has "
                        f"{len(full.stages)} (a kept plan may not have more stages than the "
                        "full plan unless faster on compute and protocol cost alone)"
                    )
                elif option.predicted_s < chosen_t:
                    note += f", but the chosen plan loads {chosen.reload_layers} layer(s), and "
                    note += (
                        "loaded stages stay where they are (sticky plans)"
                        if math.isinf(tolerance)
                        else f"the plan loading fewer wins when at most {tolerance:.0%} slower "
                        "(its unmeasured hops counted at protocol cost)"
                    )
            out.append(Alternative(label, option.predicted_s, note))
    used = {c.key for c, _, _ in chosen.stages}
    unused = [c for c in free if c.key not in used]
    if unused:
        fastest = min(unused, key=lambda c: (c.s_per_layer, c.key))
        rtt = inputs.hops.rtt(inputs.coordinator, fastest.key)[0]
        out.append(
            Alternative(
                f"fastest unused node {short_key(fastest.key)}",
                None,
                f"{format_ms(fastest.s_per_layer)}/layer, holds {fastest.cap_mid} layers, "
                f"RTT {format_ms(rtt)} to the coordinator",
            )
        )
    return tuple(out)


def _infeasible(
    inputs: _Inputs, census: Census, free: Sequence[Candidate], fixed: Sequence[Candidate]
) -> NoFeasiblePlan:
    """Why nothing fits, with the figures an operator needs."""
    model, config = inputs.model, inputs.config
    per_layer = model.layer_bytes(inputs.context_tokens)
    whole = stage_bytes(model, inputs.context_tokens, 0, model.num_layers)
    why_not = (
        f"{census.offered} node(s) offered: {census.unhealthy} unhealthy, {census.excluded} "
        f"excluded, {census.without_model} without the model, {census.too_small} too small "
        f"(one layer needs {format_bytes(per_layer)})"
    )
    usable = [*free, *fixed]
    total = sum(c.usable_bytes for c in usable)
    if not usable:
        return NoFeasiblePlan(
            f"no usable node; {why_not}", needed_bytes=whole, shortfall_bytes=whole
        )
    if total < whole:
        short = whole - total
        return NoFeasiblePlan(
            f"memory short by {format_bytes(short)}: {_whole_model(inputs)} and the "
            f"{len(usable)} usable node(s) offer {format_bytes(total)} after the "
            f"{config.memory_margin_fraction:.0%} margin; {why_not}",
            needed_bytes=whole,
            usable_bytes=total,
            shortfall_bytes=short,
            usable_nodes=len(usable),
        )
    caps = sorted((c.cap_mid for c in free), reverse=True)
    needed = min_stages(model.num_layers, caps, len(caps))
    held = sum(caps)
    if held >= model.num_layers and needed > config.max_stages:
        reason = (
            f"the model needs at least {needed} stages on these nodes but max_stages is "
            f"{config.max_stages}"
        )
    else:
        reason = (
            f"the usable nodes offer {format_bytes(total)} in all, enough for "
            f"{format_bytes(whole)}, but in whole layers ({format_bytes(per_layer)} each, "
            f"embedding {format_bytes(model.embedding_bytes)} on the first stage and head "
            f"{format_bytes(model.head_bytes)} on the last) they hold {held} of "
            f"{model.num_layers} layers, or fixed ranges leave gaps no free node fills"
        )
    return NoFeasiblePlan(
        f"{reason}; {why_not}",
        needed_bytes=whole,
        usable_bytes=total,
        shortfall_bytes=max(0, model.num_layers - held) * per_layer,
        usable_nodes=len(usable),
    )
