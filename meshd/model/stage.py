"""`StageModel`: a contiguous layer range of a checkpoint, serving many sessions.

The first stage also holds the embedding; the last stage holds the final norm, the head and the
MTP depths (plus the embedding, which MTP and tied heads share). Hidden states crossing a stage
boundary are the residual stream before the final norm, so splitting a model into any number of
stages computes exactly what the unsplit model computes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F

from meshd.model.checkpoint import Checkpoint, OnTensor
from meshd.model.config import ModelConfig
from meshd.model.device import pick_device
from meshd.model.errors import InvalidInput
from meshd.model.gguf_matrix import GgufEmbedding, GgufMatrix, Matrix
from meshd.model.governor import ThreadGovernor
from meshd.model.kernel_layers import KernelWindow
from meshd.model.kernels.blocks import note_step_weights
from meshd.model.kvcache import KVCache, KVGroup, KVLayout
from meshd.model.llama import (
    ROW_ATTENTION_MAX,
    AttnSpan,
    BatchPart,
    StepScratch,
    decoder_layer,
    decoder_layer_batch,
    decoder_layer_shapes,
    norm_linear,
)
from meshd.model.mtp import mtp_hidden
from meshd.model.quant import block_table_bytes, check_quantization, matrix_bytes
from meshd.model.rope import Rotary
from meshd.model.stage_weights import StageWeights

_T = TypeVar("_T")
# Told as a stage's weights load: (bytes read so far, bytes the stage reads in all).
LoadProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class StageOutput:
    """Residual stream after this stage `[T, hidden]`; logits `[T', vocab]` on the last stage."""

    hidden: torch.Tensor
    logits: torch.Tensor | None


class BatchItem(NamedTuple):
    """One session's window in a batched pass (`StageModel.forward_batch`)."""

    session_id: str
    base_pos: int
    inputs: torch.Tensor  # token ids [T] on the first stage, hidden states [T, hidden] after
    logits_last_n: int | None = None


@dataclass(frozen=True)
class MtpOutput:
    """One MTP depth's hidden state `[T, hidden]` (feeds the next depth) and fp32 logits."""

    hidden: torch.Tensor
    logits: torch.Tensor


def layer_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    quantization: str = "none",
) -> int:
    """Bytes one decoder layer holds once loaded, on any device (for the planner).

    `dtype` is the compute dtype (norms, biases, unquantized matrices); block matrices count
    their blocks' bytes (`quant.matrix_bytes`).
    """
    quantization = check_quantization(quantization)
    shapes = decoder_layer_shapes(config).values()
    vectors = sum(math.prod(s) for s in shapes if len(s) == 1) * _itemsize(dtype)
    return vectors + sum(
        matrix_bytes(n_in, n_out, quantization, dtype) for n_in, n_out in _layer_matrices(config)
    )


def _layer_matrices(config: ModelConfig) -> list[tuple[int, int]]:
    """`(in, out)` of a layer's fused matrices: q/k/v, o, gate/up, down."""
    h, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    inter = config.intermediate_size
    return [(h, q_out + 2 * kv_out), (q_out, h), (h, 2 * inter), (inter, h)]


def stage_weight_bytes(
    config: ModelConfig,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    quantization: str = "none",
) -> int:
    """Bytes the stage `[layer_start, layer_end)` holds once loaded: `StageModel.weight_bytes`.

    Layers, plus the embedding on the first stage and the final norm, head and MTP depths on
    the last (`StageModel` says which stage holds what). Block quantizations hold both in ggml
    block formats (`quant.block_type`), a tied head and the embedding as one table.
    """
    quantization = check_quantization(quantization)
    item = _itemsize(dtype)
    is_first, is_last = layer_start == 0, layer_end == config.num_layers
    n_mtp = config.num_mtp_layers if is_last else 0
    vocab, h = config.vocab_size, config.hidden_size
    total = (layer_end - layer_start) * layer_bytes(config, dtype, quantization)
    if quantization == "none":
        tied = config.tie_word_embeddings
        if is_first or (is_last and (tied or n_mtp > 0)):
            total += vocab * h * item
        if is_last and not tied:
            total += vocab * h * item
    else:
        # The table is held where tokens are looked up, and on the last stage as a tied head.
        table, head = block_table_bytes(vocab, h, quantization, config.tie_word_embeddings)
        if is_first or n_mtp > 0 or (is_last and config.tie_word_embeddings):
            total += table
        total += head if is_last else 0
    if is_last:
        mtp_own = 3 * h * item + matrix_bytes(2 * h, h, quantization, dtype)
        total += h * item + n_mtp * (mtp_own + layer_bytes(config, dtype, quantization))
    return total


