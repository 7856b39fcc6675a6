"""A stage's decoder layers in one call of meshd's C kernel (`KernelLayers`): what
`llama.decoder_layer` computes, layer after layer, without a Python call between products.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshd.model.gguf_matrix import GgufMatrix, Matrix
from meshd.model.kernels import CpuKernels, DimsArgs, LayerArgs, MatrixArgs, cpu_kernels
from meshd.model.llama import Dims, LayerWeights


def kernel_matrix(w: Matrix) -> MatrixArgs | None:
    """`w` as `meshd_layers` reads it, or None where it cannot: block matrices, and fp32 CPU
    matrices in either layout `linear_weight` leaves (a contiguous `[in, out]` copy,
    or the transposed view of the checkpoint's `[out, in]` rows)."""
    if isinstance(w, GgufMatrix):
        return w.args()
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    in_features, out_features = w.shape
    if w.stride(1) == 1:
        kind, layout = 32, w.stride(0)
    elif w.stride(0) == 1:
        kind, layout = 33, w.stride(1)
    else:
        return None
    return MatrixArgs(kind, in_features, out_features, layout, w.data_ptr(), None)


@dataclass(frozen=True, slots=True)
class KernelWindow:
    """One session's window in a `KernelLayers` pass: its stage cache, first position, rows and
    RoPE table (`Rotary.table(base_pos, length)`)."""

    kv: torch.Tensor  # the session's `KVGroup.kv`, [layers, max_positions, 2 * kv_heads, hd]
    base_pos: int
    length: int
    rope: torch.Tensor


class KernelLayers:
    """Every decoder layer of a stage in one call of meshd's C kernel (`meshd_layers`), for
    windows of up to `ROW_ATTENTION_MAX` rows, without the torch operations and Python calls
    per layer between the products (time a second core cannot shorten).

    For block matrices it computes what `decoder_layer` computes, to the bit (the same block
    products and row attention, RoPE as the same complex multiply). For fp32 matrices it runs
    meshd's fp32 product, whose sums differ from MKL's in the last bits; each
    row still gets the same bits alone or in a window, so a verify window computes exactly what
    the decode steps it replaces compute.

    `build` returns None unless the stage is an fp32 CPU stage whose matrices all run on
    meshd's kernels (`kernel_matrix`), with an fp32 cache, and without q/k norms (Qwen3 layers
    run op by op).
    """

    def __init__(
        self, kernels: CpuKernels, layers: Sequence[LayerWeights], d: Dims, windows: Sequence[int]
    ) -> None:
        self._fn = kernels.layers
        self._f32_mm = kernels.f32_mm
        self._layers = (LayerArgs * len(layers))()
        for args, w, window in zip(self._layers, layers, windows, strict=True):
            args.qkv, args.o = kernel_matrix(w.wqkv), kernel_matrix(w.wo)
            args.gate_up, args.down = kernel_matrix(w.w_gate_up), kernel_matrix(w.w_down)
            args.input_norm, args.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            for name in ("bqkv", "bo", "b_gate_up", "b_down"):
                bias = getattr(w, name)
                setattr(args, name, None if bias is None else bias.data_ptr())
            args.window = window
        self._held = list(layers)  # the tensors the pointers above point into
        w0 = layers[0]
        self._dims = DimsArgs(
            d.n_heads,
            d.n_kv,
            d.head_dim,
            w0.input_norm.shape[0],
            self._layers[0].down.in_features,
            d.eps,
            d.head_dim**-0.5,
        )
        self._n = len(layers)

    @classmethod
    def build(
        cls,
        layers: Sequence[LayerWeights],
        d: Dims,
        windows: Sequence[int | None],
        kv_dtype: torch.dtype,
    ) -> KernelLayers | None:
        """The kernel pass for these layers, or None where they must run op by op."""
        kernels = cpu_kernels()
        if kernels is None or not layers:
            return None
        if kv_dtype != torch.float32:
            return None
        for w in layers:
            if not all(kernel_matrix(m) is not None for m in w.matrices()):
                return None
            if w.q_norm is not None or w.k_norm is not None:
                return None
            matrices = {id(m) for m in w.matrices()}
            vectors = [t for t in w.tensors() if id(t) not in matrices]
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in vectors):
                return None
        return cls(kernels, layers, d, [0 if w is None else w for w in windows])

    def norm_linear(self, x: torch.Tensor, norm: torch.Tensor, args: MatrixArgs) -> torch.Tensor:
        """`rms_norm(x, norm) @ w` for rows `x` by meshd's fp32 product (one row's bits whatever
        the rows around it), `w` an fp32 matrix as `kernel_matrix` gives it (kind 32 or 33)."""
        rows, norm = x.contiguous(), norm.contiguous()  # held while the kernel reads them
        out = torch.empty(rows.shape[0], args.out_features)
        failed = self._f32_mm(
            rows.data_ptr(),
            rows.shape[0],
            args.in_features,
            args.codes,
            args.layout,
            args.out_features,
            int(args.kind == 32),
            out.data_ptr(),
            None,
            norm.data_ptr(),
            self._dims.eps,
            0,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("meshd's fp32 kernel could not allocate its row buffer")
        return out

    def run(self, x: torch.Tensor, windows: Sequence[KernelWindow]) -> torch.Tensor:
        """The stage's layers over `x` `[rows, hidden]` (fp32), the windows' rows in order;
        writes each window's keys and values into its cache. Returns a new tensor."""
        out = x.to(torch.float32, copy=True).contiguous()
        rows = out.shape[0]
        positions = (ctypes.c_int64 * rows)()
        sessions = (ctypes.c_int64 * rows)()
        rope = (ctypes.c_void_p * rows)()
        kv = (ctypes.c_void_p * (len(windows) * self._n))()
        r = 0
        for index, win in enumerate(windows):
            base, layer_bytes = win.kv.data_ptr(), win.kv[0].nbytes
            for layer in range(self._n):
                kv[index * self._n + layer] = base + layer * layer_bytes
            table, row_bytes = win.rope.data_ptr(), win.rope[0].nbytes
            for i in range(win.length):
                positions[r], sessions[r], rope[r] = win.base_pos + i, index, table + i * row_bytes
                r += 1
        threads = torch.get_num_threads()
        failed = self._fn(
            self._layers,
            self._n,
            ctypes.byref(self._dims),
            out.data_ptr(),
            rows,
            positions,
            sessions,
            kv,
            rope,
            threads,
            threads,
        )
        if failed:
            raise MemoryError("meshd's layer kernel could not allocate its buffers")
        return out
