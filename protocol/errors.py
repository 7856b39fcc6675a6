"""Typed protocol errors that say whose fault a failure is (after h11)."""


class ProtocolError(Exception):
    """Base class of every error raised by the protocol package."""


class LocalProtocolError(ProtocolError):
    """The local caller asked for something the protocol does not allow (our bug)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed, unauthenticated or out of order (their fault).

    Decoders promise that arbitrary bytes from the network raise this and nothing else.
    """
