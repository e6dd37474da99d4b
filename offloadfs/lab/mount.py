"""offloadfs mounts driven through the real command line.

Tests, benchmark and demo mount the way a user does (`offloadfs mount`), so
they exercise option parsing and daemon start-up too, and a mount is always
taken down again even when the code using it fails.
"""

import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

from offloadfs import cli
from offloadfs.lab.loopfs import is_mounted

TIMEOUT = 60


class MountError(RuntimeError):
    """`offloadfs mount` failed; the message is its stderr."""


def offloadfs_cli(*args, timeout=TIMEOUT, check=False):
    """Run `python -m offloadfs ARGS` with this interpreter, capturing output."""
    cmd = [sys.executable, "-m", "offloadfs", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check)


def mount_args(sources_or_source, mountpoint, options=()):
    """Arguments of `offloadfs mount` for one source or a {name: source} dict."""
    options = list(options)
    positional = []
    if isinstance(sources_or_source, dict):
        options += [f"source={name}={src}" for name, src in sources_or_source.items()]
    else:
        positional = [str(sources_or_source)]
    args = ["mount", *positional, str(mountpoint)]
    if options:
        args += ["-o", ",".join(options)]
    return args


def status(mountpoint):
    """The mount's `offloadfs status --json` object, read the CLI's way in this process: a CLI run
    per call cost 0.3-0.4 s of interpreter start on a busy machine, a getxattr costs 1 ms."""
    try:
        return cli.read_status(mountpoint)
    except cli.UsageError as e:
        raise RuntimeError(f"offloadfs status {mountpoint}: {e}") from None


def unmount(mountpoint):
    """Unmount as `offloadfs umount` does, in this process (a CLI run per mount cost 0.4 s on a busy
    machine, most of it interpreter start); if that fails (busy, or a lab namespace started
    meanwhile holds a copy), end the daemon with `offloadfs umount --force`, and as a last resort
    umount lazily."""
    with contextlib.suppress(cli.Failed, OSError):  # what the CLI would say in one line
        cli.do_umount(mountpoint, lazy=False)
    if not is_mounted(mountpoint):
        return
    try:
        offloadfs_cli("umount", "--force", mountpoint)
    except subprocess.TimeoutExpired:
        pass
    if not is_mounted(mountpoint):
        return
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


@contextlib.contextmanager
def offloadfs_mount(sources_or_source, mountpoint=None, options=()):
    """Mount offloadfs, yield the mountpoint (a Path), and unmount on exit.

    Without `mountpoint` a temporary directory is made and removed again.
    """
    made = mountpoint is None
    mountpoint = Path(tempfile.mkdtemp(prefix="offloadfs-mnt-") if made else mountpoint)
    try:
        proc = offloadfs_cli(*mount_args(sources_or_source, mountpoint, options))
        if proc.returncode != 0:
            raise MountError(proc.stderr.strip() or f"exit {proc.returncode}")
        yield mountpoint
    finally:
        unmount(mountpoint)
        if made:
            with contextlib.suppress(OSError):
                mountpoint.rmdir()
