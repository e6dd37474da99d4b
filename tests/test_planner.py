"""The copy planner's choices, against in-memory backends whose capabilities we switch on and off."""
import errno

import pytest
import trio
import trio.testing

from offloadfs.backends.base import Backend, NotSupported, Stat
from offloadfs.backends.parallel import copy_spans
from offloadfs.costs import CostModel
from offloadfs.planner import Endpoint, Planner, plan
from offloadfs.stats import Stats


class Mem(Backend):
    """Files are bytearrays; the node and the file are the same object."""

    def __init__(self, server="a"):
        self.server = server
        self.url = f"mem://{server}"

    def shares_server_with(self, other):
        return getattr(other, "server", None) == self.server

    async def getattr(self, node, file=None):
        return Stat(ino=id(node), mode=0o100644, size=len(node))

    async def read(self, file, offset, size):
        return bytes(file[offset:offset + size])

    async def write(self, file, offset, data):
        if len(file) < offset:
            file.extend(bytes(offset - len(file)))
        file[offset:offset + len(data)] = data
        return len(data)

    async def setattr(self, node, file=None, *, size=None, **changes):
        del node[size:]
        return await self.getattr(node)


class Cloning(Mem):
    """Clones where both offsets are on a multiple of ``clone_align``."""
    clone_align = 1

    def __init__(self, server="a", refuse=False):
        super().__init__(server)
        self.refuse = refuse

    async def clone_range(self, src, src_off, dst, dst_off, length):
        if self.refuse or src_off % self.clone_align or dst_off % self.clone_align:
            raise NotSupported("unaligned")
        return await self.write(dst, dst_off, src[src_off:src_off + length])


class Copying(Mem):
    """Copies at most ``cap`` bytes a call, like Linux nfsd's 4 MiB; refuses after ``fail_after`` calls."""

    def __init__(self, server="a", cap=1000, fail_after=None):
        super().__init__(server)
        self.cap, self.fail_after, self.calls = cap, fail_after, 0

    async def server_copy(self, src, src_off, dst, dst_off, length):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise NotSupported("server gave up")
        n = min(length, self.cap)
        return await self.write(dst, dst_off, src[src_off:src_off + n])


class CloningCopying(Cloning, Copying):
    def __init__(self, refuse):
        Copying.__init__(self)
        self.refuse = refuse


def ends(src_backend, dst_backend, data):
    src, dst = bytearray(data), bytearray()
    return Endpoint(src_backend, src, src, "src"), Endpoint(dst_backend, dst, dst, "dst"), dst


DATA = bytes(range(256)) * 40  # 10240 bytes


@pytest.mark.parametrize("src,dst,offload,expected", [
    (CloningCopying(False), None, True, ["clone", "server_copy", "stream"]),
    (CloningCopying(False), None, False, ["stream"]),
    (Copying(), None, True, ["server_copy", "stream"]),
    (Mem(), None, True, ["stream"]),
    (Copying("a"), Copying("b"), True, ["stream"]),
])
def test_plan_order(src, dst, offload, expected):
    s, d, _ = ends(src, dst or src, b"x")
    assert plan(s, d, offload) == expected


async def run_copy(src_backend, dst_backend, offload=True, off_in=0, off_out=0, length=1 << 40):
    stats = Stats("/mnt", {})
    src, dst, out = ends(src_backend, dst_backend, DATA)
    n = await Planner(stats, offload).copy(src, off_in, dst, off_out, length)
    return n, out, stats.snapshot()["counters"], stats


async def test_clone_when_possible():
    b = CloningCopying(refuse=False)
    n, out, c, _ = await run_copy(b, b)
    assert n == len(DATA) and out == DATA
    assert c["copies"]["clone"] == 1 and c["copy_bytes"]["clone"] == len(DATA)
    assert c["copies"]["server_copy"] == 0 and b.calls == 0


