"""Where the daemon logs, chosen before it forks so that `mount -v` can say where.

In order: ``-o logfile=PATH``; the journal when systemd runs us (JOURNAL_STREAM
names our stderr, sd-daemon(3)); the terminal with ``-f``; syslog through
/dev/log; else a file of our own. A daemon in a container has no syslog, and
its ``-o debug`` output must not be thrown away.

Every mount logs to the same place (there is one journal, one syslog, one
default file), so every line names its mount (``name_lines``): a log of its
own for each mount would help only where we choose the file, and ``grep
MOUNTPOINT`` finds one mount's lines wherever they went.
"""
import logging
import logging.handlers
import os
import socket
import sys
from dataclasses import dataclass

SYSLOG = "/dev/log"
ROOT_FILE = "/var/log/offloadfs.log"
FILE_FORMAT = "%(asctime)s offloadfs[%(process)d] %(mountpoint)s %(name)s %(levelname)s %(message)s"
UNNAMED = {"mountpoint": "-"}  # what a line logged before the daemon named its mount shows
# sd-daemon(3): a line starting "<N>" has syslog priority N.
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


@dataclass
class Logs:
    where: str  # for `mount -v`
    handler: logging.Handler

    def install(self, debug):
        logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[self.handler], force=True)


class _Mountpoint(logging.Filter):
    def __init__(self, mountpoint):
        super().__init__()
        self.mountpoint = mountpoint

    def filter(self, record):
        record.mountpoint = self.mountpoint
        return True


def name_lines(mountpoint):
    """From now on every line this process logs names ``mountpoint``."""
    for handler in logging.root.handlers:
        handler.addFilter(_Mountpoint(mountpoint))


class JournalFormatter(logging.Formatter):
    """Every line prefixed: the journal takes each line of a traceback as an entry of its own."""

    def format(self, record):
        prefix = f"<{PRIORITIES.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).splitlines())


def _journal():
    """True if stderr is the stream systemd connected to the journal (not a terminal we were started from)."""
    try:
        dev, ino = map(int, os.environ["JOURNAL_STREAM"].split(":"))
        st = os.fstat(2)
    except (KeyError, ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def default_file():
    """Root's log goes to /var/log; another user's to their XDG state directory, which is theirs
    to write and outlives a logout (unlike /run/user)."""
    if os.geteuid() == 0:
        return ROOT_FILE
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    os.makedirs(state, mode=0o700, exist_ok=True)
    return os.path.join(state, "offloadfs.log")


def _file(path):
    handler = logging.handlers.WatchedFileHandler(path)  # reopens the file logrotate moved away
    handler.setFormatter(logging.Formatter(FILE_FORMAT, defaults=UNNAMED))
    return Logs(path, handler)


def choose(logfile, foreground):
    """Open the log destination now, in the process that can still report an error to the user."""
    if logfile:
        return _file(logfile)
    if _journal():
        # A copy of stderr: the daemon points its own fds 0-2 at /dev/null.
        handler = logging.StreamHandler(os.fdopen(os.dup(2), "w", buffering=1))
        handler.setFormatter(JournalFormatter("%(mountpoint)s %(name)s: %(message)s", defaults=UNNAMED))
        return Logs("the journal", handler)
    if foreground:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(mountpoint)s %(name)s %(levelname)s %(message)s",
                                               defaults=UNNAMED))
        return Logs("stderr", handler)
    if _listening(SYSLOG):
        handler = logging.handlers.SysLogHandler(SYSLOG)
        handler.setFormatter(logging.Formatter("offloadfs[%(process)d]: %(mountpoint)s %(message)s",
                                               defaults=UNNAMED))
        return Logs(f"syslog ({SYSLOG})", handler)
    try:
        return _file(default_file())
    except OSError as e:  # a user without a home of their own, say: mount anyway, and say so
        where = f"nowhere ({e.filename}: {e.strerror}; give -o logfile=PATH)"
        print(f"offloadfs: logs go {where}", file=sys.stderr)
        return Logs(where, logging.NullHandler())


def _listening(path):
    """SysLogHandler takes a /dev/log that nobody reads without a word, and drops every line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True
