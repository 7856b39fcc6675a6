"""Two models in one mesh of three real daemons.

n2 holds the built-in model, n3 holds both (the built-in one and a second checkpoint written
here), n4 holds only the second. Each model is planned over the nodes offering it; every
node's `/v1/models` lists both; a request names its model and runs on that model's plan from
any node's endpoint (n2 relays the second model's requests to a holder, n4 the built-in one's),
with the tokens of the model run alone; an unknown model gets a 404 listing both. SIGKILL of
n4 (which serves only the second model) leaves the built-in model untouched: its plan stays
the same and a generation running across the kill completes with the same tokens, and the
survivors hold no session and no KV afterwards.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshd.bench.decode import write_random_checkpoint
from meshd.bench.single_node import generate
from meshd.cli.supervisor import kill_all, stage_budget, started, wait_until
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from tests.node.daemons import Daemon
from tests.node.test_daemon import meshctl

pytestmark = pytest.mark.slow

BUILTIN = "meshd-builtin"
SECOND = "second-model"
PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
# Long enough to still run when the SIGKILL lands.
LONG_TOKENS = 400
# This module's own mesh: daemons of other test modules running beside it never join it.
SECRET = "meshd-several-models-" + secrets.token_hex(8)


def second_checkpoint(directory: pathlib.Path) -> pathlib.Path:
    """A random checkpoint of the built-in model's shape (other weights: other tokens), with the
    built-in tokenizer."""
    write_random_checkpoint(directory, "small", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_model_dir() / name, directory / name)
    return directory


class Mesh:
    def __init__(self, tmp: pathlib.Path, second: pathlib.Path) -> None:
        self.tmp = tmp
        self.second = second
        self.daemons: dict[str, Daemon] = {}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("models")
    m = Mesh(tmp, second_checkpoint(tmp / SECOND))
    # Any one node could hold either model alone, or both.
    budget = 4 * stage_budget(str(m.second), 1)
    second = str(m.second)
    flags = {
        "n2": (),
        "n3": ("--model", "", "--model", second),
        "n4": ("--model", second),
    }
    try:
        for i, name in ((2, "n2"), (3, "n3"), (4, "n4")):
            m.daemons[name] = Daemon(tmp, i, secret=SECRET, budget=budget, extra=flags[name])
        started(m.daemons.values())
        yield m
    finally:
        kill_all(m.daemons.values())


def reference(model_dir: pathlib.Path, prompt: list[int], max_tokens: int) -> list[int]:
    """The model run alone: single-process greedy decoding of the whole model."""
    torch.set_num_threads(1)
    checkpoint = Checkpoint.open(model_dir)
    n = checkpoint.config.num_layers
    stage = StageModel.load(checkpoint, 0, n, device="cpu")
    return generate([stage], prompt, max_tokens).tokens


def _model_entry(status: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in status["models"] if m["name"] == name), None)


def _serving(daemons: list[Daemon], holders: dict[str, set[str]]) -> bool:
    """Every daemon lists every model, and each model's holders have loaded its plan."""
    for d in daemons:
        s = d.try_status()
        if s is None:
            return False
        for name, keys in holders.items():
            entry = _model_entry(s, name)
            if entry is None or not entry["plan"] or set(entry["holders"]) != keys:
                return False
            if entry["held"]:
                mine = [st["layers"] for st in entry["plan"] if st["key"] == s["key"]]
                if entry["stage_layers"] != (mine[0] if mine else None):
                    return False
    return True


def _completion(d: Daemon, model: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "meshd": {"ignore_eos": True},
    }
    return httpx.post(f"{d.api_url}/completions", json=body, timeout=120)


