"""Writes answered before the server has them, as the kernel's NFS and CIFS clients answer write(2).

Without it a writer has one WRITE in flight at a time: each 1 MiB waits for
the link, the server and the reply before the next leaves, and on the lab's
1 Gbit link dd reached 79 MiB/s against smbclient's 98 (which keeps several in
flight).  Here a WRITE is answered once its data is on its way, up to
FILE_WINDOW bytes a file and MOUNT_WINDOW a mount (more waits: backpressure,
not memory).

What the server refuses is reported later, as Linux reports writeback errors
(lib/errseq.c; vfs.rst, "Handling errors during writeback"): to each handle
open for writing when the write failed (an open file description: FUSE's
fh), whoever closes first.  A read-only handle hears none, nor does one
opened after the failure.  Until an fsync of the handle has heard the error,
its writes and its flushes fail with it: FUSE sends a FLUSH for each close(2)
of a descriptor, the close-on-exec of each subprocess the writer starts
included, and the daemon cannot tell the writer's own close from those
(Linux's NFS client reports it to the first, often a child nobody hears).

Anything that could tell the difference waits for the writes in flight first
(``settle``: the filesystem's reads, attribute changes, copies, renames), and
two writes of one range are never in flight at once, as a server may do them
in either order.  Attributes handed out meanwhile carry the size written
(``end``).  Writes side by side may land beyond one the server refused (a
full disk gives its last blocks to whichever asks first): once none is in
flight, the file is cut back to the refused one where they made it longer, so
it never ends past data that was never written, as a plain write(2) leaves it.
"""
import contextvars
import errno
import logging
from dataclasses import dataclass, field

import trio

log = logging.getLogger(__name__)

FILE_WINDOW = 4 << 20
MOUNT_WINDOW = 8 << 20


@dataclass(slots=True)
class Behind:
    """One file's writes in flight, and the errors its handles have yet to hear of."""
    ranges: dict = field(default_factory=dict)  # id -> (offset, end)
    # What ``ranges`` hold in all, and where none of them reaches (the furthest end since they were
    # last empty): tar x has hundreds of 5 KiB writes in flight, and summing and scanning them for
    # each write took longer than the write.
    bytes: int = 0
    high: int = 0
    writers: set = field(default_factory=set)  # id() of the handles open for writing
    unheard: dict = field(default_factory=dict)  # id(handle) -> the first failure it has yet to hear of
    changed: trio.Event = field(default_factory=trio.Event)  # a write in flight ended
    landed: int = 0  # writes ended
    landed_end: int = 0  # where those that landed since the last settle() end
    written: int = 0  # where the file's data ends, as far as we know: its size, or a write that landed
    outdated: object = None  # the file's attributes when it was last cut here: their size is no more
    before: int = 0  # what ``written`` was when the writes in flight began
    failed_at: int | None = None  # where the first of them that failed starts

    def end(self):
        return max((end for _, end in self.ranges.values()), default=0)


