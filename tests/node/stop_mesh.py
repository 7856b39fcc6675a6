"""The mesh the stop and kill tests share (test_stop.py, test_gguf_kills.py): stage daemons, a
spare, and a coordinator that can hold no stage (a 1-byte budget), every one on its own
loopback address with the module's secret, flags and budget.

Each test first restarts what an earlier one stopped that it needs (`StopMesh.ready`), so the
tests pass alone and in any order. `Stream` runs a generation over the control socket in a
thread, `SseStream` a streamed completion over the OpenAI API; `no_sessions_left`,
`left_only_identity` and `wait_threads_back` are what every stop checks afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import signal
import threading
import time
from typing import Any

import httpx

from meshd.cli.supervisor import DaemonError, started, wait_until
from meshd.node.control_client import ControlError, GenerateOp, request_lines
from tests.node.daemons import Daemon, stable_plan


class StopMesh:
    """Daemons numbered `stage_nodes`, `spare` and `coordinator_only`, each started with
    `extra` and the stage budget `budget` (the coordinator-only node: 1 byte, and
    `coordinator_extra` besides)."""

    def __init__(
        self,
        tmp: pathlib.Path,
        *,
        secret: str,
        budget: int,
        extra: tuple[str, ...],
        stage_nodes: tuple[int, ...],
        spare: int,
        coordinator_only: int,
        coordinator_extra: tuple[str, ...] = (),
    ) -> None:
        self.tmp = tmp
        self.secret = secret
        self.budget = budget
        self.extra = extra
        self.stage_nodes = stage_nodes
        self.spare_index = spare
        self.coordinator_only = coordinator_only
        self.coordinator_extra = coordinator_extra
        self.daemons: dict[int, Daemon] = {}
        self.gone: set[int] = set()

    def start(self, index: int) -> Daemon:
        if index == self.coordinator_only:
            budget, extra = 1, (*self.extra, *self.coordinator_extra)
        else:
            budget, extra = self.budget, self.extra
        d = Daemon(self.tmp, index, secret=self.secret, budget=budget, extra=extra)
        self.daemons[index] = d
        self.gone.discard(index)
        return d

    def alive(self) -> list[Daemon]:
        return [d for i, d in self.daemons.items() if i not in self.gone]

    def capable(self) -> list[Daemon]:
        """The live daemons that can hold a stage."""
        return [d for d in self.alive() if d.index != self.coordinator_only]

    def ready(self, spares: int) -> None:
        """The coordinator-only node, a node per stage and `spares` more alive, restarting
        (same state dir, same key) the ones an earlier test stopped."""
        new = []
        if self.coordinator_only in self.gone:
            new.append(self.start(self.coordinator_only))
        for index in (*self.stage_nodes, self.spare_index):
            if len(self.capable()) >= len(self.stage_nodes) + spares:
                break
            if index in self.gone:
                new.append(self.start(index))
        if new:
            started(new)
        nodes = self.alive()
        keys = {d.key() for d in nodes}
        wait_until(lambda: all(d.alive_members() == keys for d in nodes), 30, "every member")

    def in_plan(self) -> list[Daemon]:
        """Daemons serving the stages of the settled plan, in route order."""
        stable = stable_plan(self.capable())
        by_key = {d.key(): d for d in self.alive()}
        return [by_key[s["key"]] for s in stable]

    def spare(self) -> Daemon:
        """A capable daemon the plan leaves out."""
        route = self.in_plan()
        return next(d for d in self.capable() if d not in route)


def op(prompt: list[int], max_tokens: int, strategy: str = "disabled") -> GenerateOp:
    """Greedy decoding of exactly `max_tokens` tokens, drafted with `strategy` (plain: none)."""
    return GenerateOp(prompt=prompt, max_tokens=max_tokens, strategy=strategy, ignore_eos=True)


class Stream:
    """A generation over the control socket in a thread, each line stamped on arrival."""

    def __init__(self, d: Daemon, op: GenerateOp) -> None:
        self.lines: list[tuple[float, dict[str, Any]]] = []
        self.error: Exception | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(d, op), daemon=True)
        self.thread.start()

    def _run(self, d: Daemon, op: GenerateOp) -> None:
        try:
            for line in request_lines(d.socket, op, timeout_s=60):
                self.lines.append((time.monotonic(), line))
                self.first.set()
        except (OSError, ControlError) as exc:
            self.error = exc
        self.first.set()

    def token_times(self) -> list[float]:
        return [t for t, line in list(self.lines) if line.get("tokens") and "ok" not in line]

    def final(self) -> dict[str, Any]:
        self.thread.join(90)
        assert not self.thread.is_alive()
        assert self.lines, self.error
        return self.lines[-1][1]


def _sse(api: str, body: dict[str, Any], events: list[str], errors: list[Exception]) -> None:
    try:
        with httpx.stream("POST", f"{api}/completions", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
    except httpx.HTTPError as exc:
        errors.append(exc)


class SseStream:
    """A streamed completion through the OpenAI endpoint in a thread (as `Stream` is over the
    control socket): its SSE `data:` payloads and any error. Returns once the first chunks
    are in."""

    def __init__(self, coordinator: Daemon, body: dict[str, Any]) -> None:
        self.events: list[str] = []
        self.errors: list[Exception] = []
        self.thread = threading.Thread(
            target=_sse, args=(coordinator.api_url, body, self.events, self.errors), daemon=True
        )
        self.thread.start()
        wait_until(lambda: len(self.events) >= 10, 60, "the stream's first chunks", poll_s=0.02)


def completion_body(
    coordinator: Daemon, prompt: list[int], max_tokens: int, strategy: str
) -> dict[str, Any]:
    """A greedy completion request of exactly `max_tokens` tokens, drafted with `strategy`."""
    model = httpx.get(f"{coordinator.api_url}/models", timeout=30).json()["data"][0]["id"]
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "meshd": {"speculative": {"strategy": strategy}, "ignore_eos": True},
    }  # fmt: skip


def complete(coordinator: Daemon, prompt: list[int], max_tokens: int, strategy: str) -> str:
    """The text the API answers to `completion_body`'s request."""
    answer = httpx.post(
        f"{coordinator.api_url}/completions",
        json=completion_body(coordinator, prompt, max_tokens, strategy),
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def streamed_text(events: list[str]) -> str:
    """The text of a completion stream's chunks (`events` without `[DONE]`)."""
    return "".join(json.loads(e)["choices"][0]["text"] for e in events)


def threads_of(d: Daemon) -> collections.Counter[str]:
    """The daemon process's OS threads by name (torch's, trio's workers', any a draft started)."""
    names: collections.Counter[str] = collections.Counter()
    for task in pathlib.Path(f"/proc/{d.proc.pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            names[(task / "comm").read_text().strip()] += 1
    return names


def wait_threads_back(d: Daemon, before: collections.Counter[str]) -> None:
    """Wait until the daemon runs no more threads of any name than `before`."""
    grown: collections.Counter[str] = collections.Counter()

    def back() -> bool:
        grown.clear()
        grown.update(threads_of(d) - before)
        return not grown

    try:
        wait_until(back, 30, f"{d.name}'s threads back to their count from before")
    except DaemonError as exc:
        raise AssertionError(
            f"{exc}; threads left: {dict(grown)}, before: {dict(before)}"
        ) from None


def no_sessions_left(daemons: list[Daemon]) -> bool:
    """Every daemon answers and hosts no session and no session KV."""
    statuses = [d.try_status() for d in daemons]
    return all(
        s is not None and s["sessions_hosted"] == 0 and s["kv_used_bytes"] == 0 for s in statuses
    )


def left_only_identity(d: Daemon, how: signal.Signals) -> None:
    """What a stopped or killed daemon leaves in its state dir: its identity, the start-up
    caches (checkpoint hashes, the compute figure: docs/operations.md), and (after SIGKILL
    only) its control socket, which the next start replaces. No temp, part or lock file."""
    left = {p.name for p in d.state.iterdir()}
    socket = {"control.sock"} if how is signal.SIGKILL else set()
    assert left <= {"identity.key", "hashes", "compute", *socket}, left
    assert not [p for p in d.state.rglob("*") if p.name.endswith((".tmp", ".part"))], left
    assert "identity.key" in left
