"""Copies by tools that never ask (issue #10): read() then write() of the same bytes.

Each tool copies inside one source; the copy must be byte for byte the source's,
and `offloadfs status` must show the bytes recognised and committed as an
offload (clone on local btrfs, server-side copy on SMB and on Linux nfsd, whose
xfs has no reflink), not written through the daemon.  nfs-ganesha has neither
COPY nor CLONE: what is recognised there is written after all, and the copy
must still come out whole.  With detect_copies=off nothing is recognised.  Data
the daemon never served, or that differs from what it served, is written as it
came.

The NFS servers run the main tools only, on small files: nfsd is a qemu guest
under TCG, slow to move bytes.
"""

import os
import shutil
import subprocess
import sys
import threading

import pytest
from mpkit import MiB, make_tree, sh, sha256, tree_digest, write_file

WHERE = ["local-btrfs", "smb-btrfs", "smb-xfs", "smb-ext4"]
NFS = ["nfsd", "nfs-ganesha"]
NO_OFFLOAD = {"nfs-ganesha"}  # places with no offload for a recognised copy to be committed by
SIZE = 8 * MiB + 12345  # not a whole number of blocks: the short last block must be recognised too
NFS_SIZE = 2 * MiB + 12345


@pytest.fixture(params=WHERE)
def mnt(request, mount_on):
    return place(request.param, mount_on)


@pytest.fixture(params=WHERE + NFS)
def anywhere(request, mount_on):
    """As mnt, and on the NFS servers too."""
    return place(request.param, mount_on)


def place(where, mount_on):
    # offload=always: a recognised copy from a source whose attributes prove nothing (SMB) is
    # committed and read back whatever the link's measured read and write rates say (the choice
    # between that and writing is Planner.verify_pays's, tested in tests/test_planner.py).
    mnt = mount_on(where, ["offload=always"])
    mnt.where = where
    mnt.size = NFS_SIZE if where.startswith("nfs") else SIZE
    return mnt


def committed(counters):
    return sum(counters["recognised_committed"].values())


def assert_offloaded(mnt, size):
    """At least ``size`` bytes were recognised and committed as offloads; none fell back.
    Where there is no offload, nothing is committed and whatever was recognised was written."""
    c = mnt.counters()
    if mnt.where in NO_OFFLOAD:
        assert committed(c) == 0, c
        assert c["recognised_written"] == c["recognised_bytes"], c
        return
    assert committed(c) >= size, c
    assert c["recognised_written"] == 0, c
    assert c["recognised_bytes"] == committed(c), c


def source_file(mnt, name="src", size=None):
    """A file made on the backing store, not through the mount: the daemon has served none of it."""
    digest = write_file(mnt.backing / name, mnt.size if size is None else size)
    return mnt.path / name, digest


def test_shutil_copyfile(anywhere):
    mnt = anywhere
    src, digest = source_file(mnt)
    shutil.copyfile(src, mnt.path / "dst")
    assert sha256(mnt.path / "dst") == digest
    assert sha256(mnt.backing / "dst") == digest
    assert_offloaded(mnt, mnt.size)


def test_shutil_copytree(anywhere):
    mnt = anywhere
    make_tree(mnt.backing / "tree", modes=mnt.can("chmod"), symlink=mnt.can("symlink"))
    shutil.copytree(mnt.path / "tree", mnt.path / "copy", symlinks=True)
    assert tree_digest(mnt.backing / "copy", mnt.can("chmod")) == tree_digest(mnt.backing / "tree", mnt.can("chmod"))
    assert_offloaded(mnt, 3 * MiB)  # the tree's largest file at least


@pytest.mark.parametrize("bs", ["4k", "64k", "100k", "1M"])
def test_dd(anywhere, bs):
    mnt = anywhere
    src, digest = source_file(mnt)
    sh("dd", f"if={src}", f"of={mnt.path / 'dst'}", f"bs={bs}", "status=none")
    assert sha256(mnt.backing / "dst") == digest
    assert_offloaded(mnt, mnt.size)


def test_dd_of_zeros_after_reading_zeros_is_one_copy(mnt):
    """Every block of zeros has one digest, and the block served last (here the file's end, read
    again) would answer for all: a run a block.  Matched at the write's own offset, it is one."""
    (mnt.backing / "zeros").write_bytes(bytes(8 * MiB))
    sh("cat", mnt.path / "zeros")
    sh("dd", f"if={mnt.path / 'zeros'}", "of=/dev/null", "bs=64k", f"skip={8 * MiB // 65536 - 1}", "count=1",
       "iflag=direct", "status=none")
    before = sum(mnt.counters()["copies"].values())
    sh("dd", "if=/dev/zero", f"of={mnt.path / 'dst'}", "bs=1M", "count=8", "status=none")
    assert (mnt.backing / "dst").read_bytes() == bytes(8 * MiB)
    assert_offloaded(mnt, 8 * MiB)
    assert sum(mnt.counters()["copies"].values()) - before == 1


def test_tar_through_a_pipe(anywhere):
    mnt = anywhere
    (mnt.backing / "tree").mkdir()
    write_file(mnt.backing / "tree" / "big", mnt.size)
    write_file(mnt.backing / "tree" / "small", 70_000)
    (mnt.path / "out").mkdir()
    sh("sh", "-c", f"tar -C '{mnt.path / 'tree'}' -cf - . | tar -C '{mnt.path / 'out'}' -xf -")
    for name in ("big", "small"):
        assert sha256(mnt.backing / "out" / name) == sha256(mnt.backing / "tree" / name)
    assert_offloaded(mnt, mnt.size)


def test_the_first_clone_of_a_file_is_not_taken_for_a_change_to_it(mount_on):
    """xfs marks a file shared on its first clone, which moves its ctime and NFS change attribute:
    data recognised from a file never cloned before is committed by CLONE all the same, not
    written after all as if the file had changed (tar c | tar x of 1 GiB on nfsd wrote all of it)."""
    mnt = place("nfsd-reflink", mount_on)
    (mnt.backing / "tree").mkdir()
    for name in ("a", "b"):
        write_file(mnt.backing / "tree" / name, mnt.size)
    (mnt.path / "out").mkdir()
    sh("sh", "-c", f"tar -C '{mnt.path / 'tree'}' -cf - . | tar -C '{mnt.path / 'out'}' -xf -")
    for name in ("a", "b"):
        assert sha256(mnt.backing / "out" / name) == sha256(mnt.backing / "tree" / name)
    assert_offloaded(mnt, 2 * mnt.size)
    assert mnt.counters()["recognised_committed"]["clone"] > 0


def test_cat(anywhere):
    """cat may use copy_file_range (a copy request) or read and write (recognised): offloaded either way."""
    mnt = anywhere
    src, digest = source_file(mnt)
    sh("sh", "-c", f"cat '{src}' > '{mnt.path / 'dst'}'")
    assert sha256(mnt.backing / "dst") == digest
    c = mnt.counters()
    if mnt.where not in NO_OFFLOAD:
        assert committed(c) + sum(c["copy_bytes"][m] for m in ("clone", "server_copy")) >= mnt.size, c


def test_rsync_whole_file(anywhere):
    mnt = anywhere
    sh("rsync", "--version")
    src, digest = source_file(mnt)
    sh("rsync", "-a", src, mnt.path / "dst")  # a temporary file, then renamed
    assert sha256(mnt.backing / "dst") == digest
    assert_offloaded(mnt, mnt.size - 2 * 64 * 1024)


