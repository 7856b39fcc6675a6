"""Real `meshd serve` daemons on loopback: discovery, planning, generation, recovery, meshctl.

One mesh serves the whole module, in order (each test leaves the mesh as the next expects):
three daemons started with only a shared secret find each other by mDNS and plan a 3-stage
split (memory budgets rule out fewer stages), while a daemon with another secret is never
admitted; a generation through the daemon equals single-node greedy decoding; a fourth
daemon joins as a spare; `meshctl kill` moves the killed node's stage (and only it) onto the
spare and `meshctl recover` brings the node back as the new spare; SIGKILL of a stage
mid-generation is survived on the spare with identical output; a second SIGKILL, with no
spare left, answers ServiceUnavailable fast.
"""

from __future__ import annotations

import json
import pathlib
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshd.cli.supervisor import kill_all, settled_plan, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.decode import generate as single_node_generate
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import GenerateOp, request_lines
from protocol.datagram import KIND_DATA, KIND_INITIATION
from protocol.handshake import MIN_INITIATION_BYTES
from protocol.packet import HEADER
from tests.node.daemons import OTHER_SECRET, REPO, SECRET, Daemon

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
# The first daemon's lane port, fixed so the intruder can be told to --join it from the start.
FIRST_PORT = 17391


def three_stage_budget() -> int:
    """A per-node memory budget where 3 nodes hold the built-in model and 2 cannot."""
    return stage_budget(str(builtin_model_dir()), 3)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """Single-node greedy decoding of the whole model in this process."""
    torch.set_num_threads(1)
    checkpoint = Checkpoint.open(builtin_model_dir())
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    return single_node_generate([stage], prompt, max_tokens).tokens


@dataclass
class Mesh:
    tmp: pathlib.Path
    budget: int
    daemons: dict[int, Daemon] = field(default_factory=dict)
    all_listening_at: float = 0.0
    intruder: Daemon | None = None
    killed: list[int] = field(default_factory=list)

    def alive(self) -> list[Daemon]:
        return [d for i, d in self.daemons.items() if i not in self.killed]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(tmp_path_factory.mktemp("mesh"), three_stage_budget())
    try:
        for i in (2, 3, 4):
            port = ("--listen-port", str(FIRST_PORT)) if i == 2 else ()
            m.daemons[i] = Daemon(m.tmp, i, secret=SECRET, budget=m.budget, extra=port)
        # Another mesh's daemon dials the first one directly (mDNS would not even show it).
        join = ("--join", f"127.0.0.2:{FIRST_PORT}")
        m.intruder = Daemon(m.tmp, 9, secret=OTHER_SECRET, budget=m.budget, extra=join)
        m.all_listening_at = started(m.daemons.values())
        started([m.intruder])
        yield m
    finally:
        kill_all([*m.daemons.values(), *([m.intruder] if m.intruder else [])])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.open(builtin_model_dir())


def run_generation(
    d: Daemon, op: GenerateOp, lines: list[tuple[float, dict[str, Any]]], first: threading.Event
) -> None:
    for line in request_lines(d.socket, op, timeout_s=60):
        lines.append((time.time(), line))
        first.set()
    first.set()


def meshctl(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "meshd.cli.meshctl", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


# ---- the tests, in mesh order -------------------------------------------------------------


def test_three_daemons_find_each_other_and_plan_three_stages(mesh: Mesh) -> None:
    nodes = list(mesh.daemons.values())
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 10, "three members each")
    found_s = time.monotonic() - mesh.all_listening_at
    print(f"three daemons found each other {found_s:.2f} s after the last one listened")
    assert found_s < 2.0

    wait_until(lambda: settled_plan(nodes) is not None, 30, "a settled plan")
    agreed = settled_plan(nodes)
    assert agreed is not None and len(agreed) == 3
    assert {s["key"] for s in agreed} == keys
    bounds = [b for s in agreed for b in s["layers"]]
    assert bounds[0] == 0 and bounds[-1] == 6 and bounds[1:-1:2] == bounds[2:-1:2]  # contiguous

    assert mesh.intruder is not None
    intruder_key = mesh.intruder.key()
    assert all(intruder_key not in d.alive_members() and intruder_key not in
               {m["key"] for m in d.status()["members"]} for d in nodes)  # fmt: skip
    assert {m["key"] for m in mesh.intruder.status()["members"]} == {intruder_key}


