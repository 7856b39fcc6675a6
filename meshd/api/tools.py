"""Tool calls: each model family's call format, the grammar that forces it, and its parser.

The model's own chat template renders `tools` and the conversation's calls and results (as
its authors wrote it); what the model writes back is parsed per family into OpenAI's
`tool_calls`:

- Hermes / Qwen2.5 (`<tool_call>` in the template): `<tool_call>\\n{"name": …, "arguments":
  {…}}\\n</tool_call>`, one block per call.
- Llama 3.1+ (`<|python_tag|>` or the `ipython` role in the template): one JSON object
  `{"name": …, "parameters": {…}}`.
- Mistral (`[TOOL_CALLS]` in the template): `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]`.

Arguments always validate against the function's schema: the call is generated under a
grammar (`meshd.speculative.grammar`) built from the tools' JSON schemas. With `tool_choice`
`required` or a named function the grammar holds from the first token; with `auto` the model
may answer in prose: for Hermes a grammar from the first token lets prose through and holds
every form of call (tagged, bare JSON, a ```json block); for the others it takes over once the
model writes the family's opening marker (where that marker is one token; otherwise the call
is parsed as written).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import msgspec

from meshd.api.textstream import TextStream
from meshd.model.tokenizer import Tokenizer
from meshd.speculative.grammar import check_grammar, grammar_tokenizer, lark_json_rule

Choice = str  # "auto", "required", or the one function's name ("none" never gets here)


class FunctionCall(msgspec.Struct, frozen=True):
    """The function a call names and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True):
    """One call in `message.tool_calls`."""

    id: str
    function: FunctionCall
    type: str = "function"


@dataclass(frozen=True)
class Family:
    """A model family's tool-call format."""

    name: str
    # The text that opens the calls (None: a call is a bare JSON object).
    marker: str | None
    # The key holding a call's arguments in what the model writes.
    arguments_key: str

    def call_schema(self, tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """JSON schema of one call of any of `tools` (their `function` objects)."""
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    self.arguments_key: tool.get("parameters") or {"type": "object"},
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        parallel: bool,
        tokenizer: Tokenizer,
        *,
        after_marker: bool,
    ) -> str:
        """The Lark grammar of the calls (from their marker, or from just after it)."""
        body = lark_json_rule(self.call_schema(tools))
        if self.name == "hermes":
            lark = f"start: {_hermes_calls(parallel, tokenizer, after_marker)}\nbody: {body}\n"

        elif self.name == "mistral":
            items = self.call_schema(tools)
            array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
            if not parallel:
                array["maxItems"] = 1
            head = "" if after_marker else f"{_literal(tokenizer, '[TOOL_CALLS]')} "
            lark = f'start: {head}" " calls\ncalls: {lark_json_rule(array)}\n'
        else:
            lark = f"start: body\nbody: {body}\n"
        return check_grammar(llguidance.LLMatcher.grammar_from_lark(lark))

    def auto_grammar(
        self, tools: Sequence[Mapping[str, Any]], parallel: bool, tokenizer: Tokenizer
    ) -> str | None:
        """The Lark grammar of an `auto` reply from its first token (None: only from the
        marker on): prose, prose then calls, or calls, where a call may also be written bare
        or in a ```` ```json ```` block (as Qwen2.5-Coder writes them). So prose may not open
        with `{` or ```` ```j ````: what opens so is a call of an offered function, with valid
        arguments, instead of one the parser could not take."""
        if self.name != "hermes":
            return None
        body = lark_json_rule(self.call_schema(tools))
        more = '("\\n" body)*' if parallel else ""
        lark = (
            "start: tagged | body | fenced | TEXT | TEXT tagged\n"
            f"tagged: {_hermes_calls(parallel, tokenizer, after_marker=False)}\n"
            f'fenced: "```json\\n" body {more} "\\n```" "\\n"?\n'
            "TEXT: /\\s*([^{`\\s]|`[^`]|``[^`]|```[^j])[\\s\\S]*/\n"
            f"body: {body}\n"
        )
        return check_grammar(llguidance.LLMatcher.grammar_from_lark(lark))

    def parse(self, text: str, names: Sequence[str] = ()) -> tuple[str | None, list[ToolCall]]:
        """What the model wrote → (prose before the calls, calls); no calls if they do not
        parse (the text is then the answer as written).

        Models of marker families sometimes write a call as bare JSON, without the marker,
        even in a markdown code block (Qwen2.5-Coder does): a reply that is nothing but JSON
        calls naming offered functions (`names`) is read as calls too.
        """
        try:
            if self.marker is not None and self.marker not in text:
                return (None, self._bare(text, names)) if names else (text, [])
            if self.name == "hermes":
                start = text.find("<tool_call>")
                blocks = re.findall(r"<tool_call>(.*?)(</tool_call>|$)", text[start:], re.S)
                # A last block cut off by max_tokens is dropped when whole calls precede it.
                if len(blocks) > 1 and not blocks[-1][1]:
                    blocks = blocks[:-1]
                calls = [self._call(json.loads(b)) for b, _ in blocks]
                return text[:start].strip() or None, calls
            if self.name == "mistral":
                start = text.find("[TOOL_CALLS]")
                found = json.loads(text[start + len("[TOOL_CALLS]") :])
                found = found if isinstance(found, list) else [found]
                return text[:start].strip() or None, [self._call(c) for c in found]
            return None, self._bare(text.replace("<|python_tag|>", ""), names)
        except (ValueError, KeyError, TypeError):
            return text, []

    def _bare(self, text: str, names: Sequence[str]) -> list[ToolCall]:
        stripped = text.strip()
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", stripped, re.S)
        if fenced:  # a call in a markdown code block, as small models like to write it
            stripped = fenced.group(1)
        if not stripped.startswith(("{", "[")):
            raise ValueError("not a JSON call")
        calls = [
            self._call(c)
            for value in _json_values(stripped)
            for c in (value if isinstance(value, list) else [value])
        ]
        if not calls or (names and any(c.function.name not in names for c in calls)):
            raise ValueError("not calls of the offered functions")
        return calls

    def _call(self, value: Any) -> ToolCall:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            raise ValueError("a call is an object with a name")
        args = value.get(self.arguments_key, value.get("arguments", value.get("parameters", {})))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(new_call_id(), FunctionCall(value["name"], arguments))


