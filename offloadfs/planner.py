"""The copy planner: every copy request comes here, and only here is the method chosen.

Order of preference, each tried only where the backends offer it:
clone (copy-on-write, near free) -> server-side copy (the data moves on the
server, not over our link) -> inter-server copy -> our own streaming copy.
An offload that the cost model, fed by earlier copies on the same route,
expects to be slower than streaming this size is skipped: offloading must
never lose.  Nor is the model trusted blindly: a running method is watched,
and one that falls behind what another would need for the rest (a server
that got busy, a link that got slow) gives way to it mid-copy.  A method
that cannot serve the request raises NotSupported and
the next one takes over from the byte where the last stopped, so a copy is
never handed back to the kernel (whose fallback is slower: 64 KiB writes
through FUSE).
"""
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import trio

from .costs import CostModel

from .backends.base import UNREACHABLE, CloneRange, InterServerCopy, NotSupported, ServerCopy
from .backends.parallel import together

log = logging.getLogger(__name__)

STREAM_CHUNK = 8 << 20
STREAM_AHEAD = 2  # chunks read ahead of the writer
# A running method gives way to another when it is expected to take this much longer than
# the other for the rest of the copy; the watcher looks every WATCH seconds.
SWITCH_RATIO = 1.5
WATCH = 0.1
# A recognised copy is committed and read back only where reading it is expected to take less than
# this share of the time writing it would (Planner.verify_pays).  The bytes written go up beside the
# program's reads on a full-duplex link, while reading back comes after them, on the same way down:
# it pays where reading takes less than what writing adds to the reads, write - read, so below 1/2.
# A fresh mount's write rate comes from one write of 1 MiB, whose fixed cost counts as rate: on the
# lab's 1 Gbit link, both CPUs busy, 8 MiB were predicted at 0.19-0.24 s against 0.08-0.10 read.
# Links faster down than up are so by far more than that (the lab's 20:1; 4:1 and up for cable and DSL).
VERIFY_SHARE = 0.25
# A failed copy cuts off what it may have left past its end (see Planner.trim); errors that say
# the server is out of reach now (UNREACHABLE) are retried this long, every TRIM_RETRY seconds.
TRIM_WAIT = 20
TRIM_RETRY = 0.5
# An interrupted copy is answered at once (the process is being killed): its cut gets this long.
TRIM_WAIT_INTERRUPTED = 0.25


@dataclass(slots=True, eq=False)
class Watched:
    """A method running on ``route`` with ``rivals`` it may give way to (see Planner._watch):
    it began when ``record`` (the copy) had ``done`` bytes, at ``started``; ``seen`` bytes at
    ``last`` are its latest progress; ``run`` is cancelled for the ``switch`` to a rival."""
    route: tuple
    rivals: list
    rest: int
    record: object
    run: trio.CancelScope
    done: int
    started: float
    seen: int
    last: float
    due: float
    switch: str | None = None


@dataclass(slots=True)
class Endpoint:
    """One side of a copy: where the file lives and how it is open."""
    backend: object
    node: object
    file: object
    label: str


def plan(src: Endpoint, dst: Endpoint, offload: bool):
    """The methods to try, best first, for a copy from ``src`` to ``dst``."""
    methods = []
    if offload and src.backend.shares_server_with(dst.backend):
        if isinstance(dst.backend, CloneRange):
            methods.append("clone")
        if isinstance(dst.backend, ServerCopy):
            methods.append("server_copy")
    elif offload and isinstance(dst.backend, InterServerCopy):
        methods.append("inter_server_copy")
    methods.append("stream")
    return methods


