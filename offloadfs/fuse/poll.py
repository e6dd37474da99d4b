"""Reading /dev/fuse again for a moment before sleeping on it.

A program that makes one small request after another (tar x's WRITEs of 10 KiB, each answered
without a task) sends its next one some microseconds after our reply.  Sleeping in epoll between
them costs more than the request itself: a trio scheduler round, and a wake-up of a vCPU that
halted meanwhile, on both sides (tar x of 256 MiB of copied data in an SMB share: 3.1 s, and
2.0-2.2 s reading again for up to 20-200 us before sleeping, with less CPU used).  So, after a
request answered at once and with nothing else to do (Session._idle), the reader reads again for
up to ``window`` seconds.

The window adapts, much as the kernel's haltpoll governor does for an idle vCPU: a sleep shorter
than POLL_MAX opens it (doubling), a longer one shrinks it (halving, then closing), and so does
a window that passed with nothing, even where the request came soon after: with every CPU busy,
the program we wait for may not run until we stop reading (a second CPU kept busy by a loop: no
request came within the window of 400).  A request caught widens it again.  So an idle mount, one
whose requests come slowly, and one on a busy machine spend little CPU on it.
"""
import os
import time

POLL_MAX = 50e-6  # seconds: the longest the reader reads again before it sleeps
POLL_START = 10e-6  # the window a short sleep opens


class Poll:
    """How long the reader of ``fd`` reads again before it sleeps, and how often that paid."""

    def __init__(self, fd):
        self.fd = fd
        self.window = 0.0
        self.caught = 0  # requests read within the window
        self.missed = False  # the last window passed with nothing
        # With one CPU the program we wait for cannot run while we read again.
        self.useful = (os.cpu_count() or 1) > 1

    def read(self, size, idle):
        """The next request, or None if none came within the window; ``idle()`` says whether the
        daemon has nothing else to do (it is asked only when no request is there at once).
        Raises what os.read does but BlockingIOError."""
        try:
            return os.read(self.fd, size)
        except BlockingIOError:
            if not (self.window and self.useful and idle()):
                return None
        end = time.perf_counter() + self.window
        while time.perf_counter() < end:
            try:
                buf = os.read(self.fd, size)
            except BlockingIOError:
                continue
            self.caught += 1
            self.window = min(POLL_MAX, 2 * self.window)
            return buf
        self.missed = True
        return None

    def slept(self, seconds):
        """The reader slept ``seconds`` before the next request came (after a window that passed
        with nothing, or none): the window opens or shrinks."""
        if seconds < POLL_MAX and not self.missed:
            self.window = min(POLL_MAX, max(2 * self.window, POLL_START))
        elif self.window > POLL_START:
            self.window /= 2
        else:
            self.window = 0.0
        self.missed = False
