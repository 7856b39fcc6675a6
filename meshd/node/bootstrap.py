"""A `mesh:ID` node before it starts: its manifest and small files, from the cache or a peer.

A node started with `--model mesh:ID` holds no files. `bootstrap_store` fetches the manifest
(whose hash is the id) and the small files (config, tokenizer) from a `join` peer (or, with
none, from the peers mDNS shows) before the node starts, so it knows the config and can be
planned; `mesh_basis` makes the node's basis of them. The tensors come later, in the
background, by `meshd/node/fetch.py`'s `ArtifactService`.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from typing import TYPE_CHECKING

import trio

from meshd.mesh.identity import NodeIdentity, admission_policy
from meshd.model.errors import MissingFile, ModelUnavailable
from meshd.model.manifest import ModelStore, store_checkpoint
from meshd.net.endpoint import Endpoint, open_endpoint
from meshd.net.peer_lane import LaneClosedError, PeerLane
from meshd.node.fetch_run import FetchRun
from protocol import artifacts
from protocol.artifacts import (
    ArtifactRefusal,
    ChunkReply,
    FetchConfig,
    Fetcher,
    FetchFailed,
    ManifestReply,
    ManifestRequest,
)
from protocol.errors import RemoteProtocolError
from protocol.noise import x25519_public_from_ed25519_public
from protocol.streams import ARTIFACT_STREAM

if TYPE_CHECKING:
    from meshd.config import NodeConfig
    from meshd.node.basis import NodeBasis

log = logging.getLogger(__name__)

MESH_PREFIX = "mesh:"
MANIFEST_TIMEOUT_S = 5.0
JOIN_RETRY_INITIAL_S = 0.5
JOIN_RETRY_MAX_S = 8.0


def mesh_model_prefix(model: str) -> str | None:
    """The id prefix of a `mesh:ID` model (None: not one). ValueError if ID is malformed."""
    if not model.startswith(MESH_PREFIX):
        return None
    prefix = model[len(MESH_PREFIX) :].strip().lower()
    if not 1 <= len(prefix) <= artifacts.MODEL_ID_CHARS or any(
        c not in "0123456789abcdef" for c in prefix
    ):
        raise ValueError(
            f"model: {model!r}: give mesh:ID with ID (or a prefix of it) in hex, as "
            "`meshctl status` prints it"
        )
    return prefix


async def bootstrap_store(
    config: NodeConfig, identity: NodeIdentity, psk: bytes, prefix: str, root: pathlib.Path
) -> ModelStore:
    """The store of model `prefix`, with its manifest and small files: from the cache when
    they are there (a restart needs no peer), else fetched from a `join` peer (retried, with
    backoff, until one that holds the model answers)."""
    store = await trio.to_thread.run_sync(ModelStore.open_cached, root, prefix)
    if store is not None:
        files = store.file_indices()
        if await trio.to_thread.run_sync(store.held, files) == set(files):
            return store
    addresses = config.bootstrap_peers()
    if not addresses and not config.mdns.enabled:  # a start-up error: one line, exit status 2
        raise MissingFile(
            f"mesh:{prefix} is not in the cache ({root / 'models'}): give a `join` "
            "address of a mesh member (or enable mDNS) so its manifest can be fetched"
        )
    admit = admission_policy(config.admitted_public_keys(), config.revoked_public_keys())
    async with open_endpoint(
        static_private=identity.x25519_private,
        psk=psk,
        bind=(config.listen_host, 0),
        admit=admit,
        lane_config=config.lane,
        node_public_key=identity.public_key,
    ) as endpoint:
        if not addresses:
            return await _bootstrap_by_mdns(config, identity, psk, endpoint, prefix, root, store)
        give_up_at = trio.current_time() + config.fetch.holder_wait_s
        delay = JOIN_RETRY_INITIAL_S
        while True:
            for address in addresses:
                with contextlib.suppress(*_BOOTSTRAP_ERRORS):
                    return await _try_bootstrap(endpoint, address, prefix, root, store, config)
            _give_up_if_due(give_up_at, config, prefix, "no `join` peer")
            await trio.sleep(delay)
            delay = min(delay * 2, JOIN_RETRY_MAX_S)


def _give_up_if_due(give_up_at: float, config: NodeConfig, prefix: str, who: str) -> None:
    """ModelUnavailable (one line, exit status 2) once `fetch.holder_wait_s` passed with no
    peer answering with the model: none holds it, or none is up."""
    if trio.current_time() >= give_up_at:
        raise ModelUnavailable(
            f"mesh:{prefix}: {who} answered with the model for "
            f"{config.fetch.holder_wait_s:.0f} s (fetch.holder_wait_s)"
        )


_BOOTSTRAP_ERRORS = (TimeoutError, LaneClosedError, FetchFailed, RemoteProtocolError)


async def _try_bootstrap(
    endpoint: Endpoint,
    address: tuple[str, int],
    prefix: str,
    root: pathlib.Path,
    store: ModelStore | None,
    config: NodeConfig,
) -> ModelStore:
    """`_bootstrap_from`, its failure logged (and raised)."""
    try:
        return await _bootstrap_from(endpoint, address, prefix, root, store, config.fetch)
    except _BOOTSTRAP_ERRORS as exc:
        log.warning("model mesh:%s from %s: %s", prefix, address, exc)
        raise


async def _bootstrap_by_mdns(
    config: NodeConfig,
    identity: NodeIdentity,
    psk: bytes,
    endpoint: Endpoint,
    prefix: str,
    root: pathlib.Path,
    store: ModelStore | None,
) -> ModelStore:
    """With no `join` address: ask each peer of the mesh that mDNS shows (browsing only: this
    short-lived endpoint is not the node) until one offering the model answers; members that
    do not hold it refuse at once. Tried again whenever a peer appears, and with backoff."""
    from meshd.mesh.discovery import mesh_hash_for, open_discovery

    log.info("model mesh:%s: looking for a member holding it by mDNS", prefix)
    async with open_discovery(
        node_id=identity.node_id,
        key_fingerprint=identity.fingerprint(),
        mesh_hash=mesh_hash_for(psk),
        port=endpoint.local_address[1],
        interfaces=list(config.mdns.interfaces),
        config=config.mdns,
        advertise=False,
    ) as disc:
        events = disc.peers()
        give_up_at = trio.current_time() + config.fetch.holder_wait_s
        delay = JOIN_RETRY_INITIAL_S
        while True:
            for peer in disc.known_peers():
                for host in peer.addresses:
                    with contextlib.suppress(*_BOOTSTRAP_ERRORS):
                        return await _try_bootstrap(
                            endpoint, (host, peer.port), prefix, root, store, config
                        )
            _give_up_if_due(give_up_at, config, prefix, "no peer mDNS shows")
            with trio.move_on_after(delay) as waited:
                await events.receive()  # a peer appeared (or changed): ask again at once
            if waited.cancelled_caught:
                delay = min(delay * 2, JOIN_RETRY_MAX_S)


class _BootstrapLane:
    """One try at a `join` peer over one lane: the manifest (unless the cache has it), then
    the small files this node does not hold."""

    def __init__(self, lane: PeerLane, lane_key: bytes, prefix: str) -> None:
        self.lane, self.lane_key, self.prefix = lane, lane_key, prefix
        self.run: FetchRun | None = None
        self.manifest_reply: list[ManifestReply | ArtifactRefusal] = []
        self.got_manifest = trio.Event()
        self.closed = False

    async def read(self, cancel: trio.CancelScope) -> None:
        """Hand the lane's artifact replies on, until the lane closes (then `cancel`)."""
        async for stream, data in self.lane:
            if stream != ARTIFACT_STREAM:
                continue
            try:
                message = artifacts.decode(data)
            except RemoteProtocolError:
                continue
            if isinstance(message, ManifestReply) or (
                isinstance(message, ArtifactRefusal) and self.run is None
            ):
                self.manifest_reply.append(message)
                self.got_manifest.set()
            elif isinstance(message, ChunkReply | ArtifactRefusal) and self.run is not None:
                self.run.on_reply(message, self.lane_key)
        # The lane closed (the peer stopped, or dropped it): this try ends now; the next one
        # dials again.
        self.closed = True
        cancel.cancel()

    async def manifest(self, root: pathlib.Path, address: tuple[str, int]) -> ModelStore:
        """Ask for the manifest and open the store it describes."""
        prefix = self.prefix
        await self.lane.send(ARTIFACT_STREAM, artifacts.encode(ManifestRequest(1, prefix)))
        with trio.move_on_after(MANIFEST_TIMEOUT_S):
            await self.got_manifest.wait()
        if not self.manifest_reply:
            raise TimeoutError(f"no answer to the manifest request in {MANIFEST_TIMEOUT_S:.0f} s")
        reply = self.manifest_reply[0]
        if isinstance(reply, ArtifactRefusal):
            raise FetchFailed(f"the peer does not hold it ({reply.code}: {reply.detail})")
        model_id, manifest = artifacts.open_manifest(reply.manifest, prefix)
        store = await trio.to_thread.run_sync(
            lambda: ModelStore(root, model_id, reply.manifest, manifest)
        )
        await trio.to_thread.run_sync(store.set_name, reply.name)
        log.info("model mesh:%s is %s (manifest from %s)", prefix, model_id, address)
        return store

    async def fetch_files(self, store: ModelStore, fetch_config: FetchConfig) -> None:
        """Fetch the store's small files this node does not hold."""
        files = store.file_indices()
        held = await trio.to_thread.run_sync(store.held, files)
        missing = [i for i in files if i not in held]
        if not missing:
            return

        async def send(_source: bytes, data: bytes) -> None:
            await self.lane.send(ARTIFACT_STREAM, data)

        fetcher = Fetcher(store.model_id, store.manifest, missing, fetch_config, first_request_id=2)
        self.run = FetchRun(fetcher, store, send, lambda: [self.lane_key])
        await self.run.run()


