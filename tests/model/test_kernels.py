"""meshd's CPU kernels: which kernel a machine picks, the compiled library's cache, and what
the kernels compute against torch and against each other."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from meshd.bench.checkpoints import make_checkpoint
from meshd.model.checkpoint import Checkpoint
from meshd.model.kernels import build_library, cpu_kernels, unavailable_reason
from meshd.model.stage import StageModel

PROMPT = [1, 5, 99, 23, 23, 180, 7, 64, 2, 211, 17, 42]
RUNS_HERE = unavailable_reason() is None
needs_kernel = pytest.mark.skipif(
    not RUNS_HERE, reason=f"does not run here: {unavailable_reason()}"
)


def _pick(env: dict[str, str]) -> str:
    """Who runs a stage's layers in a fresh process under `env`: "meshd" (the layer kernel,
    `StageModel.layer_kernel`) or "torch" (op by op)."""
    code = (
        "import torch\n"
        "from meshd.model.kernels import cpu_kernels\n"
        "print('meshd' if cpu_kernels() is not None else 'torch')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stdout.strip()


@needs_kernel
def test_a_machine_with_avx512_and_a_compiler_builds_the_kernel_once(
    tmp_path: pathlib.Path,
) -> None:
    cache = tmp_path / "kernels"
    assert _pick({"MESHD_KERNEL_DIR": str(cache)}) == "meshd"
    built = list(cache.glob("layers-*.so"))
    assert len(built) == 1 and not list(cache.glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    # The next start (another daemon, a restart) loads the same file without compiling.
    assert _pick({"MESHD_KERNEL_DIR": str(cache), "CC": "/nonexistent-cc"}) == "meshd"
    assert built[0].stat().st_mtime_ns == stamp


@needs_kernel
def test_an_unusable_compiler_falls_back_to_torch(tmp_path: pathlib.Path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = {"MESHD_KERNEL_DIR": str(tmp_path / "empty"), "CC": str(fake), "TMPDIR": str(tmp_path)}
    assert _pick(env) == "torch"


def test_the_operator_can_choose_torchs_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    make_checkpoint(tmp_path, "llama", seed=4)
    monkeypatch.setenv("MESHD_QUANT_KERNELS", "torch")
    cpu_kernels.cache_clear()
    try:
        assert unavailable_reason() == "MESHD_QUANT_KERNELS=torch"
        stage = StageModel.load(Checkpoint.open(tmp_path), 0, 4, device="cpu")
        assert stage.layer_kernel is None
        monkeypatch.setenv("MESHD_QUANT_KERNELS", "fast")
        cpu_kernels.cache_clear()
        assert "expected one of auto, torch" in (unavailable_reason() or "")
    finally:
        monkeypatch.undo()
        cpu_kernels.cache_clear()


@needs_kernel
def test_the_attention_kernel_attends_as_sdpa_does() -> None:
    # One query row at a time against an fp32 cache (GQA: 8 heads on 2 KV heads), each row its
    # own key range (a causal window, a sliding window's later start): SDPA's result to fp32
    # rounding, and a row's bits the same alone as among others.
    cpu_kernels.cache_clear()
    kernels = cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, positions = 8, 2, 64, 40
    kv = torch.randn(1, positions, 2 * kv_heads, dim, generator=gen)
    q = torch.randn(5, heads * dim, generator=gen)
    starts, ends = [0, 0, 3, 10, 10], [36, 37, 38, 39, 40]

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.empty(len(rows), heads * dim)
        sub = q[rows].contiguous()
        kernels.attend(
            sub.data_ptr(),
            heads * dim,
            len(rows),
            kv.data_ptr(),
            heads,
            kv_heads,
            dim,
            (ctypes.c_int64 * len(rows))(*[starts[r] for r in rows]),
            (ctypes.c_int64 * len(rows))(*[ends[r] for r in rows]),
            dim**-0.5,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    together = attend(list(range(5)))
    for r in range(5):
        keys = kv[:, starts[r] : ends[r], :kv_heads].transpose(1, 2)
        values = kv[:, starts[r] : ends[r], kv_heads:].transpose(1, 2)
        expected = F.scaled_dot_product_attention(
            q[r].view(1, heads, 1, dim), keys, values, enable_gqa=True
        ).view(1, -1)
        assert torch.allclose(together[r : r + 1], expected, atol=1e-5, rtol=1e-4)
        assert torch.equal(attend([r]), together[r : r + 1])


@needs_kernel
def test_a_cache_directory_others_may_write_is_not_trusted(tmp_path: pathlib.Path) -> None:
    # Loading a library from a directory another user can write would run their code: such a
    # directory is passed over for a private one, and nothing is built or loaded there.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir(mode=0o700)
    env = {"MESHD_KERNEL_DIR": str(shared), "TMPDIR": str(private_tmp)}
    assert _pick(env) == "meshd"
    assert not list(shared.iterdir())
    assert list(private_tmp.glob("meshd-kernels-*/layers-*.so"))


# --- whole layers in one call ----------------------------------------------------------------


def _pair(directory: pathlib.Path, family: str, quantization: str) -> tuple[StageModel, StageModel]:
    """The same stage twice: one running its layers in one kernel call, one op by op."""
    make_checkpoint(directory, family, seed=4)
    checkpoint = Checkpoint.open(directory)
    n = checkpoint.config.num_layers
    fused = StageModel.load(checkpoint, 0, n, device="cpu", quantization=quantization)
    by_op = StageModel.load(checkpoint, 0, n, device="cpu", quantization=quantization)
    assert fused.layer_kernel == "meshd layers"
    by_op._kernel_layers = None  # the per-operation path, as a stage without it runs
    return fused, by_op


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "llama3_rope"])
@pytest.mark.parametrize("quantization", ["q8_0", "q4_k"])
def test_layers_in_one_call_compute_the_bits_of_layer_by_layer(
    tmp_path: pathlib.Path, family: str, quantization: str
) -> None:
    # Logits and cached keys and values, for a prompt of 12 (one call), steps, a verify window
    # of 5, and positions past mistral's sliding window of 6; qwen2 adds q/k/v biases.
    fused, by_op = _pair(tmp_path, family, quantization)
    windows = [(0, PROMPT[:12]), (12, [7]), (13, [9]), (14, PROMPT[:5]), (19, [3]), (20, [4])]
    with torch.inference_mode():
        for stage in (fused, by_op):
            stage.open_session("s", 64)
        for base, ids in windows:
            a = fused.forward("s", base, torch.tensor(ids)).logits
            b = by_op.forward("s", base, torch.tensor(ids)).logits
            assert a is not None and b is not None
            assert torch.equal(a, b), (base, float((a - b).abs().max()))
    kv = [stage.kv.get("s").main.kv[:, :21] for stage in (fused, by_op)]
    assert torch.equal(kv[0], kv[1])


@needs_kernel
def test_a_batch_runs_each_window_as_it_runs_alone(tmp_path: pathlib.Path) -> None:
    # Short windows of several sessions run in one kernel call; a batch holding a prompt longer
    # than a verify window runs op by op. Either way each session's logits are its own alone.
    fused, _ = _pair(tmp_path, "qwen2", "q8_0")
    long_prompt = (PROMPT * 2)[:20]
    with torch.inference_mode():
        for sid in ("a", "b", "c", "a1", "b1", "c1"):
            fused.open_session(sid, 64)
        for sid in ("a", "a1"):
            fused.forward(sid, 0, torch.tensor(PROMPT[:6]))
        for sid in ("b", "b1"):
            fused.forward(sid, 0, torch.tensor(PROMPT[:9]))
        alone = [
            fused.forward("a1", 6, torch.tensor([5])).logits,
            fused.forward("b1", 9, torch.tensor(PROMPT[:4])).logits,
            fused.forward("c1", 0, torch.tensor(long_prompt)).logits,
        ]
        short = fused.forward_batch(
            [("a", 6, torch.tensor([5])), ("b", 9, torch.tensor(PROMPT[:4]))]
        )
        fused.close_session("a")
        fused.open_session("a", 64)
        fused.forward("a", 0, torch.tensor(PROMPT[:6]))
        mixed = fused.forward_batch(
            [("a", 6, torch.tensor([5])), ("c", 0, torch.tensor(long_prompt))]
        )
    assert torch.equal(short[0].logits, alone[0]) and torch.equal(short[1].logits, alone[1])
    assert torch.equal(mixed[0].logits, alone[0]) and torch.equal(mixed[1].logits, alone[2])


@needs_kernel
def test_stages_the_layer_kernel_cannot_run_go_op_by_op(tmp_path: pathlib.Path) -> None:
    # Qwen3's per-head q/k norms are not in the kernel; an fp16 cache, or bf16 compute, are
    # not either.
    make_checkpoint(tmp_path / "qwen3", "qwen3", seed=4)
    make_checkpoint(tmp_path / "llama", "llama", seed=4)
    qwen3 = Checkpoint.open(tmp_path / "qwen3")
    llama = Checkpoint.open(tmp_path / "llama")
    assert StageModel.load(qwen3, 0, 4, device="cpu", quantization="q8_0").layer_kernel is None
    narrow = StageModel.load(llama, 0, 4, device="cpu", quantization="q8_0", kv_dtype=torch.float16)
    assert narrow.layer_kernel is None
    bf16 = StageModel.load(llama, 0, 4, device="cpu", dtype=torch.bfloat16)
    assert bf16.layer_kernel is None
    assert StageModel.load(llama, 0, 4, device="cpu").layer_kernel == "meshd layers"


# --- fp32 stages ---------------------------------------------------------------------------


def _f32_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    res: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """meshd's fp32 product of rows `x` by `w` `[in, out]` as a stage holds it (contiguous, or
    the transposed view of `[out, in]` rows)."""
    kernels = cpu_kernels()
    assert kernels is not None
    k, n = w.shape
    transposed = w.stride(1) == 1
    out = torch.empty(x.shape[0], n)
    failed = kernels.f32_mm(
        x.data_ptr(),
        x.shape[0],
        k,
        w.data_ptr(),
        w.stride(0) if transposed else w.stride(1),
        n,
        int(transposed),
        out.data_ptr(),
        None if res is None else res.data_ptr(),
        None if norm is None else norm.data_ptr(),
        1e-6,
        int(glu),
        2,
    )
    assert not failed
    return out


@needs_kernel
@pytest.mark.parametrize("layout", ["in-major", "out-major"])
def test_the_fp32_kernel_multiplies_as_torch_does_and_each_row_alone(layout: str) -> None:
    # Both layouts a stage holds, odd shapes (outputs past a 64-wide tile, inputs past a
    # 16-wide vector), with the norm, SwiGLU and residual inside the call: torch's result to
    # fp32 rounding, and every row's bits the same alone as in a window of 13.
    gen = torch.Generator().manual_seed(3)
    k, n = 300, 203
    rows = torch.randn(n, k, generator=gen) * 0.05
    w = rows.t().contiguous() if layout == "in-major" else rows.t()
    x = torch.randn(13, k, generator=gen) * torch.logspace(-2, 2, 13)[:, None]
    res = torch.randn(13, n, generator=gen)
    norm = torch.rand(k, generator=gen) + 0.5
    gate_up = torch.randn(13, 2 * k, generator=gen) * 3

    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm
    gated = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    cases = [  # (rows, residual, norm, SwiGLU, what torch computes)
        (x, None, None, False, x @ w),
        (x, res, None, False, res + x @ w),
        (x, None, norm, False, normed @ w),
        (gate_up, None, None, True, gated @ w),
    ]
    for rows_in, residual, norm_w, glu, expected in cases:
        got = _f32_mm(rows_in, w, residual, norm_w, glu)
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
        for i in (0, 5, 12):
            one_res = None if residual is None else residual[i : i + 1]
            one = _f32_mm(rows_in[i : i + 1], w, one_res, norm_w, glu)
            assert torch.equal(one, got[i : i + 1])


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_fp32_layers_in_one_call_agree_with_torch_and_windows_equal_steps(
    tmp_path: pathlib.Path, family: str
) -> None:
    # An fp32 stage's layers in one call: logits and the cache match the op-by-op (MKL) path to
    # fp32 rounding with the same greedy tokens; a verify window computes the bits of the
    # decode steps it replaces, so speculation cannot change a greedy token.
    fused, by_op = _pair(tmp_path, family, "none")
    steps = [(12, [7]), (13, [9]), (14, [4]), (15, [31]), (16, [8]), (17, [2]), (18, [77])]
    with torch.inference_mode():
        for stage in (fused, by_op):
            stage.open_session("s", 64)
        fused.open_session("w", 64)
        fused.forward("w", 0, torch.tensor(PROMPT))
        step_logits = []
        for base, ids in [(0, PROMPT), *steps]:
            a = fused.forward("s", base, torch.tensor(ids)).logits
            b = by_op.forward("s", base, torch.tensor(ids)).logits
            assert a is not None and b is not None
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())
            assert torch.equal(a[-1].argmax(), b[-1].argmax())
            step_logits.append(a[-1])
        window = fused.forward("w", 12, torch.tensor([ids[0] for _, ids in steps])).logits
    assert window is not None
    assert torch.equal(window, torch.stack(step_logits[1:]))
    kv = [stage.kv.get("s").main.kv[:, :19] for stage in (fused, by_op)]
    assert torch.allclose(kv[0], kv[1], rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_window_over_a_long_span_attends_on_threads_with_the_bits_of_its_steps(
    tmp_path: pathlib.Path,
) -> None:
    # Short spans attend on the calling thread, long ones split over the threads: a window of
    # 16 rows after 48 positions splits, each of its steps alone does not, and they agree.
    fused, _ = _pair(tmp_path, "llama", "none")
    prompt = (PROMPT * 4)[:48]
    window = (PROMPT * 2)[:16]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            for sid in ("steps", "window"):
                fused.open_session(sid, 80)
                fused.forward(sid, 0, torch.tensor(prompt))
            steps = [
                fused.forward("steps", 48 + i, torch.tensor([tok])).logits
                for i, tok in enumerate(window)
            ]
            together = fused.forward("window", 48, torch.tensor(window)).logits
    finally:
        torch.set_num_threads(before)
    assert together is not None and all(s is not None for s in steps)
    assert torch.equal(together, torch.cat([s for s in steps if s is not None]))


def test_an_edited_header_builds_a_new_library(tmp_path: pathlib.Path) -> None:
    # The library cache is keyed by what the build reads: a header the source includes is part
    # of it, so after the header changes the library loaded is the one built from the new text,
    # never the stale one.
    if shutil.which(os.environ.get("CC") or "cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "src"
    src.mkdir()
    (src / "value.h").write_text("#define VALUE 1\n")
    (src / "lib.c").write_text('#include "value.h"\nint meshd_value(void) { return VALUE; }\n')
    built = tmp_path / "built"
    flags = ("-O1", "-fPIC", "-shared")

    def value() -> int:
        path = build_library("probe", [src / "lib.c"], flags, built, timeout_s=60)
        return int(ctypes.CDLL(str(path)).meshd_value())

    assert value() == 1
    (src / "value.h").write_text("#define VALUE 2\n")
    assert value() == 2
    assert len(list(built.glob("probe-*.so"))) == 2