class Planner:
    def __init__(self, stats, offload=True, always=False):
        """``always``: offload wherever the backends can, whatever the cost model says."""
        self.stats = stats
        self.offload = offload
        self.always = always
        self.costs = CostModel(trio.current_time)
        self._watched = set()  # Watched: the methods running with rivals
        self._watching = False  # whether the task of _watch is alive

    def carried(self, backend, op, started, nbytes):
        """A user's read or write (``op``) through ``backend`` that began at ``started``
        (trio.current_time()): what streaming from or to it costs."""
        self.costs.carried(id(backend), op, started, nbytes)

    def choose(self, route, methods, length):
        """The methods in the order to try them: offloads expected to lose against streaming
        ``length`` bytes on ``route`` come after streaming (a watched stream that turns out
        slower gives way to them, see _attempt)."""
        offloads = methods[:-1]
        if not offloads or self.always:
            return methods
        stream = self.costs.predict(route, "stream", length)
        costs = {m: self.costs.predict(route, m, length) if self.costs.trusted(route, m) else None
                 for m in offloads}
        if stream is None:
            # Streaming unmeasured: stream to learn it where an offload's cost is known to watch it against.
            return ["stream"] + offloads if any(c is not None for c in costs.values()) else methods
        faster, slower = [], []
        for m in offloads:
            (faster if costs[m] is None or costs[m] < stream else slower).append(m)
        return faster + ["stream"] + slower

    def verify_pays(self, backend, length, read=None):
        """Whether a recognised copy of ``length`` bytes into ``backend`` is worth committing by an
        offload that is then read back (recognise.py), rather than writing the bytes held for it.
        On a link faster down than up (the lab's 1 Gbit/50 Mbit), reading back costs a fraction
        of writing; on a symmetric one as much, and the offload and the comparison come on top:
        there the bytes are written.  None where writing's rate has not been measured (the
        caller measures it: the few small writes of a copy's unmatched bytes gave a slope that
        took the lab's 50 Mbit uplink for a fast one); reading unmeasured, it is tried, and so
        measured.  ``read``: what reading took, measured by the caller, where what the model
        holds now is not the link's."""
        if self.always:
            return True
        write = self.costs.predict(id(backend), "write", length)
        if write is None or not self.costs.rated(id(backend), "write"):
            return None
        if read is None:
            read = self.costs.predict(id(backend), "read", length)
        return read is None or read < write * VERIFY_SHARE

    async def copy(self, src: Endpoint, off_in, dst: Endpoint, off_out, length, stats=None):
        """Copy up to ``length`` bytes; returns the count, short at the source's EOF or where a
        failure cut the copy after a first part (the caller asks again for the rest and gets the
        error then, as with any copy_file_range).  A copy that fails leaves what a plain copy
        leaves: the part done without a gap, and no more (see trim).  ``stats``: the attributes
        of source and destination where the caller holds them, else they are asked for.  A source
        cut short since is safe: an offload past its end fails, and streaming stops at the end."""
        return sum((await self._copy(src, off_in, dst, off_out, length, False, stats)).values())

    async def offload_copy(self, src: Endpoint, off_in, dst: Endpoint, off_out, length):
        """As copy, but only by the offloads (recognise.py holds the bytes, and writes what is left);
        returns {method: bytes}, from ``off_in`` on without a gap; {} where none would serve."""
        return await self._copy(src, off_in, dst, off_out, length, True)

    async def _copy(self, src, off_in, dst, off_out, length, offload_only, stats=None):
        src_st, dst_st = stats or await together([lambda: src.backend.getattr(src.node, src.file),
                                                  lambda: dst.backend.getattr(dst.node, dst.file)])
        length = min(length, max(0, src_st.size - off_in))
        route = (id(src.backend), id(dst.backend))
        methods = plan(src, dst, self.offload)
        # Offload only: the caller holds the bytes, so there is nothing to learn by streaming them.
        methods = methods[:-1] if offload_only else self.choose(route, methods, length)
        if length == 0 or not methods:
            return {}
        record = self.stats.start_copy(src.label, dst.label, length, recognised=offload_only)
        failed = True
        try:
            head = clone_head(dst.backend, off_in, off_out, length) if methods[0] == "clone" else 0
            if head and len(methods) > 1:
                # Both offsets off a block the same way: the next method up to the boundary, a
                # clone from there (else the clone refuses and the next method takes it all).
                await self._attempt(route, methods[1], [], src, off_in, dst, off_out, head, record)
            gave_way = set()
            while methods and record.bytes_done < length:
                method = methods.pop(0)
                rivals = [] if self.always else [m for m in methods if m not in gave_way]
                if method != "stream":
                    rivals = [m for m in rivals if m == "stream"]
                rival = await self._attempt(route, method, rivals, src, off_in, dst, off_out, length, record)
                if rival is not None:
                    log.info("copy to %s: %s gives way to %s at byte %d", dst.label, method, rival,
                             record.bytes_done)
                    self.stats.switched(record, rival)
                    gave_way.add(method)
                    methods = [rival] + [m for m in methods if m != rival]
                    if "stream" not in methods:
                        methods.append("stream")  # the last resort, should the offload refuse
            failed = False
            return record.by_method
        except BaseException as e:
            # Cancelled (maybe in a group, from parallel spans): the request was interrupted.
            wait = TRIM_WAIT_INTERRUPTED if trio.current_effective_deadline() == -math.inf else TRIM_WAIT
            with trio.CancelScope(shield=True):
                await self.trim(dst, dst_st.size, off_out + record.bytes_done, wait)
            if record.bytes_done and isinstance(e, OSError):
                log.info("copy to %s failed after %d bytes: %s", dst.label, record.bytes_done, e)
                return record.by_method
            raise
        finally:
            self.stats.end_copy(record, failed)
            log.debug("%s %s -> %s: %d bytes in %.3f s by %s%s", "recognised copy" if offload_only else "copy",
                      src.label, dst.label, record.bytes_done, time.time() - record.started,
                      methods_used(record.by_method), ", failed" if failed else "")

    async def trim(self, dst, old_size, end, wait=TRIM_WAIT):
        """Cut the destination back to ``end`` (the part written without a gap), where a failed copy
        or write made it longer than it was: pieces in flight side by side (streamed writes,
        server-side copies, writes behind) may have landed beyond a piece that failed, and a file
        that ends past data never written would pass for a whole one with holes.  A server that went
        away is waited for ``wait`` seconds (the error waits with it); one that stays away leaves
        the file as it was when it went, and a warning says so."""
        keep = max(old_size, end)
        with trio.move_on_after(wait):
            while True:
                try:
                    if (await dst.backend.getattr(dst.node, dst.file)).size > keep:
                        await dst.backend.setattr(dst.node, dst.file, size=keep)
                    return
                except OSError as e:
                    if e.errno not in UNREACHABLE:
                        break
                    await trio.sleep(TRIM_RETRY)
        log.warning("a failed copy or write may have left %s longer than what was written (%d bytes): "
                    "its server could not be reached to cut it", dst.label, keep)

    async def _attempt(self, route, method, rivals, src, off_in, dst, off_out, length, record):
        """Run ``method`` on the rest of the copy, watched against ``rivals``; times it into the
        cost model.  Returns the rival it stopped for (the copy goes on from record.bytes_done,
        the part done without a gap), or None: done, or NotSupported."""
        done, started = record.bytes_done, trio.current_time()
        rest = length - done
        record.method = method  # what `offloadfs status` shows while it runs
        run = trio.CancelScope()
        watched = None
        if rivals:
            watched = Watched(route, rivals, rest, record, run, done, started, done, started, started + WATCH)
            self._watched.add(watched)
            if not self._watching:
                self._watching = True
                trio.lowlevel.spawn_system_task(self._watch)
        try:
            with run:
                await getattr(self, "_" + method)(src, off_in + done, dst, off_out + done, rest, record)
        except NotSupported:
            pass
        finally:
            self._watched.discard(watched)
            moved, seconds = record.bytes_done - done, trio.current_time() - started
            switch = watched and watched.switch
            if moved or switch is not None:
                # What it moved, in the time it took; one that gave way moving nothing took at
                # least this long for the rest.
                self.costs.record(route, method, moved or rest, seconds)
        return switch if record.bytes_done - done < rest else None  # done as the watcher spoke: no switch

    async def _watch(self):
        """Look at each watched method every WATCH seconds from its start, and stop one that a
        rival would now beat.  One task watches them all while any runs, and a little after: a
        task (and its nursery) for each copy cost a 1 KiB cp on ext4 0.1 ms, 4 % of it."""
        try:
            while self._watched:
                await trio.sleep_until(min(w.due for w in self._watched))
                now = trio.current_time()
                for w in [w for w in self._watched if w.due <= now]:
                    if w.record.bytes_done > w.seen:  # progress comes in steps: a rate from the last one
                        w.seen, w.last = w.record.bytes_done, now
                    w.due = now + WATCH
                    try:
                        w.switch = self._rival(w.route, w.rivals, w.rest, w.seen - w.done, w.last - w.started,
                                               now - w.last)
                    except Exception:  # a fault here would take the whole daemon down (a system task)
                        log.exception("copy to %s: watching it failed; it runs on unwatched", w.record.destination)
                        self._watched.discard(w)
                        continue
                    if w.switch is not None:
                        self._watched.discard(w)
                        w.run.cancel()
        finally:
            self._watching = False

    def _rival(self, route, rivals, rest, moved, moving, waiting):
        """The rival to switch to, if any: the running method moved ``moved`` of ``rest`` bytes in
        its first ``moving`` seconds, and nothing more in the ``waiting`` seconds since."""
        left = rest - moved
        best = None
        for rival in rivals:
            cost = self.costs.predict(route, rival, left)
            if cost is None:
                continue
            # At its pace so far, or (nothing moved yet) with no more to show for the wait than
            # the rival would have needed for everything left.
            mine = left * moving / moved if moved else 0.0
            if max(mine, waiting) > SWITCH_RATIO * cost and (best is None or cost < best[1]):
                best = (rival, cost)
        return None if best is None else best[0]

    async def _clone(self, src, off_in, dst, off_out, length, record):
        n = await dst.backend.clone_range(src.file, off_in, dst.file, off_out, length)
        self.stats.moved(record, "clone", n, True)
        return n

    async def _server_copy(self, src, off_in, dst, off_out, length, record):
        return await self._loop("server_copy", dst.backend.server_copy, src.file, off_in, dst.file, off_out,
                                length, record)

    async def _inter_server_copy(self, src, off_in, dst, off_out, length, record):
        async def pull(*args):
            return await dst.backend.inter_server_copy(src.backend, *args)
        return await self._loop("inter_server_copy", pull, src.file, off_in, dst.file, off_out, length, record)

    async def _loop(self, method, copy, src_file, off_in, dst_file, off_out, length, record):
        """Servers cap one copy (Linux nfsd: 4 MiB) and short counts are normal: go on until done."""
        done = 0
        while done < length:
            try:
                n = await copy(src_file, off_in + done, dst_file, off_out + done, length - done)
            except NotSupported:
                if done == 0:
                    raise
                break
            if n == 0:
                break  # the source ended early
            self.stats.moved(record, method, n, done == 0)
            done += n
        return done

    async def _stream(self, src, off_in, dst, off_out, length, record):
        """Our own copy: the next chunk is read while the last one is written, so on a network
        backend both directions of the link stay busy."""
        send, receive = trio.open_memory_channel(STREAM_AHEAD)

        async def read_ahead():
            async with send:
                pos = 0
                while pos < length:
                    data = await src.backend.read(src.file, off_in + pos, min(STREAM_CHUNK, length - pos))
                    if not data:
                        break
                    try:
                        await send.send((pos, data))
                    except trio.BrokenResourceError:
                        return  # the writer failed: its error is the copy's
                    pos += len(data)

        done = 0
        with unwrap_single():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_ahead)
                async with receive:
                    async for pos, data in receive:
                        written = 0
                        try:
                            while written < len(data):
                                written += await dst.backend.write(dst.file, off_out + pos + written,
                                                                   memoryview(data)[written:])
                        finally:  # a write that failed after a first part: that part counts
                            if written:
                                self.stats.moved(record, "stream", written, done == 0)
                                done += written
                        await trio.lowlevel.checkpoint()  # an interrupt can land between chunks
        # Written is not yet kept: an offload's copy is on disk when it answers (NFS commits
        # each COPY), a stream's unstable writes are committed at close.  Paid here, it is timed
        # as part of streaming; the close finds nothing left to do.
        await dst.backend.flush(dst.file)
        return done


def methods_used(by_method):
    """For the debug line of a copy: "clone"; "server_copy 4194304, stream 1048576" where the copy
    changed method; "nothing" where none moved a byte."""
    if len(by_method) > 1:
        return ", ".join(f"{method} {n}" for method, n in by_method.items())
    return next(iter(by_method), "nothing")


def clone_head(backend, off_in, off_out, length):
    """The bytes before the next block boundary where both offsets are off one the same way (a
    clone can begin there), or 0."""
    align = backend.clone_align
    head = -off_out % align
    return head if head and (off_in - off_out) % align == 0 and head < length else 0


@contextlib.contextmanager
def unwrap_single():
    """A nursery wraps a failure in an ExceptionGroup; callers expect the plain OSError."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
