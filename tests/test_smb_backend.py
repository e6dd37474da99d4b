"""The SMB backend against a real smbd (the Samba lab: btrfs and ext4 shares in a network namespace).

Each test talks to the backend directly under trio, in a fresh directory of
a share, and checks what it did on the server side too.
"""
import contextlib
import errno
import gc
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from offloadfs.backends import SourceError
from offloadfs.backends.base import NotSupported
from offloadfs.backends.smb import messages as m
from offloadfs.lab import freeze
from offloadfs.planner import Endpoint, Planner
from offloadfs.stats import Stats

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the Samba lab needs root (namespaces, loop mounts)"),
    pytest.mark.skipif(shutil.which("smbd") is None, reason="smbd is not installed (apt-get install samba)"),
]

smb = pytest.importorskip("offloadfs.backends.smb", reason="smbprotocol is not installed")
import smbprotocol.connection  # noqa: E402
from smbprotocol.header import Commands  # noqa: E402
samba = pytest.importorskip("offloadfs.lab.samba", reason="the Samba lab needs pyroute2")
from offloadfs.backends.smb import backend as smb_backend, capabilities, client as smb_client, leases  # noqa: E402
from offloadfs.backends.smb import errors as smb_errors  # noqa: E402

MiB = 1 << 20
HANG_BOUND = 15  # seconds: an answer slower than this is a hang, whatever the machine's load
RW, CREATE = os.O_RDWR, os.O_RDWR | os.O_CREAT | os.O_EXCL


@pytest.fixture(scope="module")
def lab():
    with samba.samba_lab(("btrfs", "ext4"), durable=("ext4",)) as lab:
        yield lab


@pytest.fixture(scope="module")
def creds(lab, tmp_path_factory):
    path = lab.server.write_credentials(tmp_path_factory.mktemp("smb") / "cred")
    return str(path)


@pytest.fixture
def connect(lab, creds):
    """connect(share, **options) -> (backend, node of a fresh directory, its path on the server)."""
    @contextlib.asynccontextmanager
    async def connect(share="ext4", **options):
        server = lab.server
        backend = smb.SMBBackend(f"smb://{server.username}@{server.host}/{share}", {"credentials": creds, **options})
        await backend.root()
        try:
            name = f"t-{uuid.uuid4().hex[:10]}"
            root = backend.nodes[""]
            node, _ = await backend.mkdir(root, name.encode(), 0o755)
            yield backend, node, server.shares[share].path / name
        finally:
            await backend.close()
    return connect


async def make_file(backend, dir, name, data):
    node, _, file = await backend.create(dir, name, CREATE, 0o644)
    try:
        assert await backend.write(file, 0, data) == len(data)
    finally:
        await backend.release(file)
    return node


def sha(data):
    return hashlib.sha256(data).hexdigest()


def connection_processes(server):
    """The smbd processes serving client connections (the parent's helpers have other names)."""
    pids = samba.server_pids(server.process.pid, str(server.conf)) - {server.process.pid}
    return [p for p in pids if Path(f"/proc/{p}/comm").read_text().strip() == "smbd"]


async def test_create_write_read_stat(connect):
    async with connect() as (b, d, path):
        data = os.urandom(3 * MiB + 123)
        node, st, f = await b.create(d, b"f", CREATE, 0o644)
        assert st.size == 0 and st.mode == 0o100755  # file_mode's default, as mount.cifs
        assert await b.write(f, 0, data) == len(data)
        assert bytes(await b.read(f, 0, len(data) + 10)) == data
        assert bytes(await b.read(f, len(data), 10)) == b""
        st = await b.getattr(node, f)
        assert (st.size, st.ino) == (len(data), node.ino)
        await b.release(f)
        assert (path / "f").read_bytes() == data
        with pytest.raises(FileExistsError):
            await b.create(d, b"f", CREATE, 0o644)
        node2, st2 = await b.lookup(d, b"f")
        assert node2 is node and st2.ino == node.ino
        with pytest.raises(FileNotFoundError):
            await b.lookup(d, b"missing")
        with pytest.raises(OSError) as e:
            await b.lookup(d, b"a:stream")
        assert e.value.errno == errno.EINVAL


async def test_answered_requests_are_freed_without_the_garbage_collector(connect):
    """A request and its arrival referred to each other, so each write's data stayed in memory until
    the cyclic garbage collector ran, which an idle daemon never makes it do (hundreds of MB)."""
    async with connect() as (b, d, path):
        data = os.urandom(8 * MiB)
        gc.collect()
        gc.disable()
        try:
            node, st, f = await b.create(d, b"f", CREATE, 0o644)
            assert await b.write(f, 0, data) == len(data)
            assert bytes(await b.read(f, 0, len(data))) == data
            await b.release(f)
            # (smbprotocol's receiver keeps the last request it answered, until the next reply.)
            held = [o.message["command"].get_value() for o in gc.get_objects()
                    if type(o) is smbprotocol.connection.Request]
            assert Commands.SMB2_WRITE not in held and Commands.SMB2_READ not in held and len(held) <= 1
        finally:
            gc.enable()


