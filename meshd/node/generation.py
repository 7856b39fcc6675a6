"""`NodeBackend`: generation on the daemon, with live recovery when a stage dies.

The node coordinates its own requests over the current plan's route, or over an earlier route
whose stages still hold their layers and a longer prefix of the prompt (`choose_route`). When the route fails
(a stage's lane died, a stage was stopped, or a stage does not hold the layers the route
expects yet), the request keeps what it committed, re-plans without the lost node and
continues on the new route: it re-prefills prompt + committed tokens and generates the rest.
Stages write KV by absolute position and the last stage samples keyed by seed and position;
the committed tokens are re-fed in windows a CPU stage computes to the bits decoding gave them
(`GenerationRequest.replay_from`), so the continuation is the same as an undisturbed run's,
greedy or seeded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import trio

from meshd.api.backend import Overloaded, ServiceUnavailable
from meshd.coord.coordinator import (
    GenerationRequest,
    GenerationResult,
    OnTokens,
    RouteFailed,
    StageOverloaded,
)
from meshd.model.tokenizer import Tokenizer
from meshd.node.held_model import HeldModel
from meshd.node.node import MeshNode
from meshd.node.planning import route_served
from meshd.plan import NoFeasiblePlan
from meshd.plan.route import Route
from meshd.speculative.telemetry import Recorder

log = logging.getLogger(__name__)

STOPPING = "this node is stopping: send the request to another node of the mesh"
STOPPED_MID_REQUEST = "this node stopped before the request finished: retry it on another node"
# What a stopping node's 503 asks clients to wait (a restart takes about this long).
STOPPING_RETRY_AFTER_S = 5.0
# Pause between attempts while the planned stages are not ready yet (a re-plan ends it sooner).
RETRY_INTERVAL_S = 0.1


class NodeBackend:
    """`meshd.api.backend.MeshBackend` on a running `MeshNode`: one of the models it holds."""

    def __init__(self, node: MeshNode, model: HeldModel) -> None:
        self.node = node
        self.model = model
        self.model_name = model.files.name
        self.model_id = model.model_id
        self.tokenizer: Tokenizer = model.files.tokenizer
        self.mtp_depth = model.files.checkpoint.config.num_mtp_layers
        self.max_context_tokens = model.files.context_tokens
        self.coordinator = model.coordinator
        self.recoveries = 0
        # One cancel scope per generation running, so a stop can end them (`abort_all`).
        self._running: set[trio.CancelScope] = set()
        self._idle = trio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        """Generations running now."""
        return len(self._running)

    async def wait_idle(self) -> None:
        """Return once no generation runs."""
        await self._idle.wait()

    async def abort_all(self) -> None:
        """End every running generation with ServiceUnavailable (the node is stopping) and
        wait until they have closed their sessions."""
        for scope in list(self._running):
            scope.cancel()
        await self.wait_idle()

    async def generate(self, request: GenerationRequest, on_tokens: OnTokens) -> GenerationResult:
        """Generate over the mesh; raises ServiceUnavailable when no plan fits or it times out.

        A failure is retried on a new route until `recovery_timeout_s`; with no feasible plan
        (too few nodes left), ServiceUnavailable is raised at once. A stopping node admits
        nothing (503), and a generation still running when its grace ends gets a 503 too
        (an error event in a stream): never a silent cut.
        """
        if self.node.commands.stopping:
            raise ServiceUnavailable(STOPPING, STOPPING_RETRY_AFTER_S)
        scope = trio.CancelScope()
        self._running.add(scope)
        self._idle = trio.Event()
        try:
            with scope:
                return await self._generate(request, on_tokens)
            raise ServiceUnavailable(STOPPED_MID_REQUEST, STOPPING_RETRY_AFTER_S)
        finally:
            self._running.discard(scope)
            if not self._running:
                self._idle.set()

    async def _generate(self, request: GenerationRequest, on_tokens: OnTokens) -> GenerationResult:
        committed: list[int] = []
        deadline = trio.current_time() + self.node.config.recovery_timeout_s
        while True:
            try:
                route = self._route(request.prompt)
            except NoFeasiblePlan as exc:
                raise ServiceUnavailable(f"no plan fits the mesh: {exc}", 1.0) from exc
            if len(committed) >= request.max_tokens:
                telemetry = Recorder(request.spec.strategy).snapshot()
                return GenerationResult(committed, "length", telemetry)
            attempt = replace(
                request,
                prompt=[*request.prompt, *committed],
                max_tokens=request.max_tokens - len(committed),
                replay_from=len(request.prompt) if committed else None,
            )
            try:
                result = await self.coordinator.generate(route, attempt, on_tokens)
            except StageOverloaded as exc:
                if not committed:
                    # Nothing generated yet: the client retries later (429 with Retry-After).
                    raise Overloaded(str(exc), exc.retry_after_s) from exc
                committed += exc.committed
                await self.node.planning.wait_change(exc.retry_after_s)
                continue
            except RouteFailed as exc:
                committed += exc.committed
                if exc.committed:
                    deadline = trio.current_time() + self.node.config.recovery_timeout_s
                self._on_failure(exc)
                if trio.current_time() >= deadline:
                    raise ServiceUnavailable(f"the mesh could not recover: {exc}", 1.0) from exc
                await self.node.planning.wait_change(RETRY_INTERVAL_S)
                continue
            result.tokens = [*committed, *result.tokens]
            return result

    def _route(self, prompt: Sequence[int]) -> Route:
        """The plan's route, or an earlier one still served that holds more of `prompt`."""
        node = self.node
        view = node.membership.view()
        suspects = node.health.suspects(trio.current_time())
        planned = node.route(self.model)
        return self.coordinator.choose_route(
            planned, prompt, lambda route: route_served(route, view, suspects)
        )

    def _on_failure(self, exc: RouteFailed) -> None:
        node_id = self.node.keys.ed_of(exc.node_key) if exc.node_key else None
        if node_id is not None and self.node.peers.lane(exc.node_key) is None:
            self.node.suspect(node_id)  # its lane is gone: route around it at once
        if exc.committed or node_id is not None:
            self.recoveries += 1
            self.node.events.note("route-failed", node_id or b"", str(exc)[:120])
        log.info("route failed after %d tokens: %s", len(exc.committed), exc)
