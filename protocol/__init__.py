"""meshd's wire protocol, sans-IO.

Nothing in this package touches a socket, a clock, a thread or torch: callers pass bytes and
`now` in, and take bytes, events and timer deadlines out (in the manner of h11 and aioquic).
"""

from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION", "LocalProtocolError", "ProtocolError", "RemoteProtocolError"]
