"""Open a model from what `--model` names: a checkpoint directory or a GGUF file.

A directory is a Hugging Face checkpoint (`Checkpoint`, `Tokenizer.open`); a file ending in
`.gguf` is a llama.cpp/Ollama/LM Studio model file (`GGUFCheckpoint`, its metadata's
tokenizer). Callers use these two functions instead of the classes, so every command that takes
`--model DIR` takes `--model FILE.gguf` too.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING

from meshd.model.errors import MissingFile

if TYPE_CHECKING:  # imported when called: `meshd.model.checkpoint` pulls in torch
    from meshd.model.checkpoint import Checkpoint
    from meshd.model.tokenizer import Tokenizer

GGUF_SUFFIX = ".gguf"


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
