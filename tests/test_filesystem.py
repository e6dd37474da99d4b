"""The filesystem layer on a real local source, without a kernel: names, ownership, escapes."""
import errno
import os

import pytest
import trio
import trio.testing

from offloadfs import cache
from offloadfs.backends.base import CALLER
from offloadfs.backends.local import LocalBackend
from offloadfs.filesystem import Filesystem, Options, check_name
from offloadfs.fuse.operations import Ctx
from offloadfs.stats import Stats

ROOT_CTX = Ctx(0, 0, 1)


@pytest.mark.parametrize("name", [b"", b".", b"..", b"a/b", b"../etc", b"a\0b", b"x" * 256])
def test_names_that_could_escape_are_refused(name):
    with pytest.raises(OSError):
        check_name(name)


async def mounted(tmp_path, **options):
    fs = Filesystem({"s": LocalBackend(str(tmp_path), {})}, Options(**options), Stats("/mnt", {}))
    await fs.start()
    return fs


async def test_symlinks_are_never_followed_on_the_server_side(tmp_path):
    outside = tmp_path.parent / (tmp_path.name + "-outside")
    outside.write_bytes(b"secret")
    (tmp_path / "link").symlink_to(outside)
    fs = await mounted(tmp_path)
    entry = await fs.lookup(ROOT_CTX, 1, b"link")
    assert await fs.readlink(ROOT_CTX, entry.nodeid) == os.fsencode(outside)
    with pytest.raises(OSError) as e:
        await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError):
        await fs.create(ROOT_CTX, 1, b"link", 0o644, os.O_WRONLY)
    assert outside.read_bytes() == b"secret"
    outside.unlink()


async def test_new_files_belong_to_the_caller(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give files away")
    fs = await mounted(tmp_path)
    user = Ctx(1234, 567, 1)
    fs.begin(user)  # as the session does for every request
    entry, opened = await fs.create(user, 1, b"f", 0o640, os.O_WRONLY)
    fs.begin(ROOT_CTX)
    await fs.release(ROOT_CTX, entry.nodeid, opened.fh)
    st = os.stat(tmp_path / "f")
    assert (st.st_uid, st.st_gid) == (1234, 567)


async def test_requests_on_an_open_file_act_for_whoever_opened_it(tmp_path):
    """The kernel's writeback sends WRITEs as root, a passed descriptor as its new holder: a
    backend that authenticates per user (NFS AUTH_SYS) must see the opener throughout."""
    (tmp_path / "f").write_bytes(b"abc")
    fs = await mounted(tmp_path)
    fs.begin(Ctx(1234, 567, os.getpid()))
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    opened = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDWR, False)
    fs.begin(Ctx(0, 0, 0))
    await fs.write(ROOT_CTX, entry.nodeid, opened.fh, 0, b"x", False)
    caller = CALLER.get()
    assert (caller.uid, caller.gid, caller.groups()[0]) == (1234, 567, 567)
    assert set(caller.groups()[1:]) == set(os.getgroups()) - {567}  # ours: the pid given was ours
    fs.begin(ROOT_CTX)
    await fs.lookup(ROOT_CTX, 1, b"f")
    assert CALLER.get().uid == 0