async def test_large_io_goes_in_parallel_pieces(connect):
    async with connect() as (b, d, path):
        assert b.client.io_size == 8 * MiB  # Samba's negotiated maximum
        data = os.urandom(20 * MiB + 5)
        node, _, f = await b.create(d, b"big", CREATE, 0o644)
        assert await b.write(f, 0, memoryview(data)) == len(data)
        got = await b.read(f, 0, len(data))
        await b.release(f)
        assert sha(bytes(got)) == sha(data) == sha((path / "big").read_bytes())


async def test_setattr(connect):
    async with connect() as (b, d, path):
        node = await make_file(b, d, b"f", b"x" * 1000)
        st = await b.setattr(node, size=10, atime_ns=1_000_000_000_123_456_700, mtime_ns=1_500_000_000_999_999_900)
        assert (st.size, st.atime_ns, st.mtime_ns) == (10, 1_000_000_000_123_456_700, 1_500_000_000_999_999_900)
        server_side = os.stat(path / "f")
        assert (server_side.st_size, server_side.st_mtime_ns) == (10, 1_500_000_000_999_999_900)
        assert (await b.setattr(node, mode=0o444)).mode & 0o222 == 0  # read-only attribute
        assert (await b.setattr(node, mode=0o644)).mode & 0o200
        f = await b.open(node, RW | os.O_TRUNC)
        assert (await b.getattr(node, f)).size == 0
        assert (await b.setattr(node, f, size=4096)).size == 4096
        await b.release(f)
        await b.setattr(node, uid=1234, gid=1234)  # accepted and ignored, as by mount.cifs


async def test_times_set_while_open_for_writing_outlast_the_close(connect):
    """The kernel sends utimes without a handle; in Samba the close of a handle that wrote
    would stamp the close time over a time set through any other handle."""
    async with connect() as (b, d, path):
        mtime = 1_600_000_000_987_654_300
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        g = await b.open(node, os.O_WRONLY)
        r = await b.open(node, os.O_RDONLY)
        assert node.files == [f, g, r]
        await b.write(f, 0, b"x" * 1000)
        await b.write(g, 0, b"y")  # two handles that wrote: each one's close would stamp
        assert (await b.setattr(node, atime_ns=mtime, mtime_ns=mtime)).mtime_ns == mtime
        await b.write(f, 1000, b"z")
        for h in (f, g, r):
            await b.release(h)
        assert node.files == []
        assert os.stat(path / "f").st_mtime_ns == mtime


async def test_rename_moves_nodes_below(connect):
    async with connect() as (b, d, path):
        a, _ = await b.mkdir(d, b"a", 0o755)
        sub, _ = await b.mkdir(a, b"sub", 0o755)
        f = await make_file(b, sub, b"f", b"data")
        await b.rename(d, b"a", d, b"b", 0)
        assert (a.path, sub.path, f.path) == (f"{d.path}\\b", f"{d.path}\\b\\sub", f"{d.path}\\b\\sub\\f")
        assert (await b.getattr(f)).size == 4
        assert (path / "b" / "sub" / "f").read_bytes() == b"data"
        other = await make_file(b, d, b"other", b"o")
        with pytest.raises(FileExistsError):
            await b.rename(sub, b"f", d, b"other", 1)  # RENAME_NOREPLACE
        with pytest.raises(OSError) as e:
            await b.rename(sub, b"f", d, b"other", 2)  # RENAME_EXCHANGE
        assert e.value.errno == errno.EINVAL
        await b.rename(sub, b"f", d, b"other", 0)
        assert f.path == f"{d.path}\\other" and other.path is None  # the replaced node is stale
        assert (path / "other").read_bytes() == b"data"
        with pytest.raises(IsADirectoryError):
            await b.rename(d, b"other", d, b"b", 0)
        with pytest.raises(NotADirectoryError):
            await b.rename(d, b"b", d, b"other", 0)
        empty, _ = await b.mkdir(d, b"empty", 0o755)
        await b.rename(d, b"b", d, b"empty", 0)  # a directory replaces an empty one
        assert a.path == f"{d.path}\\empty" and sub.path == f"{d.path}\\empty\\sub"


