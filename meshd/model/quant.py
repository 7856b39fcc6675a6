"""Quantized weight matrices: int8 and int4 weights, one kernel per device.

A stage quantizes its matrices at load (`quantize_matrix`), one layer at a time, from the
checkpoint's fp32/fp16/bf16 tensors. A quantized matrix stands where the `[in, out]` operand of
`x @ w` stood (`QuantMatrix.mm(x)`); norms, biases and activations stay in the stage's dtype.

Kernels (docs/model-runtime.md has the measurements behind each choice):

| device | int8 | int4 |
|---|---|---|
| x86 CPU with AVX-512 VNNI | meshd's own kernel (`kernels/quant_mm.c`, compiled once per machine): per-output-channel symmetric int8 weights, each row of activations quantized to uint8 over its range | `_weight_int4pack_mm_for_cpu` on bf16 activations: asymmetric 4-bit groups of 64 (32 where 64 does not divide `in`) with a bf16 scale and offset |
| other x86 CPU (or no C compiler) | fbgemm dynamic linear, same scheme (`quantized::linear_dynamic`) | as above |
| CUDA | `_weight_int8pack_mm` (weight-only, per channel) | `_weight_int4pack_mm` (tinygemm, bf16) |
| CPU without fbgemm (ARM) | `_weight_int8pack_mm` | as on x86 |
| other | dequantize on the fly (correct, not fast) | same |

A matrix whose shape a kernel refuses (int4 on CPU needs `out` % 16 == 0) falls back to int8.
`matrix_bytes` is what each holds, padding included; `QuantMatrix.nbytes` is the same figure for
a loaded matrix, so the planner's arithmetic and the loaded stage agree exactly.

What a quantized matrix is (`QuantMatrix`, `Matrix`, `VnniMatrix`) lives in `quant_matrix.py`,
the int4 matrices in `quant_int4.py`.
"""

from __future__ import annotations

import functools
import math
import platform
import warnings
from typing import Any

import torch

from meshd.model.kernels import (
    QUAD,
    TILE,
    CpuKernels,
    cpu_kernels,
    packed_bytes,
    packed_int4_bytes,
)
from meshd.model.quant_int4 import (
    Int4Cpu,
    Int4Cuda,
    Int4Dequant,
    Int4Vnni,
    cuda_inner_k_tiles,
    int4_fits,
    int4_group,
)
from meshd.model.quant_matrix import TINY, Matrix, QuantMatrix, VnniMatrix

# "gguf": a GGUF file's tensors as stored, each multiplied by its block format's kernel
# (`meshd.model.gguf_matrix`); GGUF files only. The block quantizations (`BLOCK_QUANTIZATIONS`)
# quantize a checkpoint at load into the same ggml block formats and kernels.
BLOCK_QUANTIZATIONS: tuple[str, ...] = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4", "gguf", *BLOCK_QUANTIZATIONS)
# fbgemm's fp32 scale, int32 zero point and int32 column offset, plus our fp32 column sum.
_FBGEMM_PARAMS_PER_COLUMN = 16


