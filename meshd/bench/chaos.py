"""`meshd bench chaos`: real daemons under a seeded load while nodes crash, stop and return.

    meshd bench chaos [--duration-s 120] [--disruptions N] [--seed 0] [--json] [--quick]

Starts `--nodes` `meshd serve` daemons on loopback (own addresses and state dirs, a fresh mesh
secret, the demo's memory budgets: `--stages` of them hold the built-in model, the rest are
spares), sends every job of a seeded set once or more undisturbed (the reference texts), then
for `--duration-s` keeps `--concurrency` streamed requests (greedy and sampled, chat and text)
going to the OpenAI API of random nodes while it SIGKILLs or SIGTERMs a random node (the
coordinators of open streams included), starts it again a few seconds later, and waits for
the mesh to settle before the next one (`--disruptions N` ends the storm sooner, once N
SIGKILL/SIGTERMs, one of a coordinator, were restarted). One node is down at most, so the mesh
can always serve. After the storm it waits up to `session_lease_s` (plus a margin; `--leak-wait-s` when
the daemons have no session leases) for every node to hold no session and no KV, and sends
one more request to each node.

Reported (docs/operations.md, "Chaos", explains each field): how each request ended
(completed, identical to its reference, clear errors by kind, silent truncations, hangs),
recovery times, disruptions by kind and role, and what every node still holds after the
storm. Exit status 1 when a stream was truncated silently or hung, a session or KV byte
leaked, or a node did not serve after the storm.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from types import FrameType
from typing import Any

import msgspec
import trio

from meshd.bench.chaos_mesh import ChaosMesh
from meshd.bench.chaos_requests import (
    BAD_RESPONSE,
    COMPLETED,
    CONNECTION_LOST,
    ERROR_EVENT,
    HUNG,
    REFUSED,
    TRUNCATED,
    ChaosJob,
    Disruption,
    Seen,
    classify,
    make_jobs,
    percentiles,
    recovery_s,
)
from meshd.bench.chaos_storm import (
    StormConfig,
    StormLog,
    after_storm,
    in_thread,
    leak_check,
    model_name,
    reference,
    storm,
)

# Past the lease, sessions get this long to be seen gone (status polls, clock granularity).
LEASE_MARGIN_S = 10.0
# A SIGTERMed daemon gets its graceful stop plus this long before the bench SIGKILLs it.
TERM_MARGIN_S = 15.0
# --quick: the daemons' graceful_timeout_s (when they have it) unless given.
QUICK_GRACEFUL_S = 10.0
LEASE_KEY = "session_lease_s"
GRACEFUL_KEY = "graceful_timeout_s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench chaos`."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in)")
    parser.add_argument(
        "--duration-s", type=float, default=None, help="storm length (default 120; --quick 100)"
    )
    parser.add_argument(
        "--disruptions",
        type=int,
        default=0,
        help="end the storm once this many SIGKILL/SIGTERMs (a coordinator's among them) were "
        "restarted, before --duration-s (default 0: run the whole duration)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the load and the storm")
    parser.add_argument("--concurrency", type=int, default=8, help="streamed requests at once")
    parser.add_argument("--nodes", type=int, default=4, help="daemons (stages + spares)")
    parser.add_argument("--stages", type=int, default=3, help="stages the budgets force")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (default 48; --quick 24)"
    )
    parser.add_argument(
        "--reference-rounds", type=int, default=2, help="undisturbed runs of every job"
    )
    parser.add_argument(
        "--session-lease-s",
        type=float,
        default=None,
        help=f"passed to the daemons when they have `{LEASE_KEY}` (default: theirs)",
    )
    parser.add_argument(
        "--graceful-timeout-s",
        type=float,
        default=None,
        help=f"passed to the daemons when they have `{GRACEFUL_KEY}` (default: theirs; --quick 10)",
    )
    parser.add_argument(
        "--leak-wait-s",
        type=float,
        default=30.0,
        help=f"after the storm, wait this long for sessions to go when daemons lack {LEASE_KEY}",
    )
    parser.add_argument(
        "--first-host", type=int, default=41, help="daemons bind 127.0.0.N, N+1, ..."
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="a 100 s storm, 24-token requests, 10 s graceful stops"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the daemons' work dir")


def daemon_key(key: str) -> tuple[bool, float | None]:
    """Whether the daemons have config key `key`, and its default there."""
    from meshd.config.node import NodeConfig

    for f in msgspec.structs.fields(NodeConfig):
        if f.name == key:
            default = f.default if isinstance(f.default, int | float) else None
            return True, None if default is None else float(default)
    return False, None


def run(args: argparse.Namespace) -> int:
    """Run the storm; 0 when nothing was truncated silently, hung or leaked."""
    from meshd.model.builtin import builtin_model_dir

    t0 = time.monotonic()
    settings = _settings(args)
    cfg: StormConfig = settings["cfg"]
    jobs = make_jobs(args.seed, settings["max_tokens"])
    model_dir = args.model or str(builtin_model_dir())
    mesh = ChaosMesh(
        model_dir, args.model, args.nodes, args.stages, args.first_host, settings["flags"]
    )
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        mesh.start()
        report = _run_trio(mesh, jobs, cfg, args.reference_rounds, settings["leak_wait_s"])
        report |= {k: v for k, v in settings.items() if k not in ("cfg", "flags")}
        report["nodes"] = args.nodes
        report["stages"] = args.stages
        report["concurrency"] = cfg.concurrency
        report["seed"] = args.seed
        report["duration_s"] = cfg.duration_s
        report["disruptions_asked"] = cfg.disruptions
    except KeyboardInterrupt:
        print("meshd bench chaos: interrupted; stopping the daemons", file=sys.stderr)
        return 130
    except Exception as exc:  # a failure to start or a bug: say so, with the daemons' logs
        failure = f"{type(exc).__name__}: {exc}"
        print(f"meshd bench chaos failed: {failure}\n{mesh.logs(1500)}", file=sys.stderr)
        report = {"ok": False, "failures": [failure]}
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        mesh.stop(keep_logs=args.keep_logs)
    report["pids"] = [pid for slot in mesh.slots for pid in slot.pids]
    report["work_dir"] = str(mesh.work)  # removed unless --keep-logs
    report["total_s"] = time.monotonic() - t0
    if args.json:
        print(json.dumps(report))
    elif "disruptions" in report:  # a failed start was said above, with the logs
        print_report(report)
    return 0 if report["ok"] else 1


def _run_trio(
    mesh: ChaosMesh, jobs: list[ChaosJob], cfg: StormConfig, rounds: int, leak_wait_s: float
) -> dict[str, Any]:
    """`_measure` in trio; a Ctrl-C that reaches us inside an exception group stays a Ctrl-C."""
    try:
        return trio.run(_measure, mesh, jobs, cfg, rounds, leak_wait_s)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from None
        raise


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM of the bench: stop like Ctrl-C, so the daemons stop and the work dir goes."""
    raise KeyboardInterrupt


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The storm's config and the daemons' extra flags from the command line."""
    lease_ok, lease_default = daemon_key(LEASE_KEY)
    graceful_ok, graceful_default = daemon_key(GRACEFUL_KEY)
    flags: list[str] = []
    lease_s = graceful_s = None
    if lease_ok:
        lease_s = args.session_lease_s or lease_default
        if args.session_lease_s is not None:
            flags += ["--session-lease-s", str(args.session_lease_s)]
    if graceful_ok:
        # A quick storm keeps a SIGTERMed coordinator's drain short, so that the storm still
        # holds a restart after it.
        asked = args.graceful_timeout_s or (QUICK_GRACEFUL_S if args.quick else None)
        graceful_s = asked or graceful_default
        if asked is not None:
            flags += ["--graceful-timeout-s", str(asked)]
    leak_wait_s = lease_s + LEASE_MARGIN_S if lease_s is not None else args.leak_wait_s
    duration_s = args.duration_s or (100.0 if args.quick else 120.0)
    cfg = StormConfig(
        seed=args.seed,
        duration_s=duration_s,
        concurrency=args.concurrency,
        # A daemon is slow to start on a busy machine: a quick storm wastes less time around
        # each restart so that it still holds one SIGKILL and one SIGTERM (docs/benchmarks.md).
        gap_s=(2.0, 6.0) if args.quick else (4.0, 12.0),
        down_s=(1.0, 3.0) if args.quick else (1.0, 5.0),
        term_wait_s=(graceful_s or 0.0) + TERM_MARGIN_S,
        disruptions=args.disruptions,
    )
    return {
        "cfg": cfg,
        "flags": tuple(flags),
        "max_tokens": args.max_tokens or (24 if args.quick else 48),
        "session_lease_supported": lease_ok,
        "session_lease_s": lease_s,
        "graceful_timeout_supported": graceful_ok,
        "graceful_timeout_s": graceful_s,
        "leak_wait_s": leak_wait_s,
    }


async def _measure(
    mesh: ChaosMesh, jobs: list[ChaosJob], cfg: StormConfig, rounds: int, leak_wait_s: float
) -> dict[str, Any]:
    model = await model_name(mesh)
    refs = await reference(mesh, model, jobs, cfg, max(1, rounds))
    log = StormLog()
    await storm(mesh, model, jobs, cfg, log)
    settle_error = ""
    try:
        await in_thread(lambda: mesh.wait_settled(cfg.settle_timeout_s))
    except Exception as exc:  # DaemonError: reported, the leak check still runs
        settle_error = str(exc)
    snapshot, waited_s = await leak_check(mesh, leak_wait_s)
    greedy = next(j for j in jobs if j.greedy)
    after = await after_storm(mesh, model, greedy, cfg)
    report = build_report(jobs, refs, log, snapshot, after)
    report |= {
        "model": model,
        "leak_wait_limit_s": leak_wait_s,
        "leak_check_waited_s": waited_s,
        "settled_after_storm": not settle_error,
        "settle_error": settle_error,
    }
    if settle_error:
        report["failures"].append(f"the mesh did not settle after the storm: {settle_error}")
        report["ok"] = False
    return report


def build_report(
    jobs: list[ChaosJob],
    refs: list[list[Seen]],
    log: StormLog,
    snapshot: dict[str, dict[str, Any]],
    after: list[Seen],
) -> dict[str, Any]:
    """The report's figures from what the clients saw and what the storm did."""
    reference_text, ref_summary = _references(jobs, refs)
    outcomes = [classify(s, log.disruptions) for s in log.seen]
    recoveries = _recoveries(log, [k for k, _ in outcomes])
    report: dict[str, Any] = {
        "reference": ref_summary,
        **_request_figures(jobs, reference_text, log, outcomes),
        **_storm_figures(log, recoveries),
        **_after_storm_figures(snapshot, after),
        "disruption_log": [
            {
                "kind": d.kind,
                "node": d.node,
                "run": d.incarnation,
                "role": d.role_label,
                "coordinating": d.coordinating,
                "at_s": round(d.at - log.started_at, 3),
                "escalated": d.escalated_at is not None,
                "recovery_s": r,
            }
            for d, r in _with_recovery(log.disruptions, recoveries)
        ],
    }
    report["failures"] = _failures(report, len(snapshot))
    report["ok"] = not report["failures"]
    return report


