"""The endpoint over plain HTTP (httpx): framing, errors, auth, metrics, cancellation, 429/503."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from tests.api.conftest import API_KEY, MODEL, Served

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
JSON_TYPE = {"Content-Type": "application/json"}
LONG = 200  # tokens: with ignore_eos a generation surely outlasts the test's next steps


def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def long_stream() -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "meshd": {"ignore_eos": True},
    }


def events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line:
            yield line


# -- framing ----------------------------------------------------------------------------
def test_sse_framing_ends_with_done(served: Served) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0, "stream": True}
    response = post(served.url, "/chat/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames)
    chunks = [msgspec.json.decode(f[6:]) for f in frames[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "speculative" in chunks[-1]["meshd"]


# -- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_are_400(served: Served, content: bytes) -> None:
    response = httpx.post(
        f"{served.url}/chat/completions", content=content, headers=JSON_TYPE, timeout=10
    )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "extra,param,code",
    [
        ({"foo": 1}, "foo", "unknown_parameter"),
        ({"max_tokens": "many"}, "max_tokens", "invalid_value"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"logprobs": 3}, "logprobs", None),
        ({"response_format": {"type": "regex"}}, "response_format", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"seed": 1 << 64}, "seed", "invalid_value"),
        ({"meshd": {"top_k": -1}}, "meshd.top_k", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
        ({"meshd": {"speculative": {"strategy": "psychic"}}}, "meshd.speculative.strategy", "invalid_value"),
        ({"meshd": {"speculative": {"window_max_tokens": 999}}}, "meshd.speculative.window_max_tokens", "invalid_value"),
        ({"meshd": {"speculative": {"draft_model": "/models/draft"}}}, "meshd.speculative.draft_model", "invalid_value"),
        ({"meshd": {"speculative": {"strategy": "draft"}}}, "meshd.speculative.strategy", "invalid_value"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", None),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "unsupported_parameter"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "unsupported_parameter"),
        ({"messages": []}, "messages", None),
    ],
)  # fmt: skip
def test_bad_parameters_are_400_naming_them(
    served: Served, extra: dict[str, Any], param: str, code: str | None
) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4} | extra
    response = post(served.url, "/chat/completions", body)
    assert response.status_code == 400
    error = error_of(response)
    assert (error["param"], error["code"]) == (param, code)
    assert param.split("[")[0].split(".")[0] in error["message"] or code == "invalid_value"


def test_prompt_beyond_the_context_is_400(served: Served) -> None:
    context = served.backend.max_context_tokens
    body = {"model": MODEL, "prompt": [5] * context, "max_tokens": 1}
    response = post(served.url, "/completions", body)
    assert response.status_code == 400
    assert error_of(response)["code"] == "context_length_exceeded"
    body = {"model": MODEL, "prompt": [5] * 10, "max_tokens": context}
    response = post(served.url, "/completions", body)
    assert error_of(response) | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "context_length_exceeded",
    }


def test_request_speculative_settings_apply(served: Served) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 12,
        "temperature": 0,
        "meshd": {"speculative": {"strategy": "disabled"}},
    }
    response = post(served.url, "/chat/completions", body)
    assert response.status_code == 200
    speculative = response.json()["meshd"]["speculative"]
    assert speculative["strategy"] == "disabled" and speculative["drafted_tokens"] == 0


def test_text_content_parts_are_joined(served: Served) -> None:
    parts = [{"type": "text", "text": "Write a Python function"}, {"type": "text", "text": "x"}]
    as_parts = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    as_text = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a Python function\nx"}],
    }
    common = {"max_tokens": 8, "temperature": 0}
    a = post(served.url, "/chat/completions", as_parts | common).json()
    b = post(served.url, "/chat/completions", as_text | common).json()
    assert a["choices"] == b["choices"] and a["usage"] == b["usage"]


def test_oversized_chunked_body_is_413(served: Served) -> None:
    def body() -> Iterator[bytes]:
        for _ in range(80):
            yield b"x" * 65536  # 5 MiB without a Content-Length

    response = httpx.post(
        f"{served.url}/completions", content=body(), headers=JSON_TYPE, timeout=30
    )
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


def test_unknown_route_is_404_in_openai_shape(served: Served) -> None:
    response = httpx.get(f"{served.url}/engines", timeout=10)
    assert response.status_code == 404
    assert error_of(response)["type"] == "invalid_request_error"


# -- auth -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}]
)
def test_keyed_api_refuses_without_the_key(served: Served, headers: dict[str, str]) -> None:
    for path in ("/models", "/completions"):
        response = httpx.request(
            "GET" if path == "/models" else "POST",
            f"{served.keyed_url}{path}",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers=headers,
            timeout=10,
        )
        assert response.status_code == 401
        assert error_of(response)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    root = served.keyed_url.removesuffix("/v1")
    assert httpx.get(f"{root}/metrics", headers=headers, timeout=10).status_code == 401


def test_keyed_api_serves_with_the_key(served: Served) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{served.keyed_url}/models", headers=auth, timeout=10).status_code == 200
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = post(served.keyed_url, "/completions", body, headers=auth)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


# -- metrics ----------------------------------------------------------------------------
def test_metrics_count_requests_and_tokens(served: Served) -> None:
    ok = ("meshd_api_requests_total", (("route", "/v1/completions"), ("status", "200")))
    tokens = ("meshd_api_generated_tokens_total", ())
    ttft = ("meshd_api_time_to_first_token_seconds_count", ())
    before = served.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
    body |= {"meshd": {"ignore_eos": True}}
    response = post(served.url, "/completions", body)
    assert response.json()["usage"]["completion_tokens"] == 20
    after = served.metrics()
    assert after[ok] == before.get(ok, 0) + 1
    assert after[tokens] == before[tokens] + 20
    assert after[ttft] == before[ttft] + 1
    assert (
        after[("meshd_api_prompt_tokens_total", ())] > before[("meshd_api_prompt_tokens_total", ())]
    )
    assert any(name == "meshd_spec_drafted_tokens_total" for name, _ in after)


# -- cancellation, 429, 503 -------------------------------------------------------------
def test_client_disconnect_cancels_and_frees_kv_on_every_stage(served: Served) -> None:
    tokens = ("meshd_api_generated_tokens_total", ())
    gone = ("meshd_api_requests_total", (("route", "/v1/completions"), ("status", "499")))
    before = served.metrics()
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{served.url}/completions", json=long_stream()) as r,
    ):
        lines = events(r.iter_lines())
        next(lines), next(lines)  # generation is under way
        assert served.sessions_open() == [1, 1]
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: served.sessions_open() == [0, 0])
    wait_until(
        lambda: served.call(lambda: served.backend.pipeline.coordinator.sessions_in_flight) == 0
    )
    after = served.metrics()
    assert after[tokens] - before[tokens] < LONG  # cancelled, not run to the end
    assert after[gone] == before.get(gone, 0) + 1


def test_overloaded_backend_answers_429_with_retry_after(served: Served) -> None:
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{served.single_url}/completions", json=long_stream()) as r,
    ):
        lines = events(r.iter_lines())  # keep it referenced: closing it drops the connection
        next(lines)
        second = c.post(
            f"{served.single_url}/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_tokens": 4},
        )
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert error_of(second)["type"] == "rate_limit_error"
        # The running stream is unaffected by the refusal.
        assert next(lines).startswith("data: {")
    wait_until(lambda: served.sessions_open() == [0, 0])


def _fail_route_when_running(served: Served) -> None:
    coordinator = served.backend.pipeline.coordinator
    wait_until(lambda: served.call(lambda: coordinator.sessions_in_flight) == 1)
    last_stage = served.backend.pipeline.route.keys[-1]
    served.call(coordinator.peer_lost, last_stage)  # what the lanes report when a stage dies


def test_route_failure_is_503_with_retry_after(served: Served) -> None:
    body = long_stream() | {"stream": False}
    killer = threading.Thread(target=_fail_route_when_running, args=(served,))
    killer.start()
    response = post(served.url, "/completions", body)
    killer.join()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert error_of(response)["code"] == "service_unavailable"
    wait_until(lambda: served.sessions_open() == [0, 0])


def test_route_failure_mid_stream_ends_with_an_error_event(served: Served) -> None:
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{served.url}/completions", json=long_stream()) as r,
    ):
        lines = events(r.iter_lines())
        next(lines)
        _fail_route_when_running(served)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    error = msgspec.json.decode(rest[-2][6:])["error"]
    assert error["code"] == "service_unavailable"
    wait_until(lambda: served.sessions_open() == [0, 0])
