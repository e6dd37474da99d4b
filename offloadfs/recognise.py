"""Recognising copied data: writes that carry bytes this daemon served from a file moments ago.

rsync, shutil (sendfile), dd and tar x copy with read() and write(): the kernel
never sends us a copy request, so every byte would cross the client's link
twice.  Here the data of READ replies is cut into chunks and each chunk is
remembered by a strong hash (``Served``); written data is cut the same way, and
a chunk that hashes the same as a served one is not sent but held as a pending
copy from that file (``Pending``), committed through the planner's offload-only
entry (clone, server-side copy) before anything could see the difference: close,
fsync, a read or size change of the file, a rename, or the bound on what all
files hold.  A file whose written data long matched nothing served is written
uncut, but for a probe now and then (FRESH_RUN).  The source must be as it was
when served (size, times, change attribute, file number), checked before and
after the copy; anything else, and any failure, writes the held bytes instead,
so nothing written is lost.  Those attributes prove it only where they move with
every change (``exact_version``: a change attribute that counts, a fine-grained
ctime); from any other source (SMB) the copy is read back and compared with the
held bytes, and data found there is held only where that costs less than
writing it (``_worth_holding``).  A mount with ``trust_leases`` takes a lease or
delegation held without a gap from the data's read to the commit as proof too:
it sees every other client's write, never a program on the server itself.

The cuts are content-defined (FastCDC): where a chunk ends depends on the bytes
around it, not on its offset, so the same data cuts the same in the file read
and in the file written, whether it lands at the same offset (cp-like tools,
rsync's whole-file temporary files, tar x, dd) or shifted (an rsync update
after bytes were inserted in its basis; dd with skip or seek): after a shift,
the cuts of the two meet again within a chunk or two.

A chunk is labelled with a version seen before it was read, never after.  Some
servers change the version by reading: Linux nfsd on xfs (6.1) bumps the change
attribute with the access time of the first read after a change, so the version
known before that read (cached, the same for all reads of the file for a while)
would never match again.  ``Recogniser.read`` asks once more after the first
read of each version; where it moved, the bytes are read again and labelled
with the new version, and later reads that knew the old one get the new one.

Served data is remembered for the user it was served to (the uid that opened the
handle it went through), and written data matches only what was served to the
user that opened the handle it comes through.  Under allow_other a user could
otherwise learn the bytes of a file only root may read, by writing guesses and
watching ``recognised_bytes`` grow.  Root's writes match only root's reads too:
root's copies read their source as root, and one rule for all keeps the index
simple.
"""
import collections
import contextlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import trio
from blake3 import blake3
from pyfastcdc import FastCDC

from .backends.base import CALLER
from .stats import OFFLOADS

log = logging.getLogger(__name__)

# Chunks of 32 KiB to 128 KiB, some 48 KiB on average.  The cut skips each chunk's first 32 KiB
# (8 KiB, FastCDC's default for this average, took 2.5x the time: 0.49 ms a MiB against 0.20,
# and held a bare-veth read to 484 MiB/s against 567), and finds the same data where it did.
CHUNKER = FastCDC(32 << 10, min_size=32 << 10)
MAX_CHUNK = CHUNKER.max_size
CUT_AT = 2 * MAX_CHUNK  # data gathered before it is cut: the last chunk of a cut may end where the data did
SERVED_CHUNKS = 1 << 15  # chunks remembered: some 1.5 GiB of served data, 19 MB of index
STREAMS = 64  # files whose served data is being cut, least recently read out first
VERSIONS = 4096  # files whose last version served is remembered (Served.find)
# Replies past the end of a file's stream wait for the ones before them (readahead completes in any
# order): while within AHEAD_SPAN of it, fewer than AHEAD_PIECES of that file, AHEAD_MAX in all.
AHEAD_SPAN = 16 << 20
AHEAD_PIECES = 8
AHEAD_MAX = 64 << 20
CHECKED = 1024  # files whose version after a read is remembered (Recogniser.read)
HELD_MAX = 64 << 20  # bytes held for pending copies in all; past it the oldest files commit
WRITE_PIECE = 1 << 20  # held chunks written back after all go together, up to this much a write
# Past FRESH_RUN of a file's written data found nowhere among what was served (an opener's run), its
# writes go out uncut, but for PROBE bytes every PROBE_EVERY, which find a copy that begins further on:
# cutting every byte (some 0.2 ms a MiB) held a bare-veth dd of fresh data to 493 MiB/s against 713
# with detect_copies=off.  A copy past a long run of fresh data may be written for up to PROBE_EVERY.
FRESH_RUN = 16 << 20
PROBE_EVERY = 16 << 20
PROBE = 1 << 20
# A commit the bound makes while a file is still being written ends on a multiple of this, and the
# rest of the run waits: where a chunk ended, the next commit would begin off a block, which no clone
# serves (btrfs and xfs: 4 KiB blocks, 64 KiB covers larger ones), and the server would copy the
# data itself (rsync -a of 1 GiB on a btrfs share: 7.8 s of the 22.4 s).
COMMIT_ALIGN = 64 << 10
VERIFY_PIECE = 8 << 20  # a committed copy is read back and compared a piece at a time (Recogniser._verify)
# Where writing to a server has not been measured, this much of the data held for copies that would be
# read back is written, to measure it (Recogniser._measure_writing); what it cost decides for the rest.
# On the lab's 50 Mbit uplink, 1 MiB of a 128 MiB copy: 1 % + 1 MiB goes up, as issue #30 allows.
WRITE_SAMPLE = 1 << 20
DECIDED_FOR = 60.0  # seconds a choice between reading back and writing stands (_reading_back_pays)


