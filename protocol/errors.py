"""Typed protocol errors that say whose fault a failure is (after h11)."""


class ProtocolError(Exception):
    """Base class of every error raised by the protocol package."""


class LocalProtocolError(ProtocolError):
    """The local caller asked for something the protocol does not allow (our bug)."""


class InvalidConfig(LocalProtocolError, ValueError):
    """A config struct was given a value its rule forbids.

    Every config struct of meshd validates this one way: `__post_init__` raises a ValueError
    whose message starts with the field's name, so a loader can add the table and the place
    the value was set (`meshd.config.sources`).
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent something malformed, unauthenticated or out of order (their fault).

    Decoders promise that arbitrary bytes from the network raise this and nothing else.
    `drop_reason` labels the drop for the operator's counters; subclasses narrow it.
    """

    drop_reason = "malformed"


class UndecryptableError(RemoteProtocolError):
    """Bytes of the right shape that fail authentication: forged, corrupted, or under a key
    we do not hold (another mesh's secret, a lane's discarded key)."""

    drop_reason = "undecryptable"


class HandshakeRejected(RemoteProtocolError):
    """An INITIATION addressed to us (its mac1 holds) that we do not accept.

    `refusal` labels why, for the operator's counters of refused handshakes: `version`,
    `not_admitted`, `replayed`, `clock_skew`, `undecryptable` or `malformed`.
    """

    def __init__(self, message: str, *, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal
