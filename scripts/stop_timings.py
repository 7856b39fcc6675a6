"""Stops and crashes on real daemons: what a stream sees, and what the stages keep.

    python scripts/stop_timings.py                      # 3 rounds each way, 10 crashes
    python scripts/stop_timings.py --rounds 5 --crashes 20 --streams 4

Starts three stage daemons on loopback (memory budgets force three stages), a spare, and a
coordinator that can hold no stage (a 1-byte budget), all with `lane.dead_after_s = 1.2`,
`session_lease_s = 3` and `graceful_timeout_s = 2`. Then:

1. `--rounds` times each, alternating: a greedy 150-token generation through the coordinator;
   after its 10th token the route's middle stage gets SIGTERM (or SIGKILL). Records the time
   from the signal to the next token, the stall the signal caused (the longest gap between
   tokens beginning within graceful_timeout_s + 2 s of it) and the longest gap at all, checks
   the output against the undisturbed run and that no stage keeps a session; the stopped
   node is restarted and becomes the spare of the next round.
2. `--crashes` times: a fresh coordinator daemon opens `--streams` streams, is SIGKILLed
   once every stage holds them, and the stages must free every session and KV byte; records
   how long that took, and runs one request right after.

Prints one JSON object (medians, every sample, leaks). Timings on a shared machine are noisy:
compare the two signals within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from meshd.cli.supervisor import (
    LoopbackDaemon,
    found_each_other,
    settled_plan,
    stage_budget,
    wait_until,
    write_secret_file,
)
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import ControlError, GenerateOp, request_lines

FLAGS = (
    "--lane-dead-after-s", "1.2", "--session-lease-s", "3", "--graceful-timeout-s", "2",
)  # fmt: skip
PROMPT = "def fibonacci(n):\n"
GRACE_S = 2.0  # graceful_timeout_s in FLAGS


class Mesh:
    def __init__(self, work: Path) -> None:
        self.work = work
        secret = "stop-timings-" + secrets.token_hex(16)  # no other mesh on this machine joins
        self.secret = write_secret_file(work / "secret", secret)
        self.budget = stage_budget(str(builtin_model_dir()), 3)
        self.daemons: dict[int, LoopbackDaemon] = {}

    def start(self, index: int, budget: int | None = None) -> LoopbackDaemon:
        d = LoopbackDaemon(
            self.work, f"n{index}", f"127.0.0.{index}", self.secret,
            budget or self.budget, None, extra=FLAGS,
        )  # fmt: skip
        self.daemons[index] = d
        d.wait_listening(time.monotonic() + 90)
        return d

    def live(self) -> list[LoopbackDaemon]:
        return [d for d in self.daemons.values() if d.proc.poll() is None]

    def stages(self) -> list[LoopbackDaemon]:
        """The daemons of the settled plan, in route order, once it holds for a second."""
        candidates = [d for d in self.live() if d.name != "n60"]
        seen: list[Any] = []

        def stable() -> bool:
            seen.append(settled_plan(candidates))
            return len(seen) > 4 and seen[-1] is not None and all(p == seen[-1] for p in seen[-5:])

        wait_until(stable, 60, "a stable plan", poll_s=0.25)
        by_key = {d.key(): d for d in candidates}
        return [by_key[s["key"]] for s in seen[-1]]

    def members_settled(self) -> None:
        wait_until(lambda: found_each_other(self.live()), 60, "members")

    def no_sessions(self, daemons: list[LoopbackDaemon]) -> bool:
        statuses = [d.try_status() for d in daemons]
        return all(
            s is not None and s["sessions_hosted"] == 0 and s["kv_used_bytes"] == 0
            for s in statuses
        )


def _stream(d: LoopbackDaemon, op: GenerateOp, out: list[tuple[float, dict[str, Any]]]) -> None:
    try:
        for line in request_lines(d.socket, op, timeout_s=90):
            out.append((time.monotonic(), line))
    except (OSError, ControlError):
        pass


def stop_round(
    mesh: Mesh, prompt: list[int], expected: list[int], how: signal.Signals
) -> dict[str, Any]:
    route = mesh.stages()
    victim = route[1]
    coordinator = mesh.daemons[60]
    op = GenerateOp(prompt=prompt, max_tokens=len(expected), strategy="disabled", ignore_eos=True)
    lines: list[tuple[float, dict[str, Any]]] = []
    thread = threading.Thread(target=_stream, args=(coordinator, op, lines), daemon=True)
    thread.start()
    wait_until(lambda: sum(1 for _, ln in lines if ln.get("tokens")) >= 10, 60, "10 tokens",
               poll_s=0.01)  # fmt: skip
    at = time.monotonic()
    victim.proc.send_signal(how)
    thread.join(90)
    final = lines[-1][1]
    after = [t for t, ln in lines if ln.get("tokens") and "ok" not in ln and t > at]
    starts = [at, *after]
    gaps = [b - a for a, b in zip(starts, after, strict=False)]
    worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
    # The signal's own stall: a crash's recovery starts at once, a stop's hand-over when its
    # grace ends; gaps beginning later are the machine's noise (a long tail collects some).
    near = [g for g, a in zip(gaps, starts, strict=False) if a <= at + GRACE_S + 2]
    wait_until(lambda: victim.proc.poll() is not None, 30, "the victim to exit")
    others = [d for d in mesh.live() if d.name != "n60"]
    leak_free = True
    try:
        wait_until(lambda: mesh.no_sessions(others), 15, "no sessions")
    except Exception:
        leak_free = False
    index = int(victim.name[1:])
    victim.log_path.rename(victim.log_path.with_suffix(f".{how.name}.{time.time():.0f}.log"))
    mesh.start(index)  # back as the next round's spare
    mesh.members_settled()
    return {
        "signal": how.name,
        "identical": bool(final.get("ok")) and final.get("tokens") == expected,
        "to_next_token_s": after[0] - at if after else None,
        "stall_s": max(near) if near else None,
        "longest_stall_s": max(gaps) if gaps else None,
        # When that stall began, after the signal (a hand-over comes at graceful_timeout_s).
        "stall_began_s": starts[worst] - at if worst is not None else None,
        "exit_status": victim.proc.returncode,
        "no_session_left": leak_free,
    }


def crash_round(mesh: Mesh, prompt: list[int], streams: int) -> dict[str, Any]:
    coordinator = mesh.start(60, budget=1)
    mesh.members_settled()
    stages = mesh.stages()
    op = GenerateOp(prompt=prompt, max_tokens=400, strategy="disabled", ignore_eos=True)
    threads = [
        threading.Thread(target=_stream, args=(coordinator, op, []), daemon=True)
        for _ in range(streams)
    ]
    for t in threads:
        t.start()
    wait_until(
        lambda: all((d.try_status() or {}).get("sessions_hosted") == streams for d in stages),
        60, "every stream on every stage", poll_s=0.05,
    )  # fmt: skip
    at = time.monotonic()
    coordinator.kill()
    coordinator.wait_stopped(time.monotonic() + 10)
    try:
        wait_until(lambda: mesh.no_sessions(stages), 15, "freed")
        freed_s: float | None = time.monotonic() - at
    except Exception:
        freed_s = None
    statuses = [d.status() for d in stages]
    final = list(request_lines(stages[0].socket, GenerateOp(prompt=prompt, max_tokens=8)))[-1]
    return {
        "freed_after_kill_s": freed_s,
        "sessions_left": sum(s["sessions_hosted"] for s in statuses),
        "kv_bytes_left": sum(s["kv_used_bytes"] for s in statuses),
        "request_after_ok": bool(final.get("ok")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="stop rounds per signal")
    parser.add_argument("--crashes", type=int, default=10, help="coordinator SIGKILLs")
    parser.add_argument("--streams", type=int, default=4, help="streams open at each crash")
    parser.add_argument("--signals", default="SIGTERM,SIGKILL", help="stop rounds' signals")
    parser.add_argument("--keep-logs", metavar="DIR", help="work (and keep the logs) in DIR")
    args = parser.parse_args()
    signals = [signal.Signals[name] for name in args.signals.split(",") if name]
    import torch

    from meshd.bench.single_node import generate
    from meshd.model.checkpoint import Checkpoint
    from meshd.model.stage import StageModel

    torch.set_num_threads(1)
    tokenizer = Tokenizer.open(builtin_model_dir())
    prompt = tokenizer.encode(PROMPT)
    checkpoint = Checkpoint.open(builtin_model_dir())
    whole = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    expected = generate([whole], prompt, 150).tokens
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            tmp = args.keep_logs
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="meshd-stops-"))
        mesh = Mesh(Path(tmp))
        try:
            for i in (71, 72, 73):
                mesh.start(i)
            wait_until(lambda: settled_plan(mesh.live()) is not None, 60, "a plan")
            mesh.start(74)  # the spare
            mesh.start(60, budget=1)  # the coordinator of the stop rounds
            mesh.members_settled()
            stops = []
            for _ in range(args.rounds):
                for how in signals:
                    stops.append(stop_round(mesh, prompt, expected, how))
                    print(json.dumps(stops[-1]), flush=True)
            mesh.daemons[60].kill()
            mesh.daemons[60].wait_stopped(time.monotonic() + 10)
            crashes = []
            for _ in range(args.crashes):
                crashes.append(crash_round(mesh, prompt, args.streams))
                print(json.dumps(crashes[-1]), flush=True)
        finally:
            for d in mesh.daemons.values():
                d.kill()
            for d in mesh.daemons.values():
                d.wait_stopped(time.monotonic() + 10)

    def median(how: str, key: str) -> float | None:
        values = [s[key] for s in stops if s["signal"] == how and s[key] is not None]
        return statistics.median(values) if values else None

    report = {
        "stop_rounds": stops,
        "median_s": {
            how: {k: median(how, k) for k in ("to_next_token_s", "stall_s", "longest_stall_s")}
            for how in ("SIGTERM", "SIGKILL")
        },
        "all_identical": all(s["identical"] for s in stops),
        "crashes": len(crashes),
        "streams_per_crash": args.streams,
        "leaked_sessions": sum(c["sessions_left"] for c in crashes),
        "leaked_kv_bytes": sum(c["kv_bytes_left"] for c in crashes),
        "freed_s": sorted(c["freed_after_kill_s"] for c in crashes if c["freed_after_kill_s"]),
        "requests_after_ok": sum(c["request_after_ok"] for c in crashes),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
