"""The one small interface every backend implements, plus optional capabilities.

A backend serves one source.  It hands out opaque *nodes* (what names a file
on the server: an O_PATH fd, an NFS filehandle, an SMB path) and *files*
(open handles).  The filesystem keys nodes by ``Backend.identity``, not by
``Stat.ino`` alone: a server may give a deleted file's inode number to the
next new file at once.

Capabilities are separate protocols, as in rclone: the copy planner asks
``isinstance(backend, ServerCopy)`` instead of every backend carrying flags.
A backend whose class has a capability its source lacks (a local filesystem
that cannot clone) sets that method to None: isinstance then says no.
A capability method raises ``NotSupported`` when it cannot serve *this*
request (a range that is not aligned, two files on different filesystems),
and the planner moves on to the next method.
"""
import contextvars
import errno
import time
from dataclasses import dataclass, field
from typing import Hashable, Protocol, runtime_checkable

import trio

GROUPS_MAX = 16  # what AUTH_SYS carries
GROUPS_TTL = 1.0  # seconds a process's groups read from /proc serve its next requests
DROP_BOUND = 5.0  # seconds a promise given up waits for the kernel to drop the file (Leases.on_break)
# A time setattr sets to "now" (touch): the source's own clock where it has one, since servers let
# anyone who may write set that (NFS SET_TO_SERVER_TIME4) but only the owner an explicit time.
# The value of fuse.operations.NOW, so the filesystem passes the kernel's times through.
NOW = -1
# What a backend raises when the server did not answer (well): a lost connection, a timeout.  Where
# a failed request could be followed by another one in the same operation, these end it instead:
# the next request would wait as long again.
UNREACHABLE = (errno.EIO, errno.ETIMEDOUT)


class NotSupported(Exception):
    """This capability cannot serve this request; try another method."""


@dataclass(slots=True)
class Caller:
    """The user a request acts for, in CALLER while the request runs.  The local backend gives
    new files to their creator; NFS sends each request as its user (AUTH_SYS), so that the
    server checks their permissions and a root-squashing export lets them reach their files."""
    uid: int
    gid: int
    pid: int = 0
    _groups: list | None = field(default=None, repr=False)

    def groups(self):
        """The primary group, then the supplementary ones, which the kernel does not send: they
        come from /proc, as libfuse's fuse_req_getgroups does, read once a second per process."""
        if self._groups is None:
            self._groups = [self.gid] + [g for g in _proc_groups(self.pid) if g != self.gid][:GROUPS_MAX - 1]
        return self._groups


_groups_read = {}  # pid -> (when, supplementary groups)


def _proc_groups(pid):
    now = time.monotonic()
    when, groups = _groups_read.get(pid, (0.0, None))
    if groups is not None and now - when < GROUPS_TTL:
        return groups
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            line = next((l for l in f if l.startswith(b"Groups:")), b"Groups:")
        groups = [int(g) for g in line.split()[1:]]
    except OSError:
        groups = []  # the process is gone (or pid 0: the kernel's own request)
    if len(_groups_read) > 1024:
        _groups_read.clear()
    _groups_read[pid] = (now, groups)
    return groups


CALLER = contextvars.ContextVar("CALLER", default=Caller(0, 0))


@dataclass(slots=True)
class Stat:
    ino: int
    mode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    size: int = 0
    blocks: int = 0
    blksize: int = 4096
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    change: int = 0  # NFS's change attribute (0 elsewhere): what the directory cache compares


@dataclass(slots=True)
class DirItem:
    """One entry of a listing.  Where the server's listing carried them, ``stat`` (its
    attributes) and ``node`` (what ``lookup`` would give: a node that needs no ``forget``)
    spare a lookup per entry."""
    name: bytes
    ino: int
    type: int  # DT_* value
    stat: Stat | None = None
    node: object = None


@dataclass(slots=True)
class FsStat:
    blocks: int = 0
    bfree: int = 0
    bavail: int = 0
    files: int = 0
    ffree: int = 0
    bsize: int = 4096
    namelen: int = 255
    frsize: int = 4096


def user_xattr(name) -> bool:
    """A user.* attribute name: all that SMB EAs and NFSv4.2 extended attributes can hold."""
    return name.startswith(b"user.") and len(name) > 5


