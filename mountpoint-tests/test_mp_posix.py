"""POSIX rules that pjdfstest checks, from the defects it found (issue 33), on every place
where they apply.

- A write by a user who may not keep setuid/setgid (not root) clears them, and the mode says
  so at once, through this mount and through another mount of the same directory.  On NFS the
  server clears them (the writer may not chmod a file they do not own); locally the daemon does.
  A truncate by them succeeds too.
- A file unlinked while open has 0 links (fstat).
- The longest name a mount reports (statfs) is the longest it takes, at most 255 bytes, and a
  longer name fails with ENAMETOOLONG before any request reaches the server.
"""

import errno
import os
import stat
import subprocess

import pytest

NOBODY = 65534


def as_nobody(cwd, script):
    """Run ``sh -c script`` in ``cwd`` as uid and gid 65534, with no other groups."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "sh", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120)


def second_mount(mnt, mount):
    """Another mount of the directory ``mnt`` shows: another client of its server."""
    return mount(next(iter(mnt.status()["sources"].values()))).path


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


WRITES = {"rw": "printf x 1<>f", "append": "printf x >>f", "trunc": "printf x >f"}
SETID_CASES = [pytest.param(where, options, how, id="-".join([where, *options, how])) for where, options, how in (
    [(where, [], how) for where in ("local-ext4", "nfs-ganesha") for how in WRITES]
    + [("local-ext4", ["passthrough"], "rw"), ("local-ext4", ["passthrough"], "append"), ("nfsd", [], "rw")])]


@pytest.mark.parametrize("where,options,how", SETID_CASES)
def test_a_write_by_another_user_clears_setuid_and_setgid(where, options, how, mount_on, mount):
    """`chmod 6777 f`, then uid 65534 writes it: the write succeeds, and the mode is 0777 at
    once through this mount and a second one (pjdfstest chmod/12).  With passthrough the kernel
    would write the backing file as the daemon, root, who keeps them."""
    mnt = mount_on(where, ["allow_other", *options])
    (mnt.path / "f").write_bytes(b"")
    os.chmod(mnt.path / "f", 0o6777)
    assert mode(mnt.path / "f") == 0o6777  # cached here, in the kernel and the daemon
    done = as_nobody(mnt.path, WRITES[how])
    assert done.returncode == 0, done.stderr
    other = second_mount(mnt, mount)
    for path in (mnt.path / "f", other / "f"):
        assert mode(path) == 0o777, path
        assert path.read_bytes() == b"x", path


@pytest.mark.parametrize("where", ["local-ext4", "nfs-ganesha", "nfsd"])
def test_a_truncate_by_another_user_succeeds(where, mount_on, mount):
    """uid 65534 truncates a setuid file it may write: the truncate succeeds, and both mounts
    show the mode the server keeps (locally, as the kernel does, without setuid and setgid; over
    NFS whatever the server decides, as with the Linux client)."""
    mnt = mount_on(where, ["allow_other"])
    (mnt.path / "f").write_bytes(b"abc")
    os.chmod(mnt.path / "f", 0o6777)
    assert mode(mnt.path / "f") == 0o6777
    done = as_nobody(mnt.path, "truncate -s 1 f")
    assert done.returncode == 0, done.stderr
    other = second_mount(mnt, mount)
    assert mode(mnt.path / "f") == mode(other / "f") == stat.S_IMODE(os.stat(mnt.backing / "f").st_mode)
    if where.startswith("local"):
        assert mode(mnt.path / "f") == 0o777
    assert (other / "f").read_bytes() == b"a"


@pytest.mark.parametrize("where", ["local-ext4", "smb-btrfs", "smb-xfs", "smb-ext4", "nfs-ganesha", "nfsd"])
def test_an_open_file_unlinked_has_no_links_left(where, mount_on):
    """fstat of an open file after unlink says 0 links (pjdfstest unlink/14), and 1 after its
    other name goes first.  Samba keeps such a file delete-pending until it is closed."""
    mnt = mount_on(where)
    fd = os.open(mnt.path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x")
        os.link(mnt.path / "f", mnt.path / "g")
        os.unlink(mnt.path / "g")
        assert os.fstat(fd).st_nlink == 1
        os.unlink(mnt.path / "f")
        st = os.fstat(fd)
        assert (st.st_nlink, st.st_size) == (0, 1)
        assert os.pread(fd, 1, 0) == b"x"
    finally:
        os.close(fd)
    mnt.settle(mnt.backing / "f")
    assert not (mnt.backing / "f").exists()


@pytest.mark.parametrize("where", ["nfs-ganesha"])
def test_the_longest_name_is_the_one_reported(where, mount_on):
    """statfs's name length is what the server takes, 255 at most as with the Linux NFS client
    (ganesha says 1024 while its xfs takes 255): tools trust it (pathconf).  A name of that
    length works everywhere; one byte more fails with ENAMETOOLONG, without a request."""
    mnt = mount_on(where)
    longest = os.statvfs(mnt.path).f_namemax
    assert longest == os.pathconf(mnt.path, "PC_NAME_MAX") == 255
    a, b, c = ("a" * longest, "b" * longest, "c" * longest)
    (mnt.path / a).write_bytes(b"x")
    os.rename(mnt.path / a, mnt.path / b)
    os.link(mnt.path / b, mnt.path / c)
    os.symlink(b, mnt.path / a)
    os.mkdir(mnt.path / ("d" * longest))
    assert sorted(os.listdir(mnt.path)) == [a, b, c, "d" * longest]
    assert os.stat(mnt.path / a).st_nlink == 2
    assert os.listdir(mnt.backing) == os.listdir(mnt.path)
    long = mnt.path / ("e" * (longest + 1))
    before = mnt.counters()
    for call in (lambda: os.stat(long), lambda: os.open(long, os.O_CREAT | os.O_WRONLY), lambda: os.mkdir(long),
                 lambda: os.symlink(b, long)):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.ENAMETOOLONG
    after = mnt.counters()  # the long name was never looked up at the server
    assert (after["lookups"], after["listings"]) == (before["lookups"], before["listings"])
    for call in (lambda: os.rename(mnt.path / b, long), lambda: os.link(mnt.path / b, long)):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == errno.ENAMETOOLONG
    assert sorted(os.listdir(mnt.backing)) == [a, b, c, "d" * longest]