class WriteBehind:
    """``send(h, offset, data)`` writes all of data through handle h and returns once the server has
    it; ``cut(inode, h, size)`` cuts the file back to size if it is longer; ``where(inode)`` names a
    file for the log."""

    def __init__(self, send, cut, where):
        self.send = send
        self.cut = cut
        self.where = where
        self.room = MOUNT_WINDOW
        self.room_changed = trio.Event()
        self._ids = 0

    async def write(self, inode, h, offset, data):
        """Start writing ``data`` at ``offset`` of ``inode`` through ``h``; returns once it is on its way."""
        b = inode.behind
        if b is None:
            b = inode.behind = Behind()
        end = offset + len(data)
        while True:
            if id(h) in b.unheard:
                raise b.unheard[id(h)]
            overlaps = offset < b.high and any(o < end and offset < e for o, e in b.ranges.values())
            if overlaps or b.ranges and b.bytes + len(data) > FILE_WINDOW:
                await b.changed.wait()
            elif self.room < len(data) and self.room < MOUNT_WINDOW:
                await self.room_changed.wait()
            else:
                break
        if not b.ranges:
            st = inode.stat
            b.before = b.written = max(b.written, st.size if st is not None and st is not b.outdated else 0)
        self._ids += 1
        b.ranges[self._ids] = (offset, end)
        b.bytes += len(data)
        b.high = max(b.high, end)
        self.room -= len(data)
        trio.lowlevel.spawn_system_task(self._send, inode, b, self._ids, h, offset, data,
                                        context=contextvars.copy_context())

    async def _send(self, inode, b, key, h, offset, data):
        try:
            await self.send(h, offset, data)
            b.written = max(b.written, offset + len(data))
            b.landed_end = max(b.landed_end, offset + len(data))
        except Exception as e:
            if b.failed_at is None:
                log.error("%s: a write of %d bytes at %d failed after it was answered: %s",
                          self.where(inode), len(data), offset, e)
            error = e if isinstance(e, OSError) and e.errno else OSError(errno.EIO, f"write failed: {e}")
            for writer in b.writers:
                b.unheard.setdefault(writer, error)
            b.failed_at = offset if b.failed_at is None else min(b.failed_at, offset)
        finally:
            if len(b.ranges) == 1 and b.failed_at is not None:
                await self._cut_back(inode, h, b)
            del b.ranges[key]
            b.bytes -= len(data)
            if not b.ranges:
                b.high = 0
            b.landed += 1
            self.room += len(data)
            b.changed.set()
            b.changed = trio.Event()
            self.room_changed.set()
            self.room_changed = trio.Event()

    async def _cut_back(self, inode, h, b):
        """The last write in flight ended and one failed: cut off what landed past it, where the
        file did not reach before."""
        keep, b.failed_at = max(b.before, b.failed_at), None
        if b.written > keep:
            b.written, b.outdated = keep, inode.stat
            b.landed_end = min(b.landed_end, keep)
            with trio.CancelScope(shield=True):
                try:
                    await self.cut(inode, h, keep)
                except Exception:  # a system task that raised would end the daemon
                    log.exception("%s: cutting the file back to %d bytes failed", self.where(inode), keep)

    @staticmethod
    async def settle(inode):
        """Wait for ``inode``'s writes in flight."""
        b = inode.behind
        if b is None:
            return
        while b.ranges:
            await b.changed.wait()
        b.landed_end = 0

    @staticmethod
    def opened(inode, h):
        """``h`` was opened for writing: it hears of the writes that fail from now on."""
        if inode.behind is None:
            inode.behind = Behind()
        inode.behind.writers.add(id(h))

    @staticmethod
    def closed(inode, h):
        """``h`` was released: what it did not hear of by then was logged."""
        if inode.behind is not None:
            inode.behind.writers.discard(id(h))
            inode.behind.unheard.pop(id(h), None)

    @staticmethod
    def unheard(inode, h):
        """The error of a write that failed while ``h`` was open for writing, until an fsync of
        ``h`` heard of it (None: none)."""
        return None if inode.behind is None else inode.behind.unheard.get(id(h))

    @staticmethod
    def report(inode, h, clear=False):
        """Raise the error ``h`` has yet to hear of (its writes and closes do); with ``clear`` (its
        fsync) it has heard it once this raises.  Settle first: one still in flight may fail."""
        if inode.behind is not None:
            e = inode.behind.unheard.pop(id(h), None) if clear else inode.behind.unheard.get(id(h))
            if e is not None:
                raise e

    @staticmethod
    def truncated(inode, size):
        """The file was cut to ``size`` here (an open with O_TRUNC, a truncate): what it held past that
        is gone, whatever the attributes held until they are asked for again say."""
        if inode.behind is None:
            inode.behind = Behind()
        inode.behind.written = size
        inode.behind.outdated = inode.stat

    @staticmethod
    def landed(inode):
        """How many of ``inode``'s writes have ended: an answer from the server asked for before one
        more ended may lack it."""
        return 0 if inode.behind is None else inode.behind.landed

    @staticmethod
    def landed_end(inode):
        """Where the writes that landed since the last settle() end."""
        return 0 if inode.behind is None else inode.behind.landed_end

    @staticmethod
    def end(inode):
        """Where the writes in flight end (0: none)."""
        return 0 if inode.behind is None else inode.behind.end()
