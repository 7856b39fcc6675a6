"""The figures of `meshd bench plot`: one function per bench, its `--json` report(s) in.

Each function reads the fields its bench's module writes (meshd/bench/lanes.py,
meshd/bench/decode.py, meshd/bench/spec.py, meshd/bench/pipeline.py,
meshd/bench/concurrency.py, meshd/bench/scale.py, meshd/bench/load.py) and
returns a matplotlib Figure. Figures are drawn without pyplot (no global state) on the Agg
canvas. Imported only by `meshd bench plot`: matplotlib is the optional `plots` extra.
"""

from __future__ import annotations

import pathlib
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from meshd.bench.harness import median

PANEL_SIZE_IN = (5.2, 3.9)  # width, height of one panel, inches
PERCENTILES = ("p50", "p90", "p99", "max")
SPEC_CELL = (2, 20.0)  # the spec bars' stages and RTT ms, as docs/benchmarks.md quotes them
# Reference lines: the scale goals, as meshd.bench.scale.GOALS states them.
DEATH_KNOWN_GOAL_S = 5.0
GOSSIP_GOAL_KB_S = 10.0
PLAN_GOAL_MS = 100.0


def save(figure: Figure, path: pathlib.Path, dpi: int) -> None:
    """Write `figure` as a PNG (no timestamp or version in it, so reruns diff cleanly)."""
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=dpi, metadata={"Software": None})


