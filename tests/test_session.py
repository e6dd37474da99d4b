"""The protocol layer against a fake device: a SEQPACKET socket keeps message boundaries like /dev/fuse."""
import ctypes
import errno
import os
import socket
import struct
import sys
import time

import pytest
import trio

from offloadfs.fuse import abi
from offloadfs.fuse import session as session_module
from offloadfs.fuse.poll import POLL_MAX, POLL_START, Poll
from offloadfs.fuse.operations import DirEntry, Entry, Opened, Operations
from offloadfs.fuse.session import MAX_COPY_32, MAX_WRITE, ProtocolError, Session
from offloadfs.backends.base import Stat


class Device:
    """The kernel's end of the fake device."""

    def __init__(self):
        self.kernel, self.daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.unique = 0

    def send(self, opcode, body=b"", nodeid=1):
        self.unique += 2
        header = abi.in_header.pack(abi.in_header.size + len(body), opcode, self.unique, nodeid, 0, 0, 42, 0, 0)
        self.kernel.send(header + body)
        return self.unique

    async def reply(self):
        await trio.lowlevel.wait_readable(self.kernel)
        data = self.kernel.recv(1 << 21)
        length, error, unique = abi.out_header.unpack_from(data)
        assert length == len(data)
        return unique, -error, data[abi.out_header.size:]

    def init(self, minor=abi.KERNEL_MINOR_VERSION, flags=0xFFFFFFFF, flags2=0xFFFFFFFF):
        body = abi.init_in.pack(7, minor, 131072, flags) + abi.init_in_flags2.pack(flags2) + bytes(44)
        return self.send(abi.INIT, body)


async def serving(nursery, ops, **kwargs):
    dev = Device()
    session = Session(dev.daemon.fileno(), ops, **kwargs)
    nursery.start_soon(session.serve)
    dev.init()
    unique, err, body = await dev.reply()
    assert err == 0
    return dev, session, body


class Slow(Operations):
    def __init__(self):
        self.cancelled = False
        self.copy_args = None

    async def copy_file_range(self, ctx, nodeid_in, fh_in, off_in, nodeid_out, fh_out, off_out, length, flags):
        self.copy_args = (nodeid_in, fh_in, off_in, nodeid_out, fh_out, off_out, length, flags)
        if length == 7:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled = True
                raise
        return 5 << 30  # over 4 GiB: only opcode 53 can say so

    async def lookup(self, ctx, parent, name):
        if name == b"negative":
            return Entry(0, None, entry_timeout=2.5)
        if name != b"a":
            raise FileNotFoundError(errno.ENOENT, "no")
        return Entry(7, Stat(ino=99, mode=0o100644, size=3))

    async def readdir(self, ctx, nodeid, fh, offset):
        return [DirEntry(b"name%03d" % i, i + 10, 8, i + 1) for i in range(offset, 100)]

    async def readdirplus(self, ctx, nodeid, fh, offset, fits):
        self.looked_up = []
        out = []
        for d in await self.readdir(ctx, nodeid, fh, offset):
            if not fits(d.name):
                break
            self.looked_up.append(d.name)
            out.append((d, Entry(d.ino + 1000, Stat(ino=d.ino, mode=0o100644)) if d.ino % 2 else None))
        return out

    async def getxattr(self, ctx, nodeid, name):
        return b"value"


def copy_body(length):
    return abi.copy_file_range_in.pack(1, 0, 3, 2, 0, length, 0)


async def test_init_grants_only_what_the_kernel_offers():
    async with trio.open_nursery() as nursery:
        dev, session, body = await serving(nursery, Operations(), passthrough=True)
        fields = abi.init_out.unpack_from(body)
        major, minor, _, flags, _, _, max_write, _, max_pages, _, flags2, stack_depth, _ = fields
        assert (major, minor, max_write, max_pages) == (7, abi.KERNEL_MINOR_VERSION, MAX_WRITE, 256)
        granted = flags | flags2 << 32
        assert granted & abi.PASSTHROUGH and stack_depth == 1
        assert not granted & abi.WRITEBACK_CACHE  # not asked for
        assert session.conn.passthrough
        nursery.cancel_scope.cancel()


