"""Write errors as Linux reports them (errseq, lib/errseq.c): with other closers present.

A write is answered before the server has it (writebehind.py), so what the
server refuses is reported later: to each open file description that had the
file open for writing when the write failed, at its writes and closes until
its fsync has heard it, whichever other descriptions close first. A
read-only close (a `cat` of the file) never takes it, nor does a child's
close of a descriptor it inherited, and a description opened after the
failure never hears of it.

Each test writes 64 KiB to a server whose filesystem has no block left: the
write is answered at once and refused there. Whoever opens the file next
waits for that write (close-to-open), so the refusal precedes every later
open in these tests, whatever the timing.
"""

import contextlib
import errno
import os
import shutil
import subprocess

import pytest
from mpkit import MiB
from smbkit import smb_lab

from offloadfs.lab.ganesha import ganesha_lab
from offloadfs.lab.mount import offloadfs_mount

WRITE = 64 << 10


@pytest.fixture(scope="module", params=["smb-ext4", "smb-ext4-durable", "nfs-ganesha"])
def server(request):
    """(URL, server-side directory, mount options) of a lab of this module's own: its filesystem
    gets filled up.  Both share configurations of the Samba lab: the durable one keeps durable
    handles (batch oplocks)."""
    if request.param.startswith("smb-"):
        if shutil.which("smbd") is None:
            pytest.skip("smbd is not installed (apt-get install samba samba-vfs-modules)")
        share = request.param.removeprefix("smb-")
        with smb_lab(servers=1, kinds=("ext4",), durable=("ext4",) if share == "ext4-durable" else ()) as lab:
            yield lab.url(share), lab.lab.server.shares[share].path, lab.options()
    else:
        if shutil.which("ganesha.nfsd") is None:
            pytest.skip("ganesha.nfsd is not installed (apt-get install nfs-ganesha nfs-ganesha-vfs)")
        with ganesha_lab(kind="ext4") as lab:
            s = lab.server
            yield f"nfs://{s.host}{s.export}", s.path, []


@pytest.fixture
def file(server):
    """Descriptors of "f" on a mount of the server, whose filesystem has no block left but for that
    empty file, made before; emptied again after the test."""
    url, path, options = server
    (path / "f").touch()
    fill(path / "filler")
    try:
        with offloadfs_mount(url, options=options) as mnt:
            f = Descriptors(mnt / "f")
            try:
                yield f
            finally:
                for fd in f.fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
    finally:
        for f in path.iterdir():
            f.unlink()


def fill(path):
    """Allocate to ``path`` every block its filesystem will give (each ENOSPC halves the step;
    what a refused step took stays taken)."""
    with open(path, "wb") as f:
        size, step = 0, 256 * MiB
        while step >= 4096:
            try:
                os.posix_fallocate(f.fileno(), size, step)
                size += step
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                step //= 2


class Descriptors:
    """Descriptors of one file, each closed once: by the test, or after it."""

    def __init__(self, path):
        self.path = path
        self.fds = []

    def open(self, flags=os.O_WRONLY):
        self.fds.append(os.open(self.path, flags))
        return self.fds[-1]

    def close(self, fd):
        """close(2) ``fd``: the errno it failed with, 0 for none."""
        self.fds.remove(fd)
        try:
            os.close(fd)
        except OSError as e:
            return e.errno
        return 0


def refused(fd):
    """Write through ``fd`` what the server will refuse: answered before it does.  One WRITE
    request: the kernel cuts a write of 1 MiB from a buffer not page aligned into two, and the
    second could meet the first one's error."""
    assert os.write(fd, os.urandom(WRITE)) == WRITE


def fails_enospc(call, *args):
    with pytest.raises(OSError) as e:
        call(*args)
    assert e.value.errno == errno.ENOSPC, e.value


def cat(path):
    """Read ``path`` with cat, which fails where its close does."""
    done = subprocess.run(["cat", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60)
    assert done.returncode == 0, f"a read-only close took the writer's error: {done.stderr.strip()}"


def test_a_cat_closing_first_leaves_the_error_to_the_writer(file):
    """The issue's case: a `cat` of the file between the refusal and the writer's fsync."""
    fd = file.open()
    refused(fd)
    cat(file.path)
    fails_enospc(os.write, fd, b"x")  # its writes fail until it has heard
    fails_enospc(os.fsync, fd)
    assert file.close(fd) == 0  # heard once


def test_a_child_closing_the_writers_descriptor_leaves_the_error_to_the_writer(file):
    """The issue's other case: the writer's subprocess.run, whose child closes the descriptor it
    inherited (so does every exec, closing those marked close-on-exec).  FUSE sends a FLUSH for
    each close(2), on the description they share: Linux's own NFS client reports the error there,
    where nobody hears it; here the writer still does."""
    fd = file.open()
    refused(fd)
    assert subprocess.run(["true"], pass_fds=[fd], timeout=60).returncode == 0
    fails_enospc(os.fsync, fd)


def test_another_writer_closing_first_hears_it_and_the_writer_still_does(file):
    """Each description open for writing when the write failed hears of it once."""
    fd, other = file.open(), file.open()
    refused(fd)
    assert file.close(other) == errno.ENOSPC
    fails_enospc(os.fsync, fd)
    os.fsync(fd)
    assert file.close(fd) == 0


def test_a_writer_hears_it_at_close_after_a_cat_and_another_writer(file):
    fd, other = file.open(), file.open()
    refused(fd)
    cat(file.path)
    assert file.close(other) == errno.ENOSPC
    assert file.close(fd) == errno.ENOSPC


def test_a_description_opened_after_the_failure_does_not_hear_of_it(file):
    fd = file.open()
    refused(fd)
    late = file.open()  # the open waits for the refused write
    os.fsync(late)
    assert file.close(late) == 0
    fails_enospc(os.fsync, fd)
