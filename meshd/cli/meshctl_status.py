"""`meshctl status [--json]`: members, lanes, the plan and its stages, sessions, events."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from meshd.cli.meshctl_common import add_socket_argument, run_op

if TYPE_CHECKING:
    from rich.table import Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshctl status`."""
    add_socket_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    parser.add_argument("--events", type=int, default=10, help="recent events to show")


def run(args: argparse.Namespace) -> int:
    """Print the daemon's status."""
    from meshd.node.control_client import StatusOp

    def show(reply: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(reply["status"], indent=2))
        else:
            render(reply["status"], args.events)

    return run_op(args, StatusOp(), show)


def render(status: dict[str, Any], events: int) -> None:
    """A readable status with rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    layers = status["stage_layers"]
    console.print(
        f"node [bold]{status['name']}[/] ({status['key'][:16]})  model {status['model_id'][:16]}"
        f" {status['quantization']}  stage {_layers(layers)}  {_state(status)}"
    )
    console.print(
        f"holds weights {_mib(status['weight_bytes'])} + KV {status['kv_bytes_per_token']} "
        f"B/token (KV {status['kv_dtype']}), {status['threads']} thread(s)"
    )
    console.print(
        f"sessions hosted {status['sessions_hosted']} "
        f"(KV {status.get('kv_used_bytes', 0) / 2**20:.1f} of "
        f"{status.get('kv_budget_bytes', 0) / 2**20:.1f} MiB), coordinated "
        f"{status['sessions_coordinated']}, recoveries {status['recoveries']}, up "
        f"{status['uptime_s']:.0f} s, {status.get('tasks', 0)} trio tasks"
    )
    draft = status.get("draft")
    if draft:  # the coordinators' draft model: a session per request drafting with it
        console.print(
            f"draft {draft['model']}: weights {_mib(draft['weight_bytes'])}, sessions "
            f"{draft['sessions']} (KV {draft['kv_used_bytes'] / 2**20:.1f} MiB), prompt cache "
            f"{draft.get('prefix_cache_bytes', 0) / 2**20:.1f} MiB"
        )
    fetch = status.get("fetch")
    if fetch:  # a `mesh:ID` node's last fetch: its stage's tensors, or a spare's prefetch
        eta = fetch["eta_s"]
        console.print(
            f"fetch {fetch['what']}: {fetch['state']} {fetch['done_bytes'] / 1e6:.1f}/"
            f"{fetch['total_bytes'] / 1e6:.1f} MB, {fetch['rate_bytes_s'] / 1e6:.1f} MB/s, ETA "
            + (f"{eta:.0f} s" if eta is not None and fetch["state"] == "fetching" else "-")
            + (f"  [red]{fetch['error']}[/]" if fetch["error"] else "")
            + (f"  [yellow]waiting: {fetch['waiting']}[/]" if fetch.get("waiting") else "")
        )
    console.print(_counts("dropped datagrams", status.get("datagrams_dropped")))
    console.print(_counts("refused handshakes", status.get("handshakes_refused")))
    if isinstance(status.get("sessions_expired"), dict):  # sessions a lease ended, by cause
        console.print(_counts("expired sessions", status["sessions_expired"]))
    prefix = status.get("prefix_cache")
    if isinstance(prefix, dict):
        console.print(_prefix_line(prefix))
    console.print(_members_table(status["members"]))
    if status["plan"]:
        plan = Table(
            title=f"plan (~{status['predicted_ms_per_token']:.2f} ms/token), quantization "
            f"{status['plan_quantization']}"
        )
        for column in ("stage", "node key", "layers", "weights", "weights + KV"):
            plan.add_column(column)
        for i, stage in enumerate(status["plan"]):
            plan.add_row(
                str(i),
                stage["key"][:16],
                _layers(stage["layers"]),
                _mib(stage["weight_bytes"]),
                _mib(stage["memory_bytes"]),
            )
        console.print(plan)
    else:
        console.print(f"[red]no plan:[/] {status['plan_error']}")
    if len(status.get("models") or []) > 1:  # a mesh serving several models
        _models(console, status["models"])
    for event in status["events"][-events:]:
        stamp = time.strftime("%H:%M:%S", time.localtime(event["at_unix_s"]))
        console.print(f"{stamp} {event['kind']:<16} {event['node']} {event['detail']}")


def _members_table(rows: list[dict[str, Any]]) -> Table:
    """The members table: one row per node the membership knows, this node marked (self)."""
    from rich import box
    from rich.table import Table

    members = Table(
        title="members", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True
    )
    # The node id and key prefix are what an operator reads and types (`meshctl kill NODE`):
    # whole, never cut. On a narrow console the other columns wrap or fold instead (a lane's
    # packet counts grow with uptime and once pushed the key into an ellipsis).
    members.add_column("node", min_width=16)
    members.add_column("key", min_width=16, no_wrap=True)
    columns = ("health", "address", "offers", "stage", "weights", "KV/token", "lane", "rtt ms")
    for column in (*columns, "loss"):
        members.add_column(column, overflow="fold")
    for m in rows:
        loss = f"{m['packets_lost']}/{m['packets_sent']}" if m["lane_up"] else "-"
        held = m["loaded_layers"] is not None
        members.add_row(
            m["name"] + (" (self)" if m["is_self"] else ""),
            m["key"][:16],
            m["status"],
            m["address"] or "-",
            m["quantization"] if m["offers_model"] else "[red]no[/]",
            _layers(m["loaded_layers"]),
            _mib(m["weight_bytes"]) if held else "-",
            f"{m['kv_bytes_per_token']} B" if held else "-",
            "up" if m["lane_up"] else "-",
            f"{m['rtt_ms']:.2f}" if m["rtt_ms"] is not None else "-",
            loss,
        )
    return members


def _models(console: Any, models: list[dict[str, Any]]) -> None:
    """One table per model: its plan's stages (models held elsewhere: as their nodes report)."""
    from rich.table import Table

    for m in models:
        where = "held here" if m["held"] else "held elsewhere"
        speed = m["predicted_ms_per_token"]
        # A line of its own, not the table's title: rich wraps titles to the table's width.
        console.print(
            f"model {m['name']} ({m['model_id'][:16]}), {where}"
            + (f", ~{speed:.2f} ms/token" if speed is not None else "")
            + f", sessions hosted {m['sessions_hosted']}"
        )
        table = Table()
        for column in ("stage", "node key", "layers", "weights"):
            table.add_column(column)
        for i, stage in enumerate(m["plan"]):
            table.add_row(
                str(i), stage["key"][:16], _layers(stage["layers"]), _mib(stage["weight_bytes"])
            )
        if m["plan"]:
            console.print(table)
        else:
            console.print(f"[red]no plan:[/] {m['plan_error']}")