def _panels(count: int, title: str) -> tuple[Figure, list[Axes]]:
    width, height = PANEL_SIZE_IN
    figure = Figure(figsize=(width * count, height + 0.4), layout="constrained")
    axes = list(figure.subplots(1, count, squeeze=False)[0])
    figure.suptitle(title, fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return figure, axes


def conditions(report: dict[str, Any]) -> str:
    """The run's date and host load, where the report carries them ("" otherwise)."""
    c = {**report, **(report.get("conditions") or {})}
    parts = []
    if c.get("date"):
        parts.append(str(c["date"]))
    before, after = c.get("load_average_before"), c.get("load_average_after")
    if before is not None:
        load = f"load {before}" + (f" → {after}" if after is not None else "")
        parts.append(load + (f" on {c['cpus']} CPUs" if c.get("cpus") else ""))
    return ", ".join(parts)


def _title(text: str, report: dict[str, Any]) -> str:
    extra = conditions(report)
    return f"{text}\n{extra}" if extra else text


def _bar_groups(
    ax: Axes, groups: list[str], series: dict[str, list[float | None]], fmt: str = "{:.3g}"
) -> None:
    """Grouped bars: one group per label, one bar per series; None leaves a gap."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        bars = ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=name)
        ax.bar_label(bars, labels=[fmt.format(v) for _, v in shown], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)


# -- lanes ----------------------------------------------------------------------------------
def lanes(reports: list[dict[str, Any]]) -> Figure:
    """Throughput and round trip: our lane vs aioquic vs raw UDP (the last report)."""
    r = reports[-1]
    figure, (left, right) = _panels(
        2,
        _title(
            f"meshd bench lanes — loopback, median of {r['rounds']} alternating rounds: lane "
            f"{r['throughput_ratio_vs_aioquic']:.1f}× aioquic's throughput, round trip "
            f"{r['rtt_ratio_vs_aioquic']:.2f}× aioquic's, {r['rtt_ratio_vs_udp']:.1f}× raw UDP's",
            r,
        ),
    )
    names = ["meshd lane", "aioquic\n1200 B", "aioquic\n16000 B"]
    values = [r["lane_mb_s"], r["aioquic_mb_s"], r["aioquic_max_datagram_mb_s"]]
    bars = left.bar(names, values, color=["C0", "C1", "C1"])
    left.bar_label(bars, fmt="%.3g", fontsize=8)
    left.set_ylabel("MB/s")
    left.set_title(f"throughput, {r['messages']} × 64 KiB one way", fontsize=9)
    names = ["raw UDP", "UDP +\ntask hops", "meshd lane", "aioquic"]
    keys = ["udp_rtt_us", "udp_task_hop_rtt_us", "lane_rtt_us", "aioquic_rtt_us"]
    bars = right.bar(names, [r[k] for k in keys], color=["C2", "C2", "C0", "C1"])
    right.bar_label(bars, fmt="%.3g", fontsize=8)
    right.set_ylabel("µs (median)")
    right.set_title(f"round trip of a 64-byte message, {r['pings']} pings", fontsize=9)
    return figure


# -- decode ---------------------------------------------------------------------------------
def decode(reports: list[dict[str, Any]]) -> Figure:
    """meshd's decode loop vs transformers generate(), one group per report (checkpoint)."""
    first = reports[0]
    figure, (left, right) = _panels(
        2,
        _title(
            f"meshd bench decode — greedy, batch 1, {first['dtype']} on {first['device']}, "
            f"{first['threads']} thread(s), medians of interleaved rounds",
            first,
        ),
    )
    labels = [f"{r['model']}\n{r['params'] / 1e6:.1f} M params" for r in reports]
    _bar_groups(
        left,
        labels,
        {
            "meshd": [r["meshd_tok_s"] for r in reports],
            "transformers": [r["transformers_tok_s"] for r in reports],
        },
        "{:.3g}",
    )
    rates = [r[k] for r in reports for k in ("meshd_tok_s", "transformers_tok_s")]
    if max(rates) > 20 * min(rates):  # checkpoints of very different sizes
        left.set_yscale("log")
    left.set_ylabel("tokens/s (wall)")
    left.set_title("throughput", fontsize=9)
    _bar_groups(
        right,
        labels,
        {
            "wall time": [r["ratio"] for r in reports],
            "CPU time": [r.get("cpu_ratio") for r in reports],
            "bound: matmuls alone (CPU)": [r.get("max_cpu_ratio") for r in reports],
        },
        "{:.2f}",
    )
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_ylabel("× transformers")
    right.set_title("meshd's speed ÷ transformers'", fontsize=9)
    return figure


# -- spec -----------------------------------------------------------------------------------
def _spec_cell(rows: list[dict[str, Any]]) -> tuple[int, float]:
    """(stages, RTT) of the bars: the docs' 2 stages at 20 ms, else the most networked cell."""
    cells = {(r["stages"], r["rtt_ms"]) for r in rows}
    return SPEC_CELL if SPEC_CELL in cells else max(cells)


def spec(reports: list[dict[str, Any]]) -> Figure:
    """Speedup over `disabled` per strategy × workload at one cell, and across RTTs."""
    r = reports[-1]
    rows = r["rows"]
    stages, rtt = _spec_cell(rows)
    strategies = list(dict.fromkeys(x["strategy"] for x in rows if x["strategy"] != "disabled"))
    workloads = list(dict.fromkeys(x["workload"] for x in rows))
    rtts = sorted({x["rtt_ms"] for x in rows if x["stages"] == stages})
    mismatched = sum(not x["identical_to_disabled"] for x in rows)
    check = (
        "every run token-identical to disabled"
        if not mismatched
        else (f"{mismatched} rows NOT token-identical to disabled")
    )
    figure, axes = _panels(
        2 if len(rtts) > 1 else 1,
        _title(f"meshd bench spec — greedy, {r['tokens']} tokens per run; {check}", r),
    )
    ratio = {
        (x["rtt_ms"], x["workload"], x["strategy"]): x["ratio_vs_disabled"]
        for x in rows
        if x["stages"] == stages
    }
    _bar_groups(
        axes[0],
        strategies,
        {w: [ratio.get((rtt, w, s)) for s in strategies] for w in workloads},
        "{:.1f}",
    )
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].tick_params(axis="x", labelsize=8, rotation=20)
    axes[0].set_ylabel("decode tok/s ÷ disabled (same run)")
    axes[0].set_title(f"{stages} stage(s), RTT {rtt:g} ms, by workload", fontsize=9)
    if len(rtts) > 1:
        ax = axes[1]
        for s in strategies:
            ys = [median(ratio[(t, w, s)] for w in workloads if (t, w, s) in ratio) for t in rtts]
            ax.plot(rtts, ys, "o-", label=s)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("emulated RTT per link (ms)")
        ax.set_ylabel("× disabled, median over workloads")
        ax.set_title(f"{stages} stage(s), by RTT", fontsize=9)
        ax.legend(fontsize=8)
    return figure


