"""The NFS backend against a real nfs-ganesha 4.3 (FSAL VFS on xfs) in a lab namespace.

ganesha answers COPY and CLONE with NOTSUPP (the fallback path), answers
READ_PLUS with nonsense (the READ fallback), and does SEEK, ALLOCATE and
DEALLOCATE.  Linux nfsd (real COPY/CLONE) lives in test_nfs_nfsd.py.
"""
import errno
import itertools
import os
import shutil
import signal
import stat

import pytest
import trio

from backendkit import make, mounted

from offloadfs.backends import SourceError
from offloadfs.backends.base import CALLER, Caller, NotSupported
from offloadfs.backends.nfs import backend as nfs_backend, ops
from offloadfs.lab import freeze
from offloadfs.lab.nfsreplies import LoopingListing
from offloadfs.lab.proxy import RPC, Proxy

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="ganesha labs need root (namespaces, loop devices)"),
    pytest.mark.skipif(shutil.which("ganesha.nfsd") is None, reason="nfs-ganesha is not installed "
                       "(apt-get install nfs-ganesha nfs-ganesha-vfs)"),
    pytest.mark.skipif(shutil.which("mkfs.xfs") is None, reason="xfsprogs is not installed"),
]

_dirs = itertools.count()


@pytest.fixture(scope="module")
def lab():
    from offloadfs.lab.ganesha import ganesha_lab
    with ganesha_lab() as lab:
        yield lab.server


@pytest.fixture
def place(lab):
    """(URL, server-side path) of a fresh directory in the export, writable by everyone."""
    name = f"t{next(_dirs)}"
    path = lab.path / name
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    return f"nfs://{lab.host}/export/{name}", path


# -- connecting ---------------------------------------------------------------------------


async def test_root_is_the_directory_in_the_url(place):
    url, path = place
    async with mounted(url) as (b, root):
        st = await b.getattr(root)
        assert stat.S_ISDIR(st.mode) and st.ino == os.stat(path).st_ino


async def test_missing_directory_is_a_clear_error(lab):
    with pytest.raises(SourceError, match="no export or directory /export/nowhere"):
        async with mounted(f"nfs://{lab.host}/export/nowhere"):
            pass


async def test_unreachable_server_fails_fast():
    with trio.fail_after(10):
        with pytest.raises(OSError, match="cannot connect to 127.0.0.1:9"):
            async with mounted("nfs://127.0.0.1:9/export"):
                pass


# -- files --------------------------------------------------------------------------------


async def test_write_and_read_back_in_many_pieces(place):
    url, path = place
    data = os.urandom(5 << 20) + b"tail"
    async with mounted(url, rsize="65536", wsize="131072") as (b, root):
        node, f = await make(b, root, b"f", data)
        assert await b.read(f, 0, len(data) + 100) == data
        assert await b.read(f, 12345, 70000) == data[12345:12345 + 70000]
        assert await b.read(f, len(data), 10) == b""
        await b.release(f)
        assert (await b.getattr(node)).size == len(data)
    assert (path / "f").read_bytes() == data


async def test_writes_landing_while_a_commit_is_on_its_way_are_not_lost_ones(place, monkeypatch):
    """Writes behind reach a file while one of them commits: those are unstable writes the
    next COMMIT takes, not writes the server lost (it said so by keeping its verifier)."""
    monkeypatch.setattr(nfs_backend, "DIRTY_LIMIT", 0)
    url, path = place
    pieces = [os.urandom(4096) for _ in range(4)]
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f")
        send, behind = b._call, iter(range(1, len(pieces)))

        async def call(compound, **kw):
            i = next(behind, None) if isinstance(compound[-1], ops.Commit) else None
            if i is not None:  # the next write lands first
                await b._write_piece(f, i * 4096, pieces[i])
            return await send(compound, **kw)

        monkeypatch.setattr(b, "_call", call)
        await b.write(f, 0, pieces[0])
        for _ in pieces:
            await b.flush(f)  # each commits what was written before it
        assert not f.dirty
        await b.release(f)
    assert (path / "f").read_bytes() == b"".join(pieces)


