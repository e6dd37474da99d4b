"""The lab's links: an asymmetric one is shaped on each direction at its own rate.

Run with -s to see the transfer times it prints.
"""

import os
import socket
import subprocess
import sys
import time

import pytest

from offloadfs.lab import net

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab's namespaces need root")

SIZE = 2 << 20
UPLINK_BITS = 50e6  # per second: net.ASYMMETRIC's up, as the qdisc shows it ("rate 50Mbit")
# Accepts one connection at a time: b"d" asks for SIZE bytes down, b"u" announces SIZE bytes up, answered
# with b"k" once all arrived (so the sender's clock stops when the bytes are across, not in its buffer).
SERVER = """
import socket, sys
size = int(sys.argv[2])
listener = socket.create_server((sys.argv[1], 0))
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    with conn:
        if conn.recv(1) == b"d":
            conn.sendall(bytes(size))
        else:
            got = 0
            while got < size and (chunk := conn.recv(1 << 20)):
                got += len(chunk)
            conn.sendall(b"k")
"""


def recv_exactly(conn, size):
    got = 0
    while got < size:
        chunk = conn.recv(min(size - got, 1 << 20))
        assert chunk, f"the server closed after {got} of {size} bytes"
        got += len(chunk)


def timed(address, direction):
    """Seconds SIZE bytes took to cross the link in `direction` ("down": server -> client)."""
    with socket.create_connection(address, timeout=30) as conn:
        start = time.monotonic()
        if direction == "down":
            conn.sendall(b"d")
            recv_exactly(conn, SIZE)
        else:
            conn.sendall(b"u" + bytes(SIZE))
            recv_exactly(conn, 1)
        return time.monotonic() - start


def qdisc(command):
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def test_directions_of_a_rate():
    assert net.directions("1gbit") == ("1gbit", "1gbit")
    assert net.directions(("1gbit", "50mbit")) == ("1gbit", "50mbit")
    assert net.directions(None) == (None, None)


def test_asymmetric_link_sends_up_slower_than_down():
    with net.server_namespace(net.ASYMMETRIC) as ns:
        assert "rate 50Mbit" in qdisc(["tc", "qdisc", "show", "dev", ns.client_if])
        assert "rate 1Gbit" in qdisc(ns.command("tc", "qdisc", "show", "dev", "lab0"))
        server = ns.popen(sys.executable, "-c", SERVER, ns.server_addr, SIZE, stdout=subprocess.PIPE, text=True)
        try:
            address = (ns.server_addr, int(server.stdout.readline()))
            before = ns.counters()
            down, up = timed(address, "down"), timed(address, "up")
            after = ns.counters()
        finally:
            server.kill()
            server.wait()
    print(f"\n{SIZE >> 20} MiB on {net.ASYMMETRIC}: down {down:.3f} s, up {up:.3f} s, up/down {up / down:.1f}")
    assert after.rx - before.rx >= SIZE and after.tx - before.tx >= SIZE
    # A floor, not a measure: past its burst the token bucket passes 50 Mbit/s at most, however
    # idle the machine (a busy one only adds time).  No ratio to the down time: load decides that.
    assert up >= (SIZE - net.BURST) * 8 / UPLINK_BITS, up