async def test_init_without_passthrough_offer():
    dev = Device()
    session = Session(dev.daemon.fileno(), Operations(), passthrough=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.serve)
        dev.init(flags2=0)
        _, err, body = await dev.reply()
        assert err == 0 and not session.conn.passthrough
        assert abi.init_out.unpack_from(body)[10] == 0
        nursery.cancel_scope.cancel()


async def test_old_kernel_is_refused():
    dev = Device()
    session = Session(dev.daemon.fileno(), Operations())
    dev.init(minor=30)
    with pytest.raises(ProtocolError):
        await session.serve()
    _, err, _ = await dev.reply()
    assert err == errno.EPROTO


async def test_interrupt_cancels_the_request_and_answers_eintr():
    ops = Slow()
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, ops)
        unique = dev.send(abi.COPY_FILE_RANGE_64, copy_body(7))
        await trio.sleep(0.05)
        dev.send(abi.INTERRUPT, abi.interrupt_in.pack(unique))
        with trio.fail_after(2):
            got, err, _ = await dev.reply()
        assert (got, err) == (unique, errno.EINTR)
        assert ops.cancelled
        nursery.cancel_scope.cancel()


async def test_copy_replies_in_64_bits_and_caps_opcode_47():
    ops = Slow()
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, ops)
        dev.send(abi.COPY_FILE_RANGE_64, copy_body(6 << 30))
        _, err, body = await dev.reply()
        assert err == 0 and abi.copy_file_range_out.unpack(body)[0] == 5 << 30
        assert ops.copy_args == (1, 1, 0, 3, 2, 0, 6 << 30, 0)
        dev.send(abi.COPY_FILE_RANGE, copy_body(6 << 30))
        await dev.reply()
        assert ops.copy_args[6] == MAX_COPY_32
        nursery.cancel_scope.cancel()


async def test_unknown_and_unimplemented_requests():
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, Operations())
        for opcode, expected in ((abi.STATX, errno.ENOSYS), (63, errno.ENOSYS),
                                 (abi.IOCTL, errno.ENOTTY), (abi.GETATTR, errno.ENOSYS)):
            dev.send(opcode, bytes(64))
            _, err, _ = await dev.reply()
            assert err == expected, opcode
        nursery.cancel_scope.cancel()


async def test_lookup_entry_and_error():
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, Slow())
        dev.send(abi.LOOKUP, b"a\0")
        _, err, body = await dev.reply()
        fields = abi.entry_out.unpack(body)
        assert err == 0 and fields[0] == 7 and fields[6] == 99 and fields[7] == 3
        assert fields[15] == 0o100644
        dev.send(abi.LOOKUP, b"b\0")
        _, err, body = await dev.reply()
        assert err == errno.ENOENT and body == b""
        dev.send(abi.LOOKUP, b"negative\0")  # nodeid 0: the kernel keeps "no such name" for a while
        _, err, body = await dev.reply()
        fields = abi.entry_out.unpack(body)
        assert err == 0 and fields[0] == 0 and (fields[2], fields[4]) == (2, 500_000_000)
        nursery.cancel_scope.cancel()


async def test_readdirplus_packs_only_what_fits():
    """An entry looked up is a reference the kernel must receive: none beyond the buffer."""
    async with trio.open_nursery() as nursery:
        ops = Slow()
        dev, _, _ = await serving(nursery, ops)
        dev.send(abi.READDIRPLUS, abi.read_in.pack(1, 0, 500, 0, 0, 0, 0))
        _, err, body = await dev.reply()
        record = abi.entry_out.size + 32  # a dirent of a 7-byte name, padded
        assert err == 0 and len(body) == 3 * record and ops.looked_up == [b"name000", b"name001", b"name002"]
        nodeids = [abi.entry_out.unpack_from(body, i * record)[0] for i in range(3)]
        assert nodeids == [0, 1011, 0]  # None: a zero entry
        nursery.cancel_scope.cancel()


