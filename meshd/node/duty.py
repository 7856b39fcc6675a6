"""`Duty`: what this node's stage is for, under the plan and the operator's commands.

Sans-IO: each method takes `now` (and what the caller knows of the stage: the layers it
hosts, its open sessions) and returns the effects to carry out, in order; nothing here reads
a clock or does I/O. The daemon (`MeshNode`) carries them out: `StopStage` and `LoadStage` on
its `StageSlot`, `Note` in the event log, `Publish` to membership, `StartDrain`/`CancelDrain`
on the task that waits for the stage's sessions to end.

The modes (`Mode`):
- SERVING: in the plan, hosting its layers; SPARE: offering the model, not in the plan.
- DRAINING (`meshctl kill --drain`): the stage serves its open sessions, refuses new ones
  and is left out of every plan; it stops when they end or at `drain_timeout_s`.
- KILLED (`meshctl kill`, or after a drain): hosts nothing and offers nothing until
  `meshctl recover`, which makes it a spare again.
- STOPPING (SIGTERM, `meshd/node/shutdown.py`): like a drain the operator cannot undo; the
  stop ends it (`finish_stop`).
A kill at once or a recover overrides a drain in progress; a second `--drain` joins the first;
a stopping node ignores both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

Layers = tuple[int, int]


class Mode(enum.Enum):
    """What the node's stage does now."""

    SERVING = "serving"
    SPARE = "spare"
    DRAINING = "draining"
    KILLED = "killed"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class StopStage:
    """Stop the hosted stage; its open sessions fail with `stage_stopped` and `reason`."""

    reason: str


@dataclass(frozen=True, slots=True)
class LoadStage:
    """Load and serve `layers` (stopping the current stage first)."""

    layers: Layers


@dataclass(frozen=True, slots=True)
class Note:
    """Add `kind` (about this node) to the operator's event log."""

    kind: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Publish:
    """Re-sign the capacity record (`urgent`: at once, so plans move off this node now)."""

    urgent: bool = False


@dataclass(frozen=True, slots=True)
class StartDrain:
    """Wait until the stage has no session or `deadline` passes, then call `on_drained` or
    `on_timer`."""

    deadline: float


@dataclass(frozen=True, slots=True)
class CancelDrain:
    """Stop waiting for the drain started before (a command overrode it)."""


@dataclass(frozen=True, slots=True)
class Ignored:
    """The command was ignored, for `reason` (log it; nothing changes)."""

    reason: str


Effect = StopStage | LoadStage | Note | Publish | StartDrain | CancelDrain | Ignored


