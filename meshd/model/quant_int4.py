"""int4 matrices: asymmetric 4-bit groups of `in` with a scale and offset per group, one class
per kernel (meshd's VNNI kernel, torch's CPU and CUDA int4 packs, dequantize on the fly).
`quant.quantize_matrix` picks one; `quant.py`'s table says which runs where.
"""

from __future__ import annotations

import torch

from meshd.model.kernels import TILE, CpuKernels, packed_int4_bytes
from meshd.model.quant_matrix import QuantMatrix, VnniMatrix

# Elements per int4 group, preferred first: 64 costs 0.5625 bytes per weight (q4_0's figure).
INT4_GROUPS: tuple[int, ...] = (64, 32)


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


def cuda_inner_k_tiles(in_features: int) -> int | None:
    return next((t for t in (8, 4, 2) if in_features % (t * 16) == 0), None)


def int4_fits(in_features: int, out_features: int, device_type: str) -> int | None:
    """The int4 group for this shape on this device, or None where int4 does not fit."""
    group = int4_group(in_features)
    if group is None:
        return None
    if device_type == "cpu" and out_features % 16:
        return None
    if device_type == "cuda" and (out_features % 8 or cuda_inner_k_tiles(in_features) is None):
        return None
    return group