async def test_readdir_fills_the_buffer_and_resumes():
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, Slow())
        names, offset = [], 0
        while True:
            dev.send(abi.READDIR, abi.read_in.pack(1, offset, 200, 0, 0, 0, 0))
            _, err, body = await dev.reply()
            assert err == 0 and len(body) <= 200
            if not body:
                break
            pos = 0
            while pos < len(body):
                ino, offset, namelen, dtype = abi.dirent.unpack_from(body, pos)
                names.append(body[pos + 24:pos + 24 + namelen])
                pos += (24 + namelen + 7) & ~7
        assert names == [b"name%03d" % i for i in range(100)]
        nursery.cancel_scope.cancel()


async def test_getxattr_size_probe_and_erange():
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, Slow())
        dev.send(abi.GETXATTR, abi.getxattr_in.pack(0, 0) + b"user.x\0")
        _, err, body = await dev.reply()
        assert err == 0 and abi.getxattr_out.unpack(body)[0] == 5
        dev.send(abi.GETXATTR, abi.getxattr_in.pack(3, 0) + b"user.x\0")
        _, err, _ = await dev.reply()
        assert err == errno.ERANGE
        dev.send(abi.GETXATTR, abi.getxattr_in.pack(64, 0) + b"user.x\0")
        _, err, body = await dev.reply()
        assert (err, body) == (0, b"value")
        nursery.cancel_scope.cancel()


class UserXattrsOnly(Slow):
    def __init__(self):
        super().__init__()
        self.asked = []

    def no_such_xattr(self, nodeid, name):
        return not name.startswith(b"user.")

    async def getxattr(self, ctx, nodeid, name):
        self.asked.append(name)
        return b"value"


async def test_getxattr_of_a_name_the_node_cannot_hold_is_answered_at_once():
    async with trio.open_nursery() as nursery:
        ops = UserXattrsOnly()
        dev, _, _ = await serving(nursery, ops)
        dev.send(abi.GETXATTR, abi.getxattr_in.pack(255, 0) + b"security.selinux\0")
        _, err, _ = await dev.reply()
        dev.send(abi.GETXATTR, abi.getxattr_in.pack(255, 0) + b"user.x\0")
        _, err2, body = await dev.reply()
        assert (err, err2, body, ops.asked) == (errno.EOPNOTSUPP, 0, b"value", [b"user.x"])
        nursery.cancel_scope.cancel()


def test_struct_layouts_match_fuse_h():
    assert abi.in_header.size == 40
    assert abi.entry_out.size == 128
    assert abi.init_out.size == 64
    assert abi.copy_file_range_in.size == 56
    assert abi.copy_file_range_out.size == 8
    assert abi.backing_map.size == 16
    # _IOW(229, 1, 16 bytes) and _IOW(229, 2, 4 bytes)
    assert abi.DEV_IOC_BACKING_OPEN == (1 << 30) | (16 << 16) | (229 << 8) | 1
    assert abi.DEV_IOC_BACKING_CLOSE == (1 << 30) | (4 << 16) | (229 << 8) | 2
    assert struct.calcsize("=Q") == 8 and os.sep == "/"


async def test_notifications_carry_their_code_and_no_unique():
    async with trio.open_nursery() as nursery:
        dev, session, _ = await serving(nursery, Operations())
        session.notify_inval_inode(7, 4096, -1)
        unique, err, body = await dev.reply()
        assert (unique, -err) == (0, abi.NOTIFY_INVAL_INODE)
        assert abi.notify_inval_inode_out.unpack(body) == (7, 4096, -1)
        session.notify_inval_entry(1, b"name")
        unique, err, body = await dev.reply()
        assert (unique, -err) == (0, abi.NOTIFY_INVAL_ENTRY)
        assert body == abi.notify_inval_entry_out.pack(1, 4, 0) + b"name\0"
        nursery.cancel_scope.cancel()


