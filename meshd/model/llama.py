"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3): norms, weight records,
attention and the decoder layer. RoPE is in `rope.py`; every layer in one C call in
`kernel_layers.py`.

Shapes carry no batch dimension: one session runs one window of T positions at a time, so
activations are `[T, hidden]` and attention runs over `[heads, T, head_dim]`. A batched pass
stacks several sessions' windows as rows (`decoder_layer_batch`): the matmuls run once over all
rows, attention runs per window against that session's cache. Keys and values
live in an explicit positional cache owned by the caller (see `kvcache.py`): a layer writes the
window's keys at absolute positions and attends over `[span.start, span.end)` of that cache.

The forward pass is plain functions over frozen weight records (no nn.Module dispatch on the
per-token path). As in gpt-fast, q/k/v and gate/up projections are fused into one matmul each
at load time; the checkpoint keeps the usual Hugging Face names (`decoder_layer_shapes`).
Matrices are held as the `[in, out]` operand of `x @ w` (see `linear_weight` for why), so a
projection is one `mm`, and a projection that feeds the residual stream is one `addmm`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshd.model.config import ModelConfig
from meshd.model.gguf_matrix import GgufMatrix, Matrix
from meshd.model.kernels import CpuKernels, cpu_kernels
from meshd.model.rope import interleave_rope_dims, rotate_, rotation_view

# Turns a checkpoint matrix `[out, in]` into what the forward pass multiplies by.
MatrixPrep = Callable[[torch.Tensor], Matrix]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, d: Dims) -> torch.Tensor:
    """Root-mean-square norm over the last dim with `d.eps`, scaled by `weight` (as in HF)."""
    if x.dtype == torch.float32:
        # HF's statistics (sum of squares, over n, plus eps) in six small ops in all, where
        # F.rms_norm dispatches fourteen; each costs microseconds once weights have flushed L2.
        mean_square = torch.add(
            d.eps_tensor, x.square().sum(-1, keepdim=True), alpha=1 / x.shape[-1]
        )
        return x * mean_square.rsqrt_() * weight
    # Other dtypes: fp32 statistics, scaled in the activation dtype, exactly as HF does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + d.eps)
    return weight * h.to(x.dtype)


def linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A checkpoint matrix `[out, in]` as the `[in, out]` operand of `x @ w`, laid out for speed.

    At batch 1 a projection is a matrix-vector product that streams the whole matrix from
    memory. The CPU BLAS torch ships (MKL) does that markedly faster from a contiguous
    `[in, out]` copy when the output is wider than the input (q/k/v, gate/up, the head; figures
    in docs/model-runtime.md), and slightly faster from the checkpoint's own `[out, in]` rows
    otherwise (o, down). Other devices take the transposed view as it is.
    """
    transposed = weight.t()
    if weight.device.type == "cpu" and weight.shape[0] > weight.shape[1]:
        return transposed.contiguous()
    return transposed


@dataclass(frozen=True)
class AttnSpan:
    """Which cached positions a window attends to: keys `[start, end)`, and a mask if needed."""

    start: int
    end: int
    mask: torch.Tensor | None
    # For each query row, its first visible key relative to `start` (a sliding window hides
    # the oldest keys of later rows): what `_attend_row` slices, computed once for all layers.
    row_starts: tuple[int, ...] = ()

    @staticmethod
    def build(base_pos: int, length: int, window: int | None, device: torch.device) -> AttnSpan:
        """Causal (optionally sliding-window) span for queries at `base_pos .. +length-1`."""
        end = base_pos + length
        start = 0 if window is None else max(0, base_pos + 1 - window)
        if length == 1:
            return AttnSpan(start, end, None)
        q_pos = torch.arange(base_pos, end, device=device)[:, None]
        k_pos = torch.arange(start, end, device=device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        firsts = tuple(
            0 if window is None else max(0, base_pos + i + 1 - window - start)
            for i in range(length)
        )
        return AttnSpan(start, end, allowed, firsts)


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a session's cache.

    `kv` is `[1, max_positions, 2 * kv_heads, head_dim]`: keys then values by position, the
    order in which a q/k/v row carries its k and v heads, so one copy writes a window's keys
    and values. `k` and `v` are the same memory seen as `[1, kv_heads, max_positions,
    head_dim]`, the layout attention reads, built once so that a step only slices them.
    """

    kv: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def over(cls, kv: torch.Tensor) -> LayerCache:
        """The cache of one layer stored in `kv` `[1, max_positions, 2 * kv_heads, head_dim]`."""
        n_kv = kv.shape[2] // 2
        return cls(kv, kv[:, :, :n_kv].transpose(1, 2), kv[:, :, n_kv:].transpose(1, 2))


