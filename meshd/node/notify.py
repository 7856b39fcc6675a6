"""systemd's notify protocol: READY=1, STATUS=..., WATCHDOG=1 as datagrams to $NOTIFY_SOCKET.

A no-op when the variable is unset (not started by systemd with Type=notify). An abstract
socket name starts with "@" in the variable and with a NUL byte on the wire.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends notify messages; every send is best-effort (a lost message must not stop us)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        path = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self.sent = 0

    @property
    def enabled(self) -> bool:
        """True when a notify socket was given."""
        return bool(self.address)

    def send(self, **fields: str) -> None:
        """Send `KEY=value` lines in one datagram (e.g. `send(READY="1", STATUS="serving")`)."""
        if not self.enabled:
            return
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(payload, self.address)
            self.sent += 1
        except OSError:
            pass

    def watchdog_interval_s(self, env: Mapping[str, str] | None = None) -> float | None:
        """Half of $WATCHDOG_USEC in seconds (how often to send WATCHDOG=1), if set."""
        usec = (env if env is not None else os.environ).get("WATCHDOG_USEC", "")
        return int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