def digest(data):
    """A strong hash of a chunk (BLAKE3: 3.5-5.7 GiB/s on 8-64 KiB chunks here, SHA-256 with
    SHA-NI 1.1-1.5, blake2b 0.8; reading on a bare veth, SHA-256 took a fifth of the daemon's
    CPU, a third with FastCDC's cut)."""
    return blake3(data).digest()


def sample(data):
    """A few bytes of a chunk: written data whose sample no served chunk has is passed over
    without hashing it (hashing every write took 28 % of the daemon's CPU on fresh data)."""
    return len(data), bytes(data[:16]), bytes(data[-16:])


def cuts(data, final):
    """Where the chunks of ``data`` (which begins at a cut) end; the last end is where the data
    does only if ``final`` (nothing follows it) or the chunk reached MAX_CHUNK."""
    ends = [c.offset + c.length for c in CHUNKER.cut_buf(data)]
    if ends and not final and ends[-1] - (ends[-2] if len(ends) > 1 else 0) < MAX_CHUNK:
        ends.pop()
    return ends


def cut(head, data, final):
    """Cut ``head + data`` into chunks: ([(buffer, its chunks' ends)], the bytes left for the next
    cut).  ``head`` begins at a cut (what the last cut left: shorter than MAX_CHUNK);
    ``final``: nothing follows ``data``.  Only the first chunk past ``head`` is cut from a copy: a
    cut depends on nothing before its chunk's start, so ``data`` is cut in place from there on
    (copying every write cost more than cutting it)."""
    if not head:
        ends = cuts(data, final)
        return [(data, ends)], bytes(data[ends[-1] if ends else 0:])
    joined = bytes(head) + bytes(data[:MAX_CHUNK])
    if len(data) <= MAX_CHUNK:
        ends = cuts(joined, final)
        return [(joined, ends)], joined[ends[-1] if ends else 0:]
    ends = cuts(joined, False)  # the first chunk to end past head is decided: more follows it
    taken = next((i for i, end in enumerate(ends) if end >= len(head)), None)
    if taken is None:  # not so for a head that was not left by a cut: all of it from a copy
        joined = bytes(head) + bytes(data)
        ends = cuts(joined, final)
        return [(joined, ends)], joined[ends[-1] if ends else 0:]
    taken += 1
    rest = memoryview(data)[ends[taken - 1] - len(head):]
    more = cuts(rest, final)
    return [(joined, ends[:taken]), (rest, more)], bytes(rest[more[-1] if more else 0:])


def version(st, inode):
    """What changes whenever the source's data may have: a pending copy from it is safe while equal.
    The inode's own count of changes made through this mount is part of it, as servers may
    update the times of a write late (Samba holds the write time of an open file)."""
    return st.size, st.mtime_ns, st.ctime_ns, st.change, st.ino, inode.data_changes


def offload_touched(before, after):
    """True where a source's version ``after`` an offload from it differs from ``before`` only as
    the offload itself may have made it: its ctime and NFS change attribute moved, its size, mtime
    and identity did not.  xfs marks a file shared on its first clone, through the file's ctime and
    change attribute (Linux nfsd 6.1); any write to its data, ours or another client's, moves its
    mtime too."""
    return before[:2] == after[:2] and before[4:] == after[4:]


@dataclass(slots=True, frozen=True)
class Chunk:
    """One chunk as served to ``uid``: ``source`` is the file's inode key."""
    source: tuple
    offset: int
    length: int
    version: tuple
    digest: bytes
    sample: tuple
    uid: int


