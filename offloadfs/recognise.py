"""Recognising copied data: writes that carry bytes this daemon served from a file moments ago.

rsync, shutil (sendfile), dd and tar x copy with read() and write(): the kernel
never sends us a copy request, so every byte would cross the client's link
twice.  Here each block of a READ reply is remembered by a strong hash
(``Served``); a write whose blocks hash the same is not sent but held as a
pending copy from that file (``Pending``), and committed through the planner's
offload-only entry (clone, server-side copy) before anything could see the
difference: close, fsync, a read or size change of the file, a rename, or the
bound on what all files hold.  The source must be as it was when served
(size, times, change attribute, file number), checked before and after the
copy; anything else, and any failure, writes the held bytes instead, so
nothing written is lost.

A block is labelled with a version seen before it was read, never after.  Some
servers change the version by reading: Linux nfsd on xfs (6.1) bumps the change
attribute with the access time of the first read after a change, so the version
known before that read (cached, the same for all reads of the file for a while)
would never match again.  ``Recogniser.read`` asks once more after the first
read of each version; where it moved, the bytes are read again and labelled
with the new version, and later reads that knew the old one get the new one.

v1 matches blocks at the same offset modulo BLOCK in source and destination
(what cp-like tools, rsync's whole-file temporary files, tar x and dd without
skip/seek produce); data shifted by other amounts is written as usual.
"""
import collections
import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from .stats import OFFLOADS

log = logging.getLogger(__name__)

BLOCK = 64 << 10
SERVED_BLOCKS = 1 << 15  # blocks remembered: 2 GiB of served data, some 12 MB of index
PARTS = 256  # blocks served in part, kept until the rest of them is served
CHECKED = 1024  # files whose version after a read is remembered (Recogniser.read)
HELD_MAX = 64 << 20  # bytes held for pending copies in all; past it the oldest files commit


def digest(data):
    return hashlib.sha256(data).digest()  # SHA-NI: 1.5 GiB/s here, blake2b 0.85


def sample(data):
    """A few bytes of a block: written data whose sample no served block has is passed over
    without hashing it (hashing every write took 28 % of the daemon's CPU on fresh data)."""
    return len(data), bytes(data[:16]), bytes(data[-16:])


def version(st, inode):
    """What changes whenever the source's data may have: a pending copy from it is safe while equal.
    The inode's own count of changes made through this mount is part of it, as servers may
    update the times of a write late (Samba holds the write time of an open file)."""
    return st.size, st.mtime_ns, st.ctime_ns, st.change, st.ino, inode.data_changes


@dataclass(slots=True, frozen=True)
class Block:
    """One block as served: ``source`` is the file's inode key; a short block ends the file."""
    source: tuple
    offset: int
    length: int
    version: tuple
    digest: bytes
    sample: tuple


