"""Tool calls: the official `openai` client against a tiny random model whose tokenizer has a
Hermes-style chat template written here. The model's own choices are noise, so every call
that comes back well-formed is the grammar's doing (`tool_choice` required or named forces
the call from the first token); the per-family parsers are checked on text directly."""

from __future__ import annotations

import json
import pathlib
import queue
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import tokenizers
import trio

from meshd.api.backend import open_local_backend
from meshd.api.openai import create_app
from meshd.api.server import serve_api
from meshd.api.tools import HERMES, LLAMA3, MISTRAL, Family, family_of
from meshd.bench.checkpoints import make_checkpoint
from meshd.model.builtin import builtin_model_dir
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.grammar import Constraint, GrammarError, grammar_tokenizer
from tests.api.conftest import MODEL, Served
from tests.api.test_openai_client import client

TINY = "tiny-tools"
HERMES_TEMPLATE = """
{%- if tools %}<|system|>
You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Reply with <tool_call>
{"name": <name>, "arguments": <args>}
</tool_call><|end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|assistant|>
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|end|>
{% elif message.role == "tool" %}<|user|>
<tool_response>
{{ message.content }}
</tool_response><|end|>
{% else %}<|{{ message.role }}|>
{{ message.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}
"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Clock", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def _serve(directory: pathlib.Path, out: queue.Queue[Any]) -> None:
    async def main() -> None:
        async with open_local_backend(directory, stages=2, model_name=TINY) as backend:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, create_app(backend))
                out.put((address.base_url, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException as exc:
        out.put(exc)
        raise


@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("tiny-tools")
    builtin = builtin_model_dir()
    config = json.loads((builtin / "tokenizer_config.json").read_text())
    if (builtin / "generation_config.json").is_file():
        shutil.copy(builtin / "generation_config.json", directory / "generation_config.json")
    # The call markers as special tokens, as in Qwen2.5: the grammar must name them by id.
    backend = tokenizers.Tokenizer.from_file(str(builtin / "tokenizer.json"))
    backend.add_special_tokens(["<tool_call>", "</tool_call>"])
    backend.save(str(directory / "tokenizer.json"))
    make_checkpoint(directory, vocab_size=backend.get_vocab_size(), max_position_embeddings=1024)
    config["chat_template"] = HERMES_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    out: queue.Queue[Any] = queue.Queue()
    thread = threading.Thread(target=_serve, args=(directory, out), daemon=True)
    thread.start()
    got = out.get(timeout=120)
    if isinstance(got, BaseException):
        raise got
    url, token, stop = got
    try:
        yield url
    finally:
        token.run_sync_soon(stop.set)
        thread.join(timeout=15)


def call(url: str, **kwargs: Any) -> Any:
    args = dict(model=TINY, messages=ASK, tools=TOOLS, max_tokens=120, seed=3) | kwargs
    return client(url).chat.completions.create(**args)


def assert_valid(calls: Any) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_forces_a_valid_call(tiny_url: str, temperature: float) -> None:
    got = call(tiny_url, tool_choice="required", parallel_tool_calls=False, temperature=temperature)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    assert_valid(choice.message.tool_calls)


def test_a_named_function_is_the_one_called(tiny_url: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    got = call(tiny_url, tool_choice=named, temperature=0.8)
    calls = got.choices[0].message.tool_calls
    assert_valid(calls)
    assert {c.function.name for c in calls} == {"get_time"}


def test_streamed_calls_equal_the_whole_answer(tiny_url: str) -> None:
    kwargs = dict(tool_choice="required", parallel_tool_calls=False, temperature=0.9, seed=8)
    whole = call(tiny_url, **kwargs).choices[0].message.tool_calls
    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in call(tiny_url, stream=True, **kwargs):
        if not chunk.choices:
            continue
        for piece in chunk.choices[0].delta.tool_calls or []:
            entry = parts.setdefault(piece.index, {"name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [parts[i] for i in sorted(parts)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


def test_a_tool_result_goes_back_through_the_template(tiny_url: str) -> None:
    first = call(tiny_url, tool_choice="required", parallel_tool_calls=False, temperature=0)
    made = first.choices[0].message.tool_calls[0]
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": '{"temperature": 21}'},
    ]
    got = call(tiny_url, messages=follow, tool_choice="none", max_tokens=8)
    assert got.choices[0].message.tool_calls is None
    assert got.choices[0].finish_reason in ("stop", "length")
    assert got.usage is not None and got.usage.prompt_tokens > first.usage.prompt_tokens


def test_bad_tool_requests_are_400_naming_the_parameter(tiny_url: str, served: Served) -> None:
    cases = [
        (tiny_url, TINY, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (tiny_url, TINY, {"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        # The built-in model's template does not render tools.
        (served.url, MODEL, {}, "tools"),
    ]  # fmt: skip
    for url, model, extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client(url).chat.completions.create(
                **(dict(model=model, messages=ASK, tools=TOOLS, max_tokens=4) | extra)
            )
        assert err.value.param == param


# -- the formats, on text ---------------------------------------------------------------
def test_each_family_parses_its_own_format() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    _, calls = LLAMA3.parse('<|python_tag|>{"name": "a", "parameters": {"x": 2}}', ["a"])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("a", {"x": 2})]
    _, calls = MISTRAL.parse(
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 3}}, {"name": "b", "arguments": {}}]'
    )
    assert [c.function.name for c in calls] == ["a", "b"]
    assert HERMES.parse("no calls here") == ("no calls here", [])
    # A marker family's model writing a bare JSON call of an offered function.
    _, calls = HERMES.parse('{"name": "a", "arguments": {"x": 4}}', ["a"])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("a", {"x": 4})]
    assert HERMES.parse('{"name": "zz", "arguments": {}}', ["a"])[1] == []
    _, calls = HERMES.parse('```json\n{"name": "a", "arguments": {}}\n```', ["a"])
    assert [c.function.name for c in calls] == ["a"]
    # Calls one per line, the last cut off by max_tokens; and a cut-off last block.
    _, calls = HERMES.parse(
        '{"name": "a", "arguments": {}}\n{"name": "a", "arguments": {}}\n{"na', ["a"]
    )
    assert [c.function.name for c in calls] == ["a", "a"]
    _, calls = HERMES.parse(
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    )
    assert [c.function.name for c in calls] == ["a"]
    assert LLAMA3.parse("{not json") == ("{not json", [])
    assert family_of("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert family_of("{{ '[TOOL_CALLS]' }} {{ tools }}") is MISTRAL
    assert family_of("{{ '<|python_tag|>' }} {{ tools }}") is LLAMA3
    assert family_of("{{ messages }}") is None


@pytest.mark.parametrize(
    "family,text",
    [
        (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
        (LLAMA3, '{"name": "get_time", "parameters": {"zone": "PST"}}'),
        (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius", "days": 2}}]'),
    ],
)  # fmt: skip
def test_each_familys_grammar_takes_its_calls_and_refuses_others(family: Family, text: str) -> None:
    tokenizer = Tokenizer.open(builtin_model_dir())
    functions = [t["function"] for t in TOOLS]
    grammar = family.grammar(functions, True, tokenizer, after_marker=False)
    ok = Constraint(grammar_tokenizer(tokenizer), grammar)
    ok.commit(tokenizer.encode(text, add_special_tokens=False))
    assert ok.stopped or ok.window_masks([], [], []) is not None
    _, calls = family.parse(text, ["get_time", "get_weather"])
    assert calls and all(c.function.name in SCHEMAS for c in calls)
    bad = Constraint(grammar_tokenizer(tokenizer), grammar)
    with pytest.raises(GrammarError):
        bad.commit(tokenizer.encode(text.replace("get_time", "get_tame"), add_special_tokens=False))


@pytest.mark.parametrize(
    "text,allowed",
    [
        ("It is sunny in Rome today.", True),
        ("```python\nprint('hi')\n```", True),
        ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>', True),
        ('```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```', True),
        ('{"name": "get_time", "arguments": {"zone": "UTC"}}', True),
        # A call of a function not offered, in the forms the parser reads: refused.
        ('```json\n{"name": "find_articles", "arguments": {"zone": "UTC"}}\n```', False),
        ('{"name": "find_articles", "arguments": {}}', False),
    ],
)  # fmt: skip
def test_an_auto_reply_is_prose_or_calls_of_offered_functions(text: str, allowed: bool) -> None:
    tokenizer = Tokenizer.open(builtin_model_dir())
    functions = [t["function"] for t in TOOLS]
    grammar = HERMES.auto_grammar(functions, True, tokenizer) or pytest.fail()
    constraint = Constraint(grammar_tokenizer(tokenizer), grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if allowed:
        constraint.commit(ids)
    else:
        with pytest.raises(GrammarError):
            constraint.commit(ids)
