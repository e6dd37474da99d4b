"""The FUSE clients a user would mount a Samba share with instead of offloadfs: rclone mount and smbnetfs.

Both come from Debian 12 packages, installed here when missing (this is the benchmark's own set-up, not
scripts/setup: the product does not need them). Each runs in the foreground as our child, in a session of
its own: rclone's `--daemon` hides start-up errors (and clashes with `--rc`), and a child we started is one
we can end for certain, with every process it forked, when the benchmark fails half way.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from offloadfs.lab.loopfs import is_mounted, unmount
from offloadfs.lab.mount import mount_args

PACKAGES = ("rclone", "smbnetfs")
START_TIMEOUT = 30
STOP_TIMEOUT = 10
# What a careful user picks for a fast rclone mount: the directory cache held for an hour (default 5 min);
# no VFS write cache, so that close() returns once the file is on the server (with `writes` rclone uploads
# it some seconds later, and `create` would time the local disk); attribute timeout left at its 1 s.
RCLONE_OPTIONS = ("--dir-cache-time", "1h", "--vfs-cache-mode", "off")
# Only the lab server we name: no browsing of the network for workgroups and hosts (smbnetfs's default),
# no password store, names resolved without NetBIOS broadcasts.
SMBNETFS_CONF = """\
smb_query_browsers "false"
use_libsecret "false"
host "{host}" visible=true
auth "{host}" "{user}" "{password}"
"""
LIBSMBCLIENT_CONF = """\
[global]
client min protocol = SMB2
disable netbios = yes
name resolve order = host
"""


def install_peers(packages=PACKAGES):
    """apt-get install whichever of ``packages`` (each named as its command) is missing (apt-get update
    first if the lists are stale)."""
    missing = [name for name in packages if shutil.which(name) is None]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(install, env=env, check=True)


def private_file(path, text):
    """Write a file only root can read (it holds a password); returns path."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    return path


def stop(process):
    """Let `process` exit by itself (an unmounted FUSE daemon does), else SIGTERM it and then SIGKILL;
    last, SIGKILL whatever it forked that is still in its session."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig:
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT)
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def fuse_daemon(argv, mountpoint, log, env=None):
    """Run a FUSE daemon in the foreground as our child, output to `log`; once `mountpoint` is mounted, yield
    its session id (its pid: it leads a session of its own).

    On exit it is unmounted first (a daemon killed while mounted would leave a dead mount) and then the
    daemon's session ended.
    """
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not is_mounted(mountpoint):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not mount {mountpoint}:\n{Path(log).read_text()[-3000:]}")
            time.sleep(0.05)
        yield process.pid
    finally:
        unmount(str(mountpoint))
        stop(process)


def mountpoint(workdir, name):
    path = Path(workdir, name)
    path.mkdir()
    return path


@contextlib.contextmanager
def rclone_mount(server, share, workdir):
    """`rclone mount` of `share` with RCLONE_OPTIONS; yield (the directory showing the share, session id)."""
    obscured = subprocess.run(["rclone", "obscure", "-"], input=server.password, capture_output=True,
                              text=True, check=True).stdout.strip()
    conf = private_file(Path(workdir, "rclone.conf"), f"[lab]\ntype = smb\nhost = {server.host}\n"
                                                      f"user = {server.username}\npass = {obscured}\n")
    mnt = mountpoint(workdir, "rclone")
    argv = ["rclone", "mount", f"lab:{share}", mnt, "--config", conf, "--cache-dir", Path(workdir, "cache"),
            *RCLONE_OPTIONS]
    with fuse_daemon(list(map(str, argv)), mnt, Path(workdir, "rclone.log")) as sid:
        yield mnt, sid


@contextlib.contextmanager
def smbnetfs_mount(server, share, workdir):
    """smbnetfs with the lab server as its only host; yield (the directory showing `share`, session id).

    HOME points into `workdir`, where libsmbclient looks for its smb.conf.
    """
    smb = Path(workdir, ".smb")
    smb.mkdir()
    (smb / "smb.conf").write_text(LIBSMBCLIENT_CONF)
    conf = private_file(smb / "smbnetfs.conf", SMBNETFS_CONF.format(
        host=server.host, user=server.username, password=server.password))
    mnt = mountpoint(workdir, "smbnetfs")
    argv = ["smbnetfs", str(mnt), "-f", "-o", f"config={conf}"]
    with fuse_daemon(argv, mnt, Path(workdir, "smbnetfs.log"), env={**os.environ, "HOME": str(workdir)}) as sid:
        yield mnt / server.host / share, sid


@contextlib.contextmanager
def offloadfs_debug_mount(server, share, workdir):
    """offloadfs in the foreground with `-o debug`, its log (one line per FUSE request) in workdir/offloadfs.log.

    Yields (mountpoint, log path).
    """
    cred = server.write_credentials(Path(workdir, "credentials"))
    mnt = mountpoint(workdir, "offloadfs-debug")
    log = Path(workdir, "offloadfs.log")
    url = f"smb://{server.username}@{server.host}/{share}"
    argv = [sys.executable, "-m", "offloadfs", *mount_args(url, mnt, ["debug", f"credentials={cred}"]), "-f"]
    with fuse_daemon(argv, mnt, log):
        yield mnt, log
