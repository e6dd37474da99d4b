"""What SMB leases let the mount cache, and what a break takes away (Samba 4.17 and 4.22, both share
configurations, and ksmbd).

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
import smbkit
from mpkit import MiB, assert_same, rewrite_keeping_times

from offloadfs.cli import read_status
from offloadfs.lab.mount import offloadfs_mount, status

# The labs' two share configurations, Samba's defaults and durable handles, on 4.17 and on 4.22.
PLACES = ["smb-ext4", "smb-ext4-durable", "smb422-xfs", "smb422-xfs-durable", "ksmbd-xfs"]
SIZE = MiB
LONG = ["attr_timeout=3600", "entry_timeout=3600"]
KEEP = "closetimeo=3600"  # handles kept open (off by default) until something closes them, not the clock
BREAK_BOUND = 30  # seconds: a break that takes longer is no break (attributes would time out in 3600)


@pytest.fixture
def two_mounts(request):
    """mounts(where) -> (ours, the other client's, the directory on the server): two mounts of one
    fresh directory of the SMB place `where`."""
    with contextlib.ExitStack() as stack:

        def make(where):
            smb, _, share = smbkit.place(request, where)
            url, path = smb.fresh_dir(share)
            ours = stack.enter_context(offloadfs_mount(url, options=[*LONG, KEEP, *smb.options()]))
            theirs = stack.enter_context(offloadfs_mount(url, options=smb.options()))
            return ours, theirs, path

        yield make


def reads(mountpoint):
    return requests(mountpoint).get("READ", 0)


def requests(mountpoint):
    return read_status(mountpoint)["counters"]["smb_requests"]


def kept(mountpoint):
    """Handles the mount keeps open past their last release (SMBBackend.release).  Read in this process
    (`offloadfs status` starts a Python): a handle is kept for a second only."""
    return read_status(mountpoint)["counters"]["smb_handles_kept"]


def wait_kept(mountpoint, n):
    """Wait until the mount keeps ``n`` handles open past their release: the kernel sends a release
    after close(2) returns."""
    deadline = time.monotonic() + BREAK_BOUND
    while kept(mountpoint) != n:
        assert time.monotonic() < deadline, f"{kept(mountpoint)} handles kept open, not {n}"
        time.sleep(0.01)


def read_and_close(path, kept_now=1):
    """Read the file and close it: its last handle, released, stays open at the server, the
    mount's ``kept_now``-th handle kept so."""
    with open(path, "rb") as f:
        data = f.read()
    wait_kept(path.parent, kept_now)
    return data


@pytest.mark.parametrize("where", PLACES)
def test_a_rewrite_that_keeps_the_times_is_read_at_the_next_open(two_mounts, where):
    """Close-to-open while our mount holds the file open: the rewrite changes no attribute Samba
    reports, so only the broken lease tells the next open to drop the kernel's pages."""
    ours, theirs, server = two_mounts(where)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), old)  # in the kernel's cache now
        before = os.stat(ours / "f")
        rewrite_keeping_times(theirs / "f", new)
        with open(ours / "f", "rb") as f:
            assert_same(f.read(), new)
        assert (os.stat(ours / "f").st_mtime_ns, os.stat(ours / "f").st_size) == (before.st_mtime_ns, SIZE)


@pytest.mark.parametrize("where", PLACES)
def test_a_file_under_a_lease_is_read_again_from_the_kernels_cache(two_mounts, where):
    """Nobody else writes: while the lease is held (a descriptor keeps the file open), every open
    keeps the kernel's pages, and reading the file again sends no READ."""
    ours, _, server = two_mounts(where)
    data = os.urandom(SIZE)
    (server / "f").write_bytes(data)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), data)
        first = reads(ours)
        assert first > 0
        for _ in range(3):
            with open(ours / "f", "rb") as f:
                assert_same(f.read(), data)
        if where in smbkit.EPOCH_AT_EVERY_OPEN:
            assert reads(ours) >= first + 3  # each open reads again (READs split as the kernel asks)
        else:
            assert reads(ours) == first


