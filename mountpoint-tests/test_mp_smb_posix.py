"""SMB 3.1.1 POSIX extensions on Samba 4.22 shares (`smb3 unix extensions = yes`): what a mount of
one shows and does where the server gives it modes, owners, link counts and POSIX names.

Without the extensions (Samba 4.17, or -o noposix) every file shows file_mode=/dir_mode= and
root; test_mp_smb and the other SMB tests cover that.
"""

import os
import shutil
import stat
import subprocess

import pytest
from mpkit import MiB, sha256, write_file

from offloadfs.lab.mount import MountError, offloadfs_mount

PLACES = ["smb422-btrfs", "smb422-xfs"]


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("where", PLACES)
def test_new_files_get_the_mode_asked_less_the_umask(where, mount_on):
    mnt = mount_on(where)
    subprocess.run(["sh", "-c", "umask 027; touch f; mkdir d"], cwd=mnt.path, check=True)
    fd = os.open(mnt.path / "secret", os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    for name, want in [("f", 0o640), ("d", 0o750), ("secret", 0o600)]:
        assert (mode(mnt.path / name), mode(mnt.backing / name)) == (want, want), name
    assert stat.S_ISDIR(os.stat(mnt.path / "d").st_mode)


@pytest.mark.parametrize("where", PLACES)
def test_owner_and_group_are_the_servers_numeric_ids(where, mount_on):
    mnt = mount_on(where)
    (mnt.backing / "theirs").write_text("12345")
    os.chown(mnt.backing / "theirs", 1234, 5678)
    (mnt.backing / "sub").mkdir(mode=0o711)
    os.chown(mnt.backing / "sub", 4321, 8765)
    st = os.stat(mnt.path / "theirs")
    assert (st.st_uid, st.st_gid, st.st_size) == (1234, 5678, 5)
    listed = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(mnt.path)}
    assert (listed["sub"].st_uid, listed["sub"].st_gid, stat.S_IMODE(listed["sub"].st_mode)) == (4321, 8765, 0o711)
    assert (listed["theirs"].st_uid, listed["theirs"].st_gid, listed["theirs"].st_size) == (1234, 5678, 5)


@pytest.mark.parametrize("where", PLACES)
def test_link_counts_are_the_servers(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "a").write_text("x")
    os.link(mnt.path / "a", mnt.path / "b")
    (mnt.backing / "c").write_text("y")
    os.link(mnt.backing / "c", mnt.backing / "d")
    os.link(mnt.backing / "c", mnt.backing / "e")
    (mnt.backing / "dir" / "sub").mkdir(parents=True)
    assert [os.stat(mnt.path / n).st_nlink for n in "abcde"] == [2, 2, 3, 3, 3]
    # btrfs counts 1 link for any directory, xfs 2 and one per subdirectory
    assert os.stat(mnt.path / "dir").st_nlink == os.stat(mnt.backing / "dir").st_nlink


@pytest.mark.parametrize("where", PLACES)
def test_names_differing_in_case_are_different_files(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "name").write_text("lower")
    (mnt.path / "NAME").write_text("upper")
    assert sorted(os.listdir(mnt.path)) == ["NAME", "name"]
    assert (mnt.backing / "name").read_text() == "lower"
    assert (mnt.backing / "NAME").read_text() == "upper"


@pytest.mark.parametrize("where", PLACES[:1])
def test_status_says_whether_they_are_on(where, mount_on):
    assert mount_on(where).counters()["smb_posix_sources"] == 1
    assert mount_on(where, ["posix"]).counters()["smb_posix_sources"] == 1
    assert mount_on(where, ["noposix"]).counters()["smb_posix_sources"] == 0


@pytest.mark.parametrize("where", PLACES[:1])
def test_noposix_shows_what_a_server_without_them_would(where, mount_on):
    mnt = mount_on(where, ["noposix"])
    (mnt.backing / "theirs").write_text("x")
    os.chown(mnt.backing / "theirs", 1234, 5678)
    os.chmod(mnt.backing / "theirs", 0o600)
    st = os.stat(mnt.path / "theirs")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o755, 0, 0)


