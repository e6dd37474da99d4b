"""The NFS lab serves for real: ganesha and Linux nfsd (in qemu) answer an
NFSv4.1 client, export /export, refuse v4.0, and leave nothing behind.

There is no NFS client yet, so a tiny one lives here: ONC RPC over TCP with
record marking, EXCHANGE_ID, CREATE_SESSION, then SEQUENCE + PUTROOTFH +
LOOKUP + CREATE + GETATTR. The nfsd test boots two qemu guests (TCG) at
once, ~20 s on two busy cores; it is marked slow. Run with -s to see the
times it prints.
"""

import os
import shutil
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from offloadfs.lab import ganesha, nfsd
from offloadfs.lab.loopfs import is_mounted

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the NFS lab needs root (namespaces, loop mounts, taps)")
needs_ganesha = pytest.mark.skipif(
    shutil.which("ganesha.nfsd") is None or not Path("/usr/lib/x86_64-linux-gnu/ganesha/libfsalvfs.so").exists(),
    reason="nfs-ganesha is not installed (apt-get install nfs-ganesha nfs-ganesha-vfs)",
)
needs_qemu = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None, reason="qemu is not installed (apt-get install qemu-system-x86)"
)

NFS4_OK = 0
NFS4ERR_MINOR_VERS_MISMATCH = 10021
NF4DIR = 2
FATTR4_OWNER = 36
OP_CREATE, OP_GETATTR, OP_LOOKUP, OP_PUTROOTFH = 6, 9, 15, 24
OP_EXCHANGE_ID, OP_CREATE_SESSION, OP_SEQUENCE = 42, 43, 53


def u32(*values):
    return struct.pack(f">{len(values)}I", *values)


def opaque(data):
    return u32(len(data)) + data + b"\0" * (-len(data) % 4)


class NfsClient:
    """Just enough NFSv4.1 to prove a server serves: COMPOUNDs with AUTH_SYS root."""

    def __init__(self, host, port):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.xid = 0
        self.session = None
        self.slot_seq = 0

    def close(self):
        self.sock.close()

    def recv(self, size):
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("server closed the connection")
            data += chunk
        return data

    def call(self, proc, body):
        """One RPC to NFS version 4; returns the result bytes."""
        self.xid += 1
        cred = u32(0) + opaque(b"offloadfs-test") + u32(0, 0, 0)  # stamp, machine, uid 0, gid 0, no gids
        msg = u32(self.xid, 0, 2, 100003, 4, proc, 1) + opaque(cred) + u32(0, 0) + body
        self.sock.sendall(u32(0x80000000 | len(msg)) + msg)
        reply = b""
        while True:
            (mark,) = struct.unpack(">I", self.recv(4))
            reply += self.recv(mark & 0x7FFFFFFF)
            if mark & 0x80000000:
                break
        xid, kind, stat, _, vlen = struct.unpack(">5I", reply[:20])
        end = 20 + vlen + (-vlen % 4)
        (accept,) = struct.unpack(">I", reply[end : end + 4])
        assert (xid, kind, stat, accept) == (self.xid, 1, 0, 0), "RPC not accepted"
        return reply[end + 4 :]

    def compound(self, ops, minor=1):
        """(overall status, the results from their count on); a failed op ends the list."""
        body = opaque(b"") + u32(minor, len(ops)) + b"".join(u32(op) + args for op, args in ops)
        result = self.call(1, body)
        status, taglen = struct.unpack(">II", result[:8])
        rest = result[8 + taglen + (-taglen % 4) :]
        return status, rest

    def exchange_id(self):
        # owner (verifier, id), flags, SP4_NONE, no implementation id
        owner = os.urandom(8) + opaque(f"offloadfs-test-{os.getpid()}-{time.time()}".encode())
        status, rest = self.compound([(OP_EXCHANGE_ID, owner + u32(0, 0, 0))])
        assert status == NFS4_OK, f"EXCHANGE_ID: {status}"
        # results: count, opcode, status, clientid, sequenceid
        count, op, opstatus, clientid, seq = struct.unpack(">IIIQI", rest[:24])
        assert (count, op, opstatus) == (1, OP_EXCHANGE_ID, NFS4_OK)
        return clientid, seq

    def create_session(self):
        clientid, seq = self.exchange_id()
        channel = u32(0, 1 << 20, 1 << 20, 4096, 16, 1, 0)  # pad, sizes, cached, ops, requests, no rdma_ird
        args = struct.pack(">QII", clientid, seq, 0) + channel + channel + u32(0x40000000, 1, 0)  # cb program, AUTH_NONE
        status, rest = self.compound([(OP_CREATE_SESSION, args)])
        assert status == NFS4_OK, f"CREATE_SESSION: {status}"
        self.session = rest[12:28]  # after count, opcode, status

    def mkdir(self, path, name):
        """Create directory path/name (path from the root, e.g. "/export") in
        one session-bound COMPOUND; return its owner as the server reports it."""
        self.slot_seq += 1
        ops = [(OP_SEQUENCE, self.session + u32(self.slot_seq, 0, 0, 0)), (OP_PUTROOTFH, b"")]
        ops += [(OP_LOOKUP, opaque(part.encode())) for part in path.strip("/").split("/")]
        # NF4DIR, name, no attributes; then GETATTR of the new directory's owner.
        ops.append((OP_CREATE, u32(NF4DIR) + opaque(name.encode()) + u32(0, 0)))
        ops.append((OP_GETATTR, u32(2, 0, 1 << (FATTR4_OWNER - 32))))
        status, rest = self.compound(ops)
        assert status == NFS4_OK, f"mkdir {path}/{name}: {status}"
        # Skip the result count, SEQUENCE's (36 bytes), PUTROOTFH's and the
        # LOOKUPs' (none), each after an opcode and a status.
        offset = 4 + 8 + 36 + 8 * (len(ops) - 3)
        # CREATE: change_info4 (20 bytes), then the bitmap of attributes set.
        (words,) = struct.unpack(">I", rest[offset + 28 : offset + 32])
        offset += 32 + 4 * words
        # GETATTR: bitmap, attribute list length, then the owner string.
        (words,) = struct.unpack(">I", rest[offset + 8 : offset + 12])
        offset += 12 + 4 * words + 4
        (size,) = struct.unpack(">I", rest[offset : offset + 4])
        return rest[offset + 4 : offset + 4 + size].decode()


