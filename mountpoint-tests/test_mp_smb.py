"""offloadfs on real Samba shares in the lab: what only SMB can show.

The everyday tools and the model test run on SMB shares too (test_mp_tools,
test_mp_model). Here: a cp inside a share must be done by the server (the
counters say how, the extents on the server's filesystem and the bytes on the
client's link prove it), copies across shares and servers must come out
right, a server that dies mid-copy must never leave a cp that reports success
over wrong data, and a wrong password must fail the mount cleanly.
"""

import datetime
import errno
import os
import re
import shutil
import stat
import subprocess
import time
import uuid

import pytest
import smbkit
from mpkit import MiB, sh, sha256, write_file
from smbkit import smb_lab

from offloadfs.backends.smb.client import RECONNECT_DELAY_MAX
from offloadfs.lab.mount import offloadfs_cli, offloadfs_mount, status

pytestmark = pytest.mark.skipif(shutil.which("smbd") is None,
                                reason="smbd is not installed (apt-get install samba samba-vfs-modules)")

SIZE = 256 * MiB
EXTENT = re.compile(r"^\s*\d+:\s")


def extent_flags(path):
    """Flags of each extent of `path` as filefrag -v reports them."""
    lines = [ln for ln in sh("filefrag", "-v", path).splitlines() if EXTENT.match(ln)]
    return [ln.rsplit(":", 1)[1].strip() for ln in lines]


def wire_bytes(net, before):
    now = net.counters()
    return now.rx - before.rx + now.tx - before.tx


@pytest.mark.parametrize("where,method", [("smb-btrfs", "clone"), ("smb-xfs", "server_copy"),
                                          ("smb-ext4", "server_copy"), ("smb422-btrfs", "clone"),
                                          ("smb422-xfs", "server_copy")])
def test_cp_in_a_share_is_done_by_the_server(where, method, request, mount_on):
    mnt = mount_on(where)
    digest = write_file(mnt.backing / "big", SIZE)
    os.sync()
    smb, index, kind = smbkit.place(request, where)
    net = smb.lab.servers[index].net
    before = net.counters()
    sh("cp", mnt.path / "big", mnt.path / "copy")
    wire = wire_bytes(net, before)
    print(f"cp of {SIZE >> 20} MiB in {where}: {wire} bytes on the client's link")
    counters = mnt.counters()
    assert counters["copy_bytes"].get(method) == SIZE, counters
    assert wire < SIZE // 100 + 64 * 1024, f"{wire} bytes crossed the client's link"
    assert sha256(mnt.backing / "copy") == digest
    if kind != "ext4":
        for name in ("big", "copy"):
            flags = extent_flags(mnt.backing / name)
            assert flags and all("shared" in f for f in flags), (name, flags)


def test_cp_in_the_ksmbd_share_is_a_clone(request, mount_on):
    """ksmbd on reflink xfs takes FSCTL_DUPLICATE_EXTENTS_TO_FILE: the copy shares the original's
    blocks, which the guest's free space shows (filefrag cannot look at its disk from here)."""
    size = 64 * MiB  # TCG: the guest writes the original at a few tens of MiB/s
    mnt = mount_on("ksmbd-xfs")
    digest = write_file(mnt.backing / "big", size)
    ksmbd = smbkit.place(request, "ksmbd-xfs")[0]
    guest, net = ksmbd.lab.guest, ksmbd.lab.net
    used = guest_used_kib(guest)
    before = net.counters()
    sh("cp", mnt.path / "big", mnt.path / "copy")
    wire = wire_bytes(net, before)
    counters = mnt.counters()
    assert counters["copy_bytes"].get("clone") == size, counters
    assert wire < size // 100 + 64 * 1024, f"{wire} bytes crossed the client's link"
    assert guest_used_kib(guest) - used < size // 1024 // 10, "the copy took blocks of its own"
    assert sha256(mnt.backing / "copy") == digest


