"""Issue #30: once write, fsync or close returns 0, the file holds exactly the bytes the program wrote,
whatever other clients and programs on the server do meanwhile.

The foreign writers: a program on the server (a process writing the directory behind the share or
export, which breaks no SMB lease while Samba runs with `kernel oplocks = no`), and a second client
(another offloadfs mount of the same share, with its own connection; nfsd's directory is seen
through one, see nfskit).  Each rewrites a file in place,
keeping its size, and puts its times back as `cp -p`, `touch -r` and `tar x` do: on Samba nothing in
the attributes then tells the rewrite apart (the ctime is the mtime, an open file's write time is held).
"""

import os
from contextlib import ExitStack

import pytest
from mpkit import MiB, assert_same, rewrite_keeping_times

from offloadfs.lab.mount import offloadfs_mount

SIZE = 8 * MiB + 12345
REWRITE = 4 * MiB  # the source's first bytes, rewritten after they were read
WHERE = ["smb-btrfs", "smb-xfs", "smb-ext4", "nfs-ganesha", "nfsd", "local-btrfs"]


@pytest.fixture(params=WHERE)
def place(request, mount_on):
    # offload=always: a recognised copy from a source whose attributes prove nothing is held and read
    # back, whatever the rates measured on the lab's bare veth say (they could have it written instead)
    mnt = mount_on(request.param, ["offload=always"])
    mnt.where = request.param
    return mnt


@pytest.fixture
def other_client(smb):
    """Factory: (our mount, a second client's mount, the server's path) of a fresh directory of SMB
    share ``kind``."""
    with ExitStack() as stack:

        def make(kind):
            url, path = smb.fresh_dir(kind)
            ours, theirs = (stack.enter_context(offloadfs_mount(url, options=[*smb.options(), "offload=always"]))
                            for _ in range(2))
            return ours, theirs, path

        yield make


def copy_by_hand(src, dst, between):
    """What shutil and rsync do, read() then write(), with ``between()`` run after all of the source
    was read and written, before the destination's close commits what was recognised."""
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while block := os.read(fin, MiB):
            os.write(fout, block)
        between()
    finally:
        os.close(fin)
        os.close(fout)


def test_a_recognised_copy_holds_what_was_read_when_a_program_on_the_server_rewrites_the_source(place):
    """shutil read the source's first MiBs, a program on the server rewrote them in place and put
    the times back: the copy must hold what shutil read and wrote, not the source's new bytes."""
    mnt = place
    data = os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(data)
    copy_by_hand(mnt.path / "src", mnt.path / "dst",
                 lambda: rewrite_keeping_times(mnt.backing / "src", os.urandom(REWRITE)))
    assert_same((mnt.backing / "dst").read_bytes(), data)
    c = mnt.counters()
    assert c["recognised_bytes"] >= SIZE - 2 * MiB, c  # it was a recognised copy


def test_a_file_rewritten_with_its_times_put_back_is_read_anew_by_the_next_open(place):
    """Close-to-open: a program on the server rewrites a file this mount read, and puts its times
    back; after `ls -l`, a new open reads the new bytes, and a copy of them holds them.  (With the
    file held open meanwhile, SMB pages follow the lease, which such a program does not break; a
    second client's rewrite does: test_mp_leases.)"""
    mnt = place
    old, new = os.urandom(SIZE), os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(old)
    assert_same((mnt.path / "src").read_bytes(), old)
    rewrite_keeping_times(mnt.backing / "src", new)
    os.stat(mnt.path / "src")
    assert_same((mnt.path / "src").read_bytes(), new)
    copy_by_hand(mnt.path / "src", mnt.path / "dst", lambda: None)
    assert_same((mnt.backing / "dst").read_bytes(), new)


@pytest.mark.parametrize("kind", ["btrfs", "xfs"])
def test_a_second_client_rewriting_the_source_with_its_times_put_back(other_client, kind):
    """Another SMB client (its own connection) rewrites the source after it was read and copied
    here, before the copy's close: the copy holds what was read."""
    ours, theirs, backing = other_client(kind)
    data = os.urandom(SIZE)
    (backing / "src").write_bytes(data)
    copy_by_hand(ours / "src", ours / "dst", lambda: rewrite_keeping_times(theirs / "src", os.urandom(REWRITE)))
    assert_same((backing / "dst").read_bytes(), data)
