"""The daemon: open the sources, mount, serve until unmounted, and unmount on signals."""
import ctypes
import errno
import logging
import os
import resource
import signal

import trio

from .backends import open_backend
from .filesystem import Filesystem
from .fuse import mount as fusemount
from .fuse.session import Session
from .stats import Stats

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3)
READAHEAD_KIB = 4096  # sequential reads arrive as 1 MiB READs, several ahead of the reader (+14 % on tmpfs)


def keep_buffers_on_the_heap():
    """Each request and reply is a fresh ~1 MiB buffer: above glibc's mmap threshold every one
    would be a new mapping and 256 page faults.  A fixed threshold keeps them on the heap
    (measured: page faults per GiB written 165k -> 2k, daemon CPU -30 %)."""
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, 8 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


def raise_fd_limit():
    """Every inode the kernel remembers holds a descriptor in the local backend."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def forget_passwd():
    """PASSWD (an SMB password) is needed only while the backends open.  Dropped from the
    environment, fusermount3 and the rest never inherit it; and since /proc/PID/environ shows
    the memory the process started with, whatever unsetenv() does, its bytes are zeroed there."""
    libc = ctypes.CDLL(None)
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    entries = []
    while environ[len(entries)]:
        entries.append(environ[len(entries)])
    os.environ.pop("PASSWD", None)  # unsetenv() takes it out of environ, not out of memory
    for address in entries:
        entry = ctypes.string_at(address)
        if entry.startswith(b"PASSWD="):
            ctypes.memset(address, 0, len(entry))


async def _unmount_on_signal(mountpoint):
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting %s", signal.Signals(signum).name, mountpoint)
            # In a thread: the kernel may want answers from us while it unmounts.
            try:
                await trio.to_thread.run_sync(fusemount.unmount, mountpoint)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    log.error("%s", e)
                    continue
                # Busy: detach now; open files keep being served until closed.
                await trio.to_thread.run_sync(lambda: fusemount.unmount(mountpoint, lazy=True))


async def serve(config, on_ready):
    raise_fd_limit()
    keep_buffers_on_the_heap()
    backends = {name: open_backend(url, config.backend_options) for name, url in config.sources.items()}
    forget_passwd()
    stats = Stats(config.mountpoint, dict(config.sources))
    fs = Filesystem(backends, config.fs, stats)
    await fs.start()
    fd = fusemount.mount(config.mountpoint, fsname=config.fsname, flags=config.flags,
                         allow_other=config.allow_other, default_permissions=config.default_permissions)
    session = Session(fd, fs, writeback_cache=config.writeback_cache, passthrough=config.passthrough,
                      debug=config.debug)

    def ready():
        if os.geteuid() == 0:
            fusemount.set_readahead(config.mountpoint, READAHEAD_KIB)
        on_ready()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_unmount_on_signal, config.mountpoint)
            await session.serve(ready)
            nursery.cancel_scope.cancel()
    finally:
        if fusemount.is_mounted(config.mountpoint):
            fusemount.unmount(config.mountpoint, lazy=True)  # we failed: leave no dead mount behind
        os.close(fd)
        with trio.CancelScope(shield=True):
            await fs.close()
    log.info("unmounted %s", config.mountpoint)


def run(config, on_ready):
    trio.run(serve, config, on_ready)
