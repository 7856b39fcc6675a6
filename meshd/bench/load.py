"""`meshd bench load`: a load test through the OpenAI endpoint, as users would drive it.

    meshd bench load [--requests 200] [--concurrency 8] [--stages 2] [--json] [--quick] [--local]

Starts real `meshd serve` daemons on loopback (as `meshd demo` does: own addresses, a fresh
mesh secret, memory budgets that force a `--stages` split of the built-in model), waits for
their plan, then fires `--requests` requests at `--concurrency` with httpx on trio, spread
round-robin over every daemon's endpoint (each one coordinates what it receives). The mix is
seeded: chat and text completions, streamed and whole, short/medium/long prompts and
max_tokens, greedy and sampled. A 429 is retried after its `Retry-After`, as a client would,
and counted apart from errors. Reported: latency and time-to-first-token percentiles,
throughput, errors by status, and a leak check: each node's open sessions, requests in flight
and resident memory when idle before the load and after it drains. Any error or leak is a
failure (exit status 1). `--local` runs an in-process pipeline and API instead of daemons
(its leak check reads the stages' KV bytes directly).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import trio

from meshd.bench.harness import (
    add_model_option,
    add_quantization_option,
    model_dir,
    nearest_rank,
    print_report,
    resolve_quantization,
)
from meshd.bench.load_requests import SIZES, Job, LoadConfig, Record, make_jobs, run_load
from meshd.bench.load_targets import Snapshot
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.tokenizer import Tokenizer


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/max by nearest rank (None when there is nothing to rank)."""
    ranked = sorted(values)
    return {
        p: nearest_rank(ranked, q) for p, q in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
    }


def find_leaks(before: Snapshot, after: Snapshot, cfg: LoadConfig) -> list[str]:
    """What did not return to its idle level (empty: nothing leaked)."""
    leaks = []
    for node, idle in before.items():
        now = after.get(node, {})
        for name, value in idle.items():
            got = now.get(name)
            if name == "rss_bytes":
                if got is None or got - value > cfg.rss_growth_limit_bytes:
                    leaks.append(f"{node}: resident memory {value} -> {got} bytes")
            elif got != value:
                leaks.append(f"{node}: {name} {value} -> {got}")
    return leaks


def summarize(
    jobs: list[Job], records: list[Record], wall_s: float, cfg: LoadConfig
) -> dict[str, Any]:
    """The report's figures about the requests themselves."""
    ok = [r for r in records if not r.error]
    failed = [r for r in records if r.error]
    tokens = sum(r.completion_tokens for r in ok)
    size_of = {j.index: j.size for j in jobs}
    by_size = {
        size: percentiles([r.latency_s for r in ok if size_of[r.index] == size])
        for size in sorted(set(size_of.values()))
    }
    return {
        "requests": len(records),
        "concurrency": cfg.concurrency,
        "seed": cfg.seed,
        "succeeded": len(ok),
        "errors": len(failed),
        "errors_by_status": dict(Counter(str(r.status) for r in failed)),
        "error_examples": sorted({r.error for r in failed})[:5],
        "retried_429": sum(r.retries_429 for r in records),
        "requests_that_saw_429": sum(1 for r in records if r.retries_429),
        "latency_s": percentiles([r.latency_s for r in ok]),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "latency_by_size_s": by_size,
        "completion_tokens": tokens,
        "prompt_tokens": sum(j.prompt_tokens for j in jobs),
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(records) / wall_s if wall_s > 0 else 0.0,
        "mix": dict(
            Counter(f"{j.kind}/{'stream' if j.stream else 'whole'}/{j.size}" for j in jobs)
        ),
        "per_target": dict(Counter(str(r.target) for r in records)),
    }


async def measure(
    urls: list[str],
    tokenizer: Tokenizer,
    context_tokens: int,
    snapshot: Callable[[], Awaitable[Snapshot]],
    cfg: LoadConfig,
) -> dict[str, Any]:
    """Warm up, take the idle snapshot, fire the load, wait for the drain, compare."""
    async with httpx.AsyncClient(timeout=60) as client:
        model = (await client.get(urls[0] + "/models")).json()["data"][0]["id"]
    # Every node coordinates one short request first (lazy set-up stays out of the idle level).
    warm = make_jobs(tokenizer, len(urls), cfg.seed + 1, context_tokens, ("short",))
    warm_records, _ = await run_load(
        urls, model, warm, msgspec.structs.replace(cfg, concurrency=len(urls))
    )
    before = await _settled(snapshot, None, cfg.drain_timeout_s)
    jobs = make_jobs(tokenizer, cfg.requests, cfg.seed, context_tokens, cfg.sizes)
    records, wall_s = await run_load(urls, model, jobs, cfg)
    t0 = time.perf_counter()
    after = await _settled(snapshot, before, cfg.drain_timeout_s)
    leaks = find_leaks(before, after, cfg)
    return summarize(jobs, records, wall_s, cfg) | {
        "model": model,
        "kv_idle_before": before,
        "kv_after": after,
        "drain_s": time.perf_counter() - t0,
        "leaked": bool(leaks),
        "leaks": leaks,
        "warmup_errors": sum(1 for r in warm_records if r.error),
    }


async def _settled(
    snapshot: Callable[[], Awaitable[Snapshot]], idle: Snapshot | None, timeout_s: float
) -> Snapshot:
    """A snapshot once its counts stop moving (and, given `idle`, match it), or at the timeout."""
    deadline = trio.current_time() + timeout_s
    last = await snapshot()
    while trio.current_time() < deadline:
        await trio.sleep(0.25)
        now = await snapshot()
        counts_equal = _counts(now) == _counts(last)
        if counts_equal and (idle is None or _counts(now) == _counts(idle)):
            return now
        last = now
    return last


