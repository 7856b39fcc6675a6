"""`meshd serve`: run the daemon (lanes, discovery, membership, planning, stages, control)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import os
import pathlib
import signal
import socket
import stat
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

import trio

from meshd.config import ConfigError, NodeConfig, add_config_arguments, load_config_from_args
from meshd.logging_setup import setup_logging
from meshd.node.notify import Notifier

if TYPE_CHECKING:
    from meshd.model.stage import LoadProgress
    from meshd.node.basis import NodeBasis
    from meshd.node.stage_slot import LoadDisplay

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every config key as a flag (see docs/configuration.md)."""
    add_config_arguments(parser)


# The exit status of a start-up error no restart can fix (systemd: RestartPreventExitStatus=2).
EXIT_STARTUP_ERROR = 2
# After a graceful stop, how long the last error events and [DONE]s may take to go out.
RESPONSES_FLUSH_S = 2.0


class StartupError(Exception):
    """A model, config, state dir or port error at start: one line on stderr, exit status 2."""


def run(args: argparse.Namespace) -> int:
    """Check the config, secrets, model and ports, then serve until stopped.

    Every error a restart cannot fix (config, secrets, the state dir and identity key, model,
    a port in use) is one line on stderr and exit status 2, whether the checks here find it or
    it surfaces while the daemon starts; any other failure is logged with its traceback, exit
    status 1. The cheap checks run first, so these fail within a second, before the model loads.
    """
    try:
        config = load_config_from_args(args, os.environ)
        config.read_mesh_secret()
        config.read_api_key()
        check_state_dir(config)
        for index, model in enumerate(config.models):
            if index and model.startswith("mesh:"):
                raise StartupError(
                    f"model: {model}: only the first model may be fetched over the mesh "
                    "(mesh:ID); the further ones are local files"
                )
            check_model(model)
        check_draft_model(config.models[0], config.spec.draft_model)
        check_ports(config)
    except (ConfigError, StartupError) as exc:
        print(f"meshd serve: {exc}", file=sys.stderr)
        return EXIT_STARTUP_ERROR
    _prepare_model(config)
    setup_logging(config.log_level, config.log_format)
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        _exit_at_once(0)
    except Exception as exc:
        cause = startup_cause(exc)
        if cause is not None:
            print(f"meshd serve: {cause}", file=sys.stderr)
            return EXIT_STARTUP_ERROR
        # One last structured line (JSON logs too), then a failure status for systemd.
        log.exception("meshd serve failed")
        return 1
    _exit_at_once(0)