async def test_created_files_belong_to_the_caller(place):
    url, path = place
    async with mounted(url) as (b, root):
        CALLER.set(Caller(1234, 4321))
        _, f = await make(b, root, b"mine", b"x")
        await b.release(f)
        await b.mkdir(root, b"dir", 0o750)
        await b.symlink(root, b"link", b"mine")
    for name in ("mine", "dir", "link"):
        st = os.lstat(path / name)
        assert (st.st_uid, st.st_gid) == (1234, 4321), name
    assert stat.S_IMODE(os.stat(path / "dir").st_mode) == 0o750


async def test_the_server_checks_the_callers_permissions(place):
    url, path = place
    path.chmod(0o755)
    async with mounted(url) as (b, root):
        CALLER.set(Caller(1234, 1234))
        with pytest.raises(PermissionError):
            await b.create(root, b"nope", os.O_WRONLY | os.O_CREAT, 0o644)


async def test_exclusive_create_and_truncating_open(place):
    url, path = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f", b"0123456789")
        await b.release(f)
        with pytest.raises(FileExistsError):
            await b.create(root, b"f", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        _, _, f = await b.create(root, b"f", os.O_RDWR | os.O_CREAT, 0o600)
        assert await b.read(f, 0, 100) == b"0123456789"  # no O_TRUNC, no O_EXCL: the file as it was
        await b.release(f)
        f = await b.open(node, os.O_WRONLY | os.O_TRUNC)
        await b.release(f)
    assert (path / "f").read_bytes() == b""


async def test_setattr(place):
    url, path = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f", b"x" * 100)
        st = await b.setattr(node, f, size=10)
        assert st.size == 10
        await b.setattr(node, None, uid=55, gid=66)  # (a change of owner clears setuid: first)
        st = await b.setattr(node, None, mode=0o4711, atime_ns=10**9 + 5, mtime_ns=2 * 10**9 + 7)
        assert (stat.S_IMODE(st.mode), st.uid, st.gid) == (0o4711, 55, 66)
        assert (st.atime_ns, st.mtime_ns) == (10**9 + 5, 2 * 10**9 + 7)
        await b.release(f)
    st = os.stat(path / "f")
    assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (
        10, 0o4711, 55, 66, 2 * 10**9 + 7)


async def test_names(place):
    url, path = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"a", b"hello")
        await b.release(f)
        d, _ = await b.mkdir(root, b"d", 0o755)
        lnk, st = await b.symlink(root, b"s", b"a")
        assert stat.S_ISLNK(st.mode) and await b.readlink(lnk) == b"a"
        _, st = await b.link(node, d, b"hard")
        assert st.nlink == 2
        await b.rename(root, b"a", d, b"moved", 0)
        with pytest.raises(FileExistsError):
            await b.rename(d, b"moved", d, b"hard", 1)  # RENAME_NOREPLACE
        with pytest.raises(OSError) as e:
            await b.rename(d, b"moved", d, b"hard", 2)  # RENAME_EXCHANGE
        assert e.value.errno == errno.EINVAL
        fifo, st = await b.mknod(root, b"fifo", stat.S_IFIFO | 0o600, 0)
        assert stat.S_ISFIFO(st.mode)
        reg, st = await b.mknod(root, b"plain", stat.S_IFREG | 0o600, 0)
        assert stat.S_ISREG(st.mode)
        names = {i.name: i for i in (await b.listdir(root))[1]}
        assert set(names) == {b"d", b"s", b"fifo", b"plain"}
        assert names[b"d"].type == 4 and names[b"s"].type == 10
        assert sorted(i.name for i in (await b.listdir(d))[1]) == [b"hard", b"moved"]
        with pytest.raises(FileNotFoundError):
            await b.lookup(root, b"a")
        with pytest.raises(OSError) as e:
            await b.rmdir(root, b"d")
        assert e.value.errno == errno.ENOTEMPTY
        for name in (b"hard", b"moved"):
            await b.unlink(d, name)
        await b.rmdir(root, b"d")
        with pytest.raises(OSError) as e:
            await b.open(lnk, os.O_RDONLY)
        assert e.value.errno == errno.ELOOP
    assert sorted(os.listdir(path)) == ["fifo", "plain", "s"]


