"""Log-probs through the official `openai` client, chat and completions, streamed and not."""

from __future__ import annotations

import pytest

from tests.api.conftest import MODEL, Served
from tests.api.test_openai_client import CHAT, PROMPT, client


def test_chat_logprobs_cover_every_token_and_top_1_is_the_choice(served: Served) -> None:
    got = client(served.url).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = got.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert got.usage is not None and len(content) == got.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0.0
        assert bytes(entry.bytes or []).decode() == entry.token


def test_streamed_chat_logprobs_equal_the_whole_answer(served: Served) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0.8, seed=11)
    whole = client(served.url).chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
    streamed = []
    for chunk in client(served.url).chat.completions.create(
        logprobs=True, top_logprobs=2, stream=True, **kwargs
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert whole.choices[0].logprobs is not None
    expected = whole.choices[0].logprobs.content or []
    assert [t.token for t in streamed] == [t.token for t in expected]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in expected], abs=1e-4)


def test_completion_logprobs_in_the_legacy_shape(served: Served) -> None:
    got = client(served.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    # Special tokens are listed (as OpenAI does) but left out of the text.
    special = set(served.backend.tokenizer.special_tokens.values()) | {"<|user|>", "<|assistant|>"}
    assert "".join(t for t in lp.tokens if t not in special) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == value == top[token]


def test_no_logprobs_unless_asked(served: Served) -> None:
    got = client(served.url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert got.choices[0].logprobs is None