def _exit_at_once(status: int) -> NoReturn:
    """Exit without the interpreter's teardown of torch and the other big modules.

    That teardown takes seconds, far longer than the daemon's own stop, and a stop bounded by
    systemd's TimeoutStopSec must not spend it there. Everything the daemon owns is closed by
    now; flush the logs first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _prepare_model(config: NodeConfig) -> None:
    """Hash the first model's tensors in threads while the daemon imports torch
    (`meshd.model.files.prepare`; a GGUF file only)."""
    first = config.models[0]
    if first and not first.startswith("mesh:"):
        from meshd.model.digests import set_cache_dir
        from meshd.model.files import prepare

        set_cache_dir(config.model_cache_path())  # where NodeBasis.load looks too
        prepare(first)


def check_model(model: str) -> None:
    """Raise StartupError unless `model` names a checkpoint the daemon can open ("" = built-in).

    Every rule about the model path lives here; a missing path and a path that is not a
    directory are told apart. Opening the checkpoint reads its config and the safetensors
    headers only (no weights); a GGUF file's header and tensor table are checked without
    importing torch, so a damaged file is one line within a second.
    """
    if model.startswith("mesh:"):
        from meshd.node.bootstrap import mesh_model_prefix

        try:
            mesh_model_prefix(model)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        return
    if not model:
        return
    path = pathlib.Path(model)
    try:
        is_dir = stat.S_ISDIR(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        raise StartupError(f"model: {model} not found") from None
    except OSError as exc:
        raise StartupError(f"model: cannot read {model}: {exc.strerror}") from None
    from meshd.model.errors import ModelError
    from meshd.model.files import check_checkpoint, is_gguf

    if not is_dir and not is_gguf(path):
        raise StartupError(
            f"model: {model} is not a directory: give a Hugging Face checkpoint directory "
            f"(config.json and *.safetensors) or a GGUF file (*.gguf)"
        )
    if is_dir and not (path / "config.json").is_file():
        raise StartupError(
            f"model: {model} has no config.json: not a Hugging Face checkpoint directory"
        )
    try:
        check_checkpoint(path)
    except ModelError as exc:
        raise StartupError(f"model: {exc}") from None
    except OSError as exc:
        raise StartupError(f"model: cannot read {model}: {exc.strerror or exc}") from None


def check_draft_model(model: str, draft: str) -> None:
    """Raise StartupError unless `draft` ("" = none) is a checkpoint whose tokenizer is the
    target model's (or its vocabulary a prefix of the target's); the message names both."""
    if not draft:
        return
    from meshd.model.builtin import builtin_model_dir
    from meshd.model.errors import ModelError
    from meshd.speculative.draft import DraftMismatchError, check_draft_tokenizer

    try:
        check_model(draft)
    except StartupError as exc:
        raise StartupError(f"spec.draft_model: {str(exc).removeprefix('model: ')}") from None
    if model.startswith("mesh:"):
        return  # the tokenizer arrives with the manifest: checked when the draft loads
    try:
        check_draft_tokenizer(model or str(builtin_model_dir()), draft)
    except (DraftMismatchError, ModelError) as exc:
        raise StartupError(f"spec.draft_model: {exc}") from None


def check_state_dir(config: NodeConfig) -> None:
    """Raise StartupError unless the identity key loads (created on first run, so a full,
    read-only or misplaced state dir shows now) and the control socket's directory is writable.
    """
    from meshd.mesh.identity import IdentityError, NodeIdentity

    try:
        NodeIdentity.load_or_create(config.state_dir)
    except IdentityError as exc:
        raise StartupError(str(exc)) from None
    path = config.control_socket_path()
    directory = path.parent
    if not directory.is_dir():
        raise StartupError(
            f"control_socket: cannot create {path}: its directory {directory} does not exist"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(directory) else "is not writable"
        raise StartupError(f"control_socket: cannot create {path}: {directory} {why}")


def _read_only(directory: pathlib.Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_ports(config: NodeConfig) -> None:
    """Raise StartupError when the lane (UDP) or API (TCP) port cannot be bound.

    The daemon binds them only after loading the model; checking first makes a port in use
    one line at once. (A port taken in between still stops the start with exit status 2.)
    """
    wanted = (
        ("listen_port", config.listen_host, config.listen_port, socket.SOCK_DGRAM),
        ("api_port", config.api.host, config.api.port, socket.SOCK_STREAM),
    )
    for key, host, port, kind in wanted:
        if port == 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, kind) as sock:
            if kind == socket.SOCK_STREAM:  # as the listener does: TIME_WAIT does not block
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise StartupError(bind_error(key, kind, host, port, exc)) from None


def bind_error(key: str, kind: int, host: str, port: int, exc: OSError) -> str:
    """The one line for a port the daemon cannot bind (`kind`: SOCK_DGRAM or SOCK_STREAM)."""
    proto = "UDP" if kind == socket.SOCK_DGRAM else "TCP"
    in_use = " (another meshd running?)" if exc.errno == errno.EADDRINUSE else ""
    return f"{key}: cannot bind {proto} {host}:{port}: {exc.strerror or exc}{in_use}"


@contextlib.contextmanager
def _binding(key: str, kind: int, host: str, port: int) -> Iterator[None]:
    """A port taken between `check_ports` and the daemon's own bind is a StartupError too.

    Only the errors a bind gives are turned into one: anything else the task raises is no
    port's fault and keeps its traceback.
    """
    try:
        yield
    except (OSError, ExceptionGroup) as exc:
        failed = _bind_failure(exc)
        if failed is None:
            raise
        raise StartupError(bind_error(key, kind, host, port, failed)) from None


_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL})


def _bind_failure(exc: BaseException) -> OSError | None:
    """The bind error in `exc` or its group (a task's error may arrive wrapped in one)."""
    if isinstance(exc, BaseExceptionGroup):
        return next(filter(None, map(_bind_failure, exc.exceptions)), None)
    return exc if isinstance(exc, OSError) and exc.errno in _BIND_ERRNOS else None


def startup_cause(exc: BaseException) -> str | None:
    """The one-line message of an error no restart can fix, found in `exc` (or its group)."""
    from meshd.mesh.identity import IdentityError
    from meshd.model.errors import ModelError

    leaves = [exc]
    while leaves:
        leaf = leaves.pop(0)
        if isinstance(leaf, BaseExceptionGroup):
            leaves.extend(leaf.exceptions)
        elif isinstance(leaf, ModelError):
            return f"model: {leaf}"
        elif isinstance(leaf, (ConfigError, StartupError, IdentityError)):
            return str(leaf)
        elif isinstance(leaf, OSError) and leaf.errno == errno.EADDRINUSE:
            return f"cannot bind: {leaf}"
    return None


async def serve(config: NodeConfig) -> None:
    """Run one daemon until cancelled."""
    # Imported here so `meshd --help` and config errors stay fast (torch is heavy).
    from meshd.api.metrics import ApiMetrics
    from meshd.api.openai import create_app
    from meshd.api.server import serve_api
    from meshd.node.api_relay import MeshCatalog, model_catalog
    from meshd.node.control import serve_control
    from meshd.node.generation import NodeBackend
    from meshd.node.node import MeshNode, run_node
    from meshd.node.node_metrics import export_metrics
    from meshd.node.prefix_status import export_prefix_metrics
    from meshd.node.shutdown import stop_gracefully
    from meshd.node.status import node_status

    basis = await _open_models(config)
    notifier = Notifier()
    started = trio.Event()
    node: MeshNode
    backend: NodeBackend
    catalog: MeshCatalog
    metrics = ApiMetrics()

    async def graceful() -> None:
        if started.is_set():  # before that, there is nothing to hand over
            await stop_gracefully(node, catalog, config.graceful_timeout_s)  # every model's
            # A generation ends before its HTTP task has written the error event and [DONE]:
            # let those go out before the API is cancelled, or a stream is cut silently.
            with trio.move_on_after(RESPONSES_FLUSH_S):
                await metrics.wait_no_requests()

    async with trio.open_nursery() as nursery:
        await nursery.start(_stop_on_sigterm, nursery.cancel_scope, notifier, graceful)
        # Pings start before READY: loading a big model must not look like a hang.
        nursery.start_soon(_watchdog, notifier)
        lanes = ("listen_port", socket.SOCK_DGRAM, config.listen_host, config.listen_port)
        with _startup_display(config), _binding(*lanes):
            node = await nursery.start(
                functools.partial(run_node, load_display=_load_display(config)), config, basis
            )
        backend = NodeBackend(node, node.models[0])
        catalog = model_catalog(node, backend, config.read_api_key())
        await nursery.start(catalog.run)
        control = config.control_socket_path()
        try:
            await nursery.start(serve_control, node, backend, str(control))
        except OSError as exc:
            raise StartupError(
                f"control_socket: cannot listen on {control}: {exc.strerror}"
            ) from None
        export_metrics(metrics, node, backend)
        export_prefix_metrics(metrics, node)
        app = create_app(
            backend,
            api_key=config.read_api_key(),
            spec=config.spec,
            config=config.api,
            metrics=metrics,
            status=lambda: node_status(node, backend),
            catalog=catalog,
        )
        catalog.app = app
        with _binding("api_port", socket.SOCK_STREAM, config.api.host, config.api.port):
            api = await nursery.start(
                functools.partial(serve_api, header_timeout_s=config.api.header_timeout_s),
                app, config.api.host, config.api.port,
            )  # fmt: skip
        started.set()
        notifier.send(READY="1", STATUS=f"node {node.identity.node_id} serving on {api.base_url}")
        print(
            f"meshd: node {node.identity.node_id} api {api.base_url} "
            f"listening on {node.lane_address}",
            flush=True,
        )


async def _open_models(config: NodeConfig) -> NodeBasis:
    """Open every model `config` names (the built-in one where it names none): the files of
    each, or for a mesh model only its manifest (its stage's tensors come once planned)."""
    from meshd.model.builtin import builtin_model_dir
    from meshd.model.gguf_file import forget_parsed
    from meshd.node.basis import NodeBasis
    from meshd.node.bootstrap import mesh_basis, mesh_model_prefix
    from meshd.node.models import with_models

    first, *more = config.models
    model_dir = first or str(builtin_model_dir())
    prefix = mesh_model_prefix(first)
    if prefix is not None:  # holds no files: manifest first, its stage's tensors once planned
        basis = await mesh_basis(config, prefix)
    else:
        basis = NodeBasis.load(config, model_dir)
    basis = with_models(config, basis, more)
    # Every model is open: the parses of GGUF headers shared while opening them go.
    forget_parsed()
    for files in basis.models:
        log.info(
            "model %s open (id %s, %d layers, quantization %s)",
            files.name or files.model_dir,
            files.shape.model_id[:16],
            files.checkpoint.config.num_layers,
            basis.quantization,
        )
    return basis


def _startup_display(config: NodeConfig) -> contextlib.AbstractContextManager[object]:
    """A rich spinner while the model loads and compute is measured (on a terminal only)."""
    if config.log_format != "text" or not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(
        "loading the model and measuring stage compute …", spinner="dots"
    )


def _load_display(config: NodeConfig) -> LoadDisplay | None:
    """A rich progress bar per stage load on a terminal; elsewhere the log line says how long."""
    if config.log_format != "text" or not sys.stderr.isatty():
        return None
    return _rich_load_bar


@contextlib.contextmanager
def _rich_load_bar(what: str) -> Iterator[LoadProgress | None]:
    """A transient bar over the bytes a stage load reads (updated from the loading thread)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(what, total=None)

    def update(done_bytes: int, total_bytes: int) -> None:
        bar.update(task, completed=done_bytes, total=total_bytes)

    with bar:
        yield update


async def _stop_on_sigterm(
    scope: trio.CancelScope,
    notifier: Notifier,
    graceful: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGTERM (systemctl stop, the demo): stop gracefully (`meshd/node/shutdown.py`), then
    cancel everything, exit status 0. A second SIGTERM (or Ctrl-C) stops at once."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        await signals.__anext__()
        log.info("SIGTERM: stopping")
        notifier.send(STOPPING="1")
        notifier.send(STATUS="stopping: finishing requests in flight")
        async with trio.open_nursery() as stopping:

            async def at_once() -> None:
                await signals.__anext__()
                log.info("second SIGTERM: stopping at once")
                stopping.cancel_scope.cancel()

            stopping.start_soon(at_once)
            await graceful()
            stopping.cancel_scope.cancel()
        scope.cancel()


async def _watchdog(notifier: Notifier) -> None:
    """WATCHDOG=1 every WATCHDOG_USEC/2 from the trio loop (a stuck loop stops the pings)."""
    interval = notifier.watchdog_interval_s()
    if interval is None:
        return
    while True:
        notifier.send(WATCHDOG="1")
        await trio.sleep(interval)
