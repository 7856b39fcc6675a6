"""`ArtifactServer`: a node's answers on `ARTIFACT_STREAM`, from the files it holds (a full
checkpoint directory, or the tensors a `mesh:ID` node fetched and verified)."""

from __future__ import annotations

import logging
import os
import pathlib
from typing import TYPE_CHECKING

from meshd.model.checkpoint import Checkpoint
from meshd.model.errors import ModelError
from meshd.model.manifest import store_of
from protocol import artifacts
from protocol.artifacts import (
    ArtifactKind,
    ArtifactRefusal,
    ChunkReply,
    ChunkRequest,
    ManifestReply,
    ManifestRequest,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class ArtifactServer:
    """Answers manifest and chunk requests from the files this node holds (and only those)."""

    def __init__(self, checkpoint: Checkpoint, name: str = "") -> None:
        self.checkpoint = checkpoint
        self.name = name  # what this node's API calls the model (sent with the manifest)
        self._manifest: tuple[str, bytes, artifacts.Manifest] | None = None
        self._unavailable = ""
        self.chunks_served = 0

    def _table(self) -> tuple[str, bytes, artifacts.Manifest] | None:
        if self._manifest is None and not self._unavailable:
            try:
                store = store_of(self.checkpoint)
                if store is not None:
                    self._manifest = (store.model_id, store.manifest_bytes, store.manifest)
                else:
                    self._manifest = self.checkpoint.manifest
            except ModelError as exc:
                self._unavailable = str(exc)
        return self._manifest

    def _locate(self, index: int) -> tuple[pathlib.Path, int, int] | None:
        """(path, offset, nbytes) of artifact `index` if this node holds it."""
        table = self._table()
        assert table is not None
        artifact = table[2].artifacts[index]
        checkpoint = self.checkpoint
        store = store_of(checkpoint)
        if store is not None:
            if not store.is_held(index):
                return None
            return store.path_of(index), store.data_offset(index), artifact.nbytes
        if artifact.kind == ArtifactKind.FILE:
            if table[2].format == "gguf":  # byte ranges of the GGUF file
                return self._gguf_files.get(artifact.name)
            return checkpoint.directory / artifact.name, 0, artifact.nbytes
        info = checkpoint.tensors.get(artifact.name)
        return (info.path, info.offset, info.nbytes) if info is not None else None

    @property
    def _gguf_files(self) -> dict[str, tuple[pathlib.Path, int, int]]:
        from meshd.model.gguf_checkpoint import GGUFCheckpoint

        assert isinstance(self.checkpoint, GGUFCheckpoint)
        return self.checkpoint.file_locations

    def prepare(self) -> None:
        """(blocking) What `answer` reads before its first reply: the manifest, and a GGUF
        holder's file locations (its shards' headers parsed: seconds for a large vocabulary).
        Called in a worker thread before serving, so the first request never stalls the
        node's trio loop (its lanes, gossip and pings)."""
        table = self._table()
        if table is not None and table[2].format == "gguf" and store_of(self.checkpoint) is None:
            log.debug("serving %d file artifacts of a GGUF file", len(self._gguf_files))

    def answer(
        self, message: ManifestRequest | ChunkRequest
    ) -> ManifestReply | ChunkReply | ArtifactRefusal:
        """(blocking: reads the file) The reply to one request."""
        table = self._table()
        rid = message.request_id
        if table is None:
            return ArtifactRefusal(rid, "unknown_model", self._unavailable[:200])
        model_id, data, manifest = table
        if isinstance(message, ManifestRequest):
            if not model_id.startswith(message.model_prefix):
                return ArtifactRefusal(rid, "unknown_model", f"this node holds {model_id}")
            return ManifestReply(rid, model_id, data, self.name)
        if message.model_id != model_id:
            return ArtifactRefusal(rid, "unknown_model", f"this node holds {model_id}")
        if message.index >= len(manifest.artifacts):
            return ArtifactRefusal(rid, "bad_range", "no such artifact")
        if message.offset + message.length > manifest.artifacts[message.index].nbytes:
            return ArtifactRefusal(rid, "bad_range", "beyond the artifact's end")
        where = self._locate(message.index)
        if where is None:
            return ArtifactRefusal(rid, "not_held", "")
        path, offset, _nbytes = where
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                chunk = os.pread(fd, message.length, offset + message.offset)
            finally:
                os.close(fd)
        except OSError as exc:
            return ArtifactRefusal(rid, "unreadable", (exc.strerror or str(exc))[:200])
        if len(chunk) != message.length:
            return ArtifactRefusal(rid, "unreadable", "the file is shorter than its manifest")
        self.chunks_served += 1
        return ChunkReply(rid, chunk)
