"""Tokenizer, chat template and streaming detokenization for a checkpoint directory.

Reads `tokenizer.json` (the `tokenizers` package), special tokens from `tokenizer_config.json`,
stop ids from `generation_config.json`, and renders the chat template with a sandboxed jinja2
environment configured like transformers' `apply_chat_template`, so a prompt tokenizes to the
same ids here as it would there.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import msgspec
import tokenizers

from meshd.model.errors import MissingFile, TokenizerError

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode/decode text and render chats for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens or {})
        bos = self.special_tokens.get("bos_token")
        self.bos_id: int | None = backend.token_to_id(bos) if bos else None
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos else None
        ids = [*eos_ids, *([eos_id] if eos_id is not None else [])]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer files of a checkpoint directory."""
        path = pathlib.Path(directory)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise MissingFile(f"{tokenizer_file}: tokenizer.json not found")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file}: cannot load ({exc})") from None
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        special = {k: v for k in _SPECIAL_KEYS if (v := _token_text(config.get(k))) is not None}
        eos = generation.get("eos_token_id")
        eos_ids = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
        return cls(
            backend,
            special_tokens=special,
            eos_ids=eos_ids,
            chat_template=_chat_template(path, config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def vocabulary(self) -> dict[str, int]:
        """Every token string and its id, added tokens included."""
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizers`' JSON (what grammar engines read)."""
        return str(self._backend.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the post-processor's BOS etc. when `add_special_tokens`)."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None."""
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template applied to `messages` (like HF `apply_chat_template(tokenize=False)`).

        `tools` (OpenAI's `{"type": "function", "function": {…}}` entries) is the template's
        `tools` variable, rendered as the model's authors wrote it."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json)")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **(self.special_tokens | template_kwargs),
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template: {exc}") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the rendered chat (the template supplies any BOS, as in HF)."""
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def stream(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generation."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns tokens arriving one by one into text deltas that never split a character.

    Byte-level tokens may end inside a multi-byte UTF-8 character; such a tail decodes to
    U+FFFD and is held back until the character completes. Only a short window of recent ids is
    re-decoded per token (prefix/read offsets, as in text-generation-inference), so the cost per
    token stays constant and decoders that treat the first token specially (leading spaces)
    still agree with decoding the whole sequence.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (may hold U+FFFD)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = msgspec.json.decode(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like HF: no HTML escaping, unlike jinja's built-in tojson.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from None
