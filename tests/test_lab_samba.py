"""The Samba lab works for real: shares on each filesystem, passwords,
namespaces, shaping, crash/restart, and a teardown that leaves nothing.

Run with -s to see the start-up and transfer times it prints.
"""

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from smbprotocol.connection import Connection
from smbprotocol.exceptions import LogonFailure
from smbprotocol.header import NtStatus
from smbprotocol.open import (
    CreateDisposition,
    CreateOptions,
    FileAttributes,
    FilePipePrinterAccessMask,
    ImpersonationLevel,
    Open,
    ShareAccess,
)
from smbprotocol.session import Session
from smbprotocol.tree import TreeConnect

from offloadfs.lab import net, samba
from offloadfs.lab.loopfs import is_mounted

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the Samba lab needs root (namespaces, loop mounts)"),
    pytest.mark.skipif(shutil.which("smbd") is None, reason="smbd is not installed (apt-get install samba)"),
]

CHUNK = 1 << 20
KINDS = ("btrfs", "xfs", "ext4")


@contextlib.contextmanager
def tree(server, share, password=None):
    """A tree connect to share, logged in as the lab user."""
    conn = Connection(uuid.uuid4(), server.host, server.port)
    conn.connect(timeout=5)
    try:
        session = Session(conn, server.username, password or server.password)
        session.connect()
        connected = TreeConnect(session, server.unc(share))
        connected.connect()
        yield connected
    finally:
        # Disconnecting the tree first would leave dangling opens.
        conn.disconnect(True)


def open_file(tree, name, disposition):
    handle = Open(tree, name)
    handle.create(
        ImpersonationLevel.Impersonation,
        FilePipePrinterAccessMask.GENERIC_READ | FilePipePrinterAccessMask.GENERIC_WRITE,
        FileAttributes.FILE_ATTRIBUTE_NORMAL,
        ShareAccess.FILE_SHARE_READ,
        disposition,
        CreateOptions.FILE_NON_DIRECTORY_FILE,
    )
    return handle


def write_file(tree, name, data):
    handle = open_file(tree, name, CreateDisposition.FILE_OVERWRITE_IF)
    try:
        offset = 0
        while offset < len(data):
            # A write can be shorter than asked; follow the count it returns.
            offset += handle.write(data[offset : offset + CHUNK], offset)
    finally:
        handle.close()


def read_file(tree, name):
    handle = open_file(tree, name, CreateDisposition.FILE_OPEN)
    try:
        data = bytearray()
        while len(data) < handle.end_of_file:
            data += handle.read(len(data), min(CHUNK, handle.end_of_file - len(data)))
        return bytes(data)
    finally:
        handle.close()


@pytest.fixture(scope="module")
def lab():
    start = time.monotonic()
    with samba.samba_lab(KINDS, durable=("ext4",)) as lab:
        print(f"\nsamba_lab({KINDS}) up in {time.monotonic() - start:.3f} s")
        yield lab


@pytest.mark.parametrize("kind", KINDS)
def test_share_round_trip(lab, kind):
    server, data = lab.server, os.urandom(3 * CHUNK + 123)
    with tree(server, kind) as share:
        write_file(share, "round-trip", data)
        assert read_file(share, "round-trip") == data
    backing = server.shares[kind].path / "round-trip"
    assert backing.read_bytes() == data
    # force user = root: files belong to the user running the tests.
    assert backing.stat().st_uid == 0
    assert backing.stat().st_mode & 0o777 == 0o644