def test_cp_in_ksmbds_share_without_reflink_is_copychunk(request):
    """ksmbd's tmpfs share refuses duplicate extents (NOT_SUPPORTED): a cp goes through
    FSCTL_SRV_COPYCHUNK_WRITE, done by the server byte for byte (the guest's sha256sum says so; tmpfs
    has no NFS view). ksmbd answers the resume key request in our open's compound with the related
    file id (all ones), which no copychunk finds: the copy asks for the key again by the file id."""
    size = 64 * MiB
    ksmbd = request.getfixturevalue("ksmbd")
    guest, net = ksmbd.lab.guest, ksmbd.lab.net
    where = f"/srv/tmpfs/t-{uuid.uuid4().hex[:10]}"
    made, out = guest.run(f"mkdir {where} && dd if=/dev/urandom of={where}/big bs=1M count={size // MiB} "
                          f"2>/dev/null && sha256sum {where}/big")
    assert made == 0, out
    try:
        with offloadfs_mount(ksmbd.url("tmpfs", where.rsplit("/", 1)[1]), options=ksmbd.options()) as mnt:
            before = net.counters()
            sh("cp", mnt / "big", mnt / "copy")
            wire = wire_bytes(net, before)
            counters = status(mnt)["counters"]
        print(f"cp of {size >> 20} MiB in ksmbd's tmpfs share: {wire} bytes on the client's link")
        assert counters["copy_bytes"].get("server_copy") == size, counters
        assert wire < size // 100 + 64 * 1024, f"{wire} bytes crossed the client's link"
        copied, sums = guest.run(f"sha256sum {where}/copy")
        assert copied == 0 and sums.split()[0] == out.split()[0], (out, sums)
    finally:
        guest.run(f"rm -rf {where}")


def guest_used_kib(guest):
    """KiB in use on the guest's xfs, once what it holds in memory is on its disk."""
    status, out = guest.run("sync && df -k /export")
    assert status == 0, out
    return int(out.splitlines()[-1].split()[2])


# What a cp of 1 KiB inside a share may cost, per command and in round trips (docs/performance.md, "A small cp on SMB"):
# LOOKUP dst (absent), LOOKUP src, OPEN src, CREATE dst, COPY_FILE_RANGE, RELEASE of both.
SMALL_CP_REQUESTS = {"CREATE": 4, "QUERY_INFO": 4, "CLOSE": 4, "IOCTL": 2}
SMALL_CP_ROUND_TRIPS = 7


@pytest.mark.parametrize("where", ["smb-xfs", "smb422-xfs"])
def test_a_small_cp_in_a_share_costs_few_round_trips(where, mount_on):
    # Long timeouts: the kernel asks nothing again that it was told, however slow the machine.
    mnt = mount_on(where, ["attr_timeout=60", "entry_timeout=60"])
    (mnt.backing / "src").write_bytes(os.urandom(1024))
    before = mnt.counters()
    sh("cp", mnt.path / "src", mnt.path / "dst")
    for name in ("src", "dst"):
        mnt.settle(mnt.backing / name)  # the kernel sends the releases after cp is gone
    after = mnt.counters()
    requests = {c: n - before["smb_requests"].get(c, 0) for c, n in after["smb_requests"].items()}
    requests = {c: n for c, n in requests.items() if n}
    round_trips = after["smb_round_trips"] - before["smb_round_trips"]
    print(f"cp of 1 KiB: {requests}, {round_trips} round trips")
    assert (mnt.backing / "dst").read_bytes() == (mnt.backing / "src").read_bytes()
    assert after["copy_bytes"]["server_copy"] == 1024, after
    assert all(requests.get(c, 0) <= n for c, n in SMALL_CP_REQUESTS.items()) and requests.keys() <= \
        SMALL_CP_REQUESTS.keys(), requests
    assert round_trips <= SMALL_CP_ROUND_TRIPS


def test_copies_between_shares_and_servers(mount_on):
    mnt = mount_on({"b": "smb-btrfs", "x": "smb-xfs", "e": "smb-ext4", "r": "smb2-ext4", "n": "smb422-btrfs"})
    assert sorted(os.listdir(mnt.path)) == ["b", "e", "n", "r", "x"]
    digest = write_file(mnt.backing["b"] / "f0", 24 * MiB + 5)
    # Each hop copies what the one before wrote: every pair of kinds, both ways between servers, and
    # both ways between Samba 4.17 and 4.22.
    route = ["b", "x", "e", "b", "r", "x", "r", "n", "b"]
    for hop, (src, dst) in enumerate(zip(route, route[1:])):
        sh("cp", mnt.path / src / f"f{hop}", mnt.path / dst / f"f{hop + 1}")
        assert sha256(mnt.backing[dst] / f"f{hop + 1}") == digest, f"{src} -> {dst}"
    counters = mnt.counters()
    assert counters["copy_requests"] >= len(route) - 1, counters
    assert counters["copy_errors"] == 0, counters
    print(f"copies by method: {counters['copies']}")