class Backed(Operations):
    """Every open hands over a backing fd of its own, as the local backend does."""

    def __init__(self):
        self.fhs = iter(range(1, 100))

    async def open(self, ctx, nodeid, flags, kill_suidgid):
        return Opened(next(self.fhs), backing_fd=100 + nodeid, keep_cache=True)

    async def release(self, ctx, nodeid, fh):
        pass


async def test_passthrough_handles_of_a_node_share_one_backing_id(monkeypatch):
    """The kernel fails an open whose backing file differs from the one the inode's open handles
    use; /dev/fuse shows no backing ids, so the ioctls are recorded here instead."""
    ioctls = []

    def ioctl(fd, request, arg, mutate):
        ioctls.append((request, bytes(arg)))
        return len(ioctls)  # the backing id

    monkeypatch.setattr(session_module.fcntl, "ioctl", ioctl)
    async with trio.open_nursery() as nursery:
        dev, session, _ = await serving(nursery, Backed(), passthrough=True)

        async def request(opcode, body, nodeid):
            dev.send(opcode, body, nodeid)
            _, err, out = await dev.reply()
            assert err == 0
            return out

        async def open_(nodeid):
            fh, flags, backing_id = abi.open_out.unpack(await request(abi.OPEN, abi.open_in.pack(0, 0), nodeid))
            assert flags == abi.FOPEN_PASSTHROUGH
            return fh, backing_id

        async def release(nodeid, fh):
            await request(abi.RELEASE, abi.release_in.pack(fh, 0, 0, 0), nodeid)

        (a, first), (b, second), (c, other) = await open_(5), await open_(5), await open_(6)
        assert first == second != other
        assert [r for r, _ in ioctls] == [abi.DEV_IOC_BACKING_OPEN] * 2
        await release(5, a)
        assert len(ioctls) == 2  # b still uses it
        await release(5, b)
        assert ioctls[-1] == (abi.DEV_IOC_BACKING_CLOSE, first.to_bytes(4, "little"))
        (d, again), _ = await open_(5), await release(6, c)
        assert again not in (first, other)  # a fresh id: the last release gave the old one back
        assert ioctls[-1] == (abi.DEV_IOC_BACKING_CLOSE, other.to_bytes(4, "little"))
        nursery.cancel_scope.cancel()


class Writes(Operations):
    """Records the offsets of the WRITEs it takes, by node, the first of each pair taking a while."""

    def __init__(self):
        self.order = {}

    async def write(self, ctx, nodeid, fh, offset, data, kill_suidgid):
        if offset % 2 == 0:
            await trio.sleep(0.001)
        self.order.setdefault(nodeid, []).append(offset)
        return len(data)


async def test_writes_to_one_file_are_taken_in_the_order_the_kernel_sent_them():
    """The scheduler runs the tasks it starts in any order: a copy recognised in written data
    (recognise.py) follows a file's bytes in the order the program wrote them."""
    ops = Writes()
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, ops)
        sent = {2: [], 3: []}
        for offset in range(40):
            for nodeid in sent:
                dev.send(abi.WRITE, abi.write_in.pack(0, offset, 1, 0, 0, 0, 0) + b"x", nodeid=nodeid)
                sent[nodeid].append(offset)
        with trio.fail_after(5):
            for _ in range(80):
                _, err, _ = await dev.reply()
                assert err == 0
        assert ops.order == sent
        nursery.cancel_scope.cancel()


class WritesNow(Writes):
    """Takes a WRITE at once (write_now) where its data begins with b"now"; the others as requests,
    which wait for ``go``."""

    def __init__(self):
        super().__init__()
        self.go = trio.Event()

    def write_now(self, nodeid, fh, offset, data, kill_suidgid):
        if bytes(data[:3]) != b"now":
            return None
        self.order.setdefault(nodeid, []).append(offset)
        return len(data)

    async def write(self, ctx, nodeid, fh, offset, data, kill_suidgid):
        await self.go.wait()
        return await super().write(ctx, nodeid, fh, offset, data, kill_suidgid)


