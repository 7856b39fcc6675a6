"""Suite-wide settings: deterministic hypothesis profile, and which tests may run side by side.

`scripts/test` runs pytest on two workers (pytest-xdist, `--dist loadgroup`, the scheduler
below). Every test module is one unit of work, so its module-scoped set-up (a shared pipeline,
a loaded model) is built once. The modules that start real daemons, bind loopback addresses,
ports and mDNS, or measure threads and time form two serial groups: each group's modules run on
one worker, one after the other, and the two groups run at once, one on each worker. Each group
binds a block of loopback addresses of its own (`tests/node/daemons.py`'s `loopback`), so two
modules running at once never bind the same address; daemons of different meshes ignore each
other's mDNS announcements (a fresh secret per worker, docs/discovery.md). Then both workers
run the remaining modules, which bind nothing fixed.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.node import daemons

settings.register_profile(
    "meshd",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshd")

TESTS = pathlib.Path(__file__).parent
# The serial groups, in the order they are handed out (the first to the first worker); a
# group's index is its block of loopback addresses (`daemons.use_block`).
SERIAL_GROUPS = ("serial-a", "serial-b")
# Folders whose every module runs in a serial group, and single modules elsewhere.
SERIAL_FOLDERS = ("node", "cli", "examples", "systemd", "net")
SERIAL_MODULES = (
    # the benchmarks that start daemons or assert timings; the others run in-process
    "bench/test_chaos.py",
    "bench/test_fetch.py",
    "bench/test_load.py",
    "bench/test_pipeline.py",
    "bench/test_threads.py",
    "api/test_console_browser.py",
    "api/test_edge.py",
    "api/test_origin_policy.py",
    "api/test_server.py",
    "mesh/test_config.py",
    "mesh/test_discovery.py",
    "mesh/test_jointoken.py",
    "mesh/test_membership.py",
    "model/test_kernels.py",
    "model/test_threads.py",
    "protocol/test_gossip_capacity.py",
    "plan/test_scale.py",
    "protocol/test_sans_io.py",
    "speculative/test_policy.py",
    "test_logging_setup.py",
)
# The serial modules of the second group ("serial-b"); every other one is in "serial-a".
# Balanced by measured duration (docs/operations.md, "The test suite"). The modules that
# assert timings or thread counts (bench/test_pipeline, bench/test_threads, model/test_threads,
# model/test_kernels, plan/test_scale, speculative/test_policy) are all here, one after the
# other, so that no two of them measure at once.
SECOND_GROUP = (
    "bench/test_chaos.py",
    "bench/test_fetch.py",
    "bench/test_load.py",
    "bench/test_pipeline.py",
    "bench/test_threads.py",
    "cli/test_demo.py",
    "model/test_kernels.py",
    "model/test_threads.py",
    "node/test_block_quantization_daemon.py",
    "node/test_daemon.py",
    "node/test_fetch_mdns.py",
    "node/test_fetch_prefetch.py",
    "node/test_gguf_daemons.py",
    "node/test_gguf_kills.py",
    "node/test_kill_drain.py",
    "node/test_metrics_daemons.py",
    "node/test_several_models.py",
    "plan/test_scale.py",
    "speculative/test_policy.py",
)


def xdist_group(path: pathlib.Path) -> str:
    """The group of the test module at `path`: one of SERIAL_GROUPS, or the module itself."""
    relative = path.resolve().relative_to(TESTS)
    name = relative.as_posix()
    if relative.parts[0] in SERIAL_FOLDERS or name in SERIAL_MODULES:
        return SERIAL_GROUPS[1] if name in SECOND_GROUP else SERIAL_GROUPS[0]
    return name


def address_block(path: pathlib.Path) -> int | None:
    """The loopback block of the module at `path`: its serial group's index, or None."""
    group = xdist_group(path)
    return SERIAL_GROUPS.index(group) if group in SERIAL_GROUPS else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test's fixtures are set up: the addresses its module's group may bind."""
    daemons.use_block(address_block(item.path))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadgroup`: one unit of work per group (`xdist_group` above), the serial
    groups handed out first, one to each worker. (xdist's own loadgroup reads `xdist_group` marks
    into node ids, which pytest 9 no longer lets a plugin rewrite: its groups split.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(config.rootpath / nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node: Any) -> None:
            for group in reversed(SERIAL_GROUPS):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


@pytest.fixture(autouse=True)
def _one_torch_thread_outside_the_serial_groups(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under xdist, a test outside the serial groups runs torch on one thread: its tensors are
    small, and a second spinning intra-op thread would take the core that the other worker's
    daemons need (see tests/model/conftest.py). The previous setting is restored after."""
    if "PYTEST_XDIST_WORKER" not in os.environ or xdist_group(request.path) in SERIAL_GROUPS:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