async def _bootstrap_from(
    endpoint: Endpoint,
    address: tuple[str, int],
    prefix: str,
    root: pathlib.Path,
    store: ModelStore | None,
    fetch_config: FetchConfig,
) -> ModelStore:
    node_id = await endpoint.query_key(address)
    lane_key = x25519_public_from_ed25519_public(node_id)
    lane = await endpoint.connect(address, lane_key)
    peer = _BootstrapLane(lane, lane_key, prefix)

    async def ask(store: ModelStore | None) -> ModelStore:
        if store is None:
            store = await peer.manifest(root, address)
        await peer.fetch_files(store, fetch_config)
        return store

    # A try's failure (`_BOOTSTRAP_ERRORS`: the caller tries again) is raised out here, not
    # from inside the nursery, where it could come wrapped in an exception group the caller
    # does not catch (and the daemon would end with a traceback).
    failure: Exception | None = None
    fetched: ModelStore | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer.read, nursery.cancel_scope)
            try:
                fetched = await ask(store)
            except _BOOTSTRAP_ERRORS as exc:
                failure = exc
            nursery.cancel_scope.cancel()
    finally:
        lane.close("manifest fetched")
    if failure is not None:
        raise failure
    if fetched is None or peer.closed:
        raise FetchFailed("the lane to the peer closed")
    return fetched


async def mesh_basis(config: NodeConfig, prefix: str) -> NodeBasis:
    """What a `mesh:ID` node is before it opens lanes: the store's manifest and small files
    (fetched now if not cached), and a checkpoint over the tensors it holds."""
    from meshd.model.manifest import set_cache_dir
    from meshd.node.basis import NodeBasis
    from protocol.handshake import psk_from_secret

    identity = NodeIdentity.load_or_create(config.state_dir)
    psk = psk_from_secret(config.read_mesh_secret())
    root = config.model_cache_path()
    set_cache_dir(root)
    store = await bootstrap_store(config, identity, psk, prefix, root)
    checkpoint = await trio.to_thread.run_sync(store_checkpoint, store)
    # The tokenizer's files: the store's directory, or a GGUF file's skeleton (its metadata).
    model_dir = checkpoint.directory if store.manifest.format == "gguf" else store.directory
    return NodeBasis.of(
        config,
        identity,
        psk,
        str(model_dir),
        checkpoint,
        # The holders' name for it, so that every node answers to one name for one model.
        name=store.name,
        timing_checkpoint=store_checkpoint(store, synthetic=True),
    )
