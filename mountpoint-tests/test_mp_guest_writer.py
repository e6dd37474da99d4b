"""Issue #30 on Linux nfsd with a program inside the guest as the foreign writer.

nfsd's delegations are kernel leases: a local program's open for writing (or its utimensat) breaks
them, and the program waits while nfsd recalls the delegation from its holder, which then has to
stop trusting what it cached.  A second NFS client (test_mp_delegations, test_mp_foreign_writers)
takes nfsd's own path to the recall, not the lease break.

The program rewrites a file in place with bytes staged next to it (through nfskit's view), keeping
the size, and puts the times back with `touch -r` (nanoseconds kept), as `cp -p` and `tar x` do.
"""

import errno
import hashlib
import os
import time

import pytest
from mpkit import MiB, assert_same
from test_mp_restore import errors_of

SMALL = MiB
LARGE = 32 * MiB
REWRITE = 4 * MiB
LONG = ["attr_timeout=3600", "entry_timeout=3600"]  # nothing may come from attributes timing out
RECALL_BOUND = 60  # seconds: longer is no recall (attributes would time out in 3600)


class Guest:
    """The guest behind a mount of a fresh directory of its export: runs commands there."""

    def __init__(self, guest, mnt):
        self.guest = guest
        self.dir = f"{guest.export}/{mnt.backing.name}"

    def run(self, command):
        status, output = self.guest.run(command)
        assert status == 0, f"{command!r} in the guest: exit {status}: {output}"
        return output

    def rewrite(self, name, staged, offset=0):
        """Write the bytes of ``staged`` over ``name`` at ``offset`` in place, then put the times back."""
        path = f"{self.dir}/{name}"
        self.run(f"touch -r {path} /tmp/stamp && dd if={self.dir}/{staged} of={path} bs=1M oflag=seek_bytes "
                 f"seek={offset} conv=notrunc 2>/dev/null && touch -r /tmp/stamp {path}")


@pytest.fixture
def on_guest(request, mount_on):
    """Factory: on_guest(where, options) -> (Mount, Guest) of a fresh directory at nfskit place ``where``."""

    def make(where, options):
        mnt = mount_on(where, options)
        _, lab = request.getfixturevalue(where.replace("-", "_"))
        return mnt, Guest(lab.guest, mnt)

    return make


def delegations(mnt):
    return mnt.counters()["nfs_delegations"]


def read_until_delegated(mnt, name, data):
    """Read ``name`` through the mount until a delegation is held on it: nfsd grants none while the
    view's CLOSE of the file it wrote may still be on its way."""
    deadline = time.monotonic() + RECALL_BOUND
    while True:
        assert_same((mnt.path / name).read_bytes(), data)
        if delegations(mnt) == 1:
            return
        assert time.monotonic() < deadline, f"no delegation granted in {RECALL_BOUND} s"
        time.sleep(0.1)


def test_the_guests_command_channel(on_guest):
    """The lab's channel: output and exit status, and a clear error where no answer comes."""
    _, guest = on_guest("nfsd", [])
    assert guest.guest.run("echo one; echo two >&2; exit 3") == (3, "one\ntwo\n")
    with pytest.raises(TimeoutError, match="did not answer 'sleep 3'"):
        guest.guest.run("sleep 3", timeout=0.5)
    start = time.monotonic()
    assert guest.guest.run(f"ls {guest.dir}") == (0, "")
    print(f"\na guest command after a 3 s one that timed out: {time.monotonic() - start:.3f} s")
    start = time.monotonic()
    for _ in range(10):
        guest.run("true")
    print(f"a guest command: {(time.monotonic() - start) / 10 * 1000:.1f} ms")


def test_a_guest_programs_rewrite_recalls_the_delegation_and_the_next_open_reads_it(on_guest):
    """Close-to-open after a rewrite that keeps the size and times: nothing in the attributes has to
    show it while the delegation lets the mount skip the check; the recall is what drops the pages."""
    mnt, guest = on_guest("nfsd", LONG)
    old, new = os.urandom(SMALL), os.urandom(SMALL)
    (mnt.backing / "f").write_bytes(old)
    (mnt.backing / "new").write_bytes(new)
    read_until_delegated(mnt, "f", old)
    start = time.monotonic()
    guest.rewrite("f", "new")
    print(f"\nthe guest's rewrite with a delegation to recall: {time.monotonic() - start:.3f} s; "
          f"nfs_delegations before 1, after {delegations(mnt)}")
    assert delegations(mnt) == 0, "the mount holds the delegation still after the guest's write"
    assert_same((mnt.path / "f").read_bytes(), new)


def test_a_guest_programs_write_reaches_an_open_file_at_the_recall(on_guest):
    """A descriptor open all along: the recall drops the kernel's pages, so reads through it see the
    guest's bytes long before the attributes would time out."""
    mnt, guest = on_guest("nfsd", LONG)
    old, new = os.urandom(SMALL), os.urandom(SMALL)
    (mnt.backing / "f").write_bytes(old)
    (mnt.backing / "new").write_bytes(new)
    read_until_delegated(mnt, "f", old)
    with open(mnt.path / "f", "rb") as held:
        assert_same(held.read(), old)
        guest.rewrite("f", "new")
        deadline = time.monotonic() + RECALL_BOUND
        while os.pread(held.fileno(), SMALL, 0) != new:
            assert time.monotonic() < deadline, f"old bytes {RECALL_BOUND} s after the guest's write"
            time.sleep(0.05)


def copy_reading(src, dst, at, between):
    """Copy as shutil and rsync do (read() then write(), a MiB at a time), calling ``between()`` once
    ``at`` bytes were read; the sha256 of what was read."""
    read = hashlib.sha256()
    done = 0
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while block := fin.read(MiB):
            read.update(block)
            fout.write(block)
            done += len(block)
            if done == at:
                between()
    return read.hexdigest()