@pytest.mark.parametrize("where", PLACES[:1])
def test_uid_and_gid_options_leave_the_owners_the_server_reports(where, mount_on):
    """As mount.cifs has it: uid= and gid= stand for the owner a server without the extensions does not
    report; with them each file shows its own, which is what the server decides access by."""
    mnt = mount_on(where, ["uid=1234", "gid=2345"])
    (mnt.backing / "theirs").write_text("x")
    os.chown(mnt.backing / "theirs", 1000, 1001)
    (mnt.path / "mine").write_text("y")
    os.chown(mnt.path / "mine", 1000, 1001)
    listed = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(mnt.path)}
    for name in ("theirs", "mine"):
        for st in (os.stat(mnt.path / name), listed[name]):
            assert (st.st_uid, st.st_gid) == (1000, 1001), name


@pytest.mark.parametrize("where, options", [("smb-xfs", []), ("smb422-xfs", ["noposix"])])
def test_uid_and_gid_options_are_every_files_owner_without_the_extensions(where, options, mount_on):
    mnt = mount_on(where, ["uid=1234", "gid=2345", *options])
    (mnt.backing / "theirs").write_text("x")
    os.chown(mnt.backing / "theirs", 1000, 1001)
    for path in (mnt.path, mnt.path / "theirs"):
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == (1234, 2345), path


@pytest.mark.skipif(shutil.which("smbd") is None, reason="smbd is not installed")
def test_posix_on_a_server_without_them_fails_the_mount(mount_on):
    with pytest.raises(MountError, match="does not offer SMB 3.1.1 POSIX extensions"):
        mount_on("smb-ext4", ["posix"])


@pytest.mark.parametrize("where", PLACES)
def test_chmod_sets_the_mode_on_the_server(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "f").write_text("x")
    (mnt.path / "d").mkdir()
    os.chmod(mnt.path / "f", 0o604)
    os.chmod(mnt.path / "d", 0o710)
    for name, want in [("f", 0o604), ("d", 0o710)]:
        assert (mode(mnt.path / name), mode(mnt.backing / name)) == (want, want), name


@pytest.mark.parametrize("where", PLACES[:1])
def test_chmod_of_setuid_setgid_or_sticky_fails_and_changes_nothing(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "f").write_text("x")
    os.chmod(mnt.path / "f", 0o644)
    with pytest.raises(PermissionError):
        os.chmod(mnt.path / "f", 0o4755)
    assert (mode(mnt.path / "f"), mode(mnt.backing / "f")) == (0o644, 0o644)


@pytest.mark.parametrize("where", PLACES)
def test_chown_by_root_sets_owner_and_group_on_the_server(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "f").write_text("x")
    os.chown(mnt.path / "f", 1234, 5678)
    os.chown(mnt.path / "f", -1, 42)
    st, server = os.stat(mnt.path / "f"), os.stat(mnt.backing / "f")
    assert (st.st_uid, st.st_gid) == (server.st_uid, server.st_gid) == (1234, 42)


@pytest.mark.parametrize("where", PLACES[:1])
@pytest.mark.parametrize("how", ["printf x 1<>f", "printf x >>f", "printf x >f"])
def test_a_write_by_another_user_clears_setuid_and_setgid(where, how, mount_on):
    """As pjdfstest chmod/12, but with the bits set on the server: Samba sets none from a client."""
    mnt = mount_on(where, ["allow_other"])
    (mnt.backing / "f").write_bytes(b"")
    os.chmod(mnt.backing / "f", 0o6777)
    assert mode(mnt.path / "f") == 0o6777
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", how],
                          cwd=mnt.path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (mode(mnt.path / "f"), mode(mnt.backing / "f")) == (0o777, 0o777)
    assert (mnt.backing / "f").read_bytes() == b"x"


