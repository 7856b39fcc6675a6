"""The response that runs a generation: one JSON object, or server-sent events.

A generation runs while a watcher waits for the client's `http.disconnect`: a client that goes
away before the end cancels its generation, and the coordinator then frees the session's KV on
every stage. A streamed response sends its headers only with its first event, so a backend
that refuses the request (429, 503) still answers with a proper status rather than an error
inside a 200 stream.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from meshd.api.backend import MeshBackend
from meshd.api.errors import SERVER_ERROR, ApiError
from meshd.api.logprobs import (
    ChatLogprobs,
    Scored,
    TextLogprobs,
    chat_logprobs,
    text_logprobs,
    token_bytes,
)
from meshd.api.metrics import ApiMetrics
from meshd.api.prepare import Prepared
from meshd.api.runner import Outcome, run_generation
from meshd.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    FunctionDelta,
    MeshdInfo,
    TextChoice,
    ToolCallDelta,
)

log = logging.getLogger(__name__)

JSON = "application/json"
CLIENT_GONE = "meshd.client_gone"  # scope key: the client disconnected before the end


class GenerationResponse(Response):
    """Runs the generation while the response is sent (streamed as SSE, or as one JSON)."""

    def __init__(
        self, backend: MeshBackend, metrics: ApiMetrics, prepared: Prepared, arrived_s: float
    ) -> None:
        super().__init__(status_code=200)
        self.backend = backend
        self.metrics = metrics
        self.prepared = prepared
        self.arrived_s = arrived_s
        prefix = "chatcmpl-" if prepared.kind == "chat" else "cmpl-"
        self.id = prefix + secrets.token_hex(12)
        self.created = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = self._stream if self.prepared.stream else self._whole
        error: Exception | None = None
        finished = False

        async def send_noting_end(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True  # a disconnect from now on is the normal end of the exchange
            await send(message)

        async def cancel_on_disconnect(cancel_scope: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                scope[CLIENT_GONE] = True  # for the metrics middleware
                cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, nursery.cancel_scope)
            try:
                await respond(send_noting_end)
            except Exception as exc:  # re-raised below, outside the nursery's exception group
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error

    async def _run(self, emit: Callable[[str, list[Scored]], Awaitable[None]]) -> Outcome:
        return await run_generation(
            self.backend, self.prepared, self.metrics, emit, arrived_s=self.arrived_s
        )

    async def _whole(self, send: Send) -> None:
        pieces: list[str] = []
        scored: list[Scored] = []

        async def collect(text: str, tokens: list[Scored]) -> None:
            pieces.append(text)
            scored.extend(tokens)

        try:
            outcome = await self._run(collect)
        except ApiError as exc:
            await send_error(send, exc)
            return
        text = "".join(pieces)
        info = MeshdInfo(outcome.telemetry)
        body: ChatCompletion | Completion
        if self.prepared.kind == "chat":
            message = (
                AssistantMessage(text or None, tool_calls=outcome.tool_calls)
                if outcome.tool_calls
                else AssistantMessage(text)
            )
            choice = ChatChoice(message, outcome.finish_reason, logprobs=self._chat_lp(scored))
            body = ChatCompletion(
                id=self.id, created=self.created, model=self.prepared.model, choices=[choice],
                usage=outcome.usage, meshd=info,
            )  # fmt: skip
        else:
            body = Completion(
                id=self.id, created=self.created, model=self.prepared.model,
                choices=[
                    TextChoice(text, outcome.finish_reason, logprobs=self._text_lp(scored, 0))
                ],
                usage=outcome.usage, meshd=info,
            )  # fmt: skip
        await send_whole(send, 200, msgspec.json.encode(body), {})

    async def _stream(self, send: Send) -> None:
        sse = _EventSender(send)
        # Text goes through a channel to a writer task, so the decode loop never waits on
        # the socket; a writer that falls behind sends what piled up as one event.
        texts_in, texts_out = trio.open_memory_channel[tuple[str, list[Scored]]](math.inf)
        outcome: Outcome | None = None
        failure: Exception | None = None

        async def emit(text: str, scored: list[Scored]) -> None:
            texts_in.send_nowait((text, scored))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_deltas, sse, texts_out)
            try:
                outcome = await self._run(emit)
            except Exception as exc:  # handled below, once the writer has sent all text
                failure = exc
            finally:
                texts_in.close()
        if isinstance(failure, ApiError):
            if not sse.started:
                await send_error(send, failure)
                return
            await sse.raw(failure.encode())  # OpenAI clients raise on an `error` event
            await sse.done()
            return
        if failure is not None:
            if not sse.started:
                raise failure
            log.error("generation failed mid-stream", exc_info=failure)
            error = ApiError(500, "internal server error", type=SERVER_ERROR, code="internal_error")
            await sse.raw(error.encode())
            await sse.done()
            return
        assert outcome is not None
        await self._finish_stream(sse, outcome)

    async def _write_deltas(
        self, sse: _EventSender, texts: trio.MemoryReceiveChannel[tuple[str, list[Scored]]]
    ) -> None:
        chat = self.prepared.kind == "chat"
        usage = self._usage_field()
        offset = 0  # characters sent so far (completions' text_offset)
        async for text, first in texts:
            pieces = [text]
            scored = list(first)
            with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
                while True:
                    more, more_scored = texts.receive_nowait()
                    pieces.append(more)
                    scored.extend(more_scored)
            delta = "".join(pieces)
            if chat and not sse.started:
                await sse.event(
                    self._chat_chunk(ChatDelta(role="assistant", content=""), usage=usage)
                )
            chunk = (
                self._chat_chunk(
                    ChatDelta(content=delta), usage=usage, logprobs=self._chat_lp(scored)
                )
                if chat
                else self._text_chunk(delta, usage=usage, logprobs=self._text_lp(scored, offset))
            )
            offset += len(delta)
            await sse.event(chunk)

    def _chat_lp(self, scored: list[Scored]) -> ChatLogprobs | None:
        if self.prepared.generation.logprobs < 0:
            return None
        return chat_logprobs(scored, token_bytes(self.backend.tokenizer))

    def _text_lp(self, scored: list[Scored], offset: int) -> TextLogprobs | None:
        if self.prepared.generation.logprobs < 0:
            return None
        return text_logprobs(scored, token_bytes(self.backend.tokenizer), offset)

    def _usage_field(self) -> msgspec.UnsetType | None:
        """Chunks carry `"usage": null` when a usage chunk will follow, else no usage key."""
        return None if self.prepared.include_usage else msgspec.UNSET

    async def _finish_stream(self, sse: _EventSender, outcome: Outcome) -> None:
        chat = self.prepared.kind == "chat"
        usage_field = self._usage_field()
        info = MeshdInfo(outcome.telemetry)
        if chat:
            if not sse.started:
                await sse.event(
                    self._chat_chunk(ChatDelta(role="assistant", content=""), usage=usage_field)
                )
            for index, call in enumerate(outcome.tool_calls):
                piece = ToolCallDelta(
                    index,
                    FunctionDelta(call.function.name, call.function.arguments),
                    id=call.id,
                    type="function",
                )
                await sse.event(self._chat_chunk(ChatDelta(tool_calls=[piece]), usage=usage_field))
            final: ChatCompletionChunk | Completion = self._chat_chunk(
                ChatDelta(), outcome.finish_reason, usage=usage_field, meshd=info
            )
        else:
            final = self._text_chunk("", outcome.finish_reason, usage=usage_field, meshd=info)
        await sse.event(final)
        if self.prepared.include_usage:
            await sse.event(self._usage_chunk(outcome))
        await sse.done()

    def _chat_chunk(
        self,
        delta: ChatDelta,
        finish: Any = None,
        *,
        usage: Any = msgspec.UNSET,
        meshd: Any = msgspec.UNSET,
        logprobs: ChatLogprobs | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.prepared.model,
            choices=[ChatChunkChoice(delta, finish, logprobs=logprobs)], usage=usage, meshd=meshd,
        )  # fmt: skip

    def _text_chunk(
        self,
        text: str,
        finish: Any = None,
        *,
        usage: Any = msgspec.UNSET,
        meshd: Any = msgspec.UNSET,
        logprobs: TextLogprobs | None = None,
    ) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.prepared.model,
            choices=[TextChoice(text, finish, logprobs=logprobs)], usage=usage, meshd=meshd,
        )  # fmt: skip

    def _usage_chunk(self, outcome: Outcome) -> ChatCompletionChunk | Completion:
        """The stream's last chunk when the client asked for usage: no choices, the usage."""
        kind = ChatCompletionChunk if self.prepared.kind == "chat" else Completion
        return kind(
            id=self.id, created=self.created, model=self.prepared.model, choices=[],
            usage=outcome.usage,
        )  # fmt: skip


class _EventSender:
    """Server-sent events: headers with the first event, `data: [DONE]` at the end."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def event(self, value: Any) -> None:
        await self.raw(msgspec.json.encode(value))

    async def raw(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # proxies must not buffer the stream
            ]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True}
        )

    async def done(self) -> None:
        await self.raw(b"[DONE]")
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_whole(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    """A complete JSON response."""
    raw = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    """An error response in OpenAI's shape."""
    await send_whole(send, error.status, error.encode(), error.headers)