async def test_a_write_taken_at_once_waits_for_the_writes_to_its_file_before_it():
    """tar x makes a WRITE of 5 KiB on average: one that only joins data the filesystem holds is
    answered without a task of its own, but never ahead of an earlier WRITE to the same file."""
    ops = WritesNow()
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, ops)
        write = abi.write_in.pack(0, 0, 3, 0, 0, 0, 0)
        slow = dev.send(abi.WRITE, write + b"old", nodeid=2)
        dev.send(abi.WRITE, abi.write_in.pack(0, 1, 3, 0, 0, 0, 0) + b"now", nodeid=2)
        now = dev.send(abi.WRITE, abi.write_in.pack(0, 1, 3, 0, 0, 0, 0) + b"now", nodeid=3)
        with trio.fail_after(5):
            unique, err, body = await dev.reply()
            assert (unique, err, abi.write_out.unpack(body)[0]) == (now, 0, 3)
            assert ops.order == {3: [1]}
            ops.go.set()
            replies = [(await dev.reply())[0] for _ in range(2)]
        assert replies[0] == slow and ops.order == {2: [0, 1], 3: [1]}
        nursery.cancel_scope.cancel()


class Cached(Operations):
    """Has node 2's attributes and its directory's names at hand; a request that reaches a task
    waits for ``go``."""

    def __init__(self):
        self.go = trio.Event()
        self.asked = []
        self.released = []

    def getattr_now(self, ctx, nodeid, fh):
        return (Stat(ino=nodeid, mode=0o40755, nlink=2), 1.5) if nodeid == 2 else None

    async def getattr(self, ctx, nodeid, fh):
        self.asked.append((abi.GETATTR, nodeid))
        await self.go.wait()
        return Stat(ino=nodeid, mode=0o40755, nlink=2), 1.5

    def opendir_now(self, ctx, nodeid, flags):
        return Opened(7, keep_cache=True, cache_dir=True) if nodeid == 2 else None

    async def opendir(self, ctx, nodeid, flags):
        self.asked.append((abi.OPENDIR, nodeid))
        await self.go.wait()
        return Opened(8)

    def releasedir(self, ctx, nodeid, fh):
        self.released.append(fh)


async def test_requests_with_answers_at_hand_are_answered_without_a_task():
    """`find` after attr_timeout asks for each directory's attributes, opens and closes it: with
    the answers at hand, a task for each request cost about as much as the answer."""
    ops = Cached()
    async with trio.open_nursery() as nursery:
        dev, _, _ = await serving(nursery, ops)
        dev.send(abi.GETATTR, abi.getattr_in.pack(0, 0, 0), nodeid=3)
        dev.send(abi.OPENDIR, abi.open_in.pack(0, 0), nodeid=3)
        getattr_ = dev.send(abi.GETATTR, abi.getattr_in.pack(0, 0, 0), nodeid=2)
        opendir = dev.send(abi.OPENDIR, abi.open_in.pack(0, 0), nodeid=2)
        releasedir = dev.send(abi.RELEASEDIR, abi.release_in.pack(7, 0, 0, 0), nodeid=2)
        with trio.fail_after(5):
            replies = {unique: (err, body) for unique, err, body in [await dev.reply() for _ in range(3)]}
            assert sorted(ops.asked) == [(abi.GETATTR, 3), (abi.OPENDIR, 3)]
            assert replies[getattr_][0] == replies[opendir][0] == replies[releasedir][0] == 0
            sec, nsec, _, ino, *_ = abi.attr_out.unpack(replies[getattr_][1])
            assert (sec, nsec, ino) == (1, 500_000_000, 2)
            assert abi.open_out.unpack(replies[opendir][1])[:2] == (7, abi.FOPEN_KEEP_CACHE | abi.FOPEN_CACHE_DIR)
            assert ops.released == [7]
            ops.go.set()
            assert [(await dev.reply())[1] for _ in range(2)] == [0, 0]
        nursery.cancel_scope.cancel()


