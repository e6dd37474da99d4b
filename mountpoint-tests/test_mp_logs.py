"""Where a daemon in the background logs: logfile=, the journal, syslog or a default file."""

import importlib.metadata
import os
import re
import subprocess
import sys
import time

import pytest
from mpkit import MiB, sh, write_file

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import mount_args, offloadfs_cli, unmount


def wait_for(path, text, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return path.read_text(errors="replace")
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never showed in {path}: {path.read_text() if path.exists() else 'no file'}")


@pytest.fixture
def mountpoint(tmp_path):
    path = tmp_path / "mnt"
    path.mkdir()
    yield path
    unmount(path)


def test_logfile_keeps_debug_output(backing, mountpoint, tmp_path):
    log = tmp_path / "offloadfs.log"
    proc = offloadfs_cli(*mount_args(backing(), mountpoint, ["debug", f"logfile={log}"]), "-v")
    assert proc.returncode == 0, proc.stderr
    assert f"logs go to {log}" in proc.stdout
    os.listdir(mountpoint)
    wait_for(log, "<- OPENDIR")


def test_logfile_in_a_missing_directory_is_refused(backing, mountpoint, tmp_path):
    proc = offloadfs_cli(*mount_args(backing(), mountpoint, [f"logfile={tmp_path}/nowhere/log"]))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nowhere" in lines[0] and "no such directory" in lines[0], proc.stderr
    assert not is_mounted(mountpoint)


def test_journal_under_systemd(backing, mountpoint, tmp_path):
    """systemd hands a service's stderr to the journal and says so in JOURNAL_STREAM (its
    device:inode); lines with a <N> priority prefix are what the journal reads."""
    journal = tmp_path / "journal"
    with open(journal, "w") as stderr:
        st = os.fstat(stderr.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        proc = subprocess.run([sys.executable, "-m", "offloadfs",
                               *mount_args(backing(), mountpoint, ["debug"]), "-v"],
                              stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, timeout=60)
    assert proc.returncode == 0, journal.read_text()
    assert "logs go to the journal" in proc.stdout
    os.listdir(mountpoint)
    text = wait_for(journal, "<- OPENDIR")
    assert any(line.startswith("<7>") and "<- OPENDIR" in line for line in text.splitlines()), text


def test_v_says_where_logs_go_without_logfile(backing, mountpoint):
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    proc = subprocess.run([sys.executable, "-m", "offloadfs", *mount_args(backing(), mountpoint), "-v"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    where = "syslog (/dev/log)" if os.path.exists("/dev/log") else "/var/log/offloadfs.log"
    assert f"logs go to {where}" in proc.stdout, proc.stdout


def test_two_mounts_in_one_log_name_their_lines(backing, tmp_path):
    """Issue #31: mounts share one log, and a line carried a pid but no mountpoint.  Each mount
    starts with a line that says what it mounted, where, which version and with what options."""
    log = tmp_path / "offloadfs.log"
    sources, mountpoints = [backing(), backing()], [tmp_path / "one", tmp_path / "two"]
    try:
        for source, mountpoint in zip(sources, mountpoints):
            mountpoint.mkdir()
            proc = offloadfs_cli(*mount_args(source, mountpoint, ["debug", f"logfile={log}"]))
            assert proc.returncode == 0, proc.stderr
            os.listdir(mountpoint)
        version = importlib.metadata.version("offloadfs")
        for source, mountpoint in zip(sources, mountpoints):
            text = wait_for(log, f"{mountpoint} offloadfs.fuse.session DEBUG <- OPENDIR")
            assert (f" {mountpoint} offloadfs.daemon INFO offloadfs {version}: mounted {source} on {mountpoint}, "
                    f"options debug,logfile={log}\n") in text, text
    finally:
        for mountpoint in mountpoints:
            unmount(mountpoint)
    lines = log.read_text().splitlines()
    stamp = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} offloadfs\[\d+\] ")
    assert all(re.match(stamp.pattern + f"({mountpoints[0]}|{mountpoints[1]}) ", line)
               for line in lines if stamp.match(line)), "\n".join(lines)


@pytest.mark.parametrize("options, method", [((), "clone"), (("offload=off",), "stream")])
def test_debug_says_how_each_copy_went(backing, mountpoint, tmp_path, options, method):
    """Issue #31: -o debug showed the requests but not which method a copy took, its size or time."""
    log = tmp_path / "offloadfs.log"
    proc = offloadfs_cli(*mount_args(backing("btrfs"), mountpoint, ["debug", f"logfile={log}", *options]))
    assert proc.returncode == 0, proc.stderr
    write_file(mountpoint / "a", MiB + 1)
    sh("cp", mountpoint / "a", mountpoint / "b")  # a copy request
    text = wait_for(log, "copy a -> b")
    assert re.search(rf"DEBUG copy a -> b: {MiB + 1} bytes in \d+\.\d{{3}} s by {method}\n", text), text
