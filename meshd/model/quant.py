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
"""

from __future__ import annotations

import functools
import math
import platform
import struct
import warnings
from typing import Any

import torch

from meshd.model.kernels import (
    QUAD,
    TILE,
    CpuKernels,
    MatrixArgs,
    cpu_kernels,
    packed_bytes,
    packed_int4_bytes,
)

# "gguf": a GGUF file's tensors as stored, each multiplied by its block format's kernel
# (`meshd.model.gguf_matrix`); GGUF files only. The block quantizations (`BLOCK_QUANTIZATIONS`)
# quantize a checkpoint at load into the same ggml block formats and kernels.
BLOCK_QUANTIZATIONS: tuple[str, ...] = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4", "gguf", *BLOCK_QUANTIZATIONS)
# Elements per int4 group, preferred first: 64 costs 0.5625 bytes per weight (q4_0's figure).
INT4_GROUPS: tuple[int, ...] = (64, 32)
# fbgemm's fp32 scale, int32 zero point and int32 column offset, plus our fp32 column sum.
_FBGEMM_PARAMS_PER_COLUMN = 16
# The least half-range of a row (a constant row's), as an fp32 value.
TINY = struct.unpack("f", struct.pack("f", 1e-30))[0]


class QuantMatrix:
    """A quantized `[in, out]` matrix: `mm(x)` is `x @ w` for rows `x` `[T, in]`."""

    kind = ""  # "int8" or "int4"
    kernel = ""  # which kernel runs it (for reports)
    in_features: int
    out_features: int
    nbytes: int  # bytes held, padding included

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ w` in `x`'s dtype."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The fp32 `[in, out]` matrix this stands for (tests and fallbacks)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        raise NotImplementedError


Matrix = torch.Tensor | QuantMatrix


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


class VnniMatrix(QuantMatrix):
    """A matrix run by meshd's own x86 kernels (`kernels/quant_mm.c`): int8 or int4 weights,
    each row of activations quantized to uint8 over its own range in the kernel, so a row's
    result has the same bits in any batch (verify windows compute the bits of plain decoding).
    A call can also RMS-norm or SwiGLU-gate its input and add a residual (`mm_add`)."""

    _fn: Any  # the kernel's entry point
    _packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, sums
    _layout: int  # the padded input (int8) or the group size (int4)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm_add(x, None)

    def mm_add(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        out: torch.Tensor | None = None,
        glu: bool = False,
    ) -> torch.Tensor:
        """`x @ w (+ residual)`, the residual added in the kernel (`[T, out]`, x's dtype).

        With `norm` (fp32 `[in]`), `x` is first RMS-normed in the kernel with that weight and
        `eps` (the pre-norm of a projection, without a torch operation of its own). With `glu`,
        `x` is `[T, 2 * in]`, gate then up, and the kernel multiplies silu(gate) * up (the
        input of a SwiGLU down projection). `out`: an fp32 `[T, out]` contiguous tensor to
        write into.
        """
        rows = x.float().contiguous()
        if out is None or out.dtype != torch.float32 or not out.is_contiguous():
            out = torch.empty(rows.shape[0], self.out_features)
        res = None if residual is None else residual.float().contiguous()
        codes, scales, sums = self._packed
        failed = self._fn(
            rows.data_ptr(),
            rows.shape[0],
            self.in_features,
            codes.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
            self.out_features,
            self._layout,
            out.data_ptr(),
            None if res is None else res.data_ptr(),
            None if norm is None else norm.data_ptr(),
            eps,
            int(glu),
            TINY,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("meshd's quantized kernel could not allocate its row buffers")
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def args(self) -> MatrixArgs:
        """This matrix as the kernel's `meshd_matrix` (pointers into tensors it keeps)."""
        codes, scales, sums = self._packed
        return MatrixArgs(
            8 if self.kind == "int8" else 4,
            self.in_features,
            self.out_features,
            self._layout,
            codes.data_ptr(),
            scales.data_ptr(),
            sums.data_ptr(),
        )


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


# --- int4 groups: scale and offset per group of `in` --------------------------------------


def int4_group(in_features: int) -> int | None:
    """The int4 group size for rows of `in_features` elements (None: no group divides it)."""
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def _int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `w` `[out, in]` (fp32).

    Returns q `[out, in]` int32 in 0..15 and `scales_and_zeros` `[in / group, out, 2]` fp32 in
    torch's int4pack convention: w ≈ (q - 8) * scale + zero.
    """
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    zero = lo + 8 * scale
    sz = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()
    return q.to(torch.int32).reshape(out_f, in_f), sz


def _int4_dequantize(q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """`[in, out]` fp32 from q `[out, in]` (0..15) and `[in / group, out, 2]` scales/zeros."""
    scale = sz[..., 0].t().float().repeat_interleave(group, dim=1)
    zero = sz[..., 1].t().float().repeat_interleave(group, dim=1)
    return ((q.float() - 8) * scale + zero).t()


class Int4Cpu(QuantMatrix):
    """x86 CPU int4: torch's int4pack kernel, fed bf16 activations.

    It is fed bf16 because on bf16 input it is the fastest CPU matrix-vector product we have
    (faster than fbgemm's int8) and on fp32 input it takes a slow path, hence the casts
    around it (docs/model-runtime.md).
    """

    kind, kernel = "int4", "_weight_int4pack_mm_for_cpu (bf16)"

    def __init__(self, w: torch.Tensor, group: int) -> None:
        out_f, in_f = w.shape
        q, sz = _int4_groups(w, group)
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [out, in/2]
        self._sz = sz.to(torch.bfloat16)
        self.group = group
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = self._packed.nbytes + self._sz.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self._packed, self.group, self._sz
        )
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        # Recover q by multiplying the identity: the kernel's own view of its packed weight.
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        zeros = self._sz.clone()
        zeros[..., 0] = 1
        zeros[..., 1] = 8  # (q - 8) * 1 + 8 = q, exact in bf16 for 0..15
        q: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self._packed, self.group, zeros
        )
        return _int4_dequantize(q.t().round().to(torch.int32), self._sz, self.group)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class Int4Vnni(VnniMatrix):
    """x86 CPU int4 with AVX-512 VNNI: the weights of `Int4Cpu` (asymmetric 4-bit groups with
    a bf16 scale and offset each) with `Int8Vnni`'s per-row activations and prologues."""

    kind, kernel = "int4", "meshd int4 (AVX-512 VNNI)"

    def __init__(self, w: torch.Tensor, group: int, kernels: CpuKernels) -> None:
        out_f, in_f = w.shape
        q, sz = _int4_groups(w, group)
        sz16 = sz.to(torch.bfloat16)  # [groups, out, 2]
        self._fn = kernels.int4_mm
        self._layout = self.group = group
        tiles = -(-out_f // TILE)
        codes = torch.empty(tiles * TILE * in_f // 2, dtype=torch.uint8)
        q8 = q.to(torch.uint8).contiguous()  # held while the kernel reads it
        kernels.int4_pack(q8.data_ptr(), out_f, in_f, codes.data_ptr())
        groups = in_f // group
        dz = torch.zeros(tiles * TILE, groups, 2, dtype=torch.bfloat16)
        dz[:out_f] = sz16.transpose(0, 1)
        # [tile, group, (scale, offset), channel]: what one group of one tile reads together.
        dz = dz.view(tiles, TILE, groups, 2).permute(0, 2, 3, 1).contiguous()
        sums = torch.zeros(tiles * TILE)
        sums[:out_f] = _int4_dequantize(q, sz16, group).double().sum(dim=0).float()
        self._packed = (codes, dz, sums)
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = packed_int4_bytes(in_f, out_f, group)
        assert self.nbytes == sum(t.nbytes for t in self._packed)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        codes, dz, _ = self._packed
        tiles = codes.numel() * 2 // (TILE * k)
        b = codes.view(tiles, k // 4, 2, 16, 4)  # [tile, quad, half, lane, input]
        nibbles = torch.stack((b & 0x0F, b >> 4), dim=3)  # [tile, quad, half, nibble, lane, in]
        q = nibbles.permute(0, 2, 3, 4, 1, 5).reshape(tiles * TILE, k)[:n].to(torch.int32)
        sz = dz.permute(1, 0, 3, 2).reshape(k // self.group, tiles * TILE, 2)[:, :n]
        return _int4_dequantize(q, sz, self.group)


class Int4Cuda(QuantMatrix):
    """CUDA int4: tinygemm's `_weight_int4pack_mm` on bf16 (as gpt-fast runs it)."""

    kind, kernel = "int4", "_weight_int4pack_mm (tinygemm)"

    def __init__(self, w: torch.Tensor, group: int, inner_k_tiles: int, device: torch.device):
        out_f, in_f = w.shape
        q, sz = _int4_groups(w, group)
        packed_bytes = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
        self._packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, inner_k_tiles)
        self._sz = sz.to(device=device, dtype=torch.bfloat16)
        self.group = group
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = self._packed.nbytes + self._sz.nbytes

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16), self._packed, self.group, self._sz
        )
        return y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self._packed.device)
        ones = torch.empty_like(self._sz)
        ones[..., 0], ones[..., 1] = 1, 8
        q: torch.Tensor = torch.ops.aten._weight_int4pack_mm(eye, self._packed, self.group, ones)
        return _int4_dequantize(q.t().round().to(torch.int32).cpu(), self._sz.cpu(), self.group)

    @property
    def device(self) -> torch.device:
        device: torch.device = self._packed.device
        return device


class Int4Dequant(QuantMatrix):
    """int4 on a device with no int4 kernel: two weights per byte, dequantized per call."""

    kind, kernel = "int4", "dequantize per call"

    def __init__(self, w: torch.Tensor, group: int, device: torch.device) -> None:
        out_f, in_f = w.shape
        q, sz = _int4_groups(w, group)
        self._packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)
        self._sz = sz.to(device=device, dtype=torch.bfloat16)
        self.group = group
        self.in_features, self.out_features = in_f, out_f
        self.nbytes = self._packed.nbytes + self._sz.nbytes

    def _q(self) -> torch.Tensor:
        hi, lo = (self._packed >> 4).to(torch.int32), (self._packed & 15).to(torch.int32)
        return torch.stack((hi, lo), dim=-1).reshape(self.out_features, self.in_features)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        w = _int4_dequantize(self._q(), self._sz, self.group)
        return torch.mm(x, w.to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return _int4_dequantize(self._q(), self._sz, self.group).cpu()

    @property
    def device(self) -> torch.device:
        device: torch.device = self._packed.device
        return device


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    return next((t for t in (8, 4, 2) if in_features % (t * 16) == 0), None)


def _int4_fits(in_features: int, out_features: int, device_type: str) -> int | None:
    """The int4 group for this shape on this device, or None where int4 does not fit."""
    group = int4_group(in_features)
    if group is None:
        return None
    if device_type == "cpu" and out_features % 16:
        return None
    if device_type == "cuda" and (out_features % 8 or _cuda_inner_k_tiles(in_features) is None):
        return None
    return group


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
        group = _int4_fits(in_f, out_f, device.type)
        if group is not None:
            if device.type == "cpu":
                return Int4Cpu(w, group)
            if device.type == "cuda":
                tiles = _cuda_inner_k_tiles(in_f)
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
        group = _int4_fits(in_features, out_features, device_type)
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
