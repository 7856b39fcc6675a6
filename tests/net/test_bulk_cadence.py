"""The bulk gate's quiet ahead of an expected window (meshd/net/bulk.py): windows that come at
a cadence find bulk work already paused, a transfer keeps its share of every gap, and
irregular or stopped windows get no quiet at all."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from meshd.net.bulk import BulkGate, CadenceConfig, WindowCadence

CONFIG = CadenceConfig(quiet_s=0.0015, history=8, tolerance=0.3, min_open_share=0.6)


def fed(gaps: list[float], hold_s: float) -> tuple[WindowCadence, float]:
    """A cadence fed windows held `hold_s` each, `gaps` apart; and the last one's end."""
    cadence = WindowCadence(CONFIG)
    now = 100.0
    cadence.window_started(now)
    cadence.window_ended(now + hold_s)
    for gap in gaps:
        now += hold_s + gap
        cadence.window_started(now)
        cadence.window_ended(now + hold_s)
    return cadence, now + hold_s


def test_regular_windows_get_a_quiet_that_covers_the_next_ones_arrival() -> None:
    cadence, last = fed([0.005, 0.006, 0.005, 0.004, 0.005, 0.006, 0.005, 0.005], 0.003)
    quiet = cadence.quiet()
    assert quiet is not None
    start, end = quiet
    # Bulk pauses `quiet_s` before the usual arrival (5 ms after the last window's end) and
    # stays paused past it, within the quiet's share of the gap (2 ms of 5).
    assert start == pytest.approx(last + 0.005 - CONFIG.quiet_s)
    assert last + 0.005 < end <= start + (1 - CONFIG.min_open_share) * 0.005 + 1e-9


def test_the_quiet_never_takes_more_than_its_share_of_a_short_gap() -> None:
    cadence, last = fed([0.001] * 8, 0.005)
    quiet = cadence.quiet()
    assert quiet is not None
    start, end = quiet
    assert end - start == pytest.approx((1 - CONFIG.min_open_share) * 0.001)
    assert end == pytest.approx(last + 0.001)  # just before the next window, not after this one


def test_irregular_windows_too_few_windows_and_no_windows_get_no_quiet() -> None:
    irregular, _ = fed([0.005, 0.025, 0.007, 0.045, 0.005, 0.015, 0.006, 0.035], 0.005)
    assert irregular.quiet() is None
    few, _ = fed([0.005] * 3, 0.005)
    assert few.quiet() is None
    assert WindowCadence(CONFIG).quiet() is None
    off = WindowCadence(CadenceConfig(quiet_s=0.0))
    for i in range(10):
        off.window_started(i * 0.01)
        off.window_ended(i * 0.01 + 0.005)
    assert off.quiet() is None


def test_no_quiet_while_a_window_is_on_nor_twice_in_one_gap() -> None:
    cadence, last = fed([0.005] * 8, 0.005)
    assert cadence.quiet() is not None
    cadence.quiet_spent()  # the window did not come: windows stopped
    assert cadence.quiet() is None
    cadence.window_started(last + 0.020)
    assert cadence.quiet() is None  # the window is on: the gate holds for it anyway
    cadence.window_ended(last + 0.025)
    assert cadence.quiet() is not None  # one long gap among eight: still regular


async def test_windows_at_a_cadence_find_bulk_paused_and_a_transfer_keeps_its_share(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = BulkGate(CONFIG)
    interval, hold_s, windows = 0.010, 0.005, 40
    arrivals: list[bool] = []  # whether bulk was paused as each window arrived
    open_s = 0.0  # time the gate was open while windows came

    async def transfer() -> None:
        nonlocal open_s
        while True:
            await gate.wait_open()
            t = trio.current_time()
            await trio.sleep(0.0001)  # one chunk's work
            if not gate.held:
                open_s += trio.current_time() - t

    async with trio.open_nursery() as nursery:
        await nursery.start(gate.run)
        nursery.start_soon(transfer)
        for _ in range(windows):
            arrivals.append(gate.held)
            async with gate.hold():
                await trio.sleep(hold_s)
            await trio.sleep(interval - hold_s)
        open_with_windows_s = open_s
        # Windows stop: at most the one quiet already planned, then the gate stays open.
        quiets = gate.quiets_total
        await trio.sleep(1.0)
        assert not gate.held and gate.quiets_total <= quiets + 1
        nursery.cancel_scope.cancel()
    learned = arrivals[CONFIG.history + 1 :]
    assert learned and all(learned)  # once learned, no window arrives during bulk work
    assert not any(arrivals[: CONFIG.history])  # nothing predicted before the history fills
    # The transfer kept its share of every gap between windows, and runs on once they stop.
    gaps_s = windows * (interval - hold_s)
    assert open_with_windows_s >= CONFIG.min_open_share * gaps_s
    assert open_s - open_with_windows_s >= 1.0 - CONFIG.quiet_s * 2


async def test_irregular_windows_leave_the_gate_as_it_was_held_by_windows_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = BulkGate(CONFIG)
    pauses = [0.005, 0.030, 0.008, 0.060, 0.005, 0.020, 0.007, 0.045] * 4
    async with trio.open_nursery() as nursery:
        await nursery.start(gate.run)
        for pause in pauses:
            assert not gate.held  # between windows, bulk runs
            async with gate.hold():
                await trio.sleep(0.005)
            await trio.sleep(pause)
        nursery.cancel_scope.cancel()
    assert gate.quiets_total == 0 and gate.holds_total == len(pauses)
