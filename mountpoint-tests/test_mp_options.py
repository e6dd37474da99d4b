"""Mount options change what the mount does, checked by their effects."""

import errno
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mpkit import MiB, sh, sha256, write_file

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import unmount

NOBODY = 65534


def expect_errno(code, fn, *args):
    with pytest.raises(OSError) as err:
        fn(*args)
    assert err.value.errno == code, err.value


def test_ro_refuses_writes(backing, mount):
    src = backing()
    (src / "f").write_bytes(b"keep")
    (src / "d").mkdir()
    mnt = mount(src, ["ro"])
    assert (mnt.path / "f").read_bytes() == b"keep"
    expect_errno(errno.EROFS, open, mnt.path / "f", "r+b")
    expect_errno(errno.EROFS, open, mnt.path / "new", "wb")
    expect_errno(errno.EROFS, os.mkdir, mnt.path / "dir")
    expect_errno(errno.EROFS, os.unlink, mnt.path / "f")
    expect_errno(errno.EROFS, os.rmdir, mnt.path / "d")
    expect_errno(errno.EROFS, os.chmod, mnt.path / "f", 0o777)
    assert sorted(os.listdir(src)) == ["d", "f"]
    assert (src / "f").read_bytes() == b"keep"


def test_uid_gid(backing, mount):
    src = backing()
    (src / "f").write_bytes(b"x")
    (src / "d").mkdir()
    mnt = mount(src, ["uid=1234", "gid=2345"])
    for path in (mnt.path, mnt.path / "f", mnt.path / "d"):
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (1234, 2345), path
    assert os.stat(src / "f").st_uid == 0


def test_umask(backing, mount):
    src = backing()
    for name, mode in (("wide", 0o777), ("file", 0o666)):
        (src / name).write_bytes(b"x")
        os.chmod(src / name, mode)
    (src / "dir").mkdir()
    os.chmod(src / "dir", 0o777)
    mnt = mount(src, ["umask=027"])
    assert stat.S_IMODE(os.stat(mnt.path / "wide").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(mnt.path / "dir").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(mnt.path / "file").st_mode) & 0o027 == 0


def test_offload_off_streams(backing, mount):
    src = backing("btrfs")
    mnt = mount(src, ["offload=off"])
    digest = write_file(mnt.path / "a", 8 * MiB + 1)
    sh("cp", mnt.path / "a", mnt.path / "b")
    assert sha256(src / "b") == digest
    counters = mnt.counters()
    assert {m for m, n in counters["copies"].items() if n} == {"stream"}, counters
    assert counters["copy_bytes"]["stream"] == 8 * MiB + 1


@pytest.mark.parametrize("passthrough", [True, False])
def test_passthrough_bypasses_daemon(passthrough, backing, mount):
    src = backing()
    digest = write_file(src / "in", 32 * MiB)
    mnt = mount(src, ["passthrough"] if passthrough else [])
    before = mnt.counters()
    assert sha256(mnt.path / "in") == digest
    read = mnt.counters()["fuse_read_bytes"] - before["fuse_read_bytes"]
    if passthrough:
        assert read < MiB
    else:  # the control: without passthrough every byte passes the daemon
        assert read >= 32 * MiB
    sh("dd", "if=/dev/zero", f"of={mnt.path / 'out'}", "bs=1M", "count=16", "conv=fsync",
       "status=none")
    assert (src / "out").read_bytes() == bytes(16 * MiB)
    digest = write_file(mnt.path / "rand", 5 * MiB + 7)
    assert sha256(src / "rand") == digest == sha256(mnt.path / "rand")