class Duty:
    """The stage's duty state; `kill`, `recover`, the drain's end, the graceful stop and each
    new plan move it."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = drain_timeout_s
        # Killed by the operator (or stopped): hosts nothing, offers nothing.
        self.disabled = False
        # A drain or a stop is in progress: open sessions are served, new ones refused, and
        # the node is left out of every plan.
        self.draining = False
        # SIGTERM: the node admits nothing new and ignores kill/recover.
        self.stopping = False
        # When the drain in progress ends at the latest (None: no drain is waiting).
        self.drain_deadline: float | None = None

    # ---- what the rest of the node reads ----------------------------------------------------
    @property
    def offers_model(self) -> bool:
        """Whether the capacity record offers the model (plans may place a stage here)."""
        return not (self.disabled or self.draining)

    @property
    def refuses_new_sessions(self) -> bool:
        """Whether the stage refuses sessions it does not hold yet."""
        return self.draining

    def mode(self, layers: Layers | None) -> Mode:
        """The mode, given the layers the stage hosts now."""
        if self.stopping:
            return Mode.STOPPING
        if self.draining:
            return Mode.DRAINING
        if self.disabled:
            return Mode.KILLED
        return Mode.SERVING if layers is not None else Mode.SPARE

    # ---- operator commands -----------------------------------------------------------------
    def kill(
        self, *, drain: bool, layers: Layers | None, sessions: int, now: float
    ) -> list[Effect]:
        """`meshctl kill [--drain]`: stop hosting, at once or after the open sessions end.

        A drain needs a stage to drain: without one (or when already killed) it is a kill at once.
        """
        if self.stopping:
            return [Ignored("this node is stopping")]
        if drain and layers is not None and not self.disabled:
            if self.draining:
                return []  # a second --drain joins the first
            self.draining = True
            self.drain_deadline = now + self.drain_timeout_s
            return [
                Note("draining", f"{sessions} sessions open"),
                Publish(urgent=True),  # new requests plan around us while ours finish
                StartDrain(self.drain_deadline),
            ]
        effects = self._cancel_drain()
        self.disabled = True
        return [*effects, StopStage("killed by the operator"), Note("killed", "at once"), Publish()]

    def recover(self, now: float) -> list[Effect]:
        """`meshctl recover`: offer the model again (the node becomes a spare)."""
        if self.stopping:
            return [Ignored("this node is stopping")]
        effects = self._cancel_drain()
        self.disabled = False
        return [*effects, Note("recovered"), Publish()]

    def on_drained(self, now: float) -> list[Effect]:
        """The draining stage has no session left: stop it."""
        return self._end_drain(timed_out=False)

    def on_timer(self, now: float) -> list[Effect]:
        """Time passed: a drain still waiting at its deadline stops the stage anyway."""
        if self.drain_deadline is None or now < self.drain_deadline:
            return []
        return self._end_drain(timed_out=True)

    def _end_drain(self, *, timed_out: bool) -> list[Effect]:
        if self.drain_deadline is None:
            return []  # overridden meanwhile
        self.drain_deadline = None
        self.disabled = True
        self.draining = False
        detail = f"drain timed out after {self.drain_timeout_s:g} s" if timed_out else "drained"
        return [
            StopStage("killed by the operator after draining"),
            Note("killed", detail),
            Publish(),
        ]

    def _cancel_drain(self) -> list[Effect]:
        """A kill at once, a recover or a stop overrides a drain in progress."""
        waiting = self.drain_deadline is not None
        self.drain_deadline = None
        self.draining = False
        return [CancelDrain()] if waiting else []

    # ---- graceful stop ---------------------------------------------------------------------
    def begin_stop(self, *, sessions: int, now: float) -> list[Effect]:
        """SIGTERM: admit nothing new and stop offering the model, so every plan moves to a
        spare at once, while the stage keeps serving the sessions it has."""
        effects = self._cancel_drain()
        self.stopping = True
        self.draining = True
        return [*effects, Note("stopping", f"{sessions} sessions open"), Publish(urgent=True)]

    def finish_stop(self, *, sessions: int, now: float) -> list[Effect]:
        """End the stop: the stage stops, and sessions still open go to the spare."""
        self.disabled = True
        detail = f"{sessions} sessions handed over" if sessions else "drained"
        return [StopStage("the node is stopping"), Note("stopped", detail), Publish()]

    # ---- the plan --------------------------------------------------------------------------
    def on_plan(
        self, *, assigned: Layers | None, planned: bool, layers: Layers | None, now: float
    ) -> list[Effect]:
        """A new plan (`planned`: one exists) assigns this node `assigned` (None: not in it);
        the stage hosts `layers`. Load or stop to match, unless a drain or stop owns the stage.

        Not in the plan: the stage stops only when a plan exists without this node (or it is
        killed); with no plan at all, it keeps what it holds for a later one.
        """
        if self.draining:
            return []  # the drain (or the stop) owns the stage until its sessions end
        wanted = None if self.disabled else assigned
        if wanted == layers:
            return []
        if wanted is not None:
            # Urgent: every planner keeps loaded stages where they are (sticky plans), but
            # only once this node's record says it holds them; a node recovered meanwhile,
            # planned against the rate-limited record, could take the stage straight back.
            # Loads are rare (a plan change), so this cannot flood.
            loaded = Note("stage-loaded", f"layers {list(wanted)}")
            return [LoadStage(wanted), loaded, Publish(urgent=True)]
        if planned or self.disabled:
            return [StopStage("not in the plan"), Note("stage-stopped"), Publish()]
        return [Publish()]