# -- pipeline -------------------------------------------------------------------------------
def _pipeline_panel(ax: Axes, rows: list[dict[str, Any]], issue: bool) -> None:
    """Measured points and model lines per stage count (colour = stages)."""
    for i, stages in enumerate(sorted({r["stages"] for r in rows})):
        mine = sorted((r for r in rows if r["stages"] == stages), key=lambda r: r["rtt_ms"])
        rtts = [r["rtt_ms"] for r in mine]
        colour = f"C{i}"
        ax.plot(rtts, [r["measured_ms_per_token"] for r in mine], "o", color=colour, ms=6)
        ax.plot(rtts, [r["predicted_ms_per_token"] for r in mine], "-", color=colour, lw=1.4)
        if issue and stages > 1:  # at one stage both models are C
            ys = [r["predicted_issue_ms_per_token"] for r in mine]
            ax.plot(rtts, ys, ":", color=colour, lw=1.2)
    ax.set_xlabel("emulated RTT per link (ms)")
    ax.set_ylabel("ms per token")
    ax.set_ylim(bottom=0)


def _pipeline_legend(ax: Axes, stage_counts: list[int], issue: bool) -> None:
    handles = [
        Line2D([], [], color=f"C{i}", marker="o", label=f"{s} stage{'s' if s > 1 else ''}")
        for i, s in enumerate(stage_counts)
    ]
    handles += [
        Line2D([], [], color="k", marker="o", ls="", label="measured (median)"),
        Line2D([], [], color="k", ls="-", label="model C + H(S)·(RTT/2 + P)"),
    ]
    if issue:
        handles.append(Line2D([], [], color="k", ls=":", label="issue's C + (S−1)·(2·RTT + P′)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left")


def pipeline(reports: list[dict[str, Any]]) -> Figure:
    """Time per token vs RTT, one colour per stage count: plain, then the best speculation."""
    r = reports[-1]
    c, m = r["conditions"], r["model"]
    plain = [x for x in r["rows"] if x["table"] == "plain"]
    best = [x for x in r["rows"] if x["table"] == "speculative"]
    stage_counts = sorted({x["stages"] for x in plain})
    figure, axes = _panels(
        2 if best else 1,
        _title(
            f"meshd bench pipeline — prompt {c['prompt']}, {c['tokens']} tokens, median of "
            f"{c['repeats']}; P = {m['P_ms']:.2f} ms per lane message, O = {m['O_ms']:.2f} ms",
            r,
        ),
    )
    _pipeline_panel(axes[0], plain, issue=True)
    _pipeline_legend(axes[0], stage_counts, issue=True)
    axes[0].set_title(
        f"plain greedy: {m['plain_cells_within_tolerance']} of {m['plain_cells_tested']} "
        "out-of-sample cells within 15 %",
        fontsize=9,
    )
    if best:
        _pipeline_panel(axes[1], best, issue=False)
        _pipeline_legend(axes[1], stage_counts, issue=False)
        axes[1].set_title(
            f"fastest of {len(c['candidates'])} speculative strategies per cell, model ÷ E",
            fontsize=9,
        )
    return figure


# -- concurrency ----------------------------------------------------------------------------
def concurrency(reports: list[dict[str, Any]]) -> Figure:
    """Aggregate tok/s and per-token latency vs concurrent streams, batching on vs off."""
    r = reports[-1]
    rows = r["rows"]
    differ = [x["streams"] for x in rows if not x["identical_to_unbatched"]]
    check = "batched text identical" if not differ else f"TEXT DIFFERS at {differ} streams"
    figure, (left, right) = _panels(
        2,
        _title(
            f"meshd bench concurrency — {r['stages']} stages, {r['tokens_per_stream']} "
            f"tokens/stream, RTT {r['rtt_ms']:g} ms, {r['strategy']}, best of {r['repeats']}; "
            f"{check}",
            r,
        ),
    )
    streams = sorted({x["streams"] for x in rows})
    modes = ((True, "o", "-", "C0", "batching on"), (False, "s", "--", "C1", "batching off"))
    for batching, marker, line, colour, name in modes:
        mine = sorted((x for x in rows if x["batching"] == batching), key=lambda x: x["streams"])
        xs = [x["streams"] for x in mine]
        left.plot(xs, [x["decode_tok_s"] for x in mine], marker + line, color=colour, label=name)
        right.plot(
            xs, [x["p99_token_ms"] for x in mine], marker + line, color=colour, label=f"p99, {name}"
        )
        right.plot(
            xs,
            [x["p50_token_ms"] for x in mine],
            marker + ":",
            color=colour,
            alpha=0.5,
            label=f"p50, {name}",
        )
    for x in rows:  # the speedup over one stream, on the batched line
        if x["batching"] and x["ratio_vs_1_stream"]:
            left.annotate(
                f"{x['ratio_vs_1_stream']:.2f}×",
                (x["streams"], x["decode_tok_s"]),
                textcoords="offset points",
                xytext=(-10, 7),
                fontsize=7,
            )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(s) for s in streams])
        ax.set_xlabel("concurrent streams")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room for the labels above the top point
        ax.legend(fontsize=8)
    left.set_ylabel("aggregate decode tokens/s")
    left.set_title("throughput (labels: × one stream, batched)", fontsize=9)
    right.set_ylabel("ms per token")
    right.set_title("per-token latency", fontsize=9)
    return figure


