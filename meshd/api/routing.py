"""Which model a request names, and where it runs: here, relayed to a node that serves it, or
nowhere (404 listing the models the mesh serves).

A `ModelCatalog` is what the API needs of a mesh that may serve several models: the backends
this node coordinates itself, every model the mesh serves, and a way to relay a request to a
node that holds a model this one does not. `LocalModels` is the catalog of backends in one
process (tests, benchmarks, `meshd demo`). A model is named by its name (directory or GGUF file name,
`meshd-builtin`) or by its model id (the alias `meshctl status` prints).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshd.api.backend import MeshBackend
from meshd.api.errors import ApiError

# Set on a request one node relays to another: the holder runs it or fails it, never relays it
# again (two nodes with stale views must not pass a request back and forth).
RELAYED_HEADER = "x-meshd-relayed"


@dataclass(frozen=True)
class ServedModel:
    """One model the mesh serves, as `/v1/models` lists it."""

    name: str
    model_id: str = ""
    max_context_tokens: int | None = None


class RelayCut(Exception):
    """A relayed response's body ended before the holder finished it (the holder was lost)."""


@dataclass
class RelayedResponse:
    """A holder's answer to a relayed request: status, headers, then the body as it comes
    (`RelayCut` if it ends early)."""

    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]


class ModelCatalog(Protocol):
    """The models the API can answer for."""

    def local(self, name: str) -> MeshBackend | None:
        """The backend of `name` (name or id) when this node coordinates it, else None."""
        ...

    def served(self) -> Sequence[ServedModel]:
        """Every model the mesh serves now (this node's first)."""
        ...

    async def relay(self, name: str, method: str, path: str, body: bytes) -> RelayedResponse | None:
        """Run the request on a node that serves `name`; None when no node does."""
        ...


class LocalModels:
    """The catalog of backends in this process (tests, benchmarks, `meshd demo`): nothing to
    relay."""

    def __init__(self, backends: Sequence[MeshBackend]) -> None:
        self.backends = list(backends)

    def local(self, name: str) -> MeshBackend | None:
        return next((b for b in self.backends if b.model_name == name), None)

    def served(self) -> Sequence[ServedModel]:
        return [
            ServedModel(b.model_name, max_context_tokens=b.max_context_tokens)
            for b in self.backends
        ]

    async def relay(self, name: str, method: str, path: str, body: bytes) -> RelayedResponse | None:
        return None


def unknown_model(name: str, served: Sequence[ServedModel]) -> ApiError:
    """404 naming the models the mesh serves (OpenAI's `model_not_found`)."""
    names = ", ".join(f"`{m.name}`" for m in served) or "no model at the moment"
    return ApiError(
        404,
        f"The model `{name}` does not exist; this mesh serves {names}",
        param="model",
        code="model_not_found",
    )


def find_served(name: str, served: Sequence[ServedModel]) -> ServedModel | None:
    """The served model `name` names (its name, or its model id)."""
    for m in served:
        if name in (m.name, m.model_id):
            return m
    return None