@dataclass(slots=True)
class Stream:
    """The data served from one file in a row, as of one version: what is not cut yet begins at
    ``start``; replies past its end wait in ``ahead`` (offset -> (bytes, at the end of the file))."""
    version: tuple
    start: int
    begun: int = 0  # where it began
    data: bytearray = field(default_factory=bytearray)
    ahead: dict = field(default_factory=dict)
    eof: bool = False
    cut: bool = False  # chunks were cut from it: it can no longer begin earlier
    # A stream whose first reply completed after later ones had been cut: it ends where those
    # began (``until``), and ``then`` goes on from there.
    until: int | None = None
    then: "Stream | None" = None
    # Its first CUT_AT bytes, while a stream could yet end where this one began (one that begins
    # past the file's start, for AHEAD_SPAN): cut across from that one's data, they are copied too.
    head: bytes | None = None

    def end(self):
        return self.start + len(self.data)


class Served:
    """The chunks of recent READ replies, by hash and by place, least recently served out first.

    A file's replies are cut in the order of their offsets (``Stream``): the kernel's readahead
    may complete them in any order, and a reply that does not follow the ones before (a seek, or
    another version) begins a new stream.  Each user has streams and chunks of their own: a chunk
    is found only for the user it was served to (by_digest is keyed (uid, digest), at and streams
    (uid, source, ...))."""

    def __init__(self, limit=SERVED_CHUNKS):
        self.limit = limit
        self.by_digest = OrderedDict()  # (uid, digest) -> Chunk
        self.samples = collections.Counter()  # (uid, sample) -> chunks in by_digest that have it
        self.at = OrderedDict()  # (uid, source, offset) -> Chunk, the last served last; at most twice limit
        self.streams = OrderedDict()  # (uid, source) -> Stream
        # source -> the version its last reply was served as: chunks of an older one are not found
        # (the source changed since: a copy from them would be written after all).
        self.versions = OrderedDict()
        self.ahead = 0  # bytes in the streams' ahead

    def add(self, uid, source, ver, offset, data, eof):
        """``data`` was served to ``uid`` from ``source`` (as of ``ver``, taken before the read) at
        ``offset``; ``eof``: the reply reached the end of the file."""
        self.now_at(source, ver)
        key = (uid, source)
        first = s = self.streams.get(key)
        while s is not None and s.then is not None and offset >= s.until:
            s = s.then
        if s is not None and s.version == ver and s.begun <= offset and offset + len(data) <= s.start:
            # Cut already, read again (four copies at once: the kernel dropped the pages): the stream
            # goes on, where ending it lost the chunks around where it stood; the chunks the reply
            # begins with are put back as served last.
            end = offset + len(data)
            while (known := self.at.get((uid, source, offset))) is not None and offset + known.length <= end:
                self._put(known)
                offset += known.length
            return
        if s is not None and s.version == ver and s.cut and s is first and s.begun - AHEAD_SPAN <= offset < s.begun:
            # Not the first reply asked for, but the first ones cut: a stream of its own up to them.
            s = self.streams[key] = Stream(ver, offset, offset, until=s.begun, then=s)
        elif s is not None and s.version == ver and not s.cut and s.start - AHEAD_SPAN <= offset < s.start:
            # Not the first reply asked for, but the first to complete: the stream begins here.
            if s.data:
                s.ahead[s.start] = (bytes(s.data), s.eof)
                self.ahead += len(s.data)
            s.data, s.start, s.begun, s.eof = bytearray(), offset, offset, False
            s.head = b"" if offset else None
        if s is not None and s.version == ver and s.start <= offset <= s.end() + AHEAD_SPAN:
            self.streams.move_to_end(key)
        else:
            if first is not None:
                self._end(key, first)
            s = self.streams[key] = Stream(ver, offset, offset, head=b"" if offset else None)
            while len(self.streams) > STREAMS:
                self._end(*next(iter(self.streams.items())))
        if offset > s.end():
            if offset not in s.ahead:
                s.ahead[offset] = (bytes(data), eof)
                self.ahead += len(data)
            if len(s.ahead) < AHEAD_PIECES and self.ahead <= AHEAD_MAX:
                return
            # A gap that the replies in flight will not fill (the reader skipped it): go on past it.
            self._cut(key, s)
            s.data.clear()
            s.start, s.cut = min(s.ahead), True
        else:
            self._append(key, s, offset, data, eof)
        while s.ahead and min(s.ahead) <= s.end():
            at = min(s.ahead)
            piece, last = s.ahead.pop(at)
            self.ahead -= len(piece)
            self._append(key, s, at, piece, last)
        if s.until is not None and s.end() >= s.until:  # it reached the stream that goes on
            self._put_cuts(key, s.version, s.start, cut(s.data, s.then.head or b"", False)[0])
            self.ahead -= sum(len(piece) for piece, _ in s.ahead.values())
            self.streams[key] = s.then
        for other in [k for k, o in self.streams.items() if o.ahead and k != key]:
            if self.ahead <= AHEAD_MAX:
                break
            self._end(other, self.streams[other])

    def now_at(self, source, ver):
        """``source`` is at version ``ver`` (None: gone): its chunks of any other are found no more."""
        self.versions[source] = ver
        self.versions.move_to_end(source)
        while len(self.versions) > VERSIONS:
            self.versions.popitem(last=False)

    def _append(self, key, s, offset, data, eof):
        skip = s.end() - offset  # served before, in this stream
        if s.until is not None and offset + len(data) > s.until:
            data, eof = memoryview(data)[:s.until - offset], False  # the stream that goes on has the rest
        if skip > len(data) or (skip == len(data) and not eof):
            return
        data = memoryview(data)[skip:]
        s.eof = eof
        if s.head is not None:
            if s.end() > s.begun + AHEAD_SPAN:
                s.head = None  # no reply before it is still in flight
            elif len(s.head) < CUT_AT:
                s.head += data[:CUT_AT - len(s.head)]
        if eof or len(s.data) + len(data) >= CUT_AT:
            self._cut(key, s, data)
        else:
            s.data += data

    def _end(self, key, s):
        """The stream ends (and those it goes on into): its data is cut where the content says,
        but for the last chunk, unless it ends the file."""
        del self.streams[key]
        while s is not None:
            self.ahead -= sum(len(piece) for piece, _ in s.ahead.values())
            self._cut(key, s)
            s = s.then

    def _cut(self, key, s, data=b""):
        """Cut what ``s`` holds and ``data``, which follows it; what is left waits in ``s``."""
        groups, rest = cut(s.data, data, s.eof)
        pos = self._put_cuts(key, s.version, s.start, groups)
        s.cut = s.cut or pos > s.start
        s.data, s.start = bytearray(rest), pos

    def _put_cuts(self, key, ver, pos, groups):
        """Put the chunks ``cut`` gave for data at ``pos`` served to ``key`` (uid, source); where they end."""
        uid, source = key
        for buf, ends in groups:
            view = memoryview(buf)
            begin = 0
            for end in ends:
                known = self.at.get((uid, source, pos + begin))
                if known is not None and known.version == ver and known.length == end - begin:
                    self._put(known)  # the same bytes again: no need to hash them
                else:
                    piece = view[begin:end]
                    self._put(Chunk(source, pos + begin, end - begin, ver, digest(piece), sample(piece), uid))
                begin = end
            pos += begin
        return pos

    def _put(self, chunk):
        place, hashed = (chunk.uid, chunk.source, chunk.offset), (chunk.uid, chunk.digest)
        old = self.at.get(place)
        if old is not None and self.by_digest.get((old.uid, old.digest)) is old:
            self._drop(old)
        if hashed not in self.by_digest:
            self.samples[chunk.uid, chunk.sample] += 1
        self.by_digest[hashed] = chunk
        self.by_digest.move_to_end(hashed)
        self.at.pop(place, None)
        self.at[place] = chunk
        while len(self.at) > 2 * self.limit:  # chunks of bytes served since from elsewhere (zeros) stay here
            self.at.popitem(last=False)
        while len(self.by_digest) > self.limit:
            gone = next(iter(self.by_digest.values()))
            self._drop(gone)
            if self.at.get((gone.uid, gone.source, gone.offset)) is gone:
                del self.at[(gone.uid, gone.source, gone.offset)]

    def _drop(self, chunk):
        del self.by_digest[(chunk.uid, chunk.digest)]
        self.samples[chunk.uid, chunk.sample] -= 1
        if not self.samples[chunk.uid, chunk.sample]:
            del self.samples[chunk.uid, chunk.sample]

    def find(self, uid, data, next_to=None, offset=None):
        """The chunk served to ``uid`` of the bytes ``data``, written at ``offset``.  ``next_to`` ((source,
        offset)) is asked first, so that a run from one file goes on there rather than jumping to
        another file with the same bytes; then the chunk at ``offset`` in the file that served those
        bytes last, as cp-like tools copy to the same offsets, so that a file of one repeated chunk
        (zeros) makes one run, not a run a chunk from wherever that chunk was served last."""
        if (uid, sample(data)) not in self.samples:
            return None
        hashed, length = digest(data), len(data)
        chunk = self.by_digest.get((uid, hashed))
        for here in (None if next_to is None else self.at.get((uid, *next_to)),
                     None if chunk is None else self.at.get((uid, chunk.source, offset)), chunk):
            if (here is not None and here.digest == hashed and here.length == length
                    and self.versions.get(here.source, here.version) == here.version):
                return here
        return None


