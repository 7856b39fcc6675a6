"""How a stage reads its weights (`StageWeights`, the base of `StageModel`): each layer read,
fused and quantized in turn, the embedding and head by quantization, and a GGUF file's tensors
as stored (`_load_stored`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from meshd.model.checkpoint import Checkpoint, OnTensor
from meshd.model.config import ModelConfig
from meshd.model.errors import UnsupportedArchitecture
from meshd.model.gguf_checkpoint import GGUFCheckpoint
from meshd.model.gguf_matrix import GgufEmbedding, GgufMatrix, Matrix
from meshd.model.kernel_layers import KernelLayers, kernel_matrix
from meshd.model.kernels import MatrixArgs
from meshd.model.kernels.blocks import (
    BlockMatrix,
    UnsupportedTensorType,
    quantize_rows,
    supported_types,
)
from meshd.model.llama import (
    Dims,
    LayerWeights,
    decoder_layer_shapes,
    linear_weight,
    rope_row_order,
)
from meshd.model.mtp import MtpWeights, mtp_shapes
from meshd.model.quant import BLOCK_QUANTIZATIONS, block_type, row_exact


class StageWeights:
    """The weights of layers `[layer_start, layer_end)` and what the stage's ends hold, read
    from a checkpoint by `_load_weights`. `StageModel` sets the fields up to `_on_tensor`;
    `_load_weights` sets the rest."""

    config: ModelConfig
    layer_start: int
    layer_end: int
    is_first: bool
    is_last: bool
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str
    bytes_per_layer: int
    _layer_windows: list[int | None]
    _on_tensor: OnTensor | None
    _dims: Dims
    layers: list[LayerWeights]
    _kernel_layers: KernelLayers | None

    def _fetch(
        self, checkpoint: Checkpoint, prefix: str, names: list[str]
    ) -> dict[str, torch.Tensor]:
        loaded = checkpoint.load((prefix + name for name in names), self._on_tensor)
        if self.quantization == "none":
            return {
                name[len(prefix) :]: t.to(device=self.device, dtype=self.dtype)
                for name, t in loaded
            }
        # Matrices stay as read (on the CPU) until quantized; vectors take the stage's format.
        return {
            name[len(prefix) :]: t if t.dim() == 2 else t.to(device=self.device, dtype=self.dtype)
            for name, t in loaded
        }

    def _matrix(self, quantization: str) -> Callable[[torch.Tensor], Matrix]:
        """How a checkpoint matrix `[out, in]` becomes an operand at `quantization`."""
        if quantization == "none":
            return linear_weight
        return functools.partial(_block_matrix, quantization=quantization, role="matrix")

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
        if self.quantization == "gguf":
            self._load_stored(checkpoint)
            return
        blocks = self.quantization in BLOCK_QUANTIZATIONS
        if blocks and self.device.type != "cpu":
            raise ValueError(
                f"quantization {self.quantization} runs on CPU stages only (ggml's block "
                f"kernels); this stage is on {self.device}"
            )
        config = self.config
        exact = row_exact(self.quantization, self.device)
        self._dims = Dims.of(config, self.device, exact_windows=exact)
        layer_names = list(decoder_layer_shapes(config))
        matrix = self._matrix(self.quantization)
        # One layer at a time: read, fuse, quantize; the full-precision copy is freed before
        # the next layer is read.
        self.layers = [
            LayerWeights.from_checkpoint(
                self._fetch(checkpoint, f"model.layers.{i}.", layer_names), self._dims, matrix
            )
            for i in range(self.layer_start, self.layer_end)
        ]
        self._kernel_layers = (
            KernelLayers.build(self.layers, self._dims, self._layer_windows, self.kv_dtype)
            if self.device.type == "cpu" and self.dtype == torch.float32
            else None
        )
        tied = config.tie_word_embeddings
        needs_embed = self.is_first or (self.is_last and (tied or n_mtp > 0))
        embed = (
            self._fetch(checkpoint, "model.", ["embed_tokens.weight"])["embed_tokens.weight"]
            if needs_embed
            else None
        )
        self._embed: torch.Tensor | GgufEmbedding | None = embed
        self._norm: torch.Tensor | None = None
        self._head: Matrix | None = None  # [hidden, vocab] (`linear_weight`)
        # An fp32 head as meshd's kernel reads it, where the layers run there (see `_logits`).
        self._kernel_head: MatrixArgs | None = None
        self.mtp: list[MtpWeights] = []
        if blocks:
            self._block_table_and_head(checkpoint, embed, n_mtp)
            embed = None
        if not self.is_last:
            return
        self._norm = self._fetch(checkpoint, "model.norm.", ["weight"])["weight"]
        if not blocks:  # (a block quantization's head is built with its table)
            head = embed if tied else self._fetch(checkpoint, "lm_head.", ["weight"])["weight"]
            assert head is not None
            self._head = linear_weight(head)
            if tied:
                # One tensor serves both: the head in its matmul layout, lookups reading its
                # columns (a lookup touches T rows; the head streams the whole matrix every
                # token).
                self._embed = self._head.t()
            del head
        del embed
        assert self._head is not None
        if self._kernel_layers is not None:
            args = kernel_matrix(self._head)
            if args is not None and args.kind in (32, 33):  # quantized heads are row-exact
                self._kernel_head = args
        mtp_names = list(mtp_shapes(config))
        self.mtp = [
            MtpWeights.from_checkpoint(
                self._fetch(checkpoint, f"mtp.{k}.", mtp_names), self._dims, matrix
            )
            for k in range(n_mtp)
        ]

    def _block_table_and_head(
        self, checkpoint: Checkpoint, embed: torch.Tensor | None, n_mtp: int
    ) -> None:
        """A block quantization's embedding and head, as a GGUF file at that type holds them
        (`quant.block_type`): a tied head is the table itself, quantized as the head."""
        table = None
        if embed is not None:
            role = "head" if self.config.tie_word_embeddings else "embedding"
            table = _block_matrix(embed, self.quantization, role).parts[0]

        def untied_head() -> BlockMatrix:
            head = self._fetch(checkpoint, "lm_head.", ["weight"])["weight"]
            return _block_matrix(head, self.quantization, "head").parts[0]

        self._blocks_table_and_head(table, untied_head, self.is_first or n_mtp > 0)

    def _blocks_table_and_head(
        self, table: BlockMatrix | None, untied_head: Callable[[], BlockMatrix], lookups: bool
    ) -> None:
        """The embedding (where this stage looks tokens up) and the head (last stage) of a stage
        of ggml blocks, whether a GGUF file's or quantized at load: a tied head multiplies the
        embedding table's own bytes (counted once, `weight_bytes`)."""
        self._embed = GgufEmbedding(table) if table is not None and lookups else None
        self._head = None
        if self.is_last:
            tied = self.config.tie_word_embeddings
            self._head = GgufMatrix([table if tied and table is not None else untied_head()])

    def _load_stored(self, checkpoint: Checkpoint) -> None:
        """Quantization `gguf`: every matrix and the embedding as the GGUF file stores them
        (views of the mapped file, `gguf_matrix`); only norms and biases are read into memory."""
        if not isinstance(checkpoint, GGUFCheckpoint):
            raise ValueError(
                f"quantization gguf runs a GGUF file's tensors as stored, and "
                f"{checkpoint.directory} is not a GGUF file"
            )
        if self.device.type != "cpu":
            raise ValueError(
                f"quantization gguf runs on CPU stages only; this stage is on {self.device}"
            )
        config = self.config
        self._dims = Dims.of(config, self.device, exact_windows=True)
        shapes = decoder_layer_shapes(config)
        vectors = [name for name, shape in shapes.items() if len(shape) == 1]

        def block(name: str) -> BlockMatrix:
            t = checkpoint.stored(name)
            try:
                matrix = BlockMatrix(t.raw, t.ggml_type, t.shape[-1], t.shape[0])
            except UnsupportedTensorType:
                raise UnsupportedArchitecture(
                    f"{checkpoint.directory}: tensor {t.gguf_name} is {t.type_name}, a GGUF type "
                    f"meshd has no kernel for (supported: "
                    f"{', '.join(sorted(t.name for t in supported_types()))})"
                ) from None
            if self._on_tensor is not None:
                self._on_tensor(name, t.raw.nbytes)
            return matrix

        def layer(i: int) -> LayerWeights:
            prefix = f"model.layers.{i}."
            # q/k rows of a `llama` file are stored in the runtime's rotary order already
            # (llama.cpp's converter permutes them so); other files' q/k products are reordered.
            stored_order = checkpoint.architecture == "llama"

            def fuse(names: list[str]) -> Matrix:
                parts = [block(prefix + n) for n in names]
                perms = [
                    None if stored_order else rope_row_order(n, p.out_features, self._dims)
                    for n, p in zip(names, parts, strict=True)
                ]
                return GgufMatrix(parts, perms)

            return LayerWeights.from_parts(
                self._fetch(checkpoint, prefix, vectors), self._dims, fuse
            )

        self.layers = [layer(i) for i in range(self.layer_start, self.layer_end)]
        self._kernel_layers = (
            KernelLayers.build(self.layers, self._dims, self._layer_windows, self.kv_dtype)
            if self.dtype == torch.float32
            else None
        )
        self._kernel_head = None
        self.mtp = []
        tied = config.tie_word_embeddings
        table = (
            block("model.embed_tokens.weight") if self.is_first or (self.is_last and tied) else None
        )
        self._blocks_table_and_head(table, lambda: block("lm_head.weight"), self.is_first)
        self._norm = None
        if self.is_last:
            self._norm = self._fetch(checkpoint, "model.norm.", ["weight"])["weight"]
        self.bytes_per_layer = max((layer.nbytes() for layer in self.layers), default=0)


def _block_matrix(w: torch.Tensor, quantization: str, role: str) -> GgufMatrix:
    """Checkpoint matrix `w` `[out, in]` quantized into the ggml block type `quantization` gives
    it in `role` (`quant.block_type`): one tensor's bytes, as a GGUF file of that type holds."""
    out_features, in_features = w.shape
    qtype = GGMLQuantizationType[block_type(quantization, in_features, role)]
    data = quantize_rows(w, qtype)
    return GgufMatrix([BlockMatrix(data, qtype, in_features, out_features)])
