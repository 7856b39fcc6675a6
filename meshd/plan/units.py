"""How the planner writes bytes, seconds and node keys for people."""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """Bytes in binary units, three significant figures (`1.50 GiB`)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds with two decimals (`12.50 ms`)."""
    return f"{seconds * 1e3:.2f} ms"


def format_delta_ms(seconds: float) -> str:
    """A signed difference in milliseconds (`+3.10 ms`)."""
    return f"{seconds * 1e3:+.2f} ms"


def short_key(key: bytes) -> str:
    """A node key for a listing: the first 8 hex digits, or the text of a short ASCII key."""
    if not key:
        return "(empty)"
    if len(key) <= 24 and all(0x21 <= b < 0x7F for b in key):
        return key.decode("ascii")
    return key.hex()[:8]