@contextlib.contextmanager
def acting_for(h):
    """A commit acts for whoever opened ``h``, the handle the held data came through, whichever
    request makes it (a read of the file, another file's write past the bound): its requests go as
    that user, and its copy in flight is theirs in `offloadfs status`."""
    token = CALLER.set(h.caller)
    try:
        yield
    finally:
        CALLER.reset(token)


@dataclass(slots=True)
class Run:
    """Written bytes at ``dst`` that are the bytes of ``source`` at ``src``, held until committed."""
    dst: int
    source: tuple
    src: int
    version: tuple
    lease: object = None  # the lease its data was read under, where trusted (Recogniser.read); else None
    held: list = field(default_factory=list)  # memoryviews, in order
    length: int = 0


@dataclass(slots=True)
class Pending:
    """What one file holds: runs to commit, and the window (the data written in a row since the
    last cut, not yet decided).  ``handle`` is the open file the data came through and is
    committed by."""
    key: tuple = ()  # the file's inode key: its own chunks are no source for it
    handle: object = None
    runs: list = field(default_factory=list)
    window_at: int = 0
    window: bytearray = field(default_factory=bytearray)
    lock: trio.Lock = field(default_factory=trio.Lock)
    fresh: int = 0  # bytes decided in a row that no served chunk had, since ``handle`` began
    passed: int = 0  # bytes sent uncut since the last probe
    probe: int = 0  # bytes the probe under way has yet to decide

    def end(self):
        """Where the written data ends, as far as it is held here (0: nothing held)."""
        ends = [r.dst + r.length for r in self.runs]
        if self.window:
            ends.append(self.window_at + len(self.window))
        return max(ends, default=0)


