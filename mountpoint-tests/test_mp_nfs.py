"""offloadfs on real NFS servers in the labs: what only NFS can show.

The everyday tools and the model test run on both servers too (test_mp_tools,
test_mp_model). Here: a cp on Linux nfsd is done by the server (counters say
how, the client's link proves it) and on nfs-ganesha, which has no COPY or
CLONE, it falls back to streaming and comes out right; an asynchronous COPY
shows in `offloadfs status` and dies with the cp that asked for it; holes are
found by SEEK and never cross the link; a restarted ganesha is survived by a
hard mount and reported quickly by a soft one.

The session's nfsd guest exports an xfs without reflink (see nfskit): its
COPY copies the bytes in the guest, slowly enough under TCG to be watched.
"""

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time

import nfskit
import pytest
from mpkit import MiB, gone, sh, sha256, write_file

from offloadfs.cli import read_status
from offloadfs.daemon import STOP_WITHIN
from offloadfs.lab.ganesha import ganesha_lab
from offloadfs.lab.mount import offloadfs_cli, offloadfs_mount

pytestmark = pytest.mark.skipif(nfskit.missing_tools() is not None, reason=str(nfskit.missing_tools()))

SIZE = 64 * MiB
# A copy nfsd needs seconds for, made without moving its bytes over the link: preallocated (so cp
# sees no holes and asks for a copy), and copied in the guest at ~60 MiB/s under TCG.
SLOW = 256 * MiB
HANG_BOUND = 15  # seconds: anything slower is a hang


def wire_bytes(net, before):
    now = net.counters()
    return now.rx - before.rx + now.tx - before.tx


def test_cp_on_nfsd_is_done_by_the_server(nfsd, mount_on):
    _, lab = nfsd
    mnt = mount_on("nfsd")
    digest = write_file(mnt.path / "big", SIZE)
    before = lab.net.counters()
    sh("cp", mnt.path / "big", mnt.path / "copy")
    wire = wire_bytes(lab.net, before)
    print(f"cp of {SIZE >> 20} MiB on nfsd: {wire} bytes on the client's link")
    counters = mnt.counters()
    by_server = counters["copy_bytes"]["clone"] + counters["copy_bytes"]["server_copy"]
    assert by_server == SIZE and counters["copy_bytes"]["stream"] == 0, counters
    assert wire < SIZE // 100 + 64 * 1024, f"{wire} bytes crossed the client's link"
    assert sha256(mnt.backing / "copy") == digest


def test_cp_on_ganesha_falls_back_to_streaming(ganesha, mount_on):
    mnt = mount_on("nfs-ganesha")
    digest = write_file(mnt.backing / "big", SIZE)
    sh("cp", mnt.path / "big", mnt.path / "copy")
    counters = mnt.counters()
    assert counters["copy_bytes"]["stream"] == SIZE, counters
    assert counters["copy_bytes"]["clone"] == counters["copy_bytes"]["server_copy"] == 0, counters
    assert counters["copy_errors"] == 0, counters
    assert sha256(mnt.backing / "copy") == digest
    assert sha256(mnt.path / "copy") == digest


