"""Structured output through the official `openai` client: `response_format` json_object and
json_schema, enforced by grammar masks on the built-in model behind a 2-stage pipeline."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL, Served
from tests.api.test_openai_client import client

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays_and_enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
            "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
        },
        "required": ["tags", "sizes"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 100},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["score", "count", "ok"],
        "additionalProperties": False,
    },
}  # fmt: skip


def ask(served: Served, schema: dict[str, Any], **kwargs: Any) -> Any:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    return client(served.url).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=300, response_format=fmt, **kwargs  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_parse_and_validate(
    served: Served, name: str, temperature: float
) -> None:
    schema = SCHEMAS[name]
    got = ask(served, schema, temperature=temperature, seed=5)
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content or ""), schema)


def test_speculation_on_equals_off_for_the_same_seed(served: Served) -> None:
    schema = SCHEMAS["nested"]
    answers = {
        strategy: ask(
            served,
            schema,
            temperature=0.9,
            seed=21,
            extra_body={"meshd": {"speculative": {"strategy": strategy}}},
        )
        .choices[0]
        .message.content
        for strategy in ("disabled", "ngram-simple", "auto")
    }
    assert len(set(answers.values())) == 1, answers


def test_streamed_equals_whole(served: Served) -> None:
    schema = SCHEMAS["arrays_and_enums"]
    whole = ask(served, schema, temperature=0.7, seed=9).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in ask(served, schema, temperature=0.7, seed=9, stream=True)
        if chunk.choices
    )
    assert streamed == whole


def test_json_object_gives_an_object(served: Served) -> None:
    got = client(served.url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].message.content or ""), dict)
    else:  # out of tokens mid-object: still the prefix of one
        assert (got.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    "fmt,param",
    [
        ({"type": "grammar", "grammar": "x"}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}, "strict": True}}, "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_formats_it_cannot_enforce_are_400_naming_the_parameter(
    served: Served, fmt: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(served.url).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, response_format=fmt  # type: ignore[arg-type]
        )  # fmt: skip
    assert err.value.param == param
    assert err.value.status_code == 400
