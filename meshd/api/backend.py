"""What the HTTP layer needs of the mesh: a small backend interface and a local implementation.

The OpenAI endpoint turns requests into `GenerationRequest`s and hands them to a `MeshBackend`.
The daemon implements the interface for the real mesh (planning, recovery); here lives
`LocalPipelineBackend`, which runs the in-process loopback pipeline (real lanes, real stage
hosts, one coordinator) — used by tests, benchmarks and `meshd demo`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import AsyncIterator
from typing import Protocol

from meshd.coord.coordinator import (
    GenerationRequest,
    GenerationResult,
    OnTokens,
    RouteFailed,
    StageOverloaded,
)
from meshd.coord.local import LocalPipeline, open_local_pipeline
from meshd.model.builtin import builtin_model_dir
from meshd.model.files import open_tokenizer
from meshd.model.tokenizer import Tokenizer
from meshd.node.models import display_name
from protocol.messages import DType


class ServiceUnavailable(Exception):
    """The mesh cannot serve now (no plan fits, a stage died without a spare): HTTP 503."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Overloaded(Exception):
    """Too many requests in flight; the client should retry later: HTTP 429."""

    def __init__(self, message: str = "too many requests in flight", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MeshBackend(Protocol):
    """One model served by the mesh, as the API sees it.

    Declared as read-only properties so plain attributes and properties both satisfy it.
    """

    @property
    def model_name(self) -> str:
        """What `/v1/models` lists and requests must name."""
        ...

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer and chat template."""
        ...

    @property
    def mtp_depth(self) -> int:
        """MTP depths the model has (0: none)."""
        ...

    @property
    def max_context_tokens(self) -> int:
        """Longest prompt + completion the model serves, in tokens."""
        ...

    async def generate(self, request: GenerationRequest, on_tokens: OnTokens) -> GenerationResult:
        """Generate, reporting committed tokens; raise `Overloaded` or `ServiceUnavailable`."""
        ...


class LocalPipelineBackend:
    """`MeshBackend` over an in-process pipeline; fails fast (no recovery, no re-planning)."""

    def __init__(
        self,
        pipeline: LocalPipeline,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_concurrent_requests: int = 8,
        retry_after_s: float = 1.0,
    ) -> None:
        if max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.model_name = model_name
        config = pipeline.checkpoint.config
        self.mtp_depth = config.num_mtp_layers
        self.max_context_tokens = config.max_position_embeddings
        self.max_concurrent_requests = max_concurrent_requests
        self.retry_after_s = retry_after_s
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Generations running now."""
        return self._in_flight

    async def generate(self, request: GenerationRequest, on_tokens: OnTokens) -> GenerationResult:
        """Run `request` on the pipeline's route (see `MeshBackend.generate`)."""
        if self._in_flight >= self.max_concurrent_requests:
            raise Overloaded(
                f"{self._in_flight} requests in flight (limit {self.max_concurrent_requests})",
                self.retry_after_s,
            )
        self._in_flight += 1
        try:
            pipe = self.pipeline
            return await pipe.coordinator.generate(pipe.route, request, on_tokens)
        except StageOverloaded as exc:
            # A stage refused the session (sessions, queue or KV memory full): 429, retry later.
            raise Overloaded(str(exc), exc.retry_after_s) from exc
        except RouteFailed as exc:
            # A local pipeline has no spare node to re-plan onto: tell the client to retry.
            raise ServiceUnavailable(f"pipeline failed: {exc}", self.retry_after_s) from exc
        finally:
            self._in_flight -= 1


@contextlib.asynccontextmanager
async def open_local_backend(
    model_dir: str | os.PathLike[str] | None = None,
    stages: int = 2,
    *,
    model_name: str | None = None,
    rtt_s: float = 0.0,
    wire_dtype: DType = "f32",
    max_concurrent_requests: int = 8,
    quantization: str = "none",
) -> AsyncIterator[LocalPipelineBackend]:
    """Start a local pipeline of `stages` on `model_dir` (default: the built-in model).

    The model name defaults to `meshd-builtin` for the built-in model, else the directory name.
    """
    directory = pathlib.Path(model_dir) if model_dir is not None else builtin_model_dir()
    if model_name is None:
        model_name = display_name("" if model_dir is None else str(directory))
    tokenizer = open_tokenizer(directory)
    async with open_local_pipeline(
        directory,
        stages,
        rtt_s=rtt_s,
        wire_dtype=wire_dtype,
        eos_ids=frozenset(tokenizer.eos_ids),
        quantization=quantization,
    ) as pipeline:
        yield LocalPipelineBackend(
            pipeline,
            tokenizer,
            model_name=model_name,
            max_concurrent_requests=max_concurrent_requests,
        )
