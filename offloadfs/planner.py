"""The copy planner: every copy request comes here, and only here is the method chosen.

Order of preference, each tried only where the backends offer it:
clone (copy-on-write, near free) -> server-side copy (the data moves on the
server, not over our link) -> inter-server copy -> our own streaming copy.
An offload that the cost model, fed by earlier copies on the same route,
expects to be slower than streaming this size is skipped: offloading must
never lose.  A method that cannot serve the request raises NotSupported and
the next one takes over from the byte where the last stopped, so a copy is
never handed back to the kernel (whose fallback is slower: 64 KiB writes
through FUSE).
"""
import contextlib
import time
from dataclasses import dataclass

import trio

from .costs import CostModel

from .backends.base import CloneRange, InterServerCopy, NotSupported, ServerCopy

STREAM_CHUNK = 8 << 20
STREAM_AHEAD = 2  # chunks read ahead of the writer
# While streaming on a route is unmeasured, copies up to this size stream once to learn
# its cost: being wrong about a small copy costs little.
EXPLORE_LIMIT = 1 << 20


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
    def __init__(self, stats, offload=True):
        self.stats = stats
        self.offload = offload
        self.costs = CostModel()

    def choose(self, route, methods, length):
        """Drop the offloads expected to lose against streaming ``length`` bytes on ``route``."""
        offloads = methods[:-1]
        if not offloads:
            return methods
        stream = self.costs.predict(route, "stream", length)
        if stream is None:
            learned = any(self.costs.known(route, m) for m in offloads)
            return ["stream"] if learned and length <= EXPLORE_LIMIT else methods
        faster = []
        for m in offloads:
            cost = self.costs.predict(route, m, length)
            if cost is None or cost < stream:
                faster.append(m)
        return faster + ["stream"]

    async def copy(self, src: Endpoint, off_in, dst: Endpoint, off_out, length):
        """Copy up to ``length`` bytes; returns the count (short only at the source's EOF)."""
        size = (await src.backend.getattr(src.node, src.file)).size
        length = min(length, max(0, size - off_in))
        if length == 0:
            return 0
        record = self.stats.start_copy(src.label, dst.label, length)
        route = (id(src.backend), id(dst.backend))
        failed = True
        try:
            done = 0
            for method in self.choose(route, plan(src, dst, self.offload), length):
                started = time.monotonic()
                record.method = method  # what `offloadfs status` shows while it runs
                try:
                    n = await getattr(self, "_" + method)(src, off_in + done, dst, off_out + done,
                                                          length - done, record)
                except NotSupported:
                    continue
                if n == length:  # one method did it all: a clean sample of its cost
                    self.costs.record(route, method, n, time.monotonic() - started)
                done += n
                if done >= length:
                    break
            failed = False
            return done
        finally:
            self.stats.end_copy(record, failed)

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
                    await send.send((pos, data))
                    pos += len(data)

        done = 0
        with unwrap_single():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_ahead)
                async with receive:
                    async for pos, data in receive:
                        written = 0
                        while written < len(data):
                            written += await dst.backend.write(dst.file, off_out + pos + written,
                                                               memoryview(data)[written:])
                        self.stats.moved(record, "stream", len(data), done == 0)
                        done += len(data)
                        await trio.lowlevel.checkpoint()  # an interrupt can land between chunks
        return done


@contextlib.contextmanager
def unwrap_single():
    """A nursery wraps a failure in an ExceptionGroup; callers expect the plain OSError."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