class Recogniser:
    """Served chunks and the pending copies of a mount.

    ``send(handle, offset, data)`` writes to the server as usual (maybe still on its way when it
    returns: writebehind.py), ``drain(inode)`` waits for what was sent to ``inode``, ``source_of(key)``
    is the live inode of an inode key (or None), ``endpoint(inode, file)`` the planner's Endpoint."""

    def __init__(self, stats, planner, send, drain, source_of, endpoint, held_max=HELD_MAX, trust_leases=False):
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
        # (source key, version its data was served as) -> the version our own offloads from it left
        # (offload_touched), which a later commit of data served as the first finds unchanged.
        self.offloaded = OrderedDict()
        self.held = 0
        self.decided = {}  # id(backend) -> (whether reading back pays, until when): _reading_back_pays
        self.read_before = {}  # id(backend) -> what reading 8 MiB took before writing was measured
        # id(backend) whose sample (_measure_writing) went out and is not measured yet: the writes
        # behind it answer before they land, and each write until then took another (3.4 MiB of a
        # 256 MiB copy went up, not 1).
        self.sampled = set()
        self.holding = {}  # id(Pending) -> Pending with runs, oldest first: what backpressure commits
        self.trust_leases = trust_leases
        # source key -> (its inode, our own open file of it), held while data held comes from it (_pin);
        # None while that open is on its way.
        self.pins = {}

    # -- reads --------------------------------------------------------------------------

    async def read(self, h, offset, size, st):
        """READ ``size`` bytes at ``offset`` through the open file ``h``, their chunks remembered as
        served to whoever opened it (the kernel's readahead READs carry the reader's uid too, but
        the opener is who the open was checked for).  ``st``: the file's attributes as known before
        the read (maybe cached)."""
        inode, file = h.inode, h.file
        backend = inode.source.backend
        ver = version(st, inode)
        lease = self._lease(inode)
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
        if self.trust_leases:
            # Served data is labelled with the lease it was read under too (None: no lease held from
            # before the read to after it): data read under another, or none, is another version.
            ver = (ver, lease if lease == self._lease(inode) else None)
        self.served.add(h.caller.uid, inode.key, ver, offset, data, len(data) < size or offset + len(data) >= st.size)
        return data

    def _lease(self, inode):
        """``inode``'s lease or delegation while held, where the mount trusts them (trust_leases): the
        same value for as long as it holds without a gap (Leases.caching); else None."""
        if not self.trust_leases or not inode.source.leases:
            return None
        return inode.source.backend.caching(inode.node)

    def _proven(self, src, run):
        """Whether ``src``, the source of ``run``, is known to hold what was read from it: its
        attributes move with every change, or (trust_leases) the lease it was read under still holds,
        without a gap since."""
        return src.source.backend.exact_version or (run.lease is not None and self._lease(src) == run.lease)

    # -- writes -------------------------------------------------------------------------

    async def write(self, h, offset, data):
        """Take a write through ``h``: its copied chunks are held, the rest sent; returns once each
        byte is one or the other (the chunks the next write may change wait in the window)."""
        inode = h.inode
        if inode.pending is None:
            inode.pending = Pending(inode.key)
        p = inode.pending
        async with p.lock:
            if p.handle is not h:
                if p.runs or p.window:
                    with acting_for(p.handle):
                        await self._commit(p)  # another opener's data goes first, as it came first
                p.handle, p.fresh, p.passed, p.probe = h, 0, 0, 0
            await self._write(p, offset, memoryview(data))
        while self.held > self.held_max and self.holding:
            oldest = next(iter(self.holding.values()))
            async with oldest.lock:
                with acting_for(oldest.handle):
                    await self._commit_runs(oldest, aligned=True)
            await self._unpin()

    def write_now(self, h, offset, data):
        """Take a write through ``h`` that only grows the window (no chunk of it is decided): True;
        False where ``write`` must take it.  No lock: nothing else runs meanwhile."""
        p = h.inode.pending
        if (p is None or p.handle is not h or p.lock.locked() or not p.window
                or offset != p.window_at + len(p.window) or len(p.window) + len(data) >= CUT_AT):
            return False
        end = offset + len(data)
        if any(r.dst < end and offset < r.dst + r.length for r in p.runs):
            return False
        p.window += data
        return True

    async def _write(self, p, offset, view):
        end = offset + len(view)
        if p.window and offset != p.window_at + len(p.window):
            await self._take(p, final=True)  # not in a row: the window will not grow
        if any(r.dst < end and offset < r.dst + r.length for r in p.runs):
            await self._commit_runs(p)  # written over: what was held goes first
        if self._uncut(p, len(view)):
            if p.window:
                await self._take(p, final=True)
            await self.send(p.handle, offset, view)
            return
        if not p.window:
            p.window_at = offset
        if len(p.window) + len(view) < CUT_AT:
            p.window += view
        else:
            await self._take(p, view)

    def _uncut(self, p, size):
        """True where the next ``size`` bytes written to ``p`` go out without being cut: nothing was
        served to match them, or they follow FRESH_RUN of fresh data and no probe is due."""
        if not (self.served.by_digest or self.served.streams):
            return True
        if p.fresh < FRESH_RUN or p.probe > 0:
            return False
        p.passed += size
        if p.passed < PROBE_EVERY:
            return True
        p.passed, p.probe = 0, PROBE
        return False

    async def _take(self, p, view=b"", final=False):
        """Decide the chunks of the window and of ``view``, which follows it: each one served is
        held, the others sent, together where they follow each other; unless ``final``, the last
        one waits in the window for what follows it."""
        groups, rest = cut(p.window, view, final)
        pos = p.window_at
        for buf, ends in groups:
            view = memoryview(buf)
            plain = None  # where the bytes not matched so far begin
            begin = 0
            for end in ends:
                chunk = view[begin:end]
                served = self._find(p, pos + begin, chunk)
                p.probe -= len(chunk)
                if served is None:
                    p.fresh += len(chunk)
                    plain = begin if plain is None else plain
                else:
                    p.fresh = 0
                    if plain is not None:
                        await self.send(p.handle, pos + plain, view[plain:begin])
                        plain = None
                    self._hold(p, pos + begin, chunk, served)
                    if self.trust_leases:
                        await self._pin(p.runs[-1])
                begin = end
            if plain is not None:
                await self.send(p.handle, pos + plain, view[plain:begin])
            pos += begin
        p.window, p.window_at = bytearray(rest), pos
        await self._measure_writing(p)

    def _find(self, p, dst, data):
        next_to = None
        if p.runs:
            last = p.runs[-1]
            if last.dst + last.length == dst:
                next_to = (last.source, last.src + last.length)
        served = self.served.find(p.handle.caller.uid, data, next_to, dst)
        if served is None or served.source == p.key or not self._worth_holding(p, served):
            return None
        return served

    def _worth_holding(self, p, served):
        """Whether data of ``p`` found in ``served`` is to be held for a copy.  From a source whose
        attributes prove nothing, the copy must be read back (_commit_run), which only pays where
        reading costs less than writing: elsewhere (a symmetric link) the bytes go out as they come,
        side by side with the program's reads, as without recognition (held to the close, then
        written or read back, rsync of 256 MiB took twice as long on the lab's 1 Gbit link).
        Unmeasured, it is held (and _measure_writing measures)."""
        src = self.source_of(served.source)
        if src is None or src.source.backend.exact_version or self._labelled(served)[1] is not None:
            return True
        return self._reading_back_pays(p.handle.inode.source.backend) is not False

    def _reading_back_pays(self, backend):
        """Planner.verify_pays for copies into ``backend``, as decided when first measured and kept
        for DECIDED_FOR: once the choice is made, the program's own traffic measures its pace, not
        the link (its reads slow to the pace of its writes where these go out, on a 50 Mbit uplink
        to 0.4-0.9 s for 8 MiB from 0.1), and would keep a wrong choice.  None: not measured yet."""
        now = trio.current_time()
        decided = self.decided.get(id(backend))
        if decided is not None and now < decided[1]:
            return decided[0]
        pays = self.planner.verify_pays(backend, VERIFY_PIECE, self.read_before.get(id(backend)))
        if pays is not None:
            self.decided[id(backend)] = (pays, now + DECIDED_FOR)
            self.read_before.pop(id(backend), None)
            self.sampled.discard(id(backend))
        return pays

    async def _measure_writing(self, p):
        """While writing to ``p``'s server is unmeasured, the first WRITE_SAMPLE held from sources
        that prove nothing is written at once, as one piece: its time tells the rate that decides
        for the rest (_worth_holding).  The chunks found, written as they came, were no measure:
        each waited for the program's next write, and the pace they gave was the program's."""
        backend = p.handle.inode.source.backend
        if not p.runs or id(backend) in self.sampled or self._reading_back_pays(backend) is not None:
            return
        unproven = [r for r in p.runs if (src := self.source_of(r.source)) is not None
                    and not self._proven(src, r)]
        if sum(r.length for r in unproven) < WRITE_SAMPLE:
            return
        # What reading takes, before the sample goes up: on a slow uplink the sample's bytes delay
        # the acknowledgements of what comes down, and reads measured meanwhile (0.36 s for 8 MiB
        # against 0.10 on the lab's 50 Mbit uplink) would take it for a symmetric link.
        self.read_before[id(backend)] = self.planner.costs.predict(id(backend), "read", VERIFY_PIECE)
        self.sampled.add(id(backend))
        for run in unproven:
            await self._write_run(p.handle, run, 0, run.length, unchecked=True)
            p.runs.remove(run)
            self.held -= run.length
        if not p.runs:
            self.holding.pop(id(p), None)

    def _labelled(self, served):
        """(version, lease) a served chunk was read as (Recogniser.read)."""
        return served.version if self.trust_leases else (served.version, None)

    def _hold(self, p, dst, data, served):
        ver, lease = self._labelled(served)
        last = p.runs[-1] if p.runs else None
        if not (last is not None and last.source == served.source and last.version == ver
                and last.lease == lease and last.dst + last.length == dst
                and last.src + last.length == served.offset):
            last = Run(dst, served.source, served.offset, ver, lease)
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
            with acting_for(p.handle):
                await self._commit(p)
        await self._unpin()
        return True

    async def _pin(self, run):
        """Open the source of ``run`` ourselves, and keep it open until nothing held comes from it:
        a lease lasts while the file is open, and rsync's sender and tar c close their source
        before the copy's close commits it (the commit would then find the lease gone, and read
        back).  Opened under the lease the data was read under, so it goes on without a gap."""
        if run.lease is None or run.source in self.pins:
            return
        src = self.source_of(run.source)
        if src is None or self._lease(src) != run.lease:
            return  # the lease is gone already: the commit reads back
        self.pins[run.source] = None
        try:
            file = await src.source.backend.open(src.node, os.O_RDONLY)
        except OSError as e:
            del self.pins[run.source]
            log.debug("a copy's source cannot be kept open, its lease may end before the commit: %s", e)
            return
        self.pins[run.source] = (src, file)

    async def _unpin(self):
        """Close the sources kept open (_pin) that nothing held comes from any more."""
        held_from = {r.source for p in self.holding.values() for r in p.runs}
        for key in [k for k, pin in self.pins.items() if pin is not None and k not in held_from]:
            src, file = self.pins.pop(key)
            with trio.CancelScope(shield=True):
                await src.source.backend.release(file)

    async def _commit(self, p):
        if p.window:
            await self._take(p, final=True)
        await self._commit_runs(p)

    async def _commit_runs(self, p, aligned=False):
        """Commit what ``p`` holds; ``aligned``: but for the end of its last run past a multiple of
        COMMIT_ALIGN (the file's next write may make it longer), where something else is committed."""
        rest = self._unaligned_end(p) if aligned and p.runs else None  # (committed while we waited)
        while p.runs:
            run = p.runs[0]
            await self._commit_run(p.handle, run)
            p.runs.pop(0)
            self.held -= run.length
        if rest is not None:
            p.runs.append(rest)
        else:
            self.holding.pop(id(p), None)

    def _unaligned_end(self, p):
        """Take the end of ``p``'s last run past its last multiple of COMMIT_ALIGN off it: that
        end, as a run of its own; None where that is the whole of what ``p`` holds."""
        last = p.runs[-1]
        keep = (last.dst + last.length) % COMMIT_ALIGN
        if keep == 0 or (keep >= last.length and len(p.runs) == 1):
            return None
        if keep >= last.length:
            return p.runs.pop()
        cut = last.length - keep
        rest = Run(last.dst + cut, last.source, last.src + cut, last.version, last.lease, length=keep)
        pos = 0
        for i, piece in enumerate(last.held):
            if pos + len(piece) > cut:
                rest.held = [piece[cut - pos:]] + last.held[i + 1:]
                last.held = last.held[:i] + ([piece[:cut - pos]] if cut > pos else [])
                break
            pos += len(piece)
        last.length = cut
        return rest

    def drop(self, p):
        """Forget what ``p`` holds: its file is gone from reach (the caller logs it)."""
        self.held -= sum(r.length for r in p.runs)
        p.runs.clear()
        p.window = bytearray()
        self.holding.pop(id(p), None)

    async def _commit_run(self, h, run):
        """Commit ``run``: by an offload where that is safe and pays, the rest written.

        Only a source whose attributes move with every change (``exact_version``) proves by
        them that it was not rewritten since it was read.  From any other (Samba: the ctime is
        the mtime, an open file's write time is held, a rewrite may put the times back), what
        the offload left is read back and compared with the held bytes, and what differs is
        written: the program's bytes, whatever the source holds now.  Where reading back is
        expected to cost as much as writing (_reading_back_pays: a symmetric link measured since
        the bytes were held), they are written."""
        src = self.source_of(run.source)
        if src is not None and not self._proven(src, run) and self._reading_back_pays(h.inode.source.backend) is False:
            await self._write_run(h, run, 0, run.length, unchecked=True)
            return
        done = await self._offload(h, run) if src is not None else 0
        if done and not self._proven(src, run):  # asked after the copy: a lease held since covers it
            await self._verify(h, run, 0, done)
        if done < run.length:
            await self._write_run(h, run, done, run.length)

    async def _verify(self, h, run, start, end):
        """Read back ``run`` from ``start`` to ``end`` (offsets in the run) as the file holds it and
        write the held bytes over each piece that differs (an opener of our own reads the server's
        data, not the kernel's pages)."""
        backend = h.inode.source.backend
        file = await backend.open(h.inode.node, os.O_RDONLY)
        try:
            started = trio.current_time()
            for at in range(start, end, VERIFY_PIECE):
                stop = min(end, at + VERIFY_PIECE)
                if await backend.read(file, run.dst + at, stop - at) != self._held(run, at, stop):
                    log.info("%s: a recognised copy's source changed before it was copied: writing "
                             "%d bytes at %d", self.endpoint(h.inode, h.file).label, stop - at, run.dst + at)
                    await self._write_run(h, run, at, stop)
                    self.stats.written_over(stop - at)
            self.planner.carried(backend, "read", started, end - start)
            self.stats.read_back(end - start)
        finally:
            with trio.CancelScope(shield=True):
                await backend.release(file)

    @staticmethod
    def _held(run, start, end):
        """The held bytes of ``run`` from ``start`` to ``end`` (offsets in the run)."""
        out, pos = [], 0
        for piece in run.held:
            if pos >= end:
                break
            if pos + len(piece) > start:
                out.append(piece[max(0, start - pos):end - pos])
            pos += len(piece)
        return b"".join(out)

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
            if isinstance(e, FileNotFoundError):
                self.served.now_at(run.source, None)
            return 0
        try:
            source = self.endpoint(src, file)
            before = version(await backend.getattr(src.node, file), src)
            if before not in (run.version, self.offloaded.get((run.source, run.version))):
                log.info("%s changed since it was read: writing the data copied from it", source.label)
                self.served.now_at(run.source, before)
                return 0
            await self.drain(h.inode)  # a write still on its way there could land after the copy
            moved = await self.planner.offload_copy(source, run.src, self.endpoint(h.inode, h.file), run.dst,
                                                    run.length)
            if moved:
                after = version(await backend.getattr(src.node, file), src)
                if after != before:
                    if not offload_touched(before, after):
                        log.info("%s changed while copied: writing the data copied from it", source.label)
                        return 0  # the held bytes are written over what came
                    self.offloaded[run.source, run.version] = after
                    self.offloaded.move_to_end((run.source, run.version))
                    while len(self.offloaded) > VERSIONS:
                        self.offloaded.popitem(last=False)
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

    async def _write_run(self, h, run, start, end, unchecked=False):
        """Write the held bytes of ``run`` from ``start`` to ``end`` (offsets in the run): recognised,
        written after all; ``unchecked``: as reading back would not pay.  WRITE_PIECE a write: a
        write a chunk (some 48 KiB) each cost its request, and 256 MiB recognised from a file another
        client had deleted since took 6.5 times as long as written fresh (dd on the Samba lab's bare
        veth)."""
        for at in range(start, end, WRITE_PIECE):
            stop = min(end, at + WRITE_PIECE)
            await self.send(h, run.dst + at, self._held(run, at, stop))
        self.stats.recognised_written += end - start
        if unchecked:
            self.stats.recognised_unchecked += end - start
