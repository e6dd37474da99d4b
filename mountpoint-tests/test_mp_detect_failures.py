"""A recognised copy that fails never loses or changes what the application wrote.

A tool that copies with read()+write() has its writes held while the daemon recognises them as data it
served; they are committed as a server-side copy at close() or fsync(). Every way that commit can go wrong
must still leave the destination holding exactly the bytes written: the source rewritten or removed on
the server before the commit, the daemon killed right after close() returned, the connection broken between
the writes and the close, and a stat or a second open while the bytes are held. Each test first checks that
its writes were recognised (else it would test plain writes) and then compares the destination byte for byte,
on the server's disk (mnt.backing), not through the mount. Where the destination's own handle is lost (smbd
restarted), close() fails with EIO instead.
"""

import contextlib
import errno
import os
import signal
import time

import pytest
from mpkit import MiB, assert_same, gone, sh

from offloadfs.backends.smb.client import RECONNECT_DELAY_MAX
from offloadfs.recognise import CUT_AT

SIZE = 4 * MiB
WHERE = ("local-btrfs", "smb-ext4")
# What is found is held whatever the rates measured on the lab's bare veth say: on SMB it could be
# written as it comes instead (recognise.Recogniser._worth_holding), and nothing would be held to fail.
HOLD = ["offload=always"]


@contextlib.contextmanager
def held_copy(mnt):
    """Put SIZE random bytes in `src` on the server, read them through the mount and write them to `dst`
    the way cp-like tools do (same offsets); yield (open fd of dst, the bytes) while the copy is held.
    Then close the fd: the server's dst must hold the bytes as soon as that returns."""
    data = os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(data)
    with open(mnt.path / "src", "rb") as f:
        assert f.read() == data
    fd = os.open(mnt.path / "dst", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, SIZE, MiB):
            os.pwrite(fd, data[off:off + MiB], off)
        # Held, but for the last chunks, which wait for the close to be decided (recognise.CUT_AT), and
        # maybe a chunk or two between: with both CPUs kept busy, 2 of at most 20 tries recognised only
        # 3.82-3.88 MB, in three runs with 50-65 KB gaps between them, likely read replies of src that
        # completed too far out of order (as test_mp_detect's copies at once sees).
        assert mnt.counters()["recognised_bytes"] >= 0.9 * SIZE - CUT_AT, mnt.counters()
        yield fd, data
    finally:
        os.close(fd)
    assert_same((mnt.backing / "dst").read_bytes(), data)


@pytest.mark.parametrize("change", ["rewritten", "removed"])
@pytest.mark.parametrize("where", WHERE)
def test_a_source_changed_before_the_commit_leaves_what_was_written(where, change, mount_on):
    """Another client rewrites the source (same size, other bytes) after we read it, or removes it (the
    copy then fails): the destination gets the bytes the application wrote, not the source's new ones."""
    mnt = mount_on(where, HOLD)
    with held_copy(mnt) as (_, data):
        time.sleep(0.01)  # a new mtime and ctime even on a coarse clock
        if change == "rewritten":
            (mnt.backing / "src").write_bytes(os.urandom(SIZE))
        else:
            (mnt.backing / "src").unlink()
    with open(mnt.path / "dst", "rb") as f:
        assert_same(f.read(), data)


@pytest.mark.parametrize("where", WHERE)
def test_the_data_is_on_the_server_when_close_returns(where, mount_on):
    """SIGKILL the daemon right after close(): nothing it still held may be lost."""
    mnt = mount_on(where, HOLD)
    pid = mnt.status()["pid"]
    with held_copy(mnt) as (_, data):
        pass
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # a guard against a process that SIGKILL cannot end, not a time
    while not gone(pid):
        assert time.monotonic() < deadline, "the daemon outlived SIGKILL by 30 s"
        time.sleep(0.02)
    assert_same((mnt.backing / "dst").read_bytes(), data)


@pytest.mark.parametrize("where", WHERE)
def test_fsync_returns_once_the_data_is_on_the_server(where, mount_on):
    mnt = mount_on(where, HOLD)
    with held_copy(mnt) as (fd, data):
        os.fsync(fd)
        assert_same((mnt.backing / "dst").read_bytes(), data)


@pytest.mark.parametrize("where", WHERE)
def test_held_bytes_show_in_stat_and_in_reads(where, mount_on):
    """While the copy is held, fstat and stat give the size written and a second open reads the bytes."""
    mnt = mount_on(where, HOLD)
    with held_copy(mnt) as (fd, data):
        assert os.fstat(fd).st_size == SIZE
        assert os.stat(mnt.path / "dst").st_size == SIZE
        with open(mnt.path / "dst", "rb") as f:
            assert_same(f.read(), data)


def wait_usable(mnt):
    """Return once the mount reaches the restarted server again: a new file made on the server side reads
    back through the mount (a new name each try, so no cached lookup answers)."""
    deadline = time.monotonic() + RECONNECT_DELAY_MAX + 30  # a hang guard: a busy machine logs on slowly
    for i in range(10**6):
        probe = os.urandom(16)
        (mnt.backing / f"probe{i}").write_bytes(probe)
        try:
            if (mnt.path / f"probe{i}").read_bytes() == probe:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the mount did not reach the restarted smbd"
        time.sleep(0.2)


def test_a_commit_after_a_durable_reconnect_writes_what_was_held(smb, mount_on):
    """The connection breaks between the writes and the close (smbd keeps the durable handles): the
    server's state the copy would use is gone with it, and close() still leaves every held byte on the
    server, through the destination's handle reconnected."""
    mnt = mount_on("smb-ext4-durable", HOLD)
    with held_copy(mnt):
        sh("ss", "-K", "dst", smb.lab.server.host, "dport", "=", "445")


def test_a_commit_after_smbd_restarted_fails(smb, mount_on):
    """smbd is killed and started again between the writes and the close: no durable handle outlives
    it, so the destination's handle is lost, and close() fails with EIO rather than write the held
    bytes into whatever the name leads to now (test_mp_restore)."""
    mnt = mount_on("smb-ext4", HOLD)
    server = smb.lab.server
    with pytest.raises(OSError) as failed, held_copy(mnt):
        server.kill()
        server.start()
        wait_usable(mnt)
    assert failed.value.errno == errno.EIO
