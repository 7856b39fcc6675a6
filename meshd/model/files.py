"""Open a model from what `--model` names: a checkpoint directory or a GGUF file.

A directory is a Hugging Face checkpoint (`Checkpoint`, `Tokenizer.open`); a file ending in
`.gguf` is a llama.cpp/Ollama/LM Studio model file (`GGUFCheckpoint`, its metadata's
tokenizer). Callers use these two functions instead of the classes, so every command that takes
`--model DIR` takes `--model FILE.gguf` too.
"""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from typing import TYPE_CHECKING

from meshd.model.errors import MissingFile

if TYPE_CHECKING:  # imported when called: `meshd.model.checkpoint` pulls in torch
    from meshd.model.checkpoint import Checkpoint
    from meshd.model.tokenizer import Tokenizer

GGUF_SUFFIX = ".gguf"

log = logging.getLogger(__name__)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a GGUF file (by its suffix; directories never are)."""
    p = pathlib.Path(path)
    return p.suffix.lower() == GGUF_SUFFIX and not p.is_dir()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at `path`: a `Checkpoint` directory or a `GGUFCheckpoint` file."""
    if is_gguf(path):
        from meshd.model.gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint.open(path)
    from meshd.model.checkpoint import Checkpoint

    p = pathlib.Path(path)
    if p.is_file():
        raise MissingFile(
            f"{p}: a model is a checkpoint directory or a .gguf file, not another kind of file"
        )
    return Checkpoint.open(p)


def check_checkpoint(path: str | os.PathLike[str]) -> None:
    """Raise `ModelError` unless `path` opens as a checkpoint. A GGUF file is checked from its
    header, metadata and tensor table without importing torch (`gguf_model.open_gguf`), so a
    damaged file fails in well under a second; its tensor shapes are checked when it opens."""
    if is_gguf(path):
        from meshd.model.gguf_model import open_gguf

        p = pathlib.Path(path)
        if not p.is_file():
            raise MissingFile(f"{p}: GGUF file not found")
        open_gguf(p)
        return
    open_checkpoint(path)


def prepare(path: str | os.PathLike[str]) -> None:
    """Start hashing the tensors of the GGUF file at `path` in a thread (the digests of its
    model id; `meshd.model.digests` caches them, and the model id waits for a hashing under
    way rather than hash again). Nothing for a checkpoint directory; errors are left for the
    model id's own hashing to raise.

    `meshd serve` calls it once the file has passed its check, so a first start hashes while
    torch imports (hashlib hashes without the GIL, on the other core). The tokenizer is not
    built ahead: it would hold the GIL beside the import (docs/benchmarks.md, "Start-up").
    """
    if is_gguf(path):
        p = pathlib.Path(path)
        threading.Thread(target=_digests, args=(p,), name="model-digests", daemon=True).start()


def _digests(path: pathlib.Path) -> None:
    from meshd.model.digests import file_tensor_digests
    from meshd.model.errors import ModelError
    from meshd.model.gguf_model import open_gguf

    try:
        model = open_gguf(path)  # the start-up check's parse, cached
        for shard in dict.fromkeys(t.path for t in model.tensors.values()):
            file_tensor_digests(shard, [t for t in model.tensors.values() if t.path == shard])
    except (ModelError, OSError) as exc:
        log.debug("hashing %s ahead of the start failed: %s", path, exc)


def open_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the model at `path` (directory files, or GGUF metadata)."""
    if is_gguf(path):
        from meshd.model.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(pathlib.Path(path))
    from meshd.model.tokenizer import Tokenizer

    return Tokenizer.open(path)


def model_name(path: str | os.PathLike[str]) -> str:
    """A display name for the model at `path`: the directory's name, or the file's stem."""
    p = pathlib.Path(path).resolve()
    return p.stem if is_gguf(p) else p.name
