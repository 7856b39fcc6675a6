"""Suite-wide settings: deterministic hypothesis profile, and which tests may run side by side.

`scripts/test` runs the suite on two pytest-xdist workers with `--dist loadgroup`. Tests that
start `meshd serve` daemons bind fixed loopback addresses (127.0.0.N, some with fixed ports)
and find each other by mDNS on them, so two modules on the same addresses must never overlap:
each module that starts daemons goes to an xdist group, whose tests one worker runs one after
another. `OWN_ADDRESSES` lists the modules whose addresses no other group uses; they form a
second group that may run beside the first. Every other daemon module (a new one too, found by
`_STARTS_DAEMONS`) is in the first. Without xdist the mark is inert.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "meshd",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("meshd")

DAEMON_GROUP = "loopback-daemons"
OWN_GROUP = "loopback-daemons-own-addresses"
# Addresses (127.0.0.N) and fixed ports of the second group's modules; no module of the first
# group may use them. A module added here must be checked against every daemon module.
OWN_ADDRESSES = {
    "tests/bench/test_chaos.py": "51-54, 56-59 (--first-host)",
    "tests/bench/test_load.py": "37-39 (--first-host)",
    "tests/cli/test_demo.py": "21-24 (the demo's --first-host) and 127.0.0.1 port 0",
    "tests/api/test_console_browser.py": "120-122",
    "tests/node/test_fetch_mdns.py": "51-53",
    "tests/node/test_block_quantization_daemon.py": "21",
    "tests/node/test_fetch_mesh.py": "31-39, ports 17431-17434",
}
# What in a test module's source means it starts daemons on fixed loopback addresses: the
# numbered test daemons, the supervisor they and the demo and benches use, a bench's or the
# demo's `--first-host`, or a `meshd serve` given a `--listen-host` other than 127.0.0.1
# (daemons on 127.0.0.1 with port 0, as tests/cli/test_serve_startup.py's, collide with none).
_STARTS_DAEMONS = re.compile(
    r'\bDaemon\(|meshd\.cli\.supervisor|--first-host|"--listen-host",\s*"127\.0\.0\.(?!1")'
    r"|ChaosMesh|DaemonMesh"
)


@functools.cache
def _starts_daemons(path: pathlib.Path) -> bool:
    return bool(_STARTS_DAEMONS.search(path.read_text(errors="replace")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix() in OWN_ADDRESSES:
            item.add_marker(pytest.mark.xdist_group(OWN_GROUP))
        elif _starts_daemons(item.path):
            item.add_marker(pytest.mark.xdist_group(DAEMON_GROUP))