def _stream(d: Daemon, model: str, prompt: list[int], max_tokens: int) -> list[str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "meshd": {"ignore_eos": True}}  # fmt: skip
    pieces = []
    with httpx.stream("POST", f"{d.api_url}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert [line for line in lines if line][-1] == "data: [DONE]", lines[-3:]
    for line in lines:
        if line.startswith("data: {"):
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return pieces


def _plan_of(d: Daemon, name: str) -> list[dict[str, Any]]:
    entry = _model_entry(d.status(), name)
    assert entry is not None
    return list(entry["plan"])


def test_two_models_in_one_mesh(mesh: Mesh) -> None:
    d = mesh.daemons
    nodes = list(d.values())
    keys = {n.key() for n in nodes}
    wait_until(lambda: all(n.alive_members() == keys for n in nodes), 30, "three members each")
    holders = {
        BUILTIN: {d["n2"].key(), d["n3"].key()},
        SECOND: {d["n3"].key(), d["n4"].key()},
    }
    wait_until(lambda: _serving(nodes, holders), 60, "each model planned and loaded")

    # /v1/models on every node lists both; an unknown model is a 404 listing them.
    for n in nodes:
        ids = {m["id"] for m in httpx.get(f"{n.api_url}/models", timeout=30).json()["data"]}
        assert ids == {BUILTIN, SECOND}, (n.name, ids)
        missing = _completion(n, "no-such-model", [1, 2, 3], 4)
        assert missing.status_code == 404, missing.text
        error = missing.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert f"`{BUILTIN}`" in error["message"] and f"`{SECOND}`" in error["message"]

    # meshctl shows each model's plan.
    status = json.loads(meshctl("status", "--json", "--socket", d["n3"].socket))
    assert {m["name"] for m in status["models"]} == {BUILTIN, SECOND}
    assert all(m["held"] for m in status["models"])
    plans = json.loads(meshctl("plan", "--json", "--socket", d["n2"].socket))["models"]
    assert [m["name"] for m in plans] == [BUILTIN, SECOND]
    assert all(m["plan"] for m in plans), plans
    text = meshctl("plan", "--socket", d["n2"].socket)
    assert f"== model {BUILTIN}" in text and f"== model {SECOND}" in text
    text = meshctl("status", "--socket", d["n4"].socket)
    assert f"model {BUILTIN} (" in text and "held elsewhere" in text
    assert f"model {SECOND} (" in text and "held here" in text

    # Both models answer from every node's endpoint, with the tokens of the model run alone.
    tokenizer = Tokenizer.open(builtin_model_dir())
    prompt = tokenizer.encode(PROMPT)
    expected = {
        BUILTIN: tokenizer.decode(reference(builtin_model_dir(), prompt, MAX_TOKENS)),
        SECOND: tokenizer.decode(reference(mesh.second, prompt, MAX_TOKENS)),
    }
    assert expected[BUILTIN] != expected[SECOND]
    for n in nodes:
        for name in (BUILTIN, SECOND):
            reply = _completion(n, name, prompt, MAX_TOKENS)
            assert reply.status_code == 200, (n.name, name, reply.text)
            body = reply.json()
            assert body["model"] == name
            assert body["choices"][0]["text"] == expected[name], (n.name, name)
    # A relayed stream carries the same tokens; a relayed chat runs the holder's template.
    assert "".join(_stream(d["n2"], SECOND, prompt, MAX_TOKENS)) == expected[SECOND]
    chat = httpx.post(
        f"{d['n4'].api_url}/chat/completions",
        json={"model": BUILTIN, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 4, "temperature": 0},
        timeout=120,
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == BUILTIN and chat.json()["usage"]["completion_tokens"] >= 1

    # The model id is an alias of the name.
    second_id = _model_entry(d["n4"].status(), SECOND)["model_id"]  # type: ignore[index]
    reply = _completion(d["n2"], second_id, prompt, MAX_TOKENS)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected[SECOND]

    # A client that hangs up on a relayed stream cancels it on the holder: no session stays.
    body = {"model": SECOND, "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0,
            "stream": True, "meshd": {"ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", f"{d['n2'].api_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    wait_until(lambda: all(_clean(n) for n in nodes), 30, "the relayed request cancelled")
    # The holder saw its client go (499), as it would a client of its own.
    gone = sum(_metric(n, "meshd_api_requests_total", status="499") for n in (d["n3"], d["n4"]))
    assert gone == 1

    # SIGKILL n4, which serves only the second model, while a built-in generation runs from
    # n4's neighbour n2: it completes undisturbed, and the built-in plan does not change.
    before = {n.name: _plan_of(n, BUILTIN) for n in (d["n2"], d["n3"])}
    long_expected = tokenizer.decode(reference(builtin_model_dir(), prompt, LONG_TOKENS))
    result: dict[str, Any] = {}
    pieces: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        body = {
            "model": BUILTIN,
            "prompt": prompt,
            "max_tokens": LONG_TOKENS,
            "temperature": 0,
            "stream": True,
            "meshd": {"ignore_eos": True},
        }
        text = pieces
        with httpx.stream("POST", f"{d['n2'].api_url}/completions", json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    first_event.set()
                elif line == "data: [DONE]":
                    result["done"] = True
        first_event.set()
        result["text"] = "".join(text)

    recoveries = {n.name: n.status()["recoveries"] for n in (d["n2"], d["n3"])}
    # Beside it, a relayed stream of the second model from n2: its holder is the node serving
    # the second model's stage (one stage here). If that is n4, the kill cuts the relayed
    # stream, which then ends with an error event and [DONE]; if n3, it completes.
    [second_stage] = _plan_of(d["n2"], SECOND)
    relayed_lines: list[str] = []

    def relayed_stream() -> None:
        body = {"model": SECOND, "prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0,
                "stream": True, "meshd": {"ignore_eos": True}}  # fmt: skip
        with httpx.stream("POST", f"{d['n2'].api_url}/completions", json=body, timeout=120) as r:
            relayed_lines.extend(line for line in r.iter_lines() if line)

    thread = threading.Thread(target=stream)
    relayed = threading.Thread(target=relayed_stream)
    thread.start()
    relayed.start()
    assert first_event.wait(60)
    wait_until(lambda: len(relayed_lines) >= 2, 60, "the relayed stream under way")
    d["n4"].kill()
    streamed_at_kill = len(pieces)
    thread.join(120)
    assert result.get("status") == 200 and result.get("done"), result
    assert result["text"] == long_expected
    relayed.join(120)
    assert relayed_lines[-1] == "data: [DONE]"
    last = json.loads(relayed_lines[-2][6:])
    if second_stage["key"] == d["n4"].key():
        assert last["error"]["code"] == "service_unavailable", last
    else:
        assert "error" not in last
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in relayed_lines[:-1]]
        assert "".join(texts) == tokenizer.decode(reference(mesh.second, prompt, LONG_TOKENS))
    assert streamed_at_kill < len(pieces), "the generation ended before the kill"
    survivors = [d["n2"], d["n3"]]
    survivor_keys = {n.key() for n in survivors}
    wait_until(lambda: all(n.alive_members() == survivor_keys for n in survivors), 30, "n4 gone")
    for n in survivors:
        assert _plan_of(n, BUILTIN) == before[n.name], n.name
        assert n.status()["recoveries"] == recoveries[n.name], n.name
    # The built-in model keeps answering from both survivors; the second one moves to n3.
    holders = {BUILTIN: survivor_keys, SECOND: {d["n3"].key()}}
    wait_until(lambda: _serving(survivors, holders), 60, "the second model re-planned on n3")
    for n in survivors:
        for name in (BUILTIN, SECOND):
            reply = _completion(n, name, prompt, MAX_TOKENS)
            assert reply.status_code == 200, (n.name, name, reply.text)
            assert reply.json()["choices"][0]["text"] == expected[name], (n.name, name)

    # Nothing is left behind on the survivors: no session, no KV, nothing coordinated.
    wait_until(lambda: all(_clean(n) for n in survivors), 30, "no session left on the survivors")


def _metric(n: Daemon, name: str, **labels: str) -> float:
    root = n.api_url.removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _clean(n: Daemon) -> bool:
    s = n.status()
    idle = s["sessions_hosted"] == 0 and s["kv_used_bytes"] == 0
    return (
        idle
        and s["sessions_coordinated"] == 0
        and all(m["sessions_hosted"] == 0 and m["kv_used_bytes"] == 0 for m in s["models"])
    )
