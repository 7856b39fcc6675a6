"""The stage a node hosts refuses a session whose route expects another quantization: its
tokens would differ from the other stages' (a node restarted with another `quantization`
while a coordinator's view still shows the old one); it tells its listener of each pass."""

from __future__ import annotations

import msgspec
import torch
import trio

from meshd.mesh.identity import NodeIdentity
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.net.endpoint import open_endpoint
from meshd.net.lane_table import LaneTable
from meshd.node.stage_slot import StageSlot
from protocol.messages import Message, OpenSession, Sampling, StageError, VerifyWindow


def _open(session: str, coordinator: bytes, quantization: str) -> OpenSession:
    return OpenSession(
        session=session,
        model_id=Checkpoint.open(builtin_model_dir()).model_id,
        max_positions=64,
        stage_index=0,
        coordinator=coordinator,
        layer_start=0,
        layer_end=6,
        quantization=quantization,
    )


async def test_a_session_at_another_quantization_is_refused_with_a_typed_error() -> None:
    torch.set_num_threads(1)
    me = NodeIdentity.generate()
    replies: list[Message] = []
    got = trio.Event()

    def to_me(message: Message, sender: bytes) -> None:  # this node coordinates too
        replies.append(message)
        got.set()

    async with (
        open_endpoint(static_private=me.x25519_private, psk=b"k" * 32) as endpoint,
        trio.open_nursery() as nursery,
    ):
        peers = LaneTable(endpoint, me.x25519_public, to_me)
        await nursery.start(peers.run)
        slot = StageSlot(
            Checkpoint.open(builtin_model_dir()),
            peers,
            device=torch.device("cpu"),
            dtype=torch.float32,
            eos_ids=frozenset(),
            quantization="q8_0",
        )
        await nursery.start(slot.run)
        await slot.load((0, 6))
        assert slot.weight_bytes > 0 and slot.kv_bytes_per_token > 0

        slot.handle(_open("fp32-route", me.x25519_public, "none"), me.x25519_public)
        with trio.fail_after(10):
            await got.wait()
        [error] = replies
        assert isinstance(error, StageError) and error.code == "wrong_quantization"
        assert "q8_0" in error.message and "none" in error.message
        assert slot.sessions == 0

        # Another model's session (a stale plan of a mesh serving several) is refused too.
        replies.clear()
        got = trio.Event()
        other = msgspec.structs.replace(_open("other", me.x25519_public, "q8_0"), model_id="f" * 32)
        slot.handle(other, me.x25519_public)
        with trio.fail_after(10):
            await got.wait()
        [error] = replies
        assert isinstance(error, StageError) and error.code == "wrong_model"
        assert slot.sessions == 0

        # The route that says q8_0 (or says nothing) is served.
        slot.handle(_open("q8_0-route", me.x25519_public, "q8_0"), me.x25519_public)
        slot.handle(_open("unsaid", me.x25519_public, ""), me.x25519_public)
        assert slot.sessions == 2

        # Each forward pass is told to the slot's listener (the daemon's stage metrics), set
        # after the stage loaded.
        passes: list[tuple[tuple[int, int], float]] = []
        passed = trio.Event()

        def on_pass(layers: tuple[int, int], seconds: float) -> None:
            passes.append((layers, seconds))
            passed.set()

        slot.on_pass = on_pass
        window = VerifyWindow("q8_0-route", 0, 1, 0, [1, 2, 3], Sampling(), sample=False)
        slot.handle(window, me.x25519_public)
        with trio.fail_after(20):
            await passed.wait()
        [(layers, seconds)] = passes
        assert layers == (0, 6) and seconds > 0
        await slot.stop("test over")
        nursery.cancel_scope.cancel()
