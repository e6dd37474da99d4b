"""Server network namespaces joined to this host by a veth pair.

Server-side copy only pays off when the wire is the bottleneck, so the SMB
tests put each server behind its own veth link, optionally shaped with tc tbf
on each direction (at one rate, or at two for an asymmetric link such as
ASYMMETRIC), and count the bytes that cross the client end. Addresses
come from 10.213.0.0/16, one /24 per namespace; they exist only on our veths.

Namespaces are named offloadfs-lab-PID-N so parallel runs never collide; one
left behind by a run that died (its PID gone) is removed by the next run.
"""

import contextlib
import fcntl
import ipaddress
import itertools
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pyroute2 import IPRoute, netns

PREFIX = "offloadfs-lab-"
NETWORK = ipaddress.ip_network("10.213.0.0/16")
LOCK = "/run/lock/offloadfs-lab.lock"
NETNS_DIR = Path("/run/netns")
# Larger than one 64 KiB GSO packet so tbf never has to split one; small
# enough that the initial burst is a few ms even at 100 Mbit/s.
BURST = 128 << 10
LATENCY = "50ms"
# (down, up): a laptop at home or over a VPN, where what a tool sends up to
# the server is the bottleneck.
ASYMMETRIC = ("1gbit", "50mbit")

_serial = itertools.count()


@dataclass(frozen=True)
class Counters:
    """Byte counters of the client veth (rx: server -> client)."""

    rx: int
    tx: int


@dataclass(frozen=True)
class Namespace:
    """A live server namespace; addresses are strings."""

    name: str
    client_if: str
    client_addr: str
    server_addr: str

    def counters(self):
        """Bytes that crossed the client end of the link so far."""
        stats = Path("/sys/class/net", self.client_if, "statistics")
        return Counters(int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    def command(self, *args):
        """argv that runs `args` in the namespace (only the network is switched)."""
        return ["nsenter", f"--net={NETNS_DIR / self.name}", "--", *map(str, args)]

    def popen(self, *args, **kwargs):
        """subprocess.Popen of `args` in the namespace; the pid is the program's own."""
        return subprocess.Popen(self.command(*args), **kwargs)


def client_if_name(pid, serial):
    """Root-side veth name (15 characters at most, as the kernel demands)."""
    return f"ofl{pid}c{serial}"


def pids_in(name):
    """Pids of the processes whose network namespace is `name`."""
    target = os.stat(NETNS_DIR / name).st_ino
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns/net").st_ino == target:
                    pids.append(int(entry.name))
    return pids


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def destroy(name, client_if):
    """Kill what runs in the namespace, then delete the veth and the namespace.

    A process left inside would keep the namespace, and with it the veth and
    its address, alive after the name is gone.
    """
    if (NETNS_DIR / name).exists():
        pids = pids_in(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=client_if):
            with contextlib.suppress(Exception):
                ipr.link("del", index=index)
    if (NETNS_DIR / name).exists():
        netns.remove(name)


def remove_stale():
    """Remove namespaces of our prefix whose creating process is dead."""
    for name in netns.listnetns():
        if not name.startswith(PREFIX):
            continue
        pid, serial = name[len(PREFIX):].split("-")
        if not pid_alive(int(pid)):
            destroy(name, client_if_name(pid, serial))


def free_subnet(ipr):
    """First 10.213.X.0/24 with no address on any interface of this namespace."""
    used = set()
    for msg in ipr.get_addr(family=socket.AF_INET):
        addr = ipaddress.ip_address(msg.get_attr("IFA_ADDRESS"))
        if addr in NETWORK:
            used.add(addr.packed[2])
    for third in range(1, 255):
        if third not in used:
            return ipaddress.ip_network(f"10.213.{third}.0/24")
    raise RuntimeError(f"no free /24 left in {NETWORK}")


def shape(ipr, index, rate):
    ipr.tc("add", "tbf", index=index, handle="1:", rate=rate, burst=BURST, latency=LATENCY)


def directions(rate):
    """(down, up) of a rate: one for both ("1gbit"), or a (down, up) pair; None leaves that way unshaped."""
    return tuple(rate) if isinstance(rate, (tuple, list)) else (rate, rate)


@contextlib.contextmanager
def server_namespace(rate=None):
    """Yield a Namespace linked to this one by a veth pair.

    rate ("100mbit", "1gbit", ...) shapes both directions with tc tbf; a
    (down, up) pair such as ASYMMETRIC shapes server -> client at down and
    client -> server at up (each veth end shapes what it sends). The
    namespace, the veth and any process still inside are gone on exit, also
    when the body or the setup itself fails.
    """
    down, up = directions(rate)
    pid, serial = os.getpid(), next(_serial)
    name, client_if = f"{PREFIX}{pid}-{serial}", client_if_name(pid, serial)
    try:
        # One lock around choosing the subnet and claiming it, so that two
        # runs starting together cannot pick the same /24.
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            remove_stale()
            netns.create(name)
            with IPRoute() as ipr:
                subnet = free_subnet(ipr)
                client_addr, server_addr = str(subnet[1]), str(subnet[2])
                ipr.link("add", ifname=client_if, kind="veth", peer={"ifname": "lab0", "net_ns_fd": name})
                index = ipr.link_lookup(ifname=client_if)[0]
                ipr.addr("add", index=index, address=client_addr, prefixlen=24)
                ipr.link("set", index=index, state="up")
                if up:
                    shape(ipr, index, up)
        with IPRoute(netns=name) as ipr:
            for ifname in ("lo", "lab0"):
                ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state="up")
            index = ipr.link_lookup(ifname="lab0")[0]
            ipr.addr("add", index=index, address=server_addr, prefixlen=24)
            if down:
                shape(ipr, index, down)
        yield Namespace(name, client_if, client_addr, server_addr)
    finally:
        destroy(name, client_if)
