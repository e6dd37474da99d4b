"""Writes answered before the server has them (offloadfs/writebehind.py)."""
import errno

import pytest
import trio
import trio.testing

from offloadfs import writebehind
from offloadfs.writebehind import WriteBehind


class _Inode:
    behind = None
    stat = None  # no attributes known: the file was empty


class _Server:
    """A send() that takes ``delay`` seconds, records what it wrote in order, and fails where told."""

    def __init__(self, delay=1.0):
        self.delay = delay
        self.done = []
        self.started = []
        self.fail_at = None
        self.in_flight = 0
        self.most = 0
        self.size = 0
        self.cuts = []

    async def send(self, h, offset, data):
        self.started.append(offset)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await trio.sleep(self.delay)
            if offset == self.fail_at:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.done.append((offset, bytes(data)))
            self.size = max(self.size, offset + len(data))
        finally:
            self.in_flight -= 1

    async def cut(self, inode, h, size):
        self.cuts.append(size)
        self.size = min(self.size, size)

    def behind(self):
        return WriteBehind(self.send, self.cut, lambda inode: "f")


def run(fn):
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_writes_are_answered_before_the_server_has_them_and_settle_waits():
    async def body():
        server, inode = _Server(), _Inode()
        wb = server.behind()
        start = trio.current_time()
        for i in range(4):
            await wb.write(inode, None, i << 20, bytes(1 << 20))
        assert trio.current_time() == start and server.done == []
        assert wb.end(inode) == 4 << 20
        await wb.settle(inode)
        assert sorted(o for o, _ in server.done) == [0, 1 << 20, 2 << 20, 3 << 20] and wb.end(inode) == 0
        assert server.most == 4
    run(body)


class _Handle:
    """An open file description."""


def opened(wb, inode):
    """A handle of ``inode`` opened for writing."""
    h = _Handle()
    wb.opened(inode, h)
    return h


def raises_enospc(call, *args, **kwargs):
    with pytest.raises(OSError) as e:
        call(*args, **kwargs)
    assert e.value.errno == errno.ENOSPC


def test_a_failed_write_fails_the_writes_of_its_handle_until_an_fsync_hears_it():
    async def body():
        server, inode = _Server(), _Inode()
        server.fail_at = 0
        wb = server.behind()
        h = opened(wb, inode)
        await wb.write(inode, h, 0, b"x" * 10)
        await wb.settle(inode)  # a read, say: waits, reports nothing
        with pytest.raises(OSError) as e:
            await wb.write(inode, h, 10, b"y")
        assert e.value.errno == errno.ENOSPC
        raises_enospc(wb.report, inode, h)  # a close
        raises_enospc(wb.report, inode, h)  # another close of the description: FUSE cannot tell whose
        raises_enospc(wb.report, inode, h, clear=True)  # an fsync
        wb.report(inode, h, clear=True)  # heard once
        await wb.write(inode, h, 10, b"y")
    run(body)


def test_a_failed_write_is_reported_to_each_handle_open_for_writing_when_it_failed():
    """As Linux reports writeback errors (lib/errseq.c): to each open file description, once; a
    read-only one (never opened here) hears none, and one opened after the failure neither."""
    async def body():
        server, inode = _Server(), _Inode()
        server.fail_at = 0
        wb = server.behind()
        writer, other, reader = opened(wb, inode), opened(wb, inode), _Handle()
        await wb.write(inode, writer, 0, b"x" * 10)
        await wb.settle(inode)
        late = opened(wb, inode)
        wb.report(inode, reader)
        wb.report(inode, late)
        await wb.write(inode, late, 10, b"y")
        raises_enospc(wb.report, inode, other, clear=True)
        wb.closed(inode, other)
        raises_enospc(wb.report, inode, writer, clear=True)
        wb.report(inode, writer, clear=True)
    run(body)


def test_a_failure_after_one_heard_is_heard_again_and_a_closed_handle_hears_none():
    async def body():
        server, inode = _Server(), _Inode()
        wb = server.behind()
        h, gone = opened(wb, inode), opened(wb, inode)
        wb.closed(inode, gone)
        for offset in (0, 10):
            server.fail_at = offset
            await wb.write(inode, h, offset, b"x" * 10)
            await wb.settle(inode)
            raises_enospc(wb.report, inode, h, clear=True)
        assert wb.unheard(inode, gone) is None
    run(body)


def test_writes_of_one_range_are_never_in_flight_at_once():
    async def body():
        server, inode = _Server(), _Inode()
        wb = server.behind()
        await wb.write(inode, None, 0, b"a" * 100)
        await wb.write(inode, None, 50, b"b" * 100)  # waits for the first
        await wb.settle(inode)
        assert server.most == 1 and [d[:1] for _, d in server.done] == [b"a", b"b"]
    run(body)


def test_a_file_and_a_mount_have_bounded_bytes_in_flight():
    async def body():
        server = _Server()
        wb = server.behind()
        inodes = [_Inode() for _ in range(8)]
        async with trio.open_nursery() as nursery:
            for n, inode in enumerate(inodes):
                async def writer(inode=inode):
                    for i in range(16):
                        await wb.write(inode, None, i << 20, bytes(1 << 20))
                nursery.start_soon(writer)
        for inode in inodes:
            await wb.settle(inode)
        assert server.most == writebehind.MOUNT_WINDOW >> 20
        assert len(server.done) == 8 * 16
    run(body)


@pytest.mark.parametrize("size_before", [0, 4 << 20])
def test_writes_that_landed_past_a_failed_one_are_cut_off_where_they_made_the_file_longer(size_before):
    """A file that ends past data never written would pass for a whole one with a hole: writes side by
    side may land beyond one the server refused (a full disk takes the later one first)."""
    async def body():
        server, inode = _Server(), _Inode()
        server.fail_at = 1 << 20
        server.size = size_before
        inode.stat = type("Stat", (), {"size": size_before})()
        wb = server.behind()
        h = opened(wb, inode)
        for i in range(3):
            await wb.write(inode, h, i << 20, bytes(1 << 20))
        await wb.settle(inode)
        raises_enospc(wb.report, inode, h, clear=True)
        assert server.size == max(size_before, 1 << 20)
    run(body)


def test_a_file_cut_here_is_cut_back_past_a_failed_write_whatever_its_old_attributes_say():
    """dd over a longer file (open with O_TRUNC): the attributes held until asked again still give the
    old size, which must not spare what landed past a failed write."""
    async def body():
        server, inode = _Server(), _Inode()
        server.fail_at = 1 << 20
        inode.stat = type("Stat", (), {"size": 8 << 20})()
        wb = server.behind()
        wb.truncated(inode, 0)
        h = opened(wb, inode)
        for i in range(3):
            await wb.write(inode, h, i << 20, bytes(1 << 20))
        await wb.settle(inode)
        raises_enospc(wb.report, inode, h, clear=True)
        assert server.size == 1 << 20
    run(body)
