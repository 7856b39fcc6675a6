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
from concurrent.futures import Future
from typing import TYPE_CHECKING

from meshd.model.errors import MissingFile

if TYPE_CHECKING:  # imported when called: `meshd.model.checkpoint` pulls in torch
    from meshd.model.checkpoint import Checkpoint
    from meshd.model.gguf_model import GGUFModel
    from meshd.model.tokenizer import Tokenizer

GGUF_SUFFIX = ".gguf"

log = logging.getLogger(__name__)
# Tokenizers `prepare` is building, by the file's (resolved path, device, inode, size,
# mtime_ns): `open_tokenizer` takes its result once, so a changed file is built anew.
_prepared: dict[tuple[str, int, int, int, int], Future[Tokenizer]] = {}
_prepared_lock = threading.Lock()


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
    """Start, in a thread, what opening the GGUF file at `path` will need: the digests of its
    tensors (its model id; `meshd.model.digests` caches them) and its tokenizer (which
    `open_tokenizer` then takes). Nothing for a checkpoint directory.

    `meshd serve` calls it once the file checked out, so both run while torch imports (seconds:
    hashlib hashes without the GIL). Any error is left for the real open to raise.
    """
    if not is_gguf(path):
        return
    p = pathlib.Path(path)
    try:
        key = _file_key(p)
    except OSError:
        return
    future: Future[Tokenizer] = Future()
    with _prepared_lock:
        if key in _prepared:
            return
        _prepared[key] = future
    threading.Thread(target=_prepare, args=(p, future), name="model-prepare", daemon=True).start()


def _prepare(path: pathlib.Path, future: Future[Tokenizer]) -> None:
    from meshd.model.gguf_model import open_gguf

    try:
        model = open_gguf(path)  # the start-up check's parse, cached
        threading.Thread(target=_digests, args=(model,), name="model-digests", daemon=True).start()
        future.set_result(_build_tokenizer(path))
    except BaseException as exc:  # raised again by `open_tokenizer`, in its caller's thread
        future.set_exception(exc)


def _digests(model: GGUFModel) -> None:
    from meshd.model.digests import file_tensor_digests
    from meshd.model.errors import ModelError

    try:
        for shard in dict.fromkeys(t.path for t in model.tensors.values()):
            file_tensor_digests(shard, [t for t in model.tensors.values() if t.path == shard])
    except (ModelError, OSError) as exc:  # the model id's own hashing meets it again
        log.debug("hashing %s ahead of the start failed: %s", model.path, exc)


def _file_key(path: pathlib.Path) -> tuple[str, int, int, int, int]:
    stat = path.stat()
    return (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _build_tokenizer(path: pathlib.Path) -> Tokenizer:
    from meshd.model.gguf_tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(path)


def forget_prepared() -> None:
    """Drop what `prepare` built and no open took (a started daemon needs none of it)."""
    with _prepared_lock:
        _prepared.clear()


def open_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of the model at `path` (directory files, or GGUF metadata); one
    `prepare` built for this very file is taken from it."""
    if is_gguf(path):
        try:
            key = _file_key(pathlib.Path(path))
        except OSError:
            key = None
        with _prepared_lock:
            future = _prepared.pop(key, None) if key is not None else None
        if future is not None:
            return future.result()
        from meshd.model.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(pathlib.Path(path))
    from meshd.model.tokenizer import Tokenizer

    return Tokenizer.open(path)


def model_name(path: str | os.PathLike[str]) -> str:
    """A display name for the model at `path`: the directory's name, or the file's stem."""
    p = pathlib.Path(path).resolve()
    return p.stem if is_gguf(p) else p.name
