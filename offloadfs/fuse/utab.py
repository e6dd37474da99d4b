"""Forget a mount in libmount's /run/mount/utab.

mount(8) records there the options the kernel does not keep (_netdev,
x-systemd.*, ...) for an fstab or unit mount; umount(8) removes the line.  An
unmount of ours must too, or findmnt and systemd read the stale options for the
next mount on that path.  libmount does it, under its own lock.
"""
import ctypes
import ctypes.util

_name = ctypes.util.find_library("mount")
_libmount = ctypes.CDLL(_name) if _name else None  # no util-linux: no utab either
if _libmount:
    _libmount.mnt_new_update.restype = ctypes.c_void_p
    _libmount.mnt_update_set_fs.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_void_p]
    _libmount.mnt_update_table.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    _libmount.mnt_free_update.argtypes = [ctypes.c_void_p]


def forget(mountpoint):
    """Remove ``mountpoint``'s utab line, if it has one (as after umount(8); errors are libmount's to log)."""
    if not _libmount:
        return
    update = _libmount.mnt_new_update()
    if not update:
        return
    try:
        if _libmount.mnt_update_set_fs(update, 0, mountpoint.encode(), None) == 0:
            _libmount.mnt_update_table(update, None)
    finally:
        _libmount.mnt_free_update(update)
