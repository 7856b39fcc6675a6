"""An in-process pipeline on loopback: real lanes, real stage hosts, one coordinator.

Each node is a UDP endpoint with a lane table; stage nodes host a `StageModel`. Messages
reach each node's parts through `NodeWiring` (one coordinator, one stage). The coordinator lives on the
first stage's node (as a daemon receiving a request would when it
hosts stage 0). Latency between nodes is emulated in userspace on every endpoint's send path
(`rtt_s / 2` each way), since this kernel has no netem. Used by tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import itertools
import pathlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import torch
import trio
from nacl.bindings import crypto_scalarmult_base
from nacl.utils import random as nacl_random

from meshd.coord.coordinator import Coordinator
from meshd.coord.wiring import NodeWiring
from meshd.model.checkpoint import Checkpoint
from meshd.model.files import open_checkpoint
from meshd.model.governor import ThreadGovernor
from meshd.model.stage import StageModel
from meshd.net.emulator import LinkProfile
from meshd.net.endpoint import Endpoint, open_endpoint
from meshd.net.lane_table import LaneTable
from meshd.plan.route import Route, RouteStage
from meshd.speculative.draft import DraftModel
from meshd.stage.host import StageHost, StageHostConfig
from meshd.stage.leases import SESSION_LEASE_S
from protocol.config import LaneConfig
from protocol.messages import DType


@dataclass
class LocalNode:
    """One node of the local pipeline."""

    key: bytes
    peers: LaneTable
    host: StageHost | None


@dataclass
class LocalPipeline:
    """What `open_local_pipeline` yields."""

    coordinator: Coordinator
    route: Route
    nodes: list[LocalNode]
    checkpoint: Checkpoint

    @property
    def hosts(self) -> list[StageHost]:
        """The stage hosts in pipeline order."""
        return [n.host for n in self.nodes if n.host is not None]


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges of near-equal size."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    bounds = [round(i * num_layers / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(bounds))


@contextlib.asynccontextmanager
async def open_local_pipeline(
    model_dir: str | pathlib.Path,
    stages: int,
    *,
    rtt_s: float = 0.0,
    wire_dtype: DType = "f32",
    dtype: torch.dtype = torch.float32,
    eos_ids: frozenset[int] = frozenset(),
    split: Sequence[tuple[int, int]] | None = None,
    use_thread: bool = True,
    torch_threads: int | None = 1,
    session_lease_s: float = SESSION_LEASE_S,
    keep_alive: bool = True,
    quantization: str = "none",
    draft: DraftModel | None = None,
    lane_config: LaneConfig | None = None,
    stage_config: StageHostConfig | None = None,
    kv_budget_bytes: int | None = None,
) -> AsyncIterator[LocalPipeline]:
    """Start `stages` stage nodes on loopback and a coordinator on the first one.

    All stages share this process, and each computes in its own worker thread, so torch's
    intra-op threads default to 1 here: several stages each spinning up an OpenMP team on a
    small machine oversubscribe it, and every pass slows many times over under load
    (docs/model-runtime.md, "Threads"). `torch_threads=None` leaves torch's setting alone.
    `split` may repeat layers (several nodes holding the same ones): see `route`.
    `draft`: the coordinator's draft model, loaded before the lanes open (a load inside the
    event loop can outlast the lanes' `dead_after_s` on a loaded machine). `lane_config`: every
    lane's settings (default `LaneConfig()`). `stage_config`: every stage host's settings
    (default `StageHostConfig()`); `kv_budget_bytes`: each stage's KV memory budget (None: none).
    Stages free a session after `session_lease_s` without a window or keep-alive; the
    coordinator renews its sessions' leases, and tells the stages which prefix-cache entries its
    indexes dropped, unless `keep_alive` is off (tests of a lapsing lease).
    """
    _limit_torch_threads(torch_threads, draft)
    checkpoint = open_checkpoint(model_dir)
    ranges = list(split) if split is not None else even_split(checkpoint.config.num_layers, stages)
    nodes: list[LocalNode] = []
    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        endpoints, publics = await _open_endpoints(stack, len(ranges), rtt_s, lane_config)
        for index, layers in enumerate(ranges):
            wiring, peers, host = _stage_node(
                checkpoint,
                layers,
                endpoints[index],
                publics[index],
                dtype=dtype,
                quantization=quantization,
                kv_budget_bytes=kv_budget_bytes,
                eos_ids=eos_ids,
                use_thread=use_thread,
                session_lease_s=session_lease_s,
                config=stage_config,
            )
            if index == 0:
                coordinator = Coordinator(
                    peers,
                    publics[0],
                    wire_dtype=wire_dtype,
                    session_lease_s=session_lease_s,
                    draft=draft,
                    target_config=checkpoint.config,
                    prefix_max_entries=(stage_config or StageHostConfig()).prefix_cache_entries,
                )
                wiring.coordinator = coordinator
                if keep_alive:
                    nursery.start_soon(coordinator.keep_alive)
            nodes.append(LocalNode(publics[index], peers, host))
            await nursery.start(peers.run)
            nursery.start_soon(host.run)
        _introduce(nodes, endpoints)
        route = _route_without_spares(checkpoint.model_id, nodes, ranges)
        try:
            yield LocalPipeline(coordinator, route, nodes, checkpoint)
        finally:
            nursery.cancel_scope.cancel()


def _limit_torch_threads(torch_threads: int | None, draft: DraftModel | None) -> None:
    """Torch's intra-op threads to `torch_threads`, the draft's passes included (None: leave
    torch's setting alone)."""
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
        if draft is not None:
            # The draft computes on the threads the stages were given, whichever worker thread
            # runs its passes (the coordinator's steps run on one, and a thread's torch count
            # is its own): its governor sets them before each pass. A pass it governs on more
            # sets torch's count, which worker threads started later inherit, and these
            # stages, loaded on one thread, would then compute on more.
            draft.stage.governor = ThreadGovernor(torch_threads)


def _introduce(nodes: Sequence[LocalNode], endpoints: Sequence[Endpoint]) -> None:
    """Every node learns every node's address (its own included)."""
    for node in nodes:
        for other, endpoint in zip(nodes, endpoints, strict=True):
            node.peers.addresses[other.key] = endpoint.local_address


async def _open_endpoints(
    stack: contextlib.AsyncExitStack, count: int, rtt_s: float, lane_config: LaneConfig | None
) -> tuple[list[Endpoint], list[bytes]]:
    """`count` endpoints on loopback, open until `stack` closes, that admit each other (one
    PSK), each sending with `rtt_s / 2` of delay; and their static public keys."""
    psk = nacl_random(32)
    egress = LinkProfile(delay_s=rtt_s / 2) if rtt_s > 0 else None
    keys = [nacl_random(32) for _ in range(count)]
    endpoints = [
        await stack.enter_async_context(
            open_endpoint(static_private=k, psk=psk, egress=egress, lane_config=lane_config)
        )
        for k in keys
    ]
    return endpoints, [crypto_scalarmult_base(k) for k in keys]


def _stage_node(
    checkpoint: Checkpoint,
    layers: tuple[int, int],
    endpoint: Endpoint,
    public: bytes,
    *,
    dtype: torch.dtype,
    quantization: str,
    kv_budget_bytes: int | None,
    eos_ids: frozenset[int],
    use_thread: bool,
    session_lease_s: float,
    config: StageHostConfig | None,
) -> tuple[NodeWiring, LaneTable, StageHost]:
    """A stage node: `layers` of the checkpoint loaded on the CPU, its lane table and stage
    host, its lanes dispatched through one wiring (which takes the coordinator too on the
    first node)."""
    stage = StageModel.load(
        checkpoint,
        *layers,
        device="cpu",
        dtype=dtype,
        quantization=quantization,
        kv_budget_bytes=kv_budget_bytes,
    )
    wiring = NodeWiring()
    peers = LaneTable(endpoint, public, wiring.dispatch, on_lane_lost=wiring.on_lane_lost)
    host = StageHost(
        stage,
        peers,
        eos_ids=eos_ids,
        use_thread=use_thread,
        session_lease_s=session_lease_s,
        config=config,
    )
    wiring.stage = host
    return wiring, peers, host


def _route_without_spares(
    model_id: str, nodes: Sequence[LocalNode], ranges: Sequence[tuple[int, int]]
) -> Route:
    """The route over the nodes in order, each taking the layers after the last one's. Nodes
    whose layers repeat earlier ones' are spares: left out."""
    chain: list[RouteStage] = []
    for node, (lo, hi) in zip(nodes, ranges, strict=True):
        if lo == (chain[-1].layer_end if chain else 0):
            chain.append(RouteStage(node.key, lo, hi))
    return Route(model_id, tuple(chain))
