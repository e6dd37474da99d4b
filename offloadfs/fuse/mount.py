"""Attach a FUSE connection to a mountpoint, and detach it.

As root we open /dev/fuse and call mount(2) ourselves; otherwise the setuid
``fusermount3`` mounts for us and hands the device fd back over a unix
socket (the _FUSE_COMMFD handshake), which is what libfuse does too.
"""
import contextlib
import ctypes
import os
import socket
import stat
import subprocess
import threading
from typing import NamedTuple

from . import utab

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MNT_DETACH = 2

FLAG_OPTIONS = {
    "ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
    "sync": MS_SYNCHRONOUS, "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
}
FUSERMOUNT = "fusermount3"
FUSECTL = "/sys/fs/fuse/connections"
FLUSH_WAIT = 2.0  # seconds umount --force gives the daemon to take the kernel's dirty pages

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syncfs.argtypes = [ctypes.c_int]


class MountError(Exception):
    """Mounting failed; the message is meant for the user."""


def mount(mountpoint, *, fsname, flags=0, allow_other=False, default_permissions=False):
    """Mount a new FUSE connection on ``mountpoint`` and return the /dev/fuse fd."""
    mode = os.stat(mountpoint).st_mode
    if os.geteuid() != 0:
        return _fusermount(mountpoint, fsname, flags, allow_other, default_permissions)
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise MountError(f"cannot open /dev/fuse: {e.strerror}") from None
    data = f"fd={fd},rootmode={stat.S_IFMT(mode):o},user_id={os.getuid()},group_id={os.getgid()}"
    if allow_other:
        data += ",allow_other"
    if default_permissions:
        data += ",default_permissions"
    ret = _libc.mount(fsname.encode(), os.fsencode(mountpoint), b"fuse.offloadfs", flags | MS_NOSUID | MS_NODEV,
                      data.encode())
    if ret != 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise MountError(f"mount {mountpoint}: {os.strerror(err)}")
    return fd


