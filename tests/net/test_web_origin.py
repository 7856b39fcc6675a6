"""Host values and origins: two spellings of one address compare equal, garbage is refused."""

from __future__ import annotations

import pytest

from meshd.net.web_origin import HostPort, Origin, parse_host, parse_origin


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("LocalHost:7392", "localhost", 7392),
        ("127.0.0.1", "127.0.0.1", None),
        ("[::1]:80", "::1", 80),
        ("[0:0:0:0:0:0:0:1]:80", "::1", 80),
        ("[::ffff:127.0.0.1]:8000", "127.0.0.1", 8000),
        ("fd00::2", "fd00::2", None),
        ("mesh_node.lan.", "mesh_node.lan.", None),
    ],
)
def test_hosts_are_normalised(text: str, host: str, port: int | None) -> None:
    assert parse_host(text) == HostPort(host, port)


@pytest.mark.parametrize(
    "text",
    ["", ":80", "a:b:c", "[::1", "[::1]x", "[127.0.0.1]:80", "x:0", "x:65536", "x:8o",
     "-bad.lan", "a..b", "*.lan", "http://x", "a b", "caf\xe9.lan", "a" * 64 + ".lan"],
)  # fmt: skip
def test_garbage_hosts_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_host(text)


def test_origins_serialise_as_browsers_send_them() -> None:
    assert str(parse_origin("HTTP://LocalHost:80")) == "http://localhost"
    assert str(parse_origin("https://app.example.com:443")) == "https://app.example.com"
    assert str(parse_origin("http://[::1]:7392")) == "http://[::1]:7392"
    assert parse_origin("https://app.example.com") == Origin("https", "app.example.com", 443)
    assert parse_origin("tauri://localhost") == Origin("tauri", "localhost", None)


@pytest.mark.parametrize(
    "text",
    ["null", "", "app.example.com", "http://", "http://a/", "http://a/b", "http://u@a",
     "http://a?x", "1http://a", "http://a:99999"],
)  # fmt: skip
def test_what_is_not_an_origin_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_origin(text)
