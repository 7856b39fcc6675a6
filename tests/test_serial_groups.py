"""The two serial groups of tests/conftest.py run at once: no two of their modules may bind the
same loopback address. Every module takes its addresses from `tests/node/daemons.py` (its
group's block); these checks fail when one writes an address of its own or when a module that
binds addresses is left out of the serial groups."""

from __future__ import annotations

import re

import pytest

from tests.conftest import (
    SECOND_GROUP,
    SERIAL_FOLDERS,
    SERIAL_GROUPS,
    SERIAL_MODULES,
    TESTS,
    address_block,
    xdist_group,
)
from tests.node import daemons

# An address 127.0.0.N other than 127.0.0.1 written in a module (a literal, an f-string, or a
# `--first-host` of a daemon-starting command): it would not move with the module's group.
OWN_ADDRESS = re.compile(r"127\.0\.0\.(\{|[02-9]|1\d)|\"--first-host\", \"")
# Modules where such an address is data that nothing binds, or lives in a namespace of its own.
NOT_BOUND = {
    "mesh/test_discovery.py": "every node is in a network namespace the test creates",
    "protocol/test_gossip_capacity.py": "an address inside a capacity record",
    "api/test_origin_policy.py": "a Host header",
    "api/test_server.py": "an address asked whether it is loopback",
    "mesh/test_config.py": "an address asked whether it is loopback",
    "cli/test_meshctl_status.py": "status rows printed by meshctl",
}
# What a module uses to bind the addresses of its group.
BINDS = re.compile(r"\b(Daemon|loopback|host_number)\(")


def _modules() -> list[str]:
    return sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*.py"))


def test_no_module_writes_a_loopback_address_of_its_own() -> None:
    found = {
        name: match.group(0)
        for name in _modules()
        if name not in NOT_BOUND and name != "node/daemons.py"
        for match in [OWN_ADDRESS.search((TESTS / name).read_text())]
        if match
    }
    assert not found, f"use tests/node/daemons.py's loopback()/host_number() instead: {found}"


def test_every_module_that_binds_addresses_is_in_a_serial_group() -> None:
    binding = [n for n in _modules() if n.rsplit("/", 1)[-1].startswith("test_")]
    binding = [n for n in binding if n != "test_serial_groups.py"]
    binding = [n for n in binding if BINDS.search((TESTS / n).read_text())]
    assert binding  # the daemon tests are found
    outside = [n for n in binding if xdist_group(TESTS / n) not in SERIAL_GROUPS]
    assert not outside, f"these bind loopback addresses beside any other module: {outside}"


def test_every_second_group_module_exists_and_is_serial() -> None:
    for name in SECOND_GROUP:
        assert (TESTS / name).is_file(), name
        assert name.split("/")[0] in SERIAL_FOLDERS or name in SERIAL_MODULES, name
        assert xdist_group(TESTS / name) == SERIAL_GROUPS[1]


def test_the_groups_blocks_are_disjoint_and_a_module_outside_them_gets_none() -> None:
    blocks = []
    try:
        for block in range(len(SERIAL_GROUPS)):
            daemons.use_block(block)
            numbers = [daemons.host_number(i) for i in range(2, daemons.LAST_INDEX + 1)]
            assert all(2 <= n <= 254 for n in numbers)
            blocks.append(set(numbers))
            with pytest.raises(ValueError):
                daemons.loopback(daemons.LAST_INDEX + 1)
        assert not blocks[0] & blocks[1]
        daemons.use_block(address_block(TESTS / "model" / "test_blocks.py"))
        with pytest.raises(AssertionError, match="serial group"):
            daemons.loopback(2)
    finally:
        daemons.use_block(address_block(TESTS / "test_serial_groups.py"))
