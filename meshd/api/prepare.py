"""Validated request bodies → what to generate (`Prepared`), or an `ApiError` saying why not.

This is where the API's policy lives: which OpenAI parameters are honoured, which are refused
(with a 400 naming them, never silently ignored), the defaults, the context-length check, and
how the `meshd` extension's speculative settings are layered over the node's.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec
import trio

from meshd.api.backend import MeshBackend
from meshd.api.errors import ApiError, bad_request, unsupported
from meshd.api.logprobs import MAX_CHAT_TOP_LOGPROBS, MAX_TEXT_LOGPROBS
from meshd.api.schemas import ChatCompletionRequest, ChatMessage, CommonFields, CompletionRequest
from meshd.api.tools import ToolPlan, family_of
from meshd.coord.coordinator import GenerationRequest
from meshd.model.errors import TokenizerError
from meshd.speculative.config import SpecConfig, SpecConfigError, resolve_spec_config
from meshd.speculative.grammar import (
    Constraint,
    GrammarError,
    grammar_tokenizer,
    json_schema_grammar,
)
from protocol.messages import Sampling

MAX_STOP_SEQUENCES = 16
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SEED_MASK = (1 << 64) - 1
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

Kind = Literal["chat", "text"]


@dataclass(frozen=True)
class Prepared:
    """A request ready to run."""

    kind: Kind
    model: str
    generation: GenerationRequest
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    # The grammar the output must follow (structured output), compiled for the model's
    # tokenizer by `with_grammar`; None: unconstrained.
    grammar: str | None = None
    # Tool calls: how the reply is read for calls and what grammar forces them; None: the
    # reply is text.
    tools: ToolPlan | None = None

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.generation.prompt)


def check_model(name: str, backend: MeshBackend) -> None:
    """404 unless `name` is the model the backend serves."""
    if name != backend.model_name:
        raise ApiError(
            404,
            f"The model `{name}` does not exist; this mesh serves `{backend.model_name}`",
            param="model",
            code="model_not_found",
        )


def prepare_chat(
    body: ChatCompletionRequest, backend: MeshBackend, spec_base: SpecConfig
) -> Prepared:
    """Check a chat request and render its prompt with the model's chat template."""
    check_model(body.model, backend)
    _refuse_common(body)
    _refuse_chat(body)
    if not body.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    calls = {c.id: c.function.name for m in body.messages for c in m.tool_calls or ()}
    messages = [_message(i, m, calls) for i, m in enumerate(body.messages)]
    tools = [msgspec.to_builtins(t) for t in body.tools or ()]
    plan = _tool_plan(body, backend)
    try:
        prompt = backend.tokenizer.encode_chat(messages, tools=tools or None)
    except TokenizerError as exc:
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
    limit = _max_tokens(body.max_tokens, body.max_completion_tokens)
    prepared = _prepared("chat", body, prompt, limit, backend, spec_base)
    grammar = _response_format(body.response_format)
    if grammar is not None and plan is not None:
        raise bad_request(
            "response_format and tool calls cannot both constrain one reply; set tool_choice "
            "to none or drop response_format",
            param="response_format",
        )
    return replace(prepared, grammar=grammar, tools=plan)


async def with_grammar(prepared: Prepared, backend: MeshBackend) -> Prepared:
    """`prepared` with its grammar's matcher attached to the generation (built in a worker
    thread: the first use of a tokenizer takes seconds for a large vocabulary)."""
    if prepared.grammar is None and prepared.tools is None:
        return prepared
    json_grammar, plan = prepared.grammar, prepared.tools
    tokenizer = backend.tokenizer

    def build() -> Constraint | None:
        if json_grammar is not None:
            return Constraint(grammar_tokenizer(tokenizer), json_grammar)
        assert plan is not None
        found = plan.grammar(tokenizer)
        if found is None:
            return None
        grammar, trigger = found
        return Constraint(grammar_tokenizer(tokenizer), grammar, trigger=trigger)

    try:
        constraint = await trio.to_thread.run_sync(build)
    except GrammarError as exc:
        param = "response_format" if json_grammar is not None else "tools"
        raise bad_request(f"cannot enforce this format: {exc}", param=param) from None
    return replace(prepared, generation=replace(prepared.generation, grammar=constraint))


def prepare_completion(
    body: CompletionRequest, backend: MeshBackend, spec_base: SpecConfig
) -> Prepared:
    """Check a text completion request and tokenize its prompt."""
    check_model(body.model, backend)
    _refuse_common(body)
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1")
    if body.echo not in (None, False):
        raise unsupported("echo", "echoing the prompt")
    if body.suffix not in (None, ""):
        raise unsupported("suffix", "a suffix (fill in the middle)")
    prompt = _completion_prompt(body.prompt, backend)
    limit = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    return _prepared("text", body, prompt, limit, backend, spec_base)