def test_rsync_update_copies_unchanged_blocks_from_the_basis(anywhere):
    mnt = anywhere
    src, digest = source_file(mnt)
    sh("rsync", "-a", src, mnt.path / "dst")
    before = committed(mnt.counters())
    with open(mnt.backing / "src", "r+b") as f:  # a change in place: the other blocks stay where they were
        f.seek(mnt.size * 3 // 8 + 5)
        f.write(b"changed")
    os.utime(mnt.backing / "src", ns=(1, 1))
    sh("rsync", "-a", "--no-whole-file", src, mnt.path / "dst")
    assert sha256(mnt.backing / "dst") == sha256(mnt.backing / "src")
    if mnt.where in NO_OFFLOAD:
        assert_offloaded(mnt, 0)
    else:  # read from the basis, written back
        assert committed(mnt.counters()) - before >= mnt.size * 3 // 4


def test_rsync_update_after_an_insertion_copies_the_shifted_blocks_from_the_basis(anywhere, tmp_path):
    """A source outside the mount with bytes inserted near its start, and its older copy on the
    server: rsync's receiver reads that basis through the mount and writes the basis's blocks
    after the insertion at other offsets than it read them from, in a new temporary file."""
    mnt = anywhere
    data = os.urandom(mnt.size)
    (mnt.backing / "dst").write_bytes(data)
    at = len(data) // 8 + 5
    src = tmp_path / "src"
    src.write_bytes(data[:at] + b"inserted" * 13 + data[at:])
    sh("rsync", "-a", "--no-whole-file", src, mnt.path / "dst")
    assert sha256(mnt.backing / "dst") == sha256(src)
    if mnt.where in NO_OFFLOAD:
        assert_offloaded(mnt, 0)
    else:  # read from the basis, written back: the bytes before the insertion and those after it
        assert committed(mnt.counters()) >= mnt.size * 3 // 4


def test_rsync_inplace(anywhere):
    mnt = anywhere
    src, _ = source_file(mnt)
    sh("rsync", "-a", src, mnt.path / "dst")
    with open(mnt.backing / "src", "r+b") as f:
        f.seek(mnt.size * 5 // 8)
        f.write(os.urandom(100_000))
    os.utime(mnt.backing / "src", ns=(1, 1))
    sh("rsync", "-a", "--inplace", "--no-whole-file", src, mnt.path / "dst")
    assert sha256(mnt.backing / "dst") == sha256(mnt.backing / "src")
    assert_offloaded(mnt, mnt.size)  # the first copy's at least


def test_two_copies_interleaved(anywhere):
    mnt = anywhere
    sources = [source_file(mnt, f"src{i}") for i in range(2)]
    step = threading.Barrier(2)

    def copy(i):
        src, _ = sources[i]
        with open(src, "rb") as fin, open(mnt.path / f"dst{i}", "wb") as fout:
            while block := fin.read(100_000):
                step.wait(timeout=30)  # one block of each in turn
                fout.write(block)
        step.abort()

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (_, digest) in enumerate(sources):
        assert sha256(mnt.backing / f"dst{i}") == digest
    assert_offloaded(mnt, 2 * mnt.size)


@pytest.mark.parametrize("where", ["local-btrfs", "smb-btrfs"])
def test_copies_at_once_past_the_bound_on_what_is_held(mount_on, where):
    """Four tools at once, holding more than the mount's bound (recognise.HELD_MAX, 64 MiB) between
    them: files commit under the bound while others close (one such write met a file committed
    meanwhile and failed with EIO)."""
    mnt = place(where, mount_on)
    size = 40 * MiB + 4321
    sources = [source_file(mnt, f"src{i}", size) for i in range(4)]
    dst = [mnt.path / f"dst{i}" for i in range(4)]
    procs = [subprocess.Popen(["rsync", "-a", sources[0][0], dst[0]]),
             subprocess.Popen(["rsync", "-a", sources[1][0], dst[1]]),
             subprocess.Popen([sys.executable, "-c", "import shutil, sys; shutil.copyfile(*sys.argv[1:])",
                               sources[2][0], dst[2]]),
             subprocess.Popen(["dd", f"if={sources[3][0]}", f"of={dst[3]}", "bs=1M", "status=none"])]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    for i, (_, digest) in enumerate(sources):
        assert sha256(mnt.backing / f"dst{i}") == digest
    # A reply of bytes read again behind its file's stream ended the stream: 0.1-0.4 MB of the 160 MiB
    # went unrecognised in 1 run in 3 to 10 (Served.add lets the stream go on now: 0 in 16 runs). The
    # margin stays: the test is for the EIO and the data.
    c = mnt.counters()
    assert committed(c) >= 0.9 * 4 * size and c["recognised_written"] == 0, c


@pytest.mark.parametrize("where,options", [("local-btrfs", ["detect_copies=off"]), ("local-ext4", [])])
def test_copies_are_not_looked_for(mount_on, where, options):
    """Not with detect_copies=off; nor on a local filesystem that cannot clone, where a recognised
    copy would be committed by the kernel copying the bytes, which costs what writing them does:
    nothing is won for hashing every byte read and written (a third of a read's time on tmpfs)."""
    mnt = mount_on(where, options)
    mnt.where, mnt.size = where, SIZE
    src, digest = source_file(mnt)
    shutil.copyfile(src, mnt.path / "dst")
    assert sha256(mnt.backing / "dst") == digest
    c = mnt.counters()
    assert c["recognised_bytes"] == 0 and committed(c) == 0, c
    assert c["fuse_write_bytes"] >= SIZE


def test_data_never_served_is_written(mnt):
    """The same bytes as a file's, but not read from it through the mount: nothing to copy from."""
    write_file(mnt.backing / "src", SIZE)
    data = (mnt.backing / "src").read_bytes()
    (mnt.path / "dst").write_bytes(data)
    assert sha256(mnt.backing / "dst") == sha256(mnt.backing / "src")
    assert mnt.counters()["recognised_bytes"] == 0


def test_one_byte_changed_is_written_as_is(mnt):
    src, _ = source_file(mnt)
    data = bytearray(src.read_bytes())
    data[5 * MiB + 3] ^= 0xFF
    (mnt.path / "dst").write_bytes(data)
    assert (mnt.backing / "dst").read_bytes() == data
    assert (mnt.path / "dst").read_bytes() == data
    c = mnt.counters()
    assert 0 < c["recognised_bytes"] <= SIZE - 8 * 1024, c  # the changed chunk (8 KiB at least) is not among them


def test_reads_and_stat_see_pending_data(mnt):
    """Before any close, the written size and bytes are what the application wrote."""
    src, digest = source_file(mnt)
    data = src.read_bytes()
    with open(mnt.path / "dst", "wb") as f:
        f.write(data)
        f.flush()
        assert os.fstat(f.fileno()).st_size == SIZE
        assert os.stat(mnt.path / "dst").st_size == SIZE
        with open(mnt.path / "dst", "rb") as g:
            assert sha256(g.name) == digest
    assert sha256(mnt.backing / "dst") == digest
