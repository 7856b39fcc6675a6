"""GGUF block kernels: every supported type on every kernel path this CPU runs matches ggml's
arithmetic (gguf.quants for the weights, llama.cpp's CPU activation quantizers), batches are
bit-identical to single
steps, and tensors are read in place from a read-only map."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from meshd.bench.llamacpp_q8 import q8_0_bytes
from meshd.config.sources import load_config
from meshd.model.kernels import blocks
from meshd.model.kernels.blocks import (
    BLOCK_KERNELS_ENV,
    BlockMatrix,
    UnavailableKernelPath,
    UnsupportedTensorType,
    block_kernels,
    kernel_path,
    path_unavailable_reason,
    supported_types,
)

_K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
_ONE = (T.Q4_1, T.Q5_1)  # multiplied with Q8_1 activations (their dot uses the block's sum)
_Q8_0_ACT = (T.Q4_0, T.Q5_0, T.Q8_0)
_FLOAT = (T.F32, T.F16, T.BF16)
_FIELDS_K = {T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)), T.Q6_K: (210, (208,))}


def _types() -> list[T]:
    return sorted(blocks.GGML_TYPES, key=int)


def _weights(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random weights of `qtype` as a GGUF file stores them (flat uint8)."""
    if qtype in _K_TYPES:
        # gguf.quants cannot quantize K types: random blocks with sane fp16 scales are valid.
        size, scale_at = _FIELDS_K[qtype]
        raw = rng.integers(0, 256, size=(n_out * k // 256, size), dtype=np.uint8)
        for at in scale_at:
            scale = (rng.random(raw.shape[0]) * np.float32(0.01)).astype(np.float16)
            raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
        return raw.reshape(-1)
    w = rng.standard_normal((n_out, k)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)


def _dequantize(raw: np.ndarray, qtype: T, n_out: int, k: int) -> np.ndarray:
    data = raw.view(np.float32) if qtype == T.F32 else raw
    data = data.view(np.float16) if qtype == T.F16 else data
    return gguf.quants.dequantize(data.reshape(n_out, -1), qtype).reshape(n_out, k)


def _q8_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref, dequantized: blocks of 256 scaled by the signed max."""
    b = x.reshape(-1, 256)
    at = np.abs(b).argmax(axis=1)
    top = b[np.arange(len(b)), at][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(top == 0, np.float32(0), np.float32(-127) / top).astype(np.float32)
        q = np.minimum(np.rint(iscale * b), 127).astype(np.float32)
        d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    return np.asarray((q * d).reshape(x.shape))


def _reference(raw: np.ndarray, qtype: T, x: np.ndarray, n_out: int) -> np.ndarray:
    """What ggml computes, in float64: x converted to the type's vec_dot type, then a matmul with
    the dequantized weights; the _1 formats add m * s with s rounded to fp16 as ggml stores it."""
    t, k = x.shape
    w = _dequantize(raw, qtype, n_out, k).astype(np.float64)
    if qtype in _FLOAT:
        xa = x if qtype == T.F32 else _dequantize(gguf.quants.quantize(x, qtype), qtype, t, k)
        return xa.astype(np.float64) @ w.T
    if qtype in _K_TYPES:
        return _q8_k(x).astype(np.float64) @ w.T
    xq = q8_0_bytes(x)  # llama.cpp's CPU activation blocks (gguf.quants rounds ties away)
    y = _dequantize(xq, T.Q8_0, t, k).astype(np.float64) @ w.T
    if qtype in _ONE:
        # Q8_1's s = fp16(d * sum(q)) with d unrounded, where d * sum(q) is what dequantizing gives.
        blocks_x = xq.reshape(t, k // 32, 34)
        codes = blocks_x[:, :, 2:].view(np.int8).astype(np.int32).sum(axis=2).astype(np.float32)
        d = np.abs(x.reshape(t, k // 32, 32)).max(axis=2) / np.float32(127)
        d16 = blocks_x[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        s = (codes * d).astype(np.float16).astype(np.float64)
        size = 20 if qtype == T.Q4_1 else 24
        m = raw.reshape(n_out, k // 32, size)[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        y += (s - codes.astype(np.float64) * d16) @ m.astype(np.float64).T
    return y


def _bound(raw: np.ndarray, qtype: T, x: np.ndarray, n_out: int) -> np.ndarray:
    """Sum of |terms| of each output: fp32 accumulation error is a small multiple of eps of it."""
    w = np.abs(_dequantize(raw, qtype, n_out, x.shape[1]).astype(np.float64))
    return np.abs(x.astype(np.float64)) @ w.T


@pytest.mark.parametrize("qtype", _types(), ids=lambda q: q.name)
@pytest.mark.parametrize(("k", "n_out"), [(256, 64), (544, 37), (96, 19)])
def test_every_type_computes_what_ggml_computes(path: str, qtype: T, k: int, n_out: int) -> None:
    if qtype in _K_TYPES and k % 256:
        pytest.skip("K-quant rows are whole 256-element blocks")
    rng = np.random.default_rng(int(qtype) * 1000 + k)
    raw = _weights(qtype, n_out, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    m = BlockMatrix(raw, qtype, k, n_out)
    assert m.kernel == path and m.nbytes == raw.nbytes
    y = m.mm(torch.from_numpy(x)).numpy().astype(np.float64)
    ref = _reference(raw, qtype, x, n_out)
    err = np.abs(y - ref)
    assert (err <= 2e-5 * _bound(raw, qtype, x, n_out) + 1e-6).all(), err.max()


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda q: q.name)
def test_float_types_take_any_row_length(path: str, qtype: T) -> None:
    rng = np.random.default_rng(7)
    k, n_out = 100, 23
    raw = _weights(qtype, n_out, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = BlockMatrix(raw, qtype, k, n_out).mm(torch.from_numpy(x)).numpy()
    ref = _reference(raw, qtype, x, n_out)
    assert np.allclose(y, ref, rtol=0, atol=2e-5 * _bound(raw, qtype, x, n_out).max())


@pytest.mark.parametrize("qtype", _types(), ids=lambda q: q.name)
# 544: 17 blocks, an odd last block (the AVX-512 tiles take blocks in pairs); 768: three
# K-quant super-blocks.
@pytest.mark.parametrize("k", [512, 544, 768])
def test_a_batch_is_bit_identical_to_single_steps_on_any_thread_count(
    path: str, qtype: T, k: int, threads: None
) -> None:
    if qtype in _K_TYPES and k % 256:
        pytest.skip("K-quant rows are whole 256-element blocks")
    if qtype not in _K_TYPES and k == 768:
        pytest.skip("768 is for the K-quants' odd super-block count")
    rng = np.random.default_rng(int(qtype))
    # 47 rows: units of 16 leave 15, i.e. 4-row tiles with a 2-row and a 1-row tail.
    n_out = 47
    m = BlockMatrix(_weights(qtype, n_out, k, rng), qtype, k, n_out)
    # 70 tokens cross the kernel's 64-token units of work.
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    torch.set_num_threads(1)
    singles = torch.cat([m.mm(x[i : i + 1]) for i in range(70)])
    for n in (1, 2):
        torch.set_num_threads(n)
        # 8-token tiles (AVX-512 Q4_0, Q5_0) and 4-token ones with every tail.
        for t in (1, 2, 3, 7, 9, 12, 16, 33, 70):
            for start in (0, 70 - t):
                got = m.mm(x[start : start + t])
                assert torch.equal(got, singles[start : start + t]), (n, t, start)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q4_K], ids=lambda q: q.name)
def test_a_matrix_large_enough_to_split_gives_the_single_thread_bits(
    path: str, qtype: T, threads: None
) -> None:
    # Small products stay on one thread; a matrix of a few hundred kB splits even for one token
    # (its activations then converted before the threads start), and must not change a bit.
    if qtype not in supported_types():
        pytest.skip(f"{qtype.name} has no kernel in this installation")
    rng = np.random.default_rng(11)
    k, n_out = 512, 1100
    m = BlockMatrix(_weights(qtype, n_out, k, rng), qtype, k, n_out)
    assert m.nbytes >= 256 * 1024
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    torch.set_num_threads(1)
    singles = torch.cat([m.mm(x[i : i + 1]) for i in range(9)])
    torch.set_num_threads(2)
    for t in (1, 2, 4, 5, 9):
        assert torch.equal(m.mm(x[:t]), singles[:t]), t


@pytest.mark.parametrize("qtype", sorted(set(blocks._NON_K + _K_TYPES)), ids=str)
def test_rows_are_the_dequantized_weights(path: str, qtype: T) -> None:
    rng = np.random.default_rng(3)
    k, n_out = 512, 9
    raw = _weights(qtype, n_out, k, rng)
    full = torch.from_numpy(_dequantize(raw, qtype, n_out, k).astype(np.float32))
    lib = block_kernels()
    ids = torch.tensor([4, 0, 8, 4], dtype=torch.int64)
    if qtype in supported_types():
        m = BlockMatrix(raw, qtype, k, n_out)
        assert torch.equal(m.dequantize(), full)
        assert torch.equal(m.rows(ids.reshape(2, 2)), full[ids].reshape(2, 2, k))
    else:
        # K types without their dot products still dequantize (embeddings are often Q4_K/Q6_K).
        out = torch.empty(len(ids), k)
        ptr = ctypes.c_void_p
        lib.dequantize_rows(
            int(qtype), ptr(raw.ctypes.data), k, ptr(ids.data_ptr()), len(ids), ptr(out.data_ptr())
        )
        assert torch.equal(out, full[ids])


@pytest.mark.skipif(
    path_unavailable_reason("avx2") is not None or "avx_vnni" not in blocks._cpu_flags(),
    reason="needs a CPU with AVX2 and AVX-VNNI (the avx2 path's two builds)",
)
def test_avx2_with_and_without_avx_vnni_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    n_out = 21
    x = torch.from_numpy(rng.standard_normal((6, 768)).astype(np.float32))
    types = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, *_K_TYPES)
    ks = {q: 768 if q in _K_TYPES else 544 for q in types}
    weights = {q: _weights(q, n_out, ks[q], rng) for q in types}

    def products() -> dict[T, torch.Tensor]:
        return {
            q: BlockMatrix(raw, q, ks[q], n_out, path="avx2").mm(x[:, : ks[q]])
            for q, raw in weights.items()
        }

    vnni = products()
    flags = blocks._cpu_flags() - {"avx_vnni"}
    monkeypatch.setattr(blocks, "_cpu_flags", lambda: flags)
    for q, plain in products().items():
        assert torch.equal(plain, vnni[q]), q.name


def test_the_c_entry_point_without_a_thread_count_computes_the_same(path: str) -> None:
    # meshd_blocks_mm: the C API for callers outside Python (OpenMP's own thread count).
    rng = np.random.default_rng(17)
    k, n_out, t = 256, 33, 5
    raw = _weights(T.Q4_0, n_out, k, rng)
    x = torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32))
    lib = ctypes.CDLL(str(block_kernels().path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.meshd_blocks_scratch_bytes.argtypes = [ctypes.c_int, i64, i64]
    lib.meshd_blocks_scratch_bytes.restype = i64
    lib.meshd_blocks_mm.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, p]
    scratch = np.empty(lib.meshd_blocks_scratch_bytes(int(T.Q4_0), k, t), dtype=np.uint8)
    y = torch.empty(t, n_out)
    lib.meshd_blocks_mm(
        int(T.Q4_0), raw.ctypes.data, k, n_out, x.data_ptr(), t, y.data_ptr(), scratch.ctypes.data
    )
    assert torch.equal(y, BlockMatrix(raw, T.Q4_0, k, n_out).mm(x))


def test_a_read_only_map_of_the_file_is_used_in_place(path: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    k, n_out = 256, 40
    raw = _weights(T.Q4_0, n_out, k, rng)
    file = tmp_path / "tensor.bin"
    file.write_bytes(b"\0" * 96 + raw.tobytes())
    mapped = np.memmap(file, dtype=np.uint8, mode="r", offset=96, shape=(raw.nbytes,))
    assert not mapped.flags.writeable
    m = BlockMatrix(mapped, T.Q4_0, k, n_out)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    assert torch.equal(m.mm(x), BlockMatrix(raw, T.Q4_0, k, n_out).mm(x))
    assert torch.equal(m.rows(torch.tensor([39])), m.dequantize()[39:])


def test_a_type_without_a_kernel_is_named() -> None:
    raw = np.zeros(66, dtype=np.uint8)
    with pytest.raises(UnsupportedTensorType, match="IQ2_XXS"):
        BlockMatrix(raw, T.IQ2_XXS, 256, 1)
    if T.Q4_K not in supported_types():
        with pytest.raises(UnsupportedTensorType, match="Q4_K"):
            BlockMatrix(np.zeros(144, dtype=np.uint8), T.Q4_K, 256, 1)


def test_wrong_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="not whole blocks"):
        BlockMatrix(np.zeros(18, dtype=np.uint8), T.Q4_0, 48, 1)
    with pytest.raises(ValueError, match="bytes"):
        BlockMatrix(np.zeros(17, dtype=np.uint8), T.Q4_0, 32, 1)
    m = BlockMatrix(np.zeros(18, dtype=np.uint8), T.Q4_0, 32, 1)
    with pytest.raises(ValueError, match="fp32"):
        m.mm(torch.zeros(2, 64))


def test_the_daemon_config_leaves_the_kernel_choice_to_the_process(tmp_path: Path) -> None:
    # MESHD_* variables are config keys unless they are the process's kernel choices.
    env = {"HOME": str(tmp_path), BLOCK_KERNELS_ENV: "avx2"}
    assert load_config({}, env, None)


def test_a_forced_path_the_cpu_cannot_run_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "_cpu_flags", lambda: {"sse2"})
    monkeypatch.setenv(BLOCK_KERNELS_ENV, "avx512")
    with pytest.raises(UnavailableKernelPath, match="avx512"):
        kernel_path()
    monkeypatch.setenv(BLOCK_KERNELS_ENV, "auto")
    assert kernel_path() == "portable"
    monkeypatch.setenv(BLOCK_KERNELS_ENV, "fast")
    with pytest.raises(UnavailableKernelPath, match="fast"):
        kernel_path()


def test_the_greedy_token_is_torchs_argmax_on_every_path(path: str) -> None:
    # What a greedy request answers must not depend on the CPU: the first of equal maxima, the
    # first NaN, rows of any length and stride, as torch.argmax picks them.
    gen = torch.Generator().manual_seed(7)
    vocab = torch.randn(3, 151_936, generator=gen)
    ties = torch.randint(0, 3, (6, 1001), generator=gen).float()  # many equal maxima per row
    masked = torch.randn(2, 4099, generator=gen)
    masked[:, ::2] = float("-inf")  # a grammar's mask
    nan = torch.randn(2, 300, generator=gen)
    nan[0, 250], nan[0, 17], nan[1, 299] = float("nan"), float("nan"), float("nan")
    cases = [vocab, ties, masked, nan, vocab[:, 5:70_005], torch.full((1, 9), float("-inf"))]
    cases += [torch.randn(1, n, generator=gen) for n in (1, 7, 8, 15, 16, 17, 33)]
    for logits in cases:
        assert blocks.argmax_rows(logits) == logits.argmax(-1).tolist(), logits.shape
    assert blocks.argmax_rows(vocab[1]) == [int(vocab[1].argmax())]
    assert blocks._argmax_library(path) is block_kernels(path)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0], ids=lambda q: q.name)
def test_prefetching_for_streamed_weights_changes_no_bit(path: str, qtype: T) -> None:
    # The tiles prefetch differently where a process's weights exceed the cache: the same
    # model must answer the same on a large machine and a small one.
    rng = np.random.default_rng(int(qtype) + 5)
    k, n_out = 544, 203  # 4-row tiles far enough apart that the prefetch runs ahead
    m = BlockMatrix(_weights(qtype, n_out, k, rng), qtype, k, n_out)
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    lib = block_kernels(path)
    try:
        lib.set_streaming(0)
        cached = [m.mm(x[:t]) for t in (1, 4, 9)]
        lib.set_streaming(1)
        streamed = [m.mm(x[:t]) for t in (1, 4, 9)]
    finally:
        blocks.note_step_weights(0)  # back to what the process's weights call for
    for a, b in zip(cached, streamed, strict=True):
        assert torch.equal(a, b)


def test_weights_beyond_the_last_level_cache_are_prefetched_as_a_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "_step_bytes", 0)
    monkeypatch.setattr(blocks, "last_level_cache_bytes", lambda: 1000)
    try:
        assert blocks.note_step_weights(600) is False  # one stage fits the cache
        assert blocks.note_step_weights(600) is True  # two stages of one process do not
        monkeypatch.setattr(blocks, "last_level_cache_bytes", lambda: None)
        assert blocks.note_step_weights(0) is False  # a cache the system does not name
    finally:
        monkeypatch.undo()
        blocks.note_step_weights(0)
    size = blocks.last_level_cache_bytes()
    assert size is None or size >= 1 << 20  # sysfs's "307200K" read as bytes
