"""What the protocol layer asks of a filesystem, in plain Python types.

The session decodes each kernel request into a call on an ``Operations``
object and encodes what it returns.  Errors travel as ``OSError`` with an
errno.  Every operation the kernel may send has a default here, so a
filesystem overrides only what it implements and the rest answers ENOSYS
(or, for ioctl, ENOTTY, which is what callers probing a tty expect).
"""
import errno
from dataclasses import dataclass


@dataclass(slots=True)
class Ctx:
    """The caller of one request, as the kernel reports it."""
    uid: int
    gid: int
    pid: int


@dataclass(slots=True)
class Entry:
    """A name resolved to a node; each one handed to the kernel is a lookup it will forget.
    Nodeid 0 (and no attr) is a negative entry: the name does not exist, for entry_timeout."""
    nodeid: int
    attr: object  # anything with the fields of struct fuse_attr: see session.pack_attr
    entry_timeout: float = 1.0
    attr_timeout: float = 1.0
    generation: int = 0


@dataclass(slots=True)
class Opened:
    """The answer to open/create/opendir."""
    fh: int
    backing_fd: int | None = None  # a file to hand to FUSE passthrough
    # open(): the file is as the kernel last saw it, so it keeps its cached pages and attributes;
    # otherwise both are dropped (close-to-open).  opendir(): the kernel may answer this handle's
    # reads from the names it cached (see cache_dir); otherwise it drops them.
    keep_cache: bool = False
    # The handle's reads and writes go around the kernel's page cache, each as the caller made it.
    direct_io: bool = False
    # opendir() only: the kernel keeps the names it reads in a cache of its own (FOPEN_CACHE_DIR).
    cache_dir: bool = False


@dataclass(slots=True)
class DirEntry:
    """One readdir record; ``next_offset`` is the cookie that resumes after it."""
    name: bytes
    ino: int
    type: int  # DT_* value
    next_offset: int


@dataclass(slots=True)
class SetAttr:
    """The changes of one SETATTR; None means unchanged.  Times are ns; NOW is -1."""
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    fh: int | None = None
    kill_suidgid: bool = False


NOW = -1


@dataclass(slots=True)
class ConnInfo:
    """What INIT settled: the filesystem may read it; the session owns it."""
    minor: int
    writeback_cache: bool
    passthrough: bool
    kernel: object = None  # the session: its notify_inval_* drop what the kernel caches


def _nosys(*_args, **_kwargs):
    raise OSError(errno.ENOSYS, "not implemented")


