"""mount(8) integration: `mount -t offloadfs` and fstab entries.

mount(8) finds /sbin/mount.offloadfs; the fixture links it to this venv's
helper and removes the link again if it made it.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mpkit import sh

from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import unmount

LINK = Path("/sbin/mount.offloadfs")


@pytest.fixture
def helper():
    target = Path(sys.executable).parent / "mount.offloadfs"
    assert target.exists(), f"{target} missing: install offloadfs into this venv"
    made = not LINK.exists()
    if made:
        LINK.symlink_to(target)
    yield
    if made:
        LINK.unlink()


@pytest.fixture
def mountpoint():
    path = Path(tempfile.mkdtemp(prefix="offloadfs-mp-"))
    yield path
    unmount(path)
    path.rmdir()


def test_mount_t_offloadfs(helper, backing, mountpoint):
    src = backing()
    (src / "f").write_bytes(b"hello")
    sh("mount", "-t", "offloadfs", src, mountpoint, "-o", "uid=4321,noatime")
    assert is_mounted(mountpoint)
    assert (mountpoint / "f").read_bytes() == b"hello"
    assert os.stat(mountpoint / "f").st_uid == 4321


@pytest.mark.parametrize("how", ["mount -T FILE MP", "mount -a -T FILE"])
def test_fstab_entry(helper, backing, mountpoint, tmp_path, how):
    src = backing()
    (src / "f").write_bytes(b"from fstab")
    options = "defaults,noauto,nofail,_netdev,x-systemd.automount"
    if "-a" in how:
        options = "defaults,nofail,_netdev"  # -a skips noauto entries
    fstab = tmp_path / "fstab"
    fstab.write_text(f"file://{src} {mountpoint} offloadfs {options} 0 0\n")
    cmd = how.replace("FILE", str(fstab)).replace("MP", str(mountpoint)).split()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert is_mounted(mountpoint)
    assert (mountpoint / "f").read_bytes() == b"from fstab"


def test_fake_mount_checks_but_does_not_mount(helper, backing, mountpoint):
    """mount -f does everything but mount: the source and options are checked, nothing is mounted."""
    src = backing()
    sh("mount", "-f", "-t", "offloadfs", src, mountpoint)
    assert not is_mounted(mountpoint)
    proc = subprocess.run(["mount", "-f", "-t", "offloadfs", src, mountpoint, "-o", "bogus"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "bogus" in proc.stderr, proc.stderr
    assert not is_mounted(mountpoint)


@pytest.mark.parametrize("source, options, code", [
    ("/nonexistent/offloadfs-src", "defaults", 32),  # a mount that fails
    ("SRC", "bogus", 1),  # a wrong invocation
])
def test_mount_exit_codes(helper, backing, mountpoint, source, options, code):
    source = backing() if source == "SRC" else source
    proc = subprocess.run(["mount", "-t", "offloadfs", source, mountpoint, "-o", options],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not is_mounted(mountpoint)


def test_helper_bad_usage_exits_1():
    helper = Path(sys.executable).parent / "mount.offloadfs"
    proc = subprocess.run([helper, "only-a-source"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr


def utab_lines(mountpoint):
    """libmount's lines in /run/mount/utab for ``mountpoint`` (mount(8) writes one for _netdev, x-*, ...)."""
    try:
        with open("/run/mount/utab") as f:
            return [line for line in f if f"TARGET={mountpoint} " in line]
    except FileNotFoundError:
        return []


def test_umount_forgets_the_utab_line(helper, backing, mountpoint, tmp_path):
    """An fstab mount with userspace options leaves a utab line; `offloadfs umount` takes it away,
    as umount(8) does, or findmnt and systemd go on reading _netdev for the next mount there."""
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{backing()} {mountpoint} offloadfs _netdev,x-offloadfs.test 0 0\n")
    sh("mount", "-T", fstab, mountpoint)
    assert utab_lines(mountpoint), "mount(8) wrote no utab line: nothing to test"
    sh(sys.executable, "-m", "offloadfs", "umount", mountpoint)
    assert not is_mounted(mountpoint)
    assert utab_lines(mountpoint) == []