def test_the_window_opens_while_requests_come_quickly_and_closes_while_they_do_not():
    poll = Poll(-1)
    assert poll.window == 0.0
    poll.slept(5e-6)
    assert poll.window == POLL_START
    for _ in range(10):
        poll.slept(5e-6)
    assert poll.window == POLL_MAX
    steps = 0
    while poll.window:
        poll.slept(1e-3)
        steps += 1
    assert 2 <= steps <= 5


def test_a_window_that_passed_with_nothing_shrinks_even_when_the_request_came_soon_after():
    """With every CPU busy, the program we wait for may run only once we stop reading: a short
    sleep after a window that caught nothing must not open it wider."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    poll = Poll(a.fileno())
    poll.useful = True
    poll.window = POLL_MAX
    assert poll.read(100, lambda: True) is None and poll.missed
    poll.slept(5e-6)
    assert poll.window == POLL_MAX / 2 and not poll.missed
    b.send(b"x")
    assert poll.read(100, lambda: True) == b"x" and poll.window == POLL_MAX / 2  # there at once
    a.close(), b.close()


def test_a_closed_window_or_a_busy_daemon_reads_once():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    poll = Poll(a.fileno())
    asked = []
    assert poll.read(100, lambda: asked.append(1) or True) is None and asked == []  # closed: not asked
    poll.window = 1.0
    assert poll.read(100, lambda: False) is None  # not idle: no second read
    b.send(b"x")
    assert poll.read(100, lambda: False) == b"x" and poll.caught == 0
    a.close(), b.close()


KERNEL = """
import socket, struct, sys
from offloadfs.fuse import abi
kernel = socket.socket(fileno=int(sys.argv[1]))
body = abi.write_in.pack(0, 0, 3, 0, 0, 0, 0) + b"now"
for unique in range(2, 2 + 2 * int(sys.argv[2]), 2):
    kernel.send(abi.in_header.pack(abi.in_header.size + len(body), abi.WRITE, unique, 2, 0, 0, 42, 0, 0) + body)
    assert abi.out_header.unpack_from(kernel.recv(4096))[1:] == (0, unique)
"""


async def test_a_program_writing_one_small_record_after_another_is_served_in_order():
    """tar x sends its next WRITE some microseconds after the reply to the last: the reader, with
    nothing else to do, reads again for it instead of sleeping in epoll (poll.py), and every one
    is served, in order, whichever way it was read."""
    ops = WritesNow()
    count = 400
    async with trio.open_nursery() as nursery:
        dev, session, _ = await serving(nursery, ops)
        dev.unique = 2 * count + 2
        # How many requests the reader catches depends on the CPUs being free: the catch itself is
        # tested with a timer (below), the count is a benchmark's, not an assert's.
        with trio.fail_after(60):
            done = await trio.run_process([sys.executable, "-c", KERNEL, str(dev.kernel.fileno()),
                                           str(count)], pass_fds=[dev.kernel.fileno()], check=False)
        assert done.returncode == 0
        assert ops.order[2] == [0] * count
        nursery.cancel_scope.cancel()


def timer_fd(after):
    """A timerfd (non-blocking) that becomes readable ``after`` seconds from now: the kernel makes it
    readable, with no process of ours to schedule."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.timerfd_create(time.CLOCK_MONOTONIC, os.O_NONBLOCK)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    spec = (ctypes.c_long * 4)(0, 0, int(after), int(after % 1 * 1e9))
    assert libc.timerfd_settime(fd, 0, spec, None) == 0
    return fd


def test_a_request_that_comes_within_the_window_is_caught_and_widens_it():
    fd = timer_fd(0.002)
    try:
        poll = Poll(fd)
        poll.useful = True
        poll.window = 1.0  # (past POLL_MAX only to wait for the timer whatever the machine's load)
        assert len(poll.read(8, lambda: True)) == 8
        assert poll.caught == 1 and not poll.missed and poll.window == POLL_MAX
    finally:
        os.close(fd)
