"""`meshd bench perplexity` scores ids as the runtime's own decode steps would."""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from meshd.bench.gguf_writer import write_gguf
from meshd.bench.perplexity import score
from meshd.cli.main import main
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_checkpoint, open_tokenizer
from meshd.model.stage import StageModel

PROSE = (
    "The river ran low that summer, and the children of the village walked along its bed "
    "looking for the smooth stones their grandmother liked. She kept them in a jar by the "
    "window, and on bright mornings the light went through the water in the jar and made "
    "small moving shapes on the kitchen wall.\n"
)


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    # Q8_0 blocks: the daemon's default for the file is its blocks as stored, not "none".
    return write_gguf(builtin_model_dir(), tmp_path_factory.mktemp("ppl") / "m.gguf", "Q8_0")


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", "perplexity", *args, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def _reference(
    model: str,
    quantization: str,
    ids: list[int],
    *,
    steps: bool,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[float], list[int]]:
    """-log p(next id) and argmax at each position from the logits of a stage loaded here (one
    window of every id, or one-token decode steps), the log-softmax done by hand in float64."""
    checkpoint = open_checkpoint(model)
    stage = StageModel.load(
        checkpoint,
        0,
        checkpoint.config.num_layers,
        quantization=quantization,
        kv_dtype=kv_dtype,
    )
    stage.open_session("ref", len(ids))
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        if steps:
            for pos, token in enumerate(ids[:-1]):
                out = stage.forward("ref", pos, torch.tensor([token]))
                assert out.logits is not None
                rows.append(out.logits[-1])
        else:
            out = stage.forward("ref", 0, torch.tensor(ids))
            assert out.logits is not None
            rows = list(out.logits[:-1])
    stage.close_session("ref")
    nll, top1 = [], []
    for pos, logits in enumerate(rows):
        row = logits.double()
        lse = float(row.max() + torch.log(torch.exp(row - row.max()).sum()))
        nll.append(lse - float(row[ids[pos + 1]]))
        top1.append(int(row.argmax()))
    return nll, top1


@pytest.mark.parametrize("which", ["builtin", "gguf"])
def test_perplexity_equals_exp_mean_nll_of_the_runtime_logits(
    which: str,
    tiny_gguf: pathlib.Path,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    model = str(builtin_model_dir() if which == "builtin" else tiny_gguf)
    report = _bench(capsys, "--model", model, "--text", str(text), "--tokens", "24")
    checkpoint = open_checkpoint(model)
    # The daemon's choice for the file: fp32 for the built-in, a re-quantization for Q8_0.
    assert report["quantization"] == checkpoint.default_quantization
    assert (report["quantization"] == "none") == (which == "builtin")
    ids = report["tokens"]
    assert ids == open_tokenizer(model).encode(PROSE)[:24] and report["n"] == len(ids) == 24
    assert len(report["top1"]) == report["n"] - 1
    nll, top1 = _reference(model, report["quantization"], ids, steps=False)
    assert report["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-6)
    assert report["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)
    assert report["ppl"] == pytest.approx(math.exp(report["nll"]), rel=1e-12)
    assert report["top1"] == top1
    # Decode steps give the same figures, to rounding (a long window attends in one call, a
    # step row by row).
    nll, top1 = _reference(model, report["quantization"], ids, steps=True)
    exact = report["quantization"] == "none"
    assert report["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-4 if exact else 2e-3)
    assert sum(a == b for a, b in zip(report["top1"], top1, strict=True)) >= len(top1) - 1

    # The ids printed, given back as --token-ids, are scored the same.
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(ids))
    again = _bench(capsys, "--model", model, "--token-ids", str(ids_file))
    assert again["tokens"] == ids and again["top1"] == report["top1"]
    assert again["nll"] == pytest.approx(report["nll"], rel=1e-9)
    assert again["quantization"] == report["quantization"]


def test_quantization_flag_overrides_the_default(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([5, 17, 300, 42, 9, 77, 12, 1000]))
    exact = _bench(capsys, "--model", str(tiny_gguf), "--token-ids", str(ids_file))
    none = _bench(
        capsys, "--model", str(tiny_gguf), "--token-ids", str(ids_file), "--quantization", "none"
    )
    assert exact["quantization"] != "none" and none["quantization"] == "none"
    nll, _ = _reference(str(tiny_gguf), "none", exact["tokens"], steps=True)
    assert none["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-4)


def test_a_half_precision_kv_cache_scores_as_a_stage_holding_one(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # llama.cpp keeps its KV cache in f16 by default; --kv-dtype float16 scores the ids the
    # way a daemon with `kv_dtype = "float16"` would run them, so the two compare like for like.
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([5, 17, 300, 42, 9, 77, 12, 1000, 3, 64, 8, 250]))
    args = ("--model", str(tiny_gguf), "--token-ids", str(ids_file))
    full = _bench(capsys, *args)
    half = _bench(capsys, *args, "--kv-dtype", "float16")
    assert full["kv_dtype"] == "float32" and half["kv_dtype"] == "float16"
    nll, top1 = _reference(
        str(tiny_gguf), half["quantization"], half["tokens"], steps=False, kv_dtype=torch.float16
    )
    assert half["nll"] == pytest.approx(sum(nll) / len(nll), rel=1e-6)
    assert half["top1"] == top1
    assert half["nll"] != full["nll"]  # the cache's rounding reaches the scores


def test_windows_and_passes_score_like_one_pass() -> None:
    checkpoint = open_checkpoint(builtin_model_dir())
    stage = StageModel.load(checkpoint, 0, checkpoint.config.num_layers)
    ids = [(i * 37 + 11) % checkpoint.config.vocab_size for i in range(20)]
    whole = score(stage, ids, context=64)
    passes = score(stage, ids, context=64, batch=3)
    assert passes.top1 == whole.top1 and len(whole.nll) == len(ids) - 1
    assert passes.nll == pytest.approx(whole.nll, rel=1e-4)
    # Windows of 8: each starts afresh, so its positions are scored as the start of a text.
    windows = score(stage, ids, context=8)
    for start in range(0, len(ids), 8):
        alone = score(stage, ids[start : start + 9], context=8)
        assert windows.nll[start : start + 8] == pytest.approx(alone.nll[:8], rel=1e-4)


def test_bad_token_ids_are_one_line_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    for content in ('{"x": 1}', "[1]", "[1, 99999999]"):
        bad.write_text(content)
        with pytest.raises(SystemExit) as exc:
            main(["bench", "perplexity", "--token-ids", str(bad)])
        assert "meshd bench perplexity" in str(exc.value)
