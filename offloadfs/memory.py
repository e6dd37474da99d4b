"""The daemon's memory: glibc's allocator set for 1 MiB buffers, and handed back when idle.

Every READ and WRITE is a fresh buffer of up to 1 MiB, allocated in one
thread (trio's, a sending worker, smbprotocol's receiver) and freed in
another.  glibc's defaults make each such buffer a new mapping (256 page
faults), and give every thread an arena of its own that keeps what was freed
in it.  Measured with benchmarks/memory.py (16 writers + 16 readers of
64 MiB on SMB, daemon RSS): 237 MB at the peak and kept while idle with
glibc's defaults here; 128 MB at the peak and 45 MB 5 s later with one arena
and trimming.
"""
import ctypes

import trio

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt(3)
IDLE_CHECK = 2.0  # seconds: I/O that stopped this long ago left memory to hand back
libc = ctypes.CDLL(None)


def configure():
    """Before any thread starts.  A fixed mmap threshold keeps buffers on the heap (page faults
    per GiB written 165k -> 2k, daemon CPU -30 %); one arena for all threads, which take turns
    under the GIL anyway, so that memory one thread freed serves the next."""
    libc.mallopt(M_MMAP_THRESHOLD, 8 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
    libc.mallopt(M_ARENA_MAX, 1)


async def trim_when_idle(stats):
    """Hand freed heap memory back to the system once bytes stop moving through FUSE: the trim
    threshold that spares page faults under load would otherwise keep up to 64 MiB for good."""
    moved = trimmed = 0
    while True:
        await trio.sleep(IDLE_CHECK)
        now = stats.fuse_read_bytes + stats.fuse_write_bytes
        if now == moved and now != trimmed:
            libc.malloc_trim(0)  # a few ms, with nothing else to do
            trimmed = now
        moved = now
