"""What a stage host sends, recorded (the node's lane table in a real stage)."""

from __future__ import annotations

from protocol.messages import Message


class Outbox:
    """Collects every (peer key, message) a host sends, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Message]] = []

    async def send(self, key: bytes, message: Message, stream: int = 0) -> None:
        self.sent.append((key, message))
