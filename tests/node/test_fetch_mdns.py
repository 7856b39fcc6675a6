"""A `mesh:ID` node's first start with mDNS only (no `join` address), with real daemons on
loopback: it finds a member holding the model among the peers mDNS shows, fetches the manifest
and small files from it, joins, and fetches its stage; the mesh answers the greedy tokens of
single-process decoding. One of them starts before any holder is up, and waits for one."""

from __future__ import annotations

import pathlib

import pytest

from meshd.cli.supervisor import agreed_plan, kill_all, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.tokenizer import Tokenizer
from tests.node.daemons import SECRET, Daemon, loopback
from tests.node.test_fetch_mesh import PROMPT, _reference, _tokens

pytestmark = pytest.mark.slow


def test_a_mesh_id_node_finds_its_manifest_by_mdns_alone(tmp_path: pathlib.Path) -> None:
    checkpoint = Checkpoint.open(builtin_model_dir())
    model_id = checkpoint.model_id
    budget = stage_budget(str(builtin_model_dir()), 3)
    mesh_id = ("--model", f"mesh:{model_id[:12]}")
    early = Daemon(tmp_path, 52, secret=SECRET, budget=budget, extra=mesh_id)
    daemons = [early]
    try:
        # Started first: it looks for a holder by mDNS and waits (it cannot listen before
        # it knows the model's config).
        wait_until(
            lambda: "looking for a member holding it by mDNS" in early.log_tail(20_000),
            60,
            "the early node looking for a holder",
        )
        holder = Daemon(tmp_path, 51, secret=SECRET, budget=budget)
        late = Daemon(tmp_path, 53, secret=SECRET, budget=budget, extra=mesh_id)
        daemons += [holder, late]
        started(daemons, timeout_s=120)
        plan = agreed_plan(daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 3, plan
        # The early node could only ask the holder; the late one any member holding the model
        # (the early node serves the manifest and small files too, once it has them).
        assert f"(manifest from ('{loopback(51)}'" in early.log_tail(200_000)
        late_log = late.log_tail(200_000)
        assert any(f"(manifest from ('{loopback(i)}'" in late_log for i in (51, 52)), late_log
        for d in (early, late):
            status = d.status()
            assert status["model_id"] == model_id and status["fetch"]["state"] == "done"
        prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
        expected = _reference(prompt)
        for d in daemons:
            assert _tokens(d, prompt) == expected, d.name
    finally:
        kill_all(daemons)
