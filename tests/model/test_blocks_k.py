"""The K-quant block kernels (meshd/model/kernels/blocks_k.c) against llama.cpp's references.

Each compiled path (AVX-512, AVX2, portable C) is built here from the one C file with `cc`, as
the kernel library builds it, and loaded through ctypes. What is checked, per path and per
format (Q4_K, Q5_K, Q6_K):
- dequantizing a row gives exactly what `gguf.quants.dequantize` (llama.cpp's gguf-py) gives;
- quantizing activations to Q8_K gives exactly a numpy port of ggml's quantize_row_q8_K_ref;
- a dot product equals the float64 dot of the dequantized operands to float rounding;
- every path gives the same bits, whatever the alignment of its inputs;
- a weight row against several tokens at once (the prefill tiles) gives each token the bits of
  its single-token dot, and eight Q4_K rows against one token (the decode kernel) give each
  row the bits of its single dot.

gguf-py cannot quantize K formats, so weights are random valid blocks built byte by byte.
"""

from __future__ import annotations

import ctypes
import pathlib
import platform
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

SOURCE = pathlib.Path(__file__).parents[2] / "meshd" / "model" / "kernels" / "blocks_k.c"
QK_K = 256
Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", (QK_K,)), ("bsums", "<i2", (QK_K // 16,))])
BLOCK_BYTES = {
    GGMLQuantizationType.Q4_K: 144,
    GGMLQuantizationType.Q5_K: 176,
    GGMLQuantizationType.Q6_K: 210,
}
TYPES = list(BLOCK_BYTES)
LENGTHS = (256, 512, 1536, 2304)
ROWS = 3

COMMON = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Werror")
# Each path: its compiler flags and the /proc/cpuinfo flags a CPU needs to run it.
PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    ),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "portable": ((), ()),
}

_U8 = ctypes.POINTER(ctypes.c_uint8)
_F32 = ctypes.POINTER(ctypes.c_float)


def _cpu_flags() -> set[str]:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _suffix(qtype: GGMLQuantizationType) -> str:
    """The C functions' spelling of a type: Q4_K -> q4_K."""
    return "q" + qtype.name[1:]


