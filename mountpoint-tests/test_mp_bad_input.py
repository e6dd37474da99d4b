"""Bad `offloadfs mount` input: a clear one-line error, never a traceback,
and nothing left mounted.  Exit codes follow mount(8): 1 for a wrong
invocation (bad arguments or options), 32 for a mount that failed."""

import pytest

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import offloadfs_cli, unmount


@pytest.fixture
def mp(tmp_path):
    """An empty mountpoint, unmounted afterwards should a bad mount succeed."""
    path = tmp_path / "mp"
    path.mkdir()
    yield path
    if is_mounted(path):
        unmount(path)


def mount_count(path):
    with open("/proc/self/mounts") as f:
        return sum(line.split()[1] == str(path) for line in f)


USAGE, FAILURE = 1, 32


def assert_clean_failure(proc, code):
    output = proc.stdout + proc.stderr
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in output
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), proc.stderr


@pytest.mark.parametrize("source", ["/nonexistent/offloadfs-src", "file:///nonexistent/src"])
def test_missing_source(source, mp):
    proc = offloadfs_cli("mount", source, mp)
    assert_clean_failure(proc, FAILURE)
    assert not is_mounted(mp)


def test_source_is_a_file(mp, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    proc = offloadfs_cli("mount", tmp_path / "file", mp)
    assert_clean_failure(proc, FAILURE)
    assert not is_mounted(mp)


def test_missing_mountpoint(backing, tmp_path):
    proc = offloadfs_cli("mount", backing(), tmp_path / "no-such-dir")
    assert_clean_failure(proc, FAILURE)
    assert not (tmp_path / "no-such-dir").exists()


def test_busy_mountpoint(backing, mount):
    first = mount(backing())
    (first.backing / "f").write_bytes(b"first")
    proc = offloadfs_cli("mount", backing(), first.path)
    try:
        assert_clean_failure(proc, FAILURE)
        assert mount_count(first.path) == 1
    finally:
        for _ in range(mount_count(first.path) - 1):
            unmount(first.path)
    assert (first.path / "f").read_bytes() == b"first"


@pytest.mark.parametrize("option", ["bogus", "offload=maybe", "uid=notanumber", "umask=999"])
def test_bad_option(option, backing, mp):
    proc = offloadfs_cli("mount", backing(), mp, "-o", option)
    assert_clean_failure(proc, USAGE)
    assert not is_mounted(mp)


@pytest.mark.parametrize("args", [["mount"], ["mount", "a", "b", "c"], ["frobnicate"], ["status", "a", "b"]])
def test_bad_usage(args):
    proc = offloadfs_cli(*args)
    assert proc.returncode == USAGE, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip()
