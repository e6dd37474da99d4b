"""Loop-device filesystems made from sparse image files.

Clone and server-side copy paths depend on the backing filesystem (btrfs and
xfs can share extents, ext4 cannot), so tests need real filesystems of each
kind without touching the machine's disks. A sparse image costs only the
blocks actually written, which lets a default image hold a >4 GiB sparse file.
"""

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_SIZE = 6 << 30

MKFS = {
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
    # reflink=1 is the default on recent xfsprogs; say it so clones never
    # silently turn into copies on an older one.
    "xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"],
    # Lazy init keeps mkfs from writing the whole inode table into the image.
    "ext4": ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1"],
}


def run(*cmd):
    """Run a command, raising with its stderr so failures say what broke."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def is_mounted(path):
    """True if path is a mountpoint listed in /proc/self/mounts."""
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


def unmount(path):
    """Unmount path, lazily if it stays busy, so cleanup never gets stuck."""
    for _ in range(10):
        if not is_mounted(path):
            return
        if subprocess.run(["umount", path], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    subprocess.run(["umount", "-l", path], capture_output=True)


@contextlib.contextmanager
def loop_filesystem(kind, size=DEFAULT_SIZE, parent="/var/tmp"):
    """Yield the mounted root (a Path) of a fresh `kind` filesystem.

    The image, loop device and mount are removed on exit, even when the body
    or the setup itself fails half way.
    """
    if kind not in MKFS:
        raise ValueError(f"unknown filesystem kind {kind!r}; choose from {sorted(MKFS)}")
    workdir = Path(tempfile.mkdtemp(prefix=f"offloadfs-{kind}-", dir=parent))
    image, root = workdir / "image", workdir / "mnt"
    device = None
    try:
        with open(image, "wb") as f:
            f.truncate(size)
        run(*MKFS[kind], str(image))
        device = run("losetup", "--find", "--show", str(image))
        root.mkdir()
        run("mount", device, str(root))
        yield root
    finally:
        unmount(str(root))
        if device:
            subprocess.run(["losetup", "-d", device], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
