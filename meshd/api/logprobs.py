"""Log-probs in OpenAI's shapes: chat's `logprobs.content` and completions' four lists.

The numbers come from the last stage (`protocol.messages.TokenLogprobs`): the model's own
distribution, log-softmax of the logits before temperature, top-k/top-p and any grammar mask,
as OpenAI reports it. Tokens are shown as their text and their bytes: a byte-level BPE piece
maps back through GPT-2's byte alphabet, a SentencePiece byte token `<0xNN>` is that byte, `▁`
is a space; a piece that is not whole UTF-8 shows its bytes as `\\xNN` in the text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import msgspec

from meshd.model.tokenizer import Tokenizer
from protocol.messages import TokenLogprobs

# OpenAI's limits: chat `top_logprobs` 0..20, completions `logprobs` 0..5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_TEXT_LOGPROBS = 5

Scored = tuple[int, TokenLogprobs]  # a generated token id and its log-probs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TopLogprob(msgspec.Struct, frozen=True):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    """A generated token of a chat completion, with the most likely tokens at its position."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True):
    """`choices[].logprobs` of a chat completion (or of one chunk)."""

    content: list[ChatTokenLogprob] | None
    refusal: None = None


class TextLogprobs(msgspec.Struct, frozen=True):
    """`choices[].logprobs` of a text completion (or of one chunk)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TokenBytes:
    """The bytes each token id stands for, from the tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = tokenizer.vocabulary()
        self._pieces = {i: piece for piece, i in vocab.items()}
        self._byte_level = any("Ġ" in piece for piece in vocab)
        self._decode = tokenizer.decode

    def bytes_of(self, token: int) -> bytes:
        """The bytes `token` adds to the text."""
        piece = self._pieces.get(token)
        if piece is None:
            return self._decode([token]).encode()
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()  # an added token, stored as its text
        found = _BYTE_TOKEN.fullmatch(piece)
        if found:
            return bytes([int(found.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def text_of(self, token: int) -> str:
        """`bytes_of` as text (`\\xNN` for bytes that are not whole UTF-8)."""
        return self.bytes_of(token).decode("utf-8", errors="backslashreplace")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's reversible byte → printable-character table (byte-level BPE vocabularies).
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def chat_logprobs(scored: Sequence[Scored], names: TokenBytes) -> ChatLogprobs:
    """Chat's shape: one entry per token, each with its `top_logprobs`."""
    content = []
    for token, lp in scored:
        top = [
            TopLogprob(names.text_of(i), v, list(names.bytes_of(i)))
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        ]
        raw = names.bytes_of(token)
        content.append(ChatTokenLogprob(names.text_of(token), lp.logprob, list(raw), top))
    return ChatLogprobs(content)


def text_logprobs(scored: Sequence[Scored], names: TokenBytes, offset: int = 0) -> TextLogprobs:
    """Completions' shape; `offset` is where the first token's text starts in the completion."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp in scored:
        text = names.text_of(token)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({names.text_of(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)})
        offsets.append(offset)
        offset += len(text)
    return TextLogprobs(tokens, values, tops, offsets)


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """The `TokenBytes` of a tokenizer, built once (a vocabulary has up to ~250k pieces)."""
    return TokenBytes(tokenizer)