async def test_refused_clone_falls_back_to_server_copy_looping_on_short_counts():
    b = CloningCopying(refuse=True)
    n, out, c, _ = await run_copy(b, b)
    assert n == len(DATA) and out == DATA
    assert b.calls == 11  # 10240 bytes at 1000 a call
    assert c["copies"] == {"clone": 0, "server_copy": 1, "inter_server_copy": 0, "stream": 0}


async def test_server_copy_giving_up_midway_is_finished_by_streaming():
    b = Copying(fail_after=3)
    n, out, c, _ = await run_copy(b, b)
    assert n == len(DATA) and out == DATA
    assert c["copy_bytes"]["server_copy"] == 3000
    assert c["copy_bytes"]["stream"] == len(DATA) - 3000


async def test_a_clone_off_a_block_boundary_clones_from_the_next_one():
    """Offsets that both sit the same way off a block (a recognised copy's run that begins where a
    chunk did): the bytes up to the boundary by the next method, the rest cloned, not all of it
    copied by the server."""
    b = CloningCopying(refuse=False)
    b.clone_align = 1024
    n, out, c, _ = await run_copy(b, b, off_in=100, off_out=2148)
    assert n == len(DATA) - 100 and out == bytes(2148) + DATA[100:]
    assert c["copy_bytes"]["server_copy"] == 924 and c["copy_bytes"]["clone"] == len(DATA) - 1024
    n, out, c, _ = await run_copy(b, b, off_in=100, off_out=200)  # not the same way off: no clone
    assert c["copy_bytes"]["clone"] == 0 and c["copy_bytes"]["server_copy"] == len(DATA) - 100


async def test_offload_off_streams():
    b = CloningCopying(refuse=False)
    n, out, c, _ = await run_copy(b, b, offload=False)
    assert out == DATA and c["copies"]["stream"] == 1 and c["copies"]["clone"] == 0


async def test_different_servers_stream():
    n, out, c, _ = await run_copy(Copying("a"), Copying("b"))
    assert out == DATA and c["copies"]["stream"] == 1


async def test_length_is_clamped_to_the_source_and_offsets_are_kept():
    b = Copying()
    n, out, c, stats = await run_copy(b, b, off_in=10000, off_out=5)
    assert n == 240 and out == bytes(5) + DATA[10000:]
    n, out, c, stats = await run_copy(b, b, off_in=20000)
    assert n == 0 and c["copy_requests"] == 0
    assert stats.in_flight == {}


async def test_a_failing_copy_is_counted_and_leaves_nothing_in_flight():
    class Broken(Mem):
        async def write(self, file, offset, data):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        await run_copy(Broken(), Broken())
    stats = Stats("/mnt", {})
    src, dst, _ = ends(Broken(), Broken(), DATA)
    with pytest.raises(OSError):
        await Planner(stats, True).copy(src, 0, dst, 0, 100)
    assert stats.copy_errors == 1 and stats.in_flight == {}


class Ragged(Mem):
    """Writes pieces of 1000 side by side, as the network backends do: the second fails, the rest land."""

    async def write(self, file, offset, data):
        for start in range(0, len(data), 1000):
            if start != 1000:
                await super().write(file, offset + start, data[start:start + 1000])
        raise OSError(errno.ENOSPC, "No space left on device")