def test_copies_between_ksmbd_and_samba(mount_on):
    """One mount of a Samba share and ksmbd's: the planner has each server copy inside itself (copychunk
    on Samba's ext4, a clone on ksmbd's reflink xfs) and streams between them, byte for byte both ways."""
    mnt = mount_on({"e": "smb-ext4", "k": "ksmbd-xfs"})
    digest = write_file(mnt.backing["e"] / "f0", 24 * MiB + 5)
    route = ["e", "e", "k", "k", "e"]
    for hop, (src, dst) in enumerate(zip(route, route[1:])):
        sh("cp", mnt.path / src / f"f{hop}", mnt.path / dst / f"f{hop + 1}")
        assert sha256(mnt.backing[dst] / f"f{hop + 1}") == digest, f"{src} -> {dst}"
    counters = mnt.counters()
    print(f"copies by method: {counters['copies']}")
    assert counters["copies"] == {"server_copy": 1, "clone": 1, "stream": 2, "inter_server_copy": 0}, counters
    assert counters["copy_errors"] == 0, counters


@pytest.mark.parametrize("options", [(), ("offload=off",)], ids=["server-copy", "stream"])
def test_smbd_killed_mid_copy(options):
    """cp fails or completes; if it says it completed, the data is right.

    A lab of its own, as its smbd dies. ext4 makes the server copy the bytes
    itself (about a second for 1 GiB), so the copy is still running when smbd
    is killed. Once smbd is back the same mount works again.
    """
    with smb_lab(servers=1, kinds=("ext4",)) as lab:
        server = lab.lab.server
        share = server.shares["ext4"].path
        digest = write_file(share / "big", 1 << 30)
        with offloadfs_mount(lab.url("ext4"), options=[*lab.options(), *options]) as mnt:
            cp = subprocess.Popen(["cp", mnt / "big", mnt / "copy"], stderr=subprocess.PIPE, text=True)
            try:
                wait_for_copy(mnt, cp)
                server.kill()
                _, err = cp.communicate(timeout=120)
            finally:
                if cp.poll() is None:
                    cp.kill()
                    cp.wait()
            print(f"cp exit {cp.returncode}: {err.strip()}")
            if cp.returncode == 0:
                assert sha256(share / "copy") == digest, "cp reported success over wrong data"
            else:
                assert err.strip(), "cp failed without saying why"
            server.start()
            small = write_file(share / "small", MiB)
            # The daemon tried to reach smbd while it was away (a failed copy cuts its destination
            # back): the next connection may wait out one reconnect delay.
            deadline = time.monotonic() + RECONNECT_DELAY_MAX + 30  # a hang guard: a busy machine logs on slowly
            while (again := subprocess.run(["cp", mnt / "small", mnt / "small-copy"], capture_output=True,
                                           text=True)).returncode:
                assert time.monotonic() < deadline, again.stderr
                time.sleep(0.2)
            assert sha256(share / "small-copy") == small