def test_share_filesystems(lab):
    for kind in KINDS:
        fstype = subprocess.run(
            ["stat", "-f", "-c", "%T", lab.server.shares[kind].path], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert fstype == {"btrfs": "btrfs", "xfs": "xfs", "ext4": "ext2/ext3"}[kind]
    assert "vfs objects = btrfs" in lab.server.conf.read_text()


def test_durable_share_beside_its_kind(lab):
    shares = lab.server.shares
    durable, plain = shares["ext4-durable"], shares["ext4"]
    assert durable.durable and not plain.durable and durable.kind == "ext4"
    assert durable.path.stat().st_dev == plain.path.stat().st_dev != shares["xfs"].path.stat().st_dev
    conf = lab.server.conf.read_text()
    section = conf[conf.index("[ext4-durable]"):]
    assert samba.DURABLE in section and samba.DURABLE not in conf[:conf.index("[ext4-durable]")]
    with tree(lab.server, "ext4-durable") as share:
        write_file(share, "f", b"durable")
    assert (durable.path / "f").read_bytes() == b"durable"


def test_wrong_password_is_refused(lab):
    with pytest.raises(LogonFailure) as failure:
        with tree(lab.server, "ext4", password="not-the-password"):
            pass
    assert failure.value.status == NtStatus.STATUS_LOGON_FAILURE


def test_smbd_start_time(lab):
    """smbd alone, in an existing namespace, on a plain directory."""
    with net.server_namespace() as ns, tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        with samba.smb_server({"plain": (tmp, "local")}, ns) as server:
            print(f"\nsmbd up in {time.monotonic() - start:.3f} s")
            with tree(server, "plain") as share:
                write_file(share, "f", b"x")
        assert (Path(tmp) / "f").read_bytes() == b"x"


def test_loopback_server():
    with tempfile.TemporaryDirectory() as tmp, samba.smb_server({"plain": (tmp, "local")}) as server:
        assert server.host == "127.0.0.1"
        with tree(server, "plain") as share:
            write_file(share, "f", b"loopback")
            assert read_file(share, "f") == b"loopback"


def test_two_servers_at_once():
    with samba.samba_lab(("ext4",), servers=2) as lab:
        first, second = lab.servers
        assert first.host != second.host and first.net.name != second.net.name
        with tree(first, "ext4") as one, tree(second, "ext4") as two:
            write_file(one, "f", b"first")
            write_file(two, "f", b"second")
            assert read_file(one, "f") == b"first"
            assert read_file(two, "f") == b"second"
        assert (first.shares["ext4"].path / "f").read_bytes() == b"first"
        assert (second.shares["ext4"].path / "f").read_bytes() == b"second"


def timed_write(server, size):
    """Write `size` bytes; return (seconds, client veth Counters delta)."""
    data = os.urandom(size)
    before = server.net.counters()
    with tree(server, "ext4") as share:
        start = time.monotonic()
        write_file(share, "big", data)
        seconds = time.monotonic() - start
    after = server.net.counters()
    return seconds, net.Counters(after.rx - before.rx, after.tx - before.tx)


def test_shaping_slows_the_wire(lab):
    size = 20 << 20
    free_s, free_bytes = timed_write(lab.server, size)
    with samba.samba_lab(("ext4",), rate="100mbit") as shaped:
        ns = shaped.server.net
        for cmd in (["tc", "qdisc", "show", "dev", ns.client_if], ns.command("tc", "qdisc", "show", "dev", "lab0")):
            qdisc = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
        shaped_s, shaped_bytes = timed_write(shaped.server, size)
    print(f"\n20 MiB write: unshaped {free_s:.3f} s {free_bytes}, 100mbit {shaped_s:.3f} s {shaped_bytes}")
    assert free_bytes.tx >= size and shaped_bytes.tx >= size


def test_kill_and_restart(lab):
    server = lab.server
    with tree(server, "xfs") as share:
        write_file(share, "before", b"kept")
        pids = samba.server_pids(server.process.pid, str(server.conf))
        assert len(pids) > 1  # the parent and this connection's process
        server.kill()
        assert samba.wait_gone(pids, 0)
        with pytest.raises(Exception):
            read_file(share, "before")
    server.restart()
    with tree(server, "xfs") as share:
        assert read_file(share, "before") == b"kept"


def open_srvsvc(server):
    """Open the srvsvc pipe, which makes smbd start samba-dcerpcd."""
    with tree(server, "IPC$") as ipc:
        pipe = Open(ipc, "srvsvc")
        pipe.create(
            ImpersonationLevel.Impersonation,
            FilePipePrinterAccessMask.FILE_READ_DATA | FilePipePrinterAccessMask.FILE_WRITE_DATA,
            0,
            ShareAccess.FILE_SHARE_READ | ShareAccess.FILE_SHARE_WRITE,
            CreateDisposition.FILE_OPEN,
            0,
        )
        pipe.close()


def cmdline(pid):
    """A process's command line, or b"" once it is gone (rpcd workers come and go)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def test_teardown_leaves_nothing():
    with samba.samba_lab(("btrfs",)) as lab:
        server = lab.server
        with tree(server, "btrfs") as share:
            write_file(share, "f", b"x")
            open_srvsvc(server)
            pids = samba.server_pids(server.process.pid, str(server.conf))
        name, mount, workdir = server.net.name, server.shares["btrfs"].path.parent, server.workdir
        assert any(b"samba-dcerpcd" in cmdline(pid) for pid in pids)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not Path("/sys/class/net", server.net.client_if).exists()
    assert samba.wait_gone(pids, 0)
    assert not samba.server_pids(-1, str(server.conf)) - {-1}
    assert not is_mounted(mount) and not workdir.exists()


def test_smbd_sees_no_other_sambas_winbindd(lab):
    """A winbindd of another Samba on the machine (a lab's AD DC) listens at the socket path compiled into
    smbd; asked, it maps our user's SID to a uid unknown here and every logon fails. Our smbds see an empty
    tmpfs there instead."""
    mounts = Path(f"/proc/{lab.server.process.pid}/mountinfo").read_text().splitlines()
    assert any(line.split()[4] == samba.RUN_DIR and " - tmpfs " in line for line in mounts)


needs_422 = pytest.mark.skipif(not samba.SAMBA_422.available,
                               reason=f"Samba 4.22 is not unpacked at {samba.SAMBA_422.root} (scripts/setup)")

# SMB2 NEGOTIATE (MS-SMB2 2.2.3, 2.2.4): the dialects offered, the capabilities and contexts asked for.
DIALECTS = (0x202, 0x210, 0x300, 0x302, 0x311)
CAP_DIRECTORY_LEASING = 0x20
CAPS = 0x7 | CAP_DIRECTORY_LEASING  # DFS, LEASING, LARGE_MTU
PREAUTH_CONTEXT = 1
POSIX_CONTEXT = 0x100
POSIX_GUID = bytes.fromhex("93AD25509CB411E7B42383DE968BCD7C")
HEADER = 64


def negotiate(host, port=samba.PORT):
    """(dialect, capabilities, negotiate context types) a server answers an SMB 3.1.1 NEGOTIATE with that
    asks for directory leasing and the POSIX extensions."""
    contexts = [(PREAUTH_CONTEXT, struct.pack("<HHH", 1, 32, 1) + os.urandom(32)), (POSIX_CONTEXT, POSIX_GUID)]
    body_size = 36 + 2 * len(DIALECTS)
    offset = HEADER + body_size + (-(HEADER + body_size) % 8)
    body = struct.pack("<HHHHI16sIHH", 36, len(DIALECTS), 1, 0, CAPS, os.urandom(16), offset, len(contexts), 0)
    body += struct.pack(f"<{len(DIALECTS)}H", *DIALECTS)
    body = body.ljust(offset - HEADER, b"\0")
    for kind, data in contexts:
        body = body.ljust(len(body) + (-len(body) % 8), b"\0")
        body += struct.pack("<HHI", kind, len(data), 0) + data
    message = b"\xfeSMB" + struct.pack("<HHIHHIIQIIQ16s", HEADER, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, b"") + body
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall(struct.pack(">I", len(message)) + message)
        size = struct.unpack(">I", recv_exactly(conn, 4))[0]
        reply = recv_exactly(conn, size)
    dialect, count = struct.unpack_from("<HH", reply, HEADER + 4)
    (capabilities,) = struct.unpack_from("<I", reply, HEADER + 24)
    (at,) = struct.unpack_from("<I", reply, HEADER + 60)
    kinds = []
    for _ in range(count):
        kind, length = struct.unpack_from("<HH", reply, at)
        kinds.append(kind)
        at += 8 + length + (-(8 + length) % 8)
    return dialect, capabilities, kinds


def recv_exactly(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


@pytest.fixture(scope="module")
def lab422():
    with samba.samba_lab(("btrfs",), samba=samba.SAMBA_422) as lab:
        yield lab


def inode(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


@needs_422
def test_a_422_server_runs_422_throughout(lab422):
    """smbd, the vfs_btrfs it loads for the share and the samba-dcerpcd it starts for an RPC pipe are
    4.22's own files: modules and helpers are found by paths compiled in, where the installed 4.17's lie."""
    server, root = lab422.server, samba.SAMBA_422.root
    with tree(server, "btrfs") as share:
        write_file(share, "f", b"x")
        open_srvsvc(server)
        pids = samba.server_pids(server.process.pid, str(server.conf))
        exes = {inode(f"/proc/{pid}/exe") for pid in pids if cmdline(pid)}
        maps = "".join(Path(f"/proc/{pid}/maps").read_text() for pid in pids if cmdline(pid))
    for program in ("usr/sbin/smbd", "usr/libexec/samba/samba-dcerpcd"):
        assert inode(root / program) in exes, program
    btrfs = os.stat(root / "usr/lib/x86_64-linux-gnu/samba/vfs/btrfs.so")
    mapped = {int(line.split()[4]) for line in maps.splitlines() if line.endswith("/vfs/btrfs.so")}
    assert mapped == {btrfs.st_ino}
    status = server.run("smbstatus", "-s", str(server.conf), "-j", capture_output=True, text=True, check=True)
    assert json.loads(status.stdout)["version"].startswith("4.22.")


@needs_422
def test_only_a_422_server_offers_posix_extensions_and_directory_leases(lab, lab422):
    """`smb3 unix extensions` must be in [global]: in a share's section alone, 4.22 offers no POSIX
    context at the negotiate. Neither needs `server min protocol = SMB3_11`: the client that asks gets them
    with 3.1.1."""
    assert negotiate(lab.server.host) == (0x311, 0x7, [PREAUTH_CONTEXT])
    assert negotiate(lab422.server.host) == (0x311, 0x7 | CAP_DIRECTORY_LEASING, [PREAUTH_CONTEXT, POSIX_CONTEXT])
