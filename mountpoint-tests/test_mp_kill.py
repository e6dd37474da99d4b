"""Killing things must not hang anything.

A cp killed in the middle of a long copy has to die promptly (the daemon
must answer the kernel's interrupt), and a killed daemon must leave a mount
that reports ENOTCONN and that `offloadfs umount` can clean up. A daemon
another mount namespace holds a copy of the mount for still ends on SIGTERM
within 5 s, and `offloadfs umount` tells of such namespaces (`--force` ends it).
"""

import contextlib
import errno
import os
import signal
import subprocess
import time

import pytest
from mpkit import GiB, MiB, gone, sh, sha256, write_file

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import offloadfs_cli, offloadfs_mount, status


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
    # The copy was cut where the kill found it, not finished first: a daemon that let the
    # interrupt wait would answer once all 3 GiB were copied.  (No bound on the time: a second is
    # no promise under a CPU-heavy job beside the test.)
    print(f"cp reaped {elapsed:.3f} s after SIGKILL")
    counters = mnt.counters()
    assert sum(counters["copy_bytes"].values()) < 3 * GiB, counters
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


def hold_in_another_namespace(path, propagation="private"):
    """A process in a mount namespace of its own, made while `path` is mounted: it holds a copy of the mount
    (as any `ip netns exec` or container started then would), private to it unless ``propagation`` says
    otherwise (unshare(1)'s --propagation)."""
    holder = subprocess.Popen(["unshare", "-m", f"--propagation={propagation}", "sleep", "600"])
    wait_until(lambda: is_mounted_in(holder.pid, path), 5, "the other namespace to exist")
    return holder


def is_mounted_in(pid, path):
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            return any(line.split()[4] == str(path) for line in f)
    except FileNotFoundError:
        return False


def test_sigterm_ends_a_daemon_another_namespace_holds(backing, mount):
    """The daemon's own unmount cannot end the connection while another namespace holds a copy
    (nor while a file is open): SIGTERM must still flush what the kernel holds and end the daemon
    within 5 s."""
    source = backing("ext4")
    mnt = mount(source, options=["writeback_cache"])
    pid = mnt.status()["pid"]
    holder = hold_in_another_namespace(mnt.path)
    fd = os.open(mnt.path / "written", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"kept" * 1000)  # with writeback_cache and the file open, only the kernel has it
        start = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        wait_until(lambda: gone(pid), 10, "the daemon to end after SIGTERM")
        print(f"daemon ended {time.monotonic() - start:.2f} s after SIGTERM")
    finally:
        holder.kill()
        holder.wait()
        with contextlib.suppress(OSError):
            os.close(fd)  # ENOTCONN: the connection was aborted
    assert (source / "written").read_bytes() == b"kept" * 1000
    assert not is_mounted(mnt.path)


@pytest.mark.parametrize("unmounted_here", [False, True])
def test_umount_tells_of_other_namespaces_and_force_ends_the_daemon(mnt, unmounted_here):
    """umount refuses while another namespace holds a copy (the daemon would serve on), and says so;
    --force ends the daemon, also when only the other namespace still has the mount (umount(8) here)."""
    pid = mnt.status()["pid"]
    holder = hold_in_another_namespace(mnt.path)
    try:
        if unmounted_here:
            sh("umount", mnt.path)
            time.sleep(0.5)
        proc = offloadfs_cli("umount", mnt.path)
        print(proc.stderr)
        assert proc.returncode == 32, "umount claimed success with the daemon still serving another namespace"
        assert "other mount namespace" in proc.stderr and "--force" in proc.stderr, proc.stderr
        assert is_mounted(mnt.path) != unmounted_here and not gone(pid), "a refused umount changed something"
        proc = offloadfs_cli("umount", "--force", mnt.path)
        assert proc.returncode == 0, proc.stderr
        wait_until(lambda: gone(pid), 10, "the daemon to end after umount --force")
    finally:
        holder.kill()
        holder.wait()
    assert not is_mounted(mnt.path)


@pytest.fixture
def shared_parent(tmp_path):
    """A directory on a mount with shared propagation, as / is on a systemd host."""
    parent = tmp_path / "shared"
    parent.mkdir()
    sh("mount", "-t", "tmpfs", "offloadfs-test", parent)
    sh("mount", "--make-shared", parent)
    yield parent
    sh("umount", "-l", parent)


@pytest.mark.parametrize("propagation", ["unchanged", "slave"])
def test_umount_takes_copies_that_propagation_unmounts_too(backing, shared_parent, propagation):
    """A namespace started after the mount holds a peer of a shared mount (or a slave of it): the
    unmount here takes that copy too, so umount must not refuse; the daemon then ends."""
    path = shared_parent / "mnt"
    path.mkdir()
    with offloadfs_mount(backing(), path):
        pid = status(path)["pid"]
        holder = hold_in_another_namespace(path, propagation)
        try:
            proc = offloadfs_cli("umount", path)
            assert proc.returncode == 0, proc.stderr
            assert not is_mounted_in(holder.pid, path), "the other namespace's copy outlived the unmount"
            wait_until(lambda: gone(pid), 10, "the daemon to end after umount")
        finally:
            holder.kill()
            holder.wait()
        assert not is_mounted(path)