async def test_names_below_a_directory_are_found_through_its_forgotten_names(connect):
    """A removal or rename reaches every known name below the path through an index by directory, also
    below a name the kernel forgot meanwhile; the index keeps nothing once its nodes are forgotten.
    (Scanning every known name instead cost `rm -rf` of 2000 files a fifth of the daemon's CPU.)"""
    async with connect() as (b, d, path):
        a, _ = await b.mkdir(d, b"a", 0o755)
        sub, _ = await b.mkdir(a, b"sub", 0o755)
        f = await make_file(b, sub, b"f", b"data")
        (path / "a" / "sub").rename(path / "a" / "moved")  # another client
        (path / "a" / "sub").write_bytes(b"x")
        replaced, _ = await b.lookup(a, b"sub")
        assert replaced is not sub and sub.path is None
        b.forget(replaced)  # a\sub is known no more; a\sub\f still is
        await b.rename(d, b"a", d, b"b", 0)
        assert (a.path, f.path) == (f"{d.path}\\b", f"{d.path}\\b\\sub\\f")
        shutil.rmtree(path / "b")  # another client
        with pytest.raises(FileNotFoundError):
            await b.lookup(d, b"b")
        assert a.path is None and f.path is None
        for node in (a, sub, f):
            b.forget(node)
        assert set(b.nodes) == {"", d.path} and b.below == {"": {d.path}}


async def test_unlink_rmdir_and_open_files(connect):
    async with connect() as (b, d, path):
        node, _, f = await b.create(d, b"open", CREATE, 0o644)
        await b.write(f, 0, b"still here")
        await b.unlink(d, b"open")
        assert bytes(await b.read(f, 0, 100)) == b"still here"  # delete on close
        with pytest.raises(FileNotFoundError):
            await b.lookup(d, b"open")
        await b.release(f)
        assert not (path / "open").exists()
        ro = await make_file(b, d, b"readonly", b"r")
        await b.setattr(ro, mode=0o444)
        await b.unlink(d, b"readonly")  # POSIX: the directory's permission decides
        sub, _ = await b.mkdir(d, b"sub", 0o755)
        await make_file(b, sub, b"f", b"")
        with pytest.raises(OSError) as e:
            await b.rmdir(d, b"sub")
        assert e.value.errno == errno.ENOTEMPTY
        with pytest.raises(IsADirectoryError):
            await b.unlink(d, b"sub")
        await b.unlink(sub, b"f")
        await b.rmdir(d, b"sub")
        assert list(path.iterdir()) == []


async def test_a_directory_of_one_page_is_listed_in_one_round_trip(connect):
    async with connect() as (b, d, path):
        for i in range(100):
            (path / f"f{i}").touch()
        trips, closes = b.round_trips, b.requests["CLOSE"]
        before, items = await b.listdir(d)
        assert len(items) == 100 and b.round_trips - trips == 1
        assert stat.S_ISDIR(before.mode) and before.mtime_ns == os.stat(path).st_mtime_ns // 100 * 100
        await trio.testing.wait_all_tasks_blocked()
        assert (b.round_trips - trips, b.requests["CLOSE"] - closes) == (2, 1)  # and its handle closed


async def test_readdir_pages_through_2000_files(connect):
    async with connect() as (b, d, path):
        names = {f"file-{i:05d}-{'x' * 40}" for i in range(2000)}
        for name in names:
            (path / name).touch()
        (path / "dir").mkdir()
        calls = 0
        call = b.client.call

        async def counting(*args):
            nonlocal calls
            calls += 1
            return await call(*args)

        b.client.call = counting
        _, items = await b.listdir(d)
        await trio.testing.wait_all_tasks_blocked()  # the handle's close, after the listing
        assert calls > 4  # 64 KiB pages: several QUERY_DIRECTORY round trips
        assert {i.name.decode() for i in items} == names | {"dir"}
        assert {i.type for i in items if i.name == b"dir"} == {4}
        # Right after the listing, a lookup (or a stat) of an entry needs no round trip, once.
        some = [i for i in items if i.name != b"dir"]
        calls = 0
        node, st = await b.lookup(d, some[0].name)
        assert (calls, st.ino) == (0, some[0].ino)
        assert (await b.getattr(node)).ino == some[0].ino and calls == 1
        # A change made through us drops the listing.
        await make_file(b, d, b"new", b"")
        calls = 0
        await b.lookup(d, some[1].name)
        assert calls == 1


def _endless(call):
    """A Client.call that answers QUERY_DIRECTORY with the listing's first page where the server said
    STATUS_NO_MORE_FILES: the server's own replies, so signing cannot stop it, as it stops a man in the middle."""
    first = []

    async def endless(share, messages, generation=None, uid=None, sent=None):
        results = await call(share, messages, generation, uid, sent)
        for i, msg in enumerate(messages):
            if m.command(msg) == "QUERY_DIRECTORY":
                status, body = results[i]
                if status == smb_errors.SUCCESS and not first:
                    first.append(body)
                elif status == smb_errors.NO_MORE_FILES:
                    results[i] = (smb_errors.SUCCESS, first[0])
        return results

    return endless


async def test_a_listing_that_never_ends_fails(connect):
    async with connect() as (b, d, path):
        for i in range(3):
            (path / f"f{i}").touch()
        b.client.call = _endless(b.client.call)
        with trio.fail_after(HANG_BOUND), pytest.raises(OSError) as e:
            await b.listdir(d)
        assert e.value.errno == errno.EIO and "same page twice" in e.value.strerror


