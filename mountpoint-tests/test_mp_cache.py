"""Trust under sharing: what a mount shows after other clients, or its own kernel, changed a file.

Each case was seen on the lab: a new file taken for a deleted one that had
the same inode number, attributes that hid a write or a link count change,
an open that read a file's old size, the daemon's umask on new files, and
an impossible size from a server that made the mount's root unusable.
"""

import errno
import os
import subprocess
import sys
import time

import pytest

from offloadfs.lab.proxy import RPC, Proxy


def _in_new_process(code):
    """Run ``code`` in a fresh Python: each step of a POSIX sequence is its own process, as in the suites."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _make_with_number(path, ino, pause):
    """Write a new file at ``path`` (on the server's disk) until it gets inode number ``ino``:
    the server frees a removed file's number once nothing holds the file any more."""
    for _ in range(40):
        path.write_bytes(b"the new file")
        if os.stat(path).st_ino == ino:
            return
        path.unlink()
        time.sleep(pause)
    raise AssertionError("the server did not reuse the inode number")


def test_a_new_file_that_took_a_deleted_files_inode_number_is_that_new_file(mount_on):
    """nfsd on xfs gives the next new file the number at once (ganesha keeps the old file open)."""
    mnt = mount_on("nfsd")
    seen = mnt.path / "f"
    seen.write_bytes(b"old")
    assert seen.read_bytes() == b"old"  # this mount knows the file now
    ino = os.stat(mnt.backing / "f").st_ino
    (mnt.backing / "f").unlink()  # another client deletes it and makes a new one
    _make_with_number(mnt.backing / "f", ino, 0.5)  # once nfsd's file cache let the old file go
    with open(seen, "rb") as f:
        assert f.read() == b"the new file"
        assert os.fstat(f.fileno()).st_size == 12
    assert seen.stat().st_size == 12


def test_a_rename_between_a_stale_name_and_the_file_that_took_its_number(mount_on):
    """SMB file ids carry no generation: the kernel may still hold a name of a removed file while
    the file that took its number is found by another name.  Both names would then lead to one
    inode, and the kernel would answer a rename between them itself: success, nothing done."""
    mnt = mount_on("smb-xfs", ["attr_timeout=0", "entry_timeout=60"])  # the kernel keeps f's name
    (mnt.backing / "f").write_bytes(b"old")
    ino = os.stat(mnt.path / "f").st_ino
    (mnt.backing / "f").unlink()  # another client removes f and makes g, which gets f's number
    _make_with_number(mnt.backing / "g", ino, 0.2)
    assert os.stat(mnt.path / "g").st_ino == ino
    # The daemon tells the kernel to drop f right after answering (the kernel held the directory's
    # lock): wait for that under a hang guard, not a set time a busy machine may overrun.  While
    # the kernel holds f, stat answers with g's attributes; once dropped, f is looked up and missing.
    deadline = time.monotonic() + 30
    while os.path.exists(mnt.path / "f"):
        assert time.monotonic() < deadline, "the kernel still holds f's name 30 s after g was found"
        time.sleep(0.05)
    with pytest.raises(FileNotFoundError):
        os.rename(mnt.path / "f", mnt.path / "g")
    assert sorted(os.listdir(mnt.path)) == ["g"]


def test_a_passthrough_write_past_the_end_shows_in_fstat(mount, backing):
    mnt = mount(backing("ext4"), ["passthrough"])
    fd = os.open(mnt.path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * 10, 100)
        assert os.fstat(fd).st_size == 110
    finally:
        os.close(fd)
    assert (mnt.path / "f").stat().st_size == 110


@pytest.mark.parametrize("where", ["local-ext4", "nfsd"])
def test_link_count_after_unlink_of_another_name(where, mount_on):
    """The strict POSIX sequence: the last lstat must count the two names left."""
    mnt = mount_on(where, ["allow_other"])
    d = str(mnt.path)
    for step in ("open(f'{d}/a', 'w').close()", "os.link(f'{d}/a', f'{d}/b')", "os.link(f'{d}/b', f'{d}/c')",
                 "os.chmod(f'{d}/b', 0o201)", "os.chown(f'{d}/b', 65534, 65533)", "os.unlink(f'{d}/a')"):
        _in_new_process(f"import os; d = {d!r}; {step}")
    st = os.lstat(mnt.path / "b")
    assert (st.st_nlink, st.st_mode & 0o7777, st.st_uid, st.st_gid) == (2, 0o201, 65534, 65533)


def _close_to_open(first, second, backing):
    """``first`` read a file; it is rewritten through ``second`` and on the server's disk: an open
    through ``first`` must see each new content and size."""
    (first / "f").write_bytes(b"abc")
    assert (first / "f").read_bytes() == b"abc"
    assert os.stat(first / "f").st_size == 3
    (second / "f").write_bytes(b"y" * 100_000)
    with open(first / "f", "rb") as f:
        assert os.fstat(f.fileno()).st_size == 100_000
        assert f.read() == b"y" * 100_000
    assert os.stat(first / "f").st_size == 100_000
    (backing / "f").write_bytes(b"z" * 5000)
    assert (first / "f").read_bytes() == b"z" * 5000


def test_close_to_open_between_two_local_mounts(mount, backing):
    src = backing("ext4")
    _close_to_open(mount(src).path, mount(src).path, src)


def test_close_to_open_between_two_ganesha_mounts(ganesha, mount):
    place, _ = ganesha
    url, view = place.fresh_dir()
    _close_to_open(mount(url).path, mount(url).path, view)


def test_an_unchanged_file_keeps_its_cached_pages_on_open(mount, backing):
    """Close-to-open checks the file; pages of a file nobody changed are read once."""
    mnt = mount(backing("ext4"))
    (mnt.path / "f").write_bytes(b"k" * 1_000_000)
    (mnt.path / "f").read_bytes()
    before = mnt.counters()["fuse_read_bytes"]
    for _ in range(3):
        assert (mnt.path / "f").read_bytes() == b"k" * 1_000_000
    assert mnt.counters()["fuse_read_bytes"] == before


def test_new_files_take_the_callers_umask_not_the_daemons(mount, backing):
    mnt = mount(backing("ext4"))
    d = str(mnt.path)
    code = (f"import os; os.umask(0); os.mkdir({d!r} + '/d', 0o777); "
            f"os.close(os.open({d!r} + '/f', os.O_CREAT | os.O_WRONLY, 0o666)); os.mkfifo({d!r} + '/p', 0o666); "
            f"os.umask(0o027); os.mkdir({d!r} + '/e', 0o777)")
    _in_new_process(code)
    modes = {n: os.lstat(mnt.backing / n).st_mode & 0o777 for n in ("d", "f", "p", "e")}
    assert modes == {"d": 0o777, "f": 0o666, "p": 0o666, "e": 0o750}


def test_an_impossible_size_of_the_root_fails_that_request_only(ganesha, mount):
    """A size past LLONG_MAX handed to the kernel marks the node bad; the root stays bad until
    remount.  The daemon must refuse the reply, and serve the next one."""
    place, lab = ganesha
    url, view = place.fresh_dir()
    (view / "g").write_bytes(b"abc")
    root = os.stat(view)
    # The size and fileid of the root, back to back as in every GETATTR of ours (SIZE, FILEID).
    truth = root.st_size.to_bytes(8, "big") + root.st_ino.to_bytes(8, "big")
    server = lab.server
    with Proxy((server.host, server.port), RPC) as proxy:
        mnt = mount(f"nfs://127.0.0.1:{proxy.port}{url.split(server.host, 1)[1]}", ["attr_timeout=0"])
        assert os.stat(mnt.path).st_size == root.st_size
        for impossible in ((1 << 64) - 1, 1 << 63):
            lie = impossible.to_bytes(8, "big") + truth[8:]
            proxy.mutator = lambda record: RPC.frame(record.replace(truth, lie))
            with pytest.raises(OSError) as e:
                os.stat(mnt.path)
            assert e.value.errno == errno.EIO
            proxy.mutator = None
            assert os.stat(mnt.path).st_size == root.st_size
            assert (mnt.path / "g").read_bytes() == b"abc"


def test_an_open_by_a_name_another_client_replaced_or_removed(mount_on):
    """The kernel holds a name for a minute, while another client replaces the file behind it, or
    removes it: an open gets the file the name leads to now (the SMB open checks the file id it
    opened by that name), ENOENT, or with O_CREAT a new file."""
    mnt = mount_on("smb-xfs", ["attr_timeout=60", "entry_timeout=60"])
    for name in ("replaced", "removed", "made-again"):
        (mnt.backing / name).write_bytes(b"old")
        assert (mnt.path / name).read_bytes() == b"old"  # this mount knows the file and holds its name
    (mnt.backing / "replaced").unlink()
    (mnt.backing / "replaced").write_bytes(b"the new file")
    (mnt.backing / "removed").unlink()
    (mnt.backing / "made-again").unlink()
    assert (mnt.path / "replaced").read_bytes() == b"the new file"
    with pytest.raises(FileNotFoundError):
        open(mnt.path / "removed", "rb")
    with open(mnt.path / "made-again", "ab") as f:
        f.write(b"new")
    assert (mnt.backing / "made-again").read_bytes() == b"new"


@pytest.mark.parametrize("where", ["local-btrfs", "smb-btrfs", "smb-xfs"])
def test_a_copy_from_a_file_another_client_cut_short_after_the_open(where, mount_on):
    """copy_file_range is bounded by the size the kernel and the daemon hold from the open (no
    request asks it again): a source cut short since must give a copy of what is left, not an
    empty file, nor one padded to the old size."""
    mnt = mount_on(where, ["attr_timeout=60", "entry_timeout=60"])
    data = os.urandom(3 * 65536 + 100)
    (mnt.backing / "src").write_bytes(data)
    with open(mnt.path / "src", "rb") as src, open(mnt.path / "dst", "wb") as dst:
        with open(mnt.backing / "src", "r+b") as cut:
            cut.truncate(5000)
        copied = 0
        while n := os.copy_file_range(src.fileno(), dst.fileno(), 1 << 20):
            copied += n
    assert copied == 5000
    assert (mnt.backing / "dst").read_bytes() == data[:5000]


@pytest.mark.parametrize("where", ["local-ext4", "smb-xfs", "nfs-ganesha", "nfsd"])
@pytest.mark.parametrize("access", [os.O_WRONLY, os.O_RDWR], ids=["wronly", "rdwr"])
def test_an_append_after_another_clients_append_goes_after_it(where, access, mount_on):
    """The kernel appends at the size it holds, which another client's append outdated (a shell's
    `>>` opens O_APPEND and writes without a seek): the write must land at the server's end of the
    file, after the other client's data, not over it."""
    mnt = mount_on(where, ["attr_timeout=60", "entry_timeout=60"])
    (mnt.path / "log").write_bytes(b"ours-1\n")
    assert (mnt.path / "log").stat().st_size == 7  # the kernel holds that size for a minute
    with open(mnt.backing / "log", "ab") as other:
        other.write(b"theirs\n")
    fd = os.open(mnt.path / "log", access | os.O_APPEND)
    try:
        os.write(fd, b"ours-2\n")
        os.write(fd, b"ours-3\n")
    finally:
        os.close(fd)
    assert (mnt.backing / "log").read_bytes() == b"ours-1\ntheirs\nours-2\nours-3\n"
    assert (mnt.path / "log").read_bytes() == b"ours-1\ntheirs\nours-2\nours-3\n"


@pytest.mark.parametrize("where", ["local-ext4", "smb-xfs"])
def test_each_write_of_a_write_only_file_is_one_request(where, mount_on, tmp_path):
    """tar x writes 10 KiB records cut at 512-byte headers: through the page cache the kernel ends
    a WRITE at every page it fills in part, two requests for most such writes; a file opened
    write-only gets one a write(2)."""
    log = tmp_path / "log"
    mnt = mount_on(where, ["debug", f"logfile={log}"])
    data = os.urandom(8 * 5120)
    fd = os.open(mnt.path / "f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(8):
            os.write(fd, data[i * 5120:(i + 1) * 5120])
    finally:
        os.close(fd)
    assert (mnt.path / "f").read_bytes() == data
    assert log.read_text().count("<- WRITE ") == 8


@pytest.mark.parametrize("where", ["local-ext4", "smb-xfs"])
def test_a_reader_sees_what_a_write_only_opener_wrote(where, mount_on):
    """Writes of a write-only handle go around the kernel's page cache: the pages another opener
    has cached over them must go, while the writer still holds the file open."""
    mnt = mount_on(where, ["attr_timeout=60", "entry_timeout=60"])
    (mnt.path / "f").write_bytes(b"a" * 20000)
    with open(mnt.path / "f", "rb") as reader:
        assert reader.read() == b"a" * 20000  # cached now
        fd = os.open(mnt.path / "f", os.O_WRONLY)
        try:
            os.pwrite(fd, b"b" * 5000, 3000)
            os.pwrite(fd, b"c" * 100, 20000)
            assert os.pread(reader.fileno(), 20100, 0) == b"a" * 3000 + b"b" * 5000 + b"a" * 12000 + b"c" * 100
        finally:
            os.close(fd)
    assert (mnt.backing / "f").read_bytes() == b"a" * 3000 + b"b" * 5000 + b"a" * 12000 + b"c" * 100
