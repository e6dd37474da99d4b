"""The daemon: open the sources, mount, serve until unmounted, and stop on signals."""
import ctypes
import errno
import importlib.metadata
import logging
import math
import os
import resource
import signal
import threading

import trio

from . import logs, memory
from .backends import open_backend
from .filesystem import Filesystem
from .fuse import mount as fusemount
from .fuse.session import Session
from .stats import Stats

log = logging.getLogger(__name__)

READAHEAD_KIB = 4096  # sequential reads arrive as 1 MiB READs, several ahead of the reader (+14 % on tmpfs)

STOP_WITHIN = 4.5  # seconds from SIGTERM to the end: flush and unmount, abort if need be, close the sources
UNMOUNT_WITHIN = 2.5  # of which the flush, the unmount and the kernel ending the session itself
OVERDUE = 0.3  # past STOP_WITHIN, the process ends whatever still waits


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


class _Stopper:
    """SIGTERM, SIGINT or SIGHUP: end the daemon within STOP_WITHIN seconds, whoever holds the mount.

    Our unmount ends the connection only if no other mount namespace holds a
    copy (anything started with `unshare -m` or `ip netns exec` while we were
    mounted), and a lazy one only once the last open file closes.  So: flush
    the kernel's dirty pages, unmount here, give the kernel a moment, then
    abort the connection (fusectl) and close the sources in what time is left.
    """

    def __init__(self, mountpoint):
        self.mountpoint = mountpoint
        self.dev = None  # the mount's device: its connection in fusectl, found while still mounted here
        self.deadline = math.inf  # for closing the sources, once a signal came

    async def run(self, serving):
        """Stop on the first signal; ``serving`` (the session's cancel scope) ends the session
        if aborting cannot, and its cancellation ends this task once the session is over."""
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                log.info("%s: unmounting %s", signal.Signals(signum).name, self.mountpoint)
                self.deadline = trio.current_time() + STOP_WITHIN
                self._watchdog()
                with trio.move_on_after(UNMOUNT_WITHIN):
                    await self._unmount()
                    await trio.sleep_forever()  # till the kernel ends the session
                self._abort(serving)
                break
            await trio.sleep_forever()  # later signals change nothing: we are stopping

    def _watchdog(self):
        """Closing the sources can outlast the deadline (a stalled server, cleanups that shield
        themselves): then the process ends anyway, a little after it."""
        def overdue():
            log.error("sources not closed %g s after the signal (server not answering): exiting", STOP_WITHIN)
            logging.shutdown()
            os._exit(1)

        timer = threading.Timer(STOP_WITHIN + OVERDUE, overdue)
        timer.daemon = True
        timer.start()

    async def _unmount(self):
        # In threads: the kernel wants answers from us while it flushes and unmounts.
        try:
            await trio.to_thread.run_sync(fusemount.flush, self.mountpoint, abandon_on_cancel=True)
        except OSError as e:
            log.warning("%s", e)
        for lazy in (False, True):
            try:
                await trio.to_thread.run_sync(lambda: fusemount.unmount(self.mountpoint, lazy=lazy),
                                              abandon_on_cancel=True)
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    log.warning("%s", e)
                    return
                # Busy: detach now, serve the open files a moment longer.

    def _abort(self, serving):
        log.warning("%s still in use (open files, or other mount namespaces hold it): aborting its FUSE "
                    "connection", self.mountpoint)
        try:
            fusemount.abort(self.dev)
        except OSError as e:
            log.error("%s; closing /dev/fuse instead", e)
            serving.cancel()


async def serve(config, on_ready):
    raise_fd_limit()
    memory.configure()
    backends = {name: open_backend(url, config.backend_options) for name, url in config.sources.items()}
    forget_passwd()
    stats = Stats(config.mountpoint, dict(config.sources))
    fs = Filesystem(backends, config.fs, stats)
    await fs.start()
    stopper = _Stopper(config.mountpoint)
    fd = fusemount.mount(config.mountpoint, fsname=config.fsname, flags=config.flags,
                         allow_other=config.allow_other, default_permissions=config.default_permissions)
    session = Session(fd, fs, writeback_cache=config.writeback_cache, passthrough=config.passthrough,
                      debug=config.debug)

    def ready():
        if os.geteuid() == 0:
            fusemount.set_readahead(config.mountpoint, READAHEAD_KIB)
        log.info("%s", mounted(config))
        on_ready()

    try:
        stopper.dev = fusemount.device(config.mountpoint)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stopper.run, nursery.cancel_scope)
            nursery.start_soon(memory.trim_when_idle, stats)
            await session.serve(ready)
            nursery.cancel_scope.cancel()
    finally:
        if fusemount.is_mounted(config.mountpoint):
            fusemount.unmount(config.mountpoint, lazy=True)  # we failed: leave no dead mount behind
        os.close(fd)
        with trio.CancelScope(shield=True, deadline=stopper.deadline):
            await fs.close()
    log.info("unmounted %s", config.mountpoint)


def mounted(config):
    """The line that says, once the kernel has spoken to us, what was mounted where, by which
    version and with which options: where a mount's part of a shared log begins."""
    try:
        version = importlib.metadata.version("offloadfs")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, never installed
        version = "(not installed)"
    sources = ", ".join(url if name == "source" else f"{name}={url}" for name, url in config.sources.items())
    options = ",".join(config.options) or "none"
    return f"offloadfs {version}: mounted {sources} on {config.mountpoint}, options {options}"


def run(config, on_ready):
    logs.name_lines(config.mountpoint)
    trio.run(serve, config, on_ready)