def test_passthrough_second_open_of_an_open_file(backing, mount):
    """The kernel fixes an inode's backing file while any handle has it open: every open of the
    file, whatever its access mode, must get the same one, and all see the same bytes."""
    src = backing()
    mnt = mount(src, ["passthrough"])
    path, before = mnt.path / "f", mnt.counters()
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(first, b"a" * 100, 0)
        reader = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(reader, 200, 0) == b"a" * 100
            second = os.open(path, os.O_RDWR)
            try:
                os.pwrite(second, b"b" * 50, 80)
                os.pwrite(first, b"c" * 10, 0)
                want = b"c" * 10 + b"a" * 70 + b"b" * 50
                for fd in (first, reader, second):
                    assert os.pread(fd, 200, 0) == want
                assert (src / "f").read_bytes() == want
            finally:
                os.close(second)
        finally:
            os.close(reader)
    finally:
        os.close(first)
    for _ in range(2):  # open, close, open: the last release let go of the backing file
        reader = os.open(path, os.O_RDONLY)
        writer = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(writer, b"d")
            assert os.pread(reader, 200, 0) == (src / "f").read_bytes()
        finally:
            os.close(writer)
            os.close(reader)
    assert (src / "f").read_bytes() == want + b"dd"
    after = mnt.counters()
    assert after["fuse_read_bytes"] == before["fuse_read_bytes"]  # all of it passed through
    assert after["fuse_write_bytes"] == before["fuse_write_bytes"]


@pytest.fixture
def as_nobody():
    """Run a command as user nobody, who may open /dev/fuse (mode 0600 here: made 0666 meanwhile).

    nobody keeps CAP_DAC_READ_SEARCH only to reach this Python under /root; fusermount3
    mounts for it as for any user, and the kernel grants it nothing root has.
    """
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    made = []

    def run(*cmd):
        return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
                               *map(str, cmd)], capture_output=True, text=True, timeout=60)

    def directory():
        path = Path(tempfile.mkdtemp(prefix="offloadfs-nobody-"))
        os.chown(path, NOBODY, NOBODY)
        made.append(path)
        return path

    run.directory = directory
    try:
        yield run
    finally:
        os.chmod("/dev/fuse", mode)
        for path in made:
            if is_mounted(path):
                unmount(path)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def test_passthrough_is_refused_for_a_user(as_nobody):
    """The kernel lets only root register backing files: a user's passthrough mount would fail
    every open (EPERM) and leave empty files behind, so it must not mount at all."""
    src, mp = as_nobody.directory(), as_nobody.directory()
    cli = (sys.executable, "-m", "offloadfs")
    proc = as_nobody(*cli, "mount", src, mp, "-o", "passthrough")
    assert (proc.returncode, proc.stderr.count("\n")) == (1, 1), proc.stderr
    assert "passthrough" in proc.stderr and "root" in proc.stderr, proc.stderr
    assert not is_mounted(mp)
    # The control: the same user mounts without it, and files are written.
    proc = as_nobody(*cli, "mount", src, mp)
    assert proc.returncode == 0, proc.stderr
    assert as_nobody("sh", "-c", f"echo hello > {mp}/new").returncode == 0
    assert (src / "new").read_text() == "hello\n"


def test_writeback_cache_random_writes(backing, mount):
    src = backing()
    mnt = mount(src, ["writeback_cache"])
    rng = random.Random(7)
    model = bytearray()
    with open(mnt.path / "f", "w+b") as f:
        for _ in range(300):
            off, data = rng.randrange(2 * MiB), rng.randbytes(rng.randrange(1, 70_000))
            f.seek(off)
            f.write(data)
            model[len(model):off] = bytes(max(0, off - len(model)))
            model[off : off + len(data)] = data
            if rng.random() < 0.05:
                f.truncate(size := rng.randrange(2 * MiB))
                del model[size:]
                model.extend(bytes(size - len(model)))
        f.flush()
        os.fsync(f.fileno())
    assert (mnt.path / "f").read_bytes() == model
    assert (src / "f").read_bytes() == model


def test_attr_timeout_zero_sees_backing_changes(backing, mount):
    src = backing()
    mnt = mount(src, ["attr_timeout=0", "entry_timeout=0"])
    (src / "f").write_bytes(b"12")
    assert os.stat(mnt.path / "f").st_size == 2
    (src / "f").write_bytes(b"12345")
    assert os.stat(mnt.path / "f").st_size == 5
    os.unlink(src / "f")
    assert not (mnt.path / "f").exists()


def test_debug_and_ignored_fstab_options(backing, mount):
    src = backing()
    mnt = mount(src, ["debug", "defaults", "noauto", "nofail", "_netdev", "x-systemd.foo=1", "rw"])
    digest = write_file(mnt.path / "a", MiB)
    sh("cp", mnt.path / "a", mnt.path / "b")
    assert sha256(src / "b") == digest
