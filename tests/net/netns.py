"""Two private LANs behind Linux NAT routers on a shared "internet", built from namespaces.

    hostA (10.201.1.2) -- natA [lan 10.201.1.1 | wan 198.18.1.2] -- 198.18.1.1 +
                                                                             pub (198.18.0.1)
    hostB (10.201.2.2) -- natB [lan 10.201.2.1 | wan 198.18.2.2] -- 198.18.2.1 +

`pub` is a router (the "internet": one hop between the NATs, as there always is at least one)
and holds the introducer's address on its loopback. Each NAT router runs
`iptables -t nat -A POSTROUTING -o wan -j MASQUERADE` (optionally `--random-fully`, which gives
every new flow a random port: symmetric NAT in practice). Routers have no route into the other
LAN, so the only way in is a NAT mapping, as on a home router. Every address lives only inside
these namespaces; `NatTopology.delete()` removes them all (and with them the veths and rules).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

PUBLIC_INTRODUCER = "198.18.0.1"
NAT_WAN = {"A": "198.18.1.2", "B": "198.18.2.2"}
_PUB_SIDE = {"A": "198.18.1.1", "B": "198.18.2.1"}
HOST_LAN = {"A": "10.201.1.2", "B": "10.201.2.2"}
_ROUTER_LAN = {"A": "10.201.1.1", "B": "10.201.2.1"}
# How long the routers keep an idle UDP mapping (see _wire_router).
UDP_MAPPING_TIMEOUT_S = 2
_ids = itertools.count()


class TopologyUnavailable(Exception):
    """This machine cannot build the topology (not root, or no `ip netns`/iptables)."""


@dataclass(frozen=True)
class NatTopology:
    """Names of the five namespaces of one test (unique per process and call)."""

    pub: str
    nat_a: str
    nat_b: str
    host_a: str
    host_b: str

    @property
    def all(self) -> tuple[str, ...]:
        """Every namespace, hosts first (deletion order does not matter)."""
        return (self.host_a, self.host_b, self.nat_a, self.nat_b, self.pub)

    def exec_prefix(self, netns: str) -> list[str]:
        """The command prefix that runs a program inside `netns`."""
        return ["ip", "netns", "exec", netns]

    def conntrack_ports(self, side: str) -> list[str]:
        """The router's conntrack table (for failure messages)."""
        ns = self.nat_a if side == "A" else self.nat_b
        out = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/nf_conntrack"],
            capture_output=True,
            text=True,
        )
        return out.stdout.splitlines()

    def delete(self) -> None:
        """Remove every namespace (veths and rules go with them)."""
        for ns in self.all:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def check_available() -> None:
    """Raise TopologyUnavailable with the reason if the topology cannot be built here."""
    if os.geteuid() != 0:
        raise TopologyUnavailable("needs root to create network namespaces and NAT rules")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            raise TopologyUnavailable(f"needs `{tool}` (iproute2 / iptables packages)")


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise TopologyUnavailable(f"{' '.join(args)}: {done.stderr.strip()}")


def build(*, random_fully: bool) -> NatTopology:
    """Create the topology; raises TopologyUnavailable (after cleaning up) if a step fails."""
    check_available()
    tag = f"{os.getpid()}-{next(_ids)}"
    topo = NatTopology(
        pub=f"mnat-pub-{tag}",
        nat_a=f"mnat-ra-{tag}",
        nat_b=f"mnat-rb-{tag}",
        host_a=f"mnat-ha-{tag}",
        host_b=f"mnat-hb-{tag}",
    )
    try:
        for ns in topo.all:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", topo.pub, "addr", "add", f"{PUBLIC_INTRODUCER}/32", "dev", "lo")
        _run("ip", "netns", "exec", topo.pub, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for side, router, host in (("A", topo.nat_a, topo.host_a), ("B", topo.nat_b, topo.host_b)):
            _wire_router(topo.pub, side, router, host, random_fully=random_fully)
    except BaseException:
        topo.delete()
        raise
    return topo


def _wire_router(pub: str, side: str, router: str, host: str, *, random_fully: bool) -> None:
    # WAN: a veth from the router to pub, the router's default route.
    _run("ip", "-n", router, "link", "add", "wan", "type", "veth", "peer", f"p{side}", "netns", pub)
    _run("ip", "-n", pub, "addr", "add", f"{_PUB_SIDE[side]}/24", "dev", f"p{side}")
    _run("ip", "-n", pub, "link", "set", f"p{side}", "up")
    _run("ip", "-n", router, "addr", "add", f"{NAT_WAN[side]}/24", "dev", "wan")
    _run("ip", "-n", router, "link", "set", "wan", "up")
    _run("ip", "-n", router, "route", "add", "default", "via", _PUB_SIDE[side])
    # LAN: a veth from the router to its one host, whose default route is the router.
    _run("ip", "-n", router, "link", "add", "lan", "type", "veth", "peer", "eth0", "netns", host)
    _run("ip", "-n", router, "addr", "add", f"{_ROUTER_LAN[side]}/24", "dev", "lan")
    _run("ip", "-n", router, "link", "set", "lan", "up")
    _run("ip", "-n", host, "addr", "add", f"{HOST_LAN[side]}/24", "dev", "eth0")
    _run("ip", "-n", host, "link", "set", "eth0", "up")
    _run("ip", "-n", host, "route", "add", "default", "via", _ROUTER_LAN[side])
    _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    rule = ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"]
    if random_fully:
        rule.append("--random-fully")
    _run("ip", "netns", "exec", router, "iptables", *rule)
    # Short UDP mapping lifetimes (Linux defaults: 30 s, 120 s once both ways were seen), so a
    # test can show that keepalives hold a mapping past its lifetime within seconds.
    for name in ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
        key = f"net.netfilter.{name}={UDP_MAPPING_TIMEOUT_S}"
        _run("ip", "netns", "exec", router, "sysctl", "-qw", key)