def wait_for_copy(mountpoint, cp):
    """Return once the daemon reports the copy in flight."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert cp.poll() is None, "cp finished before smbd could be killed"
        if status(mountpoint)["copies_in_flight"]:
            return
        time.sleep(0.02)
    raise AssertionError("the copy never showed in status")


def test_wrong_password_fails_in_one_line(smb, tmp_path, monkeypatch):
    server = smb.lab.server
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setenv("PASSWD", "not-the-password")
    proc = offloadfs_cli("mount", f"smb://{server.username}@{server.host}/ext4", mnt)
    assert proc.returncode == 32  # mount(8)'s "mount failure"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "logon failure" in lines[0], proc.stderr
    assert "not-the-password" not in proc.stdout + proc.stderr
    assert not os.path.ismount(mnt)
    assert os.listdir(mnt) == []


def test_the_daemon_forgets_passwd_once_read(smb, tmp_path, monkeypatch):
    """PASSWD logs the mount on; after that the daemon keeps it neither in its environment (which
    fusermount3 and any other program it runs would inherit) nor in the memory /proc shows of it."""
    server = smb.lab.server
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setenv("PASSWD", server.password)
    with offloadfs_mount(f"smb://{server.username}@{server.host}/ext4", mnt):
        with open(f"/proc/{status(mnt)['pid']}/environ", "rb") as f:
            environ = f.read()
    assert b"PASSWD=" not in environ and server.password.encode() not in environ


@pytest.mark.parametrize("where", ["smb-ext4", "smb422-xfs"])
def test_what_smb_cannot_store(where, mount_on):
    """Refused with EOPNOTSUPP, or kept as far as SMB can: never half done (on 4.22 too, with its POSIX
    extensions not asked for: test_mp_smb_posix has what they store)."""
    mnt = mount_on(where, ["noposix"])
    for make in (lambda p: os.symlink("x", p), os.mkfifo,
                 lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))):
        with pytest.raises(OSError) as err:
            make(mnt.path / "odd")
        assert err.value.errno == errno.EOPNOTSUPP
        assert not (mnt.backing / "odd").exists()
    f = mnt.path / "f"
    f.write_bytes(b"data")
    os.chown(f, 1234, 5678)
    assert os.stat(f).st_uid == 0
    os.chmod(f, 0o444)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o555
    with pytest.raises(PermissionError):
        open(f, "r+b")
    sh("cp", "-a", f, mnt.path / "g")
    assert stat.S_IMODE(os.stat(mnt.path / "g").st_mode) == 0o555
    os.chmod(f, 0o640)
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o755
    sh("rm", "-f", f, mnt.path / "g")
    assert os.listdir(mnt.backing) == []


@pytest.mark.parametrize("where,cut", [("smb-ext4", "restart"), ("smb-ext4-durable", "restart"),
                                       ("smb-ext4-durable", "drop"), ("smb422-xfs-durable", "drop"),
                                       ("ksmbd-xfs", "drop")])
def test_a_file_replaced_while_we_were_away_never_gets_our_writes(where, cut, request, mount_on):
    """Another client moves the open file away and makes a new one under its name while smbd is down
    (restart), or while our connection is broken (drop: the server keeps a durable handle meanwhile).

    Our next write must fail with EIO or reach the file we opened: never the new one.
    """
    mnt = mount_on(where)
    smb, index, _ = smbkit.place(request, where)
    server = smb.lab.servers[index] if cut == "restart" else None
    host = smb.host(index)
    first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
    fd = os.open(mnt.path / "victim", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, first, 0)
        os.fsync(fd)
        if cut == "restart":
            server.kill()
        else:
            sh("ss", "-K", "dst", host, "dport", "=", "445")
        try:
            (mnt.backing / "victim").rename(mnt.backing / "victim.moved")
            (mnt.backing / "victim").write_bytes(b"another client's file")
        finally:
            if cut == "restart":
                server.start()
        failed = []
        for step in (lambda: os.pwrite(fd, second, 64 * 1024), lambda: os.fsync(fd)):
            try:
                step()
            except OSError as e:
                failed.append(e.errno)
    finally:
        try:
            os.close(fd)
        except OSError as e:
            failed.append(e.errno)
    print(f"errors after the reconnect: {[errno.errorcode[e] for e in failed]}")
    assert (mnt.backing / "victim").read_bytes() == b"another client's file"
    moved = (mnt.backing / "victim.moved").read_bytes()
    assert set(failed) <= {errno.EIO}, failed
    assert moved in (first, first + second) if failed else moved == first + second


def test_rmdir_of_the_longest_path_that_mkdir_made(mount_on):
    """Every directory mkdir made can be removed; a path longer than SMB can name is refused up front.

    Directory by directory through file descriptors, so that the kernel's PATH_MAX does not stop it first.
    """
    mnt = mount_on("smb-ext4")
    fds = [os.open(mnt.path, os.O_DIRECTORY)]
    try:
        while True:
            try:
                os.mkdir("d" * 255, dir_fd=fds[-1])
            except OSError as e:
                assert e.errno == errno.ENAMETOOLONG, e
                break
            fds.append(os.open("d" * 255, os.O_DIRECTORY, dir_fd=fds[-1]))
        print(f"{len(fds) - 1} levels of 255 bytes made")
        assert len(fds) - 1 == 15  # 3852 bytes with the test's directory; 16 levels would pass Samba's 4095
        while len(fds) > 1:
            os.close(fds.pop())
            os.rmdir("d" * 255, dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)
    assert os.listdir(mnt.backing) == []


def test_ctime_through_another_link_advances_when_rename_replaces_one(mount_on):
    mnt = mount_on("smb-ext4", ["attr_timeout=0"])  # the server's word, not a cache's
    (mnt.path / "a").write_bytes(b"data")
    os.link(mnt.path / "a", mnt.path / "b")
    (mnt.path / "c").write_bytes(b"other")
    before = os.stat(mnt.path / "b")
    time.sleep(0.05)  # ctime must be able to move on
    os.rename(mnt.path / "c", mnt.path / "a")
    after = os.stat(mnt.path / "b")
    assert after.st_nlink == 1 and (mnt.path / "a").read_bytes() == b"other"
    assert after.st_ctime_ns > before.st_ctime_ns


def test_fstat_of_an_unlinked_open_file(mount_on):
    mnt = mount_on("smb-ext4")
    with open(mnt.path / "f", "w+b") as f:
        f.write(b"12345")
        f.flush()
        os.unlink(mnt.path / "f")
        assert os.fstat(f.fileno()).st_size == 5
        f.seek(0)
        assert f.read() == b"12345"
        f.write(b"678")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 8


@pytest.mark.parametrize("where", ["smb-ext4-durable", "smb422-xfs-durable"])
def test_a_durable_handle_outlives_a_broken_connection(where, request, mount_on):
    """The TCP connection breaks (smbd keeps the durable handle): the writes after it reach our file
    through the same open, reconnected, not through a new one by path.  On 4.22 without POSIX
    extensions: Samba 4.22 grants durable handles on POSIX opens but refuses their reconnect
    (test_a_posix_opens_durable_handle_is_not_reconnected)."""
    mnt = mount_on(where, ["noposix"])
    smb, index, _ = smbkit.place(request, where)
    server = smb.lab.servers[index]

    started = datetime.datetime.now(datetime.timezone.utc)

    def opens():
        """When each open of f made since the test began was made, as Samba lists them: a reconnected
        open keeps its time.  Found by file id: smbstatus names a file as its first open in the record
        did, and a test before may have left a disconnected durable open of a file whose inode number
        (ext4 reuses them) f now has."""
        ino = os.stat(mnt.backing / "f").st_ino
        return sorted(o["opened_at"] for entry in smb.open_files(server).values()
                      if entry.get("fileid", {}).get("inode") == ino for o in entry["opens"].values()
                      if datetime.datetime.fromisoformat(o["opened_at"]) >= started)

    first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
    with open(mnt.path / "f", "w+b") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        before = opens()
        sh("ss", "-K", "dst", server.host, "dport", "=", "445")
        os.pwrite(f.fileno(), second, len(first))
        os.fsync(f.fileno())
        assert len(before) == 1 and opens() == before
    assert (mnt.backing / "f").read_bytes() == first + second


@pytest.mark.parametrize("options", [(), ("noposix",)], ids=["posix", "noposix"])
def test_a_ksmbd_durable_handle_outlives_a_broken_connection(options, request, mount_on):
    """ksmbd (durable handles = yes) reconnects our durable v2 handle after the TCP connection breaks,
    POSIX open or not: the writes after it reach the file. ksmbd lists no opens, but nothing else could
    carry them: the mount never reopens a lost handle by path (without the reconnect: EIO). A pause
    before the writes: ksmbd keeps a handle only as long as asked, 1.6 s where the client names no
    timeout (the mount asks 60 s)."""
    mnt = mount_on("ksmbd-xfs", list(options))
    host = smbkit.place(request, "ksmbd-xfs")[0].host()
    first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
    with open(mnt.path / "f", "w+b") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        sh("ss", "-K", "dst", host, "dport", "=", "445")
        time.sleep(2)
        os.pwrite(f.fileno(), second, len(first))
        os.fsync(f.fileno())
    assert (mnt.backing / "f").read_bytes() == first + second


def test_a_posix_opens_durable_handle_is_not_reconnected(request, mount_on):
    """Samba 4.22 refuses the reconnect of a durable handle a POSIX open got (OBJECT_NAME_NOT_FOUND with
    the POSIX create context; without it the handle is no POSIX one, INVALID_LEVEL for its POSIX query):
    the writes after a broken connection fail with EIO, never land silently elsewhere, and the file holds
    what was written before."""
    mnt = mount_on("smb422-xfs-durable")
    first = os.urandom(64 * 1024)
    smb, index, _ = smbkit.place(request, "smb422-xfs-durable")
    with open(mnt.path / "f", "w+b") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        sh("ss", "-K", "dst", smb.lab.servers[index].host, "dport", "=", "445")
        with pytest.raises(OSError) as err:
            os.pwrite(f.fileno(), b"x" * 4096, len(first))
            os.fsync(f.fileno())
        assert err.value.errno == errno.EIO
        with pytest.raises(OSError):
            f.close()
    assert (mnt.backing / "f").read_bytes() == first