def _prepared(
    kind: Kind,
    body: CommonFields,
    prompt: list[int],
    max_tokens: int | None,
    backend: MeshBackend,
    spec_base: SpecConfig,
) -> Prepared:
    if body.stream_options is not None and not body.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    options = body.meshd
    logprobs = _logprobs(body)
    generation = GenerationRequest(
        prompt=prompt,
        max_tokens=_fit_context(
            len(prompt),
            max_tokens,
            backend.max_context_tokens,
            "messages" if kind == "chat" else "prompt",
        ),
        sampling=_sampling(body),
        spec=_spec(spec_base, options.speculative if options else None),
        eos_ids=frozenset() if options and options.ignore_eos else _eos(backend),
        mtp_depth=backend.mtp_depth,
        logprobs=logprobs,
    )
    return Prepared(
        kind=kind,
        model=body.model,
        generation=generation,
        stops=_stops(body.stop),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )


def _eos(backend: MeshBackend) -> frozenset[int]:
    return frozenset(backend.tokenizer.eos_ids)


# -- parameters -------------------------------------------------------------------------
def _tool_plan(body: ChatCompletionRequest, backend: MeshBackend) -> ToolPlan | None:
    """How the reply is read for calls: None when there are no tools or tool_choice is none
    (the tools are still shown to the model, as OpenAI does)."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"tools of type {tool.type!r}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    family = family_of(backend.tokenizer.chat_template)
    if family is None:
        raise unsupported(
            "tools", "tool calling with this model (its chat template does not render tools)"
        )
    functions = [msgspec.to_builtins(t.function) for t in tools]
    if choice in (None, "auto", "required"):
        forced = choice == "required"
    elif choice == "none":
        return None
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and choice["function"].get("name") in names
    ):
        forced = True
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    else:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": <one of tools>}}',
            param="tool_choice",
        )
    parallel = body.parallel_tool_calls is not False
    return ToolPlan(family, tuple(functions), parallel, forced)


def _response_format(fmt: Any) -> str | None:
    """The grammar `response_format` asks for: none for text, any JSON object for
    `json_object`, the schema's JSON for `json_schema` (`strict` refuses schema keywords the
    engine cannot enforce; without it they are ignored)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return json_schema_grammar(None)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise bad_request(
                    "response_format.json_schema must be an object with a name",
                    param="response_format.json_schema",
                )
            schema = spec.get("schema", {})
            strict = spec.get("strict")
            if not isinstance(schema, dict) or not isinstance(strict, bool | None):
                raise bad_request(
                    "response_format.json_schema: schema must be an object, strict a boolean",
                    param="response_format.json_schema",
                )
            return json_schema_grammar(schema, strict=bool(strict))
    except GrammarError as exc:
        raise bad_request(
            f"cannot enforce this JSON schema: {exc}",
            param="response_format.json_schema.schema",
            code="invalid_value",
        ) from None
    raise unsupported("response_format", f"a response format of type {kind!r}")


def _logprobs(body: CommonFields) -> int:
    """Alternatives to report per token, or -1 for no log-probs (chat: `logprobs` true with
    `top_logprobs`; completions: `logprobs` is the count)."""
    value = body.logprobs
    if isinstance(body, ChatCompletionRequest):
        if value is not None and not isinstance(value, bool):
            raise bad_request("logprobs must be true or false", param="logprobs")
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be within 0..{MAX_CHAT_TOP_LOGPROBS}",
                param="top_logprobs",
                code="invalid_value",
            )
        if not value:
            if top:
                raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
            return -1
        return top or 0
    if value is None:
        return -1
    if isinstance(value, bool) or not 0 <= value <= MAX_TEXT_LOGPROBS:
        raise bad_request(
            f"logprobs must be an integer within 0..{MAX_TEXT_LOGPROBS}",
            param="logprobs",
            code="invalid_value",
        )
    return value


