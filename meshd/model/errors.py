"""Typed errors of the model runtime.

Every error names the file, tensor, key or session at fault, so a user pointing meshd at a
broken checkpoint reads one line that says what to fix, never a traceback from inside torch.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error raised by `meshd.model`."""


class UnsupportedArchitecture(ModelError):
    """The checkpoint's architecture (or a feature of it) is not one meshd can run."""


class InvalidConfig(ModelError):
    """`config.json` (or a tokenizer config) is present but malformed or inconsistent."""


class MissingFile(ModelError):
    """A file the checkpoint needs (config, weights shard, tokenizer) does not exist."""


class ModelUnavailable(ModelError):
    """A `mesh:ID` model's files: no member holding them has been reachable for the
    configured wait (`fetch.holder_wait_s`)."""


class MissingTensor(ModelError):
    """A weight the architecture needs is absent from the checkpoint."""


class ShapeMismatch(ModelError):
    """A tensor's stored shape differs from the shape the config implies."""


class CorruptCheckpoint(ModelError):
    """A weights file is damaged: bad safetensors header, offsets beyond the file, bad index."""


class KVBudgetExceeded(ModelError):
    """Opening a session would take the stage's KV cache past its memory budget."""


class SessionError(ModelError):
    """A session id is unknown, opened twice, or used at a position its cache cannot hold."""


class TokenizerError(ModelError):
    """The tokenizer or its chat template cannot be loaded or rendered."""


class InvalidInput(ModelError):
    """A stage was given inputs of the wrong kind, shape or range (token id beyond the vocab)."""