def check_quantization(quantization: str) -> str:
    """`quantization` if it names a scheme, else ValueError listing them."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    return quantization


def matmul(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """`x @ w` for a plain or a quantized matrix."""
    if isinstance(w, QuantMatrix):
        return w.mm(x)
    return torch.mm(x, w)


def in_features(w: Matrix) -> int:
    """Rows of the `[in, out]` operand a plain or quantized matrix stands for."""
    return w.in_features if isinstance(w, QuantMatrix) else int(w.shape[0])


# --- int8 rows: scale per output channel --------------------------------------------------


def _rows_mm(
    x: torch.Tensor,
    packed: torch.classes.quantized.LinearPackedParamsBase,  # type: ignore[name-defined]
    colsum: torch.Tensor,
    tiny: float,
) -> torch.Tensor:
    """`Int8Fbgemm.mm` on fp32 rows `x`: each row mapped onto [-1, 1], then fbgemm, then back."""
    lo, hi = torch.aminmax(x, dim=1, keepdim=True)
    half = (hi - lo).mul_(0.5).clamp_(min=tiny)
    mid = lo + half
    # (x - lo) / half - 1 is exactly -1 at the row's minimum and, since rounding is monotonic
    # and (max - lo) / half rounds to exactly 2, exactly +1 at its maximum.
    rows = torch.sub(x, lo).div_(half).sub_(1.0)
    y: torch.Tensor = torch.ops.quantized.linear_dynamic(rows, packed, False)
    return y.mul_(half).add_(colsum * mid)


@functools.cache
def _int8_rows_mm() -> Any:
    """`_rows_mm` compiled by TorchScript: its eight operations cost ~35 us less a call than
    from Python (~2 ms of a 246M int8 model's decode step), with the same bits.

    torch marks TorchScript deprecated in favour of `torch.compile`, which here spent 45 s
    compiling a three-operation function and ran it no faster; where scripting fails (a torch
    without it), the same function runs from Python.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(_rows_mm)
    except Exception:  # any failure to script leaves the eager function
        return _rows_mm


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of `w` `[out, in]` (fp32): (q `[out, in]` int8, scale `[out]`)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@functools.cache
def has_fbgemm() -> bool:
    """Whether this torch build runs fbgemm (x86 CPUs); other CPUs take `_weight_int8pack_mm`."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
    return x86 and "fbgemm" in torch.backends.quantized.supported_engines


def row_exact(quantization: str, device: torch.device) -> bool:
    """Whether this stage's matrices give a row the same bits in any batch (tested): meshd's
    int8 kernel and fbgemm's int8 with per-row ranges, and the CPU int4 kernel. Not MKL's fp32
    product, and not known for the CUDA or ARM kernels."""
    if device.type != "cpu":
        return False
    if quantization == "gguf" or quantization in BLOCK_QUANTIZATIONS:
        return True  # every block kernel computes each row on its own
    if quantization == "int8":
        return cpu_kernels() is not None or has_fbgemm()
    return quantization == "int4" and has_fbgemm()


@functools.cache
def fbgemm_blocking() -> tuple[int, int]:
    """(K, N) multiples fbgemm pads a packed int8 matrix to on this CPU (its PackBMatrix traits)."""
    if torch.cpu._is_vnni_supported():  # avx512_vnni: KCB 512, NCB 48
        return 512, 48
    if torch.cpu._is_avx512_supported():
        return 256, 32
    return 512, 8  # avx2


def _fbgemm_bytes(k: int, n: int) -> int:
    kb, nb = fbgemm_blocking()
    packed = math.ceil(k / kb) * kb * math.ceil(n / nb) * nb
    return packed + _FBGEMM_PARAMS_PER_COLUMN * n


class Int8Fbgemm(QuantMatrix):
    """x86 CPU int8: fbgemm's prepacked weight and its dynamic-activation linear.

    fbgemm quantizes a call's whole input with one range, so a row's result would depend on
    the rows it is computed with: a verify window would differ from the same positions decoded
    one at a time, and speculation would change greedy tokens. Every row is therefore mapped
    onto exactly [-1, 1] first (x' = (x - min) / half - 1, half being half the row's range),
    so every call's range is [-1, 1] whatever its rows. A row's int8 codes, and so its int32
    products, are then the same in any batch, and the result comes back as
    half * (W x') + (min + half) * (column sums of W), with elementwise operations only (no
    fused multiply-add, whose use could depend on the shape). Each row keeps an asymmetric
    grid over its own [min, max], as a one-row call had. (One exception: a row of zeros alone
    gets a range of [-1, 0]; its result, about 1e-30, then differs in the last bits.)

    `reduce_range` stays off: it trades a bit of activation precision for avoiding int16
    overflow on CPUs without VNNI, and fbgemm accumulates in int32 on those that have it.
    """

    kind, kernel = "int8", "fbgemm linear_dynamic"

    def __init__(self, w: torch.Tensor) -> None:
        out_f, in_f = w.shape
        q, scale = _int8_rows(w)
        with warnings.catch_warnings():
            # torch marks its quantized tensor type deprecated; fbgemm's prepack still takes it.
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                q, scale.double(), torch.zeros(out_f, dtype=torch.long), 0
            )
        self._packed = torch.ops.quantized.linear_prepack(qw, None)
        # Sums of the stored weights' columns (dequantized), for the midpoint term.
        self._colsum = (q.float().sum(dim=1) * scale).unsqueeze(0)
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = _fbgemm_bytes(in_f, out_f)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = _int8_rows_mm()(x.float(), self._packed, self._colsum, TINY)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        qw, _bias = torch.ops.quantized.linear_unpack(self._packed)
        w: torch.Tensor = qw.dequantize()
        return w.t()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class Int8Vnni(VnniMatrix):
    """x86 CPU int8 with AVX-512 VNNI: the scheme of `Int8Fbgemm` (per-output-channel
    symmetric int8 weights, per-row uint8 activations) in one call, weights packed in tiles of
    64 channels for VPDPBUSD."""

    kind, kernel = "int8", "meshd int8 (AVX-512 VNNI)"

    def __init__(self, w: torch.Tensor, kernels: CpuKernels) -> None:
        out_f, in_f = w.shape
        q, scale = _int8_rows(w)
        self._fn = kernels.mm
        self._layout = -(-in_f // QUAD) * QUAD
        channels = -(-out_f // TILE) * TILE
        codes = torch.empty(channels * self._layout, dtype=torch.int8)
        kernels.pack(q.data_ptr(), out_f, in_f, self._layout, codes.data_ptr())
        scales = torch.zeros(channels)
        scales[:out_f] = scale
        sums = torch.zeros(channels)
        sums[:out_f] = q.sum(dim=1, dtype=torch.int32).float()
        self._packed = (codes, scales, sums)
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = packed_bytes(in_f, out_f)
        assert self.nbytes == sum(t.nbytes for t in self._packed)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        codes, scales, _ = self._packed
        tiles = codes.view(-1, self._layout // QUAD, TILE, QUAD)  # [tile, quad, channel, 4]
        q = tiles.permute(0, 2, 1, 3).reshape(-1, self._layout)[:n, :k]
        return (q.float() * scales[:n, None]).t()


class Int8WeightOnly(QuantMatrix):
    """int8 weights, scale per output channel, activations unquantized (CUDA, MPS, others).

    CUDA, MPS and CPUs without fbgemm run torch's `_weight_int8pack_mm`; any other device
    dequantizes per call.
    """

    kind = "int8"

    def __init__(self, w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
        out_f, in_f = w.shape
        q, scale = _int8_rows(w)
        self._q = q.to(device)  # [out, in]
        self._scale = scale.to(device=device, dtype=dtype)
        self._fused = device.type in ("cuda", "mps", "cpu")
        self.kernel = "_weight_int8pack_mm" if self._fused else "dequantize per call"
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = self._q.nbytes + self._scale.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(
                x.to(self._scale.dtype), self._q, self._scale
            )
            return y.to(x.dtype)
        return torch.mm(x, (self._q.to(x.dtype) * self._scale[:, None].to(x.dtype)).t())

    def dequantize(self) -> torch.Tensor:
        return (self._q.float() * self._scale.float()[:, None]).t().cpu()

    @property
    def device(self) -> torch.device:
        return self._q.device


def quantize_matrix(
    w: torch.Tensor, quantization: str, device: torch.device, dtype: torch.dtype
) -> QuantMatrix:
    """Quantize a checkpoint matrix `w` `[out, in]` for `device` (activations in `dtype`)."""
    w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
    out_f, in_f = w.shape
    if quantization == "int4":
        kernels = cpu_kernels() if device.type == "cpu" else None
        if kernels is not None and int4_group(in_f) is not None:
            return Int4Vnni(w, int4_group(in_f) or 0, kernels)
        group = int4_fits(in_f, out_f, device.type)
        if group is not None:
            if device.type == "cpu":
                return Int4Cpu(w, group)
            if device.type == "cuda":
                tiles = cuda_inner_k_tiles(in_f)
                assert tiles is not None
                return Int4Cuda(w, group, tiles, device)
            return Int4Dequant(w, group, device)
    elif quantization != "int8":
        raise ValueError(f"cannot quantize a matrix as {quantization!r}")
    if device.type == "cpu":
        kernel = cpu_kernels()
        if kernel is not None:
            return Int8Vnni(w, kernel)
        if has_fbgemm():
            return Int8Fbgemm(w)
    return Int8WeightOnly(w, device, dtype)


def matrix_bytes(
    in_features: int,
    out_features: int,
    quantization: str,
    dtype: torch.dtype,
    device_type: str = "cpu",
) -> int:
    """Bytes one `[in, out]` matrix holds at `quantization` (what `quantize_matrix` makes)."""
    if quantization == "gguf":
        raise ValueError("a gguf matrix holds its tensors' bytes in the file: ask the checkpoint")
    if quantization == "none":
        return in_features * out_features * _itemsize(dtype)
    if quantization in BLOCK_QUANTIZATIONS:
        return out_features * block_row_bytes(block_type(quantization, in_features), in_features)
    if quantization == "int4":
        group = int4_group(in_features)
        if device_type == "cpu" and group is not None and cpu_kernels() is not None:
            return packed_int4_bytes(in_features, out_features, group)
        group = int4_fits(in_features, out_features, device_type)
        if group is not None:
            # Two weights per byte, a bf16 scale and offset per group.
            return in_features * out_features // 2 + 4 * out_features * (in_features // group)
    if device_type == "cpu" and cpu_kernels() is not None:
        return packed_bytes(in_features, out_features)
    if device_type == "cpu" and has_fbgemm():
        return _fbgemm_bytes(in_features, out_features)
    return in_features * out_features + out_features * _itemsize(dtype)


# --- embedding rows -----------------------------------------------------------------------


class QuantEmbedding:
    """An embedding table as int8 rows with a scale each; a lookup dequantizes its rows.

    int4 stages keep int8 rows too: on the built-in model and the tiny random checkpoints of
    every family, 4-bit rows cost more quality than the bytes they save (docs/model.md).
    """

    def __init__(self, table: torch.Tensor, device: torch.device) -> None:
        q, scale = _int8_rows(table.detach().to(device="cpu", dtype=torch.float32))
        self.q = q.to(device)
        self.scale = scale[:, None].to(device)
        self.nbytes = self.q.nbytes + self.scale.nbytes

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` `[T]` as `[T, hidden]` in `dtype`."""
        return self.q[ids].to(dtype).mul_(self.scale[ids].to(dtype))


def embedding_bytes(vocab: int, hidden: int, quantization: str, dtype: torch.dtype) -> int:
    """Bytes of an embedding table at `quantization` (`QuantEmbedding` when int8/int4; block
    quantizations: `block_table_bytes`)."""
    if quantization == "none":
        return vocab * hidden * _itemsize(dtype)
    return vocab * hidden + 4 * vocab


def head_quantization(quantization: str) -> str:
    """The head's scheme: int8 for int4 stages too (it sets every logit; see docs/model.md)."""
    return "int8" if quantization == "int4" else quantization


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# --- ggml block formats, quantized at load ------------------------------------------------
#
# A checkpoint at a block quantization holds what llama-quantize would write for the same
# choice (llama_tensor_get_type, without an importance matrix), so the stage is the GGUF file
# that tool makes, run by the same kernels as a GGUF file run as stored:
# - matrices: the named type; a row width that K-quant super-blocks (256) do not divide takes
#   llama-quantize's fallback (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and a width that
#   blocks of 32 do not divide takes F16;
# - the head (output.weight): Q6_K for every type but q8_0 (Q8_0), as llama-quantize keeps it;
# - the embedding: the matrices' type, except that a tied embedding is the head (one tensor, as
#   llama-quantize gives token_embd the head's type when the file has no output.weight).
# Unlike a Q4_K_M file, q4_k does not move some layers' v and down matrices to Q6_K: every layer
# holds the same bytes, so the planner's per-layer figure is exact.

_BLOCK_TYPE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# (elements, bytes) of one block (ggml's type traits).
_BLOCK_SIZE = {
    "F32": (1, 4), "F16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}  # fmt: skip


def _fits(name: str, in_features: int) -> str:
    """`name`, or the type llama-quantize falls back to where its blocks do not divide a row."""
    if name in _K_FALLBACK and in_features % 256:
        name = _K_FALLBACK[name]
    return name if in_features % _BLOCK_SIZE[name][0] == 0 else "F16"


def block_type(quantization: str, in_features: int, role: str = "matrix") -> str:
    """The ggml type (its name) a matrix with rows of `in_features` takes at block quantization
    `quantization`: `role` "matrix" (a layer's), "head", or "embedding" (an untied table)."""
    name = _BLOCK_TYPE[quantization]
    if role == "head" and quantization != "q8_0":
        name = "Q6_K"
    return _fits(name, in_features)


def block_row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one row of `in_features` elements in ggml type `type_name`."""
    elements, nbytes = _BLOCK_SIZE[type_name]
    return in_features // elements * nbytes


def block_table_bytes(vocab: int, hidden: int, quantization: str, tied: bool) -> tuple[int, int]:
    """(embedding table, untied head) bytes at a block quantization; a tied head is the table."""
    head = vocab * block_row_bytes(block_type(quantization, hidden, "head"), hidden)
    if tied:
        return head, 0
    table = vocab * block_row_bytes(block_type(quantization, hidden, "embedding"), hidden)
    return table, head