class Backend:
    """One source.  Errors are OSError with the errno a local filesystem would give.

    ``__init__(url, options)`` only checks its arguments; ``root()`` connects,
    and runs before the mount is made, so a bad source fails the mount.
    """

    url: str
    OPTIONS: frozenset = frozenset()  # the mount options this backend takes
    HINTS: dict = {}  # option name -> the form to use instead, for options other tools take
    # Whether an offload to this backend spares this machine moving the bytes (a server copies
    # them, a filesystem shares them): only then do copies recognised in plain writes
    # (recognise.py) pay for hashing every byte read and written.
    offloads_spare_bytes = True
    # Whether a file's attributes (Stat, as recognise.version and cache.version take them) change
    # whenever its data does, whoever changes it: an exact change attribute (NFS), or a ctime the
    # kernel makes fine-grained.  Where not (Samba reports the mtime as the ctime and holds an open
    # file's write time; times can be put back), equal attributes prove nothing: cached pages are
    # not kept on open, and a recognised copy is read back before it counts (recognise.py).
    exact_version = False
    # Whether each user reaches the source with rights of their own (SMB multiuser): a listing made for one
    # user then answers no other's readdir or lookup, and the kernel keeps no names across opens of a
    # directory (Filesystem._valid_listing, opendir_now).
    per_user = False
    # Whether the server clears setuid and setgid itself when a user who may not keep them writes
    # the file (NFS: the Linux client leaves that to the server); the daemon then does not, as its
    # SETATTR would act for the writer, who may not chmod a file they do not own.
    clears_setid_on_write = False
    # Whether the server reports each file's owner and group and decides access by them (NFS, SMB
    # with POSIX extensions): the mount's uid= and gid= then do not replace them, as mount.cifs
    # ignores its uid= with unix extensions and mount.nfs has none.  Not for local sources, which
    # the daemon reaches as root: there they are the mount's own choice, as bindfs's --force-user.
    owners_from_server = False
    name_max = 255  # the longest name in bytes the source takes; set by root() where it says less

    @classmethod
    def check(cls, url, options):
        """Check the source as __init__ does, before the daemon forks: ValueError for a malformed URL or
        option, OSError for a source (or file it names) that is not there."""
        cls(url, options)

    def shares_server_with(self, other: "Backend") -> bool:
        """True if a server-side copy can run from this backend's files to ``other``'s."""
        return other is self

    async def root(self) -> tuple[object, Stat]: raise NotImplementedError
    async def lookup(self, dir, name: bytes) -> tuple[object, Stat]: raise NotImplementedError
    def forget(self, node) -> None: raise NotImplementedError

    def identity(self, node, st: Stat) -> Hashable:
        """What tells the file of ``node`` (found with attributes ``st``) from every other file of
        the source, for as long as the node is held: a new identity gets a new nodeid, so that the
        kernel never takes a new file for one it knew."""
        raise NotImplementedError

    async def getattr(self, node, file=None) -> Stat: raise NotImplementedError

    async def setattr(self, node, file=None, *, mode=None, uid=None, gid=None, size=None,
                      atime_ns=None, mtime_ns=None) -> Stat:
        raise NotImplementedError

    async def readlink(self, node) -> bytes: raise NotImplementedError
    async def mknod(self, dir, name, mode, rdev) -> tuple[object, Stat]: raise NotImplementedError
    async def mkdir(self, dir, name, mode) -> tuple[object, Stat]: raise NotImplementedError
    async def symlink(self, dir, name, target) -> tuple[object, Stat]: raise NotImplementedError
    async def link(self, node, dir, name) -> tuple[object, Stat]: raise NotImplementedError
    async def unlink(self, dir, name) -> None: raise NotImplementedError
    async def rmdir(self, dir, name) -> None: raise NotImplementedError
    async def rename(self, dir, name, newdir, newname, flags) -> None: raise NotImplementedError
    async def open(self, node, flags) -> object: raise NotImplementedError

    def open_checks(self, dir, name, node) -> bool:
        """True if open(node) goes by ``name`` in ``dir`` and fails, ESTALE or ENOENT, where that
        name leads to another file or to none: the open itself then checks what a lookup would."""
        return False

    def opened(self, file) -> Stat | None:
        """The attributes ``file``'s open got from the server along with it, once (then open() asks no
        getattr of its own), or None."""
        return None

    async def create(self, dir, name, flags, mode) -> tuple[object, Stat, object]:
        raise NotImplementedError

    async def read(self, file, offset, size) -> bytes: raise NotImplementedError
    async def write(self, file, offset, data) -> int: raise NotImplementedError
    async def flush(self, file) -> None:
        """close(2) of one descriptor: push what is buffered, so the next open sees it."""

    async def fsync(self, file, datasync) -> None: raise NotImplementedError
    async def release(self, file) -> None: raise NotImplementedError
    async def listdir(self, node) -> tuple[Stat, list[DirItem]]:
        """The directory's attributes, taken before its entries (in the same round trip where the
        protocol allows: they are the version its listing is kept by), and every entry but . and ..."""
        raise NotImplementedError

    async def statfs(self, node) -> FsStat: raise NotImplementedError
    def holds_xattr(self, name) -> bool:
        """Whether an extended attribute of this name can exist here at all (SMB and NFS:
        ``user_xattr``); the others answer EOPNOTSUPP, as the kernel's own clients do."""
        return True

    async def getxattr(self, node, name) -> bytes: raise NotImplementedError
    async def setxattr(self, node, name, value, flags) -> None: raise NotImplementedError
    async def listxattr(self, node) -> list[bytes]: raise NotImplementedError
    async def removexattr(self, node, name) -> None: raise NotImplementedError
    async def close(self) -> None: """Drop connections and handles at unmount."""

    def counters(self) -> dict:
        """Counters of the backend's own protocol for ``offloadfs status``, added up over the mount's sources."""
        return {}