def _request_figures(
    jobs: list[ChaosJob],
    reference_text: dict[int, str],
    log: StormLog,
    outcomes: list[tuple[str, str]],
) -> dict[str, Any]:
    """How the storm's requests ended, by kind, against their reference texts."""
    kinds = Counter(kind for kind, _ in outcomes)
    completed = [s for s, (k, _) in zip(log.seen, outcomes, strict=True) if k == COMPLETED]
    by_job = {j.index: j for j in jobs}
    identical = [s for s in completed if reference_text.get(s.job) == s.text]
    clear = {k: n for k, n in kinds.items() if k in (ERROR_EVENT, REFUSED, CONNECTION_LOST)}
    clear |= {k: n for k, n in kinds.items() if k.startswith("http_")}
    examples: dict[str, list[str]] = defaultdict(list)
    for s, (kind, sub) in zip(log.seen, outcomes, strict=True):
        if kind != COMPLETED and len(examples[kind]) < 3:
            examples[kind].append(f"{s.node}: {sub} {s.detail}"[:240])
    return {
        "requests_started": len(log.seen),
        "completed": len(completed),
        "completed_greedy": sum(1 for s in completed if by_job[s.job].greedy),
        "completed_sampled": sum(1 for s in completed if not by_job[s.job].greedy),
        "completed_identical": len(identical),
        "completed_identical_greedy": sum(1 for s in identical if by_job[s.job].greedy),
        "completed_identical_sampled": sum(1 for s in identical if not by_job[s.job].greedy),
        "completed_different": len(completed) - len(identical),
        "clear_errors": sum(clear.values()),
        "clear_errors_by_kind": clear,
        "truncated_silently": kinds[TRUNCATED],
        "truncated_silently_by_kind": dict(
            Counter(sub for kind, sub in outcomes if kind == TRUNCATED)
        ),
        "hung": kinds[HUNG],
        "bad_responses": kinds[BAD_RESPONSE],
        "examples": dict(examples),
        # Every request that must not happen, in full, to find it in the daemons' logs.
        "must_not_happen": [
            {
                "outcome": kind,
                "how": sub,
                "node": s.node,
                "run": s.incarnation,
                "started_s": round(s.started - log.started_at, 3),
                "ended_s": round(s.ended - log.started_at, 3),
                "tokens": len(s.token_times),
                "detail": s.detail,
            }
            for s, (kind, sub) in zip(log.seen, outcomes, strict=True)
            if kind in (TRUNCATED, HUNG, BAD_RESPONSE)
        ],
    }