def test_generation_equals_single_node_greedy(mesh: Mesh, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    op = GenerateOp(prompt=prompt, max_tokens=40, ignore_eos=True)
    lines = list(request_lines(mesh.daemons[2].socket, op, timeout_s=60))
    final = lines[-1]
    assert final["ok"], final
    assert final["tokens"] == reference(prompt, 40)
    streamed = [t for line in lines[:-1] for t in line["tokens"]]
    assert streamed == final["tokens"]

    # The same node serves the OpenAI endpoint over NodeBackend.
    api = mesh.daemons[2].api_url
    models = httpx.get(f"{api}/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["meshd-builtin"]
    body = {"model": "meshd-builtin", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{api}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_forged_datagrams_at_a_lane_port_show_in_status_and_metrics_by_reason(
    mesh: Mesh,
) -> None:
    target = mesh.daemons[2]
    before = target.status()["datagrams_dropped"]
    assert set(before) == {"undecryptable", "replayed", "unknown_lane", "malformed"}
    rng = random.Random(20)
    forged = {
        "malformed": [b"\xff" + rng.randbytes(40) for _ in range(5)],  # no known kind
        "unknown_lane": [  # a DATA header for a lane id nobody opened
            HEADER.pack(KIND_DATA, 0, rng.getrandbits(32), 1) + rng.randbytes(40) for _ in range(4)
        ],
        "undecryptable": [  # initiation-shaped, with a mac1 not keyed by the node's key
            bytes([KIND_INITIATION, 1]) + rng.randbytes(MIN_INITIATION_BYTES - 2) for _ in range(3)
        ],
    }
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for datagrams in forged.values():
            for data in datagrams:
                sock.sendto(data, ("127.0.0.2", FIRST_PORT))

    def dropped() -> dict[str, int]:
        return dict(target.status()["datagrams_dropped"])

    def all_counted() -> bool:
        now = dropped()
        return all(now[r] - before[r] >= len(forged[r]) for r in forged)

    wait_until(all_counted, 10, "the forged datagrams counted by reason")
    status = json.loads(meshctl("status", "--json", "--socket", target.socket))
    assert set(status["handshakes_refused"]) >= {"version", "not_admitted", "replayed"}
    root = target.api_url.removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10).text
    exported = {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "meshd_datagrams_dropped_total"
    }
    for reason in forged:
        assert exported[reason] - before[reason] >= len(forged[reason])
    assert any(s.name == "meshd_handshakes_refused_total" for f in
               text_string_to_metric_families(text) for s in f.samples)  # fmt: skip
    table = meshctl("status", "--socket", target.socket)
    line = next(x for x in table.splitlines() if x.startswith("dropped datagrams:"))
    assert all(f"{reason} " in line for reason in forged)


def test_meshctl_kill_moves_the_stage_to_a_spare_and_recover_brings_the_node_back(
    mesh: Mesh,
) -> None:
    mesh.daemons[5] = spare = Daemon(mesh.tmp, 5, secret=SECRET, budget=mesh.budget)
    started([spare])
    nodes = mesh.alive()
    keys = {d.key() for d in nodes}
    wait_until(lambda: all(d.alive_members() == keys for d in nodes), 10, "four members each")
    wait_until(lambda: settled_plan(nodes) is not None, 30, "a settled plan with the spare")
    before = settled_plan(nodes)
    assert before is not None and spare.key() not in {s["key"] for s in before}

    coordinator = mesh.daemons[2]
    victim = next(d for d in nodes if d.key() != coordinator.key() and d is not spare)
    sock = ("--socket", coordinator.socket)
    assert "killed" in meshctl("kill", victim.key()[:12], *sock)

    def spare_took_over() -> bool:
        plan_now = settled_plan(nodes)
        return plan_now is not None and spare.key() in {s["key"] for s in plan_now}

    wait_until(spare_took_over, 20, "the spare to serve the killed node's place")
    moved = settled_plan(nodes)
    assert moved is not None and len(moved) == 3 and victim.key() not in {s["key"] for s in moved}
    # Only the killed node's stage moved: the spare serves its layers, the others keep theirs.
    swap = {victim.key(): spare.key()}
    assert moved == [{**s, "key": swap.get(s["key"], s["key"])} for s in before]
    status = json.loads(meshctl("status", "--json", *sock))
    row = next(m for m in status["members"] if m["key"] == victim.key())
    assert not row["offers_model"] and row["loaded_layers"] is None
    assert victim.status()["disabled"] and victim.status()["stage_layers"] is None
    text = meshctl("status", *sock)
    assert victim.key()[:16] in text and "plan" in text
    assert spare.key()[:16] in meshctl("plan", *sock)

    assert "recovered" in meshctl("recover", victim.key()[:12], *sock)

    def victim_offers_again() -> bool:
        s = json.loads(meshctl("status", "--json", *sock))
        return any(m["key"] == victim.key() and m["offers_model"] for m in s["members"])

    wait_until(victim_offers_again, 20, "the recovered node to offer the model again")
    assert not victim.status()["disabled"]
    wait_until(lambda: settled_plan(nodes) is not None, 20, "a settled plan after recover")
    assert settled_plan(nodes) == moved  # the recovered node is a spare now: nothing moves


def _kill_mid_generation(
    mesh: Mesh, tokenizer: Tokenizer, max_tokens: int
) -> tuple[Daemon, float, list[tuple[float, dict[str, Any]]], int]:
    nodes = mesh.alive()
    wait_until(lambda: settled_plan(nodes) is not None, 30, "a settled plan")
    agreed = settled_plan(nodes)
    assert agreed is not None
    coordinator = mesh.daemons[2]
    victim = next(
        d for d in nodes if d is not coordinator and d.key() in {s["key"] for s in agreed}
    )
    op = GenerateOp(
        prompt=tokenizer.encode(PROMPT), max_tokens=max_tokens, strategy="disabled", ignore_eos=True
    )
    lines: list[tuple[float, dict[str, Any]]] = []
    first = threading.Event()
    thread = threading.Thread(target=run_generation, args=(coordinator, op, lines, first))
    thread.start()
    assert first.wait(60)
    killed_at = time.time()
    victim.kill()
    mesh.killed.append(victim.index)
    before = sum(len(line.get("tokens", [])) for _, line in lines if "ok" not in line)
    thread.join(60)
    assert not thread.is_alive()
    return victim, killed_at, lines, before


def test_sigkill_of_a_stage_mid_generation_recovers_on_the_spare(
    mesh: Mesh, tokenizer: Tokenizer
) -> None:
    max_tokens = 150
    victim, killed_at, lines, before = _kill_mid_generation(mesh, tokenizer, max_tokens)
    final = lines[-1][1]
    assert final["ok"], final
    assert 0 < before < max_tokens, "the kill did not land mid-generation"
    assert final["tokens"] == reference(tokenizer.encode(PROMPT), max_tokens)
    detected = mesh.daemons[2].first_event("lane-lost", victim.key(), killed_at)
    assert detected is not None
    print(f"stage death detected {detected - killed_at:.2f} s after SIGKILL")
    assert detected - killed_at <= 1.5
    assert mesh.daemons[2].status()["recoveries"] >= 1


def test_sigkill_without_a_spare_answers_service_unavailable_fast(
    mesh: Mesh, tokenizer: Tokenizer
) -> None:
    victim, killed_at, lines, _ = _kill_mid_generation(mesh, tokenizer, 150)
    answered_at, final = lines[-1]
    assert not final["ok"] and final["code"] == "service_unavailable", final
    detected = mesh.daemons[2].first_event("lane-lost", victim.key(), killed_at)
    assert detected is not None
    print(
        f"death detected {detected - killed_at:.2f} s after SIGKILL; "
        f"503 {answered_at - detected:.3f} s after detection"
    )
    assert detected - killed_at <= 1.5
    assert answered_at - detected <= 1.5
