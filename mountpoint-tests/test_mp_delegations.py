"""What NFS read delegations let the mount cache, and what a recall takes away (Linux nfsd 6.1).

Neither lab server says its change attribute is exact (no change_attr_type), so without a
delegation the mount drops a file's pages at every open.  nfsd grants a read delegation to a read
open and recalls it (CB_RECALL) before another client's write, truncate, rename or removal goes
on; the mount keeps it after the last close, so pages outlive closes while it is held.

The other client is nfskit's view of the export: a second offloadfs mount with its own NFS client
ID.  Our mount's attribute timeout is an hour: nothing here may come from attributes timing out.
"""

import os
import time

import pytest
from mpkit import MiB, assert_same, rewrite_keeping_times

SIZE = MiB
LONG = ["attr_timeout=3600", "entry_timeout=3600"]
RECALL_BOUND = 60  # seconds: a recall that takes longer is no recall (attributes would time out in 3600)


@pytest.fixture
def nfsd_mount(mount_on):
    return mount_on("nfsd", LONG)


def reads(mnt):
    sent = mnt.counters().get("nfs_requests", {})
    return sent.get("READ", 0) + sent.get("READPLUS", 0)


def read_until_delegated(mnt, data, name="f"):
    """Read the file through the mount until a delegation is held on it: nfsd grants none while
    another client holds the file open for writing, and the view's CLOSE may still be on its way."""
    deadline = time.monotonic() + RECALL_BOUND
    while True:
        assert_same((mnt.path / name).read_bytes(), data)
        if mnt.counters()["nfs_delegations"] == 1:
            return
        assert time.monotonic() < deadline, f"no delegation granted in {RECALL_BOUND} s"
        time.sleep(0.1)


def test_a_file_read_before_is_read_again_from_the_kernels_cache(nfsd_mount):
    """Nobody else writes: the delegation outlives the close, so each later open keeps the
    kernel's pages and sends no READ."""
    mnt = nfsd_mount
    data = os.urandom(SIZE)
    (mnt.backing / "f").write_bytes(data)
    read_until_delegated(mnt, data)
    first = reads(mnt)
    assert first > 0
    for _ in range(3):
        assert_same((mnt.path / "f").read_bytes(), data)
    assert reads(mnt) == first


def test_another_clients_rewrite_is_read_at_the_next_open(nfsd_mount):
    """Close-to-open after a rewrite that keeps the size and puts the times back: the recall is
    what tells the next open to drop the pages."""
    mnt = nfsd_mount
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (mnt.backing / "f").write_bytes(old)
    read_until_delegated(mnt, old)
    rewrite_keeping_times(mnt.backing / "f", new)
    assert_same((mnt.path / "f").read_bytes(), new)


def test_another_clients_write_reaches_an_open_file_at_the_recall(nfsd_mount):
    """A descriptor open all along: the recall drops the kernel's pages at once, so reads through
    it see the new bytes long before the attributes would time out."""
    mnt = nfsd_mount
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (mnt.backing / "f").write_bytes(old)
    read_until_delegated(mnt, old)
    with open(mnt.path / "f", "rb") as held:
        assert_same(held.read(), old)
        rewrite_keeping_times(mnt.backing / "f", new)
        deadline = time.monotonic() + RECALL_BOUND
        while os.pread(held.fileno(), SIZE, 0) != new:
            assert time.monotonic() < deadline, f"old bytes {RECALL_BOUND} s after another client's write"
            time.sleep(0.05)


def test_our_own_write_returns_the_delegation_and_is_read_back(nfsd_mount):
    """A read delegation covers no write of ours: a write open gives it back first, the write
    lands, and the next read open (a new delegation) reads what was written."""
    mnt = nfsd_mount
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (mnt.backing / "f").write_bytes(old)
    assert_same((mnt.path / "f").read_bytes(), old)
    with open(mnt.path / "f", "r+b") as f:
        f.write(new)
    assert_same((mnt.path / "f").read_bytes(), new)
    assert_same((mnt.backing / "f").read_bytes(), new)
