"""The request loop: read requests from /dev/fuse, run each as a trio task, reply.

One reader task owns the device.  Every request except FORGET and INTERRUPT
runs in its own task under its own cancel scope, so a slow copy never holds
up a stat, and FUSE_INTERRUPT can cancel exactly the request it names: a
killed ``cp`` gets EINTR and dies instead of waiting for the copy to end.
"""
import collections
import errno
import fcntl
import logging
import os
import stat
import time
from dataclasses import dataclass

import trio

from . import abi
from .poll import Poll
from .operations import NOW, ConnInfo, Ctx, Entry, Operations, SetAttr

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20
MAX_PAGES = 256
MAX_BACKGROUND = 64
BURST = 16  # queued requests read in a row before the reader lets their tasks run
READ_BUFFER = max(abi.MIN_READ_BUFFER, MAX_WRITE + 4096)  # the largest WRITE and its headers
# Copies arriving as opcode 47 answer in a u32; the kernel never asks for more.
MAX_COPY_32 = 0xFFFFF000


class ProtocolError(Exception):
    """The kernel offered something this layer cannot speak."""


def _name(body, start=0):
    end = body.index(b"\0", start)
    return bytes(body[start:end]), end + 1


def _write_args(body):
    """fh, offset, data, kill_suidgid of a WRITE."""
    fh, offset, size, write_flags, _, _, _ = abi.write_in.unpack_from(body)
    data = body[abi.write_in.size:abi.write_in.size + size]
    return fh, offset, data, bool(write_flags & abi.FUSE_WRITE_KILL_SUIDGID)


def pack_attr(a):
    return (a.ino, a.size, a.blocks,
            a.atime_ns // 1_000_000_000, a.mtime_ns // 1_000_000_000, a.ctime_ns // 1_000_000_000,
            a.atime_ns % 1_000_000_000, a.mtime_ns % 1_000_000_000, a.ctime_ns % 1_000_000_000,
            a.mode, a.nlink, a.uid, a.gid, a.rdev, a.blksize, 0)


def _split_timeout(t):
    sec = int(t)
    return sec, int((t - sec) * 1e9)


def pack_entry(e: Entry):
    es, ens = _split_timeout(e.entry_timeout)
    as_, ans = _split_timeout(e.attr_timeout)
    attr = pack_attr(e.attr) if e.attr is not None else (0,) * 16
    return abi.entry_out.pack(e.nodeid, e.generation, es, as_, ens, ans, *attr)


PADS = [b"\0" * (-(abi.dirent.size + n) % 8) for n in range(8)]  # by len(name) % 8
NO_ENTRY = bytes(abi.entry_out.size)  # a READDIRPLUS record that carries a name alone


def pack_dirent(name, ino, dtype, next_offset):
    return abi.dirent.pack(ino, next_offset, len(name), dtype) + name + PADS[len(name) % 8]


@dataclass(slots=True)
class _Backing:
    """A passthrough backing id registered with the kernel, and how many open handles use it."""
    id: int
    handles: int = 0


