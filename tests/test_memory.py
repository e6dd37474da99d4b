"""The daemon hands freed memory back once I/O stops, and not while it goes on (offloadfs/memory.py)."""
import trio
import trio.testing

from offloadfs import memory
from offloadfs.stats import Stats


class _Libc:
    def __init__(self):
        self.trims = 0

    def malloc_trim(self, pad):
        self.trims += 1
        return 1


def test_memory_is_trimmed_once_after_io_stops(monkeypatch):
    libc = _Libc()
    monkeypatch.setattr(memory, "libc", libc)
    stats = Stats("/mnt", {})
    trio.run(_io_then_idle, libc, stats, clock=trio.testing.MockClock(autojump_threshold=0))


async def _io_then_idle(libc, stats):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(memory.trim_when_idle, stats)
        for _ in range(40):  # busy: bytes move between every two checks
            stats.fuse_write_bytes += 1 << 20
            await trio.sleep(memory.IDLE_CHECK / 4)
        assert libc.trims == 0
        await trio.sleep(memory.IDLE_CHECK * 3)
        assert libc.trims == 1
        await trio.sleep(memory.IDLE_CHECK * 10)  # idle since: nothing more to hand back
        assert libc.trims == 1
        stats.fuse_read_bytes += 1 << 20
        await trio.sleep(memory.IDLE_CHECK * 3)
        assert libc.trims == 2
        nursery.cancel_scope.cancel()