def start_slow_copy(mnt):
    """A cp of SLOW bytes inside the mount, once the daemon has it in flight: (cp, in-flight entry)."""
    sh("fallocate", "-l", SLOW, mnt.path / "big")
    cp = subprocess.Popen(["cp", mnt.path / "big", mnt.path / "copy"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_BOUND
    while time.monotonic() < deadline:
        assert cp.poll() is None, "cp finished before its copy was seen in flight"
        flying = read_status(mnt.path)["copies_in_flight"]
        if flying:
            return cp, flying[0]
        time.sleep(0.01)
    cp.kill()
    raise AssertionError("the copy never showed in status")


def kill(cp):
    if cp.poll() is None:
        cp.kill()
    cp.wait(HANG_BOUND)


def test_async_copy_shows_in_status(nfsd, mount_on):
    """While nfsd copies (seconds under TCG), status names the copy, its method and growing progress."""
    mnt = mount_on("nfsd")
    cp, _ = start_slow_copy(mnt)
    try:
        deadline = time.monotonic() + HANG_BOUND
        while time.monotonic() < deadline and cp.poll() is None:
            text = offloadfs_cli("status", mnt.path).stdout
            flying = read_status(mnt.path)["copies_in_flight"]
            if flying and flying[0]["bytes_done"] > 0:
                break
            time.sleep(0.1)
        assert cp.poll() is None, "cp finished too soon to be watched"
    finally:
        kill(cp)
    print(text)
    assert len(flying) == 1, flying
    copy = flying[0]
    assert (copy["source"], copy["destination"], copy["bytes_total"]) == ("big", "copy", SLOW), copy
    assert "in flight:" in text and "#1 server_copy" in text and f"of {SLOW // MiB}.0 MiB" in text, text
    assert copy["method"] == "server_copy", copy
    assert 0 < copy["bytes_done"] < SLOW, copy


def test_killing_cp_cancels_the_async_copy(nfsd, mount_on):
    mnt = mount_on("nfsd")
    cp, _ = start_slow_copy(mnt)
    time.sleep(0.5)
    killed = time.monotonic()
    cp.kill()
    try:
        cp.wait(HANG_BOUND)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"cp still alive {HANG_BOUND} s after SIGKILL") from None
    print(f"cp died {time.monotonic() - killed:.2f} s after SIGKILL")
    deadline = time.monotonic() + HANG_BOUND
    while read_status(mnt.path)["copies_in_flight"]:
        assert time.monotonic() < deadline, "the copy is still in flight after cp died"
        time.sleep(0.05)
    # Left alone the copy would be done in a few seconds; cancelled, the partial copy stays partial.
    time.sleep(5)
    size = os.stat(mnt.backing / "copy").st_size
    assert size < SLOW, "the server finished the copy cp was killed for"
    assert os.stat(mnt.backing / "copy").st_size == size, "the server is still copying"
    digest = write_file(mnt.path / "small", 3 * MiB + 1)
    sh("cp", mnt.path / "small", mnt.path / "small-copy")
    assert sha256(mnt.backing / "small-copy") == digest
    assert read_status(mnt.path)["copies_in_flight"] == []


def test_interrupted_cp_returns_at_once_while_nfsd_is_stalled(nfsd, mount_on):
    """The interrupted COPY is answered at once and the OFFLOAD_CANCEL goes in the background: a server
    that does not answer must not hold up the cp, and the mount goes on working once it answers again."""
    _, lab = nfsd
    mnt = mount_on("nfsd")
    cp, _ = start_slow_copy(mnt)
    deadline = time.monotonic() + HANG_BOUND
    while not read_status(mnt.path)["copies_in_flight"][0]["bytes_done"]:  # the COPY is answered: asynchronous
        assert time.monotonic() < deadline and cp.poll() is None, "no progress of the asynchronous copy"
        time.sleep(0.05)
    guest = lab.guest.process
    guest.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        interrupted = time.monotonic()
        cp.send_signal(signal.SIGINT)
        try:
            cp.wait(HANG_BOUND)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"cp still alive {HANG_BOUND} s after SIGINT") from None
        took = time.monotonic() - interrupted
    finally:
        guest.send_signal(signal.SIGCONT)
    # No bound tighter than HANG_BOUND: the server is stopped, so a cp the interrupt did not reach
    # never returns, and a second is no promise under a CPU-heavy job beside the test.
    print(f"cp returned {took:.2f} s after SIGINT with the server stalled")
    deadline = time.monotonic() + HANG_BOUND
    while read_status(mnt.path)["copies_in_flight"]:
        assert time.monotonic() < deadline, "the copy is still in flight after cp died"
        time.sleep(0.05)
    # Whether the background OFFLOAD_CANCEL beat the COPYs in flight to their ends depends on the timing:
    # cut short, they leave holes (tests/test_nfs_copy.py asserts the cancel is sent until answered).
    print(f"copy: data at {layout(mnt.backing / 'copy')}")
    digest = write_file(mnt.path / "small", 3 * MiB + 1)
    sh("cp", mnt.path / "small", mnt.path / "small-copy")
    assert sha256(mnt.backing / "small-copy") == digest


