"""The prefix cache's counters as `meshctl status` prints them and `/metrics` exports them."""

from __future__ import annotations

import random

import msgspec
import trio
from rich.console import Console

from meshd.api.metrics import ApiMetrics
from meshd.cli.meshctl_status import _prefix_line
from meshd.coord.coordinator import GenerationRequest
from meshd.coord.local import open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.node.prefix_status import PrefixCacheStatus, collect_status, register_prefix_metrics


async def test_counters_after_a_hit_reach_status_and_metrics() -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(10, 2000) for _ in range(300)]
    async with open_local_pipeline(builtin_model_dir(), 2) as pipe:

        def read() -> PrefixCacheStatus:
            return collect_status([pipe.coordinator], [h.stage.kv for h in pipe.hosts])

        async def ignore(tokens: list[int]) -> None:
            pass

        for extra in ([], [7, 8, 9]):
            request = GenerationRequest(prompt=[*prompt, *extra], max_tokens=4)
            with trio.fail_after(60):
                await pipe.coordinator.generate(pipe.route, request, ignore)
            with trio.fail_after(10):
                while any(h.sessions for h in pipe.hosts):  # noqa: ASYNC110
                    await trio.sleep(0.01)
        status = read()
        metrics = ApiMetrics()
        register_prefix_metrics(metrics, read)
        text = metrics.render()[0].decode()
    fields = msgspec.to_builtins(status)
    assert (fields["lookups"], fields["hits"], fields["reused_tokens"]) == (2, 1, 256)
    assert (fields["stage_hits"], fields["stage_reused_tokens"]) == (2, 512)  # both stages
    assert fields["entries"] == 2 and fields["bytes_held"] > 0
    # The second request's entry replaced the first's: each stage freed it when told.
    assert fields["dropped"] == 2
    assert "meshd_prefix_cache_dropped_total 2.0" in text
    assert "meshd_prefix_cache_hits_total 1.0" in text
    assert "meshd_prefix_cache_reused_tokens_total 256.0" in text
    samples = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
    assert float(samples["meshd_prefix_cache_bytes"]) == fields["bytes_held"]
    console = Console(record=True, width=200)
    console.print(_prefix_line(fields))
    line = console.export_text()
    assert "1/2 requests hit, 256 tokens reused (42% of prompt tokens), 0 misses" in line
    assert "stage holds 2 entries" in line and "0 evicted, 2 dropped" in line
