"""A file restored from backup while the client was away never takes our writes (issue 30, case 3).

While the connection is lost (smbd restarted, or the link cut), a program on
the server removes the file we hold open for writing and restores it from a
backup with `cp -a`. On xfs the new file gets the old inode number, which is
Samba's file id, and `cp -a` keeps user.DOSATTRIB, where Samba keeps the
creation time: the restored file matches (file id, creation time) exactly,
which is all a reopen by name could compare. Writing on through it would
splice our next bytes into the backup's and say nothing of the bytes written
before the outage, now gone. Only a durable reconnect that Samba accepts
keeps a handle (it compares the inode's ctime too, which no restore can put
back); without one, the next write, fsync and close fail with EIO.

Each outage holds the client off until the server side is done: smbd is
down (restart), or a proxy in front of it closes every connection (cut)
until smbd has let go of the file. Only then may the client come back.
"""

import errno
import os
import shutil
import time
import uuid
from contextlib import ExitStack

import pytest
import trio
from mpkit import sh

from offloadfs.backends.smb.backend import SMBBackend
from offloadfs.backends.smb.client import RECONNECT_DELAY_MAX
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.proxy import CLOSE, SMB, Proxy

pytestmark = pytest.mark.skipif(shutil.which("smbd") is None, reason="smbd is not installed")

BOUND = 30  # seconds: longer than this is a hang, whatever the machine's load
PIECE = 64 * 1024


@pytest.fixture
def lab_place(smb):
    """Factory: lab_place(kind) -> (mountpoint, server-side directory, outage) for a fresh directory of
    the lab's share ``kind``, mounted through a Proxy.  ``outage(how, files, during)`` loses the
    connection (how: "restart" smbd, or "cut" it at the proxy, which then ends every new connection at
    once), waits until smbd has let go of ``files``, calls ``during()`` while the client is still held
    off, and returns once the mount reaches the server again."""
    server = smb.lab.server
    with ExitStack() as stack:
        proxy = stack.enter_context(Proxy((server.host, server.port), SMB))

        def make(kind):
            name = f"t-{uuid.uuid4().hex[:10]}"
            path = server.shares[kind].path / name
            path.mkdir()
            stack.callback(shutil.rmtree, path, ignore_errors=True)
            url = f"smb://{server.username}@127.0.0.1:{proxy.port}/{kind}/{name}"
            mountpoint = stack.enter_context(offloadfs_mount(url, options=smb.options()))

            def outage(how, files, during=lambda: None):
                if how == "restart":
                    server.kill()
                else:
                    proxy.mutator = lambda record: CLOSE
                    proxy.drop()
                try:
                    for f in files:
                        wait_let_go(f)
                    during()
                finally:
                    if how == "restart":
                        server.start()
                    proxy.mutator = None
                reconnected(mountpoint, path)

            return mountpoint, path, outage

        yield make


def reconnected(mountpoint, path):
    """Return once the mount reaches the server again: a new file made on the server side reads back
    through the mount (a new name each try, so that no cached lookup answers)."""
    deadline = time.monotonic() + RECONNECT_DELAY_MAX + BOUND
    for i in range(10**6):
        probe = os.urandom(16)
        (path / f"probe{i}").write_bytes(probe)
        try:
            if (mountpoint / f"probe{i}").read_bytes() == probe:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the mount did not reach the server again"
        time.sleep(0.2)


def wait_let_go(path):
    """Return once no process holds ``path`` open.  smbd closes a durable handle's file once it has
    seen the connection end: only then is the handle kept for a reconnect (a reconnect before that is
    refused), and only then can the file's inode be freed and handed to the next file."""
    deadline = time.monotonic() + BOUND
    while any(held(pid, path) for pid in os.listdir("/proc") if pid.isdigit()):
        assert time.monotonic() < deadline, f"{path} still open on the server after {BOUND} s"
        time.sleep(0.05)


def held(pid, path):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            pass
    return False


def identity(smb, kind, path):
    """(file id, creation time) of server-side ``path`` as Samba reports them: what a reopen by name
    compared. Asked on a connection of its own, straight to smbd."""
    server = smb.lab.server

    async def ask():
        backend = SMBBackend(f"smb://{server.username}@{server.host}/{kind}", {"credentials": str(smb.credentials)})
        await backend.root()
        try:
            a = await backend._stat_path(str(path.relative_to(server.shares[kind].path)).replace("/", "\\"))
            return a.file_id, a.btime_ns
        finally:
            await backend.close()

    return trio.run(ask)


def restore(path, copy, tries=256):
    """Remove ``path`` and restore it from ``copy`` with `cp -a` (its times and user.* xattrs, DOSATTRIB
    among them), as a file with the removed one's inode number (Samba's file id): xfs and ext4 give a
    new file the lowest free number near its directory, which is the removed file's only where no test
    before freed a lower one, so copies are made until one gets it (the others are removed again).
    The sync lets xfs free the removed inode (it does so in the background)."""
    ino = path.stat().st_ino
    path.unlink()
    os.sync()
    made = []
    try:
        for i in range(tries):
            made.append(path.with_name(f".{path.name}.{i}"))
            sh("cp", "-a", copy, made[-1])
            if made[-1].stat().st_ino == ino:
                made.pop().rename(path)
                return
        raise AssertionError(f"no copy of {copy} got inode number {ino} in {tries} tries")
    finally:
        for extra in made:
            extra.unlink()


def errors_of(*steps):
    """The errno each step failed with, None where it returned."""
    found = []
    for step in steps:
        try:
            step()
            found.append(None)
        except OSError as e:
            found.append(e.errno)
    return found