class Operations:
    """Override the operations you implement.  All are coroutines except forget, releasedir and those
    answered at once (the ``_now`` ones, no_such_xattr)."""

    def init(self, conn: ConnInfo) -> None:
        """Called once INIT is negotiated, before any other request is served."""

    def destroy(self) -> None:
        """Called on DESTROY or when the connection ends."""

    def forget(self, nodeid: int, nlookup: int) -> None:
        """The kernel dropped ``nlookup`` references to ``nodeid``."""

    def no_such_xattr(self, nodeid: int, name: bytes) -> bool:
        """True if ``nodeid`` cannot hold the attribute ``name``: GETXATTR is then answered EOPNOTSUPP
        at once, without a task.  `ls -l` asks for two attributes of every file it lists, and stops
        asking on a filesystem that answers EOPNOTSUPP once (as the kernel's CIFS and NFS clients do
        for labels and POSIX ACLs)."""
        return False

    def write_now(self, nodeid: int, fh: int, offset: int, data, kill_suidgid: bool) -> int | None:
        """Take a WRITE at once, without a task, where it needs no I/O (its bytes only join what the
        filesystem holds): the count written; None to take it as any request.  Asked only while no
        earlier WRITE to the node waits.  tar x makes WRITEs of 5 KiB on average, and a task for
        each cost about as much as the write itself."""
        return None

    def getattr_now(self, ctx, nodeid: int, fh: int | None) -> tuple[object, float] | None:
        """getattr answered at once, without a task, where the attributes are at hand; None to take it
        as any request.  `find` past attr_timeout asks for every directory's, then opens and closes
        it (opendir_now, releasedir): answered so, `find` over a tree of 21 directories took 3-5 %
        less time (medians of two A/B runs of 16 and 20 rounds on the Samba lab)."""
        return None

    def opendir_now(self, ctx, nodeid: int, flags: int) -> Opened | None:
        """opendir answered at once, without a task, where it needs no I/O; None to take it as any
        request."""
        return None

    def releasedir(self, ctx, nodeid: int, fh: int) -> None:
        """The kernel closed directory handle ``fh``; answered at once, without a task."""

    def begin(self, ctx: Ctx) -> None:
        """A request for ``ctx`` starts in the current trio task (each request has its own, but for
        those answered at once, which the reader answers in its own): state that lasts for the
        request, such as whom it acts for, can be set here in context variables."""

    async def lookup(self, ctx, parent, name) -> Entry: _nosys()
    async def getattr(self, ctx, nodeid, fh) -> tuple[object, float]: _nosys()
    async def setattr(self, ctx, nodeid, changes: SetAttr) -> tuple[object, float]: _nosys()
    async def readlink(self, ctx, nodeid) -> bytes: _nosys()
    async def symlink(self, ctx, parent, name, target) -> Entry: _nosys()
    async def mknod(self, ctx, parent, name, mode, rdev) -> Entry: _nosys()
    async def mkdir(self, ctx, parent, name, mode) -> Entry: _nosys()
    async def unlink(self, ctx, parent, name) -> None: _nosys()
    async def rmdir(self, ctx, parent, name) -> None: _nosys()
    async def rename(self, ctx, parent, name, newparent, newname, flags) -> None: _nosys()
    async def link(self, ctx, nodeid, newparent, newname) -> Entry: _nosys()
    async def open(self, ctx, nodeid, flags, kill_suidgid) -> Opened: _nosys()
    async def create(self, ctx, parent, name, mode, flags) -> tuple[Entry, Opened]: _nosys()
    async def read(self, ctx, nodeid, fh, offset, size) -> bytes: _nosys()
    async def write(self, ctx, nodeid, fh, offset, data, kill_suidgid) -> int: _nosys()
    async def flush(self, ctx, nodeid, fh) -> None: _nosys()
    async def release(self, ctx, nodeid, fh) -> None: _nosys()
    async def fsync(self, ctx, nodeid, fh, datasync) -> None: _nosys()
    async def opendir(self, ctx, nodeid, flags) -> Opened: _nosys()
    async def readdir(self, ctx, nodeid, fh, offset) -> list[DirEntry]: _nosys()

    async def readdirplus(self, ctx, nodeid, fh, offset, fits) -> list[tuple[DirEntry, Entry | None]]:
        """readdir with each entry's lookup (None: a zero entry), for as long as ``fits(name)``
        says the entry still fits in the reply: one that does not fit must not be looked up."""
        _nosys()

    async def fsyncdir(self, ctx, nodeid, fh, datasync) -> None: _nosys()
    async def statfs(self, ctx, nodeid) -> object: _nosys()  # fields of struct fuse_kstatfs
    async def access(self, ctx, nodeid, mask) -> None: _nosys()
    async def setxattr(self, ctx, nodeid, name, value, flags) -> None: _nosys()
    async def getxattr(self, ctx, nodeid, name) -> bytes: _nosys()
    async def listxattr(self, ctx, nodeid) -> list[bytes]: _nosys()
    async def removexattr(self, ctx, nodeid, name) -> None: _nosys()
    async def lseek(self, ctx, nodeid, fh, offset, whence) -> int: _nosys()
    async def fallocate(self, ctx, nodeid, fh, offset, length, mode) -> None: _nosys()

    async def copy_file_range(self, ctx, nodeid_in, fh_in, off_in,
                              nodeid_out, fh_out, off_out, length, flags) -> int:
        _nosys()