# -- scale ----------------------------------------------------------------------------------
def _goal(ax: Axes, value: float, text: str) -> None:
    ax.axhline(value, color="red", lw=0.8, ls="--")
    ax.annotate(
        text,
        (0.02, value),
        xycoords=("axes fraction", "data"),
        color="red",
        fontsize=7,
        xytext=(0, 2),
        textcoords="offset points",
    )


def _membership_panels(detect: Axes, gossip: Axes, members: list[dict[str, Any]]) -> None:
    ns = [m["n"] for m in members]
    for m in members:  # every crash timed; None: never known dead everywhere
        deaths = [d for d in m["death_known_s"] if d is not None]
        detect.plot([m["n"]] * len(deaths), deaths, "o", color="C0", alpha=0.4, ms=4)
    medians = [median(d for d in m["death_known_s"] if d is not None) for m in members]
    detect.plot(ns, medians, "-", color="C0", label="crash known dead everywhere (median)")
    detect.plot(
        ns,
        [m["join_converge_s"] for m in members],
        "s--",
        color="C1",
        label="late join seen by all",
    )
    _goal(detect, DEATH_KNOWN_GOAL_S, "goal: death known < 5 s")
    detect.set_ylabel("simulated seconds")
    detect.set_title("failure detection and join", fontsize=9)
    kb = [m["bytes_per_node_s"] / 1e3 for m in members]
    gossip.plot(ns, kb, "o-", label="mean per node")
    gossip.plot(ns, [m["max_bytes_per_node_s"] / 1e3 for m in members], "s--", label="busiest node")
    _goal(gossip, GOSSIP_GOAL_KB_S, "goal: < 10 kB/s per node")
    gossip.set_ylabel("gossip kB/s per node, with load churn")
    gossip.set_title("membership traffic", fontsize=9)


