"""`ThreadGovernor`: a stage runs on its threads or on one, whichever its passes show faster."""

from __future__ import annotations

import itertools
import threading

import torch

from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.governor import GOVERNOR_GAPS, GOVERNOR_PROBE_PASSES, ThreadGovernor
from meshd.model.stage import StageModel
from meshd.speculative.draft import DraftModel


def _run(gov: ThreadGovernor, passes: int, seconds: dict[int, float], rows: int = 1) -> list[int]:
    """`passes` passes whose time depends only on the threads they ran on; the choices made."""
    chosen = []
    for _ in range(passes):
        threads = gov.choose(rows)
        chosen.append(threads)
        gov.record(rows, threads, seconds[threads])
    return chosen


def test_a_quiet_machine_keeps_every_thread_and_probes_ever_more_rarely() -> None:
    gov = ThreadGovernor(2)
    chosen = _run(gov, 5000, {2: 0.020, 1: 0.030})
    assert gov.current() == 2
    # Probes back off while they confirm the choice: well under 1 % of passes on one thread
    # once the gaps have grown.
    first = GOVERNOR_GAPS[0]
    assert chosen[:first] == [2] * first
    assert chosen[first : first + GOVERNOR_PROBE_PASSES] == [1] * GOVERNOR_PROBE_PASSES
    late = chosen[2500:]
    assert 0 < late.count(1) <= len(late) * 0.01


def test_a_busy_machine_falls_back_to_one_thread_and_returns_when_cores_free_up() -> None:
    gov = ThreadGovernor(2)
    # Another process holds the second core: spinning workers make 2 threads far slower.
    busy = _run(gov, 200, {2: 0.060, 1: 0.030})
    assert gov.current() == 1
    assert busy[-100:].count(2) <= 100 * GOVERNOR_PROBE_PASSES / GOVERNOR_GAPS[0]
    # The other process ends: within one probe gap (the gap is back to its first after a switch,
    # and has grown only while probes confirmed the choice) the stage uses both cores again.
    _run(gov, GOVERNOR_GAPS[1] + 2 * GOVERNOR_PROBE_PASSES, {2: 0.020, 1: 0.030})
    assert gov.current() == 2


def test_a_probe_far_slower_than_the_choice_stops_at_once() -> None:
    # Two threads on cores other work holds: each pass 20x one thread's. After the switch to
    # one thread, each probe of two costs one such pass, not three.
    gov = ThreadGovernor(2)
    chosen = _run(gov, 2000, {2: 0.600, 1: 0.030})
    assert gov.current() == 1
    assert chosen[: GOVERNOR_GAPS[0]] == [2] * GOVERNOR_GAPS[0]
    later = chosen[GOVERNOR_GAPS[0] + GOVERNOR_PROBE_PASSES :]
    probes = sum(1 for a, b in itertools.pairwise(later) if a == 1 and b == 2)
    assert probes >= 3 and later.count(2) == probes  # one pass per probe


def test_noise_within_the_margin_is_no_reason_to_switch() -> None:
    gov = ThreadGovernor(4)
    _run(gov, 1000, {4: 0.0200, 1: 0.0195})
    assert gov.current() == 4


def test_decode_windows_and_prefill_are_judged_apart() -> None:
    gov = ThreadGovernor(2)
    # Prefill (many rows, compute-bound) gains from two cores while decode does not.
    for _ in range(300):
        for rows, times in ((1, {2: 0.030, 1: 0.020}), (64, {2: 64 * 1e-3, 1: 64 * 2e-3})):
            threads = gov.choose(rows)
            gov.record(rows, threads, times[threads])
    assert gov.current(1) == 1 and gov.current(64) == 2
    assert gov.current(8) == 2  # windows: not measured yet, the stage's threads


def test_one_thread_is_never_governed() -> None:
    gov = ThreadGovernor(1)
    assert set(_run(gov, 100, {1: 0.01})) == {1}


def test_a_stage_sets_the_threads_its_governor_chooses() -> None:
    checkpoint = Checkpoint.open(builtin_model_dir())
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
        assert single.governor is None  # loaded on one thread: nothing to choose
        torch.set_num_threads(2)
        stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
        assert stage.governor is not None and stage.governor.threads == 2
        stage.open_session("s", 64)
        seen = []
        for pos in range(GOVERNOR_GAPS[0] + GOVERNOR_PROBE_PASSES + 1):
            expected = stage.governor.choose(1)
            stage.forward("s", pos, torch.tensor([5]))
            seen.append(expected)
            assert torch.get_num_threads() == expected
        assert set(seen) == {1, 2}  # it ran its threads, then probed one
    finally:
        torch.set_num_threads(previous)


def test_a_draft_governs_its_threads_without_touching_a_stages_on_another_thread() -> None:
    """The coordinator's draft model (on the event loop's thread) governs its threads as a
    stage does; where it chose one thread, a stage's passes on its worker thread still run on
    the threads the stage's governor chose, and the draft's next pass on its own choice."""

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        draft = DraftModel.load(builtin_model_dir())
        checkpoint = Checkpoint.open(builtin_model_dir())
        stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
        assert draft.stage.governor is not None and draft.stage.governor.threads == 2
        assert stage.governor is not None
        # A busy machine: the draft's passes on two threads ran far slower than on one.
        _run(draft.stage.governor, GOVERNOR_GAPS[0] + GOVERNOR_PROBE_PASSES, {2: 0.5, 1: 0.1})
        assert draft.stage.governor.current(1) == 1
        session = draft.open(64)
        draft.next_logits(session, 0, [5])
        assert torch.get_num_threads() == 1  # the draft's pass ran on its choice
        stage.open_session("s", 64)
        seen: list[int] = []

        def stage_pass() -> None:
            stage.forward("s", 0, torch.tensor([5]))
            seen.append(torch.get_num_threads())

        worker = threading.Thread(target=stage_pass)
        worker.start()
        worker.join()
        assert seen == [stage.governor.current(1)] == [2]
        draft.next_logits(session, 1, [6])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