def test_sigterm_ends_the_daemon_while_nfsd_is_stalled(nfsd, mount_on):
    """Closing an open file and the session cannot finish while the server does not answer: the daemon
    still ends (within STOP_WITHIN of SIGTERM on an idle machine)."""
    _, lab = nfsd
    mnt = mount_on("nfsd")
    pid = mnt.status()["pid"]
    fd = os.open(mnt.path / "open", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"unstable" * 1000)
    guest = lab.guest.process
    guest.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        # A hang guard, not the promise: a daemon waiting on the stopped server never ends, and
        # STOP_WITHIN is no promise to a machine busy with other work.
        while not gone(pid):
            assert time.monotonic() - start < STOP_WITHIN + HANG_BOUND, "the daemon outlived SIGTERM"
            time.sleep(0.05)
        print(f"daemon ended {time.monotonic() - start:.2f} s after SIGTERM, the server stalled")
    finally:
        guest.send_signal(signal.SIGCONT)
        with contextlib.suppress(OSError):
            os.close(fd)


def layout(path):
    """[(data start, hole start)] of a file, by SEEK_DATA / SEEK_HOLE."""
    out = []
    with open(path, "rb") as f:
        size, pos = os.fstat(f.fileno()).st_size, 0
        while pos < size:
            try:
                data = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            pos = os.lseek(f.fileno(), data, os.SEEK_HOLE)
            out.append((data, pos))
    return out


# 1 MiB of data in a 64 MiB file: four 256 KiB pieces, one at the very end.
PIECES = [0, 5 * MiB, 40 * MiB + 512 * 1024, SIZE - 256 * 1024]


def make_sparse(path):
    chunks = {}
    with open(path, "wb") as f:
        f.truncate(SIZE)
        for off in PIECES:
            chunks[off] = os.urandom(256 * 1024)
            os.pwrite(f.fileno(), chunks[off], off)
    return chunks


def sparse_on(where, request, mount_on):
    """(mount, link of its server, {offset: data}) with a sparse file "sparse" made behind the
    mount's back (the server's directory, or nfsd's view), so no page of it is cached."""
    _, lab = request.getfixturevalue("nfsd" if where == "nfsd" else "ganesha")
    net = lab.net if where == "nfsd" else lab.server.net
    mnt = mount_on(where)
    chunks = make_sparse(mnt.backing / "sparse")
    os.sync()
    return mnt, net, chunks


def test_uid_and_gid_options_leave_the_owners_the_server_reports(ganesha, mount_on):
    """The server decides access by each file's owner (requests carry their user's ids), so that is
    the owner shown, as mount.nfs has no uid=: uid= and gid= are for SMB servers that report none."""
    mnt = mount_on("nfs-ganesha", ["uid=1234", "gid=2345"])
    (mnt.backing / "theirs").write_text("x")
    os.chown(mnt.backing / "theirs", 1000, 1001)
    st = os.stat(mnt.path / "theirs")
    assert (st.st_uid, st.st_gid) == (1000, 1001)


@pytest.mark.parametrize("where", ["nfs-ganesha", "nfsd"])
def test_seek_finds_the_holes(where, request, mount_on):
    mnt, _, _ = sparse_on(where, request, mount_on)
    expected = [(off, off + 256 * 1024) for off in PIECES]
    if where == "nfs-ganesha":
        assert layout(mnt.backing / "sparse") == expected, "the server's own file is not as made"
    assert layout(mnt.path / "sparse") == expected
    counters = mnt.counters()
    assert counters["fuse_read_bytes"] == 0, counters


@pytest.mark.parametrize("where", ["nfs-ganesha", "nfsd"])
def test_holes_are_not_read_over_the_link(where, request, mount_on):
    mnt, net, chunks = sparse_on(where, request, mount_on)
    before = net.counters()
    data = (mnt.path / "sparse").read_bytes()
    wire = wire_bytes(net, before)
    print(f"read of a {SIZE >> 20} MiB file with 1 MiB of data through {where}: {wire} bytes on the link")
    want = bytearray(SIZE)
    for off, chunk in chunks.items():
        want[off:off + len(chunk)] = chunk
    assert data == want
    assert wire < 4 * MiB, f"{wire} bytes crossed the link for 1 MiB of data"


