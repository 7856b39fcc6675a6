"""`meshd bench fetch`: weights over loopback lanes, and what a transfer does to a verify window.

A holder (the checkpoint's files, `ArtifactService`) and a fetcher (an empty `ModelStore`) run
in this one trio process on two endpoints, as two nodes do. Each round fetches every tensor of
the model (a fresh store each time) and reports MB/s; meanwhile, and before it, the fetcher
sends verify-window-sized messages (`--window-kib`, a window's hidden states) to the holder on
the pipeline stream and times each round trip: the latency of a window with the lane idle and
with a transfer running, and their ratio (the goal is within 1.2x). Rounds repeat and medians
are reported, because this machine is shared and noisy.

The built-in model is small (14 MB); `--synthetic-mb N` writes a random checkpoint of about N
MB (built-in architecture, more and wider layers) to a temp dir and fetches that instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from meshd.bench.harness import model_dir, print_report
from meshd.model.checkpoint import Checkpoint, expected_shapes
from meshd.model.manifest import ModelStore
from meshd.net.bulk import BulkGate, CadenceConfig
from meshd.net.endpoint import open_endpoint
from meshd.net.lane_table import LaneTable
from meshd.node.fetch import ArtifactService
from meshd.node.fetch_run import FetchRun, ProgressMeter
from protocol import artifacts
from protocol.artifacts import ArtifactKind, FetchConfig, Fetcher
from protocol.messages import Message
from protocol.streams import ARTIFACT_STREAM, PIPELINE_STREAM

REPLY_BYTES = 64
PSK = b"\x07" * 32
STEP_TIMEOUT_S = 10.0
# Between two windows a coordinator samples and drafts: windows are paced, not back to back.
PACE_S = 0.005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `meshd bench fetch`."""
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in)")
    parser.add_argument("--synthetic-mb", type=int, default=0, help="fetch a random ~N MB model")
    parser.add_argument("--rounds", type=int, default=3, help="fetches (medians reported)")
    parser.add_argument("--window-kib", type=int, default=64, help="verify window message size")
    parser.add_argument("--pings", type=int, default=200, help="idle round trips per round")
    parser.add_argument("--window-bytes", type=int, default=None, help="fetch flow window")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="bytes per chunk request")
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="the fetching node's process on the last core alone, the holder's on the others "
        "(as if the fetcher were another machine, as in a mesh)",
    )
    parser.add_argument(
        "--quiet-ms",
        type=float,
        default=None,
        help="the holder's bulk gate closes this long ahead of an expected window "
        "(default: the daemon's; 0: only while a window computes)",
    )
    parser.add_argument(
        "--quiet-ab",
        action="store_true",
        help="the quiet on before every other window only; report the verify window during "
        "the transfer with and without one (side by side in one run)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table or JSON."""
    defaults = FetchConfig()
    config = FetchConfig(
        chunk_bytes=args.chunk_bytes or defaults.chunk_bytes,
        window_bytes=args.window_bytes or defaults.window_bytes,
    )
    cadence = CadenceConfig()
    if args.quiet_ms is not None:
        cadence = msgspec.structs.replace(cadence, quiet_s=args.quiet_ms / 1e3)
    fetcher_cores: tuple[int, ...] = ()
    if args.pin_cores:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise SystemExit("--pin-cores needs at least 2 cores")
        fetcher_cores = (cores[-1],)
        os.sched_setaffinity(0, cores[:-1])  # the holder (and the coordinator beside it)
    with tempfile.TemporaryDirectory(prefix="meshd-bench-fetch-") as tmp:
        source = model_dir(args)
        if args.synthetic_mb:
            source = str(synthetic_checkpoint(pathlib.Path(tmp) / "model", args.synthetic_mb))
        result = trio.run(
            _main,
            source,
            pathlib.Path(tmp),
            args.rounds,
            args.window_kib * 1024,
            args.pings,
            config,
            fetcher_cores,
            cadence,
            args.quiet_ab,
        )
    print_report(result, args.json, _print_table)
    return 0


def synthetic_checkpoint(directory: pathlib.Path, megabytes: int) -> pathlib.Path:
    """A random float16 checkpoint of about `megabytes` MB with the built-in model's tokenizer."""
    import torch
    from safetensors.torch import save_file

    from meshd.model.builtin import builtin_model_dir
    from meshd.model.config import ModelConfig

    builtin = builtin_model_dir()
    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(builtin / name, directory / name)
    raw = json.loads((builtin / "config.json").read_text())
    raw |= {"hidden_size": 1024, "intermediate_size": 2816, "torch_dtype": "float16"}
    per_layer_mb = (4 * 1024 * 1024 + 3 * 1024 * 2816) * 2 / 1e6
    raw["num_hidden_layers"] = max(2, round(megabytes / per_layer_mb))
    (directory / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_file(directory / "config.json")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator).to(torch.float16)
        for name, shape in expected_shapes(config).items()
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


class _VerifyStage:
    """The built-in model, whole, verifying 4-token windows of one session (one thread)."""

    TOKENS = 4

    def __init__(self) -> None:
        import torch

        from meshd.model.builtin import builtin_model_dir
        from meshd.model.stage import StageModel

        torch.set_num_threads(1)
        checkpoint = Checkpoint.open(builtin_model_dir())
        self.stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
        self.position = 0
        self.stage.open_session("bench", 1024)

    def step(self) -> None:
        import torch

        if self.position + self.TOKENS > 1000:
            self.stage.close_session("bench")
            self.stage.open_session("bench", 1024)
            self.position = 0
        tokens = torch.arange(self.TOKENS, dtype=torch.int64) + 5
        with torch.inference_mode():
            self.stage.forward("bench", self.position, tokens, logits_last_n=self.TOKENS)
        self.position += self.TOKENS


@dataclass
class _Node:
    table: LaneTable
    service: ArtifactService
    key: bytes
    gate: BulkGate


@contextlib.asynccontextmanager
async def artifact_nodes(
    checkpoints: list[Checkpoint],
    config: FetchConfig,
    cadence: CadenceConfig | None = None,
) -> AsyncIterator[list[_Node]]:
    """One node per checkpoint on loopback lanes, each serving that checkpoint's files and
    knowing every other's address (each lists all the others as sources), each with its bulk
    gate wired as a daemon's (held while a stage there computes a window)."""
    from nacl.bindings import crypto_scalarmult_base
    from nacl.utils import random as nacl_random

    psk = PSK
    privs = [nacl_random(32) for _ in checkpoints]
    pubs = [crypto_scalarmult_base(p) for p in privs]
    async with contextlib.AsyncExitStack() as stack:
        endpoints = [
            await stack.enter_async_context(open_endpoint(static_private=p, psk=psk)) for p in privs
        ]
        nursery = await stack.enter_async_context(trio.open_nursery())
        nodes: list[_Node] = []
        for endpoint, own, checkpoint in zip(endpoints, pubs, checkpoints, strict=True):
            box: list[ArtifactService] = []

            def on_artifact(
                message: artifacts.ArtifactMessage,
                sender: bytes,
                box: list[ArtifactService] = box,
            ) -> None:
                box[0].on_message(message, sender)

            def dispatch(_message: Message, _sender: bytes) -> None:
                pass

            def on_lane_lost(key: bytes, _lane: object, box: list[ArtifactService] = box) -> None:
                box[0].on_lane_lost(key)

            def on_lane_up(key: bytes, _lane: object, box: list[ArtifactService] = box) -> None:
                box[0].on_lane_up(key)

            table = LaneTable(
                endpoint,
                own,
                dispatch,
                streams={ARTIFACT_STREAM: (artifacts.decode, on_artifact)},
                on_lane_lost=on_lane_lost,
                on_lane_up=on_lane_up,
            )
            await nursery.start(table.run)
            others = [k for k in pubs if k != own]
            for key, other in zip(pubs, endpoints, strict=True):
                if key != own:
                    table.addresses[key] = other.local_address
            gate = BulkGate(cadence)
            gate.subscribe(endpoint.hold_bulk)
            await nursery.start(gate.run)
            service = ArtifactService(checkpoint, table, others.copy, config=config, gate=gate)
            box.append(service)
            await nursery.start(service.run)
            nodes.append(_Node(table, service, own, gate))
        yield nodes
        nursery.cancel_scope.cancel()


async def _main(
    source: str,
    tmp: pathlib.Path,
    rounds: int,
    window_message_bytes: int,
    pings: int,
    config: FetchConfig,
    fetcher_cores: tuple[int, ...] = (),
    cadence: CadenceConfig | None = None,
    quiet_ab: bool = False,
) -> dict[str, Any]:
    holder = Checkpoint.open(source)
    t0 = time.perf_counter()
    model_id, data, manifest = await trio.to_thread.run_sync(lambda: holder.manifest)
    manifest_s = time.perf_counter() - t0
    tensors = [i for i, a in enumerate(manifest.artifacts) if a.kind == ArtifactKind.TENSOR]
    total = sum(manifest.artifacts[i].nbytes for i in tensors)
    samples: dict[str, list[float]] = {}
    quiets: list[int] = []
    missed: list[int] = []
    verify_stage = _VerifyStage()
    for r in range(rounds):
        store = ModelStore(tmp / f"round{r}", model_id, data, manifest)
        # Alternate: the lane alone (a window's bytes there and back), then a verify window
        # through a stage of the built-in model (its forward pass on the holder).
        for kind, stage in (("lane", None), ("verify", verify_stage)):
            async with artifact_nodes([holder, holder], config, cadence) as (server, client):
                rtts_idle, rtts_busy, mb_s, by_arm = await _round(
                    server,
                    client,
                    store,
                    tensors,
                    total,
                    window_message_bytes,
                    pings,
                    config,
                    stage,
                    fetcher_cores,
                    quiet_ab,
                )
                for arm, rtts in by_arm.items():
                    samples.setdefault(f"verify_rtt_busy_{arm}_ms", []).append(
                        statistics.median(rtts) * 1e3
                    )
                if stage is not None:
                    quiets.append(server.gate.quiets_total)
                    missed.append(server.gate.quiets_missed)
            shutil.rmtree(tmp / f"round{r}", ignore_errors=True)
            store = ModelStore(tmp / f"round{r}", model_id, data, manifest)
            samples.setdefault("fetch_mb_s", []).append(mb_s)
            if stage is not None:  # the transfer while verify windows held the gate
                samples.setdefault("fetch_verify_mb_s", []).append(mb_s)
            samples.setdefault(f"{kind}_rtt_idle_ms", []).append(statistics.median(rtts_idle) * 1e3)
            samples.setdefault(f"{kind}_rtt_busy_ms", []).append(statistics.median(rtts_busy) * 1e3)
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    for kind in ("lane", "verify"):
        out[f"{kind}_rtt_ratio"] = round(out[f"{kind}_rtt_busy_ms"] / out[f"{kind}_rtt_idle_ms"], 3)
    for arm in ("quiet", "plain"):
        if f"verify_rtt_busy_{arm}_ms" in out:
            ratio = out[f"verify_rtt_busy_{arm}_ms"] / out["verify_rtt_idle_ms"]
            out[f"verify_rtt_{arm}_ratio"] = round(ratio, 3)
    out |= {
        "model_bytes": total,
        "tensors": len(tensors),
        "manifest_hash_s": round(manifest_s, 3),
        "window_message_bytes": window_message_bytes,
        "chunk_bytes": config.chunk_bytes,
        "flow_window_bytes": config.window_bytes,
        "rounds": rounds,
        "pin_cores": bool(fetcher_cores),
        "bulk_quiet_ms": (cadence or CadenceConfig()).quiet_s * 1e3,
        "quiets": quiets,
        "quiets_missed": missed,
        "per_round": samples,
    }
    return out


async def _round(
    server: _Node,
    client: _Node,
    store: ModelStore,
    tensors: list[int],
    total: int,
    window_message_bytes: int,
    pings: int,
    config: FetchConfig,
    stage: _VerifyStage | None,
    fetcher_cores: tuple[int, ...] = (),
    quiet_ab: bool = False,
) -> tuple[list[float], list[float], float, dict[str, list[float]]]:
    """Idle and busy window round trips, the fetch's MB/s, and (`quiet_ab`) the busy round
    trips of windows after a gap with a quiet ("quiet") and without ("plain")."""
    reply_out = _wire_windows(server, client, stage, quiet_ab)
    windows = _Windows(client, server.key, b"w" * window_message_bytes, reply_out)
    await client.table.lane_to(server.key)
    for _ in range(20):  # warm-up
        await windows.rtt()
    idle = []
    for _ in range(pings):  # paced as during the transfer: one window, then a decode step
        idle.append(await windows.rtt())
        await trio.sleep(PACE_S)
    # The fetching node, in its own process as in a mesh: the holder's process serves it.
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    address = server.table.endpoint.local_address
    args = (
        server.key,
        address,
        store.model_id,
        store.manifest_bytes,
        str(store.directory.parents[1]),
    )
    process = ctx.Process(
        target=_fetch_child,
        args=(*args, config.chunk_bytes, config.window_bytes, fetcher_cores, child),
    )
    process.start()
    child.close()  # the child's end: recv raises EOFError if the child dies
    try:
        busy, elapsed, by_arm = await _busy_windows(parent, windows, quiet_ab and stage is not None)
    finally:
        await trio.to_thread.run_sync(process.join, 30)
    if not busy:
        busy = [float("nan")]
    return idle, busy, total / elapsed / 1e6, {k: v for k, v in by_arm.items() if v}


def _wire_windows(
    server: _Node, client: _Node, stage: _VerifyStage | None, quiet_ab: bool
) -> trio.MemoryReceiveChannel[bytes]:
    """The pipeline stream of both nodes: the holder answers each window (through `stage`
    when given), the fetcher's replies come out of the returned channel."""
    replies: trio.MemorySendChannel[bytes]
    replies, reply_out = trio.open_memory_channel[bytes](16)

    async def answer(sender: bytes) -> None:
        if stage is None:
            await server.table.send_bytes(sender, PIPELINE_STREAM, b"r" * REPLY_BYTES)
            return
        # A stage verifying the window, as `StageHost` does: its forward pass in a thread,
        # the node's bulk gate held from taking the window until the reply is sent.
        cadence = server.gate.cadence
        arm = b"q" if cadence.config.quiet_s > 0 else b"p"  # the gap just before this window
        async with server.gate.hold():
            if quiet_ab:  # the next gap the other way (its quiet is planned as this hold ends)
                quiet_s = quiet_on if arm == b"p" else 0.0
                cadence.config = msgspec.structs.replace(cadence.config, quiet_s=quiet_s)
            await trio.to_thread.run_sync(stage.step)
            await server.table.send_bytes(sender, PIPELINE_STREAM, arm * REPLY_BYTES)

    def echo(data: bytes, sender: bytes) -> None:  # the holder: a stage answering a window
        server.table._nursery.start_soon(answer, sender)  # type: ignore[union-attr]

    def got_reply(data: bytes, sender: bytes) -> None:
        replies.send_nowait(data)

    quiet_on = server.gate.cadence.config.quiet_s
    server.table.streams[PIPELINE_STREAM] = (bytes, echo)
    client.table.streams[PIPELINE_STREAM] = (bytes, got_reply)
    return reply_out


@dataclass
class _Windows:
    """The fetcher's verify windows to the holder, each timed until its reply."""

    client: _Node
    server_key: bytes
    window: bytes
    replies: trio.MemoryReceiveChannel[bytes]
    last_arm: bytes = b""  # the last reply's first byte: the gap before its window

    async def rtt(self) -> float:
        t = time.perf_counter()
        with trio.fail_after(STEP_TIMEOUT_S):  # a lost window is a bug: say so, do not hang
            await self.client.table.send_bytes(self.server_key, PIPELINE_STREAM, self.window)
            self.last_arm = (await self.replies.receive())[:1]
        return time.perf_counter() - t


async def _busy_windows(
    parent: multiprocessing.connection.Connection, windows: _Windows, split_arms: bool
) -> tuple[list[float], float, dict[str, list[float]]]:
    """Window round trips while the child fetches, the seconds it reports, and (`split_arms`)
    the round trips by the gap before each window."""
    with trio.fail_after(STEP_TIMEOUT_S * 6):
        started = await trio.to_thread.run_sync(parent.recv, abandon_on_cancel=True)
    assert started == "start", started
    busy: list[float] = []
    by_arm: dict[str, list[float]] = {"quiet": [], "plain": []}
    while not parent.poll():
        rtt = await windows.rtt()
        if not parent.poll():
            busy.append(rtt)
            if split_arms:
                by_arm["quiet" if windows.last_arm == b"q" else "plain"].append(rtt)
        await trio.sleep(PACE_S)  # windows come between decode steps, not back to back
    kind, elapsed = await trio.to_thread.run_sync(parent.recv, abandon_on_cancel=True)
    assert kind == "done", kind
    return busy, elapsed, by_arm


def _fetch_child(
    holder: bytes,
    address: tuple[str, int],
    model_id: str,
    data: bytes,
    root: str,
    chunk_bytes: int,
    window_bytes: int,
    cores: tuple[int, ...],
    conn: Any,
) -> None:
    """(another process) Fetch every tensor from `holder`; report "start", then the seconds.
    On `cores` alone if given (`--pin-cores`)."""
    if cores:
        os.sched_setaffinity(0, cores)
    config = FetchConfig(chunk_bytes=chunk_bytes, window_bytes=window_bytes)
    trio.run(_fetch_child_main, holder, address, model_id, data, pathlib.Path(root), config, conn)


async def _fetch_child_main(
    holder: bytes,
    address: tuple[str, int],
    model_id: str,
    data: bytes,
    root: pathlib.Path,
    config: FetchConfig,
    conn: Any,
) -> None:
    from nacl.bindings import crypto_scalarmult_base
    from nacl.utils import random as nacl_random

    _, manifest = artifacts.open_manifest(data, model_id)
    store = ModelStore(root, model_id, data, manifest)
    tensors = [i for i, a in enumerate(manifest.artifacts) if a.kind == ArtifactKind.TENSOR]
    private = nacl_random(32)
    runs: list[FetchRun] = []

    def on_artifact(message: artifacts.ArtifactMessage, sender: bytes) -> None:
        if isinstance(message, artifacts.ChunkReply | artifacts.ArtifactRefusal) and runs:
            runs[0].on_reply(message, sender)

    def dispatch(_message: Message, _sender: bytes) -> None:
        pass

    async with (
        open_endpoint(static_private=private, psk=PSK) as endpoint,
        trio.open_nursery() as nursery,
    ):
        table = LaneTable(
            endpoint,
            crypto_scalarmult_base(private),
            dispatch,
            streams={ARTIFACT_STREAM: (artifacts.decode, on_artifact)},
        )
        await nursery.start(table.run)
        table.addresses[holder] = address
        await table.lane_to(holder)

        async def send(source: bytes, payload: bytes) -> None:
            await table.send_bytes(source, ARTIFACT_STREAM, payload)

        fetcher = Fetcher(model_id, manifest, tensors, config)
        total = sum(manifest.artifacts[i].nbytes for i in tensors)
        runs.append(
            FetchRun(fetcher, store, send, lambda: [holder], ProgressMeter(model_id, "all", total))
        )
        conn.send("start")
        t0 = time.perf_counter()
        await runs[0].run()
        conn.send(("done", time.perf_counter() - t0))
        nursery.cancel_scope.cancel()


def _print_table(r: dict[str, Any]) -> None:
    print(f"meshd bench fetch — loopback lanes, {r['rounds']} rounds, medians")
    print(f"  model: {r['tensors']} tensors, {r['model_bytes'] / 1e6:.1f} MB")
    if r["pin_cores"]:
        print("  fetcher on a core of its own (--pin-cores)")
    print(f"  fetch rate                     {r['fetch_mb_s']:9.1f} MB/s")
    print(f"  fetch rate, verify windows on  {r['fetch_verify_mb_s']:9.1f} MB/s")
    for kind, what in (("lane", "lane round trip"), ("verify", "verify window")):
        print(f"  {what + ', idle':29s}  {r[f'{kind}_rtt_idle_ms']:9.3f} ms")
        print(f"  {what + ', transfer':29s}  {r[f'{kind}_rtt_busy_ms']:9.3f} ms")
        print(f"  {'ratio':29s}  {r[f'{kind}_rtt_ratio']:9.2f}x")
