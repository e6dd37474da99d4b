"""Everyday tools on a mount: content by sha256, metadata by os.stat.

Each result is also checked on the backing directory, so a tool that only
appears to work thanks to the kernel's caches still fails. Every test runs
wherever the files live: a local directory, and an SMB share on each kind of
filesystem (and one of Samba 4.22), and an export of nfs-ganesha and of Linux nfsd. What a place cannot store (symlinks, modes, owners, devices on
SMB) has its own tests, skipped there with the reason; trees copied there
are made without it and compared without it.
"""

import errno
import os
import stat
import subprocess
import sys

import pytest
from mpkit import MiB, make_tree, sh, sha256, total_copies, tree_digest, write_file

WHERE = ["local-ext4", "smb-btrfs", "smb-xfs", "smb-ext4", "smb422-xfs", "ksmbd-xfs", "nfs-ganesha", "nfsd"]


@pytest.fixture(params=WHERE)
def mnt(request, mount_on):
    return mount_on(request.param)


def tree(mnt, root):
    """make_tree with only what the mount can store."""
    make_tree(root, modes=mnt.can("chmod"), symlink=mnt.can("symlink"))


def test_cp_is_one_copy_request(mnt):
    digest = write_file(mnt.path / "a", 5 * MiB + 3)
    sh("cp", mnt.path / "a", mnt.path / "b")
    assert sha256(mnt.path / "b") == digest
    assert sha256(mnt.backing / "b") == digest
    counters = mnt.counters()
    assert counters["copy_requests"] >= 1
    assert total_copies(counters) >= 1
    assert sum(counters["copy_bytes"].values()) == 5 * MiB + 3


def test_cp_a_preserves_tree_and_metadata(mnt):
    src = mnt.path / "src"
    src.mkdir()
    tree(mnt, src)
    if mnt.can("xattr"):
        os.setxattr(src / "a", "user.note", b"kept")
    sh("cp", "-a", src, mnt.path / "dst")
    assert tree_digest(mnt.path / "dst") == tree_digest(src)
    assert tree_digest(mnt.backing / "dst") == tree_digest(mnt.backing / "src")
    if mnt.can("xattr"):
        assert os.getxattr(mnt.path / "dst" / "a", "user.note") == b"kept"


def test_cp_a_preserves_modes_and_symlinks(mnt):
    mnt.need("chmod", "symlink")
    src = mnt.path / "src"
    src.mkdir()
    make_tree(src)
    sh("cp", "-a", src, mnt.path / "dst")
    assert tree_digest(mnt.backing / "dst") == tree_digest(mnt.backing / "src")
    assert stat.S_IMODE(os.stat(mnt.backing / "dst" / "a").st_mode) == 0o600
    assert os.readlink(mnt.backing / "dst" / "link") == "d1/b"


def test_cp_p_preserves_times(mnt, tmp_path):
    """cp -p sets the times while the copy is still open; they must outlast its close.

    From outside the mount the data arrives as writes, inside as a copy
    request. Only mtime is checked: reading a file may update its atime.
    """
    atime, mtime = 1_500_000_000_123_456_789, 1_600_000_000_987_654_321
    write_file(tmp_path / "a", 100_000)
    os.utime(tmp_path / "a", ns=(atime, mtime))
    sh("cp", "-p", tmp_path / "a", mnt.path / "a")
    sh("cp", "-p", mnt.path / "a", mnt.path / "b")
    for name in ("a", "b"):
        mnt.settle(mnt.backing / name)
        for path in (mnt.backing / name, mnt.path / name):
            assert os.stat(path).st_mtime_ns == mnt.stored_ns(mtime), path


def test_cat_redirect(mnt):
    digest = write_file(mnt.path / "a", 2 * MiB + 1)
    sh("sh", "-c", f"cat '{mnt.path}/a' > '{mnt.path}/b'")
    assert sha256(mnt.backing / "b") == digest


def test_install_sets_mode(mnt):
    mnt.need("chmod")
    digest = write_file(mnt.path / "a", 300_000)
    sh("install", "-m", "0751", mnt.path / "a", mnt.path / "b")
    assert sha256(mnt.path / "b") == digest
    assert stat.S_IMODE(os.stat(mnt.backing / "b").st_mode) == 0o751


