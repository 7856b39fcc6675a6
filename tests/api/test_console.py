"""The web console's HTTP side: the page and its assets, and `/v1/mesh/status` behind the key.

The page in a real browser against real daemons is tests/api/test_console_browser.py.
"""

from __future__ import annotations

import httpx

from tests.api.conftest import API_KEY, MODEL, Served


def _root(url: str) -> str:
    return url.removesuffix("/v1")


def test_the_page_and_its_assets_load_without_a_key(served: Served) -> None:
    # A browser cannot send the key when it opens the URL; the page holds no data.
    for url in (served.url, served.keyed_url):
        page = httpx.get(f"{_root(url)}/", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/console/console.js">' in page.text
        for asset, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
            got = httpx.get(f"{_root(url)}/console/{asset}", timeout=10)
            assert got.status_code == 200 and got.headers["content-type"].startswith(kind)
            assert len(got.content) > 500
        # Only GETs of those exact paths: anything else still needs the key.
        assert httpx.post(f"{_root(served.keyed_url)}/", timeout=10).status_code == 401
    assert httpx.get(f"{_root(served.keyed_url)}/console/x.js", timeout=10).status_code == 401


def test_mesh_status_sits_behind_the_key(served: Served) -> None:
    keyed = f"{_root(served.keyed_url)}/v1/mesh/status"
    assert httpx.get(keyed, timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(keyed, headers=wrong, timeout=10).status_code == 401
    ok = httpx.get(keyed, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.json()["models"] == [MODEL]


def test_mesh_status_counts_the_tokens_it_generates(served: Served) -> None:
    status = f"{_root(served.url)}/v1/mesh/status"
    before = httpx.get(status, timeout=10).json()
    # An in-process pipeline has no mesh of its own to report.
    assert before["node"] is None and before["models"] == [MODEL]
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 7, "meshd": {"ignore_eos": True}}
    done = httpx.post(f"{served.url}/completions", json=body, timeout=60)
    assert done.status_code == 200, done.text
    after = httpx.get(status, timeout=10).json()["traffic"]
    generated = done.json()["usage"]["completion_tokens"]
    assert after["generated_tokens"] - before["traffic"]["generated_tokens"] == generated
    assert after["prompt_tokens"] > before["traffic"]["prompt_tokens"]