def scale(reports: list[dict[str, Any]]) -> Figure:
    """Detection time, gossip bytes and planner time vs simulated node count."""
    r = reports[-1]
    members, plans = r["membership"], r["plans"]
    figure, axes = _panels(
        3 if members else 1,
        _title(
            "meshd bench scale — real membership and planner code on a virtual clock, "
            f"seeded geography, 1 % loss ({r['wall_s']:.0f} s wall)",
            r,
        ),
    )
    if members:
        _membership_panels(axes[0], axes[1], members)
    plan = axes[-1]
    ns = sorted({p["n"] for p in plans})
    cpu_ms = {n: [1e3 * p["cpu_s"] for p in plans if p["n"] == n] for n in ns}
    for n in ns:
        plan.plot([n] * len(cpu_ms[n]), cpu_ms[n], "o", color="C2", alpha=0.4, ms=4)
    plan.plot(ns, [median(cpu_ms[n]) for n in ns], "-", color="C2", label="median")
    plan.plot(ns, [max(cpu_ms[n]) for n in ns], "--", color="C3", label="max")
    _goal(plan, PLAN_GOAL_MS, "goal: a plan < 100 ms")
    plan.set_yscale("log")
    plan.set_ylabel("CPU ms per plan")
    plan.set_title("planner (every model × coordinator)", fontsize=9)
    sizes = sorted({*ns, *(m["n"] for m in members)})
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("nodes")
        ax.legend(fontsize=7, loc="center right")
    return figure


# -- load -----------------------------------------------------------------------------------
def _cdf(ax: Axes, values: list[float], label: str) -> None:
    ranked = sorted(values)
    ax.step(ranked, [(i + 1) / len(ranked) for i in range(len(ranked))], where="post", label=label)


def load(reports: list[dict[str, Any]]) -> Figure:
    """Latency and time-to-first-token percentiles (and CDFs, given per-request values)."""
    r = reports[-1]
    if "failure" in r:
        raise ValueError(f"the load test did not run: {r['failure']}")
    per_request = isinstance(r.get("latencies_s"), list)
    target = r["target"]
    figure, axes = _panels(
        3 if per_request else 2,
        _title(
            f"meshd bench load — {r['requests']} requests at concurrency {r['concurrency']} "
            f"over {target['kind']} ({target['stages']} stages), seed {r['seed']}: "
            f"{r['errors']} errors, {r['retried_429']} 429 retries, {r['tokens_per_s']:.1f} "
            f"tok/s, leaked: {'YES' if r['leaked'] else 'no'}",
            r,
        ),
    )
    by_size = r.get("latency_by_size_s") or {}
    order = {"short": 0, "medium": 1, "long": 2}  # the mix's sizes, smallest first
    groups = {"all": r["latency_s"]}
    groups |= {k: by_size[k] for k in sorted(by_size, key=lambda k: (order.get(k, 3), k))}
    _bar_groups(
        axes[0], list(groups), {p: [g[p] for g in groups.values()] for p in PERCENTILES}, "{:.1f}"
    )
    axes[0].set_ylabel("seconds")
    axes[0].set_title("request latency (retries included)", fontsize=9)
    ttft_ms = [None if v is None else 1e3 * v for v in r["ttft_s"].values()]
    _bar_groups(axes[1], list(r["ttft_s"]), {"streamed requests": ttft_ms}, "{:.0f}")
    axes[1].set_ylabel("ms")
    axes[1].set_title("time to first token", fontsize=9)
    if per_request:
        _cdf(axes[2], r["latencies_s"], "latency")
        if isinstance(r.get("ttfts_s"), list):
            _cdf(axes[2], r["ttfts_s"], "time to first token")
        axes[2].set_xscale("log")
        axes[2].set_xlabel("seconds")
        axes[2].set_ylabel("fraction of requests")
        axes[2].set_title("per-request CDF", fontsize=9)
        axes[2].legend(fontsize=8)
    return figure