def test_rsync_a(mnt, tmp_path):
    tree(mnt, tmp_path)
    modes = mnt.can("chmod")
    sh("rsync", "-a", f"{tmp_path}/", f"{mnt.path}/in/")
    assert tree_digest(mnt.backing / "in", modes) == tree_digest(tmp_path, modes)
    sh("rsync", "-a", f"{mnt.path}/in/", f"{mnt.path}/again/")
    assert tree_digest(mnt.path / "again", modes) == tree_digest(tmp_path, modes)
    for name in ("a", "d1/b"):
        assert os.stat(mnt.path / "again" / name).st_mtime_ns == mnt.stored_ns(os.stat(tmp_path / name).st_mtime_ns)


def test_mv_within_and_across(mnt, tmp_path):
    outside = write_file(tmp_path / "outside", 1 * MiB)
    sh("mv", tmp_path / "outside", mnt.path / "moved-in")
    assert sha256(mnt.backing / "moved-in") == outside
    (mnt.path / "dir").mkdir()
    ino = os.stat(mnt.path / "moved-in").st_ino
    sh("mv", mnt.path / "moved-in", mnt.path / "dir" / "renamed")
    assert not (mnt.backing / "moved-in").exists()
    assert sha256(mnt.backing / "dir" / "renamed") == outside
    assert os.stat(mnt.path / "dir" / "renamed").st_ino == ino
    sh("mv", mnt.path / "dir" / "renamed", tmp_path / "back")
    assert sha256(tmp_path / "back") == outside
    assert os.listdir(mnt.backing / "dir") == []


def test_tar_create_and_extract(mnt):
    (mnt.path / "tree").mkdir()
    tree(mnt, mnt.path / "tree")
    sh("tar", "-cf", mnt.path / "t.tar", "-C", mnt.path, "tree")
    (mnt.path / "out").mkdir()
    sh("tar", "-xpf", mnt.path / "t.tar", "-C", mnt.path / "out")
    assert tree_digest(mnt.backing / "out" / "tree") == tree_digest(mnt.backing / "tree")
    listing = sh("tar", "-tf", mnt.path / "t.tar").split()
    assert "tree/d1/d2/c" in listing


def test_hard_links(mnt):
    digest = write_file(mnt.path / "a", 10_000)
    sh("ln", mnt.path / "a", mnt.path / "hard")
    a, hard = os.stat(mnt.path / "a"), os.stat(mnt.path / "hard")
    assert (a.st_ino, a.st_nlink) == (hard.st_ino, 2)
    assert os.stat(mnt.backing / "a").st_nlink == 2
    with open(mnt.path / "hard", "r+b") as f:
        f.write(b"changed")
    assert (mnt.path / "a").read_bytes()[:7] == b"changed"
    assert sha256(mnt.backing / "a") == sha256(mnt.backing / "hard") != digest


def test_hard_link_outlives_the_first_name(mnt):
    digest = write_file(mnt.path / "a", 10_000)
    sh("ln", mnt.path / "a", mnt.path / "b")
    os.unlink(mnt.path / "a")
    assert sha256(mnt.path / "b") == digest
    assert os.stat(mnt.backing / "b").st_nlink == 1


def test_symbolic_links(mnt):
    mnt.need("symlink")
    write_file(mnt.path / "a", 10_000)
    sh("ln", "-s", "a", mnt.path / "soft")
    assert os.readlink(mnt.path / "soft") == "a"
    assert stat.S_ISLNK(os.lstat(mnt.path / "soft").st_mode)
    assert os.readlink(mnt.backing / "soft") == "a"
    assert sha256(mnt.path / "soft") == sha256(mnt.path / "a")


def test_mkfifo_and_mknod(mnt):
    mnt.need("mknod")
    sh("mkfifo", mnt.path / "fifo")
    sh("mknod", mnt.path / "null", "c", "1", "3")
    assert stat.S_ISFIFO(os.stat(mnt.backing / "fifo").st_mode)
    st = os.stat(mnt.backing / "null")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
    assert stat.S_ISCHR(os.stat(mnt.path / "null").st_mode)


