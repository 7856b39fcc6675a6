"""Weights over the mesh, with real daemons: one holds the built-in checkpoint, two start with
`--model mesh:ID` and fetch exactly their stages' tensors from it over the lanes.

The three-stage mesh's greedy tokens equal single-process decoding of the whole model (what an
all-local mesh answers, `test_daemon`). A fetcher whose cached tensor was corrupted finds it
at restart, fetches it again, and still answers the same tokens. A fetcher SIGKILLed mid-fetch
(the holder's link capped so the fetch lasts seconds) leaves part files; restarted on the same
state dir it starts, finishes its stage and keeps only what a node that was never killed keeps.
One SIGTERMed mid-fetch exits at once with status 0 and leaves no part file; restarted, the
same. One frozen mid-fetch (a closed lid, SIGSTOP) until the holder drops it finishes its
fetch when it wakes (SIGCONT), answers the same tokens, and neither side keeps a task of the
broken transfer.
"""

from __future__ import annotations

import pathlib
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from meshd.bench.single_node import generate
from meshd.cli.supervisor import agreed_plan, kill_all, stage_budget, started, wait_until
from meshd.mesh.membership_config import MembershipConfig
from meshd.model.builtin import builtin_model_dir
from meshd.model.checkpoint import Checkpoint
from meshd.model.manifest import MANIFEST_FILE, MODEL_FILES, NAME_FILE
from meshd.model.stage import StageModel
from meshd.model.tokenizer import Tokenizer
from meshd.node.control_client import GenerateOp, request_lines
from meshd.node.fetch import stage_tensor_names
from protocol.artifacts import FetchConfig
from protocol.config import LaneConfig
from tests.node.daemons import LANE_DEAD_AFTER_S, Daemon, loopback, tasks_of, wait_tasks_back

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n"
MAX_TOKENS = 24
HOLDER_PORT = 17431
CAPPED_HOLDER_PORT = 17432
SIGTERM_HOLDER_PORT = 17433
LID_HOLDER_PORT = 17434
# The capped holder's egress: the fetcher's stage (about 7 MB) takes seconds to arrive, long
# enough to be killed mid-fetch.
CAPPED_BYTES_S = 2_000_000
SECRET = "meshd-fetch-mesh-secret-0123456789"
# How long a member woken after its death verdict takes to rejoin, from the timers the test
# daemons run with: its lane dies of silence (`--lane-dead-after-s`), one fresh lane's handshake,
# the lane-death probe and a probe round for the refutation; three times that, for two daemons
# sharing two busy cores.
REJOIN_S = 3 * (
    LANE_DEAD_AFTER_S
    + LaneConfig().handshake_timeout_s
    + MembershipConfig().lane_dead_probe_s
    + MembershipConfig().probe_interval_s
)


def _reference(prompt: list[int]) -> list[int]:
    torch.set_num_threads(1)
    checkpoint = Checkpoint.open(builtin_model_dir())
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers, device="cpu")
    return generate([stage], prompt, MAX_TOKENS).tokens


@pytest.fixture(scope="module")
def mesh_parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[pathlib.Path, int]]:
    tmp = tmp_path_factory.mktemp("fetch")
    yield tmp, stage_budget(str(builtin_model_dir()), 3)


def _fetcher(
    tmp: pathlib.Path, index: int, budget: int, model_id: str, holder: str | None = None
) -> Daemon:
    """Daemon `index` fetching the model from `holder` (HOST:PORT; the first holder's: None)."""
    holder = holder or f"{loopback(31)}:{HOLDER_PORT}"
    join = ("--join", holder, "--model", f"mesh:{model_id[:16]}")
    return Daemon(tmp, index, secret=SECRET, budget=budget, extra=join)


def _tokens(d: Daemon, prompt: list[int]) -> list[int]:
    """The greedy tokens `d` answers; a 503 (a member's record still settling after a restart)
    is retried as its `retry_after_s` asks, for at most 30 s."""
    op = GenerateOp(prompt=prompt, max_tokens=MAX_TOKENS, strategy="disabled", ignore_eos=True)
    finals: list[dict[str, object]] = []

    def answered() -> bool:
        finals.append(list(request_lines(d.socket, op, timeout_s=60))[-1])
        return bool(finals[-1]["ok"]) or finals[-1].get("code") != "service_unavailable"

    wait_until(answered, 30, "an answer", poll_s=1.0)
    assert finals[-1]["ok"], finals[-1]
    tokens = finals[-1]["tokens"]
    assert isinstance(tokens, list)
    return tokens