@pytest.mark.parametrize("where", PLACES)
def test_another_clients_write_reaches_an_open_file_at_the_break(two_mounts, where):
    """A descriptor open all along: the break drops the kernel's pages of the file at once, so
    reads through it see the new bytes well before the attributes would time out."""
    ours, theirs, server = two_mounts(where)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    with open(ours / "f", "rb") as held:
        assert_same(held.read(), old)
        rewrite_keeping_times(theirs / "f", new)
        deadline = time.monotonic() + BREAK_BOUND
        while os.pread(held.fileno(), SIZE, 0) != new:
            assert time.monotonic() < deadline, f"old bytes {BREAK_BOUND} s after another client's write"
            time.sleep(0.05)


@pytest.mark.parametrize("where", PLACES)
def test_a_reopen_soon_after_the_last_close_takes_the_handle_back_and_keeps_the_pages(two_mounts, where):
    """The last close of a read-only handle under a lease keeps it open a moment (as cifs's
    closetimeo): an open of the file meanwhile takes it back, and as the lease went on unbroken,
    reads no byte again."""
    ours, _, server = two_mounts(where)
    data = os.urandom(SIZE)
    (server / "f").write_bytes(data)
    assert_same(read_and_close(ours / "f"), data)
    before = reads(ours)
    with open(ours / "f", "rb") as f:
        assert kept(ours) == 0
        assert_same(f.read(), data)
    assert reads(ours) == before
    wait_kept(ours, 1)


@pytest.mark.parametrize("where", PLACES)
def test_another_clients_write_closes_a_kept_handle_and_is_read_at_the_next_open(two_mounts, where):
    """The other client's write breaks the lease of the handle kept open: it is closed, and the next
    open opens the file afresh, with the new bytes (the times put back, so only the break tells)."""
    ours, theirs, server = two_mounts(where)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    assert_same(read_and_close(ours / "f"), old)
    rewrite_keeping_times(theirs / "f", new)
    wait_kept(ours, 0)
    with open(ours / "f", "rb") as f:
        assert_same(f.read(), new)


@pytest.mark.parametrize("where", PLACES)
def test_our_unlink_and_rename_of_a_file_with_a_kept_handle_take_effect_at_once(two_mounts, where):
    """Samba leaves a file deleted under another open handle in place, delete-pending, until that
    closes: the kept handle is closed first, so the name is gone at once and free to create."""
    ours, _, server = two_mounts(where)
    for kept_now, name in enumerate(("gone", "old"), 1):
        (server / name).write_bytes(os.urandom(SIZE))
        read_and_close(ours / name, kept_now)
    os.unlink(ours / "gone")
    assert not (server / "gone").exists()
    (ours / "gone").write_bytes(b"again")
    os.rename(ours / "old", ours / "new")
    assert sorted(p.name for p in server.iterdir()) == ["gone", "new"]
    assert (server / "gone").read_bytes() == b"again"


@pytest.mark.parametrize("where", PLACES)
def test_a_kept_handle_is_closed_at_unmount(request, where):
    """Unmount leaves no handle kept open at the server, durable ones included (a durable handle
    outlives a connection that merely drops, at Samba until it times out)."""
    smb, _, share = smbkit.place(request, where)
    url, server = smb.fresh_dir(share)
    (server / "f").write_bytes(os.urandom(SIZE))
    with offloadfs_mount(url, options=[KEEP, *smb.options()]) as ours:
        read_and_close(ours / "f")
    smb.wait_closed(server / "f", timeout=0)


@pytest.mark.parametrize("where", PLACES)
def test_a_kept_handle_is_not_taken_back_for_a_name_that_leads_elsewhere_now(two_mounts, where):
    """Another client renames the file away and makes a new one by its name.  Samba does not break
    the handle caching of our lease for that on every share, so the name is asked before a kept
    handle is taken back: our next open by the name finds the file now there."""
    ours, theirs, server = two_mounts(where)
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (server / "f").write_bytes(old)
    assert_same(read_and_close(ours / "f"), old)
    os.rename(theirs / "f", theirs / "g")
    (theirs / "f").write_bytes(new)
    with open(ours / "f", "rb") as f:
        assert_same(f.read(), new)
