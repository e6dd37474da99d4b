"""The local backend: a directory on this machine (the embedded default).

Each node is an O_PATH descriptor, so renames of parents never stale it and
no name is ever resolved twice.  Every name is resolved with O_NOFOLLOW
relative to its parent's descriptor, so nothing the daemon does follows a
symlink out of the source.  Plain reads and writes, and small copies, run
inline (page-cache copies cost less than a thread hop); long copies run in
worker threads in bounded chunks, so an interrupt is honoured between chunks.
"""
import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

import trio

from .base import CALLER, NOW, Backend, DirItem, FsStat, NotSupported, Stat

FICLONE = 0x40049409  # _IOW(0x94, 9, int)
FICLONERANGE = 0x4020940D  # _IOW(0x94, 13, struct file_clone_range)
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
COPY_CHUNK = 64 << 20  # one worker-thread call of copy_file_range: an interrupt waits for at most one
CLONE_CHUNK = 1 << 30  # one worker-thread call of FICLONERANGE
# Copies and clones this small run inline: a hop to a worker thread and back cost more (0.3 ms)
# than copy_file_range of 1 KiB, or of 1 MiB in the page cache, and as much as the largest write.
INLINE = 1 << 20
# What means "this pair or range cannot be done this way", not "the copy failed".
UNSUPPORTED = {errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ETXTBSY, errno.EBADF}
# Filesystems (statfs f_type) whose ctime moves on every change, finer than a clock tick once it was
# looked at (multigrain timestamps, Linux 6.13): ext4, xfs, btrfs, tmpfs.  Nobody can set a ctime,
# so an unchanged one proves the data unchanged.  A kernel NFS or CIFS mount given as the source
# has no such ctime.
EXACT_CTIME = {0xEF53, 0x58465342, 0x9123683E, 0x01021994}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
_libc.fchownat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
_libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
_libc.utimensat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


def _timespec(ns):
    """utimensat's (seconds, nanoseconds) for a setattr time: None leaves it, NOW is the clock's."""
    if ns is None:
        return 0, UTIME_OMIT
    return (0, UTIME_NOW) if ns == NOW else divmod(ns, 10**9)


def _check(ret):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def _callers_mode():
    """New files get the mode the kernel sent, which has the caller's umask applied already
    (FUSE_DONT_MASK is not negotiated): the daemon's own umask must take nothing more away.
    Set and restored around one synchronous call, so no other request runs in between."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@dataclass(slots=True)
class Node:
    fd: int  # O_PATH
    mode: int  # file type bits

    @property
    def proc(self):
        """A path that reopens this inode without resolving any name again."""
        return f"/proc/self/fd/{self.fd}"


@dataclass(slots=True)
class File:
    fd: int


def _kernel_version():
    release = os.uname().release.split("-")[0].split(".")
    return tuple(int(part) for part in release[:2] if part.isdigit())


def _fs_type(fd):
    """statfs's f_type of the filesystem ``fd`` is on (the first word of struct statfs)."""
    buf = ctypes.create_string_buffer(128)
    _check(_libc.fstatfs(fd, buf))
    return ctypes.c_long.from_buffer(buf).value