def _hermes_calls(parallel: bool, tokenizer: Tokenizer, after_marker: bool) -> str:
    """Lark for Hermes `<tool_call>` blocks of the rule `body` (from the marker or after it)."""
    close = f'"\\n" {_literal(tokenizer, "</tool_call>")}'
    more = f'("\\n" {_literal(tokenizer, "<tool_call>")} "\\n" body {close})'
    first = f'"\\n" body {close}'
    if not after_marker:
        first = f"{_literal(tokenizer, '<tool_call>')} {first}"
    # A newline may end the calls too: models write one after `</tool_call>` before their end
    # token, and a newline that could only open another call would force one more call after
    # every call.
    repeat = more + "*" if parallel else ""
    return f'{first} {repeat} "\\n"?'


HERMES = Family("hermes", "<tool_call>", "arguments")
LLAMA3 = Family("llama3", None, "parameters")
MISTRAL = Family("mistral", "[TOOL_CALLS]", "arguments")


def family_of(template: str | None) -> Family | None:
    """The call format a chat template was written for; None if it does not render tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return None


def marker_token(tokenizer: Tokenizer, family: Family) -> int | None:
    """The marker's token id when the marker is one token (so it can trigger a grammar)."""
    if family.marker is None:
        return None
    ids = tokenizer.encode(family.marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def new_call_id() -> str:
    """A fresh call id, as OpenAI makes them."""
    return "call_" + secrets.token_hex(12)


def _literal(tokenizer: Tokenizer, text: str) -> str:
    # A special token cannot be spelled out in bytes: the grammar names it by id.
    token = tokenizer.token_to_id(text)
    if token is not None and grammar_tokenizer(tokenizer).is_special_token(token):
        return f"<[{token}]>"
    return json.dumps(text)


@dataclass(frozen=True)
class ToolPlan:
    """How a request's reply is read for calls, and what grammar forces them."""

    family: Family
    # The functions a call may name (`function` objects; one for a named tool_choice).
    functions: tuple[Mapping[str, Any], ...]
    parallel: bool
    # `required` or a named function: the reply is calls only, under the grammar from the
    # first token. `auto`: prose or calls; the grammar holds from the marker on.
    forced: bool

    def grammar(self, tokenizer: Tokenizer) -> tuple[str, int | None] | None:
        """The grammar and the token that triggers it (None: from the first token); None when
        nothing can be forced (`auto` for a family whose marker is not one token)."""
        if self.forced:
            return self.family.grammar(
                self.functions, self.parallel, tokenizer, after_marker=False
            ), None
        whole = self.family.auto_grammar(self.functions, self.parallel, tokenizer)
        if whole is not None:
            return whole, None
        trigger = marker_token(tokenizer, self.family)
        if trigger is None:
            return None
        grammar = self.family.grammar(self.functions, self.parallel, tokenizer, after_marker=True)
        return grammar, trigger


class CallReader:
    """Reads a reply that may hold calls, as it streams.

    Prose before the family's marker streams as it comes (the marker itself is held back
    until it is sure); from the marker on, everything is held and parsed at the end. A reply
    that opens with JSON is held whole too: a family without a marker writes its calls so, and
    models of the others sometimes do. Special tokens stay in the text read here: some
    families' markers are special tokens.
    """

    def __init__(self, tokenizer: Tokenizer, family: Family, names: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._family = family
        self._names = tuple(names)
        self._tokens: list[int] = []
        marker = family.marker
        stops = (marker,) if marker else ()
        self._prose = TextStream(tokenizer, stops, skip_special_tokens=False)
        self._opening = ""  # prose held until its first visible character shows
        self._streaming = False
        self._sent: list[str] = []

    def push(self, tokens: Sequence[int]) -> str:
        """Add generated tokens; return the prose they release."""
        self._tokens.extend(tokens)
        text = self._prose.push(tokens)
        if not self._streaming:
            self._opening += text
            head = self._opening.lstrip()
            if _may_open_json(head) or self._family.marker is None:
                return ""
            self._streaming = True
            text, self._opening = self._opening, ""
        self._sent.append(text)
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the text to send (none when the reply held calls) and the calls."""
        raw = self._tokenizer.decode(self._tokens, skip_special_tokens=False)
        _, calls = self._family.parse(raw, self._names)
        if calls:
            return "", calls
        sent = "".join(self._sent)
        return (raw[len(sent) :] if raw.startswith(sent) else ""), []


def _may_open_json(head: str) -> bool:
    # Held back while the reply may still turn out to be a bare JSON call: nothing visible
    # yet, a JSON opener, or (a prefix of) a ```json fence.
    fence = "```json"
    return not head or head.startswith(("{", "[", fence)) or fence.startswith(head)


def _json_values(text: str) -> list[Any]:
    """JSON values one after another (calls a model wrote on separate lines); a last one cut
    off by max_tokens is dropped when whole ones precede it."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            if values:
                break
            raise
        values.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return values
