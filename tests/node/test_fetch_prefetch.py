"""A `mesh:ID` spare prefetches, with real daemons: one holds the built-in checkpoint, two
start with `--model mesh:ID` and serve the other stages, and a fourth `mesh:ID` node joins as
the spare. It fetches ahead the layers it would take over; when a stage's node is SIGKILLed,
it serves that stage from its own store (no fetch after the kill) and the mesh answers the
greedy tokens of single-process decoding (what an all-local mesh answers, `test_daemon`).
With `--no-prefetch` the same spare fetches the stage after the kill instead.
"""

from __future__ import annotations

import pathlib
import time

import pytest

from meshd.cli.supervisor import (
    agreed_plan,
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
)
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.tokenizer import Tokenizer
from meshd.node.fetch import stage_tensor_names
from tests.node.daemons import Daemon, loopback
from tests.node.test_fetch_mesh import PROMPT, _reference, _tokens

pytestmark = pytest.mark.slow

HOLDER_PORT = 17441
SECRET = "meshd-prefetch-secret-0123456789"


def _fetcher(tmp: pathlib.Path, index: int, budget: int, model_id: str, *flags: str) -> Daemon:
    join = ("--join", f"{loopback(41)}:{HOLDER_PORT}", "--model", f"mesh:{model_id[:16]}")
    return Daemon(tmp, index, secret=SECRET, budget=budget, extra=(*join, *flags))


def _stored(d: Daemon, model_id: str) -> set[str]:
    tensors = d.state / "models" / model_id / "tensors"
    return {p.name.removesuffix(".safetensors") for p in tensors.glob("*.safetensors")}


def _story(daemons: list[Daemon], since: float) -> dict[str, list[str]]:
    """Each daemon's events since `since` (plans, loads, fetches): why a plan came out so."""
    return {
        d.name: [
            f"{e['at_unix_s'] - since:+.2f} {e['kind']} {e.get('detail', '')}"
            for e in d.status()["events"]
            if e["at_unix_s"] >= since - 5
        ]
        for d in daemons
    }


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_a_spare_prefetches_and_takes_over_a_killed_stage_without_fetching(
    tmp_path: pathlib.Path, prefetch: bool
) -> None:
    checkpoint = Checkpoint.open(builtin_model_dir())
    model_id = checkpoint.model_id
    budget = stage_budget(str(builtin_model_dir()), 3)
    holder = Daemon(
        tmp_path, 41, secret=SECRET, budget=budget, extra=("--listen-port", str(HOLDER_PORT))
    )
    stages = [holder, _fetcher(tmp_path, 42, budget, model_id)]
    stages.append(_fetcher(tmp_path, 43, budget, model_id))
    daemons = list(stages)
    try:
        started(stages, timeout_s=120)
        plan = agreed_plan(stages, timeout_s=120, stable_s=1.0)
        assert len(plan) == 3, plan
        # The spare joins a settled mesh: plans are sticky, so it stays out of the plan.
        flags = () if prefetch else ("--no-prefetch",)
        spare = _fetcher(tmp_path, 44, budget, model_id, *flags)
        daemons.append(spare)
        started([spare], timeout_s=120)

        # The victim serves a stage of a mesh:ID node (not the files' holder).
        victim = stages[1]
        lo, hi = victim.status()["stage_layers"]
        wanted = set(stage_tensor_names(checkpoint.config, lo, hi))

        def spare_ready() -> bool:
            status = spare.try_status()
            if status is None or settled_plan(daemons) != plan:
                return False
            if not prefetch:
                return True
            # Its prefetch ended, and it holds every tensor of the victim's stage.
            fetch = status["fetch"]
            done = bool(fetch) and fetch["state"] == "done" and "prefetch" in fetch["what"]
            return done and wanted <= _stored(spare, model_id)

        wait_until(spare_ready, 120, "the spare, prefetched")
        assert spare.status()["stage_layers"] is None
        before = spare.status()["fetch"]
        if prefetch:
            assert before["done_bytes"] == before["total_bytes"] > 0
        else:
            assert before is None and not _stored(spare, model_id)

        victim_key = victim.key()
        victim.kill()
        killed_at = time.time()
        survivors = [d for d in daemons if d is not victim]

        def moved() -> bool:
            now = settled_plan(survivors)
            return now is not None and victim_key not in {s["key"] for s in now}

        wait_until(moved, 60, "a plan without the killed node, loaded")
        after = settled_plan(survivors)
        assert after is not None and len(after) == 3, after
        status = spare.status()
        assert status["stage_layers"] == [lo, hi], (after, _story(survivors, killed_at))
        loaded_at = [
            e["at_unix_s"]
            for e in status["events"]
            if e["kind"] == "stage-loaded" and e["at_unix_s"] >= killed_at
        ]
        fetches = [
            e["kind"]
            for e in status["events"]
            if e["kind"] in ("fetch", "prefetch") and e["at_unix_s"] >= killed_at
        ]
        assert loaded_at, status["events"]
        if prefetch:  # nothing crossed after the kill: the last fetch is still a prefetch
            last = status["fetch"]
            assert fetches == [] and last["what"].startswith("prefetch"), (fetches, last)
        else:
            assert fetches == ["fetch"] and status["fetch"]["what"] == f"layers [{lo}, {hi})"
        print(
            f"prefetch={prefetch}: the spare loaded layers [{lo}, {hi}) "
            f"{loaded_at[0] - killed_at:.2f} s after SIGKILL"
        )
        prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
        expected = _reference(prompt)
        for d in survivors:
            assert _tokens(d, prompt) == expected, d.name
    finally:
        kill_all(daemons)