def _fusermount(mountpoint, fsname, flags, allow_other, default_permissions):
    opts = ["nosuid", "nodev", f"fsname={fsname.replace(',', '_')}", "subtype=offloadfs"]
    opts += [name for name, bit in FLAG_OPTIONS.items() if flags & bit]
    if allow_other:
        opts.append("allow_other")
    if default_permissions:
        opts.append("default_permissions")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        try:
            proc = subprocess.run(
                [FUSERMOUNT, "-o", ",".join(opts), "--", os.fspath(mountpoint)],
                env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
                pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            raise MountError(f"{FUSERMOUNT} not found: install fuse3 or mount as root") from None
        if proc.returncode != 0:
            raise MountError(proc.stderr.strip() or f"{FUSERMOUNT} failed")
        theirs.close()
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    if not fds:
        raise MountError(f"{FUSERMOUNT} did not pass a /dev/fuse descriptor")
    return fds[0]


def unmount(mountpoint, *, lazy=False):
    """Unmount; ``lazy`` detaches a busy mount now and frees it when last used."""
    if os.geteuid() != 0:
        cmd = [FUSERMOUNT, "-u"] + (["-z"] if lazy else []) + ["--", os.fspath(mountpoint)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise MountError(proc.stderr.strip() or f"{FUSERMOUNT} -u failed")
        return
    if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH if lazy else 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {mountpoint}: {os.strerror(err)}")
    utab.forget(mountpoint)


def set_readahead(mountpoint, kib):
    """Raise the mount's readahead: the kernel's 128 KiB default cuts buffered reads into small READs."""
    with open(f"/sys/class/bdi/{device(mountpoint)}/read_ahead_kb", "w") as f:
        f.write(str(kib))


class Copy(NamedTuple):
    """A mount as one mount namespace's mountinfo shows it."""
    pid: int  # a process of that namespace
    path: str
    dev: str  # "major:minor": the FUSE connection, the same in every namespace
    tags: dict  # its propagation: {"shared": peer group, "master": peer group} as the line has them


def _copy(pid, fields):
    optional = fields[6:fields.index("-")]
    return Copy(pid, _unescape(fields[4]), fields[2], dict(tag.split(":", 1) for tag in optional if ":" in tag))


def mount_entry(mountpoint):
    """The mount on ``mountpoint`` (the last one there) as /proc/self/mountinfo has it.

    mountinfo, not stat(2): the daemon must not send its own mount a request it is busy serving.
    """
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == mountpoint:
                found = _copy(os.getpid(), fields)
    if found is None:
        raise MountError(f"{mountpoint}: not in /proc/self/mountinfo")
    return found


def device(mountpoint):
    """The mount's device number "major:minor", which also names its FUSE connection."""
    return mount_entry(mountpoint).dev


def holders(mountpoint, dev=None):
    """[Copy]: one for each other mount namespace that holds the mount (``dev``, or an offloadfs mount on
    ``mountpoint``).

    A process started with `unshare -m` or `ip netns exec` while we were mounted got a copy of
    the mount; the kernel keeps the connection, and the daemon serving, while any copy lives.
    Only /proc is read: the mount itself is never touched, so a hung daemon cannot hang us.
    """
    seen = {os.readlink("/proc/self/ns/mnt")}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            if ns in seen:
                continue
            seen.add(ns)
            with open(f"/proc/{pid}/mountinfo") as f:
                lines = f.read().splitlines()
        except OSError:
            continue  # gone, or not ours to see
        for line in lines:
            fields = line.split()
            path = _unescape(fields[4])
            fstype = fields[fields.index("-") + 1]
            match = fields[2] == dev if dev else path == mountpoint and fstype.endswith("offloadfs")
            if match:
                found.append(_copy(int(pid), fields))
                break
    return found


def outliving(copies, ours):
    """The ``copies`` that unmounting ``ours`` leaves mounted.

    The kernel unmounts the peers of a shared mount's peer group with it, and its slaves, and
    theirs (a slave that is shared passes the unmount on to its own peers and slaves).  A private
    or unbindable copy, or one of another peer group, stays, and the daemon serves it on.
    """
    reached = {ours.tags["shared"]} if "shared" in ours.tags else set()
    left = list(copies)
    while taken := [c for c in left if c.tags.get("shared") in reached or c.tags.get("master") in reached]:
        reached |= {c.tags["shared"] for c in taken if "shared" in c.tags}
        left = [c for c in left if c not in taken]
    return left


def force_unmount(mountpoint, held):
    """End the mount everywhere: flush what the kernel holds (if the daemon answers in time),
    unmount here, abort the connection.  The daemon then reads ENODEV, closes its sources and ends.

    ``held`` is what holders() found; without a mount here, the flush goes through
    the root of a process that has one.
    """
    if is_mounted(mountpoint):
        dev, reach = device(mountpoint), mountpoint
    else:
        dev, reach = held[0].dev, f"/proc/{held[0].pid}/root{held[0].path}"
    # A hung daemon would hang the flush: it is left waiting, and the abort ends its wait.

    def flush_quietly():
        with contextlib.suppress(OSError):  # a dead mount: nothing to flush
            flush(reach)

    flusher = threading.Thread(target=flush_quietly, daemon=True)
    flusher.start()
    flusher.join(FLUSH_WAIT)
    if is_mounted(mountpoint):
        unmount(mountpoint, lazy=True)
    abort(dev)


def flush(path):
    """syncfs(2) of the filesystem ``path`` is on: the kernel's dirty pages (writeback_cache) go to the daemon."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def abort(dev):
    """End the FUSE connection of device ``dev`` ("major:minor") in every mount namespace at once.

    Unmounting ends it only where the last copy of the mount goes; the fusectl
    filesystem's `abort` file ends it whoever holds a copy: the daemon reads
    ENODEV, the copies answer ENOTCONN.  fusectl is mounted if it is not.
    """
    major, minor = map(int, dev.split(":"))
    path = f"{FUSECTL}/{major << 20 | minor}/abort"  # the kernel's dev_t, as fusectl names it
    if not os.path.ismount(FUSECTL) and _libc.mount(b"fusectl", FUSECTL.encode(), b"fusectl", 0, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount fusectl on {FUSECTL}: {os.strerror(err)}")
    with open(path, "w") as f:
        f.write("1")


def is_mounted(mountpoint):
    """True if ``mountpoint`` (an absolute path, symlinks resolved) is an offloadfs mount, also a dead one.

    Resolving the path here would stat the mount itself: from inside the
    daemon that is a request to ourselves, which we could never answer.
    """
    return mountpoint in mounts()


def mounts():
    """The mountpoints of every offloadfs mount in this mount namespace, in mount order."""
    with open("/proc/self/mounts") as f:
        return [_unescape(fields[1]) for fields in map(str.split, f)
                if len(fields) > 2 and fields[2] == "fuse.offloadfs"]


def _unescape(field):
    """/proc/self/mounts writes space, tab, newline and backslash as octal escapes."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field
