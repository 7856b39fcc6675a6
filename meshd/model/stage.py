"""`StageModel`: a contiguous layer range of a checkpoint, serving many sessions.

The first stage also holds the embedding; the last stage holds the final norm, the head and the
MTP depths (plus the embedding, which MTP and tied heads share). Hidden states crossing a stage
boundary are the residual stream before the final norm, so splitting a model into any number of
stages computes exactly what the unsplit model computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from meshd.model.checkpoint import Checkpoint, OnTensor
from meshd.model.config import ModelConfig
from meshd.model.device import pick_device
from meshd.model.errors import InvalidInput
from meshd.model.kvcache import KVCache, KVGroup, KVLayout
from meshd.model.llama import (
    AttnSpan,
    BatchPart,
    Dims,
    LayerWeights,
    Rotary,
    StepScratch,
    decoder_layer,
    decoder_layer_batch,
    decoder_layer_shapes,
    linear_weight,
    rms_norm,
)
from meshd.model.mtp import MtpWeights, mtp_hidden, mtp_shapes

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


def layer_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one decoder layer's weights when loaded as `dtype` (for the planner)."""
    elements = sum(math.prod(s) for s in decoder_layer_shapes(config).values())
    return elements * _itemsize(dtype)


def kv_bytes_per_token(config: ModelConfig, n_layers: int, dtype: torch.dtype) -> int:
    """KV-cache bytes per position for `n_layers` layers (count MTP depths as layers)."""
    return 2 * n_layers * config.num_kv_heads * config.head_dim * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class StageModel:
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
        self.bytes_per_layer = layer_bytes(config, dtype)
        self._layer_windows = [config.window_for_layer(i) for i in range(layer_start, layer_end)]
        self._windows = sorted(set(self._layer_windows), key=lambda w: -1 if w is None else w)
        self._rotary = Rotary(config, device, dtype)
        n_mtp = config.num_mtp_layers if self.is_last else 0
        layout = KVLayout(
            layer_end - layer_start, n_mtp, config.num_kv_heads, config.head_dim, dtype
        )
        self.kv = KVCache(layout, device, kv_budget_bytes)
        self._scratch: dict[str, StepScratch] = {}  # per open session
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
    ) -> StageModel:
        """Materialise only this stage's weights on `device` (auto-picked when None).

        `progress(done_bytes, total_bytes)` is called after each tensor is read, from the
        loading thread; None (the default) costs nothing.
        """
        device_ = pick_device(device)
        return cls(checkpoint, layer_start, layer_end, device_, dtype, kv_budget_bytes, progress)

    def _fetch(
        self, checkpoint: Checkpoint, prefix: str, names: list[str]
    ) -> dict[str, torch.Tensor]:
        loaded = checkpoint.load((prefix + name for name in names), self._on_tensor)
        return {
            name[len(prefix) :]: t.to(device=self.device, dtype=self.dtype) for name, t in loaded
        }

    def _weight_names(self, n_mtp: int) -> list[str]:
        """Every tensor name `_load_weights` reads (to size a progress display)."""
        config = self.config
        layer = list(decoder_layer_shapes(config))
        names = [
            f"model.layers.{i}.{n}" for i in range(self.layer_start, self.layer_end) for n in layer
        ]
        if self.is_first or (self.is_last and (config.tie_word_embeddings or n_mtp > 0)):
            names.append("model.embed_tokens.weight")
        if self.is_last:
            names.append("model.norm.weight")
            if not config.tie_word_embeddings:
                names.append("lm_head.weight")
            names += [f"mtp.{k}.{n}" for k in range(n_mtp) for n in mtp_shapes(config)]
        return names

    def _load_weights(self, checkpoint: Checkpoint, n_mtp: int) -> None:
        config = self.config
        self._dims = Dims.of(config, self.device)
        layer_names = list(decoder_layer_shapes(config))
        self.layers = [
            LayerWeights.from_checkpoint(
                self._fetch(checkpoint, f"model.layers.{i}.", layer_names), self._dims
            )
            for i in range(self.layer_start, self.layer_end)
        ]
        needs_embed = self.is_first or (self.is_last and (config.tie_word_embeddings or n_mtp > 0))
        self._embed = (
            self._fetch(checkpoint, "model.", ["embed_tokens.weight"])["embed_tokens.weight"]
            if needs_embed
            else None
        )
        self._norm: torch.Tensor | None = None
        self._head: torch.Tensor | None = None  # [hidden, vocab] (`linear_weight`)
        self.mtp: list[MtpWeights] = []
        if not self.is_last:
            return
        self._norm = self._fetch(checkpoint, "model.norm.", ["weight"])["weight"]
        if config.tie_word_embeddings:
            assert self._embed is not None
            # One tensor serves both: the head in its matmul layout, lookups reading its columns
            # (a lookup touches T rows; the head streams the whole matrix every token).
            self._head = linear_weight(self._embed)
            self._embed = self._head.t()
        else:
            head = self._fetch(checkpoint, "lm_head.", ["weight"])["weight"]
            self._head = linear_weight(head)
        mtp_names = list(mtp_shapes(config))
        self.mtp = [
            MtpWeights.from_checkpoint(self._fetch(checkpoint, f"mtp.{k}.", mtp_names), self._dims)
            for k in range(n_mtp)
        ]

    def weight_matrices(self) -> list[torch.Tensor]:
        """The `[in, out]` matrices one decode step multiplies by, in order (for roofline measurements)."""
        matrices = [t for layer in self.layers for t in layer.tensors() if t.dim() == 2]
        return matrices + ([self._head] if self._head is not None else [])

    def open_session(self, session_id: str, max_positions: int) -> None:
        """Allocate KV for a session (`KVBudgetExceeded` past the budget)."""
        self.kv.open(session_id, max_positions)
        config = self.config
        self._scratch[session_id] = StepScratch.allocate(
            self._dims, config.intermediate_size, self.dtype, self.device
        )

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
    ) -> StageOutput:
        """Run positions `base_pos .. base_pos+T-1` through this stage.

        `inputs` are token ids `[T]` on the first stage and hidden states `[T, hidden]`
        otherwise. The last stage also returns fp32 logits, for all T positions or only for the
        last `logits_last_n` (a prefill chunk needs just one row).
        """
        group = self.kv.get(session_id).main
        x = self._embed_tokens(inputs) if self.is_first else self._hidden_input(inputs)
        length = x.shape[0]
        group.check_window(session_id, base_pos, length, "stage")
        rope = self._rotary.table(base_pos, length)
        spans = {w: AttnSpan.build(base_pos, length, w, self.device) for w in self._windows}
        layers = zip(self.layers, group.layers, self._layer_windows, strict=True)
        scratch = self._scratch.get(session_id) if length == 1 else None
        for weights, cache, window in layers:
            x = decoder_layer(x, weights, self._dims, rope, cache, spans[window], scratch)
        group.valid_len = base_pos + length
        if self._norm is None:
            return StageOutput(x, None)
        last = x if logits_last_n is None else x[-logits_last_n:]
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
        if len({item.session_id for item in batch}) != len(batch):
            raise InvalidInput("a batched pass takes at most one window per session")
        groups = [self.kv.get(item.session_id).main for item in batch]
        xs = [self._stage_input(item.inputs) for item in batch]
        for item, group, x in zip(batch, groups, xs, strict=True):
            group.check_window(item.session_id, item.base_pos, x.shape[0], "stage")
        if not batch:
            return []
        lengths = [x.shape[0] for x in xs]
        ropes = [self._rotary.table(i.base_pos, n) for i, n in zip(batch, lengths, strict=True)]
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
        for item, group, n in zip(batch, groups, lengths, strict=True):
            group.valid_len = item.base_pos + n
        hidden = list(torch.split(x, lengths))
        if self._norm is None:
            return [StageOutput(h, None) for h in hidden]
        last = [i.logits_last_n for i in batch]
        rows = [h if k is None else h[-k:] for h, k in zip(hidden, last, strict=True)]
        logits = torch.split(self._logits(torch.cat(rows), self._norm), [len(r) for r in rows])
        return [StageOutput(h, lg) for h, lg in zip(hidden, logits, strict=True)]

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
        return torch.mm(rms_norm(hidden, norm, self._dims), self._head).float()

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
