"""`NodeBasis`: what a node is before it opens lanes: its identity, the mesh key, and the
models it holds (files, device, formats, and the planner's view of each)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshd.config import NodeConfig
from meshd.mesh.identity import NodeIdentity
from meshd.model.checkpoint import Checkpoint
from meshd.model.device import pick_device
from meshd.model.files import open_checkpoint
from meshd.model.tokenizer import Tokenizer
from meshd.node.models import ModelFiles, tokenizer_and_shape
from meshd.plan import ModelShape
from meshd.speculative.draft import DraftModel
from protocol.handshake import psk_from_secret

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NodeBasis:
    """What a node is before it opens lanes: its identity, the mesh key, its device and
    formats, and the models it holds: the first's files in these fields, the others in
    `extras` (`models` lists them all alike, for the running node)."""

    identity: NodeIdentity
    psk: bytes
    model_dir: str
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    # What this node offers: (model id, quantization). It plans with, and serves stages of,
    # the nodes offering the same quantization (docs/planner.md, "Quantization").
    quantization: str
    shape: ModelShape
    context_tokens: int
    # The coordinator's draft model (`spec.draft_model`), at the node's quantization.
    draft: DraftModel | None = None
    # What the API calls the first model, and the node's further models (`with_models`).
    name: str = ""
    extras: tuple[ModelFiles, ...] = ()
    # What compute is measured on, when not `checkpoint` (a `mesh:ID` node: random weights of
    # the model's shapes, before it fetched any).
    timing_checkpoint: Checkpoint | None = None

    @property
    def models(self) -> tuple[ModelFiles, ...]:
        """Every model the node holds, its first (`--model`'s first) first."""
        first = ModelFiles(
            name=self.name,
            model_dir=self.model_dir,
            checkpoint=self.checkpoint,
            tokenizer=self.tokenizer,
            shape=self.shape,
            context_tokens=self.context_tokens,
            timing_checkpoint=self.timing_checkpoint,
        )
        return (first, *self.extras)

    @classmethod
    def load(cls, config: NodeConfig, model_dir: str) -> NodeBasis:
        """Read the identity, the mesh secret and the model's files (ConfigError, ModelError)."""
        from meshd.model.manifest import set_cache_dir

        set_cache_dir(config.model_cache_path())
        identity = NodeIdentity.load_or_create(config.state_dir)
        psk = psk_from_secret(config.read_mesh_secret())
        return cls.of(config, identity, psk, model_dir, open_checkpoint(model_dir))

    @classmethod
    def of(
        cls,
        config: NodeConfig,
        identity: NodeIdentity,
        psk: bytes,
        model_dir: str,
        checkpoint: Checkpoint,
        *,
        timing_checkpoint: Checkpoint | None = None,
    ) -> NodeBasis:
        """The basis over an opened checkpoint (its tokenizer files are in `model_dir`)."""
        device = pick_device(None if config.device == "auto" else config.device)
        dtype = _DTYPES.get(config.dtype, torch.float32)
        kv_dtype = _DTYPES.get(config.kv_dtype, dtype)
        quantization = (
            checkpoint.default_quantization
            if config.quantization == "auto"
            else config.quantization
        )
        if quantization == "gguf" and device.type != "cpu" and config.quantization == "auto":
            # The block kernels run on CPUs; elsewhere a GGUF file is converted at load.
            quantization = "int8"
        tokenizer, shape = tokenizer_and_shape(
            checkpoint, model_dir, dtype, quantization, kv_dtype, device
        )
        return cls(
            identity=identity,
            psk=psk,
            model_dir=model_dir,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            shape=shape,
            context_tokens=config.context_tokens or checkpoint.config.max_position_embeddings,
            draft=(
                DraftModel.load(config.spec.draft_model, quantization=quantization)
                if config.spec.draft_model
                else None
            ),
            timing_checkpoint=timing_checkpoint,
        )