@runtime_checkable
class CloneRange(Protocol):
    """Copy-on-write clone of a range; returns how much was cloned from the start of it.
    ``clone_align``: the offsets must be on a multiple of it (the filesystem's block; 1 where not
    known), else NotSupported."""
    clone_align: int

    async def clone_range(self, src_file, src_offset, dst_file, dst_offset, length) -> int: ...


@runtime_checkable
class ServerCopy(Protocol):
    """The server copies a range itself; may copy less than asked (the caller loops)."""
    async def server_copy(self, src_file, src_offset, dst_file, dst_offset, length) -> int: ...


@runtime_checkable
class InterServerCopy(Protocol):
    """The destination's server pulls a range from another server (NFSv4.2 COPY_NOTIFY + COPY).

    ``src_backend`` is the source's backend; raise NotSupported when this
    pair of servers cannot do it.  May copy less than asked (the caller loops).
    """
    async def inter_server_copy(self, src_backend, src_file, src_offset, dst_file, dst_offset, length) -> int: ...


@runtime_checkable
class SeekData(Protocol):
    """SEEK_DATA / SEEK_HOLE answered by the server."""
    async def seek(self, file, offset, whence) -> int: ...


@runtime_checkable
class Allocate(Protocol):
    """fallocate(2) modes: preallocate, punch hole, zero range."""
    async def allocate(self, file, mode, offset, length) -> None: ...


async def dropped(events):
    """Wait for ``events``, those a Leases.on_break callback returned, DROP_BOUND at most: the server
    lets the other client's change go on once we give the promise up, so the kernel must have dropped
    the pages it read ahead under it first, else a read() after that change gets the bytes from before."""
    with trio.move_on_after(DROP_BOUND):
        for event in events:
            await event.wait()


@runtime_checkable
class Leases(Protocol):
    """The server says before another client changes a file we hold (SMB leases with read caching).

    ``caching(node)``: while such a promise is held on the file, a value that stays the same for as long
    as it is held without a gap; else None.  ``on_break(callback)``: ``callback(node)`` in the trio thread
    whenever one held ends other than by our own close (the file may change from now on); it returns
    the trio.Events set once the kernel has dropped what it held of the file, which a backend
    waits for before it gives the promise up (DELEGRETURN, a lease break's acknowledgment).  On a
    directory (SMB3 directory leases) the promise covers its names, and its end is told at our own
    close too: a listing and the names it lacks are kept for as long as it holds (cache.DirCache).
    """
    def caching(self, node) -> Hashable | None: ...
    def on_break(self, callback) -> None: ...


@runtime_checkable
class Watches(Protocol):
    """A directory's lease also ends at any change to a file in it, by anyone (SMB CHANGE_NOTIFY, which
    Samba sends for a program on the server too): while ``watched(node)``, the listing that Leases
    keeps vouches for its files' attributes as well (cache.DirCache.vouches)."""
    def watched(self, node) -> bool: ...


@runtime_checkable
class Passthrough(Protocol):
    """A local fd the kernel can read and write directly (FUSE passthrough)."""
    def backing_fd(self, file) -> int: ...
