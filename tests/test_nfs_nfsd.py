"""The NFS backend against Linux nfsd 6.1 in a qemu guest (xfs with reflink): the real offloads.

nfsd answers COPY synchronously up to 4 MiB a call and asynchronously with
CB_OFFLOAD on our back channel; CLONE shares extents; SEEK and READ_PLUS work.
Booting the guest takes ~10-20 s under TCG, once a run (the root conftest's nfsd_reflink_lab).
"""
import errno
import itertools
import os
import shutil

import pytest
import trio

from backendkit import make, mounted

from offloadfs.backends.nfs import ops
from offloadfs.planner import Endpoint, Planner
from offloadfs.stats import Stats

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="nfsd labs need root (namespaces, taps)"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
    pytest.mark.skipif(shutil.which("mkfs.xfs") is None, reason="xfsprogs is not installed"),
]

_dirs = itertools.count()


@pytest.fixture
def guest(nfsd_reflink_lab):
    return nfsd_reflink_lab.guest


@pytest.fixture
def url(guest):
    """The URL of a fresh directory in the guest's export."""
    name = f"t{next(_dirs)}".encode()

    async def make():
        async with mounted(f"nfs://{guest.host}/export") as (b, root):
            await b.mkdir(root, name, 0o777)

    trio.run(make)
    return f"nfs://{guest.host}/export/{name.decode()}"


async def test_synchronous_copy(url):
    data = os.urandom(1 << 20)
    async with mounted(url) as (b, root):
        _, src = await make(b, root, b"src", data)
        dst_node, dst = await make(b, root, b"dst")
        assert await b.server_copy(src, 4096, dst, 0, len(data) - 4096) == len(data) - 4096
        assert await b.read(dst, 0, 2 << 20) == data[4096:]
        for f in (src, dst):
            await b.release(f)


@pytest.mark.parametrize("per_call, size, ends", [
    (64 << 20, 16 << 20, [16 << 20]),  # one asynchronous COPY
    (8 << 20, (24 << 20) + 1000, [8 << 20] * 3),  # three side by side, the last 1000 bytes synchronous
])
async def test_asynchronous_copies_end_with_cb_offload(url, monkeypatch, per_call, size, ends):
    from offloadfs.backends.nfs import backend
    monkeypatch.setattr(backend, "COPY_PER_CALL", per_call)
    data = os.urandom(size)
    async with mounted(url) as (b, root):
        _, src = await make(b, root, b"src", data)
        _, dst = await make(b, root, b"dst")
        seen = []
        done = b.client._offload_done
        b.client._offload_done = lambda sid, outcome: (seen.append(outcome), done(sid, outcome))
        assert await b.server_copy(src, 0, dst, 0, len(data)) == len(data)
        assert [o.result.count for o in seen] == ends
        assert await b.read(dst, 0, len(data) + 1) == data
        assert not b.client.offloads
        for f in (src, dst):
            await b.release(f)


async def test_copy_without_callback_falls_back_to_synchronous(url):
    """nfsd answers OFFLOAD_STATUS with BAD_STATEID once done; without CB_OFFLOAD the count is unknown."""
    data = os.urandom(1 << 20) * 10
    async with mounted(url) as (b, root):
        src_node, src = await make(b, root, b"src", data)
        dst_node, dst = await make(b, root, b"dst")
        b.client._offload_done = lambda sid, outcome: None
        with trio.fail_after(30):
            n = await b.server_copy(src, 0, dst, 0, len(data))
        assert 0 < n <= len(data) and not b.client.async_copies
        stats = Stats("/mnt", {"s": url})
        planner = Planner(stats)
        b.client.unsupported.add(ops.OP_CLONE)  # leave the copy to COPY
        n = await planner.copy(Endpoint(b, src_node, src, "src"), 0, Endpoint(b, dst_node, dst, "dst"), 0, len(data))
        assert n == len(data) and stats.copy_bytes["server_copy"] == len(data)
        assert await b.read(dst, 0, len(data)) == data
        for f in (src, dst):
            await b.release(f)


