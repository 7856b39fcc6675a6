"""Suite-wide settings: deterministic hypothesis profile, and which tests may run side by side.

`MESHD_TEST_WORKERS=2 scripts/test` runs pytest on two workers (pytest-xdist, `--dist loadgroup`,
the scheduler below). Every test module is one unit of work, so its module-scoped set-up (a
shared pipeline, a loaded model) is built once. The serial group's modules share one worker, one after the other,
as they did in one process: they start real daemons or bind fixed loopback addresses, ports and
mDNS (two of them at once would bind the same address or join each other's mesh), or they
measure threads and time.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "meshd",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshd")

TESTS = pathlib.Path(__file__).parent
# The group of the modules that run one after the other on one worker.
SERIAL = "serial"
# Folders whose every module runs in the serial group, and single modules elsewhere.
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


def xdist_group(path: pathlib.Path) -> str:
    """The group of the test module at `path`: SERIAL, or the module itself."""
    relative = path.resolve().relative_to(TESTS)
    if relative.parts[0] in SERIAL_FOLDERS or relative.as_posix() in SERIAL_MODULES:
        return SERIAL
    return relative.as_posix()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadgroup`: one unit of work per group (`xdist_group` above), the serial group
    handed out first, to the first worker. (xdist's own loadgroup reads `xdist_group` marks
    into node ids, which pytest 9 no longer lets a plugin rewrite: its groups split.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(config.rootpath / nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node: Any) -> None:
            if SERIAL in self.workqueue:
                self.workqueue.move_to_end(SERIAL, last=False)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


@pytest.fixture(autouse=True)
def _one_torch_thread_beside_the_serial_worker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under xdist, a test outside the serial group runs torch on one thread: its tensors are
    small, and a second spinning intra-op thread would take the core that the other worker's
    daemons need (see tests/model/conftest.py). The previous setting is restored after."""
    if "PYTEST_XDIST_WORKER" not in os.environ or xdist_group(request.path) == SERIAL:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