def _storm_figures(
    log: StormLog, recoveries: list[tuple[Disruption, float | None]]
) -> dict[str, Any]:
    """What the storm did, and how fast the mesh recovered from it."""
    return {
        "storm_s": log.ended_at - log.started_at,
        "recovery_s": percentiles([r for _, r in recoveries if r is not None]),
        "recovery_by_kind_s": _recovery_by_kind(recoveries),
        "disruptions": _disruption_counts(log.disruptions),
        "coordinator_disruptions": sum(
            1 for d in log.disruptions if d.kind != "restart" and d.coordinating
        ),
        "sigterm_escalated": sum(1 for d in log.disruptions if d.escalated_at is not None),
        "skipped_unsettled": log.skipped_unsettled,
        "restart_failures": log.restart_failures,
        "restart_to_listening_s": percentiles(log.restart_s),
    }


def _after_storm_figures(snapshot: dict[str, dict[str, Any]], after: list[Seen]) -> dict[str, Any]:
    """What every node still holds after the storm, and how the requests after it ended."""
    return {
        "leaked_sessions": sum(f["sessions_hosted"] for f in snapshot.values()),
        "leaked_kv_bytes": sum(f["kv_used_bytes"] for f in snapshot.values()),
        "open_coordinated_sessions": sum(f["sessions_coordinated"] for f in snapshot.values()),
        "nodes_after": snapshot,
        "sessions_expired": _sessions_expired(snapshot),
        "after_storm_requests": len(after),
        "after_storm_completed": sum(1 for s in after if classify(s, ())[0] == COMPLETED),
    }