@pytest.mark.parametrize("where", PLACES[:1])
def test_chown_by_the_owner_to_a_group_of_theirs(where, mount_on):
    """With allow_other the kernel checks the caller (default_permissions): the owner may give the
    file to a group they are in, not to another owner."""
    mnt = mount_on(where, ["allow_other"])
    (mnt.backing / "f").write_text("x")
    os.chown(mnt.backing / "f", 65534, 65534)
    run = ["setpriv", "--reuid=65534", "--regid=65534", "--groups=4242"]
    done = subprocess.run([*run, "chgrp", "4242", "f"], cwd=mnt.path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    refused = subprocess.run([*run, "chown", "0", "f"], cwd=mnt.path, capture_output=True, text=True)
    assert "Operation not permitted" in refused.stderr
    st = os.stat(mnt.backing / "f")
    assert (st.st_uid, st.st_gid) == (65534, 4242)


@pytest.mark.parametrize("where", PLACES)
def test_symlinks(where, mount_on):
    """Samba keeps a POSIX client's symlink as a file with a reparse point, shown to POSIX clients
    as a symlink; the kernel follows it through readlink."""
    mnt = mount_on(where)
    (mnt.path / "target").write_text("pointed at")
    os.symlink("target", mnt.path / "rel")
    os.symlink("/etc/hostname", mnt.path / "abs")
    os.symlink("d\u00e9j\u00e0/../target", mnt.path / "long")
    (mnt.path / "déjà").mkdir()
    assert os.readlink(mnt.path / "rel") == "target"
    assert os.readlink(mnt.path / "abs") == "/etc/hostname"
    assert (mnt.path / "rel").read_text() == (mnt.path / "long").read_text() == "pointed at"
    assert stat.S_ISLNK(os.lstat(mnt.path / "rel").st_mode)
    listed = {e.name: e for e in os.scandir(mnt.path)}
    assert listed["rel"].is_symlink() and not listed["target"].is_symlink()
    assert stat.S_ISLNK(listed["abs"].stat(follow_symlinks=False).st_mode)
    os.rename(mnt.path / "rel", mnt.path / "moved")
    assert os.readlink(mnt.path / "moved") == "target"
    os.unlink(mnt.path / "moved")
    assert (mnt.path / "target").exists() and not os.path.lexists(mnt.path / "moved")


@pytest.mark.parametrize("where", PLACES)
def test_fifos_and_sockets(where, mount_on):
    mnt = mount_on(where)
    os.mkfifo(mnt.path / "fifo", 0o640)
    os.mknod(mnt.path / "sock", stat.S_IFSOCK | 0o600)
    assert stat.S_ISFIFO(os.stat(mnt.path / "fifo").st_mode) and mode(mnt.path / "fifo") == 0o640
    assert stat.S_ISSOCK(os.stat(mnt.path / "sock").st_mode)
    kinds = {e.name: stat.S_IFMT(e.stat(follow_symlinks=False).st_mode) for e in os.scandir(mnt.path)}
    assert kinds == {"fifo": stat.S_IFIFO, "sock": stat.S_IFSOCK}
    os.unlink(mnt.path / "fifo")
    assert not (mnt.backing / "fifo").exists()


@pytest.mark.parametrize("where", PLACES[:1])
def test_device_nodes_by_root(where, mount_on):
    mnt = mount_on(where)
    os.mknod(mnt.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(mnt.path / "disk", stat.S_IFBLK | 0o600, os.makedev(8, 1))
    assert stat.S_ISCHR(os.lstat(mnt.path / "null").st_mode)
    assert stat.S_ISBLK(os.lstat(mnt.path / "disk").st_mode)


@pytest.mark.parametrize("where", PLACES)
def test_device_numbers_read_back_from_the_reparse_point(where, smb422):
    """The server keeps a device node as a regular file with an NFS reparse point that holds its major
    and minor: our mount, and a second one that did not make them, read them back by stat and listing."""
    url, _ = smb422.fresh_dir(where.split("-", 1)[1])
    want = {"null": (stat.S_IFCHR, 1, 3), "loop0": (stat.S_IFBLK, 7, 0)}
    with offloadfs_mount(url, options=smb422.options()) as ours:
        for name, (kind, major, minor) in want.items():
            os.mknod(ours / name, kind | 0o600, os.makedev(major, minor))
        with offloadfs_mount(url, options=smb422.options()) as theirs:
            for mnt in (theirs, ours):
                listed = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(mnt)}
                for name, (kind, major, minor) in want.items():
                    for st in (listed[name], os.lstat(mnt / name)):
                        assert (stat.S_IFMT(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)) == \
                            (kind, major, minor), (mnt, name)


@pytest.mark.parametrize("where", PLACES)
def test_unlink_of_an_open_file_frees_its_name_at_once(where, mount_on):
    mnt = mount_on(where)
    fd = os.open(mnt.path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"old")
        os.unlink(mnt.path / "f")
        assert os.listdir(mnt.path) == [] and not (mnt.backing / "f").exists()
        (mnt.path / "f").write_bytes(b"new")
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 3, 0) == b"old"
        os.pwrite(fd, b"OLD", 0)
    finally:
        os.close(fd)
    assert (mnt.path / "f").read_bytes() == (mnt.backing / "f").read_bytes() == b"new"