class Served:
    """The blocks of recent READ replies, by hash and by place, least recently served out first.

    The kernel's readahead does not keep to our blocks, and its replies may complete in any
    order: the parts of a block at either end of a reply are kept (``parts``) until the replies
    that hold the rest of it, served as of the same version, complete it."""

    def __init__(self, limit=SERVED_BLOCKS):
        self.limit = limit
        self.by_digest = OrderedDict()
        self.samples = collections.Counter()  # sample -> blocks in by_digest that have it
        self.at = OrderedDict()  # (source, offset) -> Block, the last served last; at most twice limit
        self.parts = OrderedDict()  # (source, block offset) -> (version, {offset: bytes}, where the block ends)

    def add(self, source, ver, offset, data, eof):
        """``data`` was served from ``source`` (as of ``ver``, taken before the read) at ``offset``;
        ``eof``: the reply reached the end of the file, so its short last block counts too."""
        view = memoryview(data)
        end = offset + len(view)
        pos = -(-offset // BLOCK) * BLOCK
        if offset % BLOCK:
            head = min(pos, end)
            self._part(source, ver, offset, view[:head - offset], eof and head == end)
        while pos < end:
            n = min(BLOCK, end - pos)
            if n < BLOCK and not eof:
                self._part(source, ver, pos, view[pos - offset:], False)
                break
            known = self.at.get((source, pos))
            if known is not None and known.version == ver and known.length == n:
                self.by_digest[known.digest] = known  # the same bytes again: no need to hash them
                self.by_digest.move_to_end(known.digest)
            else:
                data = view[pos - offset:pos - offset + n]
                self._put(Block(source, pos, n, ver, digest(data), sample(data)))
            pos += n

    def _part(self, source, ver, start, data, last):
        """Part of the block that holds ``start``; ``last``: the file ends with it.  Once the parts
        of one version cover the block, it is served."""
        pos = start - start % BLOCK
        held = self.parts.pop((source, pos), None)
        pieces, stop = (held[1], held[2]) if held is not None and held[0] == ver else ({}, pos + BLOCK)
        pieces[start] = bytes(data)
        if last:
            stop = start + len(data)
        joined, cursor = [], pos
        for at in sorted(pieces):
            if at > cursor:
                break
            if at + len(pieces[at]) > cursor:
                joined.append(pieces[at][cursor - at:])
                cursor = at + len(pieces[at])
        if cursor >= stop:
            block = b"".join(joined)[:stop - pos]
            self._put(Block(source, pos, len(block), ver, digest(block), sample(block)))
            return
        self.parts[(source, pos)] = (ver, pieces, stop)
        while len(self.parts) > PARTS:
            self.parts.popitem(last=False)

    def _put(self, block):
        old = self.at.get((block.source, block.offset))
        if old is not None and self.by_digest.get(old.digest) is old:
            self._drop(old)
        if block.digest not in self.by_digest:
            self.samples[block.sample] += 1
        self.by_digest[block.digest] = block
        self.by_digest.move_to_end(block.digest)
        self.at.pop((block.source, block.offset), None)
        self.at[(block.source, block.offset)] = block
        while len(self.at) > 2 * self.limit:  # blocks of bytes served since from elsewhere (zeros) stay here
            self.at.popitem(last=False)
        while len(self.by_digest) > self.limit:
            gone = next(iter(self.by_digest.values()))
            self._drop(gone)
            if self.at.get((gone.source, gone.offset)) is gone:
                del self.at[(gone.source, gone.offset)]

    def _drop(self, block):
        del self.by_digest[block.digest]
        self.samples[block.sample] -= 1
        if not self.samples[block.sample]:
            del self.samples[block.sample]

    def find(self, data, next_to=None, offset=None):
        """The served block of the bytes ``data``, written at ``offset``.  ``next_to`` ((source,
        offset)) is asked first, so that a run from one file goes on there rather than jumping to
        another file with the same bytes; then the block at ``offset`` in the file that served those
        bytes last, as cp-like tools copy to the same offsets, so that a file of one repeated block
        (zeros) makes one run, not a run a block from wherever that block was served last."""
        if sample(data) not in self.samples:
            return None
        hashed, length = digest(data), len(data)
        block = self.by_digest.get(hashed)
        for place in (next_to, None if block is None else (block.source, offset)):
            here = self.at.get(place)
            if here is not None and here.digest == hashed and here.length == length:
                return here
        return block if block is not None and block.length == length else None


@dataclass(slots=True)
class Run:
    """Written bytes at ``dst`` that are the bytes of ``source`` at ``src``, held until committed."""
    dst: int
    source: tuple
    src: int
    version: tuple
    held: list = field(default_factory=list)  # memoryviews, in order
    length: int = 0


@dataclass(slots=True)
class Pending:
    """What one file holds: runs to commit, and the window (the written tail short of a block,
    not yet decided).  ``handle`` is the open file the data came through and is committed by."""
    key: tuple = ()  # the file's inode key: its own blocks are no source for it
    handle: object = None
    runs: list = field(default_factory=list)
    window_at: int = 0
    window: bytearray = field(default_factory=bytearray)
    lock: trio.Lock = field(default_factory=trio.Lock)

    def end(self):
        """Where the written data ends, as far as it is held here (0: nothing held)."""
        ends = [r.dst + r.length for r in self.runs]
        if self.window:
            ends.append(self.window_at + len(self.window))
        return max(ends, default=0)


class Recogniser:
    """Served blocks and the pending copies of a mount.

    ``send(handle, offset, data)`` writes to the server as usual (maybe still on its way when it
    returns: writebehind.py), ``drain(inode)`` waits for what was sent to ``inode``, ``source_of(key)``
    is the live inode of an inode key (or None), ``endpoint(inode, file)`` the planner's Endpoint."""

    def __init__(self, stats, planner, send, drain, source_of, endpoint, held_max=HELD_MAX):
        self.stats = stats
        self.planner = planner
        self.send = send
        self.drain = drain
        self.source_of = source_of
        self.endpoint = endpoint
        self.held_max = held_max
        self.served = Served()
        # inode key -> (version known before a read, version asked for after it, its attributes,
        # when they came): what later reads that knew the first are labelled with.
        self.checked = OrderedDict()
        self.held = 0
        self.holding = {}  # id(Pending) -> Pending with runs, oldest first: what backpressure commits

    # -- reads --------------------------------------------------------------------------

    async def read(self, inode, file, offset, size, st):
        """READ ``size`` bytes at ``offset`` through ``file``, their blocks remembered as served.
        ``st``: the file's attributes as known before the read (maybe cached)."""
        backend = inode.source.backend
        ver = version(st, inode)
        started = trio.current_time()
        data = await backend.read(file, offset, size)
        known = self.checked.get(inode.key)
        if known is not None and known[0] == ver and started >= known[3]:
            # That version was seen before this read began (a read already in flight then could
            # hold older bytes, and asks for itself below).
            self.checked.move_to_end(inode.key)
            ver, st = known[1], known[2]
        else:
            after = await backend.getattr(inode.node, file)
            now = version(after, inode)
            self.checked[inode.key] = (ver, now, after, trio.current_time())
            self.checked.move_to_end(inode.key)
            while len(self.checked) > CHECKED:
                self.checked.popitem(last=False)
            if now != ver:
                # The bytes read may be older than ``now``: read them again, after it was seen.
                data = await backend.read(file, offset, size)
                ver, st = now, after
        self.served.add(inode.key, ver, offset, data, len(data) < size or offset + len(data) >= st.size)
        return data

    # -- writes -------------------------------------------------------------------------

    async def write(self, h, offset, data):
        """Take a write through ``h``: its copied blocks are held, the rest sent; returns once each
        byte is one or the other (the last partial block waits in the window)."""
        inode = h.inode
        if inode.pending is None:
            inode.pending = Pending(inode.key)
        p = inode.pending
        async with p.lock:
            if p.handle is not h and (p.runs or p.window):
                await self._commit(p)  # another opener's data goes first, as it came first
            p.handle = h
            await self._write(p, offset, memoryview(data))
        while self.held > self.held_max and self.holding:
            oldest = next(iter(self.holding.values()))
            async with oldest.lock:
                await self._commit_runs(oldest)

    async def _write(self, p, offset, view):
        end = offset + len(view)
        if p.window and offset != p.window_at + len(p.window):
            await self._decide(p)
        if any(r.dst < end and offset < r.dst + r.length for r in p.runs):
            await self._commit_runs(p)  # written over: what was held goes first
        if p.window:  # this write goes on from the window
            need = BLOCK - len(p.window)
            p.window += view[:need]
            if len(p.window) < BLOCK:
                return
            at, block = p.window_at, bytes(p.window)
            p.window = bytearray()
            await self._take(p, at, memoryview(block))
            offset, view = offset + need, view[need:]
        start = -(-offset // BLOCK) * BLOCK
        if start > offset:  # the bytes before a block boundary can never make a block
            await self.send(p.handle, offset, view[:start - offset])
            if start >= end:
                return
            offset, view = start, view[start - offset:]
        await self._take(p, offset, view)

    async def _take(self, p, offset, view):
        """Decide the whole blocks of ``view`` (``offset`` is on a block boundary); the rest waits."""
        plain = None  # index where the bytes not matched so far begin
        i = 0
        while len(view) - i >= BLOCK:
            block = view[i:i + BLOCK]
            served = self._find(p, offset + i, block)
            if served is None:
                plain = i if plain is None else plain
            else:
                if plain is not None:
                    await self.send(p.handle, offset + plain, view[plain:i])
                    plain = None
                self._hold(p, offset + i, block, served)
            i += BLOCK
        if plain is not None:
            await self.send(p.handle, offset + plain, view[plain:i])
        if i < len(view):
            p.window_at, p.window = offset + i, bytearray(view[i:])

    async def _decide(self, p):
        """The window will not grow into a whole block: it is the source's short last block, or sent."""
        at, data = p.window_at, bytes(p.window)
        p.window = bytearray()
        served = self._find(p, at, data)
        if served is None:
            await self.send(p.handle, at, data)
        else:
            self._hold(p, at, memoryview(data), served)

    def _find(self, p, dst, data):
        next_to = None
        if p.runs:
            last = p.runs[-1]
            if last.dst + last.length == dst:
                next_to = (last.source, last.src + last.length)
        served = self.served.find(data, next_to, dst)
        return None if served is None or served.source == p.key else served

    def _hold(self, p, dst, data, served):
        last = p.runs[-1] if p.runs else None
        if not (last is not None and last.source == served.source and last.version == served.version
                and last.dst + last.length == dst and last.src + last.length == served.offset):
            last = Run(dst, served.source, served.offset, served.version)
            p.runs.append(last)
        last.held.append(data)
        last.length += len(data)
        self.held += len(data)
        self.stats.recognised_bytes += len(data)
        self.holding[id(p)] = p

    # -- commits ------------------------------------------------------------------------

    async def commit(self, inode):
        """Everything ``inode`` holds reaches the server (as copies, or written); False if it held
        nothing.  Raises OSError if the server refused the written fallback (what was not written
        stays held)."""
        p = inode.pending
        if p is None:
            return False
        async with p.lock:  # a write in progress may be about to hold data: after it
            if not (p.runs or p.window):
                return False
            await self._commit(p)
        return True

    async def _commit(self, p):
        if p.window:
            await self._decide(p)
        await self._commit_runs(p)

    async def _commit_runs(self, p):
        while p.runs:
            run = p.runs[0]
            done = await self._offload(p.handle, run)
            if done < run.length:
                await self._write_held(p.handle, run, done)
                self.stats.recognised_written += run.length - done
            p.runs.pop(0)
            self.held -= run.length
        self.holding.pop(id(p), None)

    def drop(self, p):
        """Forget what ``p`` holds: its file is gone from reach (the caller logs it)."""
        self.held -= sum(r.length for r in p.runs)
        p.runs.clear()
        p.window = bytearray()
        self.holding.pop(id(p), None)

    async def _offload(self, h, run):
        """Bytes of ``run`` copied by an offload from its start; 0 where the source changed or
        cannot be reached, or no offload took any."""
        src = self.source_of(run.source)
        if src is None:
            return 0
        backend = src.source.backend
        try:
            file = await backend.open(src.node, os.O_RDONLY)
        except OSError as e:
            log.info("a pending copy's source cannot be opened, writing the data: %s", e)
            return 0
        try:
            source = self.endpoint(src, file)
            if version(await backend.getattr(src.node, file), src) != run.version:
                log.info("%s changed since it was read: writing the data copied from it", source.label)
                return 0
            await self.drain(h.inode)  # a write still on its way there could land after the copy
            moved = await self.planner.offload_copy(source, run.src, self.endpoint(h.inode, h.file), run.dst,
                                                    run.length)
            if moved and version(await backend.getattr(src.node, file), src) != run.version:
                return 0  # changed while copied: the held bytes are written over what came
        except OSError as e:
            log.info("a pending copy failed, writing the data: %s", e)
            return 0
        finally:
            with trio.CancelScope(shield=True):
                await backend.release(file)
        for method, n in moved.items():
            if method in OFFLOADS:
                self.stats.recognised_committed[method] += n
        return sum(moved.values())

    async def _write_held(self, h, run, skip):
        pos = run.dst
        for piece in run.held:
            if pos + len(piece) > run.dst + skip:
                cut = max(0, run.dst + skip - pos)
                await self.send(h, pos + cut, piece[cut:])
            pos += len(piece)
