"""Killing things must not hang anything.

A cp killed in the middle of a long copy has to die promptly (the daemon
must answer the kernel's interrupt), and a killed daemon must leave a mount
that reports ENOTCONN and that `offloadfs umount` can clean up.
"""

import errno
import os
import signal
import subprocess
import time

from mpkit import GiB, MiB, sh, sha256, write_file

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import offloadfs_cli


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_killed_cp_dies_within_a_second(backing, mount):
    sources = {"b": backing("btrfs"), "e": backing("ext4")}
    write_file(sources["b"] / "big", 3 * GiB)
    mnt = mount(sources)
    cp = subprocess.Popen(["cp", mnt.path / "b" / "big", mnt.path / "e" / "big"])
    try:
        wait_until(lambda: mnt.status()["copies_in_flight"] or cp.poll() is not None,
                   30, "the copy to show in status")
        assert cp.poll() is None, "cp finished before it could be killed"
        start = time.monotonic()
        cp.kill()
        cp.wait(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if cp.poll() is None:
            cp.kill()
            cp.wait()
    print(f"cp reaped {elapsed:.3f} s after SIGKILL")
    assert elapsed < 2.0
    digest = write_file(mnt.path / "b" / "small", MiB)
    sh("cp", mnt.path / "b" / "small", mnt.path / "e" / "small")
    assert sha256(sources["e"] / "small") == digest
    assert "small" in os.listdir(mnt.path / "e")


def test_killed_daemon_gives_enotconn_and_umount_cleans(mnt):
    pid = mnt.status()["pid"]
    os.kill(pid, signal.SIGKILL)

    def disconnected():
        try:
            os.stat(mnt.path / "x")
        except OSError as e:
            return e.errno == errno.ENOTCONN
        return False

    wait_until(disconnected, 5, "ENOTCONN on the mountpoint")
    proc = offloadfs_cli("umount", mnt.path)
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(mnt.path)
    assert os.listdir(mnt.path) == []
