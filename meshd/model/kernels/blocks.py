"""GGUF tensors multiplied as stored: ggml's block formats, one C kernel per CPU class.

A `BlockMatrix` wraps a tensor's bytes exactly as the GGUF file holds them (usually a read-only
`np.memmap` slice: nothing is copied or converted) and multiplies fp32 activations with them the
way ggml does: each activation row is first converted to the weight type's "vec_dot type" (Q8_0
or Q8_1 blocks of 32, Q8_K blocks of 256, fp16, bf16), then every output is a block-by-block dot
product. The integer codes and scales are ggml's own, so a product equals llama.cpp's to the
rounding of fp32 accumulation (docs/model-runtime.md, "GGUF block kernels").

`blocks.c` is compiled three ways from one source: `avx512` (AVX-512 F/BW/VL/VNNI), `avx2`
(AVX2, FMA, F16C, and AVX-VNNI where the CPU has it) and `portable` (plain C for any CPU).
`MESHD_BLOCK_KERNELS` picks one (`auto`, the default, takes the best this CPU runs; naming a
path the CPU cannot run is an error, never a silent fallback). The library is built once per machine into the same cache
directory as meshd's other kernel (`meshd.model.kernels`), named by the hash of its sources and
flags, and loaded with ctypes, which releases the GIL during a call. When `blocks_k.c` (the
K-quant formats) sits beside `blocks.c` it is compiled in and Q4_K, Q5_K and Q6_K join the
supported types; without it they have no kernel (`UnsupportedTensorType`).

Every output element is computed by the same floating-point sequence whatever the batch size,
the thread count or the row's place in the batch, so a verify window of t tokens is
bit-identical to t single-token steps.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from meshd.model.kernels import BLOCK_KERNELS_ENV as BLOCK_KERNELS_ENV
from meshd.model.kernels import _cache_dir, build_library
from meshd.model.kernels import _cpu_flags as _cpu_flags  # tests replace it

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("blocks.c")
# The K-quant formats, written separately; compiled in when present.
_K_SOURCE = Path(__file__).with_name("blocks_k.c")
# ggml's reference quantizers (fp32 rows into blocks), for checkpoints quantized at load.
_QUANTIZE_SOURCE = Path(__file__).with_name("blocks_quantize.c")
# Best first: what `auto` tries in this order.
PATHS = ("avx512", "avx2", "portable")
CHOICES = ("auto", *PATHS)
_COMMON_FLAGS = (
    "-O3",
    "-fopenmp",
    # No multiply-add contraction chosen by the compiler: the only FMAs are the intrinsics, the
    # same in every variant of a dot product, so results do not depend on the batch size.
    "-ffp-contract=off",
    "-fPIC",
    "-shared",
)
_PATH_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512vnni",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "portable": (),
}
# /proc/cpuinfo flags each x86 path's instructions need.
_NEEDS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
_NON_K = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
)
_K = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# The types with a kernel in this installation (K-quants only with blocks_k.c beside blocks.c).
GGML_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    _NON_K + _K if _K_SOURCE.exists() else _NON_K
)


class UnsupportedTensorType(ValueError):
    """A GGUF tensor type with no kernel here (callers add the tensor's name)."""


class UnavailableKernelPath(RuntimeError):
    """`MESHD_BLOCK_KERNELS` names a path this machine cannot run, or the kernel cannot be built."""


@dataclass(frozen=True)
class BlockKernels:
    """One compiled and loaded copy of blocks.c: its C entry points (ctypes functions)."""

    name: str  # the ISA path: avx512, avx2 or portable
    mm: Any  # meshd_blocks_mm_threads
    row_bytes: Any
    scratch_bytes: Any
    supported: Any
    dequantizable: Any
    dequantize_rows: Any
    path: Path
    quantize_rows: Any  # meshd_blocks_quantize_rows (blocks_quantize.c)
    quantizable: Any
    parts_mm: Any  # meshd_blocks_parts_mm: a fused operand's tensors against one input
    argmax_rows: Any  # meshd_argmax_rows: the greedy token of each logits row
    set_streaming: Any  # meshd_blocks_set_streaming: how the tiles prefetch (see blocks.c)


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def path_unavailable_reason(name: str) -> str | None:
    """Why this CPU cannot run kernel path `name` (None: it can)."""
    if name not in PATHS:
        return f"unknown block kernel path {name!r} (expected one of {', '.join(PATHS)})"
    if name == "portable":
        return None
    if not _is_x86():
        return f"{name} needs an x86-64 CPU, this is {platform.machine()}"
    missing = [f for f in _NEEDS[name] if f not in _cpu_flags()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def runnable_paths() -> tuple[str, ...]:
    """The kernel paths this CPU runs, best first."""
    return tuple(p for p in PATHS if path_unavailable_reason(p) is None)


def kernel_path() -> str:
    """The path `MESHD_BLOCK_KERNELS` asks for (auto: the best this CPU runs); raises
    `UnavailableKernelPath` for a path this CPU cannot run or an unknown name."""
    choice = os.environ.get(BLOCK_KERNELS_ENV, "auto") or "auto"
    if choice not in CHOICES:
        raise UnavailableKernelPath(
            f"{BLOCK_KERNELS_ENV}={choice!r}: expected one of {', '.join(CHOICES)}"
        )
    if choice == "auto":
        return runnable_paths()[0]
    reason = path_unavailable_reason(choice)
    if reason is not None:
        raise UnavailableKernelPath(f"{BLOCK_KERNELS_ENV}={choice}: {reason}")
    return choice


def _sources() -> list[Path]:
    k_quants = [_K_SOURCE] if _K_SOURCE.exists() else []
    return [_SOURCE, *k_quants, _QUANTIZE_SOURCE]


def _flags(name: str) -> tuple[str, ...]:
    extra = ("-DMESHD_HAVE_K_QUANTS",) if _K_SOURCE.exists() else ()
    # AVX-VNNI (256-bit VPDPBUSD without AVX-512: Alder Lake and later, Zen 5) where the CPU has
    # it; it gives the same exact integer sums as the VPMADDUBSW sequence it replaces.
    if name == "avx2" and "avx_vnni" in _cpu_flags():
        extra = (*extra, "-mavxvnni")
    return (*_COMMON_FLAGS, *_PATH_FLAGS[name], *extra)


def _compile(name: str, flags: tuple[str, ...], directory: Path) -> Path:
    """The library for path `name` in `directory`, built there first if missing."""
    return build_library(f"blocks-{name}", _sources(), flags, directory, timeout_s=300)


def _load(name: str, path: Path) -> BlockKernels:
    lib = ctypes.CDLL(str(path))
    if lib.meshd_blocks_abi() != 1:
        raise OSError(f"{path}: unexpected block kernel ABI")
    lib.meshd_blocks_isa.restype = ctypes.c_char_p
    if lib.meshd_blocks_isa().decode() != name:
        raise OSError(f"{path}: built for {lib.meshd_blocks_isa().decode()}, not {name}")
    p, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    mm = lib.meshd_blocks_mm_threads
    mm.argtypes = [cint, p, i64, i64, p, i64, p, p, cint]
    mm.restype = cint
    row_bytes = lib.meshd_blocks_row_bytes
    row_bytes.argtypes = [cint, i64]
    row_bytes.restype = i64
    scratch = lib.meshd_blocks_scratch_bytes
    scratch.argtypes = [cint, i64, i64]
    scratch.restype = i64
    supported = lib.meshd_blocks_supported
    supported.argtypes = [cint]
    supported.restype = cint
    dequantizable = lib.meshd_blocks_dequantizable
    dequantizable.argtypes = [cint]
    dequantizable.restype = cint
    deq = lib.meshd_blocks_dequantize_rows
    deq.argtypes = [cint, p, i64, p, i64, p]
    deq.restype = cint
    quantize = lib.meshd_blocks_quantize_rows
    quantize.argtypes = [cint, p, i64, i64, p, cint]
    quantize.restype = cint
    quantizable = lib.meshd_blocks_quantizable
    quantizable.argtypes = [cint]
    quantizable.restype = cint
    parts_mm = lib.meshd_blocks_parts_mm
    parts_mm.argtypes = [p, i64, i64, p, i64, p, i64, p, cint]
    parts_mm.restype = cint
    argmax = lib.meshd_argmax_rows
    argmax.argtypes = [p, i64, i64, i64, p]
    argmax.restype = None
    streaming = lib.meshd_blocks_set_streaming
    streaming.argtypes = [cint]
    streaming.restype = None
    return BlockKernels(
        name, mm, row_bytes, scratch, supported, dequantizable, deq, path, quantize,
        quantizable, parts_mm, argmax, streaming,
    )  # fmt: skip


@functools.cache
def _kernels(name: str, flags: tuple[str, ...]) -> BlockKernels:
    # Loaded after torch, so its OpenMP library is torch's (one thread pool for both).
    assert torch.__version__
    errors = []
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"meshd-kernels-{os.getuid()}"):
        try:
            return _load(name, _compile(name, flags, directory))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            errors.append(f"{directory}: {detail}")
            log.warning("meshd's %s block kernels: could not build or load: %s", name, detail)
    raise UnavailableKernelPath(f"the {name} block kernels could not be built: {errors[-1]}")


def block_kernels(path: str | None = None) -> BlockKernels:
    """The loaded kernel library for `path` (None: `kernel_path()`), built on first use."""
    name = kernel_path() if path is None else path
    reason = path_unavailable_reason(name)
    if reason is not None:
        raise UnavailableKernelPath(f"block kernel path {name}: {reason}")
    return _kernels(name, _flags(name))


def supported_types(path: str | None = None) -> frozenset[GGMLQuantizationType]:
    """The GGUF tensor types the loaded library multiplies."""
    lib = block_kernels(path)
    return frozenset(t for t in GGMLQuantizationType if lib.supported(int(t)))


_local = threading.local()


def _scratch(nbytes: int) -> int:
    """The address of this thread's scratch buffer of at least `nbytes` (grown, never shrunk:
    one product runs at a time per thread, and activations of a step are small)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return int(buf.data_ptr())


def _ptr(arr: np.ndarray | torch.Tensor) -> ctypes.c_void_p:
    # A read-only memmap is fine: the C side only reads weights.
    if isinstance(arr, torch.Tensor):
        return ctypes.c_void_p(arr.data_ptr())
    return ctypes.c_void_p(arr.ctypes.data)


class BlockMatrix:
    """An [out_features, in_features] weight matrix held as GGUF stores it (ggml shape
    (in_features, out_features)): `out_features` rows of ggml blocks, read in place."""

    def __init__(
        self,
        data: np.ndarray,
        ggml_type: int | GGMLQuantizationType,
        in_features: int,
        out_features: int,
        path: str | None = None,
    ) -> None:
        try:
            qtype = GGMLQuantizationType(int(ggml_type))
        except ValueError:
            raise UnsupportedTensorType(f"unknown GGML tensor type {ggml_type}") from None
        lib = block_kernels(path)
        if not lib.supported(int(qtype)):
            raise UnsupportedTensorType(
                f"GGML type {qtype.name} has no block kernel (supported: "
                f"{', '.join(sorted(t.name for t in supported_types(lib.name)))})"
            )
        row_bytes = lib.row_bytes(int(qtype), in_features)
        if row_bytes < 0:
            raise ValueError(f"{qtype.name} rows of {in_features} elements: not whole blocks")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
            raise TypeError("BlockMatrix data must be a numpy uint8 array of the tensor's bytes")
        if not data.flags.c_contiguous:
            raise ValueError("BlockMatrix data must be contiguous")
        if data.nbytes != row_bytes * out_features:
            raise ValueError(
                f"{qtype.name} [{out_features}, {in_features}] holds "
                f"{row_bytes * out_features} bytes, the buffer {data.nbytes}"
            )
        self.data = data
        self.ggml_type = qtype
        self.in_features = in_features
        self.out_features = out_features
        self.row_bytes = row_bytes
        self._lib = lib
        # Kept as plain ints: a decode step calls mm a few hundred times, and building ctypes
        # objects (or numpy's .ctypes) per call costs more than a small product.
        self._type = int(qtype)
        self._w = int(data.ctypes.data)
        self._scratch_per_token = lib.scratch_bytes(self._type, in_features, 1) - 64

    @property
    def kernel(self) -> str:
        """The ISA path that multiplies this matrix (for reports)."""
        return self._lib.name

    @property
    def library(self) -> BlockKernels:
        """The loaded block library that multiplies this matrix (its C entry points)."""
        return self._lib

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [t, in_features] fp32 · Wᵀ → [t, out_features] fp32, on torch's thread count."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"expected fp32 [t, {self.in_features}], got {x.dtype} {list(x.shape)}"
            )
        if not x.is_contiguous():
            x = x.contiguous()
        t = x.shape[0]
        y = torch.empty(t, self.out_features, dtype=torch.float32)
        failed = self._lib.mm(
            self._type,
            self._w,
            self.in_features,
            self.out_features,
            x.data_ptr(),
            t,
            y.data_ptr(),
            _scratch(self._scratch_per_token * t + 64),
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError(f"block kernel refused {self.ggml_type.name} {self.in_features}")
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape of indices) dequantized: [*ids.shape, in_features] fp32."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            raise IndexError(f"row ids must lie in [0, {self.out_features})")
        out = torch.empty(flat.numel(), self.in_features, dtype=torch.float32)
        self._lib.dequantize_rows(
            self._type,
            self._w,
            self.in_features,
            _ptr(flat),
            flat.numel(),
            _ptr(out),
        )
        return out.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as fp32 [out_features, in_features]."""
        return self.rows(torch.arange(self.out_features))


def quantize_rows(
    w: torch.Tensor, ggml_type: int | GGMLQuantizationType, path: str | None = None
) -> np.ndarray:
    """`w` fp32 `[out, in]` as `out` rows of `ggml_type`'s blocks: the bytes a GGUF file of that
    type stores (ggml's reference quantizers, what llama-quantize writes without an importance
    matrix; blocks_quantize.c), rows quantized in parallel on torch's thread count."""
    qtype = GGMLQuantizationType(int(ggml_type))
    lib = block_kernels(path)
    if not lib.quantizable(int(qtype)):
        raise UnsupportedTensorType(f"meshd does not quantize into GGML type {qtype.name}")
    if w.dim() != 2:
        raise ValueError(f"expected a matrix [out, in], got {list(w.shape)}")
    rows = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
    out_features, in_features = rows.shape
    row_bytes = lib.row_bytes(int(qtype), in_features)
    if row_bytes < 0:
        raise ValueError(f"{qtype.name} rows of {in_features} elements: not whole blocks")
    data = np.empty(out_features * row_bytes, dtype=np.uint8)
    failed = lib.quantize_rows(
        int(qtype), _ptr(rows), out_features, in_features, _ptr(data), torch.get_num_threads()
    )
    if failed:
        raise ValueError(f"cannot quantize [{out_features}, {in_features}] as {qtype.name}")
    return data


@functools.cache
def _argmax_library(choice: str) -> BlockKernels | None:
    # Keyed by the environment's choice; a library that cannot be built is tried once.
    try:
        return block_kernels()
    except UnavailableKernelPath as exc:
        log.info("greedy tokens by torch.argmax: %s", exc)
        return None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value in fp32 CPU logits `[V]` or `[n, V]`, as
    `torch.argmax` picks it (the first of equal maxima, the first NaN), in the block library;
    torch's where the library is missing."""
    rows = logits.reshape(1, -1) if logits.dim() == 1 else logits
    lib = _argmax_library(os.environ.get(BLOCK_KERNELS_ENV, "auto"))
    if (
        lib is None
        or rows.dim() != 2
        or rows.dtype != torch.float32
        or rows.device.type != "cpu"
        or rows.stride(-1) != 1
        or rows.shape[-1] == 0
    ):
        return [int(i) for i in rows.argmax(-1).tolist()]
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    lib.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
    return [int(i) for i in out.tolist()]


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@functools.cache
def last_level_cache_bytes() -> int | None:
    """The size of the CPU's last-level cache (the highest level sysfs lists for cpu0), None
    where the system does not say."""
    found: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            nbytes = (
                int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1] in _SIZE_UNITS else int(size)
            )
        except (OSError, ValueError, IndexError):
            continue
        if found is None or level > found[0]:
            found = (level, nbytes)
    return None if found is None else found[1]


_step_lock = threading.Lock()
_step_bytes = 0


def note_step_weights(nbytes: int) -> bool:
    """Count a loaded stage's `nbytes` of matrices (what its decode step reads) into the
    process's total; the block library prefetches for streaming weights from memory once that
    total exceeds the last-level cache (blocks.c, "How a tile requests"). Returns whether it
    does. The total only grows (a stage closed leaves its share): prefetching either way gives
    the same bits, only the speed differs."""
    global _step_bytes
    with _step_lock:
        _step_bytes += nbytes
        llc = last_level_cache_bytes()
        streaming = llc is not None and _step_bytes > llc
    try:
        lib = block_kernels()
    except UnavailableKernelPath:
        return streaming
    lib.set_streaming(int(streaming))
    return streaming