def workload(root, stop, results):
    """Write, read back and check files until told to stop; results gets (i, ok) or the exception."""
    i = 0
    try:
        while not stop.is_set():
            data = os.urandom(256 * 1024 + i)
            path = root / f"w{i % 8}"
            with open(path, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            results.append((i, path.read_bytes() == data))
            i += 1
    except Exception as e:  # noqa: BLE001 - handed to the test
        results.append(e)


def test_hard_mount_survives_a_ganesha_restart(ganesha, mount_on):
    _, lab = ganesha
    mnt = mount_on("nfs-ganesha")
    stop, results = threading.Event(), []
    worker = threading.Thread(target=workload, args=(mnt.path, stop, results), daemon=True)
    worker.start()
    try:
        while len(results) < 5:
            assert worker.is_alive(), results
            time.sleep(0.02)
        restarted_at = len(results)
        lab.server.restart()
        deadline = time.monotonic() + 60
        while len(results) < restarted_at + 10:
            assert worker.is_alive(), results[-1:]
            assert time.monotonic() < deadline, f"no progress after the restart: {results[-3:]}"
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive(), "the workload hangs"
    assert all(r == (i, True) for i, r in enumerate(results)), [r for r in results if r[1:] != (True,)][:3]
    digest = write_file(mnt.backing / "after", MiB)
    assert sha256(mnt.path / "after") == digest


def test_soft_mount_fails_fast_while_ganesha_is_down(ganesha, mount_on):
    _, lab = ganesha
    mnt = mount_on("nfs-ganesha", ["soft", "timeo=10", "retrans=1"])
    # timeo=10 is 1 s a try, retrans=1 makes two tries: 2 s, and a slack for the reconnects and for a
    # machine busy with other work.  A hard mount waits for the server: far past it.
    bound = 2 + HANG_BOUND
    (mnt.path / "before").write_bytes(b"x")
    lab.server.kill()
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as err:
            with open(mnt.path / "during", "wb") as f:
                f.write(b"y")
                os.fsync(f.fileno())
        took = time.monotonic() - started
        print(f"soft mount: {err.value!r} after {took:.2f} s")
        assert err.value.errno in (errno.EIO, errno.ETIMEDOUT), err.value
        assert took < bound, f"soft mount took {took:.1f} s to give up"
    finally:
        lab.server.start()
    deadline = time.monotonic() + HANG_BOUND
    while True:  # back once the server is: the next calls reconnect
        try:
            assert (mnt.path / "before").read_bytes() == b"x"
            break
        except OSError:
            assert time.monotonic() < deadline, "the soft mount does not come back"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def squashing_ganesha():
    """A ganesha whose export squashes root, as most real exports do: a home owned by user
    1000 and a directory only group 2000 may write to."""
    with ganesha_lab(root_squash=True) as lab:
        export = lab.server.path
        for name, owner, mode in (("home", (1000, 1000), 0o755), ("team", (0, 2000), 0o770)):
            (export / name).mkdir()
            os.chown(export / name, *owner)
            (export / name).chmod(mode)
        yield lab.server


def as_user(*command):
    """Run a command as uid 1000 (gid 1000, supplementary group 2000)."""
    return subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--groups=2000", "--", *command],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("options", [[], ["writeback_cache"]])
def test_a_root_squashing_server_sees_each_user(squashing_ganesha, options):
    """Requests act for their user (AUTH_SYS), and those on an open file for whoever opened it:
    with writeback_cache the kernel sends the data as root, which the server would squash."""
    server = squashing_ganesha
    with offloadfs_mount(f"nfs://{server.host}{server.export}", options=["allow_other", *options]) as mnt:
        work = mnt / "home" / f"w{len(options)}"
        script = (f"set -e; mkdir {work}; cd {work}; echo hello > f; cp f g; mkdir d; mv g d/g; "
                  f"ln -s f l; cat l d/g; echo team > {mnt}/team/t{len(options)}")
        done = as_user("sh", "-c", script)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "hello\nhello\n"
        with pytest.raises(PermissionError):  # root is squashed: the server sees nobody
            (work / "root-was-here").write_bytes(b"x")
    backing = server.path / "home" / f"w{len(options)}"
    for path in (backing, backing / "f", backing / "d" / "g", backing / "l"):
        assert os.lstat(path).st_uid == 1000, path
    assert (backing / "d" / "g").read_bytes() == b"hello\n"
    assert (server.path / "team" / f"t{len(options)}").read_bytes() == b"team\n"
