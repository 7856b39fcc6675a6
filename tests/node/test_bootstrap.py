"""A `mesh:ID` node's start-up fetch of the manifest: a peer that takes the lane but does not
answer (busy, or not speaking the artifact protocol) is a failed try, tried again, and after
`fetch.holder_wait_s` the start ends with a one-line ModelError, never a traceback."""

from __future__ import annotations

import pathlib

import trio

from meshd.config import NodeConfig
from meshd.mesh.discovery import DiscoveryConfig
from meshd.mesh.identity import NodeIdentity
from meshd.model.errors import ModelUnavailable
from meshd.net.endpoint import open_endpoint
from meshd.net.lane_table import LaneTable
from meshd.node.bootstrap import MANIFEST_TIMEOUT_S, bootstrap_store
from protocol.artifacts import FetchConfig
from protocol.handshake import psk_from_secret

SECRET = "meshd-bootstrap-test-secret-0123456789"


async def test_a_peer_that_never_answers_the_manifest_request_ends_the_start_in_one_line(
    tmp_path: pathlib.Path,
) -> None:
    psk = psk_from_secret(SECRET)
    silent = NodeIdentity.load_or_create(tmp_path / "silent")
    asker = NodeIdentity.load_or_create(tmp_path / "asker")
    async with (
        open_endpoint(
            static_private=silent.x25519_private,
            psk=psk,
            node_public_key=silent.public_key,
        ) as endpoint,
        trio.open_nursery() as nursery,
    ):
        # It takes lanes and answers key queries; artifact messages it does not handle.
        table = LaneTable(endpoint, silent.x25519_public, lambda _message, _key: None)
        await nursery.start(table.run)
        host, port = endpoint.local_address
        config = NodeConfig(
            state_dir=str(tmp_path / "state"),
            mesh_secret=SECRET,
            listen_host="127.0.0.1",
            join=(f"{host}:{port}",),
            mdns=DiscoveryConfig(enabled=False),
            fetch=FetchConfig(holder_wait_s=1.0),
        )
        ended: list[BaseException] = []
        try:
            with trio.fail_after(MANIFEST_TIMEOUT_S * 4):
                await bootstrap_store(config, asker, psk, "0123456789abcdef", tmp_path / "cache")
        except* ModelUnavailable as group:  # `meshd serve` finds it in the group: one line
            ended += group.exceptions
        nursery.cancel_scope.cancel()
    assert [str(e) for e in ended] == [
        "mesh:0123456789abcdef: no `join` peer answered with the model for 1 s "
        "(fetch.holder_wait_s)"
    ]
