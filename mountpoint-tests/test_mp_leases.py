"""What SMB leases let the mount cache, and what a break takes away (Samba 4.17, both share configurations).

Samba's attributes cannot say that a file is unchanged: it reports the mtime
as the change time, and while a handle is open it answers with the write
time of the first open, so another client's same-size rewrite whose times
are put back leaves every attribute as it was.  A lease with read caching
can: the server breaks it before another client's write lands.  Our mount
keeps a file's pages at an open only under a lease held since the open
before, and drops them when the lease breaks.

The other client is a second offloadfs mount of the same directory (its own
connection and lease).  Our mount's attribute timeout is an hour: nothing
here may come from attributes timing out.
"""

import contextlib
import os
import time

import pytest
from mpkit import MiB, assert_same, rewrite_keeping_times

from offloadfs.lab.mount import offloadfs_mount, status

SHARES = ["ext4", "ext4-durable"]  # the lab's two configurations: Samba's defaults, and durable handles
SIZE = MiB
LONG = ["attr_timeout=3600", "entry_timeout=3600"]
BREAK_BOUND = 30  # seconds: a break that takes longer is no break (attributes would time out in 3600)


@pytest.fixture
def two_mounts(smb):
    """mounts(share) -> (ours, the other client's, the directory on the server): two mounts of one
    fresh directory of the share."""
    with contextlib.ExitStack() as stack:

        def make(share):
            url, path = smb.fresh_dir(share)
            ours = stack.enter_context(offloadfs_mount(url, options=[*LONG, *smb.options()]))
            theirs = stack.enter_context(offloadfs_mount(url, options=smb.options()))
            return ours, theirs, path

        yield make


def reads(mountpoint):
    return status(mountpoint)["counters"]["smb_requests"].get("READ", 0)


@pytest.mark.parametrize("share", SHARES)
def test_a_rewrite_that_keeps_the_times_is_read_at_the_next_open(two_mounts, share):
    """Close-to-open while our mount holds the file open: the rewrite changes no attribute Samba
    reports, so only the broken lease tells the next open to drop the kernel's pages."""
    ours, theirs, server = two_mounts(share)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), old)  # in the kernel's cache now
        before = os.stat(ours / "f")
        rewrite_keeping_times(theirs / "f", new)
        with open(ours / "f", "rb") as f:
            assert_same(f.read(), new)
        assert (os.stat(ours / "f").st_mtime_ns, os.stat(ours / "f").st_size) == (before.st_mtime_ns, SIZE)


@pytest.mark.parametrize("share", SHARES)
def test_a_file_under_a_lease_is_read_again_from_the_kernels_cache(two_mounts, share):
    """Nobody else writes: while the lease is held (a descriptor keeps the file open), every open
    keeps the kernel's pages, and reading the file again sends no READ."""
    ours, _, server = two_mounts(share)
    data = os.urandom(SIZE)
    (server / "f").write_bytes(data)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), data)
        first = reads(ours)
        assert first > 0
        for _ in range(3):
            with open(ours / "f", "rb") as f:
                assert_same(f.read(), data)
        assert reads(ours) == first


@pytest.mark.parametrize("share", SHARES)
def test_another_clients_write_reaches_an_open_file_at_the_break(two_mounts, share):
    """A descriptor open all along: the break drops the kernel's pages of the file at once, so
    reads through it see the new bytes well before the attributes would time out."""
    ours, theirs, server = two_mounts(share)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), old)
        rewrite_keeping_times(theirs / "f", new)
        deadline = time.monotonic() + BREAK_BOUND
        while os.pread(held.fileno(), SIZE, 0) != new:
            assert time.monotonic() < deadline, f"old bytes {BREAK_BOUND} s after another client's write"
            time.sleep(0.05)
