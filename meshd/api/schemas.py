"""Request and response bodies of the OpenAI-compatible API, as msgspec structs.

Requests forbid unknown fields, so a parameter meshd does not know is refused with a 400 naming
it rather than silently ignored. Parameters OpenAI defines but meshd does not implement are
declared (as `Any`) only so that `prepare.py` can refuse them by name when they ask for
something other than the default. Responses follow OpenAI's field names; meshd's own data sits
under the `meshd` key.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from meshd.api.logprobs import ChatLogprobs, TextLogprobs
from meshd.api.tools import ToolCall
from meshd.speculative.telemetry import SpecTelemetry

# -- requests ---------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`stream_options`: only `include_usage` is defined."""

    include_usage: bool = False


class MeshdOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `meshd` extension key of a request."""

    # Request-level speculative settings (keys of SpecConfig); they win over the node's.
    speculative: dict[str, Any] | None = None
    top_k: int | None = None
    # Keep generating through end-of-sequence tokens until max_tokens (benchmarks, tests).
    ignore_eos: bool = False


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content; only `text` parts are served."""

    type: str
    text: str | None = None


class FunctionDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One entry of `tools` (only `function` tools exist in chat completions)."""

    type: str
    function: FunctionDef


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One message of a chat."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Declared to refuse by name: the deprecated `functions` API.
    function_call: Any = None
    refusal: Any = None


class CommonFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    meshd: MeshdOptions | None = None
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    # Refused unless they ask for the default (see prepare.py).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # Chat: a bool (with `top_logprobs` 0..20); completions: the number of alternatives 0..5.
    logprobs: bool | int | None = None


class ChatCompletionRequest(CommonFields, frozen=True, kw_only=True):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # Accepted and ignored: bookkeeping fields of OpenAI's service.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    top_logprobs: int | None = None
    # Checked in prepare.py: text, json_object or json_schema.
    response_format: Any = None
    tools: list[ToolDef] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": …}}.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Refused unless they ask for the default.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class CompletionRequest(CommonFields, frozen=True, kw_only=True):
    """`POST /v1/completions`."""

    prompt: str | list[Any]
    # Refused unless they ask for the default.
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


# -- responses --------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    """Of the prompt's tokens, how many the stages took from their prefix cache (as OpenAI
    reports prompt caching)."""

    cached_tokens: int = 0


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class MeshdInfo(msgspec.Struct, frozen=True):
    """What meshd adds to a response: the speculative decoding telemetry."""

    speculative: SpecTelemetry


class ModelCard(msgspec.Struct, frozen=True):
    """One entry of `/v1/models`."""

    id: str
    created: int
    owned_by: str = "meshd"
    object: str = "model"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, frozen=True):
    """`GET /v1/models`."""

    data: list[ModelCard]
    object: str = "list"


FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantMessage(msgspec.Struct, frozen=True):
    """The generated message: text, or (with tools) calls and any text before them."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, frozen=True):
    """A choice of a chat completion (meshd always returns one)."""

    message: AssistantMessage
    finish_reason: FinishReason
    index: int = 0
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A non-streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    meshd: MeshdInfo
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class FunctionDelta(msgspec.Struct, frozen=True):
    """A streamed call's function: its name in the call's first chunk, arguments after."""

    name: str | UnsetType = UNSET
    arguments: str = ""


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of a streamed call (`delta.tool_calls[]`); `index` says which call."""

    index: int
    function: FunctionDelta
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatDelta(msgspec.Struct, frozen=True):
    """What one chunk adds to the message."""

    content: str | UnsetType = UNSET
    role: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, frozen=True):
    """A choice of a chat completion chunk."""

    delta: ChatDelta
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One server-sent event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | UnsetType | None = UNSET
    meshd: MeshdInfo | UnsetType = UNSET


class TextChoice(msgspec.Struct, frozen=True):
    """A choice of a text completion (or of one streamed chunk)."""

    text: str
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: TextLogprobs | None = None


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A text completion, or one chunk of a streamed one (same object type, as in OpenAI)."""

    id: str
    created: int
    model: str
    choices: list[TextChoice]
    object: str = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | UnsetType | None = UNSET
    meshd: MeshdInfo | UnsetType = UNSET
