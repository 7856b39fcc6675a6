"""The models a node holds, as files: what each is before it runs (`ModelFiles`), the memory
one takes whole and a node's budget shared among several (`split_budget`).

What serves each model once the node runs is `HeldModel` (`meshd/node/held_model.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshd.config import ConfigError, NodeConfig
from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import ModelError
from meshd.model.files import model_name, open_checkpoint, open_tokenizer
from meshd.model.tokenizer import Tokenizer
from meshd.node.planning import model_shape
from meshd.plan import ModelShape
from meshd.speculative.draft import DraftMismatchError, check_draft_tokenizer

if TYPE_CHECKING:
    from meshd.node.basis import NodeBasis

log = logging.getLogger(__name__)

# The name the API gives the built-in model.
BUILTIN_MODEL_NAME = "meshd-builtin"


def display_name(model: str) -> str:
    """What the API calls a model given by path: the directory's name, a GGUF file's stem,
    `meshd-builtin` for "" (the built-in model)."""
    return model_name(model) if model else BUILTIN_MODEL_NAME


@dataclass(frozen=True)
class ModelFiles:
    """One model a node holds: its files, the planner's view of it, its name."""

    name: str
    model_dir: str
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    shape: ModelShape
    context_tokens: int
    # Whether the node's draft (`spec.draft_model`) drafts for this model (`_draft_fits`).
    draft_fits: bool = True
    # What compute is measured on, when not `checkpoint` (a `mesh:ID` model: random weights
    # of the model's shapes, before it fetched any).
    timing_checkpoint: Checkpoint | None = None

    @classmethod
    def of(
        cls,
        config: NodeConfig,
        name: str,
        model_dir: str,
        checkpoint: Checkpoint,
        *,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        quantization: str,
        draft_fits: bool = True,
        timing_checkpoint: Checkpoint | None = None,
    ) -> ModelFiles:
        """The model over an opened checkpoint (its tokenizer files are in `model_dir`)."""
        tokenizer, shape = tokenizer_and_shape(checkpoint, model_dir, dtype, quantization, kv_dtype)
        return cls(
            name=name,
            model_dir=model_dir,
            checkpoint=checkpoint,
            tokenizer=tokenizer,
            shape=shape,
            context_tokens=config.context_tokens or checkpoint.config.max_position_embeddings,
            draft_fits=draft_fits,
            timing_checkpoint=timing_checkpoint,
        )


def tokenizer_and_shape(
    checkpoint: Checkpoint,
    model_dir: str,
    dtype: torch.dtype,
    quantization: str,
    kv_dtype: torch.dtype,
) -> tuple[Tokenizer, ModelShape]:
    """(blocking) The model's tokenizer and `model_shape`, side by side: the shape's model id
    hashes every tensor on a first start, which hashlib does without the GIL, so it runs in a
    thread while this one builds the tokenizer (seconds each for a 150k-token vocabulary and a
    1 GB file; docs/benchmarks.md, "Start-up")."""
    with ThreadPoolExecutor(1, thread_name_prefix="model-id") as pool:
        shape = pool.submit(model_shape, checkpoint, dtype, quantization, kv_dtype)
        tokenizer = open_tokenizer(model_dir)
        return tokenizer, shape.result()


def full_model_bytes(shape: ModelShape, context_tokens: int) -> int:
    """Bytes the whole model takes on one node: weights and KV for `context_tokens`."""
    weights = shape.embedding_bytes + shape.head_bytes - shape.shared_bytes
    layers = shape.num_layers * shape.layer_bytes(context_tokens)
    return weights + layers + shape.head_kv_bytes_per_token * context_tokens


def split_budget(budget: int, needs: Sequence[int]) -> list[int]:
    """A node's memory budget shared among the models it holds, in proportion to what each
    whole model needs (so each can hold the same fraction of its layers). One model: all."""
    if len(needs) <= 1:
        return [budget] * len(needs)
    total = sum(max(1, n) for n in needs)
    return [max(1, budget * max(1, n) // total) for n in needs]


def with_models(config: NodeConfig, basis: NodeBasis, more: Sequence[str]) -> NodeBasis:
    """`basis` with its first model named, and holding `more` models after it (ModelError),
    each opened with the node's device, formats and quantization."""
    from meshd.model.builtin import builtin_model_dir

    def load(model: str) -> ModelFiles:
        """Open the model's checkpoint and tokenizer; whether the node's draft drafts for it
        is checked (`_draft_fits`)."""
        model_dir = model or str(builtin_model_dir())
        return ModelFiles.of(
            config,
            display_name(model),
            model_dir,
            open_checkpoint(model_dir),
            dtype=basis.dtype,
            kv_dtype=basis.kv_dtype,
            quantization=basis.quantization,
            draft_fits=_draft_fits(config.spec.draft_model, model_dir),
        )

    extras = tuple(load(model) for model in more)
    first = basis.models[0]
    models = (first, *extras)
    ids = [f.shape.model_id for f in models]
    if len(set(ids)) != len(ids):
        raise ConfigError("model: two of the models listed are the same checkpoint", key="model")
    name = first.name or display_name(config.models[0])  # a `mesh:ID` node: the holders' name
    return dataclasses.replace(basis, models=(dataclasses.replace(first, name=name), *extras))


def _draft_fits(draft: str, model_dir: str) -> bool:
    """Whether the node's draft (`spec.draft_model`, checked at start against the first model)
    drafts for this further model too: the same tokenizer, or a prefix of its vocabulary.
    Where it does not, the model's requests run without it (a `draft` request is refused)."""
    if not draft:
        return True
    try:
        check_draft_tokenizer(model_dir, draft)
    except (DraftMismatchError, ModelError) as exc:
        log.warning("spec.draft_model does not draft for %s: %s", model_dir, exc)
        return False
    return True
