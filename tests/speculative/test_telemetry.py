"""Typed, versioned telemetry with one acceptance definition."""

from __future__ import annotations

import msgspec
import pytest

from meshd.speculative.config import SpecConfig
from meshd.speculative.policy import LinkModel, PolicyInputs, choose
from meshd.speculative.sampling import SamplingParams
from meshd.speculative.strategies import make_proposer
from meshd.speculative.telemetry import Recorder, SpecTelemetry
from tests.speculative.target import Target, decode_spec


def test_snapshot_derives_rates_from_counters() -> None:
    r = Recorder("auto")
    empty = r.snapshot()
    assert empty.version == 1
    assert empty.acceptance is None and empty.tokens_per_round_trip is None
    assert empty.decode_tok_per_s is None and empty.prompt_tok_per_s is None
    r.prefill(tokens=100, seconds=0.5)
    for _ in range(5):
        r.window_sent()
    r.window_stale()
    r.verdict("ngram-simple", drafted=4, accepted=3, committed=4, network_s=0.04, compute_s=0.01)
    r.verdict("mtp", drafted=2, accepted=0, committed=1, network_s=0.04, compute_s=0.01)
    r.verdict("ngram-simple", drafted=4, accepted=1, committed=2, network_s=0.04, compute_s=0.01)
    r.decode_elapsed(0.14)
    plan = choose(PolicyInputs(LinkModel(0.04, 0.003, 0.0004), (0.8,)), SpecConfig())
    r.policy(plan, active_strategy="ngram-simple", strategy_reason="ngram-simple wins")
    t = r.snapshot()
    assert t.proposers["ngram-simple"].drafted == 8
    assert t.proposers["ngram-simple"].acceptance == pytest.approx(4 / 8)
    assert t.proposers["mtp"].acceptance == 0.0
    assert (t.drafted_tokens, t.accepted_tokens) == (10, 4)
    assert t.acceptance == pytest.approx(0.4)  # accepted / drafted, the only definition
    assert (t.windows_sent, t.windows_stale, t.verify_round_trips) == (5, 1, 3)
    assert t.tokens_committed == t.decode_tokens == 7
    assert t.tokens_per_round_trip == pytest.approx(7 / 3)
    assert t.network_s == pytest.approx(0.12) and t.compute_s == pytest.approx(0.03)
    assert t.prompt_tok_per_s == pytest.approx(200.0)
    assert t.decode_tok_per_s == pytest.approx(50.0)
    assert t.last_width == plan.width and t.last_policy_reason == plan.reason
    assert (t.active_strategy, t.last_strategy_reason) == ("ngram-simple", "ngram-simple wins")
    with pytest.raises(ValueError):
        r.verdict("mtp", drafted=1, accepted=2, committed=3)


def test_telemetry_round_trips_as_json_with_stable_field_names() -> None:
    r = Recorder("ngram-cache")
    r.verdict("ngram-cache", drafted=3, accepted=2, committed=3)
    t = r.snapshot()
    wire = msgspec.json.encode(t)
    assert msgspec.json.decode(wire, type=SpecTelemetry) == t
    fields = msgspec.json.decode(wire)
    assert fields["version"] == 1
    assert "acceptance" in fields and "tokens_per_round_trip" in fields


def test_recorder_matches_a_real_decode() -> None:
    target = Target(1)
    proposer = make_proposer("ngram-simple", SpecConfig(ngram_min=1))
    recorder = Recorder("ngram-simple")
    run = decode_spec(target, [3, 1, 4, 1, 5], 40, SamplingParams(), proposer, 6, recorder=recorder)
    t = recorder.snapshot()
    assert t.acceptance == proposer.stats.acceptance == run.accepted / run.drafted
    assert 0.0 < t.acceptance < 1.0
    assert t.verify_round_trips == t.windows_sent == run.windows
    assert t.tokens_committed == len(run.tokens) == 40
    assert t.tokens_per_round_trip == pytest.approx(40 / run.windows)
    assert t.tokens_per_round_trip > 1.5
