"""`meshd bench load`: the request mix, the leak check, and small runs end to end.

The end-to-end runs are real: the `meshd bench load` command starting two `meshd serve`
daemons on loopback, and the in-process path with an admission limit below the concurrency
(so real 429s come back and are retried) followed by a deliberately leaked KV allocation that
the leak check must name.
"""

from __future__ import annotations

import json

import pytest

from meshd.bench.load import find_leaks, measure, percentiles
from meshd.bench.load_requests import SIZES, LoadConfig, make_jobs
from meshd.bench.load_targets import local_target
from meshd.cli.main import main
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from tests.node.daemons import host_number

CONTEXT = 256  # the built-in model's context


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.open(builtin_model_dir())


def test_mix_is_seeded_covers_every_kind_and_fits_the_context(tokenizer: Tokenizer) -> None:
    jobs = make_jobs(tokenizer, 60, seed=3, context_tokens=CONTEXT)
    assert jobs == make_jobs(tokenizer, 60, seed=3, context_tokens=CONTEXT)
    assert jobs != make_jobs(tokenizer, 60, seed=4, context_tokens=CONTEXT)
    assert {(j.kind, j.stream) for j in jobs} == {
        (kind, stream) for kind in ("chat", "completion") for stream in (False, True)
    }
    assert {j.size for j in jobs} == {s.name for s in SIZES}
    assert {j.temperature > 0 for j in jobs} == {False, True}
    short = make_jobs(tokenizer, 20, seed=3, context_tokens=CONTEXT, sizes=("short",))
    assert {j.size for j in short} == {"short"} and max(j.max_tokens for j in short) <= 16
    for job in jobs:
        assert job.prompt_tokens + job.max_tokens <= CONTEXT
        counted = (
            tokenizer.encode_chat([{"role": "user", "content": job.text}])
            if job.kind == "chat"
            else tokenizer.encode(job.text)
        )
        assert len(counted) == job.prompt_tokens


def test_percentiles_by_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "max": None}


def test_leak_check_names_what_did_not_return_to_idle() -> None:
    cfg = LoadConfig(rss_growth_limit_bytes=1000)
    idle = {"n1": {"sessions_hosted": 0, "api_in_flight": 1, "rss_bytes": 5000}}
    assert find_leaks(idle, idle, cfg) == []
    within = {"n1": {"sessions_hosted": 0, "api_in_flight": 1, "rss_bytes": 5900}}
    assert find_leaks(idle, within, cfg) == []
    leaked = {"n1": {"sessions_hosted": 2, "api_in_flight": 1, "rss_bytes": 6100}}
    assert find_leaks(idle, leaked, cfg) == [
        "n1: sessions_hosted 0 -> 2",
        "n1: resident memory 5000 -> 6100 bytes",
    ]
    assert find_leaks(idle, {}, cfg) != []  # a node that vanished is not "back to idle"


@pytest.mark.slow
async def test_local_load_retries_429s_and_the_leak_check_sees_leaked_kv(
    tokenizer: Tokenizer,
) -> None:
    cfg = LoadConfig(requests=12, concurrency=4, seed=5, drain_timeout_s=5, sizes=("short",))
    async with local_target(None, 2, max_concurrent_requests=2) as target:
        report = await measure(target.urls, tokenizer, CONTEXT, target.snapshot, cfg)
        assert report["errors"] == 0, report["error_examples"]
        assert report["succeeded"] == 12
        assert report["retried_429"] > 0  # 4 clients against an admission limit of 2
        assert report["leaked"] is False, report["leaks"]
        assert report["kv_after"]["stage1"]["kv_used_bytes"] == 0
        # KV a session never gave back: the check must name it.
        before = await target.snapshot()
        target.backend.pipeline.hosts[1].stage.open_session("left-open-by-test", 64)
        leaks = find_leaks(before, await target.snapshot(), cfg)
        assert len(leaks) == 1 and leaks[0].startswith("stage1: kv_used_bytes 0 -> ")


@pytest.mark.slow
def test_load_through_real_daemons_has_no_errors_and_no_leak(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The real command in this process (the daemons are child processes): no second import
    # of torch, which costs tens of seconds while a training run hogs both cores.
    argv = [
        "bench", "load", "--requests", "16", "--concurrency", "4", "--sizes", "short",
        "--json", "--first-host", str(host_number(37)),
    ]  # fmt: skip
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["requests"] == 16 and report["succeeded"] == 16 and report["errors"] == 0
    assert report["leaked"] is False
    nodes = report["target"]["nodes"]
    assert report["target"]["kind"] == "daemons" and len(nodes) == 2
    ranges = sorted(n["layers"] for n in nodes)  # a 2-way split of the whole model
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 6
    # Both daemons coordinated requests; each came back to no open session.
    assert set(report["per_target"]) == {"0", "1"}
    for figures in report["kv_after"].values():
        assert figures["sessions_hosted"] == 0 and figures["sessions_coordinated"] == 0
        assert figures["kv_used_bytes"] == 0  # every session's KV was freed on its stage
    assert report["latency_s"]["p50"] > 0 and report["ttft_s"]["p50"] > 0
    assert report["completion_tokens"] >= 16