def _references(jobs: list[ChaosJob], refs: list[list[Seen]]) -> tuple[dict[int, str], Any]:
    """Each job's reference text (its first undisturbed run that completed) and a summary."""
    texts: dict[int, list[str | None]] = defaultdict(list)
    for round_ in refs:
        for s in round_:
            texts[s.job].append(s.text if classify(s, ())[0] == COMPLETED else None)
    reference_text = {
        job: next(t for t in runs if t is not None)
        for job, runs in texts.items()
        if any(t is not None for t in runs)
    }
    stable = sum(
        1 for runs in texts.values() if None not in runs and len(set(runs)) == 1 and len(runs) > 1
    )
    summary = {
        "jobs": len(jobs),
        "rounds": len(refs),
        "greedy_jobs": sum(1 for j in jobs if j.greedy),
        "failed_runs": sum(1 for runs in texts.values() for t in runs if t is None),
        "stable_jobs": stable,  # every undisturbed run gave the same text
    }
    return reference_text, summary


def _recoveries(log: StormLog, outcomes: list[str]) -> list[tuple[Disruption, float | None]]:
    return [(d, recovery_s(d, log.seen, outcomes)) for d in log.disruptions if d.kind != "restart"]


def _with_recovery(
    disruptions: list[Disruption], recoveries: list[tuple[Disruption, float | None]]
) -> list[tuple[Disruption, float | None]]:
    found = dict((id(d), r) for d, r in recoveries)
    return [(d, found.get(id(d))) for d in disruptions]


def _recovery_by_kind(recoveries: list[tuple[Disruption, float | None]]) -> dict[str, Any]:
    grouped: dict[str, list[float]] = defaultdict(list)
    for d, r in recoveries:
        if r is not None:
            grouped[f"{d.kind}/{d.role}"].append(r)
    return {k: percentiles(v) for k, v in sorted(grouped.items())}


def _disruption_counts(disruptions: list[Disruption]) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter[str]] = {k: Counter() for k in ("sigkill", "sigterm", "restart")}
    for d in disruptions:
        counts[d.kind][d.role_label if d.kind != "restart" else d.role] += 1
    return {k: dict(v) for k, v in counts.items()}