def _counts(title: str, counts: dict[str, int] | None) -> str:
    """`title: 3 (replayed 2, malformed 1)`: the total, then the reasons that are not 0."""
    if counts is None:  # a daemon from before these counters
        return f"{title}: -"
    nonzero = ", ".join(f"{reason} {n}" for reason, n in counts.items() if n)
    total = sum(counts.values())
    return f"{title}: {total}" + (f" ({nonzero})" if nonzero else "")


def _state(status: dict[str, Any]) -> str:
    if status.get("stopping"):
        return f"[yellow]STOPPING[/] ({status['sessions_coordinated']} requests in flight)"
    if status.get("draining"):
        return f"[yellow]DRAINING[/] ({status['sessions_hosted']} sessions left)"
    return "[red]KILLED[/]" if status["disabled"] else ""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _layers(layers: list[int] | None) -> str:
    return "-" if layers is None else f"[{layers[0]}, {layers[1]})"


def _prefix_line(p: dict[str, Any]) -> str:
    """The prefix cache in one line: what this node's requests reused, what its stage holds."""
    looked = p.get("prompt_tokens", 0)
    share = f" ({p.get('reused_tokens', 0) / looked:.0%} of prompt tokens)" if looked else ""
    return (
        f"prefix cache: {p.get('hits', 0)}/{p.get('lookups', 0)} requests hit, "
        f"{p.get('reused_tokens', 0)} tokens reused{share}, {p.get('misses', 0)} misses; "
        f"stage holds {p.get('entries', 0)} entries ({_mib(p.get('bytes_held', 0))}), "
        f"{p.get('evictions', 0)} evicted, {p.get('dropped', 0)} dropped"
    )