async def test_clone_shares_and_then_separates(url):
    data = os.urandom(3 << 20)
    async with mounted(url) as (b, root):
        _, src = await make(b, root, b"src", data)
        clone_node, clone = await make(b, root, b"clone")
        assert await b.clone_range(src, 0, clone, 0, len(data)) == len(data)
        assert (await b.getattr(clone_node)).size == len(data)
        await b.write(clone, 0, b"changed")
        assert await b.read(src, 0, 7) == data[:7]
        assert await b.read(clone, 0, 7) == b"changed"
        for f in (src, clone):
            await b.release(f)


async def test_planner_clones_between_two_sources_on_one_server(url):
    data = os.urandom(2 << 20)
    async with mounted(url) as (b, root):
        await b.mkdir(root, b"a", 0o755)
        await b.mkdir(root, b"b", 0o755)
    async with mounted(url + "/a") as (a, a_root), mounted(url + "/b") as (b, b_root):
        assert a.shares_server_with(b) and a.client is b.client
        src_node, src = await make(a, a_root, b"src", data)
        dst_node, dst = await make(b, b_root, b"dst")
        stats = Stats("/mnt", {"a": url + "/a", "b": url + "/b"})
        n = await Planner(stats).copy(Endpoint(a, src_node, src, "a/src"), 0, Endpoint(b, dst_node, dst, "b/dst"),
                                      0, 1 << 30)
        assert n == len(data)
        assert stats.copy_bytes["clone"] == len(data)
        assert await b.read(dst, 0, len(data)) == data
        await a.release(src)
        await b.release(dst)


async def test_holes_through_seek_read_plus_and_deallocate(url):
    data = os.urandom(1 << 20)
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"sparse")
        await b.write(f, 4 << 20, data)
        await b.fsync(f, False)
        assert await b.seek(f, 0, 3) == 4 << 20
        assert await b.seek(f, 4 << 20, 4) == 5 << 20
        assert await b.read(f, 0, 5 << 20) == bytes(4 << 20) + data
        assert ops.OP_READ_PLUS not in b.client.unsupported
        await b.allocate(f, 3, (4 << 20) + 8192, 8192)
        assert await b.seek(f, 4 << 20, 4) == (4 << 20) + 8192
        assert await b.read(f, (4 << 20) + 8192, 8192) == bytes(8192)
        await b.release(f)


async def test_unstable_writes_are_committed_and_seen_by_another_client(url, guest):
    data = os.urandom(3 << 20)
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f")
        await b.write(f, 0, data)
        assert f.dirty_bytes == len(data)
        await b.flush(f)
        assert not f.dirty
        await b.release(f)
    async with mounted(url, minorversion="1") as (b, root):
        node, _ = await b.lookup(root, b"f")
        f = await b.open(node, os.O_RDONLY)
        assert await b.read(f, 0, len(data)) == data
        await b.release(f)


async def test_user_extended_attributes(url):
    async with mounted(url) as (b, root):
        node, f = await make(b, root, b"f")
        await b.setxattr(node, b"user.colour", b"blue", 0)
        assert await b.getxattr(node, b"user.colour") == b"blue"
        assert await b.listxattr(node) == [b"user.colour"]
        with pytest.raises(FileExistsError):
            await b.setxattr(node, b"user.colour", b"red", os.XATTR_CREATE)
        await b.removexattr(node, b"user.colour")
        with pytest.raises(OSError) as e:
            await b.getxattr(node, b"user.colour")
        assert e.value.errno == errno.ENODATA
        with pytest.raises(OSError) as e:
            await b.getxattr(node, b"security.capability")  # asked before every write: no round trip
        assert e.value.errno == errno.EOPNOTSUPP
        with pytest.raises(OSError) as e:
            await b.setxattr(node, b"trusted.x", b"1", 0)
        assert e.value.errno == errno.EOPNOTSUPP
        await b.release(f)