class Filling(Mem):
    """A filesystem with room for ``room`` bytes: a write past it is short, then ENOSPC."""

    def __init__(self, room):
        super().__init__()
        self.room = room

    async def write(self, file, offset, data):
        n = min(len(data), self.room - offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await super().write(file, offset, data[:n])


async def test_a_failed_copy_leaves_no_piece_past_the_one_that_failed():
    src, dst, out = ends(Ragged(), Ragged(), DATA)
    with pytest.raises(OSError) as e:
        await Planner(Stats("/mnt", {}), False).copy(src, 0, dst, 0, len(DATA))
    assert e.value.errno == errno.ENOSPC and out == b""  # nothing copied: nothing left
    src, dst, out = ends(Ragged(), Ragged(), DATA)
    out += b"x" * 20000  # what was there before the copy stays
    with pytest.raises(OSError):
        await Planner(Stats("/mnt", {}), False).copy(src, 0, dst, 500, len(DATA))
    assert len(out) == 20000 and out[:500] == b"x" * 500 and out[500:1500] == DATA[:1000]


async def test_a_copy_that_fails_after_a_first_part_answers_that_part():
    n, out, c, _ = await run_copy(Filling(3000), Filling(3000), offload=False)
    assert n == 3000 and out == DATA[:3000]
    assert c["copy_bytes"]["stream"] == 3000 and c["copy_errors"] == 1


async def test_spans_count_up_to_the_first_that_failed():
    landed = []

    async def copy(start, count):
        await trio.lowlevel.checkpoint()  # all in flight at once
        if start == 10:
            raise OSError(errno.EIO, "connection lost")
        landed.append(start)
        return count

    assert await copy_spans(copy, 40, 10, 4) == 10
    assert sorted(landed) == [0, 20, 30]  # those in flight finish
    landed.clear()
    assert await copy_spans(copy, 40, 10, 1) == 10
    assert landed == [0]  # none starts after the failure
    with pytest.raises(OSError):
        await copy_spans(lambda start, count: copy(start + 10, count), 40, 10, 4)


async def test_one_span_is_copied_without_tasks():
    """A 1 KiB cp copies one span: a nursery and a task for each span that may be in flight cost it
    more than the span's own work in the daemon."""
    tasks = set()

    async def copy(start, count):
        tasks.add(trio.lowlevel.current_task())
        return count

    assert await copy_spans(copy, 1024, 1 << 20, 4) == 1024
    assert tasks == {trio.lowlevel.current_task()}  # the caller's own


class Pulling(Mem):
    """A destination server that pulls from other servers, at most ``cap`` bytes a call."""

    def __init__(self, server, cap=4096):
        super().__init__(server)
        self.cap = cap

    async def inter_server_copy(self, src_backend, src, src_off, dst, dst_off, length):
        if not isinstance(src_backend, Mem):
            raise NotSupported("not a server we can reach")
        n = min(length, self.cap)
        return await self.write(dst, dst_off, src[src_off:src_off + n])


async def test_copies_between_servers_use_inter_server_copy():
    assert plan(*ends(Mem("a"), Pulling("b"), b"x")[:2], True) == ["inter_server_copy", "stream"]
    n, out, c, _ = await run_copy(Mem("a"), Pulling("b"))
    assert n == len(DATA) and out == DATA
    assert c["copies"]["inter_server_copy"] == 1 and c["copy_bytes"]["inter_server_copy"] == len(DATA)


def test_cost_model_separates_fixed_cost_from_rate():
    costs = CostModel()
    r = ("a", "b")
    assert costs.predict(r, "stream", 100) is None
    costs.record(r, "stream", 1000, 0.5)  # the first run sets the route up (see the next test)
    costs.record(r, "stream", 1000, 0.001)
    assert costs.predict(r, "stream", 1500) == pytest.approx(0.001)
    assert costs.predict(r, "stream", 10_000) is None  # one size: rate unknown
    costs.record(r, "stream", 3000, 0.003)
    assert costs.predict(r, "stream", 10_000) == pytest.approx(0.01)
    costs.record(r, "copy", 1000, 5.0)
    costs.record(r, "copy", 1000, 0.1001)
    costs.record(r, "copy", 11_000, 0.1011)
    assert costs.predict(r, "copy", 1_000_000) == pytest.approx(0.2, rel=0.01)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_old_samples_fade_and_a_route_that_changed_is_learned_again():
    clock = Clock()
    costs, r = CostModel(clock), ("a", "b")
    for _ in range(10):  # a fast route for a while
        for n in (1 << 20, 16 << 20):
            costs.record(r, "server_copy", n, 0.01 + n / 1e9)
        clock.now += 1
    clock.now += 300  # five minutes later the server is busy
    for n in (1 << 20, 16 << 20):
        costs.record(r, "server_copy", n, 0.01 + n / 1e7)
    assert costs.predict(r, "server_copy", 64 << 20) == pytest.approx(0.01 + (64 << 20) / 1e7, rel=0.1)
    clock.now += 600  # and ten quiet minutes on, nothing is known: the next copy tries it afresh
    assert costs.predict(r, "server_copy", 64 << 20) is None and not costs.known(r, "server_copy")


def test_predictions_follow_each_sample_each_merged_request_and_the_clock():
    """What the samples say is kept between copies (worked out afresh for each, choosing took
    0.1 ms a copy): a new sample, a request merged into a burst, and time passing show at once."""
    clock = Clock()
    costs, r = CostModel(clock), ("a", "b")
    for t in (0.5, 0.002):
        costs.record(r, "clone", 1000, t)
    assert costs.predict(r, "clone", 1000) == pytest.approx(0.002)
    clock.now += 30
    costs.record(r, "clone", 1000, 0.005)  # the older one weighs half as much now
    assert costs.predict(r, "clone", 1000) == pytest.approx(0.004)
    start = clock.now
    clock.now += 0.01
    for backend, op in (("a", "read"), ("b", "write")):
        costs.carried(backend, op, start, 1 << 20)
    assert costs.predict(r, "stream", 2 << 20) == pytest.approx(0.02)
    clock.now += 0.02
    costs.carried("a", "read", start, 1 << 20)  # in flight beside the first: 2 MiB in 0.03 s
    assert costs.predict(r, "stream", 2 << 20) == pytest.approx(0.03)
    clock.now += 600
    assert costs.predict(r, "clone", 1000) is None and costs.predict(r, "stream", 2 << 20) is None


def test_streaming_is_learned_from_the_reads_and_writes_carried():
    clock = Clock()
    costs = CostModel(clock)
    for n in (4096, 1 << 20):  # reads from a: 1 ms, then 100 MB/s; writes to b: 2 ms, then 50 MB/s
        for backend, op, fixed, rate in (("a", "read", 0.001, 1e8), ("b", "write", 0.002, 5e7)):
            start = clock.now
            clock.now += fixed + n / rate
            costs.carried(backend, op, start, n)
            clock.now += 1
    assert costs.predict(("a", "b"), "stream", 100 << 20) == pytest.approx(0.003 + (100 << 20) / 5e7, rel=0.01)
    assert costs.predict(("b", "a"), "stream", 100 << 20) is None  # nothing written to a yet
    # Requests in flight side by side share their time: eight 1 MiB reads in 0.08 s are 100 MB/s, not 12.5.
    start = clock.now
    clock.now += 0.08
    for _ in range(8):
        costs.carried("c", "read", start, 1 << 20)
    costs.carried("d", "write", start, 16 << 20)
    clock.now += 1
    costs.carried("c", "read", clock.now - 0.001, 4096)  # the next one, later: a sample of its own
    assert costs.predict(("c", "d"), "stream", 8 << 20) == pytest.approx(0.08, rel=0.05)


async def test_a_small_copy_is_not_judged_by_a_rate_from_large_requests():
    """A mount that carried only large reads and writes knows streaming's rate, not what a stream
    costs before its first byte: at 1 KiB, that rate alone made streaming look free, every known
    offload slower, and an untried one first (on nfsd, cp of 1 KiB ran COPY twice, then
    streamed, then cloned).  Streaming is learned by one stream instead."""
    clock = Clock()
    planner = Planner(Stats("/mnt", {}))
    planner.costs = CostModel(clock)
    route = ("a", "b")
    for backend, op in (("a", "read"), ("b", "write")):
        for n in (8 << 20, 16 << 20):
            start = clock.now
            clock.now += n / 1e9
            planner.costs.carried(backend, op, start, n)
            clock.now += 1
    for t in (0.0059, 0.0017):
        planner.costs.record(route, "clone", 1024, t)
    assert planner.costs.predict(route, "stream", 64 << 20) == pytest.approx(0.064 * 1.048576, rel=0.01)
    assert planner.costs.predict(route, "stream", 1024) is None
    methods = ["clone", "server_copy", "stream"]
    assert planner.choose(route, methods, 1024) == ["stream", "clone", "server_copy"]
    planner.costs.record(route, "stream", 1024, 0.0055)  # the stream's time, with its COMMIT
    assert planner.choose(route, methods, 1024) == methods


async def test_offload_always_skips_the_cost_model():
    planner = Planner(Stats("/mnt", {}), always=True)
    route, methods = ("a", "b"), ["inter_server_copy", "stream"]
    planner.costs.record(route, "inter_server_copy", 1 << 20, 10)
    planner.costs.record(route, "stream", 1 << 20, 0.01)
    assert planner.choose(route, methods, 1 << 20) == methods


async def test_slow_offloads_are_skipped_for_the_sizes_where_they_lose():
    planner = Planner(Stats("/mnt", {}))
    route, methods = ("a", "b"), ["inter_server_copy", "stream"]
    assert planner.choose(route, methods, 1000) == methods  # nothing known: offload first
    for n in (1 << 20, 64 << 20):
        planner.costs.record(route, "inter_server_copy", n, 0.1 + n / 1e9)  # setup 0.1 s, then 1 GB/s
        planner.costs.record(route, "stream", n, n / 1e8)  # no setup, 100 MB/s
    assert planner.choose(route, methods, 1 << 20) == ["stream", "inter_server_copy"]
    assert planner.choose(route, methods, 64 << 20) == methods


async def test_an_unmeasured_route_offloads_twice_then_streams_once_to_learn():
    b = Copying()
    stats = Stats("/mnt", {})
    planner = Planner(stats)
    for expected in ({"server_copy": 1}, {"server_copy": 2}, {"server_copy": 2, "stream": 1}):
        src, dst, out = ends(b, b, DATA)
        assert await planner.copy(src, 0, dst, 0, len(DATA)) == len(DATA) and out == DATA
        assert {m: n for m, n in stats.copies.items() if n} == expected
    # Both measured at this size now: the cheaper one wins from here on.
    assert planner.costs.known((id(b), id(b)), "stream")


async def test_one_slow_first_offload_is_no_verdict():
    """The first run of a method pays for setting it up (an open state, a mount between servers)."""
    planner = Planner(Stats("/mnt", {}))
    route, methods = ("a", "b"), ["inter_server_copy", "stream"]
    planner.costs.record(route, "stream", 1 << 20, 0.01)
    planner.costs.record(route, "stream", 2 << 20, 0.02)
    planner.costs.record(route, "inter_server_copy", 1 << 20, 1.0)
    assert planner.choose(route, methods, 1 << 20) == methods
    planner.costs.record(route, "inter_server_copy", 1 << 20, 0.9)
    assert planner.choose(route, methods, 1 << 20) == ["stream", "inter_server_copy"]


async def test_a_slow_first_run_does_not_keep_a_method_behind_streaming():
    """A method predicted slower than streaming is not run again, so a first run that paid for a
    setup (on nfsd, a first CLONE took 5.9 ms, the next 1.7) must not stand in its cost: with
    it, cp of 1 KiB streamed every time, 1.31x the clones' time."""
    planner = Planner(Stats("/mnt", {}))
    route, methods = ("a", "b"), ["clone", "stream"]
    for t in (0.0028, 0.0027):
        planner.costs.record(route, "stream", 1024, t)
    planner.costs.record(route, "clone", 1024, 0.0059)
    assert planner.choose(route, methods, 1024) == methods  # once: no verdict
    planner.costs.record(route, "clone", 1024, 0.0017)
    assert planner.choose(route, methods, 1024) == methods
    assert planner.costs.predict(route, "clone", 1024) == pytest.approx(0.0017)


def test_a_streams_time_includes_making_its_writes_durable():
    """An offload's copy is on disk when it answers (an NFS COPY is committed); a stream's
    unstable writes are committed at close.  That COMMIT is part of what streaming costs: left
    out, streaming 1 KiB on nfsd looked 1 ms faster than the clone it took 3 ms longer than."""
    class Unstable(Copying):
        dirty = False

        async def write(self, file, offset, data):
            self.dirty = True
            return await super().write(file, offset, data)

        async def flush(self, file):
            await trio.sleep(0.002 if self.dirty else 0)
            self.dirty = False

    async def main():
        b = Unstable()
        planner = Planner(Stats("/mnt", {}), offload=False)
        src, dst, out = ends(b, b, DATA)
        assert await planner.copy(src, 0, dst, 0, len(DATA)) == len(DATA) and out == DATA
        assert not b.dirty
        return planner.costs.predict((id(b), id(b)), "stream", len(DATA))

    assert run_mock(main) == pytest.approx(0.002)


class Slowing(Copying):
    """Copies ``cap`` bytes a call in 1 ms until ``fast`` calls, then takes ``slow`` seconds a call
    (a server that got busy mid-copy); streams at 1 ms a read or write.  Logs where writes land."""

    def __init__(self, fast, slow, cap=1000):
        super().__init__(cap=cap)
        self.fast, self.slow, self.writes = fast, slow, []
        self.stats = None

    async def server_copy(self, src, src_off, dst, dst_off, length):
        await trio.sleep(0.001 if self.calls < self.fast else self.slow)
        self.calls += 1
        n = min(length, self.cap)
        return await Mem.write(self, dst, dst_off, src[src_off:src_off + n])  # not logged: not a stream

    async def read(self, file, offset, size):
        await trio.sleep(0.001)
        return await super().read(file, offset, size)

    async def write(self, file, offset, data):
        await trio.sleep(0.001)
        self.writes.append((offset, [c.method for c in self.stats.in_flight.values()] if self.stats else None))
        return await super().write(file, offset, data)


def run_mock(fn):
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_offload_that_slows_down_mid_copy_hands_the_rest_to_streaming():
    async def main():
        b = Slowing(fast=3, slow=60)
        stats = b.stats = Stats("/mnt", {})
        planner = Planner(stats)
        started = trio.current_time()
        for n in (4096, 1 << 20):  # what streaming on this server costs, from ordinary traffic
            for op in ("read", "write"):
                start = trio.current_time()
                await trio.sleep(0.001 + n / 1e8)
                planner.carried(b, op, start, n)
        assert planner.choose((id(b), id(b)), ["server_copy", "stream"], len(DATA))[0] == "server_copy"
        src, dst, out = ends(b, b, DATA)
        b.writes.clear()
        assert await planner.copy(src, 0, dst, 0, len(DATA)) == len(DATA)
        assert trio.current_time() - started < 10  # not a whole slow call, let alone seven
        return out, b.writes, stats.snapshot()["counters"]

    out, writes, c = run_mock(main)
    assert out == DATA
    assert c["copy_bytes"] == {"clone": 0, "server_copy": 3000, "inter_server_copy": 0, "stream": len(DATA) - 3000}
    assert writes[0] == (3000, ["stream"])  # from the byte where the offload stopped; status says how
    assert c["switched_to_stream"] == 1 and c["switched_to_offload"] == 0


def test_streaming_that_turns_out_slow_gives_way_to_a_known_offload():
    class SlowStream(Copying):
        async def read(self, file, offset, size):
            await trio.sleep(30)
            return await super().read(file, offset, size)

    async def main():
        b = SlowStream(cap=1 << 20)
        stats = Stats("/mnt", {})
        planner = Planner(stats)
        for _ in range(2):
            planner.costs.record((id(b), id(b)), "server_copy", len(DATA), 0.01)
        # Streaming never measured here: the planner streams to learn, watched against the offload.
        assert planner.choose((id(b), id(b)), ["server_copy", "stream"], len(DATA)) == ["stream", "server_copy"]
        src, dst, out = ends(b, b, DATA)
        started = trio.current_time()
        assert await planner.copy(src, 0, dst, 0, len(DATA)) == len(DATA)
        assert trio.current_time() - started < 1
        # What it learned: streaming here is slow; the next copy offloads at once.
        assert planner.choose((id(b), id(b)), ["server_copy", "stream"], len(DATA)) == ["server_copy", "stream"]
        return out, stats.snapshot()["counters"]

    out, c = run_mock(main)
    assert out == DATA and c["copy_bytes"]["server_copy"] == len(DATA)
    assert c["switched_to_offload"] == 1


def streaming_known(b):
    """A planner that knows what streaming costs on ``b`` from reads and writes it carried, so
    that every offload there is watched against it."""
    planner = Planner(Stats("/mnt", {}))
    for op in ("read", "write"):
        planner.carried(b, op, trio.current_time() - 0.01, 1 << 20)
        planner.carried(b, op, trio.current_time() + 1, 1)
    return planner


def test_copies_one_after_another_share_one_watcher():
    """A watcher task for each copy cost a 1 KiB cp on ext4 0.1 ms (4 %): one watches every copy
    while any runs."""
    class Spawns(trio.abc.Instrument):
        count = 0

        def task_spawned(self, task):
            self.count += "watch" in task.name

    async def main():
        b = Copying(cap=1 << 20)
        planner = streaming_known(b)
        spawns = Spawns()
        trio.lowlevel.add_instrument(spawns)
        for _ in range(3):
            src, dst, out = ends(b, b, DATA)
            stats = await b.getattr(src.node), await b.getattr(dst.node)  # as the filesystem holds them
            assert await planner.copy(src, 0, dst, 0, len(DATA), stats) == len(DATA) and out == DATA
        trio.lowlevel.remove_instrument(spawns)
        return spawns.count

    assert run_mock(main) == 1


def test_a_fault_in_watching_a_copy_leaves_it_running_unwatched(caplog):
    """The watcher is a system task: what it raised would end the daemon."""
    class Slow(Copying):
        async def server_copy(self, src, src_off, dst, dst_off, length):
            await trio.sleep(1)
            return await super().server_copy(src, src_off, dst, dst_off, length)

    async def main():
        b = Slow(cap=1 << 20)
        planner = streaming_known(b)

        def fault(*args):
            raise ZeroDivisionError

        planner._rival = fault
        src, dst, out = ends(b, b, DATA)
        assert await planner.copy(src, 0, dst, 0, len(DATA)) == len(DATA)
        return out

    assert run_mock(main) == DATA
    assert "watching it failed" in caplog.text


async def test_a_recognised_copy_is_read_back_only_where_reading_costs_less_than_writing():
    """Planner.verify_pays: the lab's asymmetric link (reads 20x faster) reads back; a symmetric
    one writes; writing unmeasured: None (the caller measures it); reading unmeasured, it reads
    back (and so measures it); offload=always always reads back."""
    backend = object()
    for always, read, write, pays in [(False, None, None, None), (False, 0.004, None, None),
                                      (False, None, 0.08, True), (False, 0.004, 0.08, True),
                                      (False, 0.03, 0.08, False), (False, 0.07, 0.08, False),
                                      (True, 0.07, 0.07, True)]:
        p = Planner(Stats("/mnt", {}), always=always)
        for op, seconds in (("read", read), ("write", write)):
            for _ in range(3 if seconds else 0):
                p.costs.record(id(backend), op, 8 << 20, seconds)
        assert p.verify_pays(backend, 8 << 20) is pays, (always, read, write)


async def test_small_writes_alone_tell_no_rate_to_choose_a_read_back_by():
    """A copy's unmatched bytes go out in writes of some 48 KiB: two sizes of them make a slope that
    means nothing (on the lab's 50 Mbit uplink it said writing was cheap)."""
    p = Planner(Stats("/mnt", {}))
    backend = object()
    for _ in range(3):
        p.costs.record(id(backend), "read", 8 << 20, 0.07)
    p.costs.record(id(backend), "write", 40 << 10, 0.008)
    p.costs.record(id(backend), "write", 120 << 10, 0.0081)
    assert p.costs.predict(id(backend), "write", 8 << 20) is not None
    assert p.verify_pays(backend, 8 << 20) is None
    p.costs.record(id(backend), "write", 1 << 20, 0.17)
    assert p.verify_pays(backend, 8 << 20) is True