@dataclass(frozen=True, slots=True)
class Dims:
    """The few numbers the forward pass needs, hoisted out of the config."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    eps_tensor: torch.Tensor  # eps as a 0-d fp32 tensor on the stage's device
    # Windows of up to this many rows attend one row at a time (0: never); see `_attend`.
    row_attention_max: int = 0

    @classmethod
    def of(cls, config: ModelConfig, device: torch.device, *, exact_windows: bool = False) -> Dims:
        """Dims of `config` for a stage on `device`; `exact_windows`: see `_attend`."""
        eps = config.rms_norm_eps
        return cls(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            eps,
            torch.tensor(eps, dtype=torch.float32, device=device),
            ROW_ATTENTION_MAX if exact_windows else 0,
        )


# Verify windows are at most this long; longer windows (prompts) attend in one call.
ROW_ATTENTION_MAX = 16


def _rope_rows(name: str, t: torch.Tensor, d: Dims) -> torch.Tensor:
    """A checkpoint tensor with q/k rows in the runtime's rotary order (others as they are)."""
    if name.startswith(("self_attn.q_", "self_attn.k_")):
        return interleave_rope_dims(t, d.head_dim)
    return t


def rope_row_order(name: str, rows: int, d: Dims) -> torch.Tensor | None:
    """Where `interleave_rope_dims` takes each q/k row from (None for other tensors): the
    column order of a product whose matrix keeps the checkpoint's row order."""
    if not name.startswith(("self_attn.q_", "self_attn.k_")):
        return None
    return interleave_rope_dims(torch.arange(rows), d.head_dim)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's weights, q/k/v and gate/up fused; biases and q/k norms optional.

    Matrices are `[in, out]` (`linear_weight`), so the q/k/v projection is `x @ wqkv`, or
    block matrices standing for them (`meshd.model.gguf_matrix`).
    """

    input_norm: torch.Tensor
    wqkv: Matrix  # [hidden, (heads + 2 * kv_heads) * head_dim]
    bqkv: torch.Tensor | None
    wo: Matrix  # [heads * head_dim, hidden]
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    w_gate_up: Matrix  # [hidden, 2 * intermediate]
    b_gate_up: torch.Tensor | None
    w_down: Matrix  # [intermediate, hidden]
    b_down: torch.Tensor | None

    @classmethod
    def from_checkpoint(
        cls, w: Mapping[str, torch.Tensor], d: Dims, matrix: MatrixPrep = linear_weight
    ) -> LayerWeights:
        """Build from one layer's HF-named tensors (names relative to the layer prefix).

        `matrix` prepares each (fused) checkpoint matrix: `linear_weight` by default, a
        quantizer for quantized stages.
        """

        def fuse(names: list[str]) -> Matrix:
            parts = [_rope_rows(n, w[n], d) for n in names]
            return matrix(torch.cat(parts) if len(parts) > 1 else parts[0])

        return cls.from_parts(w, d, fuse)

    @classmethod
    def from_parts(
        cls, w: Mapping[str, torch.Tensor], d: Dims, fuse: Callable[[list[str]], Matrix]
    ) -> LayerWeights:
        """Build from one layer's vectors `w` (HF names relative to the layer prefix; matrices
        may be absent) and `fuse(names)`, the operand of those checkpoint matrices side by side
        with q/k rows in the runtime's rotary order (`interleave_rope_dims`)."""

        def get(name: str) -> torch.Tensor | None:
            t = w.get(name)
            return None if t is None else _rope_rows(name, t, d)

        def fused(names: list[str]) -> torch.Tensor | None:
            parts = [get(n) for n in names]
            present = [t for t in parts if t is not None]
            return torch.cat(present) if len(present) == len(parts) else None

        qkv = [f"self_attn.{p}_proj" for p in "qkv"]
        gate_up = ["mlp.gate_proj", "mlp.up_proj"]
        return cls(
            input_norm=w["input_layernorm.weight"],
            wqkv=fuse([f"{n}.weight" for n in qkv]),
            bqkv=fused([f"{n}.bias" for n in qkv]),
            wo=fuse(["self_attn.o_proj.weight"]),
            bo=w.get("self_attn.o_proj.bias"),
            q_norm=get("self_attn.q_norm.weight"),
            k_norm=get("self_attn.k_norm.weight"),
            post_norm=w["post_attention_layernorm.weight"],
            w_gate_up=fuse([f"{n}.weight" for n in gate_up]),
            b_gate_up=fused([f"{n}.bias" for n in gate_up]),
            w_down=fuse(["mlp.down_proj.weight"]),
            b_down=w.get("mlp.down_proj.bias"),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every plain tensor held (quantized matrices are in `matrices`)."""
        values = (getattr(self, f) for f in self.__slots__)
        return [t for t in values if isinstance(t, torch.Tensor)]

    def matrices(self) -> list[Matrix]:
        """The four weight matrices, in the order a step multiplies by them."""
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def nbytes(self) -> int:
        """Bytes held: vectors, plain matrices and block matrices."""
        held = sum(t.nbytes for t in self.tensors())
        return held + sum(m.nbytes for m in self.matrices() if isinstance(m, GgufMatrix))


def linear(
    x: torch.Tensor, w: Matrix, b: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ w + b` for rows `[T, in]` and a matrix `[in, out]` (into `out` if given)."""
    if isinstance(w, GgufMatrix):
        y = w.mm(x)
        if b is not None:
            y.add_(b)
        return y if out is None else out.copy_(y)
    if b is None:
        return torch.mm(x, w, out=out)
    return torch.addmm(b, x, w, out=out)


def norm_linear(
    x: torch.Tensor,
    norm: torch.Tensor,
    d: Dims,
    w: Matrix,
    b: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rms_norm(x, norm) @ w + b`."""
    return linear(rms_norm(x, norm, d), w, b, out=out)


def residual_linear(
    residual: torch.Tensor, x: torch.Tensor, w: Matrix, b: torch.Tensor | None
) -> torch.Tensor:
    """`residual + x @ w + b`, the residual added by the matmul itself (one op, not two)."""
    if isinstance(w, GgufMatrix):
        out = w.mm(x).add_(residual)
    else:
        out = torch.addmm(residual, x, w)
    return out if b is None else out.add_(b)


@dataclass(frozen=True, slots=True)
class QKV:
    """A window's fused q/k/v rows and the views of them attention works on (same memory)."""

    rows: torch.Tensor  # [T, (heads + 2 * kv_heads) * head_dim]
    qk: torch.Tensor  # [1, T, heads + kv_heads, head_dim], rotated in place
    rot: torch.Tensor  # qk as `rotate_` multiplies it
    q: torch.Tensor  # [1, heads, T, head_dim], as attention reads queries
    kv: torch.Tensor  # [1, T, 2 * kv_heads, head_dim], as the cache stores keys and values

    @classmethod
    def over(cls, rows: torch.Tensor, d: Dims) -> QKV:
        """The views of `rows`."""
        heads = rows.view(1, rows.shape[0], -1, d.head_dim)
        qk = heads[:, :, : d.n_heads + d.n_kv]
        q = heads[:, :, : d.n_heads].transpose(1, 2)
        return cls(rows, qk, rotation_view(qk), q, heads[:, :, d.n_heads :])


@dataclass(frozen=True, slots=True)
class StepScratch:
    """Rows reused by every one-position window (a decode step) of one session on one stage.

    A step writes its q/k/v and gate/up products into these (`out=`), and the views of them were
    built once: at batch 1 that is about ten fewer small ops per layer, each of which costs
    microseconds once a layer's weights have streamed through the caches.
    """

    qkv: QKV
    gate: torch.Tensor  # [1, intermediate], the first half of `gate_up`
    up: torch.Tensor
    gate_up: torch.Tensor  # [1, 2 * intermediate]

    @classmethod
    def allocate(
        cls, d: Dims, intermediate: int, dtype: torch.dtype, device: torch.device
    ) -> StepScratch:
        """Scratch rows for a model of these dims."""
        width = (d.n_heads + 2 * d.n_kv) * d.head_dim
        rows = torch.empty(1, width, dtype=dtype, device=device)
        gate_up = torch.empty(1, 2 * intermediate, dtype=dtype, device=device)
        gate, up = gate_up.chunk(2, dim=-1)
        return cls(QKV.over(rows, d), gate, up, gate_up)


def _attend(
    qkv: QKV,
    w: LayerWeights,
    d: Dims,
    rope: torch.Tensor,
    cache: LayerCache,
    span: AttnSpan,
) -> torch.Tensor:
    """One window's attention from its q/k/v rows; `[T, heads * head_dim]`."""
    length = qkv.rows.shape[0]
    if w.q_norm is not None and w.k_norm is not None:
        q, k = qkv.qk[:, :, : d.n_heads], qkv.qk[:, :, d.n_heads :]
        q.copy_(rms_norm(q, w.q_norm, d))
        k.copy_(rms_norm(k, w.k_norm, d))
    rotate_(qkv.rot, rope)
    cache.kv[:, span.end - length : span.end] = qkv.kv  # cast to the cache's dtype if narrower
    k, v = cache.k[:, :, span.start : span.end], cache.v[:, :, span.start : span.end]
    if length <= d.row_attention_max and cache.kv.dtype == qkv.rows.dtype == torch.float32:
        kernels = cpu_kernels() if cache.kv.device.type == "cpu" else None
        if kernels is not None and cache.kv.is_contiguous():
            return _attend_rows_kernel(kernels, qkv, d, cache, span)
    if k.dtype != qkv.q.dtype:  # a narrower KV cache (`kv_dtype`): attend in the compute dtype
        k, v = k.to(qkv.q.dtype), v.to(qkv.q.dtype)
    if 1 < length <= d.row_attention_max:
        return torch.cat([_attend_row(qkv.q, k, v, span, i, d) for i in range(length)])
    out = F.scaled_dot_product_attention(
        qkv.q,
        k,
        v,
        attn_mask=span.mask,
        enable_gqa=d.n_kv != d.n_heads,
    )
    if length == 1:  # [1, heads, 1, head_dim] is already one row
        return out.view(1, -1)
    return out.transpose(1, 2).reshape(length, -1)


def _attend_rows_kernel(
    kernels: CpuKernels, qkv: QKV, d: Dims, cache: LayerCache, span: AttnSpan
) -> torch.Tensor:
    """`_attend`'s rows by meshd's CPU kernel, one query row at a time (each row computed as a
    decode step computes it, as `_attend_row` does with SDPA): for row-exact stages, whose
    decode steps and short windows all attend here, far cheaper per row than SDPA."""
    length, width = qkv.rows.shape
    ends = [span.end - (length - 1 - i) for i in range(length)]
    starts = [span.start + (span.row_starts[i] if length > 1 else 0) for i in range(length)]
    out = torch.empty(length, d.n_heads * d.head_dim)
    failed = kernels.attend(
        qkv.rows.data_ptr(),
        width,
        length,
        cache.kv.data_ptr(),
        d.n_heads,
        d.n_kv,
        d.head_dim,
        (ctypes.c_int64 * length)(*starts),
        (ctypes.c_int64 * length)(*ends),
        d.head_dim**-0.5,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("meshd's attention kernel could not allocate its scores")
    return out


def _attend_row(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: AttnSpan, i: int, d: Dims
) -> torch.Tensor:
    """Row `i` of a window's attention, computed as a one-row decode step computes it.

    Attention kernels sum in an order that depends on how many query rows they get, so a
    window's row differs in the last bits from the same position decoded alone. Where the
    matrices are row-exact (block matrices: each row is quantized on its own), attending row by row makes a
    verify window compute exactly the bits of plain decoding, and speculation can never change
    a greedy token; for fp32 matrices (MKL's product also depends on the row count) it would
    buy nothing, so those stages attend in one call.
    """
    length = q.shape[2]
    end = k.shape[2] - (length - 1 - i)
    lo = span.row_starts[i]
    out = F.scaled_dot_product_attention(
        q[:, :, i : i + 1], k[:, :, lo:end], v[:, :, lo:end], enable_gqa=d.n_kv != d.n_heads
    )
    return out.view(1, -1)


@dataclass(frozen=True, slots=True)
class BatchPart:
    """One session's window inside a batched pass: its rows, positions and cache for a layer."""

    length: int
    rope: torch.Tensor
    cache: LayerCache
    span: AttnSpan


def mlp_block(
    h: torch.Tensor, w: LayerWeights, d: Dims, scratch: StepScratch | None = None
) -> torch.Tensor:
    """The SwiGLU half of a layer with its residual: h + down(silu(gate(n)) * up(n)), n = norm(h)."""
    if scratch is None:
        gate_up = norm_linear(h, w.post_norm, d, w.w_gate_up, w.b_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        gate_up = norm_linear(h, w.post_norm, d, w.w_gate_up, w.b_gate_up, out=scratch.gate_up)
        gate, up = scratch.gate, scratch.up
    # In place on the fresh gate/up product: no new tensors on the per-token path.
    return residual_linear(h, F.silu(gate, inplace=True).mul_(up), w.w_down, w.b_down)


def decoder_layer(
    x: torch.Tensor,
    w: LayerWeights,
    d: Dims,
    rope: torch.Tensor,
    cache: LayerCache,
    span: AttnSpan,
    scratch: StepScratch | None = None,
) -> torch.Tensor:
    """Pre-norm residual block: attention then MLP, `[T, hidden]` in and out.

    `scratch` (one-position windows only) receives the layer's products instead of new tensors.
    """
    if scratch is None:
        qkv = QKV.over(norm_linear(x, w.input_norm, d, w.wqkv, w.bqkv), d)
    else:
        qkv = scratch.qkv
        norm_linear(x, w.input_norm, d, w.wqkv, w.bqkv, out=qkv.rows)
    h = residual_linear(x, _attend(qkv, w, d, rope, cache, span), w.wo, w.bo)
    return mlp_block(h, w, d, scratch)


def decoder_layer_batch(
    x: torch.Tensor, w: LayerWeights, d: Dims, parts: Sequence[BatchPart]
) -> torch.Tensor:
    """`decoder_layer` over several sessions' windows stacked as rows of `x` (in `parts` order).

    The projections run once over all rows, so each weight matrix streams from memory once per
    pass; attention itself runs per window, against that session's own cache.
    """
    qkv = norm_linear(x, w.input_norm, d, w.wqkv, w.bqkv)
    rows = torch.split(qkv, [p.length for p in parts])
    outs = [
        _attend(QKV.over(r, d), w, d, p.rope, p.cache, p.span)
        for r, p in zip(rows, parts, strict=True)
    ]
    h = residual_linear(x, torch.cat(outs) if len(outs) > 1 else outs[0], w.wo, w.bo)
    return mlp_block(h, w, d)


def decoder_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint (HF) names and shapes of one decoder layer's weights, relative to its prefix."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "mlp.gate_proj.weight": (config.intermediate_size, h),
        "mlp.up_proj.weight": (config.intermediate_size, h),
        "mlp.down_proj.weight": (h, config.intermediate_size),
    }
    if config.qkv_bias:
        shapes |= {"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,)}
        shapes |= {"self_attn.v_proj.bias": (kv_out,)}
    if config.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if config.qk_norm:
        shapes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if config.mlp_bias:
        shapes |= {"mlp.gate_proj.bias": (config.intermediate_size,), "mlp.down_proj.bias": (h,)}
        shapes["mlp.up_proj.bias"] = (config.intermediate_size,)
    return shapes
