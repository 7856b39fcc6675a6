"""`Duty` on a virtual clock: serving, spare, kill, kill --drain (and its timeout), recover,
the graceful stop, and which commands override which."""

from __future__ import annotations

from meshd.node.duty import (
    CancelDrain,
    Duty,
    Ignored,
    LoadStage,
    Mode,
    Note,
    Publish,
    StartDrain,
    StopStage,
)

LAYERS = (2, 5)


def _serving(now: float = 0.0) -> Duty:
    duty = Duty(drain_timeout_s=300.0)
    effects = duty.on_plan(assigned=LAYERS, planned=True, layers=None, now=now)
    # Urgent: planners keep a stage where a record says it is loaded.
    assert effects == [
        LoadStage(LAYERS),
        Note("stage-loaded", "layers [2, 5]"),
        Publish(urgent=True),
    ]
    assert duty.mode(LAYERS) is Mode.SERVING and duty.offers_model
    return duty


def test_a_plan_loads_moves_or_keeps_the_stage() -> None:
    duty = _serving()
    assert duty.on_plan(assigned=LAYERS, planned=True, layers=LAYERS, now=1.0) == []
    assert duty.on_plan(assigned=(0, 2), planned=True, layers=LAYERS, now=2.0)[0] == LoadStage(
        (0, 2)
    )
    # A plan without this node makes it a spare.
    effects = duty.on_plan(assigned=None, planned=True, layers=LAYERS, now=3.0)
    assert effects == [StopStage("not in the plan"), Note("stage-stopped"), Publish()]
    assert duty.mode(None) is Mode.SPARE and duty.offers_model


def test_with_no_plan_at_all_the_stage_is_kept_for_a_later_one() -> None:
    duty = _serving()
    assert duty.on_plan(assigned=None, planned=False, layers=LAYERS, now=1.0) == [Publish()]
    assert duty.mode(LAYERS) is Mode.SERVING


def test_kill_stops_at_once_and_recover_makes_a_spare() -> None:
    duty = _serving()
    effects = duty.kill(drain=False, layers=LAYERS, sessions=3, now=10.0)
    assert effects == [StopStage("killed by the operator"), Note("killed", "at once"), Publish()]
    assert duty.mode(None) is Mode.KILLED and not duty.offers_model and duty.disabled
    # A killed node hosts nothing, whatever the plan says.
    assert duty.on_plan(assigned=LAYERS, planned=True, layers=None, now=11.0) == []
    assert duty.recover(now=12.0) == [Note("recovered"), Publish()]
    assert duty.mode(None) is Mode.SPARE and duty.offers_model and not duty.disabled


def test_drain_serves_the_open_sessions_then_stops() -> None:
    duty = _serving()
    effects = duty.kill(drain=True, layers=LAYERS, sessions=3, now=10.0)
    assert effects == [Note("draining", "3 sessions open"), Publish(urgent=True), StartDrain(310.0)]
    assert duty.mode(LAYERS) is Mode.DRAINING
    assert duty.refuses_new_sessions and not duty.offers_model
    # The drain owns the stage: no plan moves it, a second --drain joins the first.
    assert duty.on_plan(assigned=(0, 2), planned=True, layers=LAYERS, now=11.0) == []
    assert duty.kill(drain=True, layers=LAYERS, sessions=2, now=12.0) == []
    assert duty.on_timer(309.9) == []
    effects = duty.on_drained(now=60.0)
    assert effects == [
        StopStage("killed by the operator after draining"),
        Note("killed", "drained"),
        Publish(),
    ]
    assert duty.mode(None) is Mode.KILLED and not duty.refuses_new_sessions
    assert duty.on_timer(310.0) == []  # the drain is over: its deadline means nothing now


def test_a_drain_that_times_out_stops_the_stage_anyway_and_says_so() -> None:
    duty = _serving()
    duty.drain_timeout_s = 1.0
    assert duty.kill(drain=True, layers=LAYERS, sessions=1, now=5.0)[-1] == StartDrain(6.0)
    assert duty.on_timer(5.999) == []
    effects = duty.on_timer(6.0)
    assert effects[:2] == [
        StopStage("killed by the operator after draining"),
        Note("killed", "drain timed out after 1 s"),
    ]
    assert duty.mode(None) is Mode.KILLED


def test_kill_at_once_or_recover_override_a_drain() -> None:
    duty = _serving()
    duty.kill(drain=True, layers=LAYERS, sessions=1, now=0.0)
    effects = duty.kill(drain=False, layers=LAYERS, sessions=1, now=1.0)
    assert effects[0] == CancelDrain() and effects[1] == StopStage("killed by the operator")
    assert duty.on_drained(now=2.0) == [] and duty.on_timer(1000.0) == []

    duty = _serving()
    duty.kill(drain=True, layers=LAYERS, sessions=1, now=0.0)
    assert duty.recover(now=1.0) == [CancelDrain(), Note("recovered"), Publish()]
    # The stage was never stopped: it serves on and takes new sessions again.
    assert duty.mode(LAYERS) is Mode.SERVING and not duty.refuses_new_sessions
    assert duty.on_drained(now=2.0) == [] and duty.on_timer(1000.0) == []


def test_a_drain_without_a_stage_is_a_kill_at_once() -> None:
    duty = Duty(drain_timeout_s=300.0)
    effects = duty.kill(drain=True, layers=None, sessions=0, now=0.0)
    assert effects == [StopStage("killed by the operator"), Note("killed", "at once"), Publish()]
    # Already killed: a drain has nothing to drain.
    assert duty.kill(drain=True, layers=None, sessions=0, now=1.0)[0] == StopStage(
        "killed by the operator"
    )


def test_the_graceful_stop_overrides_a_drain_and_ignores_commands() -> None:
    duty = _serving()
    duty.kill(drain=True, layers=LAYERS, sessions=2, now=0.0)
    effects = duty.begin_stop(sessions=2, now=1.0)
    assert effects == [CancelDrain(), Note("stopping", "2 sessions open"), Publish(urgent=True)]
    assert duty.mode(LAYERS) is Mode.STOPPING and duty.refuses_new_sessions
    assert not duty.offers_model and duty.stopping
    assert duty.kill(drain=False, layers=LAYERS, sessions=2, now=2.0) == [
        Ignored("this node is stopping")
    ]
    assert duty.recover(now=2.0) == [Ignored("this node is stopping")]
    assert duty.on_plan(assigned=(0, 2), planned=True, layers=LAYERS, now=3.0) == []
    assert duty.on_drained(now=4.0) == []
    effects = duty.finish_stop(sessions=2, now=30.0)
    assert effects == [
        StopStage("the node is stopping"),
        Note("stopped", "2 sessions handed over"),
        Publish(),
    ]
    assert duty.finish_stop(sessions=0, now=31.0)[1] == Note("stopped", "drained")