def source_path(url):
    """'/srv/x' or 'file:///srv/x' -> '/srv/x'."""
    if url.startswith("file:"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError("file URLs name a local path (file:///path)")
        return unquote(parsed.path)
    return url


class LocalBackend(Backend):
    OPTIONS = frozenset()

    @classmethod
    def check(cls, url, options):
        # stat, not open: the parent's fd would pass to the daemon and keep the source busy.
        if not stat.S_ISDIR(os.stat(source_path(url)).st_mode):
            raise NotADirectoryError

    def __init__(self, url, options):
        self.url = url
        self.path = os.path.abspath(source_path(url))
        self._root_fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._root_dev = os.fstat(self._root_fd).st_dev
        vfs = os.fstatvfs(self._root_fd)
        self.clone_align = vfs.f_bsize  # FICLONERANGE: the filesystem's block
        self.name_max = min(vfs.f_namemax, self.name_max)
        self.exact_version = _kernel_version() >= (6, 13) and _fs_type(self._root_fd) in EXACT_CTIME
        if not _clones(self._root_fd):
            self.clone_range = None  # the planner plans no clones here (a capability this backend lacks)

    @property
    def offloads_spare_bytes(self):
        # Without clones an offload is copy_file_range: the kernel copying the bytes, as writing them does.
        return self.clone_range is not None

    def shares_server_with(self, other):
        # Every local file is on this host: the kernel decides per pair (EXDEV).
        return isinstance(other, LocalBackend)

    def _stat(self, st):
        ino = st.st_ino
        if st.st_dev != self._root_dev:
            # Another filesystem mounted inside the source: fold its device in.
            ino = (ino ^ (st.st_dev << 40)) & 0xFFFFFFFFFFFFFFFF
        return Stat(ino=ino, mode=st.st_mode, nlink=st.st_nlink, uid=st.st_uid, gid=st.st_gid,
                    rdev=st.st_rdev, size=st.st_size, blocks=st.st_blocks, blksize=st.st_blksize,
                    atime_ns=st.st_atime_ns, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)

    def _node(self, dir, name):
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir.fd)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        return Node(fd, stat.S_IFMT(st.st_mode)), self._stat(st)

    async def root(self):
        fd = os.dup(self._root_fd)
        st = os.fstat(fd)
        return Node(fd, stat.S_IFMT(st.st_mode)), self._stat(st)

    async def lookup(self, dir, name):
        return self._node(dir, name)

    def forget(self, node):
        os.close(node.fd)

    def identity(self, node, st):
        return st.ino  # the O_PATH descriptor holds the inode: its number is not reused meanwhile

    async def getattr(self, node, file=None):
        return self._stat(os.fstat(file.fd if file else node.fd))

    async def setattr(self, node, file=None, *, mode=None, uid=None, gid=None, size=None,
                      atime_ns=None, mtime_ns=None):
        if mode is not None:
            if stat.S_ISLNK(node.mode):
                raise OSError(errno.EOPNOTSUPP, "symlinks have no mode")
            os.chmod(node.proc, mode)
        if uid is not None or gid is not None:
            _check(_libc.fchownat(node.fd, b"", -1 if uid is None else uid, -1 if gid is None else gid,
                                  AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
        if size is not None:
            if stat.S_ISLNK(node.mode):
                raise OSError(errno.EINVAL, "cannot truncate a symlink")  # /proc would follow it
            if file is not None:
                os.ftruncate(file.fd, size)
            else:
                os.truncate(node.proc, size)
        if atime_ns is not None or mtime_ns is not None:
            times = (ctypes.c_long * 4)(*_timespec(atime_ns), *_timespec(mtime_ns))
            _check(_libc.utimensat(node.fd, b"", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))
        return await self.getattr(node, file)

    async def readlink(self, node):
        return os.readlink(b"", dir_fd=node.fd)

    def _own(self, dir, name):
        """New entries belong to the caller, as on a local filesystem (the daemon runs as root)."""
        caller = CALLER.get()
        if os.geteuid() == 0 and caller.uid != 0:
            gid = caller.gid
            if os.fstat(dir.fd).st_mode & stat.S_ISGID:
                gid = -1  # a setgid directory already chose the group
            os.chown(name, caller.uid, gid, dir_fd=dir.fd, follow_symlinks=False)

    async def mknod(self, dir, name, mode, rdev):
        with _callers_mode():
            os.mknod(name, mode, rdev, dir_fd=dir.fd)
        self._own(dir, name)
        return self._node(dir, name)

    async def mkdir(self, dir, name, mode):
        with _callers_mode():
            os.mkdir(name, mode, dir_fd=dir.fd)
        self._own(dir, name)
        return self._node(dir, name)

    async def symlink(self, dir, name, target):
        os.symlink(target, name, dir_fd=dir.fd)
        self._own(dir, name)
        return self._node(dir, name)

    async def link(self, node, dir, name):
        _check(_libc.linkat(node.fd, b"", dir.fd, name, AT_EMPTY_PATH))
        return self._node(dir, name)

    async def unlink(self, dir, name):
        os.unlink(name, dir_fd=dir.fd)

    async def rmdir(self, dir, name):
        os.rmdir(name, dir_fd=dir.fd)

    async def rename(self, dir, name, newdir, newname, flags):
        _check(_libc.renameat2(dir.fd, name, newdir.fd, newname, flags))

    async def open(self, node, flags):
        if stat.S_ISLNK(node.mode):
            raise OSError(errno.ELOOP, "is a symlink")
        # The kernel resolved the name already; O_NOFOLLOW would trip over the /proc magic link.
        flags &= ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NOFOLLOW)
        return File(os.open(node.proc, flags | os.O_CLOEXEC))

    async def create(self, dir, name, flags, mode):
        with _callers_mode():
            fd = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir.fd)
        try:
            self._own(dir, name)
            node, st = self._node(dir, name)
        except BaseException:
            os.close(fd)
            raise
        return node, st, File(fd)

    async def read(self, file, offset, size):
        return os.pread(file.fd, size, offset)

    async def write(self, file, offset, data):
        return os.pwrite(file.fd, data, offset)

    async def fsync(self, file, datasync):
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, file.fd)

    async def release(self, file):
        os.close(file.fd)

    async def listdir(self, node):
        fd = os.open(node.proc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            before = self._stat(os.fstat(fd))
            with os.scandir(fd) as it:
                return before, [DirItem(os.fsencode(e.name), e.inode(), _dtype(e)) for e in it]
        finally:
            os.close(fd)

    async def statfs(self, node):
        s = os.statvfs(node.proc)
        return FsStat(blocks=s.f_blocks, bfree=s.f_bfree, bavail=s.f_bavail, files=s.f_files,
                      ffree=s.f_ffree, bsize=s.f_bsize, namelen=s.f_namemax, frsize=s.f_frsize)

    def _xattr_path(self, node):
        if stat.S_ISLNK(node.mode):
            raise OSError(errno.EOPNOTSUPP, "no xattrs on symlinks")
        return node.proc

    async def getxattr(self, node, name):
        return os.getxattr(self._xattr_path(node), name)

    async def setxattr(self, node, name, value, flags):
        os.setxattr(self._xattr_path(node), name, value, flags)

    async def listxattr(self, node):
        if stat.S_ISLNK(node.mode):
            return []
        return [os.fsencode(n) for n in os.listxattr(node.proc)]

    async def removexattr(self, node, name):
        os.removexattr(self._xattr_path(node), name)

    async def close(self):
        os.close(self._root_fd)

    # -- capabilities ---------------------------------------------------------

    async def seek(self, file, offset, whence):
        return os.lseek(file.fd, offset, whence)

    async def allocate(self, file, mode, offset, length):
        _check(_libc.fallocate(file.fd, mode, offset, length))

    def backing_fd(self, file):
        return file.fd

    async def clone_range(self, src_file, src_offset, dst_file, dst_offset, length):
        done = 0
        while done < length:
            n = min(CLONE_CHUNK, length - done)
            arg = struct.pack("=qQQQ", src_file.fd, src_offset + done, n, dst_offset + done)
            try:
                await _run(n, fcntl.ioctl, dst_file.fd, FICLONERANGE, arg)
            except OSError as e:
                if e.errno not in UNSUPPORTED:
                    raise
                if done == 0:
                    raise NotSupported(e.strerror) from None
                break
            done += n
        return done

    async def server_copy(self, src_file, src_offset, dst_file, dst_offset, length):
        n = min(length, COPY_CHUNK)
        try:
            return await _run(n, os.copy_file_range, src_file.fd, dst_file.fd, n, src_offset, dst_offset)
        except OSError as e:
            if e.errno in UNSUPPORTED:
                raise NotSupported(e.strerror) from None
            raise


async def _run(length, fn, *args):
    """``fn(*args)``, a copy of ``length`` bytes: inline if small (INLINE), else in a worker thread."""
    if length <= INLINE:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)


def _clones(dir_fd):
    """Whether the filesystem holding ``dir_fd`` clones: FICLONE between two empty unnamed files
    made in it, which leave nothing behind.  A directory the daemon may not write to, or where
    unnamed files cannot be made, counts as one that does not."""
    fds = []
    try:
        for _ in range(2):
            fds.append(os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd))
        fcntl.ioctl(fds[1], FICLONE, fds[0])
        return True
    except OSError:
        return False
    finally:
        for fd in fds:
            os.close(fd)


def _dtype(entry):
    if entry.is_symlink():
        return 10  # DT_LNK
    if entry.is_dir(follow_symlinks=False):
        return 4  # DT_DIR
    if entry.is_file(follow_symlinks=False):
        return 8  # DT_REG
    return 0  # DT_UNKNOWN: the kernel asks with a lookup
