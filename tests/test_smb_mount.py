"""A real FUSE mount of SMB shares from the Samba lab, driven with ordinary tools.

`cp` inside a share must become a server-side copy (copychunk on ext4, a
clone on btrfs), and the password must show nowhere: not in the daemon's
command line, not in /proc/mounts, not in a failed mount's message.
"""
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting and the Samba lab need root"),
    pytest.mark.skipif(shutil.which("smbd") is None, reason="smbd is not installed (apt-get install samba)"),
]

pytest.importorskip("offloadfs.backends.smb", reason="smbprotocol is not installed")
samba = pytest.importorskip("offloadfs.lab.samba", reason="the Samba lab needs pyroute2")
from offloadfs.lab.mount import offloadfs_cli, offloadfs_mount, status  # noqa: E402

SIZE = 64 << 20


@pytest.fixture(scope="module")
def lab():
    with samba.samba_lab(("btrfs", "ext4")) as lab:
        yield lab


@pytest.fixture(scope="module")
def creds(lab, tmp_path_factory):
    path = lab.server.write_credentials(tmp_path_factory.mktemp("smb") / "cred")
    return path


def sha(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.parametrize("kind, method", [("ext4", "server_copy"), ("btrfs", "clone")])
def test_cp_inside_a_share_is_offloaded(lab, creds, kind, method):
    server = lab.server
    url = f"smb://{server.username}@{server.host}/{kind}"
    with offloadfs_mount(url, options=[f"credentials={creds}"]) as mnt:
        with open(mnt / f"src-{kind}", "wb") as f:
            f.write(os.urandom(SIZE))
        start = time.monotonic()
        subprocess.run(["cp", mnt / f"src-{kind}", mnt / f"dst-{kind}"], check=True)
        took = time.monotonic() - start
        counters = status(mnt)["counters"]
        assert counters["copy_bytes"][method] == SIZE and counters["copy_bytes"]["stream"] == 0
        assert sha(mnt / f"dst-{kind}") == sha(server.shares[kind].path / f"src-{kind}")
        daemon = status(mnt)["pid"]
        assert server.password.encode() not in Path(f"/proc/{daemon}/cmdline").read_bytes()
        assert server.password not in Path("/proc/mounts").read_text()
    print(f"\ncp of {SIZE >> 20} MiB inside the {kind} share by {method}: {took:.3f} s")


def test_tools_work_on_a_share(lab, creds):
    server = lab.server
    with offloadfs_mount(f"smb://{server.username}@{server.host}/ext4", options=[f"credentials={creds}"]) as mnt:
        work = mnt / "tools"
        (work / "a" / "b").mkdir(parents=True)
        (work / "a" / "b" / "f").write_text("hello\n")
        subprocess.run(["mv", work / "a", work / "c"], check=True)
        assert (work / "c" / "b" / "f").read_text() == "hello\n"
        os.link(work / "c" / "b" / "f", work / "c" / "g")
        assert os.stat(work / "c" / "g").st_ino == os.stat(work / "c" / "b" / "f").st_ino
        subprocess.run(["setfattr", "-n", "user.k", "-v", "v", work / "c" / "g"], check=True)
        assert os.getxattr(work / "c" / "g", "user.k") == b"v"
        subprocess.run(["truncate", "-s", "1G", work / "sparse"], check=True)
        assert os.stat(work / "sparse").st_size == 1 << 30
        subprocess.run(["tar", "-cf", work / "t.tar", "-C", work, "c"], check=True)
        subprocess.run(["rm", "-rf", work], check=True)
        assert not (server.shares["ext4"].path / "tools").exists()


def test_wrong_password_fails_the_mount_in_one_line(lab, tmp_path):
    server = lab.server
    secret = "not-the-Passw0rd"
    cred = tmp_path / "cred"
    cred.write_text(f"username={server.username}\npassword={secret}\n")
    cred.chmod(0o600)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = offloadfs_cli("mount", f"smb://{server.host}/ext4", mnt, "-o", f"credentials={cred}")
    assert proc.returncode == 32  # mount(8): a mount that failed
    assert proc.stderr.strip() == (f"offloadfs: logon failure for user {server.username} on {server.host} "
                                   "(NTSTATUS 0xC000006D)")
    assert secret not in proc.stdout + proc.stderr
    assert not os.path.ismount(mnt)
