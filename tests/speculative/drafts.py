"""Tiny random draft models for the spec tests (one per vocabulary, written once a process)."""

from __future__ import annotations

import functools
import pathlib
import tempfile

from meshd.bench.checkpoints import make_checkpoint
from meshd.speculative.draft import DraftModel

_ROOT = pathlib.Path(tempfile.mkdtemp(prefix="meshd-drafts-"))


@functools.cache
def tiny_draft_dir(vocab: int, seed: int = 17) -> pathlib.Path:
    """A random one-layer Llama over `vocab` ids (no tokenizer: ids only)."""
    directory = _ROOT / f"v{vocab}-s{seed}"
    make_checkpoint(
        directory,
        "llama",
        seed=seed,
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    return directory


@functools.cache
def tiny_draft(vocab: int, seed: int = 17) -> DraftModel:
    """The loaded draft of `tiny_draft_dir` (shared: each request opens its own session)."""
    return DraftModel.load(tiny_draft_dir(vocab, seed))
