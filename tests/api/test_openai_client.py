"""The official `openai` client against the endpoint, over a real 2-stage pipeline.

The sync client runs in these plain test functions (the server has its own trio run in a
thread; see conftest.py), exactly as a user's script would.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from meshd.api.backend import open_local_backend
from meshd.api.openai import create_app
from meshd.api.server import serve_api
from meshd.coord.coordinator import GenerationRequest
from protocol.messages import Sampling
from tests.api.conftest import MODEL, Served

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a Python function that adds two numbers."}
]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def reference(
    served: Served, prompt: list[int], max_tokens: int, *, ignore_eos: bool = False
) -> list[int]:
    """Greedy tokens straight from the coordinator, bypassing HTTP."""
    backend = served.backend

    async def run() -> list[int]:
        request = GenerationRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=Sampling(temperature=0.0),
            eos_ids=frozenset() if ignore_eos else frozenset(backend.tokenizer.eos_ids),
            mtp_depth=backend.mtp_depth,
        )

        async def ignore(tokens: list[int]) -> None:
            pass

        result = await backend.generate(request, ignore)
        return result.tokens

    return served.acall(run)


def test_models_lists_the_served_model(served: Served) -> None:
    models = client(served.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(served.url).models.retrieve(MODEL).id == MODEL


def test_greedy_completion_equals_the_coordinator(served: Served) -> None:
    tokenizer = served.backend.tokenizer
    expected = reference(served, tokenizer.encode(PROMPT), 40)
    got = client(served.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0
    )
    assert got.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert got.usage.completion_tokens == len(expected)
    assert got.usage.total_tokens == got.usage.prompt_tokens + len(expected)
    assert got.choices[0].finish_reason == ("length" if len(expected) == 40 else "stop")


def test_greedy_chat_equals_the_coordinator_streamed_and_not(served: Served) -> None:
    tokenizer = served.backend.tokenizer
    expected = reference(served, tokenizer.encode_chat(CHAT), 30)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    c = client(served.url)
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    assert whole.choices[0].message.content == text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == len(expected)
    speculative = (whole.model_extra or {})["meshd"]["speculative"]
    assert speculative["version"] == 1 and speculative["tokens_committed"] >= 1

    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == whole.choices[0].finish_reason and not any(finish[:-1])
    # include_usage: a last chunk without choices carries the usage; the others carry none.
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_streamed_completion_without_usage(served: Served) -> None:
    chunks = list(
        client(served.url).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
    )
    assert all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(ch.choices[0].text for ch in chunks)
    whole = client(served.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert text == whole.choices[0].text


def test_stop_sequences_cut_the_text_and_the_generation(served: Served) -> None:
    tokenizer = served.backend.tokenizer
    tokens = reference(served, tokenizer.encode(PROMPT), 40, ignore_eos=True)
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    # A stop made of the end of one token and the start of the next, early in the text.
    ends = [len(tokenizer.decode(tokens[:i], skip_special_tokens=True)) for i in range(41)]
    boundary = next(b for b in ends[4:20] if 2 <= b <= len(text) - 2 and b + 2 <= ends[-5])
    assert text.startswith(
        tokenizer.decode(tokens[: ends.index(boundary)], skip_special_tokens=True)
    )
    stop = text[boundary - 2 : boundary + 2]
    expected = text[: text.index(stop)]
    c = client(served.url)
    common: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "extra_body": {"meshd": {"ignore_eos": True}},
    }
    full = c.completions.create(**common)
    assert full.choices[0].text == text
    cut = c.completions.create(**common, stop=["never-seen", stop])
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage is not None and full.usage is not None
    assert cut.usage.completion_tokens < full.usage.completion_tokens == 40
    chunks = list(c.completions.create(**common, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(served: Served) -> None:
    c = client(served.url)

    def sample(seed: int) -> str:
        out = c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(-7) == sample(-7)  # OpenAI seeds are signed
    assert {sample(s) for s in (1, 2)} != {first}  # other seeds give other texts


def test_n_greater_than_one_is_refused(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(served.url).chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert err.value.status_code == 400
    assert err.value.param == "n" and err.value.code == "unsupported_parameter"


def test_tools_are_refused(served: Served) -> None:
    tool: ChatCompletionFunctionToolParam = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object"}},
    }
    with pytest.raises(openai.BadRequestError) as err:
        client(served.url).chat.completions.create(model=MODEL, messages=CHAT, tools=[tool])
    assert err.value.param == "tools"


def test_unknown_model_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client(served.url).completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"


def test_oversized_body_is_413(served: Served) -> None:
    huge: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x" * (5 << 20)}]
    with pytest.raises(openai.APIStatusError) as err:
        client(served.url).chat.completions.create(model=MODEL, messages=huge, max_tokens=2)
    assert err.value.status_code == 413
    assert err.value.code == "request_too_large"


async def test_async_client_runs_inside_trio() -> None:
    """`openai.AsyncOpenAI` (httpx on trio) against a server in the same trio run."""
    async with open_local_backend(stages=1) as backend, trio.open_nursery() as nursery:
        address = await nursery.start(serve_api, create_app(backend))
        c = openai.AsyncOpenAI(base_url=address.base_url, api_key="unused", max_retries=0)
        with trio.fail_after(30):
            whole = await c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
            )
            stream = await c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
            )
            pieces = [chunk.choices[0].text async for chunk in stream]
        assert "".join(pieces) == whole.choices[0].text
        assert whole.usage is not None and whole.usage.completion_tokens >= 1
        await c.close()
        nursery.cancel_scope.cancel()


# A system prompt of several prefill chunks: turn 2 of the chat repeats it, and turn 1's reply.
LONG_SYSTEM = (
    "You are a careful assistant for a small team that maintains a Python service. "
    "Answer briefly, name the module you mean, and prefer standard-library solutions. "
) * 12


def test_turn_two_reports_cached_tokens_and_computes_only_the_rest(served: Served) -> None:
    tokenizer = served.backend.tokenizer
    hosts = served.backend.pipeline.hosts
    c = client(served.url)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "How do I read a JSON file?"},
    ]
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens > 512
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And how do I write one back?"},
    ]
    computed = served.call(lambda: [h.stats.tokens_computed for h in hosts])
    # One token: the stages compute the prompt's uncached positions and nothing else.
    second = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    usage = second.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= 512 and cached % 128 == 0  # whole prefill chunks
    after = served.call(lambda: [h.stats.tokens_computed for h in hosts])
    assert [a - b for a, b in zip(after, computed, strict=True)] == [
        usage.prompt_tokens - cached
    ] * 2
    assert usage.prompt_tokens - cached <= 0.5 * usage.prompt_tokens

    warm = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    # The one-token request kept this prompt's own whole chunks: now those are reused.
    assert warm.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 128 * 128
    coordinator = served.backend.pipeline.coordinator
    coordinator.prefix_cache = False
    try:
        cold = reference(served, tokenizer.encode_chat(messages), 24)
    finally:
        coordinator.prefix_cache = True
    assert warm.choices[0].message.content == tokenizer.decode(cold, skip_special_tokens=True)
