"""Attach a FUSE connection to a mountpoint, and detach it.

As root we open /dev/fuse and call mount(2) ourselves; otherwise the setuid
``fusermount3`` mounts for us and hands the device fd back over a unix
socket (the _FUSE_COMMFD handshake), which is what libfuse does too.
"""
import ctypes
import os
import socket
import stat
import subprocess

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

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


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


def set_readahead(mountpoint, kib):
    """Raise the mount's readahead: the kernel's 128 KiB default cuts buffered reads into small READs.

    The device number comes from /proc/self/mountinfo, not stat(2): the daemon
    must not send its own mount a request it is busy serving.
    """
    device = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == mountpoint:
                device = fields[2]
    if device is None:
        raise MountError(f"{mountpoint}: not in /proc/self/mountinfo")
    with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as f:
        f.write(str(kib))


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