async def test_a_listing_larger_than_the_caps_fails(connect, monkeypatch):
    async with connect() as (b, d, path):
        for i in range(5):
            (path / f"f{i}").touch()
        assert len((await b.listdir(d))[1]) == 5
        monkeypatch.setattr(smb_backend, "LIST_MAX_ENTRIES", 4)
        with pytest.raises(OSError) as e:
            await b.listdir(d)
        assert e.value.errno == errno.EIO and "more than 4 entries" in e.value.strerror


async def test_hard_links_statfs_and_no_symlinks(connect):
    async with connect() as (b, d, path):
        f = await make_file(b, d, b"f", b"linked")
        node, st = await b.link(f, d, b"g")
        assert st.ino == f.ino and st.nlink == 2
        assert os.stat(path / "g").st_ino == os.stat(path / "f").st_ino
        s = await b.statfs(d)
        assert s.blocks > 0 and 0 < s.bavail <= s.blocks and s.bsize > 0
        with pytest.raises(OSError) as e:
            await b.symlink(d, b"l", b"f")
        assert e.value.errno == errno.EOPNOTSUPP


async def test_a_name_held_is_looked_up_at_the_server_even_right_after_a_listing(connect):
    """The filesystem asks about a name it holds only where its own listing is in doubt (an open
    checks that the name still leads to its file): a listing from before cannot tell."""
    async with connect() as (b, d, path):
        f = await make_file(b, d, b"f", b"old")
        (path / "other").touch()
        await b.listdir(d)
        os.link(path / "f", path / "kept")  # the old file lives on: the new f gets another file id
        os.unlink(path / "f")
        (path / "f").write_bytes(b"new")  # replaced by another client
        node, st = await b.lookup(d, b"f")
        assert node is not f and st.ino == os.stat(path / "f").st_ino
        trips = b.round_trips
        assert (await b.lookup(d, b"other"))[1].ino == os.stat(path / "other").st_ino
        assert b.round_trips == trips  # a name not held still answers from the listing


async def test_a_listing_gives_the_link_count_known_or_makes_up_1(connect):
    """QUERY_DIRECTORY carries no link count: a known file keeps the one it had (less the links
    removed through us), as the Linux cifs client does; a file not known gets 1."""
    async with connect() as (b, d, path):
        f = await make_file(b, d, b"f", b"linked")
        await b.link(f, d, b"g")
        (path / "other").touch()
        os.link(path / "other", path / "other2")  # by another client, never looked up here
        listed = {i.name: i.stat.nlink for i in (await b.listdir(d))[1]}
        assert listed == {b"f": 2, b"g": 2, b"other": 1, b"other2": 1}
        await b.unlink(d, b"g")
        assert {i.name: i.stat.nlink for i in (await b.listdir(d))[1]}[b"f"] == 1


async def test_a_node_goes_on_by_its_other_names(connect):
    """The filesystem keeps one node per file id, so a hard link or a rename by another
    client must not leave that node on a name that is gone."""
    async with connect() as (b, d, path):
        f = await make_file(b, d, b"a", b"linked")
        node, _ = await b.link(f, d, b"b")
        assert node is f
        await b.unlink(d, b"a")
        assert f.path == f"{d.path}\\b"
        h = await b.open(f, RW)
        assert bytes(await b.read(h, 0, 100)) == b"linked"
        await b.release(h)
        (path / "b").rename(path / "c")  # another client
        with pytest.raises(FileNotFoundError):
            await b.getattr(f)
        node, _ = await b.lookup(d, b"c")
        assert node is f and (await b.getattr(f)).size == 6
        await b.link(f, d, b"d")
        await b.unlink(d, b"d")
        assert f.path == f"{d.path}\\c"
        await b.unlink(d, b"c")
        with pytest.raises(FileNotFoundError):  # gone by every name (b went on the server)
            await b.open(f, RW)
        await b.link(await make_file(b, d, b"e", b""), d, b"g")
        e, _ = await b.lookup(d, b"e")
        b.forget(e)  # every name goes
        assert e not in b.nodes.values() and e not in b.by_id.values()


