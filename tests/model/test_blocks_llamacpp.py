"""On a real GGUF file, every kernel path multiplies the model's own activations as llama.cpp's CPU
backend does: the same activation codes and scales (ties to even, d from 127 / amax), the same
per-block terms, so that the only difference left is the order of fp32 sums (a few eps of the
sum of |terms|). Where that holds, meshd and llama.cpp run the same arithmetic on the same file
and any remaining gap in perplexity is rounding noise (docs/benchmarks.md). Where the order is
ggml's own (its AVX2 vec_dot kernels), the SIMD paths give its bits."""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib
from collections.abc import Iterator

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from meshd.bench.llamacpp_q8 import avx2_product, block_product, q4_0_x8, q4_K_x8
from meshd.model import gguf_matrix
from meshd.model.files import open_checkpoint
from meshd.model.kernels.blocks import BlockMatrix
from meshd.model.stage import StageModel
from tests.model.test_blocks_k import random_blocks

_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # Q4_1 layers (Q8_1 activations), a Q8_0 head
# 24 ids: more than the C layer loop's row-attention limit, so each product passes through
# GgufMatrix.mm, where the activations are read.
_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 4354, 351, 1078, 3443, 30, 2, 198]
_IDS += [1, 4093, 198, 504, 1345, 282, 4649, 314]
_ULPS = 16  # the kernels' fp32 sums stay within 6 eps of sum |terms| on this file
# llama.cpp's CPU backend as scripts/bench_llamacpp builds it on this machine (-march=native).
_GGML_CPU = sorted(
    glob.glob(os.path.expanduser("~/.cache/meshd-llamacpp/*/build/bin/libggml-cpu.so"))
)


def _ggml() -> ctypes.CDLL:
    """llama.cpp's CPU library, initialised, with the signatures the tests below call."""
    lib = ctypes.CDLL(_GGML_CPU[-1])
    lib.ggml_cpu_init()
    p, c, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for name in ("quantize_row_q8_0", "quantize_row_q8_K"):
        getattr(lib, name).argtypes = [p, p, ctypes.c_int64]
    for name in ("ggml_vec_dot_q5_0_q8_0", "ggml_vec_dot_q8_0_q8_0"):
        getattr(lib, name).argtypes = [c, p, size, p, size, p, size, c]
    for name in ("ggml_gemv_q4_0_8x8_q8_0", "ggml_gemv_q4_K_8x8_q8_K"):
        getattr(lib, name).argtypes = [c, p, size, p, p, c, c]
    return lib


def _random_rows(rng: np.random.Generator, qtype: T, n_out: int, k: int) -> np.ndarray:
    w = rng.standard_normal((n_out, k)).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(-1)


def _heavy_tailed(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    """Rows of x where cancellation in fp32 shows."""
    return (rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, k)))).astype(np.float32)


