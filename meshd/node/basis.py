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
from meshd.model.quant import check_quantization
from meshd.node.models import ModelFiles
from meshd.speculative.draft import DraftModel
from protocol.handshake import psk_from_secret

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NodeBasis:
    """What a node is before it opens lanes: its identity, the mesh key, its device and
    formats, and the models it holds (`models`, `--model`'s first first)."""

    identity: NodeIdentity
    psk: bytes
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    # What this node offers: (model id, quantization). It plans with, and serves stages of,
    # the nodes offering the same quantization (docs/planner.md, "Quantization").
    quantization: str
    models: tuple[ModelFiles, ...]
    # The coordinators' draft model (`spec.draft_model`), at the node's quantization.
    draft: DraftModel | None = None

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
        name: str = "",
        timing_checkpoint: Checkpoint | None = None,
    ) -> NodeBasis:
        """The basis over an opened checkpoint, its one model so far, called `name` (its
        tokenizer files are in `model_dir`; compute is measured on `timing_checkpoint`)."""
        device = pick_device(None if config.device == "auto" else config.device)
        dtype = _DTYPES.get(config.dtype, torch.float32)
        kv_dtype = _DTYPES.get(config.kv_dtype, dtype)
        # An alias (`int8`, `int4`) is resolved here: the node names its scheme one way to
        # its peers, whose plans compare quantizations by name.
        quantization = check_quantization(
            checkpoint.default_quantization
            if config.quantization == "auto"
            else config.quantization
        )
        if quantization == "gguf" and device.type != "cpu" and config.quantization == "auto":
            # The block kernels run on CPUs; elsewhere a GGUF file is dequantized at load into
            # the stage's dtype.
            quantization = "none"
        first = ModelFiles.of(
            config,
            name,
            model_dir,
            checkpoint,
            dtype=dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            timing_checkpoint=timing_checkpoint,
        )
        return cls(
            identity=identity,
            psk=psk,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            models=(first,),
            draft=(
                DraftModel.load(
                    config.spec.draft_model,
                    quantization=quantization,
                    prefix_cache_bytes=config.stage.prefix_cache_bytes,
                )
                if config.spec.draft_model
                else None
            ),
        )