async def test_long_directory_is_read_in_pages(place):
    url, path = place
    names = {f"file-with-a-longish-name-{i:05d}" for i in range(3000)}
    for n in names:
        (path / n).touch()
    async with mounted(url) as (b, root):
        _, items = await b.listdir(root)
    assert {i.name.decode() for i in items} == names
    assert len(items) == len(names)


async def test_a_listing_of_ever_new_cookies_ends_at_its_bound(lab, place, monkeypatch):
    """A server that never says eof but never repeats a cookie either: only the bound ends it."""
    url, path = place
    for i in range(50):
        (path / f"f{i}").touch()
    monkeypatch.setattr(nfs_backend, "LISTING_MAX_ENTRIES", 1000)
    with Proxy((lab.host, 2049), RPC) as proxy:
        async with mounted(url.replace(lab.host, f"127.0.0.1:{proxy.port}")) as (b, root):
            proxy.mutator = looping = LoopingListing(fresh_cookies=True)
            with pytest.raises(OSError, match="more than 1000 entries") as failed:
                await b.listdir(root)
            assert failed.value.errno == errno.EIO and looping.readdirs == 1000 // 50 + 1
            proxy.mutator = None
            assert len((await b.listdir(root))[1]) == 50


async def test_statfs(place):
    url, path = place
    async with mounted(url) as (b, root):
        s = await b.statfs(root)
    local = os.statvfs(path)
    assert s.blocks * s.frsize == local.f_blocks * local.f_frsize
    assert s.files == local.f_files and s.namelen >= 255


# -- NFSv4.2 ---------------------------------------------------------------------------------


async def test_copy_and_clone_are_refused_once_and_remembered(place):
    url, _ = place
    async with mounted(url) as (b, root):
        _, src = await make(b, root, b"src", b"x" * 10000)
        _, dst = await make(b, root, b"dst")
        for _ in range(2):
            with pytest.raises(NotSupported):
                await b.clone_range(src, 0, dst, 0, 10000)
            with pytest.raises(NotSupported):
                await b.server_copy(src, 0, dst, 0, 10000)
        assert {ops.OP_COPY, ops.OP_CLONE} <= b.client.unsupported
        await b.release(src)
        await b.release(dst)


async def test_no_extended_attributes_on_ganesha(place):
    url, _ = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f")
        with pytest.raises(OSError) as e:
            await b.setxattr(node, b"user.x", b"1", 0)
        assert e.value.errno == errno.EOPNOTSUPP and ops.OP_GETXATTR in b.client.unsupported
        assert await b.listxattr(node) == []
        await b.release(f)


async def test_sparse_files_seek_punch_and_read(place):
    url, path = place
    with open(path / "sparse", "wb") as f:
        f.truncate(8 << 20)
        f.seek(2 << 20)
        f.write(b"d" * (1 << 20))
    async with mounted(url) as (b, root):
        node = (await b.lookup(root, b"sparse"))[0]
        f = await b.open(node, os.O_RDWR)
        assert await b.seek(f, 0, 3) == 2 << 20  # SEEK_DATA
        assert await b.seek(f, 2 << 20, 4) == 3 << 20  # SEEK_HOLE
        with pytest.raises(OSError) as e:
            await b.seek(f, 9 << 20, 3)
        assert e.value.errno == errno.ENXIO
        data = await b.read(f, 0, 8 << 20)
        assert data == bytes(2 << 20) + b"d" * (1 << 20) + bytes(5 << 20)
        await b.allocate(f, 3, (2 << 20) + 4096, 8192)  # punch a hole, keep the size
        await b.allocate(f, 0, 9 << 20, 4096)  # allocate past the end: the file grows
        await b.allocate(f, 1, 20 << 20, 4096)  # keep-size allocation past the end: nothing to do
        with pytest.raises(OSError) as e:
            await b.allocate(f, 0x10, 0, 4096)  # zero range
        assert e.value.errno == errno.EOPNOTSUPP
        await b.release(f)
    assert os.stat(path / "sparse").st_size == (9 << 20) + 4096
    with open(path / "sparse", "rb") as f:
        f.seek((2 << 20) + 4096)
        assert f.read(8192) == bytes(8192)


