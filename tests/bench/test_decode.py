"""`meshd bench decode` runs end to end and reports comparable figures."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from meshd.bench.checkpoints import make_checkpoint
from meshd.bench.decode import RANDOM_CONFIGS
from meshd.bench.gguf_writer import write_gguf
from meshd.cli.main import main
from meshd.model.builtin import builtin_model_dir
from meshd.model.config import parse_config
from meshd.model.kernels import unavailable_reason
from meshd.model.kernels.blocks import kernel_path
from meshd.model.stage import stage_weight_bytes


def test_bench_decode_json_on_a_random_checkpoint(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "decode", "--random-config", "tiny", "--quick", "--json", "--tokens", "8"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "random-tiny" and report["tokens"] == 8 and report["rounds"] == 3
    assert report["meshd_tok_s"] > 0 and report["transformers_tok_s"] > 0
    assert report["ratio"] == pytest.approx(
        report["meshd_tok_s"] / report["transformers_tok_s"], rel=0.01
    )
    assert report["same_tokens"] is True  # both sides decoded the same greedy text
    assert 0 < report["matmul_floor_cpu_ms_per_tok"] < report["meshd_cpu_ms_per_tok"]
    assert len(report["meshd_runs_tok_s"]) == len(report["transformers_runs_tok_s"]) == 3


def test_bench_decode_text_report_for_a_given_model(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path, "qwen2", num_hidden_layers=2)
    assert (
        main(["bench", "decode", "--model", str(tmp_path), "--tokens", "4", "--rounds", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "ratio" in out and "same greedy tokens: True" in out


@pytest.mark.parametrize(
    ("quantization", "scheme"), [("int8", "q8_0"), ("int4", "q4_k"), ("q4_0", "q4_0")]
)
def test_bench_decode_reports_quantized_bytes_held(
    capsys: pytest.CaptureFixture[str], quantization: str, scheme: str
) -> None:
    def report(*extra: str) -> dict[str, object]:
        args = ["bench", "decode", "--random-config", "tiny", "--json", "--tokens", "4"]
        assert main([*args, "--rounds", "1", "--no-transformers", *extra]) == 0
        result: dict[str, object] = json.loads(capsys.readouterr().out)
        return result

    fp32 = report()
    quantized = report("--quantization", quantization, "--kv-dtype", "float16", "--threads", "1")
    # The old names int8/int4 are reported as the block formats they stand for.
    assert quantized["quantization"] == scheme and quantized["kv_dtype"] == "float16"
    assert isinstance(quantized["meshd_tok_s"], float) and quantized["meshd_tok_s"] > 0
    assert quantized["transformers_tok_s"] is None and quantized["threads"] == 1
    config = parse_config(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
         "max_position_embeddings": 4096} | RANDOM_CONFIGS["tiny"]
    )  # fmt: skip
    n = config.num_layers
    for result, name in ((fp32, "none"), (quantized, scheme)):
        assert result["weight_bytes"] == stage_weight_bytes(config, 0, n, torch.float32, name)
    assert quantized["kv_bytes_per_token"] == fp32["kv_bytes_per_token"] // 2  # type: ignore[operator]
    # The report names the kernels that ran: fp32 matrices on torch's mm, block ones on the
    # block library's path for this CPU.
    assert fp32["kernels"] == ["torch mm"]
    assert quantized["kernels"] == [kernel_path()]
    # Steps of an fp32 stage run every layer in one kernel call where meshd's kernels run; an
    # fp16 cache runs layer by layer.
    assert fp32["layer_kernel"] == ("meshd layers" if unavailable_reason() is None else None)
    assert quantized["layer_kernel"] is None


def test_a_quantized_gguf_file_is_benched_at_its_own_quantization(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_gguf(builtin_model_dir(), tmp_path / "builtin-q8.gguf", "Q8_0")
    args = ["bench", "decode", "--model", str(model), "--json", "--tokens", "4", "--rounds", "1"]
    assert main([*args, "--no-transformers"]) == 0
    report = json.loads(capsys.readouterr().out)
    # As stored, never dequantized to fp32 behind the user's back.
    assert report["quantization"] == "gguf"
    # Where meshd's kernels run, a gguf stage with an fp32 cache runs its layers in one call.
    assert report["layer_kernel"] == ("meshd layers" if unavailable_reason() is None else None)


def test_prefill_of_a_gguf_file_is_timed_alone(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_gguf(builtin_model_dir(), tmp_path / "builtin-q8.gguf", "Q8_0")
    args = ["bench", "decode", "--model", str(model), "--prefill", "40", "--rounds", "2"]
    assert main([*args, "--json", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    # What llama-bench -p 40 -n 0 reports: prompt tokens per second, here for each run.
    assert report["prefill_tokens"] == 40 and report["quantization"] == "gguf"
    assert len(report["meshd_prefill_runs_tok_s"]) == 2 and report["meshd_prefill_tok_s"] > 0
    assert min(report["meshd_prefill_runs_tok_s"]) <= report["meshd_prefill_tok_s"]
    assert report["meshd_prefill_tok_s"] <= max(report["meshd_prefill_runs_tok_s"])
    assert main(args) == 0
    assert "prefill of 40 tokens" in capsys.readouterr().out
