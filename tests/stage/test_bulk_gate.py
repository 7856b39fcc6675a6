"""The bulk gate: a stage host holds it from taking a window until its result is sent, so
that a weight transfer served by the same node waits (meshd/net/bulk.py)."""

from __future__ import annotations

import pathlib

import pytest
import trio
import trio.testing

from meshd.bench.checkpoints import make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.net.bulk import BulkGate
from meshd.stage.host import BULK_HOLD_MAX_S, StageHost
from protocol.messages import Message, OpenSession, Sampling, VerifyReply, VerifyWindow

COORD = b"c" * 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("gate_ckpt")
    make_checkpoint(directory, "llama", seed=5, num_hidden_layers=2)
    return directory


async def test_holds_nest_and_waiters_go_once_the_last_ends() -> None:
    gate = BulkGate()
    changes: list[bool] = []
    gate.subscribe(changes.append)
    passed = trio.Event()

    async def bulk() -> None:
        await gate.wait_open()
        passed.set()

    async with trio.open_nursery() as nursery:
        async with gate.hold():
            async with gate.hold():
                nursery.start_soon(bulk)
                await trio.testing.wait_all_tasks_blocked()
            assert gate.held and not passed.is_set()  # one hold still on
            await trio.testing.wait_all_tasks_blocked()
            assert not passed.is_set()
        await passed.wait()
    assert not gate.held
    assert changes == [True, False] and gate.holds_total == 1
    await gate.wait_open()  # open: returns at once


class _Outbox:
    """What the host sends (the node's lane table), with whether the gate was held then."""

    def __init__(self, gate: BulkGate) -> None:
        self.gate = gate
        self.sent: list[tuple[Message, bool]] = []
        self.got = trio.Event()

    async def send(self, key: bytes, message: Message, stream: int = 0) -> None:
        self.sent.append((message, self.gate.held))
        self.got.set()


async def test_a_host_holds_the_gate_while_it_computes_a_window_and_sends_its_reply(
    model_dir: pathlib.Path,
) -> None:
    gate = BulkGate()
    outbox = _Outbox(gate)
    stage = StageModel.load(Checkpoint.open(model_dir), 0, 2, device="cpu")
    held_in_pass: list[bool] = []
    forward = stage.forward

    def observed(*args: object, **kwargs: object) -> object:
        held_in_pass.append(gate.held)
        return forward(*args, **kwargs)  # type: ignore[arg-type]

    stage.forward = observed  # type: ignore[method-assign]
    host = StageHost(stage, outbox, use_thread=True, gate=gate)  # type: ignore[arg-type]
    host.handle(OpenSession("s", stage.model_id, 32, stage_index=0, coordinator=COORD), COORD)
    assert not gate.held  # an open session alone holds nothing
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run)
        for window_id, tokens in enumerate([[3, 4, 5], [6]], start=1):
            base = 0 if window_id == 1 else 3
            outbox.got = trio.Event()
            host.handle(
                VerifyWindow("s", 0, window_id, base_pos=base, tokens=tokens, sampling=Sampling()),
                COORD,
            )
            with trio.fail_after(30):
                await outbox.got.wait()
            await gate.wait_open()  # released once the reply is out
        nursery.cancel_scope.cancel()
    assert [type(m) for m, _ in outbox.sent] == [VerifyReply, VerifyReply]
    assert all(held for _, held in outbox.sent) and held_in_pass == [True, True]
    assert gate.holds_total == 2 and not gate.held


async def test_a_stage_whose_queue_never_empties_still_lets_transfers_through(
    model_dir: pathlib.Path,
) -> None:
    gate = BulkGate()
    stage = StageModel.load(Checkpoint.open(model_dir), 0, 2, device="cpu")
    positions: dict[str, int] = {}
    replies = 0
    closed = trio.Event()
    gate.subscribe(lambda held: closed.set() if held else None)
    enough = (trio.Event(), [1 << 30])  # set once replies reach the target

    class Feeder:
        """Each reply brings its session's next window at once: the queue never empties."""

        async def send(self, key: bytes, message: Message, stream: int = 0) -> None:
            nonlocal replies
            assert isinstance(message, VerifyReply), message
            replies += 1
            if replies >= enough[1][0]:
                enough[0].set()
            feed(message.session)

    host = StageHost(stage, Feeder(), use_thread=True, gate=gate)  # type: ignore[arg-type]

    def feed(sid: str) -> None:
        base = positions[sid]
        positions[sid] = base + 1
        window = VerifyWindow(sid, 0, base + 1, base_pos=base, tokens=[5], sampling=Sampling())
        host.handle(window, COORD)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run)
        for i in range(3):
            sid = f"s{i}"
            positions[sid] = 0
            host.handle(
                OpenSession(sid, stage.model_id, 8192, stage_index=0, coordinator=COORD), COORD
            )
            feed(sid)
        with trio.fail_after(30):
            await closed.wait()
            held_at = trio.current_time()
            await gate.wait_open()  # a transfer's chance, while windows keep coming
        waited = trio.current_time() - held_at
        enough[1][0] = replies + 10
        with trio.fail_after(30):
            await enough[0].wait()  # and the windows go on
        nursery.cancel_scope.cancel()
    assert waited < 10 * BULK_HOLD_MAX_S  # not starved (about BULK_HOLD_MAX_S)
    assert replies > 10 and gate.holds_total >= 2