async def test_planner_copies_by_streaming_when_the_server_cannot(place):
    from offloadfs.planner import Endpoint, Planner
    from offloadfs.stats import Stats

    url, path = place
    data = os.urandom(3 << 20)
    async with mounted(url) as (b, root):
        src_node, src = await make(b, root, b"src", data)
        dst_node, dst = await make(b, root, b"dst")
        stats = Stats("/mnt", {"s": url})
        n = await Planner(stats).copy(Endpoint(b, src_node, src, "src"), 0, Endpoint(b, dst_node, dst, "dst"),
                                      0, 10 << 20)
        assert n == len(data)
        await b.release(src)
        await b.release(dst)
    assert (path / "dst").read_bytes() == data


# -- recovery ---------------------------------------------------------------------------------


async def test_dropped_connection_is_reestablished(place):
    url, path = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f", b"before")
        await b.client.conn.close("test")
        assert await b.read(f, 0, 100) == b"before"
        await b.write(f, 6, b" after")
        await b.release(f)
    assert (path / "f").read_bytes() == b"before after"


async def test_restarted_server_open_files_are_reopened(lab, place, caplog):
    url, path = place
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f", b"0123456789")
        await b.fsync(f, False)
        await b.write(f, 0, b"0")  # unstable, not committed when the server goes
        assert f.dirty
        generation = b.client.generation
        await trio.to_thread.run_sync(lab.kill)
        await trio.sleep(1.1)  # ganesha's write verifier is its start time in seconds
        await trio.to_thread.run_sync(lab.start)
        assert await b.read(f, 0, 4) == b"0123"
        assert b.client.generation == generation + 1
        await b.write(f, 10, b"abc")
        await b.release(f)
        assert (await b.getattr(node)).size == 13
    assert (path / "f").read_bytes() == b"0123456789abc"
    assert "sending them again" in caplog.text  # the new write verifier sent the old unstable write again


@pytest.fixture(scope="module")
def graceful_lab():
    """A ganesha that, like real servers, keeps a grace period after a restart."""
    from offloadfs.lab.ganesha import ganesha_lab
    with ganesha_lab(grace=20) as lab:
        yield lab.server


async def test_open_files_are_reclaimed_in_the_grace_period(graceful_lab):
    """A plain OPEN would wait the grace period out; CLAIM_PREVIOUS takes the file back at once."""
    lab = graceful_lab
    (lab.path / "r").mkdir(mode=0o777)
    async with mounted(f"nfs://{lab.host}/export/r") as (b, root):
        node, f = await make(b, root, b"f", b"0123456789")
        await b.fsync(f, False)
        opens = []
        try_slot = b.client._try_slot

        async def record(conn, table, sessionid, slot, op_list, *rest):
            opens.extend(op for op in op_list if isinstance(op, ops.Open))
            return await try_slot(conn, table, sessionid, slot, op_list, *rest)

        b.client._try_slot = record
        await trio.to_thread.run_sync(lab.kill)
        await trio.to_thread.run_sync(lab.start)
        started = trio.current_time()
        assert await b.read(f, 0, 4) == b"0123"
        await b.write(f, 10, b"abc")
        await b.fsync(f, False)
        print(f"\nserving again {trio.current_time() - started:.1f} s after the restart (grace period: 20 s)")
        assert [op.reclaim for op in opens] == [True]  # taken back, never reopened
        await b.release(f)
    assert (lab.path / "r" / "f").read_bytes() == b"0123456789abc"


async def test_soft_mount_gives_up(lab, place):
    url, _ = place
    async with mounted(url, soft=True, timeo="5", retrans="1") as (b, root):
        freeze(lab.process.pid)
        try:
            with trio.fail_after(30):  # gives up after 2 x 0.5 s; a hard mount would wait for ever
                with pytest.raises(TimeoutError):
                    await b.getattr(root)
        finally:
            lab.process.send_signal(signal.SIGCONT)
        await b.getattr(root)  # and works again once the server does


async def test_hard_mount_waits_and_can_be_interrupted(lab, place):
    url, _ = place
    async with mounted(url, timeo="5") as (b, root):
        freeze(lab.process.pid)
        try:
            with trio.move_on_after(2) as scope:
                await b.getattr(root)
            assert scope.cancelled_caught
        finally:
            lab.process.send_signal(signal.SIGCONT)
        with trio.fail_after(20):
            await b.getattr(root)