def _counts(snap: Snapshot) -> dict[str, dict[str, int]]:
    return {n: {k: v for k, v in f.items() if k != "rss_bytes"} for n, f in snap.items()}


# -- the command ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench load`."""
    add_model_option(parser)
    parser.add_argument("--requests", type=int, default=None, help="default 200 (--quick: 30)")
    parser.add_argument("--concurrency", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument("--stages", type=int, default=2, help="daemons, one stage each (2-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=[s.name for s in SIZES],
        choices=[s.name for s in SIZES],
        help="request size classes in the mix",
    )
    add_quantization_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="30 requests at concurrency 4")
    parser.add_argument(
        "--local", action="store_true", help="an in-process pipeline and API, no daemons"
    )
    parser.add_argument(
        "--first-host", type=int, default=31, help="daemons bind 127.0.0.N, N+1, ..."
    )


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The load's config from the command line (`--quick` picks the small defaults)."""
    return LoadConfig(
        requests=args.requests or (30 if args.quick else 200),
        concurrency=args.concurrency or (4 if args.quick else 8),
        seed=args.seed,
        sizes=tuple(args.sizes),
    )


def run(args: argparse.Namespace) -> int:
    """Run the load test; 0 when every request succeeded and nothing leaked."""
    cfg = config_from_args(args)
    directory = model_dir(args)
    args.quantization = resolve_quantization(args.quantization, directory)  # aliases resolved
    tokenizer = open_tokenizer(directory)
    context = _context_tokens(directory)
    t0 = time.perf_counter()
    if args.local:
        report = trio.run(
            _run_local, args.model, args.stages, tokenizer, context, cfg, args.quantization
        )
        report["target"] = {"kind": "local", "stages": args.stages}
    else:
        report = _run_daemons(args, directory, tokenizer, context, cfg)
    report["total_s"] = time.perf_counter() - t0
    report["quantization"] = args.quantization
    print_report(report, args.json, _print)
    failed = report.get("errors", 1) or report.get("warmup_errors", 0)
    return 1 if failed or report.get("leaked", True) else 0


def _context_tokens(model_dir: str) -> int:

    return open_checkpoint(model_dir).config.max_position_embeddings


async def _run_local(
    model: str | None,
    stages: int,
    tokenizer: Tokenizer,
    context: int,
    cfg: LoadConfig,
    quantization: str = "none",
) -> dict[str, Any]:
    from meshd.bench.load_targets import local_target

    async with local_target(model, stages, cfg.concurrency, quantization) as target:
        return await measure(target.urls, tokenizer, context, target.snapshot, cfg)


def _run_daemons(
    args: argparse.Namespace, model_dir: str, tokenizer: Tokenizer, context: int, cfg: LoadConfig
) -> dict[str, Any]:
    from meshd.bench.load_targets import DaemonMesh
    from meshd.cli.supervisor import DaemonError

    mesh = DaemonMesh(model_dir, args.model, args.stages, args.first_host, args.quantization)
    try:
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started

        async def snapshot() -> Snapshot:
            return await trio.to_thread.run_sync(mesh.snapshot)

        report = trio.run(measure, mesh.urls, tokenizer, context, snapshot, cfg)
        report["target"] = {"kind": "daemons", "stages": args.stages, "nodes": mesh.describe()}
        report["startup_s"] = startup_s
        return report
    except DaemonError as exc:
        print(f"meshd bench load: {exc}\n{mesh.logs(1500)}")
        return {"errors": 1, "leaked": True, "failure": str(exc)}
    finally:
        mesh.stop()


def _fmt(figures: dict[str, float | None], scale: float = 1000.0) -> str:
    return "  ".join(f"{k} {'-' if v is None else f'{v * scale:.0f}'}" for k, v in figures.items())


def _print(r: dict[str, Any]) -> None:
    if "failure" in r:
        print(f"load test failed to start: {r['failure']}")
        return
    target = r["target"]
    print(
        f"{r['requests']} requests at concurrency {r['concurrency']} over {target['kind']} "
        f"({target['stages']} stages), model {r['model']}, seed {r['seed']}"
    )
    for node in target.get("nodes", ()):
        print(f"  {node['node']}: pid {node['pid']}, {node['api']}, layers {node['layers']}")
    print(f"  mix: {', '.join(f'{k} {v}' for k, v in sorted(r['mix'].items()))}")
    failed = f" {r['errors_by_status']} {r['error_examples']}" if r["errors"] else ""
    print(
        f"  succeeded {r['succeeded']}, errors {r['errors']}{failed}; 429 retries "
        f"{r['retried_429']} (on {r['requests_that_saw_429']} requests)"
    )
    print(f"  latency ms: {_fmt(r['latency_s'])}")
    for size, figures in r["latency_by_size_s"].items():
        print(f"    {size}: {_fmt(figures)}")
    print(f"  ttft ms (streamed): {_fmt(r['ttft_s'])}")
    print(
        f"  {r['completion_tokens']} tokens in {r['wall_s']:.1f} s: {r['tokens_per_s']:.1f} "
        f"tok/s, {r['requests_per_s']:.2f} requests/s"
    )
    print(f"  idle before: {r['kv_idle_before']}")
    print(f"  after drain ({r['drain_s']:.1f} s): {r['kv_after']}")
    print(f"  leaked: {'YES: ' + '; '.join(r['leaks']) if r['leaked'] else 'no'}")
