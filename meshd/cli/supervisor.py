"""The daemon supervisor: `meshd serve` child processes for the demo, the benchmarks and the
multi-process tests.

`ServeProcess` spawns one daemon (its own state dir and log under a work dir, a mesh secret
file, CPU float32), reads the address it bound, its status and events, and stops it;
`LoopbackDaemon` is one on its own loopback address with mDNS there and port 0 for lanes and
API (the daemon prints what it bound). The functions below start, wait for and stop a group:
every daemon listening, every one seeing the others alive, one plan they agree on and have
loaded, SIGTERM or SIGKILL for all. Children die with the parent process (PR_SET_PDEATHSIG on
Linux), so a killed demo, bench or test run leaves no daemons behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from meshd.cli.serve import EXIT_STARTUP_ERROR
from meshd.model.files import open_checkpoint
from meshd.node.control_client import ControlError, StatusOp, call

# Headroom over the smallest per-node budget that fits the wanted number of stages.
BUDGET_HEADROOM = 1.10
# Linux prctl option: signal the child when its parent thread exits.
_PR_SET_PDEATHSIG = 1


class DaemonError(Exception):
    """A daemon or a group of them did not do what was waited for (the message says what)."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the supervising process dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def write_secret_file(path: Path, secret: str) -> Path:
    """Write a mesh secret where only this user can read it (the daemon refuses otherwise)."""
    path.touch(mode=0o600)
    path.write_text(secret)
    return path


def fresh_secret_file(work: Path) -> Path:
    """`work/mesh.secret` holding a fresh random mesh secret."""
    return write_secret_file(work / "mesh.secret", secrets.token_urlsafe(32))


