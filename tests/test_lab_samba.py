"""The Samba lab works for real: shares on each filesystem, passwords,
namespaces, shaping, crash/restart, and a teardown that leaves nothing.

Run with -s to see the start-up and transfer times it prints.
"""

import contextlib
import os
import shutil
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