def _sessions_expired(snapshot: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    expired = {n: f["sessions_expired"] for n, f in snapshot.items() if "sessions_expired" in f}
    return expired or None


def _failures(report: dict[str, Any], nodes_answering: int) -> list[str]:
    failures = []
    checks = [
        ("truncated_silently", "streams truncated silently"),
        ("hung", "requests hung"),
        ("bad_responses", "unreadable responses"),
        ("leaked_sessions", "sessions still hosted after the storm"),
        ("leaked_kv_bytes", "KV bytes still in use after the storm"),
        ("open_coordinated_sessions", "sessions still coordinated after the storm"),
    ]
    for key, what in checks:
        if report[key]:
            failures.append(f"{report[key]} {what}")
    if report["after_storm_completed"] < report["after_storm_requests"]:
        failures.append(
            f"only {report['after_storm_completed']} of {report['after_storm_requests']} "
            "requests after the storm completed"
        )
    if report["restart_failures"]:
        failures.append(f"{len(report['restart_failures'])} restarts failed")
    if report["reference"]["failed_runs"]:
        failures.append(f"{report['reference']['failed_runs']} undisturbed reference runs failed")
    return failures


# -- the table ---------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    """The report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    lease = f"{r['session_lease_s']} s" if r["session_lease_supported"] else "not supported"
    console.print(
        f"chaos: {r['nodes']} daemons ({r['stages']} stages), {r['concurrency']} streams, "
        f"seed {r['seed']}, storm {r['storm_s']:.0f} s, model {r['model']}, "
        f"{r['max_tokens']} tokens per request; session lease {lease}"
    )
    ref = r["reference"]
    console.print(
        f"reference: {ref['jobs']} jobs x {ref['rounds']} undisturbed rounds, "
        f"{ref['stable_jobs']} gave the same text every round, {ref['failed_runs']} failed"
    )
    requests = Table(title="requests")
    requests.add_column("outcome")
    requests.add_column("count", justify="right")
    rows = [
        ("started", r["requests_started"]),
        ("completed", r["completed"]),
        ("  identical to the undisturbed run", r["completed_identical"]),
        (
            "  identical: greedy / sampled",
            f"{r['completed_identical_greedy']}/{r['completed_greedy']} greedy, "
            f"{r['completed_identical_sampled']}/{r['completed_sampled']} sampled",
        ),
        ("clear errors", r["clear_errors"]),
        *((f"  {k}", v) for k, v in sorted(r["clear_errors_by_kind"].items())),
        ("truncated silently (must be 0)", r["truncated_silently"]),
        *((f"  {k}", v) for k, v in sorted(r["truncated_silently_by_kind"].items())),
        ("hung (must be 0)", r["hung"]),
        ("unreadable responses", r["bad_responses"]),
    ]
    for name, value in rows:
        requests.add_row(name, str(value))
    console.print(requests)
    storm_table = Table(title="disruptions and recovery")
    for column in ("kind", "by role", "recovery p50 / p99 / max s"):
        storm_table.add_column(column)
    for kind, by_role in r["disruptions"].items():
        recs = [v for k, v in r["recovery_by_kind_s"].items() if k.startswith(kind + "/")]
        text = "; ".join(f"{_s(v['p50'])} / {_s(v['p99'])} / {_s(v['max'])}" for v in recs)
        roles = ", ".join(f"{k} {v}" for k, v in sorted(by_role.items())) or "-"
        storm_table.add_row(kind, roles, text or "-")
    rec = r["recovery_s"]
    storm_table.add_row("all", "", f"{_s(rec['p50'])} / {_s(rec['p99'])} / {_s(rec['max'])}")
    console.print(storm_table)
    leaks = Table(title=f"after the storm ({r['leak_check_waited_s']:.0f} s of at most "
                  f"{r['leak_wait_limit_s']:.0f} s)")  # fmt: skip
    for column in ("node", "sessions hosted", "KV bytes", "coordinated", "expired"):
        leaks.add_column(column)
    for node, f in sorted(r["nodes_after"].items()):
        leaks.add_row(
            node,
            str(f["sessions_hosted"]),
            str(f["kv_used_bytes"]),
            str(f["sessions_coordinated"]),
            json.dumps(f.get("sessions_expired", "-")),
        )
    console.print(leaks)
    console.print(
        f"requests after the storm: {r['after_storm_completed']} of "
        f"{r['after_storm_requests']} completed"
    )
    verdict = "[green]ok[/]" if r["ok"] else "[red]FAILED[/]: " + "; ".join(r["failures"])
    console.print(f"result: {verdict}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
