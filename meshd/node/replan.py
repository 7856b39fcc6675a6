"""`PlanLoop`: a node's leaderless planning, re-run (debounced) whenever the view changes: every
model it holds (`HeldModel.replan`), then a `mesh:ID` model's background fetch steered."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from meshd.config import NodeConfig
from meshd.mesh.membership import Membership
from meshd.node.fetch import FETCH_RETRY_S, ArtifactService
from meshd.node.held_model import HeldModel
from meshd.node.planning import assignment
from meshd.node.prefetch import TakeoverCache

# Membership changes arriving within this window cause one re-plan, not many (how the parts
# work, not a deployment: not configuration).
REPLAN_DEBOUNCE_S = 0.2


class PlanLoop:
    """Re-plans `models` over `membership`'s view after each `request`, in `run`."""

    def __init__(
        self,
        config: NodeConfig,
        models: Sequence[HeldModel],
        membership: Membership,
        artifacts: ArtifactService,
        nursery: trio.Nursery,
    ) -> None:
        self.config = config
        self.models = models
        self.membership = membership
        self.artifacts = artifacts
        self._nursery = nursery
        self.takeover = TakeoverCache()
        self._requested = trio.Event()
        self._changed = trio.Event()

    def request(self) -> None:
        """Re-plan soon (debounced)."""
        self._requested.set()

    async def wait_change(self, timeout_s: float) -> None:
        """Return after the next re-plan, or after `timeout_s`."""
        with trio.move_on_after(timeout_s):
            await self._changed.wait()

    async def run(self) -> None:
        while True:
            await self._requested.wait()
            await trio.sleep(REPLAN_DEBOUNCE_S)
            self._requested = trio.Event()
            await self._replan_once()

    async def _replan_once(self) -> None:
        node_key = self.membership.node_id
        for model in self.models:
            view, rtt = self.membership.view(), self.membership.rtt_matrix()
            await model.replan(view, rtt, node_key, trio.current_time())
        await self._steer_fetch(self.models[0])
        self._changed.set()
        self._changed = trio.Event()

    async def _steer_fetch(self, model: HeldModel) -> None:
        """A `mesh:ID` model's background fetch after a re-plan: a stage still to load keeps
        its fetch (`ArtifactService.stage_ready` started it); a spare prefetches the layers it
        would take over (`prefetch` key, `meshd/node/prefetch.py`); otherwise none. With no
        plan at all, whatever runs goes on (like the stage, kept for a later plan)."""
        new, config, node_key = model.plan, self.config, self.membership.node_id
        if new is None or not self.artifacts.fetches:
            return
        assigned = assignment(new, node_key)
        if not model.duty.offers_model:
            self.artifacts.stop_fetching()
        elif assigned is not None:
            if assigned == model.slot.layers:
                self.artifacts.stop_fetching()
        elif config.prefetch and model.slot.layers is None:
            view, rtt = self.membership.view(), self.membership.rtt_matrix()  # fresh copies
            # One plan per stage: in a thread, so a large mesh's planning never stalls lanes.
            ranges = await trio.to_thread.run_sync(
                lambda: self.takeover.ranges(
                    view,
                    model.files.shape,
                    rtt,
                    new,
                    node_key,
                    context_tokens=model.files.context_tokens,
                    config=config.planner,
                )
            )
            await self.artifacts.prefetch(ranges, max_bytes=config.prefetch_max_bytes)
        else:
            self.artifacts.stop_fetching()

    def on_fetch_end(self, ok: bool) -> None:
        """A background fetch ended: re-plan now (the stage it was for loads), or after a
        failure a little later (and so try again)."""
        if ok:
            self.request()
        else:
            self._nursery.start_soon(self._request_after, FETCH_RETRY_S)

    async def _request_after(self, delay_s: float) -> None:
        await trio.sleep(delay_s)
        self.request()
