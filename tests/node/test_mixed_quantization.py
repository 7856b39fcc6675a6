"""A mixed mesh with real daemons: one holds the model at q8_0 (given as `--quantization int8`,
its old name), one at full precision.

Nodes of one plan must agree on the quantization (different quantizations give different
tokens), so each plans over the nodes at its own: both are members of one mesh, each serves its
requests on its own quantization's plan, and both answer under the same model id. Each
daemon's tokens are single-process greedy decoding at its quantization.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import httpx
import pytest
import torch

from meshd.bench.single_node import generate
from meshd.cli.supervisor import kill_all, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import GenerateOp, request_lines
from tests.node.daemons import Daemon, loopback
from tests.node.test_daemon import meshctl

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
INT8_PORT = 17411
# This module's own mesh: daemons of other test modules running beside it never join it.
SECRET = "meshd-mixed-quantization-secret-0123"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Daemon]]:
    tmp: pathlib.Path = tmp_path_factory.mktemp("mixed")
    budget = stage_budget(str(builtin_model_dir()), 1)  # either node holds the model alone
    # The flag's old name: the node holds, reports and plans over q8_0.
    int8 = ("--quantization", "int8", "--listen-port", str(INT8_PORT))
    daemons = {
        "q8_0": Daemon(tmp, 11, secret=SECRET, budget=budget, extra=int8),
        "none": Daemon(tmp, 12, secret=SECRET, budget=budget, extra=("--join", f"{loopback(11)}:{INT8_PORT}")),
    }  # fmt: skip
    try:
        started(daemons.values())
        yield daemons
    finally:
        kill_all(daemons.values())


def reference(prompt: list[int], quantization: str) -> list[int]:
    torch.set_num_threads(1)
    checkpoint = Checkpoint.open(builtin_model_dir())
    n = checkpoint.config.num_layers
    stage = StageModel.load(checkpoint, 0, n, device="cpu", quantization=quantization)
    return generate([stage], prompt, MAX_TOKENS).tokens


def test_each_node_plans_over_its_own_quantization_and_both_answer(
    mesh: dict[str, Daemon],
) -> None:
    nodes = list(mesh.values())
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 20, "two members each")

    def serving_alone(d: Daemon) -> bool:
        s = d.try_status()
        if s is None or [p["key"] for p in s["plan"]] != [s["key"]] or s["stage_layers"] != [0, 6]:
            return False
        # ... and the other's signed record, with its loaded stage, has reached this node.
        return all(m["weight_bytes"] > 0 for m in s["members"] if m["key"] in keys)

    wait_until(lambda: all(serving_alone(d) for d in nodes), 30, "each node serving its plan")
    for quantization, d in mesh.items():
        status = json.loads(meshctl("status", "--json", "--socket", d.socket))
        assert status["quantization"] == status["plan_quantization"] == quantization
        # Each sees the other's quantization and the bytes its stage holds (q8_0: about a
        # quarter of fp32's).
        rows = {m["key"]: m for m in status["members"]}
        held = {q: rows[mesh[q].key()]["weight_bytes"] for q in mesh}
        assert {q: rows[mesh[q].key()]["quantization"] for q in mesh} == {q: q for q in mesh}
        assert 0 < held["q8_0"] < 0.3 * held["none"], held
        assert status["weight_bytes"] == held[quantization]
        assert status["plan"][0]["weight_bytes"] == held[quantization]
        assert f"quantization {quantization}" in meshctl("plan", "--socket", d.socket)
        assert f"ms/token), quantization {quantization}" in meshctl("status", "--socket", d.socket)

    prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
    op = GenerateOp(prompt=prompt, max_tokens=MAX_TOKENS, strategy="disabled", ignore_eos=True)
    tokens = {}
    for quantization, d in mesh.items():
        final = list(request_lines(d.socket, op, timeout_s=60))[-1]
        assert final["ok"], final
        tokens[quantization] = final["tokens"]
        assert tokens[quantization] == reference(prompt, quantization), quantization

    # The OpenAI endpoint of either node answers under one model id.
    ids = set()
    for d in nodes:
        models = httpx.get(f"{d.api_url}/models", timeout=30).json()
        ids.add(tuple(m["id"] for m in models["data"]))
        body = {"model": models["data"][0]["id"], "prompt": PROMPT, "max_tokens": 8}
        reply = httpx.post(f"{d.api_url}/completions", json={**body, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    assert ids == {("meshd-builtin",)}
