"""The stage this node hosts: load a layer range from the local checkpoint, serve it, stop it.

Every node has a full local copy of the model, so it can host any range the plan gives it.
Loading runs in a worker thread (the trio loop keeps serving lanes and gossip meanwhile).
Stopping fails the sessions open here with a typed `StageError`, so their coordinators
re-plan at once instead of waiting for a reply that will never come. Sessions whose
coordinator is lost, or whose lease lapses, are freed by the host (`StageHost`); the slot
keeps the counts across the stages it hosts over the node's life.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import trio

from meshd.model.checkpoint import Checkpoint
from meshd.model.kvcache import KVCache
from meshd.model.stage import LoadProgress, StageModel
from meshd.net.bulk import BulkGate
from meshd.net.lane_table import LaneTable
from meshd.stage.host import EXPIRY_CAUSES, StageHost, StageHostConfig
from meshd.stage.leases import SESSION_LEASE_S
from protocol.messages import Message, OpenSession, StageError

log = logging.getLogger(__name__)

# Shows one stage load (e.g. a progress bar): called with what loads, it returns a context
# whose value receives `(done_bytes, total_bytes)` from the loading thread.
LoadDisplay = Callable[[str], contextlib.AbstractContextManager[LoadProgress | None]]


def measure_compute_ns(
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    passes: int,
    *,
    quantization: str = "none",
    kv_dtype: torch.dtype | None = None,
) -> int:
    """(blocking) Nanoseconds one decoder layer takes for one decode token on this node.

    Loads the first layer alone (at the quantization the node serves), runs a short prefill as
    warm-up, then times single-token passes and keeps the fastest (the least disturbed by other
    work on the machine).
    """
    stage = StageModel.load(
        checkpoint,
        0,
        1,
        device=device,
        dtype=dtype,
        quantization=quantization,
        kv_dtype=kv_dtype,
    )
    stage.open_session("warmup", passes + 16)
    best = float("inf")
    with torch.inference_mode():
        stage.forward("warmup", 0, torch.arange(8, dtype=torch.int64) % 7, logits_last_n=1)
        for i in range(passes):
            t0 = time.perf_counter_ns()
            stage.forward("warmup", 8 + i, torch.tensor([i + 1], dtype=torch.int64))
            best = min(best, time.perf_counter_ns() - t0)
    stage.close_session("warmup")
    return max(1, int(best))


@dataclass
class _Running:
    layers: tuple[int, int]
    host: StageHost
    scope: trio.CancelScope
    done: trio.Event


class StageSlot:
    """At most one hosted stage; `handle` routes the stage's messages, checking layer ranges."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        peers: LaneTable,
        *,
        device: torch.device,
        dtype: torch.dtype,
        eos_ids: frozenset[int],
        load_display: LoadDisplay | None = None,
        host_config: StageHostConfig | None = None,
        session_lease_s: float = SESSION_LEASE_S,
        quantization: str = "none",
        kv_dtype: torch.dtype | None = None,
        gate: BulkGate | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.gate = gate  # held by each host while it computes (`StageHost`)
        self.quantization = quantization
        self.kv_dtype = kv_dtype
        self.load_display = load_display
        self.peers = peers
        self.device = device
        self.dtype = dtype
        self.eos_ids = eos_ids
        self.host_config = host_config or StageHostConfig()
        self.session_lease_s = session_lease_s
        self._running: _Running | None = None
        self._nursery: trio.Nursery | None = None
        # Sessions freed without a close by the stages hosted before the current one.
        self._expired_before = dict.fromkeys(EXPIRY_CAUSES, 0)
        # While draining: sessions already open are served, new ones are refused.
        self.refuse_new_sessions = False
        # Told (layers, seconds) as each forward pass of the hosted stage ends; looked up at
        # every pass, so a listener set after the stage loaded (the daemon's metrics) hears it.
        self.on_pass: Callable[[tuple[int, int], float], None] | None = None

    @property
    def layers(self) -> tuple[int, int] | None:
        """The layer range served now (None: no stage)."""
        return self._running.layers if self._running is not None else None

    @property
    def sessions(self) -> int:
        """Sessions open on this node's stage."""
        return self._running.host.sessions if self._running else 0

    def holds_session(self, session: str) -> bool:
        """Whether the current stage holds `session` open."""
        return self._running is not None and self._running.host.has_session(session)

    @property
    def sessions_expired(self) -> dict[str, int]:
        """Sessions freed without an explicit close since the node started, by cause."""
        current = self._running.host.stats.sessions_expired if self._running else {}
        return {c: n + current.get(c, 0) for c, n in self._expired_before.items()}

    def free_coordinator(self, coordinator: bytes) -> None:
        """`coordinator` (a lane key) is gone: free its sessions here."""
        if self._running is not None:
            self._running.host.free_coordinator(coordinator)

    @property
    def kv_cache(self) -> KVCache | None:
        """The current stage's KV cache, with its prefix-cache entries (None: no stage)."""
        return self._running.host.stage.kv if self._running else None

    @property
    def kv_used_bytes(self) -> int:
        """KV cache bytes the current stage holds for open sessions (0: no stage)."""
        return self._running.host.stage.kv.used_bytes if self._running else 0

    @property
    def weight_bytes(self) -> int:
        """Weight bytes the current stage holds (0: no stage)."""
        return self._running.host.stage.weight_bytes if self._running else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes the current stage adds per position of a session (0: no stage)."""
        return self._running.host.stage.kv_bytes_per_token if self._running else 0

    @property
    def computing(self) -> bool:
        """A forward pass of the stage runs now."""
        return self._running.host.computing if self._running else False

    @property
    def windows_computed(self) -> int:
        """Windows the current stage computed."""
        return self._running.host.stats.windows_computed if self._running else 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the hosts' tasks until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def load(self, layers: tuple[int, int]) -> None:
        """Stop any current stage, then load and serve `layers`."""
        await self.stop("re-planned")
        lo, hi = layers
        t0 = time.perf_counter()
        display = self.load_display or (lambda _what: contextlib.nullcontext(None))
        with display(f"loading layers [{lo}, {hi})") as progress:
            model = await trio.to_thread.run_sync(
                lambda: StageModel.load(
                    self.checkpoint,
                    lo,
                    hi,
                    device=self.device,
                    dtype=self.dtype,
                    progress=progress,
                    quantization=self.quantization,
                    kv_dtype=self.kv_dtype,
                )
            )
        host = StageHost(
            model,
            self.peers,
            eos_ids=self.eos_ids,
            use_thread=True,
            config=self.host_config,
            session_lease_s=self.session_lease_s,
            gate=self.gate,
            on_pass=lambda seconds: self._passed(layers, seconds),
        )
        running = _Running(layers, host, trio.CancelScope(), trio.Event())
        self._running = running
        assert self._nursery is not None, "StageSlot.run() must be started first"
        self._nursery.start_soon(self._serve, running)
        log.info(
            "stage loaded: layers [%d, %d) at quantization %s, %d weight bytes, in %.2f s",
            lo,
            hi,
            self.quantization,
            model.weight_bytes,
            time.perf_counter() - t0,
        )

    def _passed(self, layers: tuple[int, int], seconds: float) -> None:
        if self.on_pass is not None:
            self.on_pass(layers, seconds)

    async def _serve(self, running: _Running) -> None:
        try:
            with running.scope:
                await running.host.run()
        finally:
            running.done.set()

    async def stop(self, reason: str) -> None:
        """Stop serving at once: open sessions get StageError(code="stage_stopped")."""
        running, self._running = self._running, None
        if running is None:
            return
        running.scope.cancel()
        await running.done.wait()
        failed = running.host.session_coordinators()
        running.host.close_all()
        for cause, count in running.host.stats.sessions_expired.items():
            self._expired_before[cause] += count
        for session, coordinator in failed.items():
            error = StageError(session, "stage_stopped", f"the stage was stopped: {reason}")
            await self._send(coordinator, error)

    async def drain(self) -> None:
        """Wait until no session is open here (closed, or freed with its coordinator)."""
        while self._running is not None and self._running.host.sessions:
            await self._running.host.wait_empty()

    def handle(self, message: Message, sender: bytes) -> None:
        """A pipeline message for the stage; an open for layers we do not serve is refused."""
        running = self._running
        if isinstance(message, OpenSession):
            refusal = self._refusal(message, running)
            if refusal is not None:
                assert self._nursery is not None
                error = StageError(message.session, *refusal)
                self._nursery.start_soon(self._send, message.coordinator, error)
                return
        if running is not None:
            running.host.handle(message, sender)

    def _refusal(self, message: OpenSession, running: _Running | None) -> tuple[str, str] | None:
        """Why this stage refuses a new session (code, detail), or None to open it."""
        expected = (message.layer_start, message.layer_end)
        if running is None or (expected != (-1, -1) and expected != running.layers):
            held = "no stage" if running is None else f"layers {list(running.layers)}"
            return "wrong_layers", f"this node serves {held}, the route expects {list(expected)}"
        if message.model_id != self.checkpoint.model_id:
            # Another model's session (a stale plan elsewhere): never run it on these weights.
            return "wrong_model", (
                f"this node serves model {self.checkpoint.model_id[:16]} here, the route "
                f"expects {message.model_id[:16]}"
            )
        if message.quantization and message.quantization != self.quantization:
            return "wrong_quantization", (
                f"this node holds the model at quantization {self.quantization}, the route "
                f"expects {message.quantization}"
            )
        if self.refuse_new_sessions and not running.host.has_session(message.session):
            return "draining", "this stage is draining: re-plan without it"
        return None

    async def _send(self, key: bytes, message: Message) -> None:
        try:
            await self.peers.send(key, message)
        except Exception as exc:  # the coordinator may be gone too
            log.debug("could not tell %s: %s", key.hex()[:16], exc)