def probe(host, port, export):
    """Check a server like a v4.1 client would: NULL answered, v4.0 refused,
    a session, and a new directory in the export. Returns (name, owner)."""
    assert ganesha.nfs_null(host, port)
    client = NfsClient(host, port)
    try:
        status, _ = client.compound([(OP_PUTROOTFH, b"")], minor=0)
        assert status == NFS4ERR_MINOR_VERS_MISMATCH, "v4.0 should be off"
        client.create_session()
        name = f"probe-{os.urandom(4).hex()}"
        return name, client.mkdir(export, name)
    finally:
        client.close()


def fstype(path):
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()


def netns_names():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@needs_ganesha
def test_ganesha_lab_serves_and_leaves_nothing():
    start = time.monotonic()
    with ganesha.ganesha_lab() as lab:
        server = lab.server
        print(f"\nganesha_lab() up in {time.monotonic() - start:.3f} s")
        assert server.host == server.net.server_addr and server.export == "/export"
        assert fstype(server.path) == "xfs"
        name, _ = probe(server.host, server.port, server.export)
        # Made as root, not squashed, in the server-side directory on this host.
        assert (server.path / name).is_dir() and (server.path / name).stat().st_uid == 0
        pid, ns_name, mount = server.process.pid, server.net.name, server.path.parent
    assert not Path(f"/proc/{pid}").exists()
    assert ns_name not in netns_names()
    assert not is_mounted(mount)


@needs_ganesha
def test_ganesha_kill_and_restart(tmp_path):
    with ganesha.ganesha_server(tmp_path, port=free_port()) as server:
        assert server.host == "127.0.0.1"
        probe(server.host, server.port, server.export)
        server.kill()
        assert not ganesha.nfs_null(server.host, server.port)
        start = time.monotonic()
        server.restart()
        print(f"\nganesha restart in {time.monotonic() - start:.3f} s")
        probe(server.host, server.port, server.export)
        start = time.monotonic()
        server.restart()  # while running: a clean stop first
        print(f"ganesha stop + start in {time.monotonic() - start:.3f} s")
        assert ganesha.nfs_null(server.host, server.port)


@needs_ganesha
def test_ganesha_refuses_a_taken_address(tmp_path):
    port = free_port()
    with ganesha.ganesha_server(tmp_path, port=port):
        with pytest.raises(RuntimeError, match="already answers"):
            with ganesha.ganesha_server(tmp_path, port=port):
                pass


@pytest.mark.slow
@needs_qemu
def test_nfsd_guests_serve_and_leave_nothing():
    start = time.monotonic()
    with nfsd.nfsd_lab(guests=2) as lab:
        print(f"\nnfsd_lab(guests=2) up in {time.monotonic() - start:.1f} s")
        hosts = [guest.host for guest in lab.guests]
        assert len(set(hosts)) == 2 and all(host.startswith(lab.net.server_addr.rsplit(".", 1)[0]) for host in hosts)
        for guest in lab.guests:
            # Numeric owner: made as root, not squashed.
            assert probe(guest.host, guest.port, guest.export)[1] == "0"
        pids = [guest.process.pid for guest in lab.guests]
        ns_name, images = lab.net.name, [guest.image for guest in lab.guests]
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    assert ns_name not in netns_names()
    assert not any(image.exists() for image in images)