@dataclass(frozen=True)
class Kernels:
    """One compiled path of blocks_k.c, called on numpy arrays."""

    path: str
    lib: ctypes.CDLL

    def quantize_q8_K(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = np.zeros(x.size // QK_K, dtype=Q8_K)
        self.lib.meshd_quantize_row_q8_K(x.ctypes.data_as(_F32), out.ctypes.data, x.size)
        return out

    def dequantize(self, qtype: GGMLQuantizationType, w: np.ndarray) -> np.ndarray:
        n = w.size // BLOCK_BYTES[qtype] * QK_K
        out = np.empty(n, dtype=np.float32)
        fn = getattr(self.lib, f"meshd_dequantize_row_{_suffix(qtype)}")
        fn(w.ctypes.data, out.ctypes.data_as(_F32), n)
        return out

    def vec_dot(self, qtype: GGMLQuantizationType, w: np.ndarray, x8: np.ndarray) -> float:
        """The dot product of the weight blocks `w` (bytes) with as many Q8_K blocks `x8`."""
        fn = getattr(self.lib, f"meshd_vec_dot_{_suffix(qtype)}_q8_K")
        n = w.size // BLOCK_BYTES[qtype] * QK_K
        return float(fn(n, w.ctypes.data, x8.ctypes.data))

    def rows(
        self, qtype: GGMLQuantizationType, w: np.ndarray, x8: np.ndarray, stride: int, nt: int
    ) -> np.ndarray:
        """One weight row against `nt` tokens, token r's Q8_K blocks at byte r * stride of x8."""
        fn = getattr(self.lib, f"meshd_rows_{_suffix(qtype)}_q8_K")
        n = w.size // BLOCK_BYTES[qtype] * QK_K
        out = np.full(nt, np.nan, dtype=np.float32)
        fn(n, w.ctypes.data, x8.ctypes.data, stride, nt, out.ctypes.data_as(_F32))
        return out

    def rows8_q4_K(self, w: np.ndarray, row_bytes: int, x8: np.ndarray) -> np.ndarray:
        """Eight Q4_K rows, row r at byte r * row_bytes of w, against one token's blocks x8."""
        n = x8.size * QK_K
        out = np.full(8, np.nan, dtype=np.float32)
        self.lib.meshd_rows8_q4_K_q8_K(
            n,
            w.ctypes.data,
            row_bytes,
            x8.ctypes.data,
            out.ctypes.data_as(_F32),
            w.ctypes.data,
            row_bytes,
            1,
        )
        return out


def _bind(lib: ctypes.CDLL) -> None:
    lib.meshd_quantize_row_q8_K.argtypes = [_F32, ctypes.c_void_p, ctypes.c_int64]
    lib.meshd_quantize_row_q8_K.restype = None
    for name in ("q4_K", "q5_K", "q6_K"):
        dot = getattr(lib, f"meshd_vec_dot_{name}_q8_K")
        dot.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        dot.restype = ctypes.c_float
        rows = getattr(lib, f"meshd_rows_{name}_q8_K")
        rows.argtypes = [
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int,
            _F32,
        ]
        rows.restype = None
        if name == "q4_K":
            eight = lib.meshd_rows8_q4_K_q8_K
            eight.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            eight.argtypes += [_F32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            eight.restype = None
        deq = getattr(lib, f"meshd_dequantize_row_{name}")
        deq.argtypes = [ctypes.c_void_p, _F32, ctypes.c_int64]
        deq.restype = None


def _build(path: str, out_dir: pathlib.Path) -> Kernels:
    flags, needs = PATHS[path]
    if path != "portable" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"{path}: x86 only")
    missing = sorted(set(needs) - _cpu_flags())
    if missing:
        pytest.skip(f"{path}: this CPU lacks {', '.join(missing)}")
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) on PATH")
    so = out_dir / f"blocks_k_{path}.so"
    subprocess.run([cc, *COMMON, *flags, "-o", str(so), str(SOURCE), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    _bind(lib)
    return Kernels(path, lib)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("blocks_k")


_built: dict[str, Kernels] = {}


def _kernels(path: str, build_dir: pathlib.Path) -> Kernels:
    if path not in _built:
        _built[path] = _build(path, build_dir)
    return _built[path]


@pytest.fixture(params=list(PATHS))
def kernels(request: pytest.FixtureRequest, build_dir: pathlib.Path) -> Kernels:
    return _kernels(request.param, build_dir)


# ---- inputs ----------------------------------------------------------------------------------


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: GGMLQuantizationType, n_blocks: int, seed: int) -> np.ndarray:
    """`n_blocks` valid blocks of `qtype` as bytes: random quants and scales, realistic deltas."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = _f16_bytes(rng.uniform(2e-4, 2e-3, n_blocks))
    if qtype == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = d  # ql[128], qh[64], scales[16] (int8), d
    else:
        raw[:, 0:2] = d  # d, dmin, scales[12], (qh[32],) qs[128]
        raw[:, 2:4] = _f16_bytes(rng.uniform(0.0, 2e-3, n_blocks))
    return raw.reshape(-1)


def activations(rows: int, k: int, seed: int) -> np.ndarray:
    """Rows of activations with outliers, an all-zero super-block and a +-max tie."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, rng.integers(0, k, size=4)] *= 20.0
    if k >= 2 * QK_K:
        x[0, QK_K : 2 * QK_K] = 0.0
    x[-1, 7], x[-1, 3] = 1000.0, -1000.0
    return x


def q8_K_reference(x: np.ndarray) -> np.ndarray:
    """numpy port of ggml's quantize_row_q8_K_ref (ties to even, as ggml's nearest_int)."""
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    out = np.zeros(len(blocks), dtype=Q8_K)
    first_max = np.argmax(np.abs(blocks), axis=1)  # argmax: the first on a tie, as ggml
    peak = blocks[np.arange(len(blocks)), first_max]
    live = peak != 0
    iscale = np.float32(-127.0) / peak[live]
    qs = np.minimum(np.rint(blocks[live] * iscale[:, None]), 127).astype(np.int8)
    out["qs"][live] = qs
    out["d"][live] = np.float32(1.0) / iscale
    out["bsums"] = out["qs"].reshape(-1, 16, 16).sum(axis=2, dtype=np.int32).astype(np.int16)
    return out


def dequantize_q8_K(x8: np.ndarray) -> np.ndarray:
    scaled = x8["d"][:, None].astype(np.float64) * x8["qs"]
    return np.asarray(scaled, dtype=np.float64).reshape(-1)


def _shifted(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `a`'s bytes starting `offset` bytes past a 64-byte boundary."""
    raw = a.view(np.uint8).reshape(-1)
    buf = np.zeros(raw.size + 128, dtype=np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    buf[start : start + raw.size] = raw
    return buf[start : start + raw.size]


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", LENGTHS)
def test_dequantize_equals_gguf(kernels: Kernels, qtype: GGMLQuantizationType, k: int) -> None:
    w = random_blocks(qtype, ROWS * k // QK_K, seed=k)
    expected = dequantize(w.reshape(ROWS, -1), qtype).reshape(-1)
    np.testing.assert_array_equal(kernels.dequantize(qtype, w), expected)


@pytest.mark.parametrize("k", LENGTHS)
def test_quantize_q8_K_equals_ggml_reference(kernels: Kernels, k: int) -> None:
    x = activations(ROWS, k, seed=k)
    got, expected = kernels.quantize_q8_K(x), q8_K_reference(x)
    np.testing.assert_array_equal(got["qs"], expected["qs"])
    np.testing.assert_array_equal(got["bsums"], expected["bsums"])
    np.testing.assert_array_equal(got["d"], expected["d"])
    # A row quantized alone is the same bytes as that row inside a batch (blocks are per row).
    np.testing.assert_array_equal(kernels.quantize_q8_K(x[1]), got[k // QK_K : 2 * k // QK_K])


def test_quantize_q8_K_rounds_ties_to_even(kernels: Kernels) -> None:
    # The largest magnitude is -127, so the scale is -127 / -127 = 1 and each value is its own
    # scaled value: ties go to the even neighbour (0.5 -> 0, 2.5 -> 2, -3.5 -> -4), as ggml's
    # nearest_int; roundf would give 1, 3, -4.
    x = np.zeros(QK_K, dtype=np.float32)
    x[:5] = [-127.0, 0.5, 1.5, 2.5, -3.5]
    got = kernels.quantize_q8_K(x)
    assert list(got["qs"][0, :5]) == [-127, 0, 2, 2, -4]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", LENGTHS)
def test_vec_dot_equals_float64_dot(kernels: Kernels, qtype: GGMLQuantizationType, k: int) -> None:
    nb = k // QK_K
    w = random_blocks(qtype, ROWS * nb, seed=k + 1).reshape(ROWS, -1)
    x8 = kernels.quantize_q8_K(activations(ROWS, k, seed=k + 2))
    for r in range(ROWS):
        wf = dequantize(w[r], qtype).astype(np.float64).reshape(-1)
        xf = dequantize_q8_K(x8[r * nb : (r + 1) * nb])
        exact, scale = float(wf @ xf), float(np.abs(wf) @ np.abs(xf))
        got = kernels.vec_dot(qtype, w[r], x8[r * nb : (r + 1) * nb])
        assert abs(got - exact) <= 1e-5 * scale, (r, got, exact, scale)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_vec_dot_extreme_blocks_do_not_saturate(
    kernels: Kernels, qtype: GGMLQuantizationType
) -> None:
    # Every quant and scale at its largest against q8 = +-127: the int16 pair sums of the
    # SIMD paths are at their widest here.
    blocks = np.full((2, BLOCK_BYTES[qtype]), 0xFF, dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, 192:208] = np.array([0x7F, 0x80] * 8, dtype=np.uint8)  # scales +127, -128
        blocks[:, 208:210] = _f16_bytes(np.array([1e-3, 1e-3]))
    else:
        blocks[:, 0:4] = _f16_bytes(np.array([1e-3, 5e-4, 1e-3, 5e-4])).reshape(2, 4)
    w = blocks.reshape(-1)
    x = np.where(np.arange(2 * QK_K) % 3 == 0, -1.0, 1.0).astype(np.float32)
    x8 = kernels.quantize_q8_K(x)
    wf = dequantize(w, qtype).astype(np.float64).reshape(-1)
    xf = dequantize_q8_K(x8)
    exact, scale = float(wf @ xf), float(np.abs(wf) @ np.abs(xf))
    assert abs(kernels.vec_dot(qtype, w, x8) - exact) <= 1e-5 * scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 768, 2304])  # 1, 3 and 9 super-blocks
def test_a_row_against_several_tokens_gives_each_its_single_dot(
    kernels: Kernels, qtype: GGMLQuantizationType, k: int
) -> None:
    nb = k // QK_K
    w = random_blocks(qtype, nb, seed=k + 5)
    tokens = activations(4, k, seed=k + 6)  # the last row holds the +-1000 tie
    singles = [kernels.vec_dot(qtype, w, kernels.quantize_q8_K(x)) for x in tokens]
    # Token rows at a stride that is not a multiple of the block size or of 64 bytes, as the
    # scratch of meshd_blocks_mm may lay them out.
    stride = nb * Q8_K.itemsize + 36
    packed = np.zeros(4 * stride, dtype=np.uint8)
    for r, x in enumerate(tokens):
        packed[r * stride : r * stride + nb * Q8_K.itemsize] = kernels.quantize_q8_K(x).view(
            np.uint8
        )
    for nt in (1, 2, 3, 4):
        for first in range(4 - nt + 1):
            got = kernels.rows(qtype, w, packed[first * stride :], stride, nt)
            np.testing.assert_array_equal(
                got.view(np.uint32),
                np.array(singles[first : first + nt], dtype=np.float32).view(np.uint32),
                err_msg=f"nt={nt} first={first}",
            )


@pytest.mark.parametrize("k", [256, 768, 4608])  # 1, 3 and 18 super-blocks (more than a span)
def test_eight_q4_K_rows_at_once_give_each_row_its_single_dot(kernels: Kernels, k: int) -> None:
    # The decode kernel runs eight rows per call and their float steps in one vector; each row
    # must keep the bits of its single dot (what a verify window's tiles compute), whatever the
    # distance between rows (a row of a mapped file starts anywhere).
    nb = k // QK_K
    w = random_blocks(GGMLQuantizationType.Q4_K, 8 * nb, seed=k).reshape(8, -1)
    row_bytes = w.shape[1] + 40
    spaced = np.zeros(8 * row_bytes, dtype=np.uint8)
    for r in range(8):
        spaced[r * row_bytes : r * row_bytes + w.shape[1]] = w[r]
    for seed in (1, 2):
        x8 = kernels.quantize_q8_K(activations(1, k, seed=k + seed)[0])
        singles = [kernels.vec_dot(GGMLQuantizationType.Q4_K, w[r], x8) for r in range(8)]
        got = kernels.rows8_q4_K(spaced, row_bytes, x8)
        np.testing.assert_array_equal(
            got.view(np.uint32), np.array(singles, dtype=np.float32).view(np.uint32)
        )


def _results(kn: Kernels, k: int) -> list[np.ndarray]:
    """Everything a path computes on fixed inputs, as arrays to compare bit for bit."""
    x = activations(ROWS, k, seed=7)
    x8 = kn.quantize_q8_K(x)
    out = [x8.view(np.uint8)]
    for qtype in TYPES:
        w = random_blocks(qtype, ROWS * k // QK_K, seed=11)
        out.append(kn.dequantize(qtype, w))
        rows = w.reshape(ROWS, -1)
        nb = k // QK_K
        dots = [kn.vec_dot(qtype, rows[r], x8[r * nb : (r + 1) * nb]) for r in range(ROWS)]
        out.append(np.array(dots, dtype=np.float32))
    w = random_blocks(GGMLQuantizationType.Q4_K, 8 * k // QK_K, seed=13)
    out.append(kn.rows8_q4_K(w, w.size // 8, x8[: k // QK_K]))
    return out


def _runnable(build_dir: pathlib.Path) -> list[Kernels]:
    runnable: list[Kernels] = []
    for path in PATHS:
        try:
            runnable.append(_kernels(path, build_dir))
        except pytest.skip.Exception:
            continue
    if len(runnable) < 2:
        pytest.skip("only one path runs on this CPU")
    return runnable


@pytest.mark.parametrize("k", LENGTHS)
def test_all_paths_give_the_same_bits(build_dir: pathlib.Path, k: int) -> None:
    runnable = _runnable(build_dir)
    first = _results(runnable[0], k)
    for other in runnable[1:]:
        for a, b in zip(first, _results(other, k), strict=True):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=other.path)


def test_non_finite_activations_quantize_alike_on_every_path(build_dir: pathlib.Path) -> None:
    # inf and NaN are garbage in, but the same garbage out on every path: NaN products become 0
    # as ggml's nearest_int makes them, an all-NaN block is a zero block.
    x = activations(1, 1536, seed=5)[0]
    x[5], x[300], x[600], x[601] = np.inf, np.nan, -np.inf, np.nan
    x[1024:1280] = np.nan
    runnable = _runnable(build_dir)
    first = runnable[0].quantize_q8_K(x).view(np.uint8)
    for other in runnable[1:]:
        np.testing.assert_array_equal(other.quantize_q8_K(x).view(np.uint8), first)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_results_do_not_depend_on_alignment(kernels: Kernels, qtype: GGMLQuantizationType) -> None:
    k = 1536
    w = random_blocks(qtype, k // QK_K, seed=3)
    x = activations(1, k, seed=4)[0]
    x8 = kernels.quantize_q8_K(x)
    base = kernels.vec_dot(qtype, w, x8)
    deq = kernels.dequantize(qtype, w)
    for offset in (1, 2, 4, 36):
        w_moved = _shifted(w, offset)
        x8_moved = _shifted(x8, offset)
        assert kernels.vec_dot(qtype, w_moved, x8_moved) == base
        np.testing.assert_array_equal(kernels.dequantize(qtype, w_moved), deq)
    x_moved = _shifted(x, 4).view(np.float32)
    np.testing.assert_array_equal(kernels.quantize_q8_K(x_moved).view(np.uint8), x8.view(np.uint8))