def test_fetching_nodes_serve_their_stages_and_answer_like_one_process(
    mesh_parts: tuple[pathlib.Path, int],
) -> None:
    tmp, budget = mesh_parts
    checkpoint = Checkpoint.open(builtin_model_dir())
    model_id = checkpoint.model_id
    holder = Daemon(
        tmp, 31, secret=SECRET, budget=budget, extra=("--listen-port", str(HOLDER_PORT))
    )
    daemons = [holder, _fetcher(tmp, 32, budget, model_id), _fetcher(tmp, 33, budget, model_id)]
    try:
        started(daemons, timeout_s=120)
        plan = agreed_plan(daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 3, plan
        prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
        expected = _reference(prompt)
        for d in daemons:
            assert _tokens(d, prompt) == expected, d.name
        for d in daemons[1:]:
            status = d.status()
            assert status["model_id"] == model_id
            lo, hi = status["stage_layers"]
            fetch = status["fetch"]
            assert fetch["state"] == "done" and fetch["done_bytes"] == fetch["total_bytes"] > 0
            # It holds its stage's tensors, and only those of stages it was assigned (a
            # re-plan fetches what is missing and keeps the rest): no other layer crossed.
            stored = {
                p.name.removesuffix(".safetensors")
                for p in (d.state / "models" / model_id / "tensors").iterdir()
            }
            assert set(stage_tensor_names(checkpoint.config, lo, hi)) <= stored
            fetched = [
                re.match(r"layers \[(\d+), (\d+)\)", e["detail"])
                for e in status["events"]
                if e["kind"] == "fetch"
            ]
            assigned: set[str] = set()
            for m in fetched:
                assert m is not None
                assigned |= set(stage_tensor_names(checkpoint.config, int(m[1]), int(m[2])))
            assert stored <= assigned
        # The holder's files answer; the fetchers hold no checkpoint directory of their own.
        assert daemons[0].status()["fetch"] is None
        # One model, one name: a fetching node answers to the holder's name for it, and lists
        # it once.
        for d in daemons:
            listed = httpx.get(f"{d.api_url}/models", timeout=30).json()["data"]
            assert [m["id"] for m in listed] == ["meshd-builtin"], (d.name, listed)
        reply = httpx.post(
            f"{daemons[1].api_url}/completions",
            json={"model": "meshd-builtin", "prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "meshd-builtin"

        # A flipped byte in a fetched tensor: found at restart, fetched again, same tokens.
        victim = daemons[2]
        victim.kill()
        victim.wait_stopped(float("inf"))
        tensors = victim.state / "models" / model_id / "tensors"
        # Every tensor it stored gets a flipped byte: whichever of its old layers the next plan
        # gives it back, the ones it loads are corrupted.
        corrupted: dict[pathlib.Path, bytes] = {}
        for target in sorted(tensors.iterdir()):
            data = bytearray(target.read_bytes())
            data[-1] ^= 0x01
            target.write_bytes(bytes(data))
            corrupted[target] = bytes(data)
        daemons[2] = victim = _fetcher(tmp, 33, budget, model_id)
        started([victim], timeout_s=120)
        plan = agreed_plan(daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 3, plan  # it serves a stage again (two nodes hold too little)
        wait_until(
            lambda: "does not match the manifest" in victim.log_tail(200_000),
            60,
            "the corrupted tensor reported",
        )
        lo, hi = victim.status()["stage_layers"]
        for name in stage_tensor_names(checkpoint.config, lo, hi):
            path = tensors / f"{name}.safetensors"
            if path in corrupted:  # replaced by the manifest's bytes
                assert path.read_bytes() != corrupted[path], name
        assert _tokens(victim, prompt) == expected
        assert _tokens(daemons[0], prompt) == expected
    finally:
        kill_all(daemons)


def _files(state: pathlib.Path) -> set[str]:
    return {str(p.relative_to(state)) for p in state.rglob("*") if not p.is_dir()}


class CappedPair:
    """A holder whose link is capped (`CAPPED_BYTES_S`) and a `mesh:ID` fetcher joining it:
    the fetcher's stage takes seconds to arrive, long enough to stop it mid-fetch."""

    def __init__(
        self, tmp: pathlib.Path, holder_index: int, port: int, bytes_s: int = CAPPED_BYTES_S
    ) -> None:
        self.tmp, self.port = tmp, port
        self.checkpoint = Checkpoint.open(builtin_model_dir())
        self.model_id = self.checkpoint.model_id
        self.budget = stage_budget(str(builtin_model_dir()), 2)
        self.bytes_s = bytes_s
        cap = ("--emulate-bandwidth-bytes-s", str(bytes_s))
        listen = ("--listen-port", str(port))
        self.holder = Daemon(
            tmp, holder_index, secret=SECRET, budget=self.budget, extra=(*listen, *cap)
        )
        self.fetcher_index = holder_index + 1
        self.fetcher = self.start_fetcher()
        self.daemons = [self.holder, self.fetcher]

    def start_fetcher(self) -> Daemon:
        """The fetcher (again, on the same state dir after a stop)."""
        holder = f"{self.holder.host}:{self.port}"
        self.fetcher = _fetcher(self.tmp, self.fetcher_index, self.budget, self.model_id, holder)
        return self.fetcher

    def wait_mid_fetch(self) -> dict[str, Any]:
        """The fetcher's `fetch` status once part of its stage arrived, and not all."""
        seen: list[dict[str, Any]] = []

        def mid_fetch() -> bool:
            fetch = (self.fetcher.try_status() or {}).get("fetch")
            arriving = fetch is not None and fetch["state"] == "fetching"
            if arriving and 0 < fetch["done_bytes"] < fetch["total_bytes"]:
                seen.append(fetch)
            return bool(seen)

        wait_until(mid_fetch, 60, "the fetcher's stage half arrived", poll_s=0.05)
        return seen[0]

    def wait_fetched(self, what: str) -> float:
        def fetched() -> bool:
            fetch = self.fetcher.status()["fetch"]
            return fetch is not None and fetch["state"] == "done"

        return wait_until(fetched, 60, what)

    def restart_fetcher(self) -> None:
        """Start the stopped fetcher again on its state dir; it joins the plan."""
        self.daemons[1] = self.start_fetcher()
        started([self.fetcher], timeout_s=120)
        plan = agreed_plan(self.daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 2, plan

    def check_serves_clean(self) -> None:
        """The fetcher answers single-process tokens and holds what a node never stopped
        holds: its identity, the start-up caches, the model's small files, manifest, name and
        verified list, and whole tensors of the layers it was given (and of layers an earlier plan gave it: a
        cache kept on purpose); no part or temp file."""
        fetcher, model_id = self.fetcher, self.model_id
        prompt = Tokenizer.open(builtin_model_dir()).encode(PROMPT)
        assert _tokens(fetcher, prompt) == _reference(prompt)
        lo, hi = fetcher.status()["stage_layers"]
        tensors = {f"models/{model_id}/tensors/{n}.safetensors" for n in
                   stage_tensor_names(self.checkpoint.config, lo, hi)}  # fmt: skip
        now = _files(fetcher.state)
        assert not [n for n in now if n.endswith((".part", ".tmp"))], now
        small = (MANIFEST_FILE, NAME_FILE, "verified.msgpack", *MODEL_FILES)
        kept = {"identity.key", "control.sock", *(f"models/{model_id}/{n}" for n in small)}
        assert tensors <= now, tensors - now
        # The start-up caches (docs/operations.md): tensor digests and the compute figure.
        caches = ("hashes/", "compute/")
        stray = {n for n in now - kept - tensors if not n.startswith(caches)}
        assert all(n.startswith(f"models/{model_id}/tensors/") for n in stray), stray
        assert (fetcher.state / "models" / model_id).is_dir()


def test_a_fetcher_killed_mid_fetch_restarts_clean_on_its_state_dir(
    mesh_parts: tuple[pathlib.Path, int],
) -> None:
    tmp, _ = mesh_parts
    pair = CappedPair(tmp, 34, CAPPED_HOLDER_PORT)
    try:
        started(pair.daemons, timeout_s=120)
        pair.wait_mid_fetch()
        fetcher = pair.fetcher
        fetcher.kill()
        fetcher.wait_stopped(float("inf"))
        left = _files(fetcher.state)
        parts = [name for name in left if name.endswith(".part")]
        print(f"a fetcher SIGKILLed mid-fetch left {len(parts)} part files of {len(left)} files")
        assert parts, left  # the kill landed mid-fetch
        pair.restart_fetcher()
        pair.wait_fetched("the restarted fetcher's stage fetched")
        pair.check_serves_clean()
    finally:
        kill_all(pair.daemons)


def test_a_fetcher_stopped_mid_fetch_exits_at_once_clean_and_restarts(
    mesh_parts: tuple[pathlib.Path, int],
) -> None:
    tmp, _ = mesh_parts
    pair = CappedPair(tmp, 36, SIGTERM_HOLDER_PORT)
    try:
        started(pair.daemons, timeout_s=120)
        pair.wait_mid_fetch()
        fetcher = pair.fetcher
        signalled_at = time.monotonic()
        fetcher.terminate()
        # No request runs and no stage is loaded: nothing to wait for within the grace.
        exited_s = wait_until(lambda: fetcher.proc.poll() is not None, 30, "the fetcher to exit")
        print(f"a fetcher SIGTERMed mid-fetch exited {exited_s:.2f} s after the signal")
        assert fetcher.proc.returncode == 0, fetcher.log_tail(2000)
        assert time.monotonic() - signalled_at <= 5.0, fetcher.log_tail(2000)
        # A graceful stop removes what the fetch had not finished: no part or temp file, no
        # control socket.
        left = _files(fetcher.state)
        assert not [n for n in left if n.endswith((".part", ".tmp"))], left
        assert "control.sock" not in left, left
        pair.restart_fetcher()
        pair.wait_fetched("the restarted fetcher's stage fetched")
        pair.check_serves_clean()
    finally:
        kill_all(pair.daemons)


def test_a_fetcher_whose_lid_closes_mid_fetch_finishes_when_it_opens(
    mesh_parts: tuple[pathlib.Path, int],
) -> None:
    # Frozen mid-fetch until the holder declares it dead: the holder forgets what it was
    # sending it; awake, the fetcher finds its lane dead or replaced, asks again what was lost
    # with it and fetches the rest of its stage.
    tmp, _ = mesh_parts
    # Half the other tests' rate: the stage takes about 8 s, the freeze lands mid-fetch.
    pair = CappedPair(tmp, 38, LID_HOLDER_PORT, bytes_s=CAPPED_BYTES_S // 2)
    holder, fetcher = pair.holder, pair.fetcher
    try:
        started(pair.daemons, timeout_s=120)
        fetch = pair.wait_mid_fetch()
        left_s = (fetch["total_bytes"] - fetch["done_bytes"]) / pair.bytes_s
        tasks_before = tasks_of(pair.daemons)
        key = fetcher.key()
        fetcher.proc.send_signal(signal.SIGSTOP)
        try:
            # Frozen past the dead-peer time: the holder's lane to it died and the member is
            # declared dead (not only suspected).
            dead_s = wait_until(
                lambda: holder.member(key)["status"] == "dead", 30, "the holder to declare it dead"
            )
            print(f"a fetcher frozen mid-fetch: the holder declared it dead {dead_s:.2f} s later")
        finally:
            fetcher.proc.send_signal(signal.SIGCONT)
        woke, woke_unix_s = time.monotonic(), time.time()
        # Awake, its lane to the holder dies of the silence it slept through; its lane-death
        # probe pings the holder on a fresh lane, the holder tells it it was declared dead, it
        # refutes (`member-alive-again` on the holder), and each sees the other alive.
        keys = {d.key() for d in pair.daemons}
        wait_until(
            lambda: holder.first_event("member-alive-again", key, woke_unix_s - 1.0) is not None,
            REJOIN_S,
            "the holder to hear the woken fetcher refute its death",
        )
        wait_until(
            lambda: all(d.alive_members() == keys for d in pair.daemons), REJOIN_S, "rejoined"
        )
        pair.wait_fetched("the woken fetcher's stage fetched")
        done_s = time.monotonic() - woke
        print(
            f"a fetcher frozen mid-fetch: fetched {done_s:.2f} s after it woke "
            f"({left_s:.2f} s of its stage left at the capped rate)"
        )
        # The same fetch went on, on a new lane: it never failed for want of a chunk, and
        # took what was left at the capped rate and the seconds a rejoin takes. (What a replaced lane carried is asked
        # again at once: test_fetch_sources.)
        events = fetcher.status()["events"]
        assert not [e for e in events if e["kind"] == "fetch-failed"], events
        assert done_s < left_s + FetchConfig().timeout_s / 2, (done_s, left_s)
        plan = agreed_plan(pair.daemons, timeout_s=120, stable_s=1.0)
        assert len(plan) == 2, plan
        assert fetcher.proc.poll() is None, fetcher.log_tail(2000)
        pair.check_serves_clean()
        # Nothing of the broken transfer stays: the holder serves no one now, and neither
        # daemon runs more tasks than mid-fetch (the stages loaded since aside).
        back_s = wait_tasks_back(pair.daemons, tasks_before, took_stage=pair.daemons)
        print(f"a fetcher frozen mid-fetch: tasks back {time.monotonic() - woke:.2f} s after "
              f"it woke ({back_s:.2f} s waited)")  # fmt: skip
    finally:
        fetcher.proc.send_signal(signal.SIGCONT)
        kill_all(pair.daemons)