class Session:
    """One FUSE connection: the device fd, negotiated settings, requests in flight."""

    def __init__(self, fd, ops: Operations, *, writeback_cache=False, passthrough=False, debug=False):
        self.fd = fd
        self.ops = ops
        self.want_writeback = writeback_cache
        self.want_passthrough = passthrough
        self.debug = debug
        self.conn = None
        self._inflight = {}  # unique -> CancelScope
        # nodeid -> the turns (trio.Event) of its WRITEs: they run one at a time, in the order the
        # kernel sent them, which the scheduler would not keep (a copy recognised in the data
        # written follows the file's bytes in order: recognise.py).
        self._writes = {}
        self._backing = {}  # nodeid -> its _Backing while handles use it
        self._backing_of = {}  # fh -> nodeid, for handles opened in passthrough
        self._nursery = None
        self._burst = 0  # requests read since the reader last yielded
        self._poll = Poll(fd)
        self._at_once = False  # the last request was answered without a task
        os.set_blocking(fd, False)

    # -- the loop -------------------------------------------------------

    async def serve(self, on_ready=None):
        """Negotiate INIT, then serve until unmounted.  ``on_ready`` runs once INIT is answered."""
        try:
            buf = await self._next_request()
            if buf is None:
                return
            _, opcode, unique = abi.in_header.unpack_from(buf)[:3]
            if opcode != abi.INIT:
                raise ProtocolError("the kernel's first request was not INIT")
            self._init(unique, buf[abi.in_header.size:])
            if on_ready is not None:
                on_ready()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                while (buf := await self._next_request()) is not None and self._dispatch(buf):
                    pass
                nursery.cancel_scope.cancel()
        finally:
            self.ops.destroy()

    async def _next_request(self):
        """The next request, or None once the filesystem is unmounted.

        Requests already queued are read without yielding to the tasks started for the ones
        before (every BURST-th one yields): a scheduler round per request costs as much as a
        small request's own work, and the queue is bounded by the kernel's own limits.  With
        none queued, the reader reads again for a moment before it sleeps (poll.py)."""
        self._burst += 1
        if self._burst >= BURST:
            self._burst = 0
            await trio.lowlevel.checkpoint()
        while True:
            try:
                buf = self._poll.read(READ_BUFFER, self._idle)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):
                    continue  # a request interrupted before we read it
                if e.errno == errno.ENODEV:
                    return None
                raise
            if buf is None:
                self._burst = 0
                asleep = time.perf_counter()
                await trio.lowlevel.wait_readable(self.fd)
                self._poll.slept(time.perf_counter() - asleep)
                continue
            return buf or None

    def _idle(self):
        """The last request was answered at once, and nothing else is to do: no request in
        progress, no task to run.  (After requests answered by tasks, work may go on behind them,
        as writes behind do, in threads that reading again would keep from the GIL: dd bs=1M to
        an SMB share on a bare veth lost a fifth of its rate.  Reading again after tasks only while
        nothing went on behind them, the reader letting tasks just started answer first, did not
        pay either, in 5 rounds alternating with this code on the Samba lab: `find` over 2000 files
        within its noise (9-77 ms either way), `cp -r` of them 4 % and `rm -rf` 12 % slower.)"""
        return (self._at_once and not self._inflight
                and trio.lowlevel.current_statistics().tasks_runnable == 0)

    def _dispatch(self, buf):
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.in_header.unpack_from(buf)
        start = abi.in_header.size + extlen * 8
        # Only WRITE carries bulk data; a view spares copying it, names need bytes.
        body = memoryview(buf)[start:length] if opcode == abi.WRITE else buf[start:length]
        if self.debug:
            log.debug("<- %s unique=%d node=%d len=%d", abi.OPCODE_NAMES.get(opcode, opcode), unique, nodeid, length)
        if opcode == abi.FORGET:
            self.ops.forget(nodeid, abi.forget_in.unpack_from(body)[0])
            return True
        if opcode == abi.BATCH_FORGET:
            count, _ = abi.batch_forget_in.unpack_from(body)
            for i in range(count):
                self.ops.forget(*abi.forget_one.unpack_from(body, abi.batch_forget_in.size + i * 16))
            return True
        if opcode == abi.INTERRUPT:
            scope = self._inflight.get(abi.interrupt_in.unpack_from(body)[0])
            if scope is not None:
                scope.cancel()
            return True
        if opcode == abi.DESTROY:
            self.reply(unique)
            return False
        if opcode == abi.GETXATTR and self.ops.no_such_xattr(nodeid, _name(body, abi.getxattr_in.size)[0]):
            self.reply_error(unique, errno.EOPNOTSUPP)
            self._at_once = True
            return True
        if opcode == abi.WRITE and nodeid not in self._writes:  # none before it still to be taken
            n = self.ops.write_now(nodeid, *_write_args(body))
            if n is not None:
                self.reply(unique, abi.write_out.pack(n, 0))
                self._at_once = True
                return True
        now = self._now.get(opcode)
        if now is not None:
            ctx = Ctx(uid, gid, pid)
            self.ops.begin(ctx)
            try:
                out = now(self, ctx, nodeid, body)
            except Exception as e:
                self._failed(unique, e)
                return True
            if out is not None:
                self.reply(unique, *out)
                self._at_once = True
                return True
        self._at_once = False
        handler = self._handlers.get(opcode)
        if handler is None:
            self.reply_error(unique, errno.ENOSYS)
            return True
        scope = trio.CancelScope()
        self._inflight[unique] = scope
        turn = self._queue_write(nodeid) if opcode == abi.WRITE else None
        self._nursery.start_soon(self._run, handler, scope, unique, nodeid, Ctx(uid, gid, pid), body, turn)
        return True

    def _queue_write(self, nodeid):
        queue = self._writes.setdefault(nodeid, collections.deque())
        turn = trio.Event()
        if not queue:
            turn.set()
        queue.append(turn)
        return turn

    def _write_done(self, nodeid, turn):
        queue = self._writes[nodeid]
        queue.remove(turn)  # the first, but for one interrupted while it waited
        if queue:
            queue[0].set()
        else:
            del self._writes[nodeid]

    async def _run(self, handler, scope, unique, nodeid, ctx, body, turn):
        try:
            with scope:
                try:
                    if turn is not None and not turn.is_set():  # (waiting on a set Event still yields)
                        await turn.wait()
                    self.ops.begin(ctx)
                    out = await handler(self, ctx, nodeid, body)
                except Exception as e:
                    self._failed(unique, e)
                    return
                self.reply(unique, *out)
                return
            self.reply_error(unique, errno.EINTR)
        finally:
            del self._inflight[unique]
            if turn is not None:
                self._write_done(nodeid, turn)

    # -- replies and notifications --------------------------------------

    def _failed(self, unique, e):
        """Answer a request whose handler raised ``e``: an OSError with its errno, anything else
        (a bug) with EIO, logged."""
        if not isinstance(e, OSError):
            log.exception("request %d failed", unique, exc_info=e)
        self.reply_error(unique, getattr(e, "errno", None) or errno.EIO)

    def _send(self, bufs):
        try:
            os.writev(self.fd, bufs)
        except OSError as e:
            # ENOENT: the kernel gave up on the request (interrupted or aborted).
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def reply(self, unique, *payload):
        size = abi.out_header.size + sum(len(p) for p in payload)
        self._send([abi.out_header.pack(size, 0, unique), *payload])

    def reply_error(self, unique, err):
        if self.debug:
            log.debug("-> unique=%d error=%s", unique, errno.errorcode.get(err, err))
        self._send([abi.out_header.pack(abi.out_header.size, -err, unique)])

    def notify_inval_inode(self, nodeid, offset=0, length=-1):
        """Drop the kernel's cached data and attributes of a node changed behind its back."""
        body = abi.notify_inval_inode_out.pack(nodeid, offset, length)
        self._send([abi.out_header.pack(16 + len(body), abi.NOTIFY_INVAL_INODE, 0), body])

    def notify_inval_entry(self, parent, name):
        """Drop the kernel's cached dentry ``name`` in ``parent``."""
        body = abi.notify_inval_entry_out.pack(parent, len(name), 0) + name + b"\0"
        self._send([abi.out_header.pack(16 + len(body), abi.NOTIFY_INVAL_ENTRY, 0), body])

    # -- INIT -------------------------------------------------------------

    def _init(self, unique, body):
        major, minor, max_readahead, flags = abi.init_in.unpack_from(body)
        if major != abi.KERNEL_VERSION or minor < abi.OLDEST_MINOR_VERSION:
            self.reply_error(unique, errno.EPROTO)
            raise ProtocolError(f"kernel FUSE protocol {major}.{minor} is older than 7.{abi.OLDEST_MINOR_VERSION}")
        if flags & abi.INIT_EXT:
            flags |= abi.init_in_flags2.unpack_from(body, abi.init_in.size)[0] << 32
        want = (abi.ASYNC_READ | abi.ATOMIC_O_TRUNC | abi.BIG_WRITES | abi.AUTO_INVAL_DATA
                | abi.DO_READDIRPLUS | abi.READDIRPLUS_AUTO | abi.ASYNC_DIO | abi.PARALLEL_DIROPS
                | abi.MAX_PAGES | abi.CACHE_SYMLINKS | abi.HANDLE_KILLPRIV_V2 | abi.INIT_EXT)
        if self.want_writeback:
            want |= abi.WRITEBACK_CACHE
        if self.want_passthrough:
            want |= abi.PASSTHROUGH
        granted = want & flags
        passthrough = bool(granted & abi.PASSTHROUGH)
        self.conn = ConnInfo(minor=min(minor, abi.KERNEL_MINOR_VERSION),
                             writeback_cache=bool(granted & abi.WRITEBACK_CACHE), passthrough=passthrough,
                             kernel=self)
        out = abi.init_out.pack(
            abi.KERNEL_VERSION, self.conn.minor, max_readahead, granted & 0xFFFFFFFF,
            MAX_BACKGROUND, MAX_BACKGROUND * 3 // 4, MAX_WRITE, 1, MAX_PAGES, 0,
            granted >> 32, 1 if passthrough else 0, 0)
        self.ops.init(self.conn)
        self.reply(unique, out)
        log.info("FUSE 7.%d negotiated, flags %#x", self.conn.minor, granted)

    # -- passthrough ------------------------------------------------------

    def _open_out(self, nodeid, opened):
        """The kernel binds an inode to one backing file while any handle has it open, and fails
        (EIO) an open that brings another one, or that is not passthrough at all: so every
        passthrough handle of a nodeid shares the backing id of the first.  The kernel opens a
        backing file of its own for each handle, with that handle's flags, from that id's path,
        so the first handle's access mode does not limit later ones."""
        if opened.backing_fd is None or not self.conn.passthrough:
            flags = (abi.FOPEN_KEEP_CACHE if opened.keep_cache else 0) | (abi.FOPEN_DIRECT_IO if opened.direct_io else 0)
            return abi.open_out.pack(opened.fh, flags, 0)
        backing = self._backing.get(nodeid)
        if backing is None:
            arg = bytearray(abi.backing_map.pack(opened.backing_fd, 0, 0))
            backing_id = fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, arg, True)
            backing = self._backing[nodeid] = _Backing(backing_id)
        backing.handles += 1
        self._backing_of[opened.fh] = nodeid
        # No page-cache flag: the kernel fails a passthrough open that has one (EIO); the pages
        # are the backing file's.
        return abi.open_out.pack(opened.fh, abi.FOPEN_PASSTHROUGH, backing.id)

    def _close_backing(self, fh):
        """The last handle using a backing id gives the id back; files the kernel opened from it keep
        their own references."""
        nodeid = self._backing_of.pop(fh, None)
        if nodeid is None:
            return
        backing = self._backing[nodeid]
        backing.handles -= 1
        if not backing.handles:
            del self._backing[nodeid]
            fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, bytearray(backing.id.to_bytes(4, "little")), True)

    # -- handlers: (self, ctx, nodeid, body) -> tuple of reply buffers ------

    async def _lookup(self, ctx, nodeid, body):
        return (pack_entry(await self.ops.lookup(ctx, nodeid, _name(body)[0])),)

    async def _getattr(self, ctx, nodeid, body):
        flags, _, fh = abi.getattr_in.unpack_from(body)
        attr, timeout = await self.ops.getattr(ctx, nodeid, fh if flags & abi.FUSE_GETATTR_FH else None)
        return (self._attr_out(attr, timeout),)

    @staticmethod
    def _attr_out(attr, timeout):
        sec, nsec = _split_timeout(timeout)
        return abi.attr_out.pack(sec, nsec, 0, *pack_attr(attr))

    async def _setattr(self, ctx, nodeid, body):
        (valid, _, fh, size, _, atime, mtime, _, atimensec, mtimensec, _,
         mode, _, uid, gid, _) = abi.setattr_in.unpack_from(body)
        ch = SetAttr(kill_suidgid=bool(valid & abi.FATTR_KILL_SUIDGID))
        if valid & abi.FATTR_MODE:
            ch.mode = stat.S_IMODE(mode)
        if valid & abi.FATTR_UID:
            ch.uid = uid
        if valid & abi.FATTR_GID:
            ch.gid = gid
        if valid & abi.FATTR_SIZE:
            ch.size = size
        if valid & abi.FATTR_ATIME:
            ch.atime_ns = NOW if valid & abi.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimensec
        if valid & abi.FATTR_MTIME:
            ch.mtime_ns = NOW if valid & abi.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimensec
        if valid & abi.FATTR_FH:
            ch.fh = fh
        attr, timeout = await self.ops.setattr(ctx, nodeid, ch)
        return (self._attr_out(attr, timeout),)

    async def _readlink(self, ctx, nodeid, body):
        return (await self.ops.readlink(ctx, nodeid),)

    async def _symlink(self, ctx, nodeid, body):
        name, rest = _name(body)
        target, _ = _name(body, rest)
        return (pack_entry(await self.ops.symlink(ctx, nodeid, name, target)),)

    async def _mknod(self, ctx, nodeid, body):
        mode, rdev, _, _ = abi.mknod_in.unpack_from(body)
        name, _ = _name(body, abi.mknod_in.size)
        return (pack_entry(await self.ops.mknod(ctx, nodeid, name, mode, rdev)),)

    async def _mkdir(self, ctx, nodeid, body):
        mode, _ = abi.mkdir_in.unpack_from(body)
        name, _ = _name(body, abi.mkdir_in.size)
        return (pack_entry(await self.ops.mkdir(ctx, nodeid, name, mode)),)

    async def _unlink(self, ctx, nodeid, body):
        await self.ops.unlink(ctx, nodeid, _name(body)[0])
        return ()

    async def _rmdir(self, ctx, nodeid, body):
        await self.ops.rmdir(ctx, nodeid, _name(body)[0])
        return ()

    async def _rename(self, ctx, nodeid, body):
        (newdir,) = abi.rename_in.unpack_from(body)
        name, rest = _name(body, abi.rename_in.size)
        newname, _ = _name(body, rest)
        await self.ops.rename(ctx, nodeid, name, newdir, newname, 0)
        return ()

    async def _rename2(self, ctx, nodeid, body):
        newdir, flags, _ = abi.rename2_in.unpack_from(body)
        name, rest = _name(body, abi.rename2_in.size)
        newname, _ = _name(body, rest)
        await self.ops.rename(ctx, nodeid, name, newdir, newname, flags)
        return ()

    async def _link(self, ctx, nodeid, body):
        (oldnode,) = abi.link_in.unpack_from(body)
        return (pack_entry(await self.ops.link(ctx, oldnode, nodeid, _name(body, abi.link_in.size)[0])),)

    async def _open(self, ctx, nodeid, body):
        flags, open_flags = abi.open_in.unpack_from(body)
        opened = await self.ops.open(ctx, nodeid, flags, bool(open_flags & abi.FUSE_OPEN_KILL_SUIDGID))
        if not opened.keep_cache:
            # The pages go with the reply (no FOPEN_KEEP_CACHE); the attributes must go too, or
            # reads stop at the old size.  A negative offset drops attributes only and takes no
            # page lock, so this cannot wait on a READ we have yet to answer.
            self.notify_inval_inode(nodeid, -1, 0)
        return (self._open_out(nodeid, opened),)

    async def _create(self, ctx, nodeid, body):
        flags, mode, _, _ = abi.create_in.unpack_from(body)
        name, _ = _name(body, abi.create_in.size)
        entry, opened = await self.ops.create(ctx, nodeid, name, mode, flags)
        return (pack_entry(entry), self._open_out(entry.nodeid, opened))

    async def _read(self, ctx, nodeid, body):
        fh, offset, size, _, _, _, _ = abi.read_in.unpack_from(body)
        return (await self.ops.read(ctx, nodeid, fh, offset, size),)

    async def _write(self, ctx, nodeid, body):
        n = await self.ops.write(ctx, nodeid, *_write_args(body))
        return (abi.write_out.pack(n, 0),)

    async def _statfs(self, ctx, nodeid, body):
        s = await self.ops.statfs(ctx, nodeid)
        return (abi.statfs_out.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree,
                                    s.bsize, s.namelen, s.frsize, 0),)

    async def _release(self, ctx, nodeid, body):
        fh, _, _, _ = abi.release_in.unpack_from(body)
        self._close_backing(fh)
        await self.ops.release(ctx, nodeid, fh)
        return ()

    async def _flush(self, ctx, nodeid, body):
        fh, _, _, _ = abi.flush_in.unpack_from(body)
        await self.ops.flush(ctx, nodeid, fh)
        return ()

    async def _fsync(self, ctx, nodeid, body):
        fh, flags, _ = abi.fsync_in.unpack_from(body)
        await self.ops.fsync(ctx, nodeid, fh, bool(flags & abi.FUSE_FSYNC_FDATASYNC))
        return ()

    async def _fsyncdir(self, ctx, nodeid, body):
        fh, flags, _ = abi.fsync_in.unpack_from(body)
        await self.ops.fsyncdir(ctx, nodeid, fh, bool(flags & abi.FUSE_FSYNC_FDATASYNC))
        return ()

    async def _setxattr(self, ctx, nodeid, body):
        size, flags = abi.setxattr_in.unpack_from(body)
        name, rest = _name(body, abi.setxattr_in.size)
        await self.ops.setxattr(ctx, nodeid, name, bytes(body[rest:rest + size]), flags)
        return ()

    async def _getxattr(self, ctx, nodeid, body):
        size, _ = abi.getxattr_in.unpack_from(body)
        value = await self.ops.getxattr(ctx, nodeid, _name(body, abi.getxattr_in.size)[0])
        return self._sized(value, size)

    async def _listxattr(self, ctx, nodeid, body):
        size, _ = abi.getxattr_in.unpack_from(body)
        names = await self.ops.listxattr(ctx, nodeid)
        return self._sized(b"".join(n + b"\0" for n in names), size)

    @staticmethod
    def _sized(value, size):
        """getxattr/listxattr: size 0 asks for the length, too small a size is ERANGE."""
        if size == 0:
            return (abi.getxattr_out.pack(len(value), 0),)
        if len(value) > size:
            raise OSError(errno.ERANGE, "buffer too small")
        return (value,)

    async def _removexattr(self, ctx, nodeid, body):
        await self.ops.removexattr(ctx, nodeid, _name(body)[0])
        return ()

    async def _access(self, ctx, nodeid, body):
        mask, _ = abi.access_in.unpack_from(body)
        await self.ops.access(ctx, nodeid, mask)
        return ()

    async def _opendir(self, ctx, nodeid, body):
        flags, _ = abi.open_in.unpack_from(body)
        return self._opendir_out(await self.ops.opendir(ctx, nodeid, flags))

    @staticmethod
    def _opendir_out(opened):
        flags = (abi.FOPEN_KEEP_CACHE if opened.keep_cache else 0) | (abi.FOPEN_CACHE_DIR if opened.cache_dir else 0)
        return (abi.open_out.pack(opened.fh, flags, 0),)

    @staticmethod
    def _room(size, extra):
        """fits(name): True, and the room is taken, while a record for ``name`` fits in ``size``."""
        left = size

        def fits(name):
            nonlocal left
            record = abi.dirent.size + len(name)
            record += -record % 8 + extra
            if record > left:
                return False
            left -= record
            return True
        return fits

    async def _readdir(self, ctx, nodeid, body):
        fh, offset, size, _, _, _, _ = abi.read_in.unpack_from(body)
        fits = self._room(size, 0)
        out = []
        for d in await self.ops.readdir(ctx, nodeid, fh, offset):
            if not fits(d.name):
                break
            out.append(pack_dirent(d.name, d.ino, d.type, d.next_offset))
        return (b"".join(out),)

    async def _readdirplus(self, ctx, nodeid, body):
        """Only entries that fit are looked up: each lookup is a reference the kernel must get."""
        fh, offset, size, _, _, _, _ = abi.read_in.unpack_from(body)
        out = []
        for d, entry in await self.ops.readdirplus(ctx, nodeid, fh, offset, self._room(size, abi.entry_out.size)):
            out.append(NO_ENTRY if entry is None else pack_entry(entry))
            out.append(pack_dirent(d.name, d.ino, d.type, d.next_offset))
        return (b"".join(out),)

    async def _lseek(self, ctx, nodeid, body):
        fh, offset, whence, _ = abi.lseek_in.unpack_from(body)
        return (abi.lseek_out.pack(await self.ops.lseek(ctx, nodeid, fh, offset, whence)),)

    async def _fallocate(self, ctx, nodeid, body):
        fh, offset, length, mode, _ = abi.fallocate_in.unpack_from(body)
        await self.ops.fallocate(ctx, nodeid, fh, offset, length, mode)
        return ()

    async def _copy(self, ctx, nodeid, body, limit):
        fh_in, off_in, nodeid_out, fh_out, off_out, length, flags = abi.copy_file_range_in.unpack_from(body)
        return await self.ops.copy_file_range(ctx, nodeid, fh_in, off_in, nodeid_out, fh_out,
                                              off_out, min(length, limit), flags)

    async def _copy_file_range(self, ctx, nodeid, body):
        return (abi.write_out.pack(await self._copy(ctx, nodeid, body, MAX_COPY_32), 0),)

    async def _copy_file_range_64(self, ctx, nodeid, body):
        return (abi.copy_file_range_out.pack(await self._copy(ctx, nodeid, body, 1 << 63)),)

    async def _ioctl(self, ctx, nodeid, body):
        raise OSError(errno.ENOTTY, "no ioctls")  # what a tty probe (Python's open) expects

    # -- answered at once, by the reader: (self, ctx, nodeid, body) -> reply buffers, or None to take
    # the request as any other

    def _getattr_now(self, ctx, nodeid, body):
        flags, _, fh = abi.getattr_in.unpack_from(body)
        answer = self.ops.getattr_now(ctx, nodeid, fh if flags & abi.FUSE_GETATTR_FH else None)
        return None if answer is None else (self._attr_out(*answer),)

    def _opendir_now(self, ctx, nodeid, body):
        flags, _ = abi.open_in.unpack_from(body)
        opened = self.ops.opendir_now(ctx, nodeid, flags)
        return None if opened is None else self._opendir_out(opened)

    def _releasedir(self, ctx, nodeid, body):
        fh, _, _, _ = abi.release_in.unpack_from(body)
        self.ops.releasedir(ctx, nodeid, fh)
        return ()

    _now = {abi.GETATTR: _getattr_now, abi.OPENDIR: _opendir_now, abi.RELEASEDIR: _releasedir}

    _handlers = {
        abi.LOOKUP: _lookup, abi.GETATTR: _getattr, abi.SETATTR: _setattr,
        abi.READLINK: _readlink, abi.SYMLINK: _symlink, abi.MKNOD: _mknod, abi.MKDIR: _mkdir,
        abi.UNLINK: _unlink, abi.RMDIR: _rmdir, abi.RENAME: _rename, abi.RENAME2: _rename2,
        abi.LINK: _link, abi.OPEN: _open, abi.CREATE: _create, abi.READ: _read, abi.WRITE: _write,
        abi.STATFS: _statfs, abi.RELEASE: _release,
        abi.FLUSH: _flush, abi.FSYNC: _fsync, abi.FSYNCDIR: _fsyncdir,
        abi.SETXATTR: _setxattr, abi.GETXATTR: _getxattr, abi.LISTXATTR: _listxattr,
        abi.REMOVEXATTR: _removexattr, abi.ACCESS: _access, abi.OPENDIR: _opendir,
        abi.READDIR: _readdir, abi.READDIRPLUS: _readdirplus, abi.LSEEK: _lseek,
        abi.FALLOCATE: _fallocate, abi.COPY_FILE_RANGE: _copy_file_range,
        abi.COPY_FILE_RANGE_64: _copy_file_range_64, abi.IOCTL: _ioctl,
    }
