"""The relay an introducer runs: forwards RELAY datagrams between two introduced peers.

A thin trio-side driver over `protocol.punch.RelayTable`, which holds the policy (sessions only
for pairs this node introduced, forwarding only between the two addresses registered for a
session, a per-session token bucket, idle expiry). The relay never holds lane keys: it forwards
the two peers' own Noise-encrypted lane datagrams and cannot read or forge them.
"""

from __future__ import annotations

import secrets

import trio

from meshd.net.endpoint import Address, Endpoint
from protocol.datagram import KIND_RELAY
from protocol.punch import PunchConfig, RelayStats, RelayTable


class Relay:
    """Forwarding for the relay sessions this endpoint's introductions opened."""

    def __init__(self, endpoint: Endpoint, config: PunchConfig) -> None:
        self.endpoint = endpoint
        self.table = RelayTable(config=config, new_id=lambda: secrets.randbits(32))
        endpoint.datagram_handlers[KIND_RELAY] = self._on_relay

    @property
    def stats(self) -> RelayStats:
        """Sessions opened or refused, datagrams and bytes forwarded or dropped."""
        return self.table.stats

    def open_session(self, ends: tuple[Address, Address], keys: tuple[bytes, bytes]) -> int | None:
        """A relay session between two peers' observed addresses, or None when full."""
        return self.table.open_session(ends, keys, trio.current_time())

    def _on_relay(self, data: bytes, addr: Address, now: float) -> str | None:
        """A RELAY datagram (the endpoint's handler): forwarded (None), or the drop reason."""
        out = self.table.route(data, addr, now)
        if isinstance(out, str):
            return out
        self.endpoint.send_datagram(*out)
        return None