def _vec_dot(lib: ctypes.CDLL, qtype: T, raw: np.ndarray, x: np.ndarray, n_out: int) -> np.ndarray:
    """llama.cpp's product `x @ W.T`: its quantize_row_q8_0, then its ggml_vec_dot_*_q8_0 one
    row and token at a time."""
    t, k = x.shape
    dot = getattr(lib, f"ggml_vec_dot_{qtype.name.lower()}_q8_0")
    expected = np.zeros((t, n_out), np.float32)
    out = ctypes.c_float()
    for i in range(t):
        blocks = np.zeros(k // 32 * 34, np.uint8)
        lib.quantize_row_q8_0(x[i].ctypes.data, blocks.ctypes.data, k)
        for r in range(n_out):
            row = raw[r * raw.size // n_out :]
            dot(k, ctypes.addressof(out), 0, row.ctypes.data, 0, blocks.ctypes.data, 0, 1)
            expected[i, r] = out.value
    return expected


def _eps_of_terms(
    got: np.ndarray, expected: np.ndarray, raw: np.ndarray, qtype: T, x: np.ndarray
) -> float:
    """The largest |got - expected| (`[t, n]`) in eps of that output's sum of |terms|."""
    _, bound = block_product(raw, qtype, x, got.shape[1])
    err = np.abs(got.astype(np.float64) - expected.astype(np.float64))
    return float((err / bound).max()) / 2.0**-24


@pytest.fixture(scope="module")
def products() -> Iterator[list[tuple[BlockMatrix, torch.Tensor, np.ndarray, np.ndarray]]]:
    """A sample of the products of one forward pass over `_IDS`: (tensor, input rows,
    llama.cpp's product, its sum of |terms|)."""
    cache = pathlib.Path(os.environ.get("MESHD_MODEL_CACHE", "~/.cache/meshd/models"))
    path = cache.expanduser() / _FILE
    if not path.is_file():
        pytest.skip(f"{_FILE} is not cached (scripts/fetch_models smollm2-135m)")
    seen: list[tuple[BlockMatrix, torch.Tensor]] = []
    plain = gguf_matrix.GgufMatrix.mm

    def recording(self: gguf_matrix.GgufMatrix, x: torch.Tensor) -> torch.Tensor:
        seen.extend((part, x.detach().clone()) for part in self.parts)
        return plain(self, x)

    checkpoint = open_checkpoint(str(path))
    layers = checkpoint.config.num_layers
    stage = StageModel.load(checkpoint, 0, layers, dtype=torch.float32, quantization="gguf")
    stage.open_session("s", len(_IDS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the model tests run (conftest), before its per-test fixture
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf_matrix.GgufMatrix, "mm", recording)
            stage.forward("s", 0, torch.tensor(_IDS))
    finally:
        torch.set_num_threads(threads)
    # Layers 0, 1, the middle and the last, and the output head: a layer's products are its 7
    # tensors (q, k, v fused; o; gate, up fused; down).
    per_layer = 7
    assert len(seen) == layers * per_layer + 1
    keep = [*range(0, 2 * per_layer), *range(15 * per_layer, 16 * per_layer)]
    keep += [*range(29 * per_layer, 30 * per_layer), len(seen) - 1]
    sample = [seen[i] for i in keep]
    # The head's first 8192 rows for the last 4 positions: its full 49152 rows cost the numpy
    # reference seconds, and every row is the same code.
    head, x = sample[-1]
    rows = 8192
    part = head.data[: rows * head.row_bytes]
    sample[-1] = (BlockMatrix(part, head.ggml_type, head.in_features, rows), x[-4:])
    yield [
        (t, x, *block_product(t.data, t.ggml_type, x.numpy(), t.out_features)) for t, x in sample
    ]


def test_every_path_multiplies_real_activations_as_llamacpp_does(
    path: str, products: list[tuple[BlockMatrix, torch.Tensor, np.ndarray, np.ndarray]]
) -> None:
    for tensor, x, expected, bound in products:
        m = BlockMatrix(tensor.data, tensor.ggml_type, tensor.in_features, tensor.out_features)
        assert m.kernel == path
        got = m.mm(x).numpy().astype(np.float64)
        err = np.abs(got - expected)
        worst = float((err / bound).max()) / 2.0**-24
        assert worst <= _ULPS, (tensor.ggml_type.name, m.out_features, m.in_features, worst)


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q4_1, T.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("k", [96, 544, 1568])
def test_the_avx2_path_gives_the_bits_of_ggmls_avx2_kernels(path: str, qtype: T, k: int) -> None:
    # Every 32-element format but Q4_0 and Q8_0 (each block one integer, below) on avx2 runs
    # ggml's AVX2 vec_dot sequence (eight signed int32 lanes per block, one FMA per lane, its
    # horizontal sum), so a product is the one llama.cpp computes on x86 to the bit. With the
    # code offset taken out of one lane only, Q4_0 at k = 96 was 46 eps of the sum of |terms|
    # away from llama.cpp's arithmetic, whose own order is 14 eps from exact there.
    if path == "portable":
        pytest.skip("the portable path sums each block in scalar order (ggml's generic kernel)")
    if path == "avx512":
        pytest.skip("AVX-512 sums each Q5_0 block, and Q4_1/Q5_1 pairs per quarter, to integers")
    rng = np.random.default_rng(int(qtype) * 10_000 + k)
    n_out = 37  # 4-row tiles and a 1-row tail
    raw = _random_rows(rng, qtype, n_out, k)
    m = BlockMatrix(raw, qtype, k, n_out)
    assert m.kernel == path
    # 1 token (decode tiles), 5 (4-token tiles and one), 9 (AVX-512's 8-token tiles and one).
    for t in (1, 5, 9):
        x = _heavy_tailed(rng, t, k)
        got = m.mm(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, avx2_product(raw, qtype, x, n_out)), (t, got.dtype)


@pytest.mark.skipif(
    not _GGML_CPU, reason="needs llama.cpp's libggml-cpu.so (scripts/bench_llamacpp)"
)
def test_q5_0_is_the_bits_of_llamacpps_own_vec_dot(path: str) -> None:
    # The same check against llama.cpp's library itself: its quantize_row_q8_0 and
    # ggml_vec_dot_q5_0_q8_0, one row and token at a time.
    qtype = T.Q5_0
    if path == "portable":
        pytest.skip("the portable path sums each block in scalar order (ggml's generic kernel)")
    if path == "avx512":
        pytest.skip("AVX-512's Q5_0 sums each block to one integer (as the gemv below)")
    rng = np.random.default_rng(int(qtype))
    k, n_out, t = 544, 37, 9
    raw = _random_rows(rng, qtype, n_out, k)
    x = _heavy_tailed(rng, t, k)
    expected = _vec_dot(_ggml(), qtype, raw, x, n_out)
    got = BlockMatrix(raw, qtype, k, n_out).mm(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, expected)


@pytest.mark.skipif(
    not _GGML_CPU, reason="needs llama.cpp's libggml-cpu.so (scripts/bench_llamacpp)"
)
def test_q4_K_decode_is_the_bits_of_llamacpps_repacked_gemv(path: str) -> None:
    # llama.cpp multiplies Q4_K weights by one token with ggml_gemv_q4_K_8x8_q8_K on a repacked
    # copy (its default on x86); meshd reads the rows as stored and runs that kernel's float
    # steps, so a decode step gives its bits on every path. Its own quantize_row_q8_K makes
    # the activations here.
    lib = _ggml()
    quantize, gemv = lib.quantize_row_q8_K, lib.ggml_gemv_q4_K_8x8_q8_K
    rng = np.random.default_rng(35)
    k, n_out = 1536, 40
    raw = random_blocks(T.Q4_K, n_out * k // 256, seed=35)
    packed = q4_K_x8(raw, n_out, k)
    m = BlockMatrix(raw, T.Q4_K, k, n_out)
    for _ in range(3):
        x = (rng.standard_normal(k) * np.exp(rng.standard_normal(k))).astype(np.float32)
        q8 = np.zeros(k // 256 * 292, np.uint8)
        quantize(x.ctypes.data, q8.ctypes.data, k)
        expected = np.zeros(n_out, np.float32)
        gemv(k, expected.ctypes.data, 0, packed.ctypes.data, q8.ctypes.data, 1, n_out)
        got = m.mm(torch.from_numpy(x[None])).numpy()[0]
        assert np.array_equal(got, expected), np.abs(got - expected).max()


@pytest.mark.skipif(
    not _GGML_CPU, reason="needs llama.cpp's libggml-cpu.so (scripts/bench_llamacpp)"
)
def test_q4_0_is_llamacpps_repacked_gemv(path: str) -> None:
    # llama.cpp decodes Q4_0 with ggml_gemv_q4_0_8x8_q8_0 on a repacked copy: each block summed
    # to one integer, then one FMA of (d_w * d_x) per row and block. The avx2 tile runs that
    # sequence: its bits. AVX-512's tile (Q5_0's too) forms the same terms and keeps four
    # partial sums per row (blocks 4j + q): a few eps of the sum of |terms| from it.
    if path == "portable":
        pytest.skip("the portable path sums each block in scalar order (ggml's generic kernel)")
    lib = _ggml()
    rng = np.random.default_rng(40)
    worst = 0.0
    for k in (96, 544, 1568):  # 3 blocks (one short quad), 17 (a quad and one), 49
        n_out = 40
        raw = _random_rows(rng, T.Q4_0, n_out, k)
        x = _heavy_tailed(rng, 1, k)
        q8 = np.zeros(k // 32 * 34, np.uint8)
        lib.quantize_row_q8_0(x.ctypes.data, q8.ctypes.data, k)
        expected = np.zeros((1, n_out), np.float32)
        packed = q4_0_x8(raw, n_out, k)
        lib.ggml_gemv_q4_0_8x8_q8_0(
            k, expected.ctypes.data, 0, packed.ctypes.data, q8.ctypes.data, 1, n_out
        )
        got = BlockMatrix(raw, T.Q4_0, k, n_out).mm(torch.from_numpy(x)).numpy()
        if path == "avx2":
            assert np.array_equal(got, expected), (k, np.abs(got - expected).max())
            continue
        worst = max(worst, _eps_of_terms(got, expected, raw, T.Q4_0, x))
    assert path == "avx2" or 0 < worst <= 4, worst


@pytest.mark.skipif(
    not _GGML_CPU, reason="needs llama.cpp's libggml-cpu.so (scripts/bench_llamacpp)"
)
def test_q8_0_is_llamacpps_vec_dot_to_rounding(path: str) -> None:
    # Both SIMD paths sum each Q8_0 block to one integer (the tiles of Q4_0) where ggml's
    # vec_dot keeps eight lanes per block: the same terms, another order of fp32 additions.
    if path == "portable":
        pytest.skip("the portable path sums each block in scalar order (ggml's generic kernel)")
    lib = _ggml()
    rng = np.random.default_rng(80)
    worst = 0.0
    for k, t in ((96, 1), (544, 5), (1568, 9)):
        n_out = 37
        raw = _random_rows(rng, T.Q8_0, n_out, k)
        x = _heavy_tailed(rng, t, k)
        expected = _vec_dot(lib, T.Q8_0, raw, x, n_out)
        got = BlockMatrix(raw, T.Q8_0, k, n_out).mm(torch.from_numpy(x)).numpy()
        worst = max(worst, _eps_of_terms(got, expected, raw, T.Q8_0, x))
    assert 0 < worst <= 6, worst
