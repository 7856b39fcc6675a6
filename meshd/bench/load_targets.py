"""What `meshd bench load` fires at: real daemons on loopback, or an in-process pipeline.

Each target gives the API base URLs to spread the load over and an idle snapshot for the leak
check. For daemons the snapshot is what an operator sees: `meshctl status` over the control
socket (sessions hosted on the node's stage, sessions it coordinates), the API's in-flight
gauge from `/metrics` (the scrape itself counts as one), and the process's resident memory.
In process, the stage hosts' KV bytes and open sessions are read directly.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from meshd.api.backend import LocalPipelineBackend, open_local_backend
from meshd.cli.supervisor import (
    DaemonError,
    LoopbackDaemon,
    agreed_plan,
    found_each_other,
    fresh_secret_file,
    stage_budget,
    started,
    stop_all,
    wait_until,
)

# A plan counts as settled once every node reports it, loaded, unchanged this long.
PLAN_STABLE_S = 0.5
START_TIMEOUT_S = 120.0
PLAN_TIMEOUT_S = 60.0

# An idle snapshot: node (or stage) name -> figure name -> value.
Snapshot = dict[str, dict[str, int]]


class DaemonMesh:
    """`stages` real `meshd serve` daemons holding one `stages`-way split; `stop()` is idempotent."""

    def __init__(
        self,
        model_dir: str,
        model: str | None,
        stages: int,
        first_host: int,
        quantization: str = "none",
    ) -> None:
        self.model_dir = model_dir
        self.quantization = quantization
        self.model = model
        self.stages = stages
        self.first_host = first_host
        self.work = Path(tempfile.mkdtemp(prefix="meshd-load-"))
        self.daemons: list[LoopbackDaemon] = []
        self.plan: list[dict[str, Any]] = []

    def start(self) -> None:
        """Spawn the daemons and wait until they agree on a loaded plan (DaemonError if not)."""
        secret = fresh_secret_file(self.work)
        budget = stage_budget(self.model_dir, self.stages, self.quantization)
        for i in range(self.stages):
            host = f"127.0.0.{self.first_host + i}"
            self.daemons.append(
                LoopbackDaemon(
                    self.work,
                    f"n{i + 1}",
                    host,
                    secret,
                    budget,
                    self.model,
                    extra=("--quantization", self.quantization),
                )
            )
        started(self.daemons, START_TIMEOUT_S)
        wait_until(
            lambda: found_each_other(self.daemons),
            PLAN_TIMEOUT_S,
            "the daemons to find each other",
        )
        self.plan = agreed_plan(self.daemons, PLAN_TIMEOUT_S, PLAN_STABLE_S)
        if len(self.plan) != self.stages:
            raise DaemonError(f"the mesh planned {len(self.plan)} stages, not {self.stages}")

    @property
    def urls(self) -> list[str]:
        """Every daemon's API base URL (ending in /v1)."""
        return [d.api_url for d in self.daemons]

    def describe(self) -> list[dict[str, Any]]:
        """Each node's name, pid, API and layers, for the report."""
        layers = {stage["key"]: stage["layers"] for stage in self.plan}
        return [
            {"node": d.name, "pid": d.proc.pid, "api": d.api_url, "layers": layers.get(d.key())}
            for d in self.daemons
        ]

    def snapshot(self) -> Snapshot:
        """Each node's open sessions, KV bytes, in-flight requests and memory (blocking)."""
        snap: Snapshot = {}
        for d in self.daemons:
            status = d.status()
            if status is None:
                raise DaemonError(f"{d.name} stopped answering on its control socket")
            snap[d.name] = {
                "sessions_hosted": int(status["sessions_hosted"]),
                "kv_used_bytes": int(status["kv_used_bytes"]),
                "sessions_coordinated": int(status["sessions_coordinated"]),
                "api_in_flight": _in_flight(d.api_url),
                "rss_bytes": _rss_bytes(d.proc.pid),
            }
        return snap

    def logs(self, chars: int) -> str:
        """The tail of each daemon's log."""
        return "\n".join(f"--- {d.name} ---\n{d.log_tail(chars)}" for d in self.daemons)

    def stop(self) -> None:
        """SIGTERM every daemon, SIGKILL stragglers, remove the temp dir."""
        daemons, self.daemons = self.daemons, []
        stop_all(daemons)
        shutil.rmtree(self.work, ignore_errors=True)


def _in_flight(api_url: str) -> int:
    text = httpx.get(api_url.removesuffix("/v1") + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("meshd_api_requests_in_flight "):
            return round(float(line.split()[1]))
    raise DaemonError("/metrics has no meshd_api_requests_in_flight")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class LocalTarget:
    """An in-process pipeline behind a real HTTP API."""

    urls: list[str]
    snapshot: Callable[[], Awaitable[Snapshot]]
    backend: LocalPipelineBackend


@contextlib.asynccontextmanager
async def local_target(
    model_dir: str | None, stages: int, max_concurrent_requests: int, quantization: str = "none"
) -> AsyncIterator[LocalTarget]:
    """Start a local pipeline of `stages` and its API on loopback.

    The backend answers 429 past `max_concurrent_requests` generations in flight.
    """
    from meshd.api.openai import create_app
    from meshd.api.server import serve_api

    async with (
        open_local_backend(
            model_dir,
            stages,
            max_concurrent_requests=max_concurrent_requests,
            quantization=quantization,
        ) as backend,
        trio.open_nursery() as nursery,
    ):
        address = await nursery.start(serve_api, create_app(backend))

        async def snapshot() -> Snapshot:
            snap: Snapshot = {"api": {"in_flight": backend.in_flight}}
            for i, host in enumerate(backend.pipeline.hosts):
                snap[f"stage{i}"] = {
                    "sessions_open": host.stats.sessions_open,
                    "kv_used_bytes": host.stage.kv.used_bytes,
                }
            return snap

        yield LocalTarget([address.base_url], snapshot, backend)
        nursery.cancel_scope.cancel()