def test_python_shutil_copyfile(mnt):
    digest = write_file(mnt.path / "a", 4 * MiB)
    code = "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])"
    sh(sys.executable, "-c", code, mnt.path / "a", mnt.path / "b")
    assert sha256(mnt.backing / "b") == digest


def test_sync_of_one_file(mnt):
    """coreutils `sync FILE` opens the file read-only and fsyncs that. Linux's NFS and CIFS clients
    make the file's data durable whatever the handle's access (CIFS through a handle of the file
    open for writing, where there is one) and never refuse it for the access (offloadfs on SMB
    did: the server answers a FLUSH on a read-only handle with ACCESS_DENIED)."""
    data = os.urandom(256 * 1024)
    fd = os.open(mnt.path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        before = mnt.counters().get("smb_requests", {})
        sh("sync", mnt.path / "f")
        after = mnt.counters().get("smb_requests", {})
    finally:
        os.close(fd)
    if after:
        assert after.get("FLUSH", 0) > before.get("FLUSH", 0)  # through the handle open for writing
    sh("sync", mnt.path / "f")  # no handle open for writing: SMB leaves the FLUSH out, as CIFS does
    assert (mnt.backing / "f").read_bytes() == data


def test_dd_with_seek_and_notrunc(mnt, tmp_path):
    data = bytearray(os.urandom(2 * MiB))
    patch = os.urandom(64 * 1024)
    (tmp_path / "data").write_bytes(data)
    (tmp_path / "patch").write_bytes(patch)
    target = mnt.path / "f"
    sh("dd", f"if={tmp_path / 'data'}", f"of={target}", "bs=1M", "status=none")
    sh("dd", f"if={tmp_path / 'patch'}", f"of={target}", "bs=64K", "seek=5",
       "conv=notrunc,fsync", "status=none")
    data[5 * 65536 : 6 * 65536] = patch
    assert (mnt.backing / "f").read_bytes() == data
    out = subprocess.run(["dd", f"if={target}", "bs=64K", "skip=5", "count=1", "status=none"],
                         capture_output=True, check=True).stdout
    assert out == patch


def test_truncate_grow_and_shrink(mnt):
    data = os.urandom(100_000)
    (mnt.path / "f").write_bytes(data)
    sh("truncate", "-s", "1M", mnt.path / "f")
    assert os.stat(mnt.backing / "f").st_size == MiB
    assert (mnt.path / "f").read_bytes() == data + bytes(MiB - len(data))
    sh("truncate", "-s", "4000", mnt.path / "f")
    assert (mnt.backing / "f").read_bytes() == data[:4000]
    sh("truncate", "-s", "0", mnt.path / "f")
    assert os.stat(mnt.path / "f").st_size == 0


def test_fallocate_punch_hole(mnt):
    data = bytearray(os.urandom(MiB))
    (mnt.path / "f").write_bytes(data)
    os.sync()
    blocks = os.stat(mnt.backing / "f").st_blocks
    sh("fallocate", "--punch-hole", "--offset", "65536", "--length", "131072", mnt.path / "f")
    data[65536 : 65536 + 131072] = bytes(131072)
    assert (mnt.path / "f").read_bytes() == data
    assert (mnt.backing / "f").read_bytes() == data
    assert os.stat(mnt.path / "f").st_size == MiB
    assert os.stat(mnt.backing / "f").st_blocks <= blocks - 131072 // 512


def test_directories(mnt):
    (mnt.path / "a" / "b").mkdir(parents=True)
    (mnt.path / "a" / "b" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as err:
        os.rmdir(mnt.path / "a")
    assert err.value.errno == errno.ENOTEMPTY
    os.rename(mnt.path / "a", mnt.path / "c")
    assert (mnt.backing / "c" / "b" / "f").read_bytes() == b"x"
    assert not (mnt.path / "a").exists()
    (mnt.path / "g").write_bytes(b"new")
    os.rename(mnt.path / "g", mnt.path / "c" / "b" / "f")
    assert (mnt.backing / "c" / "b" / "f").read_bytes() == b"new"
    os.unlink(mnt.path / "c" / "b" / "f")
    os.rmdir(mnt.path / "c" / "b")
    os.rmdir(mnt.path / "c")
    assert os.listdir(mnt.path) == [] == os.listdir(mnt.backing)


def test_chmod_chown(mnt):
    mnt.need("chmod", "chown", "setid")
    f = mnt.path / "f"
    f.write_bytes(b"data")
    os.chmod(f, 0o4710)
    os.chown(f, 1234, 5678)
    for path in (f, mnt.backing / "f"):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o710  # chown clears setuid
        assert (st.st_uid, st.st_gid) == (1234, 5678)
    os.chmod(f, 0o640)
    assert stat.S_IMODE(os.stat(mnt.backing / "f").st_mode) == 0o640


def test_utimes(mnt):
    f = mnt.path / "f"
    f.write_bytes(b"data")
    atime, mtime = 1_111_111_111_000_000_001, 1_222_222_222_000_000_002
    sh("touch", "-m", "-d", "@1333333333.5", f)
    assert os.stat(mnt.backing / "f").st_mtime_ns == 1_333_333_333_500_000_000
    os.utime(f, ns=(atime, mtime))
    for path in (f, mnt.backing / "f"):
        st = os.stat(path)
        assert (st.st_atime_ns, st.st_mtime_ns) == (mnt.stored_ns(atime), mnt.stored_ns(mtime))


def test_xattrs(mnt):
    mnt.need("xattr")
    f = mnt.path / "f"
    f.write_bytes(b"")
    sh("setfattr", "-n", "user.colour", "-v", "blue", f)
    assert sh("getfattr", "--only-values", "-n", "user.colour", f) == "blue"
    assert os.getxattr(mnt.backing / "f", "user.colour") == b"blue"
    assert "user.colour" in os.listxattr(f)
    sh("setfattr", "-x", "user.colour", f)
    assert "user.colour" not in os.listxattr(mnt.backing / "f")
    proc = subprocess.run(["getfattr", "-n", "user.colour", str(f)], capture_output=True)
    assert proc.returncode != 0


LS_ASKS = ("security.selinux", "system.posix_acl_access")  # what `ls -l` asks of every file it lists


def test_attributes_the_mount_cannot_hold_are_unsupported(mnt, tmp_path):
    """Where the mount cannot hold a label or a POSIX ACL (SMB, NFS), asking for one says so
    (EOPNOTSUPP, as the kernel's CIFS and NFS clients answer), and `ls -l` stops asking after the
    first file instead of sending a request a file for nothing; a local mount answers as its
    backing directory does."""
    for i in range(20):
        (mnt.path / f"f{i:02}").write_bytes(b"")
    for name in LS_ASKS:
        with pytest.raises(OSError) as here:
            os.getxattr(mnt.path / "f00", name)
        if mnt.can("posix_acl"):
            with pytest.raises(OSError) as there:
                os.getxattr(mnt.backing / "f00", name)
            assert here.value.errno == there.value.errno
        else:
            assert here.value.errno == errno.EOPNOTSUPP
    trace = tmp_path / "trace"
    sh("strace", "-s", "4096", "-o", trace, "-e", "trace=getxattr,lgetxattr", "ls", "-l", mnt.path)
    asked = [line for line in trace.read_text().splitlines() if f'"{mnt.path}' in line]
    if mnt.can("posix_acl"):
        assert len(asked) > len(LS_ASKS) * 20  # each file, and the directory
    else:
        assert len(asked) == len(LS_ASKS)  # the directory: then it gives up


def test_statfs_matches_backing(mnt):
    out = sh("df", "-B1", "--output=size,target", mnt.path).splitlines()[-1].split()
    assert out[1] == str(mnt.path)
    back = os.statvfs(mnt.backing)
    assert int(out[0]) == back.f_blocks * back.f_frsize
    st = os.statvfs(mnt.path)
    assert st.f_bavail * st.f_frsize == pytest.approx(back.f_bavail * back.f_frsize, rel=0.01)