async def test_paths_end_where_samba_can_still_remove_them(connect):
    async with connect() as (b, d, path):
        parent = d
        while len(parent.path) + 1 + 255 <= smb.backend.MAX_PATH:
            parent, _ = await b.mkdir(parent, b"d" * 255, 0o755)
        last = smb.backend.MAX_PATH - len(parent.path) - 1  # bytes left for the last name
        with pytest.raises(OSError) as e:
            await b.mkdir(parent, "é".encode() * (last // 2 + 1), 0o755)
        assert e.value.errno == errno.ENAMETOOLONG
        deepest, _ = await b.mkdir(parent, b"e" * last, 0o755)
        assert len(deepest.path.encode()) == smb.backend.MAX_PATH
        await b.rmdir(parent, b"e" * last)
        with pytest.raises(FileNotFoundError):  # gone (too deep to look at on the server side)
            await b.lookup(parent, b"e" * last)


async def test_xattrs_are_user_eas(connect):
    async with connect() as (b, d, path):
        f = await make_file(b, d, b"f", b"")
        await b.setxattr(f, b"user.colour", b"blue", 0)
        assert await b.getxattr(f, b"user.colour") == b"blue"
        assert await b.listxattr(f) == [b"user.colour"]
        with pytest.raises(FileExistsError):
            await b.setxattr(f, b"user.colour", b"red", os.XATTR_CREATE)
        await b.setxattr(f, b"user.colour", b"red", os.XATTR_REPLACE)
        assert os.getxattr(path / "f", "user.colour") == b"red"  # Samba keeps EAs as user.* xattrs
        await b.removexattr(f, b"user.colour")
        assert await b.listxattr(f) == []
        for call, error in ((b.getxattr(f, b"user.colour"), errno.ENODATA),
                            (b.getxattr(f, b"security.capability"), errno.EOPNOTSUPP),
                            (b.removexattr(f, b"user.colour"), errno.ENODATA)):
            with pytest.raises(OSError) as e:
                await call
            assert e.value.errno == error
        with pytest.raises(OSError) as e:
            await b.setxattr(f, b"trusted.x", b"1", 0)
        assert e.value.errno == errno.EOPNOTSUPP


async def copy_loop(method, src_file, dst_file, length):
    """What the planner does: call until done, a short count continues from where it stopped."""
    counts = []
    while sum(counts) < length:
        n = await method(src_file, sum(counts), dst_file, sum(counts), length - sum(counts))
        assert n > 0
        counts.append(n)
    return counts


async def test_server_copy_short_counts_and_learned_limits(connect, monkeypatch):
    async with connect("ext4") as (b, d, path):
        data = os.urandom(40 * MiB + 1234)
        src = await make_file(b, d, b"src", data)
        sf = await b.open(src, os.O_RDONLY)
        _, _, df = await b.create(d, b"dst", CREATE, 0o644)
        monkeypatch.setattr(capabilities, "COPY_PER_CALL", 12 * MiB)
        b.copy_limits = capabilities.CopyLimits(1024, 4 * MiB, 1 << 30)  # more than Samba takes
        counts = await copy_loop(b.server_copy, sf, df, len(data))
        assert counts == [12 * MiB, 12 * MiB, 12 * MiB, 4 * MiB + 1234]
        # Samba's refusal named its limits: 256 chunks of 1 MiB, 16 MiB a request.
        limits = b.copy_limits
        assert (limits.chunks, limits.chunk_size, limits.total) == (256, MiB, 16 * MiB)
        # Past the source's end the server copies nothing: a zero count, not an error.
        assert await b.server_copy(sf, len(data), df, len(data), MiB) == 0
        await b.release(sf)
        await b.release(df)
        assert sha((path / "dst").read_bytes()) == sha(data)


async def test_planner_uses_server_copy_on_ext4_and_clone_on_btrfs(connect):
    for share, method in (("ext4", "server_copy"), ("btrfs", "clone")):
        async with connect(share) as (b, d, path):
            data = os.urandom(20 * MiB + 77)
            src = await make_file(b, d, b"src", data)
            sf = await b.open(src, os.O_RDONLY)
            dst, _, df = await b.create(d, b"dst", CREATE, 0o644)
            stats = Stats("/mnt", {})
            start = time.monotonic()
            n = await Planner(stats).copy(Endpoint(b, src, sf, "s"), 0, Endpoint(b, dst, df, "d"), 0, 1 << 40)
            took = time.monotonic() - start
            await b.release(sf)
            await b.release(df)
            assert n == len(data)
            assert stats.copy_bytes[method] == len(data), stats.copy_bytes
            assert sha((path / "dst").read_bytes()) == sha(data)
            print(f"\n{share}: 20 MiB by {method} in {took * 1000:.1f} ms")


async def test_duplicate_extents_on_btrfs(connect):
    async with connect("btrfs") as (b, d, path):
        assert b.can_clone
        data = os.urandom(10 * MiB + 1000)
        src = await make_file(b, d, b"src", data)
        sf = await b.open(src, os.O_RDONLY)
        _, _, df = await b.create(d, b"whole", CREATE, 0o644)
        # An unaligned end is fine where it is the source's end; the empty destination is sized first.
        assert await b.clone_range(sf, 0, df, 0, len(data)) == len(data)
        await b.release(df)
        assert sha((path / "whole").read_bytes()) == sha(data)
        assert "shared" in subprocess.run(["filefrag", "-v", str(path / "whole")], capture_output=True,
                                          text=True).stdout
        _, _, df = await b.create(d, b"part", CREATE, 0o644)
        # An unaligned end inside the file: the aligned part is cloned, the rest left to another method.
        assert await b.clone_range(sf, 4096, df, 4096, 5 * MiB + 100) == 5 * MiB
        with pytest.raises(NotSupported):
            await b.clone_range(sf, 100, df, 100, MiB)
        await b.release(df)
        await b.release(sf)
        assert (path / "part").read_bytes()[4096:] == data[4096:4096 + 5 * MiB]


async def test_copies_across_shares_of_one_connection(connect):
    async with connect("btrfs") as (bt, dt, path_t), connect("ext4") as (be, de, path_e):
        assert bt.client is be.client and bt.shares_server_with(be) and be.shares_server_with(bt)
        data = os.urandom(3 * MiB)
        sf = await bt.open(await make_file(bt, dt, b"src", data), os.O_RDONLY)
        _, _, df = await be.create(de, b"from-btrfs", CREATE, 0o644)
        assert await copy_loop(be.server_copy, sf, df, len(data)) == [len(data)]
        with pytest.raises(NotSupported):
            await be.clone_range(sf, 0, df, 0, len(data))  # Samba finds handles only on their own share
        await be.release(df)
        await bt.release(sf)
        assert (path_e / "from-btrfs").read_bytes() == data
        # Into btrfs from ext4: refused up front (Samba's vfs_btrfs would crash on the foreign key).
        sf = await be.open(await make_file(be, de, b"src", data), os.O_RDONLY)
        _, _, df = await bt.create(dt, b"from-ext4", CREATE, 0o644)
        with pytest.raises(NotSupported):
            await bt.server_copy(sf, 0, df, 0, len(data))
        await bt.release(df)
        await be.release(sf)
        assert (await be.getattr(de)).ino == de.ino  # the connection is fine


async def test_seek_and_punch_holes(connect):
    async with connect("ext4") as (b, d, path):
        node, _, f = await b.create(d, b"sparse", CREATE, 0o644)
        await b.write(f, 0, b"d" * (8 * MiB))
        assert await b.seek(f, 0, capabilities.SEEK_HOLE) == 8 * MiB  # not sparse yet: all data
        # 600 holes: more ranges than the first 4 KiB answer buffer holds (Samba then says BUFFER_TOO_SMALL).
        for i in range(600):
            await b.allocate(f, 3, i * 8192, 4096)
        assert (await b.getattr(node, f)).size == 8 * MiB
        fd = os.open(path / "sparse", os.O_RDONLY)
        try:
            for offset in (0, 4096, 4097, 8192, 600 * 8192 - 1, 600 * 8192, 7 * MiB):
                for whence in (os.SEEK_DATA, os.SEEK_HOLE):
                    assert await b.seek(f, offset, whence) == os.lseek(fd, offset, whence), (offset, whence)
        finally:
            os.close(fd)
        with pytest.raises(OSError) as e:
            await b.seek(f, 8 * MiB, os.SEEK_DATA)
        assert e.value.errno == errno.ENXIO
        assert (path / "sparse").read_bytes()[:8192] == bytes(4096) + b"d" * 4096
        await b.allocate(f, 0, 0, 9 * MiB)  # plain allocation past the end grows the file
        assert (await b.getattr(node, f)).size == 9 * MiB
        with pytest.raises(OSError) as e:
            await b.allocate(f, 0x10, 0, 4096)  # FALLOC_FL_ZERO_RANGE
        assert e.value.errno == errno.EOPNOTSUPP
        await b.release(f)


async def test_sealed_and_older_dialects(connect):
    for options in ({"seal": True}, {"seal": True, "vers": "3.0"}, {"vers": "3.0"}, {"vers": "2.1"}):
        async with connect(**options) as (b, d, path):
            data = os.urandom(MiB + 3)
            node = await make_file(b, d, b"f", data)
            f = await b.open(node, os.O_RDONLY)
            assert bytes(await b.read(f, 0, len(data))) == data
            await b.release(f)
            session = b.client.session
            assert session.encrypt_data == bool(options.get("seal")), options


async def test_bad_sources_fail_clearly_and_never_show_the_password(lab, tmp_path):
    server = lab.server
    secret = "Wr0ng-but-s3cret"
    cred = tmp_path / "cred"
    cred.write_text(f"username={server.username}\npassword={secret}\n")
    cred.chmod(0o600)
    cases = [
        (f"smb://{server.username}@{server.host}/ext4", "logon failure for user offloadfs-lab on"),
        (f"smb://{server.username}@{server.host}:1/ext4", "cannot connect to"),
    ]
    for url, message in cases:
        backend = smb.SMBBackend(url, {"credentials": str(cred)})
        with trio.fail_after(HANG_BOUND), pytest.raises(SourceError) as e:
            await backend.root()
        assert message in str(e.value)
        assert secret not in str(e.value) and secret not in repr(e.value)
        assert backend.client is None
    good = cred.with_name("good")
    good.write_text(f"password={server.password}\n")
    good.chmod(0o600)
    for share, message in (("nope", "no such share"), ("ext4/no/dir", "no such directory")):
        backend = smb.SMBBackend(f"smb://{server.username}@{server.host}/{share}", {"credentials": str(good)})
        with pytest.raises(SourceError, match=message) as e:
            await backend.root()
        assert server.password not in str(e.value)


async def test_reconnect_after_server_restart(lab, connect):
    server = lab.server
    async with connect() as (b, d, path):
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        await b.write(f, 0, b"before ")
        generation = b.client.generation
        await trio.to_thread.run_sync(server.kill)
        try:
            with trio.fail_after(HANG_BOUND), pytest.raises(OSError) as e:  # no server: EIO, not a hang
                await b.getattr(d)
        finally:
            await trio.to_thread.run_sync(server.start)  # the later tests need it, whatever happened here
        # Sent before the client saw the socket close, or after: either way the error names the server.
        assert e.value.errno == errno.EIO and server.host in str(e.value), e.value
        # The dead connection is noticed and a new one made.  No durable handle outlives smbd, and
        # nothing else proves that the name still leads to the file as we left it: the handle is lost.
        for use in (lambda: b.write(f, 7, b"after"), lambda: b.read(f, 0, 100), lambda: b.fsync(f, False),
                    lambda: b.flush(f)):
            with pytest.raises(OSError) as e:
                await use()
            assert e.value.errno == errno.EIO and "lost in a reconnect" in str(e.value), e.value
        assert b.client.generation == generation + 1
        assert (await b.getattr(d)).ino == d.ino
        assert (await b.getattr(node)).size == 7  # by name: the lost handle is not the stat's to fail
        await b.release(f)
        g = await b.open(node, RW)  # a new open is the program's own choice, and works
        assert await b.write(g, 7, b"after") == 5
        await b.release(g)
        assert (path / "f").read_bytes() == b"before after"


async def test_a_durable_handle_is_reconnected_after_a_lost_connection(connect):
    async with connect("ext4-durable") as (b, d, path):
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        assert f.create_guid is not None  # granted
        await b.write(f, 0, b"before ")
        handle, generation = f.file_id, b.client.generation
        b.client._shutdown(b.client.conn)  # the TCP connection breaks; smbd keeps the handle
        with trio.fail_after(HANG_BOUND):
            assert await b.write(f, 7, b"after") == 5
        assert b.client.generation == generation + 1
        assert f.file_id[:8] == handle[:8]  # the same open (persistent id), not a new one by path
        await b.release(f)
        assert (path / "f").read_bytes() == b"before after"


async def test_a_durable_handle_keeps_its_lease_across_a_reconnect(connect):
    """The reconnect names the lease (MS-SMB2 3.2.4.3.5), under the client GUID the server keys it by;
    the file may have changed while we were away, so caching starts anew and the break callback hears of it."""
    async with connect("ext4-durable") as (b, d, path):
        broken = []
        b.on_break(broken.append)
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        before = b.caching(node)
        assert before is not None and f.create_guid is not None
        handle = f.file_id
        b.client._shutdown(b.client.conn)
        with trio.fail_after(HANG_BOUND):
            assert await b.write(f, 0, b"after") == 5
        assert f.file_id[:8] == handle[:8]  # reconnected, not reopened by path
        assert broken == [node] and b.caching(node) not in (None, before)
        await b.release(f)
        assert b.caching(node) is None


async def test_our_opens_share_a_lease_and_break_nothing_of_each_other(connect):
    """Our opens of one file name one lease key: a second open, a write through it and a delete
    (which Samba lets through our handles, as they share delete access) break nothing, and read
    caching goes on.  With a batch oplock, each of them broke the first handle's."""
    async with connect("ext4-durable") as (b, d, path):
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        await b.write(f, 0, b"data")
        held = b.caching(node)
        g = await b.open(node, RW)
        await b.write(g, 4, b"more")
        assert b.caching(node) == held and b.requests["OPLOCK_BREAK"] == 0
        await b.unlink(d, b"f")
        assert bytes(await b.read(f, 0, 100)) == b"datamore"
        assert b.caching(node) == held and b.requests["OPLOCK_BREAK"] == 0
        for h in (f, g):
            await b.release(h)
        assert not (path / "f").exists()


async def test_a_name_that_now_leads_to_another_file_is_stale_though_our_lease_key_is_held(connect):
    """Samba refuses a lease key held on one file for another (STATUS_INVALID_PARAMETER): the open of a
    node whose name another client gave to a new file is ESTALE, as without leases, not EINVAL."""
    async with connect() as (b, d, path):
        node = await make_file(b, d, b"f", b"ours")
        f = await b.open(node, os.O_RDONLY)
        (path / "f").rename(path / "g")  # another client renames it, and makes a new f
        (path / "f").write_bytes(b"theirs")
        with pytest.raises(OSError) as e:
            await b.open(node, os.O_RDONLY)
        assert e.value.errno == errno.ESTALE
        assert bytes(await b.read(f, 0, 10)) == b"ours" and b.caching(node) is not None
        await b.release(f)


@pytest.mark.parametrize("share", ["ext4", "ext4-durable"])
@pytest.mark.parametrize("vers", ["default", "2.1"])
async def test_a_write_by_another_client_breaks_read_caching(connect, share, vers, monkeypatch):
    """Another client's write breaks our lease before it lands: the callback hears of it, caching
    ends, and each break the server waits for is acknowledged (else its open or write would wait
    35 s).  Lease v2 on SMB 3, v1 on 2.1; the other client is a connection of its own."""
    heard = []
    on_break = leases.Listener._broken
    monkeypatch.setattr(leases.Listener, "_broken", lambda self, brk: heard.append(brk) or on_break(self, brk))
    async with connect(share, vers=vers) as (b, d, path):
        async with connect(share, vers="2.1" if vers == "default" else "3.0") as (b2, _, _):
            assert b2.client is not b.client
            broken = trio.Event()
            b.on_break(lambda node: broken.set())
            node = await make_file(b, d, b"f", b"old data")
            f = await b.open(node, os.O_RDONLY)
            assert b.caching(node) is not None
            theirs, _ = await b2.lookup((await b2.lookup(b2.nodes[""], path.name.encode()))[0], b"f")
            with trio.fail_after(HANG_BOUND):
                g = await b2.open(theirs, RW)
                await b2.write(g, 0, b"new")
                await broken.wait()
                while b.requests["OPLOCK_BREAK"] < sum(brk.ack_required for brk in heard):
                    await trio.sleep(0.01)  # acknowledged by a task of its own
            assert b.caching(node) is None
            assert bytes(await b.read(f, 0, 100)) == b"new data"
            await b2.release(g)
            await b.release(f)


async def test_a_server_that_stops_answering_fails_requests_not_the_mount(lab, connect, monkeypatch):
    server = lab.server
    monkeypatch.setattr(smb_client, "IO_TIMEOUT", 1)
    async with connect() as (b, d, path):
        stopped = connection_processes(server)
        for pid in stopped:
            freeze(pid)
        try:
            with trio.fail_after(HANG_BOUND), pytest.raises(OSError) as e:
                await b.getattr(d)
            assert e.value.errno == errno.EIO and "did not answer in 1 s" in str(e.value)
            assert (await b.getattr(d)).ino == d.ino  # a new connection
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)


async def test_interrupted_requests_leave_nothing_behind(connect):
    async with connect() as (b, d, path):
        data = os.urandom(24 * MiB)
        f = await b.open(await make_file(b, d, b"f", data), os.O_RDONLY)
        with trio.move_on_after(0.005) as scope:
            await b.read(f, 0, len(data))  # three 8 MiB reads in flight, then interrupted
        assert scope.cancelled_caught
        with trio.fail_after(5):
            while b.client.conn.outstanding_requests.keys() - {leases.UNSOLICITED}:  # answered, and dropped
                await trio.sleep(0.01)
        assert bytes(await b.read(f, MiB, 10)) == data[MiB:MiB + 10]
        await b.release(f)


async def test_getattr_through_a_handle_closed_meanwhile_asks_by_name(connect):
    """getattr borrows an open handle of the node; the kernel does not wait for a release, so
    that handle may be closed before the query reaches the server (rsync's stat of its temporary
    file got EBADF): then the attributes come another way."""
    async with connect() as (b, d, path):
        node, _, f = await b.create(d, b"f", CREATE, 0o644)
        await b.write(f, 0, b"data")
        query = b._file_attributes

        async def closed_first(file):
            await b.release(file)
            return await query(file)

        b._file_attributes = closed_first
        assert (await b.getattr(node)).size == 4


@pytest.mark.parametrize("name", ["a\\b", "a:b", "a*", "a?", 'a"', "a<", "a>", "a|", "a\x01b", "a\x1f", "\x7f\x00"])
def test_a_name_smb_cannot_hold_is_refused_before_any_request(name):
    without, posix = SimpleNamespace(posix=False), SimpleNamespace(posix=True)
    with pytest.raises(OSError) as raised:
        smb.SMBBackend._child(without, SimpleNamespace(path="dir"), name.encode())
    assert raised.value.errno == errno.EINVAL
    if "\\" in name or "\0" in name:
        with pytest.raises(OSError):
            smb.SMBBackend._child(posix, SimpleNamespace(path="dir"), name.encode())
    else:  # a POSIX open takes every name but / and NUL; \\ separates our paths
        assert smb.SMBBackend._child(posix, SimpleNamespace(path="dir"), name.encode()) == f"dir\\{name}"


def test_names_smb_holds_make_paths_below_their_directory():
    without = SimpleNamespace(posix=False)
    assert smb.SMBBackend._child(without, SimpleNamespace(path="dir"), "a b-c_d.é\x7f".encode()) == "dir\\a b-c_d.é\x7f"
    assert smb.SMBBackend._child(without, SimpleNamespace(path=""), b"top") == "top"