@pytest.mark.parametrize("where", PLACES)
def test_rename_over_an_open_file(where, mount_on):
    mnt = mount_on(where)
    (mnt.path / "f").write_bytes(b"old")
    (mnt.path / "g").write_bytes(b"new")
    fd = os.open(mnt.path / "f", os.O_RDWR)
    try:
        os.rename(mnt.path / "g", mnt.path / "f")
        assert os.pread(fd, 3, 0) == b"old"
        assert (mnt.path / "f").read_bytes() == (mnt.backing / "f").read_bytes() == b"new"
        assert sorted(os.listdir(mnt.path)) == ["f"]
    finally:
        os.close(fd)
    assert (mnt.path / "f").read_bytes() == b"new"


@pytest.mark.parametrize("where", PLACES[:1])
def test_names_windows_cannot_hold(where, mount_on):
    """A POSIX open takes any name but / (and \\, our separator here).  Listings show them as they are
    only where the share has `mangled names = no` (the lab's 4.22 shares do): else smbd lists them as
    8.3 names, POSIX client or not (smbd_dirptr_lanman2_match_fn)."""
    mnt = mount_on(where)
    names = ["a:b", "what?", "<tag>", 'say "hi"', "pipe|d", "star*", "tab\tname"]
    for name in names:
        (mnt.path / name).write_text(name)
    assert sorted(os.listdir(mnt.path)) == sorted(os.listdir(mnt.backing)) == sorted(names)
    assert all((mnt.backing / name).read_text() == name for name in names)


@pytest.mark.parametrize("where,method", [("smb422-btrfs", "clone"), ("smb422-xfs", "server_copy")])
def test_cp_in_a_posix_share_is_done_by_the_server(where, method, mount_on):
    mnt = mount_on(where)
    digest = write_file(mnt.backing / "big", 64 * MiB)
    os.chmod(mnt.backing / "big", 0o640)
    subprocess.run(["cp", "-p", mnt.path / "big", mnt.path / "copy"], check=True)
    assert mnt.counters()["copy_bytes"].get(method) == 64 * MiB, mnt.counters()
    assert sha256(mnt.backing / "copy") == digest
    assert mode(mnt.backing / "copy") == 0o640
    if method == "clone":
        flags = subprocess.run(["filefrag", "-v", mnt.backing / "copy"], capture_output=True, text=True).stdout
        assert "shared" in flags


@pytest.mark.parametrize("where", PLACES[:1])
def test_what_a_user_makes_is_theirs(where, mount_on):
    """The share forces root as the user files are made as; through an allow_other mount they
    belong to whoever made them, with the group of a setgid directory they are made in."""
    mnt = mount_on(where, ["allow_other"])
    os.chmod(mnt.path, 0o777)
    (mnt.backing / "shared").mkdir(mode=0o777)
    os.chown(mnt.backing / "shared", 0, 4242)
    os.chmod(mnt.backing / "shared", 0o2777)
    script = "set -e; touch f; mkdir d; ln -s f l; mkfifo p; touch shared/g; mkdir shared/e"
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65533", "--clear-groups", "sh", "-c", script],
                          cwd=mnt.path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name, group in [("f", 65533), ("d", 65533), ("l", 65533), ("p", 65533), ("shared/g", 4242),
                        ("shared/e", 4242)]:
        st, server = os.lstat(mnt.path / name), os.lstat(mnt.backing / name)
        assert (st.st_uid, st.st_gid) == (server.st_uid, server.st_gid) == (65534, group), name
