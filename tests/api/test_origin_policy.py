"""What a web page can make the browser send, refused over real HTTP: a foreign `Host` (DNS
rebinding), a foreign `Origin`, a body that is not JSON (a "simple" cross-origin POST), a
preflight from an origin nobody allowed. And what must still work: curl-like clients on
every loopback name, the console's own origin, an allowed origin with its preflight.

A page in a real browser is tests/api/test_console_browser.py.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
import pytest

from tests.api.conftest import ALLOWED_HOST, API_KEY, CORS_ORIGIN, MODEL, Served
from tests.api.test_http import error_of

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_JSON = (
    b'{"model": "meshd-builtin", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}'
)
KEY = {"Authorization": f"Bearer {API_KEY}"}
PROMPT_TOKENS = ("meshd_api_prompt_tokens_total", ())
# GETs with data, the console's page, and the metrics: all refused under a foreign Host.
GETS = ("/", "/console/console.js", "/v1/mesh/status", "/metrics", "/v1/models")


def root(url: str) -> str:
    return url.removesuffix("/v1")


def port(url: str) -> int:
    got = urlsplit(url).port
    assert got is not None
    return got


def ran(served: Served, url: str | None = None) -> float:
    """Prompt tokens of the requests that ran on this app so far."""
    return served.metrics(url, KEY).get(PROMPT_TOKENS, 0.0)


def chat(url: str, headers: dict[str, str], content: bytes = CHAT_JSON) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", content=content, headers=headers, timeout=60)


def raw_status(url: str, head: bytes, body: bytes = b"") -> int:
    """Send a request as raw bytes (headers a client library would not send) and read the
    status of its answer."""
    with socket.create_connection(("127.0.0.1", port(url)), timeout=10) as sock:
        sock.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


# -- Host ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "host", ["evil.example.com", "evil.example.com:{port}", "localhost:1", "127.0.0.2:{port}"]
)
def test_a_foreign_host_is_refused_on_every_route(served: Served, host: str) -> None:
    host = host.format(port=port(served.url))
    before = ran(served)
    for path in GETS:
        response = httpx.get(f"{root(served.url)}{path}", headers={"Host": host}, timeout=10)
        assert response.status_code == 403, path
        error = error_of(response)
        assert error["code"] == "host_not_allowed"
        assert repr(host) in error["message"] and "api_allowed_hosts" in error["message"]
    refused = chat(served.url, {"Host": host, "Content-Type": "application/json"})
    assert refused.status_code == 403 and error_of(refused)["code"] == "host_not_allowed"
    assert ran(served) == before  # nothing was generated


def test_every_loopback_name_of_the_api_is_served(served: Served) -> None:
    p = port(served.url)
    for host in (f"127.0.0.1:{p}", f"localhost:{p}", f"LOCALHOST:{p}", f"[::1]:{p}", "localhost"):
        got = httpx.get(f"{served.url}/models", headers={"Host": host}, timeout=10)
        assert got.status_code == 200, host
    # What curl -H 'Content-Type: application/json' -d sends.
    answer = chat(served.url, {"Host": f"localhost:{p}", "Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"


def test_with_a_key_the_host_rule_guards_the_public_routes(served: Served) -> None:
    # The console's files need no key: a foreign Host gets them refused; a name in
    # api_allowed_hosts serves them, on any port.
    url = root(served.cors_url)
    for path in ("/", "/console/console.js"):
        assert httpx.get(url + path, headers={"Host": "evil.example"}).status_code == 403
        for host in (ALLOWED_HOST, f"{ALLOWED_HOST}:8443", f"{ALLOWED_HOST.upper()}:80"):
            assert httpx.get(url + path, headers={"Host": host}).status_code == 200, host
    # The routes with data answer whoever holds the key, under any name.
    assert httpx.get(f"{url}/v1/models", headers={"Host": "gpu-box.lan:7392", **KEY}).is_success
    assert httpx.get(f"{url}/v1/models", headers={"Host": "gpu-box.lan"}).status_code == 401


# -- Origin -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "origin",
    ["http://evil.example.com", "null", "http://127.0.0.1:1", "https://app.example.com:444",
     "file://", "chrome-extension://abcdef", "http://localhost:{port}/path", "garbage"],
)  # fmt: skip
def test_a_foreign_origin_is_refused(served: Served, origin: str) -> None:
    origin = origin.format(port=port(served.url))
    before = ran(served)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json"):
        refused = chat(served.url, {"Origin": origin, "Content-Type": content_type})
        assert refused.status_code == 403
        error = error_of(refused)
        assert error["code"] == "origin_not_allowed" and "api_cors_origins" in error["message"]
        assert "access-control-allow-origin" not in refused.headers
    status = httpx.get(f"{root(served.url)}/v1/mesh/status", headers={"Origin": origin})
    assert status.status_code == 403
    assert ran(served) == before


def test_the_consoles_own_origin_is_served(served: Served) -> None:
    # What the console's fetch sends: its page's origin, the JSON body.
    p = port(served.url)
    for origin in (f"http://127.0.0.1:{p}", f"http://localhost:{p}"):
        headers = {"Origin": origin, "Content-Type": "application/json"}
        answer = chat(served.url, headers)
        assert answer.status_code == 200, answer.text
        assert "access-control-allow-origin" not in answer.headers  # same-origin needs none
        status = httpx.get(f"{root(served.url)}/v1/mesh/status", headers={"Origin": origin})
        assert status.status_code == 200 and status.json()["models"] == [MODEL]


# -- Content-Type -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content_type", "content"),
    [
        ("text/plain", CHAT_JSON),
        ("text/plain;charset=UTF-8", CHAT_JSON),
        ("application/x-www-form-urlencoded", b"model=meshd-builtin&prompt=hi"),
        ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\n"),
        ("application/jsonp", CHAT_JSON),
        (None, CHAT_JSON),
    ],
)
def test_a_body_that_is_not_json_is_415(
    served: Served, content_type: str | None, content: bytes
) -> None:
    before = ran(served)
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/chat/completions", "/completions"):
        refused = httpx.post(f"{served.url}{path}", content=content, headers=headers)
        assert refused.status_code == 415
        error = error_of(refused)
        assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert ran(served) == before


def test_json_with_a_charset_is_served(served: Served) -> None:
    body = b'{"model": "meshd-builtin", "prompt": "def f(x):", "max_tokens": 2}'
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    answer = httpx.post(f"{served.url}/completions", content=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text


# -- CORS ---------------------------------------------------------------------------------
def preflight(url: str, origin: str, **extra: str) -> httpx.Response:
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST", **extra}
    return httpx.options(f"{url}/chat/completions", headers=headers, timeout=10)


def test_an_allowed_origin_gets_its_preflight_and_reads_the_answers(served: Served) -> None:
    asked = "authorization, content-type, x-stainless-lang"
    allowed = preflight(served.cors_url, CORS_ORIGIN, **{"Access-Control-Request-Headers": asked})
    assert allowed.status_code == 204  # without the key: a browser never sends it here
    assert allowed.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    names = {h.strip().lower() for h in allowed.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-lang"} <= names
    odd = preflight(served.cors_url, CORS_ORIGIN, **{"Access-Control-Request-Headers": "a b, (c)"})
    assert odd.status_code == 204
    assert odd.headers["access-control-allow-headers"] == "Authorization, Content-Type"
    before = ran(served, served.cors_url)
    headers = {"Origin": CORS_ORIGIN, **KEY}
    answer = httpx.post(f"{served.cors_url}/chat/completions", json=CHAT, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert ran(served, served.cors_url) > before
    # Its errors are readable too, the missing key's included.
    unkeyed = httpx.post(f"{served.cors_url}/chat/completions", json=CHAT,
                         headers={"Origin": CORS_ORIGIN})  # fmt: skip
    assert unkeyed.status_code == 401
    assert unkeyed.headers["access-control-allow-origin"] == CORS_ORIGIN


@pytest.mark.parametrize("origin", ["http://evil.example.com", "null", "https://app.example.co"])
def test_a_preflight_from_another_origin_is_403_without_cors_headers(
    served: Served, origin: str
) -> None:
    for url in (served.url, served.cors_url):
        refused = preflight(url, origin)
        assert refused.status_code == 403
        assert error_of(refused)["code"] == "origin_not_allowed"
        assert not any(h.startswith("access-control-") for h in refused.headers)


def test_no_preflight_is_answered_where_no_origin_is_allowed(served: Served) -> None:
    # The API's own origin never needs one; api_cors_origins is empty by default.
    refused = preflight(served.url, f"http://127.0.0.1:{port(served.url)}")
    assert refused.status_code == 403
    assert "access-control-allow-origin" not in refused.headers


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "head",
    [
        b"GET /v1/models HTTP/1.1\r\nHost: [::1",
        b"GET /v1/models HTTP/1.1\r\nHost: a:b:c",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:99999",
        b"GET /v1/models HTTP/1.1\r\nHost: " + b"a" * 300,
        b"GET /v1/models HTTP/1.1\r\nHost: \xff\xfe",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example",
        b"GET /v1/models HTTP/1.0",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: ",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: \xff://x",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://[::1",
        b"OPTIONS /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAccess-Control-Request-Method: GET",
        b"OPTIONS / HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\n"
        b"Access-Control-Request-Method: POST",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: \xff\r\n"
        b"Content-Length: 2",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: ;\r\nContent-Length: 2",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked",
    ],
)
def test_bad_hosts_origins_and_types_are_a_clean_4xx(served: Served, head: bytes) -> None:
    body = b"{}" if b"Content-Length: 2" in head else b"0\r\n\r\n" if b"chunked" in head else b""
    for url in (served.url, served.cors_url):
        assert 400 <= raw_status(url, head, body) < 500, head