def test_findmnt_finds_the_mount_by_the_type_help_names(helper, backing, mountpoint):
    """FUSE shows the type as fuse.offloadfs, never offloadfs: the helper's --help names the form that finds it."""
    sh("mount", "-t", "offloadfs", backing(), mountpoint)
    helper_help = sh(Path(sys.executable).parent / "mount.offloadfs", "--help")
    assert "findmnt -t fuse.offloadfs" in helper_help
    found = sh("findmnt", "-n", "-o", "TARGET", "-t", "fuse.offloadfs", mountpoint)
    assert found.strip() == str(mountpoint)


def test_relative_source_is_recorded_absolute(backing, mountpoint):
    src = backing()
    sh(sys.executable, "-m", "offloadfs", "mount", src.name, mountpoint, cwd=src.parent)
    found = sh("findmnt", "-n", "-o", "SOURCE", mountpoint)
    assert found.strip() == str(src)


@pytest.mark.parametrize("source, options", [
    ("/nonexistent/offloadfs-src", "defaults"),
    ("smb://alice@127.0.0.1/share", "credentials=/nonexistent/offloadfs.cred"),
])
def test_fake_mount_checks_the_source_as_a_mount_would(helper, mountpoint, source, options):
    """mount -f fails where mount would (exit 32, one line), without mounting or reaching a server."""
    proc = subprocess.run(["mount", "-f", "-t", "offloadfs", source, mountpoint, "-o", options],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 32 and "nonexistent" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not is_mounted(mountpoint)


SECRET = "s3cr3t-in-url"


@pytest.mark.parametrize("source, options, says", [
    # malformed options and sources: a wrong invocation, exit 1 as README and --help say
    ("smb://alice@127.0.0.1/share", "vers=1.0", "vers=1.0"),
    ("smb://127.0.0.1/share", "", "no user name"),
    (f"smb://alice:{SECRET}@127.0.0.1/share", "", "credentials="),
    # other tools' forms: the message gives ours
    ("//127.0.0.1/share/dir", "", "smb://127.0.0.1/share/dir"),
    ("127.0.0.1:/export/dir", "", "nfs://127.0.0.1/export/dir"),
    ("smb://alice@127.0.0.1/share", "user=alice", "username="),
    ("smb://alice@127.0.0.1/share", "password=x", "credentials="),
    ("nfs://127.0.0.1/export", "vers=4.2", "minorversion=2"),
])
def test_malformed_options_exit_1_with_the_right_form(helper, mountpoint, source, options, says):
    cmd = ["mount", "-t", "offloadfs", source, mountpoint] + (["-o", options] if options else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PASSWD": "pw"})
    print(proc.stderr)
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr
    assert SECRET not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not is_mounted(mountpoint)


@pytest.mark.parametrize("options, warned", [("", True), ("_netdev,", False)])
def test_network_source_in_fstab_without_netdev_is_warned_of(helper, smb, mountpoint, tmp_path, options, warned):
    """Without _netdev systemd takes an fstab or unit mount of type offloadfs for a local filesystem:
    mounted before the network is up, and its failure at boot stops in emergency mode.  The mount
    itself goes ahead."""
    url, server_dir = smb.fresh_dir("ext4")
    (server_dir / "f").write_bytes(b"on the share")
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{url} {mountpoint} offloadfs {options}credentials={smb.credentials} 0 0\n")
    proc = subprocess.run(["mount", "-T", fstab, mountpoint], capture_output=True, text=True, timeout=60)
    print(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert ("_netdev" in proc.stderr) == warned, proc.stderr
    assert (mountpoint / "f").read_bytes() == b"on the share"