@pytest.mark.parametrize("kind,how", [("xfs", "restart"), ("ext4-durable", "cut")])
def test_a_file_restored_while_we_were_away_never_gets_our_writes(kind, how, lab_place, smb):
    """Written and fsynced before the outage; removed and restored from a backup (cp -a) during it.
    The next write may be answered before it is sent, but its error then comes at the fsync; the fsync
    and the close fail with EIO, and the server's file is the backup, byte for byte."""
    mountpoint, path, outage = lab_place(kind)
    victim, backup = path / "victim", path / "backup"
    first, second, third = (os.urandom(PIECE) for _ in range(3))
    (mountpoint / "victim").write_bytes(first)  # made through SMB: Samba keeps its creation time in DOSATTRIB
    smb.wait_closed(victim)  # else our open below shares the file, and gets no durable handle
    before = identity(smb, kind, victim)  # asked before our handle opens, which it could make share the file
    backup.mkdir()
    sh("cp", "-a", victim, backup / "victim")
    fd = os.open(mountpoint / "victim", os.O_RDWR)
    failed = []
    try:
        os.pwrite(fd, second, PIECE)
        os.fsync(fd)
        outage(how, [victim], lambda: restore(victim, backup / "victim"))
        failed += errors_of(lambda: os.pwrite(fd, third, 2 * PIECE), lambda: os.fsync(fd))
    finally:
        failed += errors_of(lambda: os.close(fd))
    print(f"write, fsync, close after the reconnect: {[errno.errorcode.get(e) for e in failed]}")
    # Else the test proves nothing: a reopen by name could not tell the restored file from ours.
    assert identity(smb, kind, victim) == before, "the restored file differs in file id or creation time"
    assert failed[0] in (None, errno.EIO) and failed[1:] == [errno.EIO, errno.EIO], failed
    assert victim.read_bytes() == first, "written into the restored file"


def test_a_reclaimed_durable_handle_goes_on(lab_place):
    """The same cut with nothing changed on the server: Samba reconnects the durable handles, and a
    writer and a reader go on as if nothing happened."""
    mountpoint, path, outage = lab_place("ext4-durable")
    first, second, data = (os.urandom(PIECE) for _ in range(3))
    (path / "r").write_bytes(data)
    reader = os.open(mountpoint / "r", os.O_RDONLY)
    try:
        with open(mountpoint / "w", "wb", buffering=0) as f:
            f.write(first)
            os.fsync(f.fileno())
            outage("cut", [path / "w", path / "r"])
            f.write(second)
            os.fsync(f.fileno())
        assert os.pread(reader, PIECE, 0) == data
    finally:
        os.close(reader)
    assert (path / "w").read_bytes() == first + second


def test_a_handle_the_server_did_not_keep_fails(lab_place):
    """smbd restarted, nothing changed on the server: no durable handle survives a restart, and nothing
    else proves the file is as we left it, so the writer's next write, fsync and close fail with EIO
    and a reader's next read too; the server's file keeps what was written before."""
    mountpoint, path, outage = lab_place("xfs")
    first, second, data = (os.urandom(PIECE) for _ in range(3))
    (path / "r").write_bytes(data)
    reader = os.open(mountpoint / "r", os.O_RDONLY)
    writer = os.open(mountpoint / "w", os.O_WRONLY | os.O_CREAT, 0o644)
    failed = []
    try:
        os.write(writer, first)
        os.fsync(writer)
        outage("restart", [])
        failed += errors_of(lambda: os.write(writer, second), lambda: os.fsync(writer))
        read = errors_of(lambda: os.pread(reader, PIECE, 0))
    finally:
        failed += errors_of(lambda: os.close(writer))
        os.close(reader)
    print(f"write, fsync, close after the restart: {[errno.errorcode.get(e) for e in failed]}")
    assert failed[0] in (None, errno.EIO) and failed[1:] == [errno.EIO, errno.EIO], failed
    assert read == [errno.EIO]
    assert (path / "w").read_bytes() == first



def test_a_file_restored_on_an_nfs_server_is_a_stale_filehandle(ganesha, mount_on):
    """The same restore while ganesha is down.  The NFS backend reopens a file the restarted server did
    not give back (no grace period here) by its filehandle, which on xfs carries the inode's generation
    as well as its number: the restored file, though it has the old inode number, is another
    filehandle, and the server refuses the old one (STALE).  The error comes at the fsync, and
    nothing is written into the restored file."""
    _, lab = ganesha
    mnt = mount_on("nfs-ganesha")
    victim, backup = mnt.backing / "victim", mnt.backing / "backup"
    first, second, third = (os.urandom(PIECE) for _ in range(3))
    (mnt.path / "victim").write_bytes(first)
    backup.mkdir()
    sh("cp", "-a", victim, backup / "victim")
    fd = os.open(mnt.path / "victim", os.O_RDWR)
    failed = []
    try:
        os.pwrite(fd, second, PIECE)
        os.fsync(fd)
        inode = victim.stat().st_ino
        lab.server.kill()
        try:
            restore(victim, backup / "victim")
        finally:
            lab.server.start()
        failed += errors_of(lambda: os.pwrite(fd, third, 2 * PIECE), lambda: os.fsync(fd))
    finally:
        failed += errors_of(lambda: os.close(fd))
    print(f"write, fsync, close after the restart: {[errno.errorcode.get(e) for e in failed]}")
    assert victim.stat().st_ino == inode, "the restored file did not keep the old inode number"
    assert failed[0] in (None, errno.ESTALE, errno.EIO) and failed[1] in (errno.ESTALE, errno.EIO), failed
    assert victim.read_bytes() == first, "written into the restored file"
