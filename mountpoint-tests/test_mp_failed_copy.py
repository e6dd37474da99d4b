"""What a copy that fails part way leaves: what a plain cp leaves, a correct prefix of the source.

A copy moves several pieces at once (writes of a streamed chunk side by
side, server-side copies in flight together), so a later piece may land
while an earlier one fails.  The destination must then hold no more than
the part copied without a gap from the start, and cp must fail; unless the
destination's handle itself is lost (smbd restarted), when cp fails and the
file keeps what the server wrote.
"""

import json
import os
import shutil
import subprocess
import time

import pytest
from mpkit import MiB, assert_same, sha256, write_file
from smbkit import smb_lab

from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount, status

SMALL_FS = 128 * MiB  # the destination's filesystem
SIZE = 192 * MiB  # a file that does not fit on it
PAGE = 4096


def assert_prefix(source, destination, copied):
    """``destination`` holds the first bytes of ``source`` and nothing else, and no more than ``copied``."""
    size = destination.stat().st_size
    with open(source, "rb") as src, open(destination, "rb") as dst:
        for off in range(0, size, MiB):
            want, got = src.read(MiB), dst.read(MiB)
            assert_same(got, want[:len(got)], at=off)
    assert size <= copied, f"{destination}: {size} bytes, but only {copied} were copied"


def copied(counters):
    """Bytes the daemon reports moved into files, by copies and by writes."""
    return sum(counters["copy_bytes"].values()) + counters["fuse_write_bytes"]


def cp_fails(src, dst):
    cp = subprocess.run(["cp", src, dst], capture_output=True, text=True, timeout=300)
    print(f"cp exit {cp.returncode}: {cp.stderr.strip()}")
    assert cp.returncode != 0, "cp reported success although the destination is full"
    assert cp.stderr.strip(), "cp failed without saying why"


def test_streamed_copy_onto_a_full_filesystem(backing):
    """Between two sources on different filesystems the daemon streams: ENOSPC part way."""
    with loop_filesystem("ext4", size=SMALL_FS) as small:
        src = backing("ext4")
        write_file(src / "big", SIZE)
        with offloadfs_mount({"a": src, "b": small}) as mnt:
            cp_fails(mnt / "a" / "big", mnt / "b" / "copy")
            counters = status(mnt)["counters"]
            assert counters["copy_bytes"]["stream"] > 0, counters
            assert_prefix(src / "big", small / "copy", copied(counters))


@pytest.fixture(scope="module")
def lab():
    """A Samba lab of this module's own: its filesystem gets filled up, its smbd killed."""
    if shutil.which("smbd") is None:
        pytest.skip("smbd is not installed (apt-get install samba samba-vfs-modules)")
    with smb_lab(servers=1, kinds=("ext4",)) as lab:
        yield lab


@pytest.fixture
def share(lab):
    """The lab's ext4 share on the server's disk, emptied again after the test."""
    path = lab.lab.server.shares["ext4"].path
    yield path
    for f in path.iterdir():
        f.unlink()


def test_streamed_copy_onto_a_full_share(lab, share):
    """offload=off: the daemon reads and writes the pieces of each chunk side by side."""
    write_file(share / "big", SIZE)
    fs = os.statvfs(share)  # smbd writes as root: the blocks kept for root count too
    with open(share / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, fs.f_bfree * fs.f_frsize - SMALL_FS)
    with offloadfs_mount(lab.url("ext4"), options=[*lab.options(), "offload=off"]) as mnt:
        cp_fails(mnt / "big", mnt / "copy")
        counters = status(mnt)["counters"]
    assert_prefix(share / "big", share / "copy", copied(counters))


def test_writes_answered_before_the_share_filled_fail_the_close(lab, share, tmp_path):
    """Writes to a remote file are answered while on their way (writebehind.py): the ENOSPC one of
    them meets must still fail the writer, at a later write or at close, never pass unseen."""
    write_file(tmp_path / "big", SIZE)
    fs = os.statvfs(share)
    with open(share / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, fs.f_bfree * fs.f_frsize - SMALL_FS)
    with offloadfs_mount(lab.url("ext4"), options=lab.options()) as mnt:
        dd = subprocess.run(["dd", f"if={tmp_path / 'big'}", f"of={mnt / 'copy'}", "bs=1M"],
                            capture_output=True, text=True, timeout=300)
        print(f"dd exit {dd.returncode}: {dd.stderr.strip()}")
        assert dd.returncode != 0 and "No space left on device" in dd.stderr
        counters = status(mnt)["counters"]
    assert_prefix(tmp_path / "big", share / "copy", copied(counters))


def test_server_copy_cut_by_a_server_restart(lab, share):
    """smbd dies while server-side copies are in flight side by side, and comes back.

    ext4 makes the server copy the bytes itself, so the copy is still running
    when smbd is killed.  No durable handle outlives smbd: the destination's
    handle is lost (test_mp_restore) and cp fails, unless it finished first.
    Nothing may then cut the file back to the part the daemon saw done: only
    a reopen by name could, and that could cut a file that is no longer ours.
    What is left is what the server wrote before it died: the source's bytes,
    and zeros where a copy in flight had not reached.
    """
    server = lab.lab.server
    digest = write_file(share / "big", 1 << 30)
    with offloadfs_mount(lab.url("ext4"), options=lab.options()) as mnt:
        cp = subprocess.Popen(["cp", mnt / "big", mnt / "copy"], stderr=subprocess.PIPE, text=True)
        try:
            wait_for_progress(mnt, cp)
            server.kill()
            time.sleep(1)
            server.start()
            _, err = cp.communicate(timeout=120)
        finally:
            if cp.poll() is None:
                cp.kill()
                cp.wait()
            if server.process is None:
                server.start()
        print(f"cp exit {cp.returncode}: {err.strip()}")
        counters = status(mnt)["counters"]
    assert counters["copy_bytes"]["server_copy"] > 0, counters
    if cp.returncode == 0:
        assert sha256(share / "copy") == digest, "cp reported success over wrong data"
    else:
        assert err.strip(), "cp failed without saying why"
        assert_source_or_zeros(share / "big", share / "copy")


def assert_source_or_zeros(source, destination):
    """Every page of ``destination`` is the same page of ``source``, or zeros."""
    size = destination.stat().st_size
    assert size <= source.stat().st_size
    with open(source, "rb") as src, open(destination, "rb") as dst:
        for off in range(0, size, PAGE):
            want, got = src.read(PAGE), dst.read(PAGE)
            assert got in (want[:len(got)], bytes(len(got))), f"{destination}: wrong bytes in the page at {off}"


def wait_for_progress(mountpoint, cp):
    """Return once the daemon reports a copy in flight with a first part done."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert cp.poll() is None, "cp finished before smbd could be killed"
        copies = json.loads(os.getxattr(mountpoint, "user.offloadfs.status"))["copies_in_flight"]
        if copies and copies[0]["bytes_done"]:
            return
        time.sleep(0.005)
    raise AssertionError("the copy never made progress in status")