def kv_bytes_per_token(config: ModelConfig, n_layers: int, dtype: torch.dtype) -> int:
    """KV-cache bytes per position for `n_layers` layers (count MTP depths as layers).

    `dtype` is the KV cache's element type (the stage's `kv_dtype`).
    """
    return 2 * n_layers * config.num_kv_heads * config.head_dim * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class StageModel(StageWeights):
    """Layers `[layer_start, layer_end)` of a model, with a positional KV cache per session."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        layer_start: int,
        layer_end: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_budget_bytes: int | None,
        progress: LoadProgress | None = None,
        quantization: str = "none",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        config = checkpoint.config
        if not 0 <= layer_start < layer_end <= config.num_layers:
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) is not within the model's "
                f"{config.num_layers} layers"
            )
        self.config = config
        self.model_id = checkpoint.model_id
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == config.num_layers
        self.device, self.dtype = device, dtype
        self.quantization = quantization = check_quantization(quantization)
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        # A `gguf` stage counts its layers once they are mapped (`_load_stored`).
        self.bytes_per_layer = (
            0 if quantization == "gguf" else layer_bytes(config, dtype, quantization)
        )
        self._layer_windows = [config.window_for_layer(i) for i in range(layer_start, layer_end)]
        self._windows = sorted(set(self._layer_windows), key=lambda w: -1 if w is None else w)
        self._rotary = Rotary(config, device, dtype)
        n_mtp = config.num_mtp_layers if self.is_last else 0
        layout = KVLayout(
            layer_end - layer_start, n_mtp, config.num_kv_heads, config.head_dim, self.kv_dtype
        )
        self.kv = KVCache(layout, device, kv_budget_bytes)
        self._scratch: dict[str, StepScratch] = {}  # per open session
        # A CPU stage governs the intra-op threads torch had when it loaded (the daemon's
        # `threads`): each pass runs on those or on one, whichever measures faster now.
        threads = torch.get_num_threads()
        self.governor = ThreadGovernor(threads) if device.type == "cpu" and threads > 1 else None
        self.kv_bytes_per_token = layout.bytes_per_token
        self._on_tensor: OnTensor | None = None
        if progress is not None:
            self._on_tensor = _progress_counter(self._weight_names(n_mtp), checkpoint, progress)
        self._load_weights(checkpoint, n_mtp)
        self._on_tensor = None

    @classmethod
    def load(
        cls,
        checkpoint: Checkpoint,
        layer_start: int,
        layer_end: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        kv_budget_bytes: int | None = None,
        progress: LoadProgress | None = None,
        quantization: str = "none",
        kv_dtype: torch.dtype | None = None,
    ) -> StageModel:
        """Materialise only this stage's weights on `device` (auto-picked when None).

        `quantization` "q8_0", "q4_0", "q4_k", "q5_k" and "q6_k" (or the aliases "int8" and
        "int4") quantize the matrices into ggml's block formats as each layer loads (CPU stages;
        the checkpoint's own precision is read one layer at a time), run by the kernels of a
        GGUF file's tensors; "gguf" runs a GGUF file's tensors as stored; "none" keeps `dtype`.
        `kv_dtype` is the KV cache's element type (default: `dtype`; float16 or bfloat16 halve
        an fp32 stage's KV bytes). `progress(done_bytes, total_bytes)` is called after each
        tensor is read, from the loading thread; None (the default) costs nothing.
        """
        device_ = pick_device(device)
        stage = cls(
            checkpoint,
            layer_start,
            layer_end,
            device_,
            dtype,
            kv_budget_bytes,
            progress,
            quantization,
            kv_dtype,
        )
        matrices = stage.weight_matrices()
        if any(isinstance(m, GgufMatrix) for m in matrices):
            # The block kernels prefetch by whether the process's weights fit the cache (a
            # stage without block matrices does not load the block library for it).
            note_step_weights(sum(int(m.nbytes) for m in matrices))
        return stage

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this stage holds: layers, embedding, norm, head, MTP depths.

        Counted from the loaded tensors (quantized matrices by their kernel's layout); equal to
        `stage_weight_bytes` of this stage's config, range, dtype and quantization.
        """
        total = sum(layer.nbytes() for layer in self.layers)
        total += sum(depth.nbytes() for depth in self.mtp)
        if self._embed is not None:
            total += self._embed.nbytes
        head, embed = self._head, self._embed
        shared = (  # a tied fp head and the embedding are one tensor
            isinstance(head, torch.Tensor)
            and isinstance(embed, torch.Tensor)
            and head.data_ptr() == embed.data_ptr()
        ) or (  # a tied GGUF head maps the embedding's bytes
            isinstance(head, GgufMatrix)
            and isinstance(embed, GgufEmbedding)
            and head.parts[0] is embed.table
        )
        if head is not None and not shared:
            total += head.nbytes
        if self._norm is not None:
            total += self._norm.nbytes
        return total

    @property
    def layer_kernel(self) -> str | None:
        """Whether decode steps and verify windows run every layer of this stage in one call of
        meshd's C kernel (`KernelLayers`): "meshd layers", or None (layer by layer)."""
        return None if self._kernel_layers is None else "meshd layers"

    @property
    def head(self) -> Matrix | None:
        """The head `[hidden, vocab]` the last stage's logits come from (None elsewhere)."""
        return self._head

    def weight_matrices(self) -> list[Matrix]:
        """The `[in, out]` matrices one decode step multiplies by, in order (for roofline measurements)."""
        matrices = [m for layer in self.layers for m in layer.matrices()]
        return matrices + ([self._head] if self._head is not None else [])

    def open_session(
        self, session_id: str, max_positions: int, *, prefix: tuple[int, int] | None = None
    ) -> int:
        """Allocate KV for a session (`KVBudgetExceeded` past the budget); with `prefix` =
        (entry id, p), start from the prefix-cache entry's first p positions. Returns the
        positions reused (`KVCache.open`)."""
        reused = self.kv.open(session_id, max_positions, prefix=prefix)
        config = self.config
        self._scratch[session_id] = StepScratch.allocate(
            self._dims, config.intermediate_size, self.dtype, self.device
        )
        return reused

    def close_session(self, session_id: str) -> None:
        """Free a session's KV (no-op if it is not open)."""
        self.kv.close(session_id)
        self._scratch.pop(session_id, None)

    @torch.inference_mode()
    def forward(
        self,
        session_id: str,
        base_pos: int,
        inputs: torch.Tensor,
        *,
        logits_last_n: int | None = None,
        head: Matrix | None = None,
    ) -> StageOutput:
        """Run positions `base_pos .. base_pos+T-1` through this stage.

        `inputs` are token ids `[T]` on the first stage and hidden states `[T, hidden]`
        otherwise. The last stage also returns fp32 logits, for all T positions or only for the
        last `logits_last_n` (a prefill chunk needs just one row), by `head` where given (a
        draft's narrowed vocabulary) instead of its own.
        """
        return self._governed(
            len(inputs), lambda: self._forward(session_id, base_pos, inputs, logits_last_n, head)
        )

    def _governed(self, rows: int, run: Callable[[], _T]) -> _T:
        """`run()`, a pass of `rows` rows, on the threads the governor chooses, timed for it."""
        if self.governor is None:
            return run()
        threads = self.governor.choose(rows)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        out = run()
        self.governor.record(rows, threads, time.perf_counter() - start)
        return out

    def _forward(
        self,
        session_id: str,
        base_pos: int,
        inputs: torch.Tensor,
        logits_last_n: int | None,
        head: Matrix | None = None,
    ) -> StageOutput:
        group = self.kv.get(session_id).main
        x = self._stage_input(inputs)
        length = x.shape[0]
        group.check_window(session_id, base_pos, length, "stage")
        rope = self._rotary.table(base_pos, length)
        if self._kernel_layers is not None and length <= ROW_ATTENTION_MAX:
            x = self._kernel_layers.run(x, [KernelWindow(group.kv, base_pos, length, rope)])
        else:
            spans = {w: AttnSpan.build(base_pos, length, w, self.device) for w in self._windows}
            layers = zip(self.layers, group.layers, self._layer_windows, strict=True)
            scratch = self._scratch.get(session_id) if length == 1 else None
            for weights, cache, window in layers:
                x = decoder_layer(x, weights, self._dims, rope, cache, spans[window], scratch)
        group.valid_len = base_pos + length
        if self._norm is None:
            return StageOutput(x, None)
        last = x if logits_last_n is None else x[-logits_last_n:]
        if head is not None:
            return StageOutput(x, norm_linear(last, self._norm, self._dims, head, None).float())
        return StageOutput(x, self._logits(last, self._norm))

    @torch.inference_mode()
    def forward_batch(
        self, items: Sequence[BatchItem | tuple[str, int, torch.Tensor]]
    ) -> list[StageOutput]:
        """`forward` for several sessions' windows in one pass; outputs in `items` order.

        The rows of all windows go through each weight matrix together (decode is memory-bound:
        the weights stream once per pass, not once per session); attention runs per session
        against its own KV. Each session may appear once. Every window is checked before any is
        computed, so a bad one leaves every cache untouched.
        """
        batch = [BatchItem(*item) for item in items]
        if not batch:
            return []
        rows = sum(len(item.inputs) for item in batch)
        return self._governed(rows, lambda: self._forward_batch(batch))

    def _forward_batch(self, batch: list[BatchItem]) -> list[StageOutput]:
        if len({item.session_id for item in batch}) != len(batch):
            raise InvalidInput("a batched pass takes at most one window per session")
        groups = [self.kv.get(item.session_id).main for item in batch]
        xs = [self._stage_input(item.inputs) for item in batch]
        for item, group, x in zip(batch, groups, xs, strict=True):
            group.check_window(item.session_id, item.base_pos, x.shape[0], "stage")
        lengths = [x.shape[0] for x in xs]
        ropes = [self._rotary.table(i.base_pos, n) for i, n in zip(batch, lengths, strict=True)]
        if self._kernel_layers is not None and max(lengths) <= ROW_ATTENTION_MAX:
            windows = [
                KernelWindow(g.kv, i.base_pos, n, r)
                for g, i, n, r in zip(groups, batch, lengths, ropes, strict=True)
            ]
            x = self._kernel_layers.run(torch.cat(xs), windows)
        else:
            x = self._layers_batch(xs, batch, groups, lengths, ropes)
        for item, group, n in zip(batch, groups, lengths, strict=True):
            group.valid_len = item.base_pos + n
        hidden = list(torch.split(x, lengths))
        if self._norm is None:
            return [StageOutput(h, None) for h in hidden]
        last = [i.logits_last_n for i in batch]
        rows = [h if k is None else h[-k:] for h, k in zip(hidden, last, strict=True)]
        logits = torch.split(self._logits(torch.cat(rows), self._norm), [len(r) for r in rows])
        return [StageOutput(h, lg) for h, lg in zip(hidden, logits, strict=True)]

    def _layers_batch(
        self,
        xs: list[torch.Tensor],
        batch: list[BatchItem],
        groups: list[KVGroup],
        lengths: list[int],
        ropes: list[torch.Tensor],
    ) -> torch.Tensor:
        spans = [
            {w: AttnSpan.build(i.base_pos, n, w, self.device) for w in self._windows}
            for i, n in zip(batch, lengths, strict=True)
        ]
        x = torch.cat(xs)
        for index, (weights, window) in enumerate(
            zip(self.layers, self._layer_windows, strict=True)
        ):
            parts = [
                BatchPart(n, rope, group.layers[index], span[window])
                for n, rope, group, span in zip(lengths, ropes, groups, spans, strict=True)
            ]
            x = decoder_layer_batch(x, weights, self._dims, parts)
        return x

    def _stage_input(self, inputs: torch.Tensor) -> torch.Tensor:
        return self._embed_tokens(inputs) if self.is_first else self._hidden_input(inputs)

    @torch.inference_mode()
    def mtp_forward(
        self,
        session_id: str,
        depth: int,
        base_pos: int,
        prev_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        *,
        logits_last_n: int | None = None,
    ) -> MtpOutput:
        """Run MTP depth `depth` (1-based) at positions `base_pos .. base_pos+T-1`.

        `prev_hidden[j]` is h_prev at position base_pos+j (the main model's residual output for
        depth 1, depth-1's `hidden` otherwise) and `next_tokens[j]` is t[base_pos+j+depth].
        The logits at row j predict t[base_pos+j+depth+1]; they are computed for all T rows, or
        only for the last `logits_last_n` (a drafter needs one row, or none to keep KV only:
        the vocabulary head over a few rows costs more than the depth's decoder layer).
        """
        if not 1 <= depth <= len(self.mtp):
            raise InvalidInput(
                f"MTP depth {depth} requested; this stage has {len(self.mtp)} MTP depths"
                + ("" if self.is_last else " (MTP runs on the last stage only)")
            )
        group: KVGroup = self.kv.get(session_id).mtp[depth - 1]
        embeds = self._embed_tokens(next_tokens)
        hidden = self._hidden_input(prev_hidden)
        length = embeds.shape[0]
        if hidden.shape[0] != length:
            raise InvalidInput(f"MTP: {hidden.shape[0]} hidden states but {length} next tokens")
        group.check_window(session_id, base_pos, length, f"MTP depth {depth}")
        rope = self._rotary.table(base_pos, length)
        span = AttnSpan.build(base_pos, length, None, self.device)
        weights = self.mtp[depth - 1]
        scratch = self._scratch.get(session_id) if length == 1 else None
        h = mtp_hidden(embeds, hidden, weights, self._dims, rope, group.layers[0], span, scratch)
        group.valid_len = base_pos + length
        rows = h if logits_last_n is None else h[h.shape[0] - logits_last_n :]
        return MtpOutput(h, self._logits(rows, weights.norm))

    def _logits(self, hidden: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        assert self._head is not None
        kernels, head = self._kernel_layers, self._kernel_head
        if kernels is not None and head is not None and hidden.shape[0] <= ROW_ATTENTION_MAX:
            # Where the layers run in meshd's kernel, so does the head of a step or window: with
            # fp32 matrices that keeps a window's rows the bits of the steps it replaces.
            return kernels.norm_linear(hidden, norm, head)
        return norm_linear(hidden, norm, self._dims, self._head, None).float()

    def _embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise InvalidInput("this stage has no embedding: it takes hidden states, not tokens")
        if tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32) or not len(tokens):
            raise InvalidInput(
                f"expected token ids as a non-empty 1-D integer tensor, got {tokens.dtype} "
                f"{list(tokens.shape)}"
            )
        # Ids from outside (the network) arrive on the CPU and are checked there; ids already on
        # an accelerator came from our own sampler, and checking them would force a sync per step.
        # (One `tolist` is cheaper than the four tensor ops of a vectorised range check.)
        ids = tokens.tolist() if tokens.device.type == "cpu" else None
        if ids is not None and (min(ids) < 0 or max(ids) >= self.config.vocab_size):
            raise InvalidInput(f"token id outside the vocabulary [0, {self.config.vocab_size})")
        if isinstance(self._embed, GgufEmbedding):
            return self._embed.lookup(tokens.to(self.device), self.dtype)
        return F.embedding(tokens.to(self.device), self._embed)

    def _hidden_input(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size or not len(hidden):
            raise InvalidInput(
                f"expected hidden states [T, {self.config.hidden_size}], got {list(hidden.shape)}"
            )
        if not hidden.is_floating_point():
            raise InvalidInput(f"hidden states must be floating point, got {hidden.dtype}")
        return hidden.to(device=self.device, dtype=self.dtype)


def _progress_counter(
    names: Sequence[str], checkpoint: Checkpoint, progress: LoadProgress
) -> OnTensor:
    """Turn per-tensor reads into `progress(done_bytes, total_bytes)` calls."""
    total = sum(checkpoint.tensors[name].nbytes for name in names if name in checkpoint.tensors)
    done = 0
    progress(0, total)

    def on_tensor(_name: str, nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress(done, total)

    return on_tensor