class ServeProcess:
    """One `meshd serve` child process with its state dir and log under `work`.

    `flags` are the serve flags beyond the state dir, the secret file and the CPU float32
    compute on one thread every demo and test daemon uses; `prefix` runs the command inside
    something (e.g. `ip netns exec NS`).
    """

    def __init__(
        self,
        work: Path,
        name: str,
        secret_file: Path,
        flags: Sequence[str],
        *,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.state = work / name
        self.socket = str(self.state / "control.sock")
        self.log_path = work / f"{name}.log"
        self.lane_address = ""
        self.api_url = ""
        self.killed_at = 0.0
        self._key = ""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        args = [
            *prefix, sys.executable, "-m", "meshd.cli.main", "serve",
            "--state-dir", str(self.state),
            "--mesh-secret-file", str(secret_file),
            "--device", "cpu", "--dtype", "float32",
            # Several daemons share one machine here: one thread each keeps them from
            # oversubscribing its cores (a daemon alone uses them all: `threads` = 0).
            "--threads", "1",
            *flags,
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_die_with_parent,
            )

    def wait_listening(self, deadline: float) -> float:
        """Block until the daemon prints its `listening on` line; returns when (monotonic).

        Raises DaemonError at the deadline or when the daemon exits first.
        """
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if not ready:
                continue
            line = self.proc.stdout.readline().decode()
            if "listening on" in line:
                self.lane_address = line.rsplit(" ", 1)[1].strip()
                self.api_url = line.split(" api ", 1)[1].split(" ", 1)[0]
                return time.monotonic()
            if not line:  # stdout closed: the daemon is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                break
        status = self.proc.poll()
        if status == EXIT_STARTUP_ERROR:  # the daemon's own one line says what to fix
            raise DaemonError(f"{self.name} did not start: {self.last_log_line()}")
        raise DaemonError(f"{self.name} did not start (exit status {status}; log {self.log_path})")

    def last_log_line(self) -> str:
        """The daemon's last log line (after a start-up error: its one-line message)."""
        lines = self.log_tail(2000).strip().splitlines()
        return lines[-1] if lines else "(empty log)"

    def status(self) -> dict[str, Any]:
        """The daemon's status over its control socket (DaemonError while it does not answer)."""
        status = self.try_status()
        if status is None:
            raise DaemonError(f"{self.name} does not answer on {self.socket}")
        return status

    def try_status(self) -> dict[str, Any] | None:
        """The daemon's status, or None while it does not answer."""
        try:
            return dict(call(self.socket, StatusOp(), timeout_s=10)["status"])
        except (OSError, ControlError):
            return None

    def key(self) -> str:
        """The node key in hex (asked once, so it is known after the daemon dies)."""
        if not self._key:
            self._key = str(self.status()["key"])
        return self._key

    def alive_members(self) -> set[str]:
        """Keys of the members this daemon sees alive."""
        status = self.try_status()
        if status is None:
            return set()
        return {m["key"] for m in status["members"] if m["status"] == "alive"}

    def member(self, key: str) -> dict[str, Any]:
        """This daemon's status row for the member `key`."""
        return next(m for m in self.status()["members"] if m["key"] == key)

    def recoveries(self) -> int:
        """How many requests this node re-routed after losing a stage."""
        status = self.try_status()
        return int(status["recoveries"]) if status else 0

    def first_event(self, kind: str, node_key: str, after_unix_s: float) -> float | None:
        """When (unix s) this node first logged `kind` about `node_key` since a moment."""
        status = self.try_status() or {"events": []}
        for event in status["events"]:
            mine = event["kind"] == kind and node_key.startswith(event["node"])
            if mine and event["at_unix_s"] >= after_unix_s:
                return float(event["at_unix_s"])
        return None

    def kill(self) -> None:
        """SIGKILL, as a crash would (not reaped here: wait_stopped() does that)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.killed_at = time.time()

    def terminate(self) -> None:
        """Ask the daemon to stop (SIGTERM: it shuts down its API, lanes and stage)."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait_stopped(self, deadline: float) -> str:
        """Reap the process, SIGKILLing it past the deadline; says how it ended."""
        try:
            code = self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            how = "stopped" if code == 0 else f"exited with status {code}"
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            how = "did not stop in time: SIGKILLed"
        if self.killed_at:
            how = "had been SIGKILLed"
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return f"{how} (pid {self.proc.pid})"

    def log_tail(self, chars: int) -> str:
        """The end of the daemon's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class LoopbackDaemon(ServeProcess):
    """A daemon on its own loopback address: lanes, API and mDNS there, any free ports."""

    def __init__(
        self,
        work: Path,
        name: str,
        host: str,
        secret_file: Path,
        budget: int,
        model: str | None,
        *,
        extra: Sequence[str] = (),
    ) -> None:
        self.host = host
        flags = [
            "--listen-host", host, "--listen-port", "0",  # a later --listen-port in extra wins
            "--mdns-interfaces", host,
            "--api-host", host, "--api-port", "0",
            "--memory-budget-bytes", str(budget),
            *(("--model", model) if model else ()),
            *extra,
        ]  # fmt: skip
        super().__init__(work, name, secret_file, flags)


def settled_plan(daemons: Sequence[ServeProcess]) -> list[dict[str, Any]] | None:
    """The plan every daemon agrees on, once each has loaded its own stage of it."""
    statuses = [d.try_status() for d in daemons]
    if any(s is None or not s["plan"] for s in statuses):
        return None
    plans = [s["plan"] for s in statuses if s is not None]
    if any(p != plans[0] for p in plans):
        return None
    by_key = {stage["key"]: stage["layers"] for stage in plans[0]}
    for s in statuses:
        if s is not None and s["stage_layers"] != by_key.get(s["key"]):
            return None
    return list(plans[0])


def found_each_other(daemons: Sequence[ServeProcess]) -> bool:
    """Whether every daemon sees every one of them alive (a daemon that does not answer: no)."""
    keys = {d.key() for d in daemons}
    return all(d.alive_members() == keys for d in daemons)


def wait_stable(
    read: Callable[[], list[dict[str, Any]] | None], timeout_s: float, stable_s: float, what: str
) -> list[dict[str, Any]]:
    """Poll `read` every `stable_s` until two reads in a row return the same value (not None),
    so it held that long; returns it (DaemonError after `timeout_s`)."""
    seen: list[list[dict[str, Any]] | None] = [None]

    def stable() -> bool:
        before, seen[0] = seen[0], read()
        return seen[0] is not None and seen[0] == before

    wait_until(stable, timeout_s, what, poll_s=stable_s)
    return seen[0] or []


def agreed_plan(
    daemons: Sequence[ServeProcess], timeout_s: float, stable_s: float
) -> list[dict[str, Any]]:
    """The plan these daemons agree on and have loaded, unchanged for `stable_s`."""
    return wait_stable(lambda: settled_plan(daemons), timeout_s, stable_s, "a settled plan")


def started(daemons: Iterable[ServeProcess], timeout_s: float = 60.0) -> float:
    """Wait until every daemon listens; returns when the last one did (time.monotonic)."""
    deadline = time.monotonic() + timeout_s
    return max(d.wait_listening(deadline) for d in daemons)


def stop_all(daemons: Iterable[ServeProcess], timeout_s: float = 10.0) -> list[str]:
    """SIGTERM every daemon, reap them, SIGKILL those still running after `timeout_s`; says
    how each one ended, in order."""
    daemons = list(daemons)
    for d in daemons:
        d.terminate()
    deadline = time.monotonic() + timeout_s
    return [d.wait_stopped(deadline) for d in daemons]


def kill_all(daemons: Iterable[ServeProcess]) -> None:
    """SIGKILL and reap every daemon (a test's finally: nothing to drain)."""
    daemons = list(daemons)
    for d in daemons:
        d.kill()
    deadline = time.monotonic() + 10
    for d in daemons:
        d.wait_stopped(deadline)


# Set by the demo's SIGINT handler. Python drops a KeyboardInterrupt raised while a destructor
# or weakref callback runs ("Exception ignored in ..."), so the demo also checks this latch
# wherever it waits or reports: one Ctrl-C always stops it.
INTERRUPTED = threading.Event()


def latch_interrupt(signum: int, frame: object) -> None:
    """SIGINT handler: remember the interrupt, then raise it as Python would."""
    INTERRUPTED.set()
    raise KeyboardInterrupt


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came and was swallowed on the way."""
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, *, poll_s: float = 0.1
) -> float:
    """Poll until true; returns the seconds it took (DaemonError on timeout)."""
    start = time.monotonic()
    while not predicate():
        check_interrupted()
        if time.monotonic() - start > timeout_s:
            raise DaemonError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def stage_budget(model_dir: str, stages: int, quantization: str = "auto") -> int:
    """A per-node memory budget where `stages` nodes hold the model and one fewer cannot, at
    `quantization` ("auto": the checkpoint's own, as `meshd serve` loads it)."""
    import torch

    from meshd.node.planning import model_shape
    from meshd.plan import NodeCapacity, NoFeasiblePlan, plan

    checkpoint = open_checkpoint(model_dir)
    if quantization == "auto":
        quantization = checkpoint.default_quantization
    shape = model_shape(checkpoint, torch.float32, quantization)
    context = checkpoint.config.max_position_embeddings

    def planned(budget: int, n: int) -> int:
        nodes = [NodeCapacity(bytes([i + 1]) * 32, budget, 1e-5) for i in range(n)]
        try:
            return len(plan(shape, nodes, {}, nodes[0].key, context_tokens=context).stages)
        except NoFeasiblePlan:
            return 0

    lo, hi = 1, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if planned(mid, stages) else (mid + 1, hi)
    budget = int(lo * BUDGET_HEADROOM)
    if planned(budget, stages) != stages or (stages > 1 and planned(budget, stages - 1)):
        raise DaemonError(f"no memory budget forces exactly {stages} stages on this model")
    return budget
