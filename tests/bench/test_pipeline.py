"""`meshd bench pipeline`: the model's fit and a small real run on the built-in model."""

from __future__ import annotations

import json

import pytest

from meshd.bench.pipeline import fit_model, hops
from meshd.cli.main import main


def test_fit_recovers_the_model_it_was_made_from() -> None:
    c, p = 5.0, 0.3
    model = fit_model({s: hops(s) * p for s in (1, 2, 3)})
    assert model.p_ms == pytest.approx(p)
    # 2 stages: one message forward, one back, RTT/2 each; the issue's formula charges 2·RTT.
    assert model.predict(c, 2, 20.0) == pytest.approx(c + 2 * (10.0 + p))
    assert model.predict(c, 3, 20.0) == pytest.approx(c + 3 * (10.0 + p))
    assert model.predict(c, 1, 50.0) == pytest.approx(c)  # one stage never touches a lane
    assert model.predict_issue(c, 2, 20.0) == pytest.approx(c + 40.0 + model.p_issue_ms)
    # A window committing 2 tokens pays the per-window costs once per 2 tokens.
    assert model.predict(c, 2, 20.0, 2.0) == pytest.approx((c + 2 * (10.0 + p)) / 2)


def test_small_run_is_sane_and_a_token_pays_one_rtt_at_two_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "pipeline", "--json", "--stages", "2", "--rtt-ms", "100"]
    assert main([*argv, "--tokens", "16", "--repeats", "1", "--strategies", "auto"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["table"], r["stages"], r["rtt_ms"]): r for r in report["rows"]}
    # The calibration cells (1 stage, RTT 0) are always added.
    assert set(rows) == {
        (t, s, r) for t in ("plain", "speculative") for s in (1, 2) for r in (0, 100)
    }
    assert report["model"]["P_ms"] >= 0
    for row in rows.values():
        assert row["predicted_ms_per_token"] > 0
        assert row["measured_ms_per_token"] > 0
        assert row["C_ms"] > 0
    for key, row in rows.items():
        if key[0] == "speculative":
            assert row["identical_to_plain"], row
            assert row["strategy"] == "auto"
            assert row["tokens_per_round_trip"] >= 1
    # Out of sample: 2 stages at 100 ms cross two 50 ms one-way links per token (one RTT), not
    # the issue's two round trips; a large RTT keeps the machine's noise small beside it.
    near, far = rows[("plain", 2, 0.0)], rows[("plain", 2, 100.0)]
    assert not far["in_sample"]
    added = far["measured_ms_per_token"] - near["measured_ms_per_token"]
    assert 50 < added < 150, (near, far)
    assert abs(far["rel_error"]) < 0.3, far
    assert abs(far["rel_error_issue"]) > abs(far["rel_error"]), far
