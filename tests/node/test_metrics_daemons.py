"""Every family `/metrics` exports is set by the daemon: three real daemons, a request, a stage
SIGKILLed (its lane dies, the plan shrinks to the two survivors), another request, then the
coordinator's `/metrics` read family by family.

Each exported family has a check here (a family with none fails the test, so a new one cannot
be added untested): counters and histograms the traffic implies count more than 0, gauges have
plausible values (the survivor's RTT > 0, one member dead, a two-stage plan), the other
families have every sample they promise. Forged NAT probes (one with a wrong tag, two genuine
ones for no punch) are counted by reason in `/metrics` and `meshctl status` alike.

The per-node budget lets two nodes hold the built-in model, so the survivors (the coordinator
among them) serve the second request, and the coordinator computes a stage of it.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.cli.supervisor import (
    agreed_plan,
    kill_all,
    settled_plan,
    stage_budget,
    started,
    wait_until,
)
from meshd.model.builtin import builtin_model_dir
from meshd.net.endpoint import DROP_REASONS, REFUSAL_REASONS
from meshd.node.node_metrics import FETCH_STATES, MEMBER_HEALTH
from meshd.stage.host import EXPIRY_CAUSES
from protocol import punch
from protocol.handshake import psk_from_secret
from tests.api.test_metrics_docs import documented_table
from tests.node.daemons import Daemon
from tests.node.test_daemon import meshctl

pytestmark = pytest.mark.slow

# Address numbers 71-73 (`loopback`) and a secret of its own: no other mesh joins this one.
SECRET = "meshd-metrics-test-" + secrets.token_hex(8)
NODES = (71, 72, 73)
MODEL = "meshd-builtin"
PROMPT = "def fibonacci(n):\n"
# From starting the daemons to the last scrape: the goal's bound (issue 34). It took 35-50 s
# on a shared 2-core machine at load 9, most of it the daemons' start (torch, compute timing).
SCENARIO_BOUND_S = 90.0

Sample = tuple[dict[str, str], float]


@pytest.fixture
def mesh(tmp_path: pathlib.Path) -> Iterator[tuple[list[Daemon], float]]:
    """The three daemons, started, and when they were (time.monotonic)."""
    budget = stage_budget(str(builtin_model_dir()), 2)
    t0 = time.monotonic()
    nodes = [Daemon(tmp_path, i, secret=SECRET, budget=budget) for i in NODES]
    try:
        yield nodes, t0
    finally:
        kill_all(nodes)


def scrape(daemon: Daemon) -> dict[str, list[Sample]]:
    """The daemon's `/metrics`: each family's samples (a counter's `_created` left out)."""
    root = daemon.api_url.removesuffix("/v1")
    reply = httpx.get(f"{root}/metrics", timeout=30)
    assert reply.status_code == 200, reply.text
    out: dict[str, list[Sample]] = {}
    families = list(text_string_to_metric_families(reply.text))
    names = {f.name for f in families}
    for family in families:
        if family.name.endswith("_created") and family.name.removesuffix("_created") in names:
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = [
            (dict(s.labels), s.value) for s in family.samples if not s.name.endswith("_created")
        ]
    return out


def value(samples: list[Sample], **labels: str) -> float:
    """The sum of a counter's or gauge's samples matching `labels`."""
    return sum(v for s_labels, v in samples if all(s_labels.get(k) == x for k, x in labels.items()))


def count(samples: list[Sample]) -> float:
    """A histogram's observations: its `+Inf` buckets summed over the label sets."""
    return sum(v for labels, v in samples if labels.get("le") == "+Inf")


def by(samples: list[Sample], label: str) -> dict[str, float]:
    return {labels[label]: v for labels, v in samples if label in labels}


def chat(daemon: Daemon, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "temperature": 0, "meshd": {"ignore_eos": True},
    }  # fmt: skip
    reply = httpx.post(f"{daemon.api_url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def scrape_mid_stream(daemon: Daemon) -> dict[str, list[Sample]]:
    """`/metrics` read while a long streamed completion is running on the mesh."""
    body = {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True,
        "meshd": {"ignore_eos": True},
    }  # fmt: skip
    with httpx.stream("POST", f"{daemon.api_url}/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        mid = scrape(daemon)
        assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
    return mid  # leaving the block hangs up: the generation is cancelled


def forge_probes(daemon: Daemon) -> None:
    """Send the daemon's lane port one forged probe and two genuine probes for no punch."""
    host, port = daemon.lane_address.rsplit(":", 1)
    genuine = punch.make_probe(punch.probe_key(psk_from_secret(SECRET)), secrets.token_bytes(16))
    forged = genuine[:-1] + bytes([genuine[-1] ^ 1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for data in (forged, genuine, genuine):
            sock.sendto(data, (host, int(port)))


def test_every_exported_family_is_set_after_a_request_and_a_kill(
    mesh: tuple[list[Daemon], float],
) -> None:
    daemons, t0 = mesh
    coordinator = daemons[0]
    started(daemons)
    keys = {d.key() for d in daemons}
    wait_until(lambda: all(d.alive_members() == keys for d in daemons), 30, "three members")
    wait_until(lambda: settled_plan(daemons) is not None, 30, "a settled plan")
    before = coordinator.status()["datagrams_dropped"]
    assert chat(coordinator, 12)["usage"]["completion_tokens"] == 12

    forge_probes(coordinator)
    # One read can miss (a status call timing out mid-request): wait for the agreed plan.
    plan = agreed_plan(daemons, timeout_s=30, stable_s=0.5)
    victim = next(
        d for d in daemons if d is not coordinator and d.key() in {s["key"] for s in plan}
    )
    victim_name = victim.status()["name"]
    survivors = [d for d in daemons if d is not victim]
    survivor_name = next(d for d in survivors if d is not coordinator).status()["name"]
    victim.kill()

    def replanned() -> bool:
        agreed = settled_plan(survivors)
        return agreed is not None and len(agreed) == 2 and victim.key() not in str(agreed)

    wait_until(replanned, 30, "a plan on the two survivors")
    dead = lambda: coordinator.member(victim.key())["status"] == "dead"  # noqa: E731
    wait_until(dead, 30, "membership to declare the victim dead")
    assert chat(coordinator, 12)["usage"]["completion_tokens"] == 12
    mid = scrape_mid_stream(coordinator)
    got = scrape(coordinator)
    took_s = time.monotonic() - t0
    status = json.loads(meshctl("status", "--json", "--socket", coordinator.socket))

    drafted = value(got["meshd_spec_drafted_tokens_total"])
    checks: dict[str, Callable[[list[Sample]], bool]] = {
        "meshd_api_requests_total": lambda s: (
            value(s, route="/v1/chat/completions", status="200") >= 2
        ),
        "meshd_api_requests_in_flight": lambda s: value(s) >= 1,  # the scrape itself
        "meshd_api_request_duration_seconds": lambda s: count(s) >= 3,
        "meshd_api_prompt_tokens_total": lambda s: value(s) > 0,
        "meshd_api_generated_tokens_total": lambda s: value(s) >= 24,
        "meshd_api_time_to_first_token_seconds": lambda s: count(s) >= 2,
        "meshd_api_time_per_output_token_seconds": lambda s: count(s) >= 22,
        # The default strategy's proposers, each with a sample from the first request on.
        "meshd_spec_drafted_tokens_total": lambda s: len(by(s, "proposer")) >= 1,
        "meshd_spec_accepted_tokens_total": lambda s: len(by(s, "proposer")) >= 1,
        "meshd_spec_draft_seconds_total": lambda s: value(s) == 0,  # no draft model here
        # Observed for each request that drafted anything.
        "meshd_spec_acceptance_ratio": lambda s: (count(s) > 0) == (drafted > 0),
        "meshd_spec_tokens_per_round_trip": lambda s: count(s) >= 2,
        "meshd_lane_deaths_total": lambda s: value(s, peer=victim_name) >= 1,
        "meshd_lane_rtt_seconds": lambda s: (
            set(by(s, "peer")) == {survivor_name} and 0 < value(s) < 1
        ),
        "meshd_lane_loss_ratio": lambda s: (
            set(by(s, "peer")) == {survivor_name} and 0 <= value(s) <= 1
        ),
        "meshd_members": lambda s: (
            by(s, "health") == {**dict.fromkeys(MEMBER_HEALTH, 0.0), "alive": 2.0, "dead": 1.0}
        ),
        "meshd_sessions_hosted": lambda s: value(s) >= 0,
        "meshd_sessions_coordinated": lambda s: value(s) >= 0,
        "meshd_kv_used_bytes": lambda s: value(s) >= 0,
        "meshd_kv_budget_bytes": lambda s: value(s) > 0,  # it holds a stage
        "meshd_draft_sessions": lambda s: value(s) == 0,  # no draft model here
        "meshd_draft_kv_used_bytes": lambda s: value(s) == 0,
        "meshd_draft_prefix_cache_bytes": lambda s: value(s) == 0,
        "meshd_plan_stages": lambda s: by(s, "model") == {MODEL: 2.0},
        "meshd_plan_predicted_seconds_per_token": lambda s: 0 < value(s, model=MODEL) < 10,
        "meshd_fetch_done_bytes": lambda s: value(s) == 0,  # it holds its files: no fetch
        "meshd_fetch_total_bytes": lambda s: value(s) == 0,
        "meshd_fetch_state": lambda s: (
            by(s, "state") == {**dict.fromkeys(FETCH_STATES, 0.0), "none": 1.0}
        ),
        "meshd_datagrams_dropped_total": lambda s: (
            set(by(s, "reason")) == set(DROP_REASONS)
            and value(s, reason="unknown_probe") - before["unknown_probe"] >= 2
            and value(s, reason="undecryptable") - before["undecryptable"] >= 1
        ),
        "meshd_handshakes_refused_total": lambda s: set(by(s, "reason")) == set(REFUSAL_REASONS),
        "meshd_stage_sessions_expired_total": lambda s: set(by(s, "cause")) == set(EXPIRY_CAUSES),
        "meshd_trio_tasks": lambda s: value(s) > 10,
        "meshd_stage_compute_seconds": lambda s: count(s) > 0 and MODEL in by(s, "model"),
        # Every request looks its prompt up; the two differ, so nothing need be reused.
        "meshd_prefix_cache_lookups_total": lambda s: value(s) >= 2,
        "meshd_prefix_cache_hits_total": lambda s: value(s) >= 0,
        "meshd_prefix_cache_reused_tokens_total": lambda s: value(s) >= 0,
        "meshd_prefix_cache_misses_total": lambda s: value(s) >= 0,
        "meshd_prefix_cache_evictions_total": lambda s: value(s) >= 0,
        "meshd_prefix_cache_dropped_total": lambda s: value(s) >= 0,
        "meshd_prefix_cache_bytes": lambda s: value(s) >= 0,
        "meshd_prefix_cache_entries": lambda s: value(s) >= 0,
    }
    documented = {row.split("`")[1] for row in documented_table().splitlines()[2:]}
    assert set(got) == documented, "every family documented, and exported by the daemon"
    assert set(checks) == set(got), "a check for every exported family"
    unset = {name: samples for name, samples in got.items() if not samples}
    assert not unset, f"families with no sample: {sorted(unset)}"
    failed = {name: got[name] for name, check in checks.items() if not check(got[name])}
    assert not failed, f"families not set as the traffic implies: {failed}"

    # Mid-stream the gauges of a running session are up; meshctl status says the same drops.
    assert value(mid["meshd_sessions_coordinated"]) >= 1
    assert value(mid["meshd_sessions_hosted"]) >= 1
    assert value(mid["meshd_kv_used_bytes"]) > 0
    assert value(mid["meshd_api_requests_in_flight"]) >= 2  # the stream and the scrape
    dropped = by(got["meshd_datagrams_dropped_total"], "reason")
    for reason in ("unknown_probe", "undecryptable"):
        assert status["datagrams_dropped"][reason] >= dropped[reason]
    table = meshctl("status", "--socket", coordinator.socket)
    line = next(x for x in table.splitlines() if x.startswith("dropped datagrams:"))
    assert "unknown_probe " in line
    assert took_s < SCENARIO_BOUND_S, f"the scenario took {took_s:.0f} s"