@pytest.mark.parametrize("where", ["nfsd", "nfsd-reflink"])
@pytest.mark.parametrize("rewritten", ["read", "next"])
def test_a_recognised_copy_holds_what_was_read_while_a_guest_program_rewrites_the_source(on_guest, where,
                                                                                          rewritten):
    """A quarter of the way through a recognised copy, a program in the guest rewrites 4 MiB of the
    source and puts the times back: either bytes the copier read, or the next ones (which the
    kernel may have read ahead: the recall must drop them).  The copier reads the source as it was
    at each read, and the destination holds exactly that, whether the mount copies on the server
    (COPY; CLONE on reflink xfs) or writes."""
    # offload=always: held and read back, whatever the lab's rates say
    mnt, guest = on_guest(where, ["offload=always"])
    data, new = os.urandom(LARGE), os.urandom(REWRITE)
    (mnt.backing / "src").write_bytes(data)
    (mnt.backing / "new").write_bytes(new)
    at = LARGE // 4
    offset = 0 if rewritten == "read" else at
    read = copy_reading(mnt.path / "src", mnt.path / "dst", at, lambda: guest.rewrite("src", "new", offset))
    now = data[:offset] + new + data[offset + REWRITE:]
    assert guest.run(f"sha256sum {guest.dir}/src").split()[0] == hashlib.sha256(now).hexdigest()
    assert read == hashlib.sha256(data if rewritten == "read" else now).hexdigest(), "the copier read stale bytes"
    assert guest.run(f"sha256sum {guest.dir}/dst").split()[0] == read, "the destination is not what the copier read"
    c = mnt.counters()
    sent = {op: n for op, n in c["nfs_requests"].items() if op in ("WRITE", "COPY", "CLONE")}
    print(f"\n{where}, {rewritten} bytes rewritten: recognised {c['recognised_bytes'] // MiB} MiB, sent {sent}")
    assert c["recognised_bytes"] >= LARGE - 2 * MiB, c  # it was a recognised copy


def test_a_clone_keeps_what_was_copied_when_a_guest_program_rewrites_the_source_after(on_guest):
    """On reflink xfs a recognised copy of a whole file is a CLONE: the two files share extents, and
    a later rewrite of the source in the guest must not show in the copy, on the server or through
    the mount."""
    mnt, guest = on_guest("nfsd-reflink", ["offload=always"])
    data = os.urandom(LARGE)
    (mnt.backing / "src").write_bytes(data)
    (mnt.backing / "new").write_bytes(os.urandom(REWRITE))
    read = copy_reading(mnt.path / "src", mnt.path / "dst", LARGE, lambda: None)
    assert mnt.counters()["copies"]["clone"] == 1, mnt.counters()
    assert_same((mnt.path / "dst").read_bytes(), data)
    guest.rewrite("src", "new")
    assert hashlib.sha256(data).hexdigest() not in guest.run(f"sha256sum {guest.dir}/src")
    assert guest.run(f"sha256sum {guest.dir}/dst").split()[0] == read
    assert hashlib.sha256((mnt.path / "dst").read_bytes()).hexdigest() == read


def test_a_file_restored_in_the_guest_while_nfsd_was_down_is_a_stale_filehandle(on_guest):
    """test_mp_restore's restore on nfsd: with nfsd stopped (its threads to 0: every open and
    delegation is gone; nfsd-up starts it again), a program in the guest removes the file we hold
    open for writing and restores it from a backup with `cp -a`, as a file with the old inode number.  nfsd's
    filehandles carry the inode's generation as well: the restored file is another filehandle, our
    reopen (a reclaim in nfsd's grace period) is refused STALE, the error comes at the fsync, and
    nothing of ours is written into the restored file."""
    mnt, guest = on_guest("nfsd", [])
    first, second, third = (os.urandom(64 * 1024) for _ in range(3))
    (mnt.path / "victim").write_bytes(first)
    guest.run(f"cd {guest.dir} && mkdir backup && cp -a victim backup/victim")
    fd = os.open(mnt.path / "victim", os.O_RDWR)
    failed = []
    try:
        os.pwrite(fd, second, len(first))
        os.fsync(fd)
        # xfs gives a new file the lowest free inode number near its directory: copies are made
        # until one gets the removed file's (the sync lets xfs free it)
        inode = guest.run(f"stat -c %i {guest.dir}/victim").strip()
        guest.run(f"cd {guest.dir} && echo 0 > /proc/fs/nfsd/threads && rm victim && sync && "
                  f"for i in $(seq 256); do cp -a backup/victim .v$i; [ $(stat -c %i .v$i) = {inode} ] && "
                  f"mv .v$i victim && break; done; rm -f .v*; nfsd-up")
        failed += errors_of(lambda: os.pwrite(fd, third, 2 * len(first)), lambda: os.fsync(fd))
    finally:
        failed += errors_of(lambda: os.close(fd))
        # the grace period would hold the session's other tests' opens back
        guest.run("echo Y > /proc/fs/nfsd/v4_end_grace")
    print(f"\nwrite, fsync, close after the restart: {[errno.errorcode.get(e) for e in failed]}")
    assert guest.run(f"stat -c %i {guest.dir}/victim").strip() == inode, "no copy got the old inode number"
    assert failed[0] in (None, errno.ESTALE, errno.EIO) and failed[1] in (errno.ESTALE, errno.EIO), failed
    status, _ = guest.guest.run(f"cmp {guest.dir}/victim {guest.dir}/backup/victim")
    assert status == 0, "written into the restored file"
