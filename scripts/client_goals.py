"""Issue 31's client goals on a real GGUF model through the official `openai` client.

    python scripts/client_goals.py [MODEL.gguf] [--only tools|json]

Serves the model in-process (one stage), then:

- tools: 20 tool-call prompts (single, parallel, `required`, named, a follow-up after a tool
  result), each streamed and not, greedy. Counts replies whose `tool_calls` are well-formed
  with arguments valid for the function's schema, and streamed/whole agreement.
- json: 20 JSON schemas (nested objects, arrays, enums, numbers, required keys) × greedy and
  sampled: counts answers that parse and validate, checks speculation on equals off for the
  same seed, and the decode speed with a schema against the same request without one.

Prints one JSON object. A benchmark, not a test: the model's quality is part of the result.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import time
from typing import Any

import jsonschema
import openai
import trio

from meshd.api.backend import open_local_backend
from meshd.api.openai import create_app
from meshd.api.server import serve_api

DEFAULT = os.path.expanduser("~/.cache/meshd/models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
    "required": ["query"],
}
EMAIL = {
    "type": "object",
    "properties": {
        "to": {"type": "string"},
        "subject": {"type": "string"},
        "body": {"type": "string"},
    },
    "required": ["to", "subject", "body"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email", "parameters": EMAIL}},
]  # fmt: skip
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def _follow_up(question: str, name: str, args: dict[str, Any], result: str) -> list[Any]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }
    return [
        *_user(question),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "user", "content": "Now also check the weather in Rome, in celsius."},
    ]  # fmt: skip


TOOL_PROMPTS: list[tuple[str, list[Any], Any, bool]] = [
    ("single", _user("What's the weather like in Paris right now? Use celsius."), "auto", True),
    ("single", _user("Search the web for the latest Python release."), "auto", True),
    ("single", _user("Send an email to bob@example.com saying the build is green."), "auto", True),
    ("single", _user("How warm is it in Tokyo, in fahrenheit?"), "auto", True),
    ("single", _user("Find articles about speculative decoding, at most 5."), "auto", True),
    ("single", _user("Email alice@example.com the subject 'lunch' and body 'noon?'."), "auto", True),
    ("single", _user("Is it raining in London? Use celsius."), "auto", True),
    ("single", _user("Look up the population of Canada on the web."), "auto", True),
    ("parallel", _user("What's the weather in Paris and in Berlin, in celsius?"), "auto", True),
    ("parallel", _user("Get the weather for Madrid and search the web for Madrid museums."), "auto", True),
    ("parallel", _user("Check the weather in Oslo and Lima (celsius)."), "auto", True),
    ("parallel", _user("Search the web for 'trio python' and for 'starlette'."), "auto", True),
    ("required", _user("Tell me something about Lisbon."), "required", True),
    ("required", _user("I need to reach my boss carol@example.com about the outage."), "required", False),
    ("required", _user("What do you know about rust async?"), "required", True),
    ("named", _user("Paris."), {"type": "function", "function": {"name": "get_weather"}}, True),
    ("named", _user("quantum computing"), {"type": "function", "function": {"name": "search_web"}}, True),
    ("named", _user("Tell dave@example.com hi."), {"type": "function", "function": {"name": "send_email"}}, True),
    ("follow-up", _follow_up("Weather in Paris?", "get_weather", {"city": "Paris", "unit": "celsius"}, '{"temp": 18, "sky": "clear"}'), "auto", True),
    ("follow-up", _follow_up("Search for meshd.", "search_web", {"query": "meshd"}, '{"results": ["github.com/meshd"]}'), "auto", True),
]  # fmt: skip

JSON_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}}, "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}}}, "required": ["colors"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "warn", "fail"]}, "code": {"type": "integer"}}, "required": ["status", "code"]},
    {"type": "object", "properties": {"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}}, "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}, "maxItems": 4}}, "required": ["points"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}, "required": ["title", "tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string"}}, "required": ["ok"]},
    {"type": "object", "properties": {"lang": {"enum": ["python", "rust", "go"]}, "version": {"type": "string"}}, "required": ["lang", "version"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}, "maxItems": 3}}, "required": ["matrix"]},
    {"type": "object", "properties": {"min": {"type": "integer", "minimum": 0}, "max": {"type": "integer", "maximum": 100}}, "required": ["min", "max"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "authors": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "year", "authors"]}}, "required": ["book"]},
    {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5}}, "required": ["steps"]},
    {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"}, "name": {"type": "string"}}, "required": ["kind", "legs", "name"]},
    {"type": "object", "properties": {"event": {"type": "string"}, "date": {"type": "string"}, "attendees": {"type": "integer"}}, "required": ["event", "date", "attendees"]},
    {"type": "object", "properties": {"config": {"type": "object", "properties": {"debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}}, "required": ["debug", "level"]}}, "required": ["config"]},
    {"type": "object", "properties": {"function": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}}, "returns": {"type": "string"}}, "required": ["function", "args", "returns"]},
    {"type": "object", "properties": {"temperature": {"type": "number"}, "unit": {"enum": ["C", "F"]}, "city": {"type": "string"}}, "required": ["temperature", "unit", "city"]},
]  # fmt: skip


def _serve(path: str, out: queue.Queue[Any]) -> None:
    async def main() -> None:
        async with open_local_backend(path, stages=1) as backend:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_api, create_app(backend))
                out.put(
                    (address.base_url, backend.model_name, trio.lowlevel.current_trio_token(), stop)
                )
                await stop.wait()
                nursery.cancel_scope.cancel()

    trio.run(main)


def _valid_calls(calls: Any) -> bool:
    try:
        for c in calls or []:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS_BY_NAME[c["name"]])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return bool(calls)


def _streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None]:
    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if chunk.choices:
            for piece in chunk.choices[0].delta.tool_calls or []:
                entry = parts.setdefault(piece.index, {"name": "", "arguments": ""})
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    return [parts[i] for i in sorted(parts)], finish


def tools_goal(
    client: openai.OpenAI, model: str, first: int = 0, last: int | None = None
) -> dict[str, Any]:
    rows = []
    for kind, messages, choice, parallel in TOOL_PROMPTS[first:last]:
        kwargs = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, temperature=0, max_tokens=200)  # fmt: skip
        started = time.perf_counter()
        whole = client.chat.completions.create(**kwargs)
        seconds = time.perf_counter() - started
        msg = whole.choices[0].message
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}
            for c in msg.tool_calls or []
        ]
        streamed, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        rows.append({
            "kind": kind, "finish": whole.choices[0].finish_reason, "calls": calls,
            "valid": _valid_calls(calls) and whole.choices[0].finish_reason == "tool_calls",
            "streamed_agrees": streamed == calls and finish == whole.choices[0].finish_reason,
            "content": (msg.content or "")[:120], "seconds": round(seconds, 2),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {
        "prompts": len(rows),
        "valid_tool_calls": sum(r["valid"] for r in rows),
        "streamed_agrees": sum(r["streamed_agrees"] for r in rows),
        # Prompts that need two calls (parallel_tool_calls=true): how many got two or more.
        "parallel_prompts": sum(r["kind"] == "parallel" for r in rows),
        "parallel_with_2_calls": sum(
            r["kind"] == "parallel" and len(r["calls"]) >= 2 for r in rows
        ),
        "rows": rows,
    }


def json_goal(client: openai.OpenAI, model: str) -> dict[str, Any]:
    rows = []
    for i, schema in enumerate(JSON_SCHEMAS):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
        }
        ask = [
            {
                "role": "user",
                "content": f"Give an example JSON object for this schema: {json.dumps(schema)}",
            }
        ]
        for temperature in (0.0, 0.8):
            texts = {}
            for strategy in ("auto", "disabled"):
                started = time.perf_counter()
                got = client.chat.completions.create(
                    model=model,
                    messages=ask,
                    response_format=fmt,
                    temperature=temperature,
                    seed=7,
                    max_tokens=300,
                    extra_body={"meshd": {"speculative": {"strategy": strategy}}},
                )  # type: ignore[call-overload]
                texts[strategy] = (
                    got.choices[0].message.content or "",
                    time.perf_counter() - started,
                    got.usage.completion_tokens if got.usage else 0,
                )
            text = texts["auto"][0]
            try:
                jsonschema.validate(json.loads(text), schema)
                valid = True
            except (ValueError, jsonschema.ValidationError):
                valid = False
            rows.append(
                {
                    "schema": i,
                    "temperature": temperature,
                    "valid": valid,
                    "spec_equals_plain": text == texts["disabled"][0],
                    "tokens": texts["auto"][2],
                    "text": text[:160],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {
        "answers": len(rows),
        "valid": sum(r["valid"] for r in rows),
        "spec_equals_plain": sum(r["spec_equals_plain"] for r in rows),
        "rows": rows,
    }


def speed_goal(client: openai.OpenAI, model: str, rounds: int = 3) -> dict[str, Any]:
    """Decode speed (the telemetry's decode tokens/s, prefill excluded) of one request with
    and without a schema, speculation off, alternating rounds; medians."""
    samples: dict[str, list[float]] = {"plain": [], "schema": []}
    for _ in range(rounds):
        speed: dict[str, Any] = {}
        ask = [{"role": "user", "content": "Describe a person as JSON with name, age and hobbies."}]
        fmt = {
            "type": "json_schema",
            "json_schema": {
                "name": "p",
                "schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "age": {"type": "integer"},
                        "hobbies": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["name", "age", "hobbies"],
                },
            },
        }
        for label, extra in (("plain", {}), ("schema", {"response_format": fmt}), ("plain2", {})):
            started = time.perf_counter()
            got = client.chat.completions.create(
                model=model,
                messages=ask,
                max_tokens=64,
                temperature=0,
                extra_body={
                    "meshd": {
                        "ignore_eos": label != "schema",
                        "speculative": {"strategy": "disabled"},
                    }
                },
                **extra,
            )  # type: ignore[call-overload]
            tokens = got.usage.completion_tokens if got.usage else 0
            speed[label] = {
                "tokens": tokens,
                "seconds": round(time.perf_counter() - started, 2),
                "meshd": (got.model_extra or {})
                .get("meshd", {})
                .get("speculative", {})
                .get("decode_tok_per_s"),
            }
        for label in ("plain", "schema"):
            if speed[label]["meshd"]:
                samples[label].append(speed[label]["meshd"])
    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    ratio = medians["schema"] / medians["plain"] if len(medians) == 2 else None
    return {"decode_tok_per_s": samples, "median": medians, "schema_over_plain": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=DEFAULT)
    parser.add_argument("--only", choices=["tools", "json", "speed"])
    parser.add_argument("--first-prompt", type=int, default=0, help="skip the tool prompts before")
    parser.add_argument("--end-prompt", type=int, help="stop before this tool prompt")
    args = parser.parse_args()
    out: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_serve, args=(args.model, out), daemon=True).start()
    url, model, token, stop = out.get(timeout=600)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    result: dict[str, Any] = {"model": os.path.basename(args.model)}
    if args.only in (None, "tools"):
        result["tools"] = tools_goal(client, model, args.first_prompt, args.end_prompt)
    if args.only in (None, "json"):
        result["json"] = json_goal(client, model)
    if args.only in (None, "speed"):
        result["speed"] = speed_goal(client, model)
    token.run_sync_soon(stop.set)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