def _max_tokens(max_tokens: int | None, max_completion_tokens: int | None) -> int | None:
    both = max_tokens is not None and max_completion_tokens is not None
    if both and max_tokens != max_completion_tokens:
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; set only one",
            param="max_completion_tokens",
        )
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def _fit_context(
    prompt_tokens: int, max_tokens: int | None, context: int, prompt_param: str
) -> int:
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", param="max_tokens", code="invalid_value")
    if prompt_tokens >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens, but the prompt has "
            f"{prompt_tokens} tokens (at least one must be left for the completion)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return context - prompt_tokens
    if prompt_tokens + max_tokens > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} "
            f"for the completion). Please reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _sampling(body: CommonFields) -> Sampling:
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(
            "temperature must be within 0..2", param="temperature", code="invalid_value"
        )
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request("top_p must be within (0, 1]", param="top_p", code="invalid_value")
    top_k = body.meshd.top_k if body.meshd and body.meshd.top_k is not None else 0
    if top_k < 0:
        raise bad_request(
            "top_k must be 0 (off) or more", param="meshd.top_k", code="invalid_value"
        )
    if body.seed is None:
        seed = secrets.randbits(64)  # unseeded requests differ from one another
    elif -(1 << 63) <= body.seed <= _SEED_MASK:
        seed = body.seed & _SEED_MASK  # OpenAI seeds are signed 64-bit; fold them onto u64
    else:
        raise bad_request("seed must fit in 64 bits", param="seed", code="invalid_value")
    return Sampling(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed)


def _spec(base: SpecConfig, request: Mapping[str, Any] | None) -> SpecConfig:
    if not request:
        return base
    defaults = SpecConfig()
    node = {
        key: value
        for key, value in msgspec.structs.asdict(base).items()
        if value != getattr(defaults, key)
    }
    try:
        # The node's settings sit at the config-file level; the request wins over them.
        return resolve_spec_config({}, node, {}, request)
    except SpecConfigError as err:
        raise bad_request(
            str(err), param=f"meshd.speculative.{err.key}", code="invalid_value"
        ) from None


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")
    if any(not s for s in stops):
        raise bad_request("stop sequences must not be empty", param="stop")
    return stops


# -- prompts ----------------------------------------------------------------------------
def _message(index: int, message: ChatMessage, calls: Mapping[str, str]) -> dict[str, Any]:
    """One message as chat templates take it: OpenAI's shape, with a call's arguments as an
    object (what templates serialise with `tojson`) and a tool result's function name."""
    where = f"messages[{index}]"
    if message.function_call is not None:
        raise unsupported(f"{where}.function_call", "the deprecated function calling API")
    role = _ROLES.get(message.role)
    if role is None:
        if message.role == "function":
            raise unsupported(f"{where}.role", "the 'function' role (use 'tool')")
        raise bad_request(
            f"{where}.role: unknown role {message.role!r}; use system, developer, user, "
            f"assistant or tool",
            param=f"{where}.role",
        )
    content = message.content
    if content is None:
        if role != "assistant":
            raise bad_request(f"{where}.content is required", param=f"{where}.content")
        content = ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise unsupported(f"{where}.content[{j}]", f"content of type {part.type!r}")
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": content}
    if message.tool_calls:
        if role != "assistant":
            raise bad_request(
                f"{where}.tool_calls: only assistant messages hold calls",
                param=f"{where}.tool_calls",
            )
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function)},
            }
            for call in message.tool_calls
        ]
    if role == "tool":
        if message.tool_call_id is None:
            raise bad_request(
                f"{where}.tool_call_id is required for a tool message",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = message.tool_call_id
        out["name"] = message.name or calls.get(message.tool_call_id, "")
    elif message.name is not None:
        out["name"] = message.name
    return out


def _arguments(function: Any) -> Any:
    # Templates (HF's convention) serialise arguments themselves; a string that is not JSON
    # is passed on as written.
    try:
        return json.loads(function.arguments)
    except ValueError:
        return function.arguments


def _completion_prompt(prompt: str | list[Any], backend: MeshBackend) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = backend.tokenizer.encode(prompt)
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = backend.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be within 0..{vocab - 1}", param="prompt")
        ids = list(prompt)
    elif prompt and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", "more than one prompt per request")
    else:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a list holding one of those",
            param="prompt",
        )
    if not ids:
        raise bad_request("the prompt is empty", param="prompt")
    return ids


# -- refusals ---------------------------------------------------------------------------
def _refuse_common(body: CommonFields) -> None:
    if body.n not in (None, 1):
        raise unsupported("n", "n > 1 (several choices per request)")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise unsupported(name, "a non-zero penalty")
    if body.logit_bias:
        raise unsupported("logit_bias", "logit bias")


def _refuse_chat(body: ChatCompletionRequest) -> None:
    if body.functions not in (None, []):
        raise unsupported("functions", "the deprecated function calling API (use tools)")
    if body.function_call not in (None, "none"):
        raise unsupported("function_call", "the deprecated function calling API (use tools)")
    if body.modalities not in (None, ["text"]):
        raise unsupported("modalities", "output other than text")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(body, name) is not None:
            raise unsupported(name, f"{name}")
