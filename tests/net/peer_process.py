"""A lane peer in its own process, for tests that kill it (SIGKILL) like a crash would.

Usage: python -m tests.net.peer_process PSK_HEX. Prints `PORT PUBKEY_HEX` once listening,
then echoes every message it receives on the lane it accepts.
"""

import sys

import trio
from nacl.bindings import crypto_scalarmult_base
from nacl.utils import random as nacl_random

from meshd.net.endpoint import open_endpoint


async def main(psk: bytes) -> None:
    private = nacl_random(32)
    async with open_endpoint(static_private=private, psk=psk) as ep:
        print(ep.local_address[1], crypto_scalarmult_base(private).hex(), flush=True)
        while True:
            lane = await ep.accept()
            async for stream_id, data in lane:
                await lane.send(stream_id, data)


if __name__ == "__main__":
    trio.run(main, bytes.fromhex(sys.argv[1]))