async def test_display_options_and_stable_inode_numbers(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    fs = await mounted(tmp_path, uid=42, gid=43, umask=0o077)
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    attr, _ = await fs.getattr(ROOT_CTX, entry.nodeid, None)
    assert (attr.uid, attr.gid, attr.mode & 0o777, attr.size) == (42, 43, 0o600, 3)
    assert attr.ino == os.stat(tmp_path / "f").st_ino
    again = await fs.lookup(ROOT_CTX, 1, b"f")
    assert again.nodeid == entry.nodeid
    fs.forget(entry.nodeid, 2)
    assert entry.nodeid not in fs.inodes


async def test_read_only_refuses_changes(tmp_path):
    fs = await mounted(tmp_path, ro=True)
    for call in (fs.mkdir(ROOT_CTX, 1, b"d", 0o755), fs.unlink(ROOT_CTX, 1, b"x"),
                 fs.create(ROOT_CTX, 1, b"f", 0o644, os.O_WRONLY)):
        with pytest.raises(OSError) as e:
            await call
        assert e.value.errno == errno.EROFS


async def test_an_unread_directory_is_listed_ahead_of_its_fstat_unless_it_is_large(tmp_path, monkeypatch):
    """opendir(3) fstats the directory before it reads it: the getattr fetches the listing it is
    about to need.  A directory known to be large is not listed for a getattr (a dirfd held open
    unread for openat would make each getattr a long listing)."""
    # Every listing racy (its directory changed within RACY_NS of it), so never kept on: made just
    # now, the directories were so only while the test ran within a second of making them.
    monkeypatch.setattr(cache, "RACY_NS", 3600 * cache.NS)
    for name, count in (("small", 3), ("large", 1100)):
        (tmp_path / name).mkdir()
        for i in range(count):
            (tmp_path / name / f"f{i}").touch()
    fs = await mounted(tmp_path, attr_timeout=0.0)
    listed = {}
    for name in ("small", "large"):
        nodeid = (await fs.lookup(ROOT_CTX, 1, name.encode())).nodeid
        for _ in range(2):  # before any listing, then with one held
            opened = await fs.opendir(ROOT_CTX, nodeid, os.O_RDONLY)
            before = fs.stats.listings
            await fs.getattr(ROOT_CTX, nodeid, None)
            listed.setdefault(name, []).append(fs.stats.listings - before)
            await fs.readdir(ROOT_CTX, nodeid, opened.fh, 0)
            fs.releasedir(ROOT_CTX, nodeid, opened.fh)
        before = fs.stats.listings
        await fs.getattr(ROOT_CTX, nodeid, None)  # no handle unread: a getattr only
        listed[name].append(fs.stats.listings - before)
    assert listed == {"small": [1, 1, 0], "large": [1, 0, 0]}


async def test_who_waits_for_a_listing_that_fails_fails_with_it(tmp_path):
    """Requests for a directory being listed wait for that one listing.  When it fails (a server
    that timed out), they fail with it rather than each asking again in turn: a timeout is then
    paid once, not once a waiting request."""
    (tmp_path / "d").mkdir()
    fs = await mounted(tmp_path)
    nodeid = (await fs.lookup(ROOT_CTX, 1, b"d")).nodeid
    release, calls = trio.Event(), []

    async def failing_listdir(node):
        calls.append(node)
        await release.wait()
        raise OSError(errno.EIO, "timed out")

    fs.inodes[nodeid].source.backend.listdir = failing_listdir
    errors = []

    async def read():
        opened = await fs.opendir(ROOT_CTX, nodeid, os.O_RDONLY)
        try:
            await fs.readdir(ROOT_CTX, nodeid, opened.fh, 0)
        except OSError as e:
            errors.append(e.errno)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        release.set()
    assert (len(calls), errors) == (1, [errno.EIO] * 3)


@pytest.mark.parametrize("failure, asks_alone", [(errno.EIO, False), (errno.ETIMEDOUT, False), (errno.EACCES, True)])
async def test_a_getattr_asks_alone_after_its_listing_failed_only_if_the_server_answered(tmp_path, failure, asks_alone):
    """A listing fetched ahead of a readdir (opendir(3)'s fstat) that the server refused leaves the
    getattr to ask alone (a directory we may search but not read).  One the server did not answer
    ends the getattr: a second request would wait as long again."""
    (tmp_path / "d").mkdir()
    fs = await mounted(tmp_path, attr_timeout=0.0)
    nodeid = (await fs.lookup(ROOT_CTX, 1, b"d")).nodeid
    backend = fs.inodes[nodeid].source.backend
    asked = []

    async def failing_listdir(node):
        raise OSError(failure, os.strerror(failure))

    async def getattr(node, file=None):
        asked.append(node)
        return await type(backend).getattr(backend, node, file)

    backend.listdir, backend.getattr = failing_listdir, getattr
    opened = await fs.opendir(ROOT_CTX, nodeid, os.O_RDONLY)
    if asks_alone:
        await fs.getattr(ROOT_CTX, nodeid, None)
    else:
        with pytest.raises(OSError) as e:
            await fs.getattr(ROOT_CTX, nodeid, None)
        assert e.value.errno == failure
    assert bool(asked) == asks_alone
    fs.releasedir(ROOT_CTX, nodeid, opened.fh)
