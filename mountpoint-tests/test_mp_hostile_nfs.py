"""offloadfs on NFS servers that misbehave, and on a network that lies.

The lab's mutating proxy (offloadfs.lab.proxy) sits between the mount and
the session's nfs-ganesha and rewrites, stalls or cuts the server's replies.
NFS over AUTH_SYS has no integrity protection: a changed READ payload is
indistinguishable from the file's data, so these tests check only what the
protocol can tell (framing, XDR, statuses, listings) and that every failure
is one clear EIO within the mount's timeout, never a hang or a dead daemon.
"""

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nfskit
import pytest
from mpkit import backoff_attempts, sh

from offloadfs.backends.nfs import ops
from offloadfs.backends.nfs.session import RECONNECT_FIRST, RECONNECT_MAX
from offloadfs.lab.loopfs import is_mounted
from offloadfs.lab.mount import mount_args, unmount
from offloadfs.lab.nfsreplies import LoopingListing, NFSMutator, compound_results
from offloadfs.lab.proxy import RPC, Proxy

HANG_BOUND = 30  # seconds: anything slower is a hang
MUTATIONS = 1000  # mutated replies in the randomized run


@contextlib.contextmanager
def through_proxy(place, lab):
    """(Proxy in front of the lab's ganesha, nfs:// URL of a fresh directory through it, its view)."""
    url, view = place.fresh_dir()
    view.chmod(0o777)
    with Proxy((lab.server.host, 2049), RPC) as proxy:
        yield proxy, url.replace(f"nfs://{lab.server.host}/", f"nfs://127.0.0.1:{proxy.port}/"), view
    shutil.rmtree(view, ignore_errors=True)


@pytest.fixture
def proxied(ganesha):
    """through_proxy() on the session's ganesha."""
    with through_proxy(*ganesha) as proxied:
        yield proxied


class Daemon:
    """A foreground mount: its mountpoint, process and log (stderr)."""

    def __init__(self, path, process, log):
        self.path, self.process, self.log = path, process, log

    def log_lines(self):
        return self.log.read_text(errors="replace").splitlines()

    def cpu_seconds(self):
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self):
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")


@contextlib.contextmanager
def foreground_mount(url, options=()):
    """Mount ``url`` with `offloadfs mount -f`, its log kept: yields a Daemon; unmounts on exit."""
    mountpoint = Path(tempfile.mkdtemp(prefix="offloadfs-mnt-"))
    log = mountpoint.with_suffix(".log")
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "offloadfs", *mount_args(url, mountpoint, options), "-f"],
                                   stdout=out, stderr=subprocess.STDOUT)
    daemon = Daemon(mountpoint, process, log)
    try:
        deadline = time.monotonic() + HANG_BOUND
        while not is_mounted(mountpoint):
            assert process.poll() is None, "\n".join(daemon.log_lines())
            assert time.monotonic() < deadline, "the mount never came up"
            time.sleep(0.05)
        yield daemon
        assert process.poll() is None, "the daemon died:\n" + "\n".join(daemon.log_lines()[-30:])
    finally:
        unmount(mountpoint)
        try:
            process.wait(HANG_BOUND)
        except subprocess.TimeoutExpired:
            process.kill()
        mountpoint.rmdir()
        log.unlink()


def as_user(*command):
    """Run a command as uid 1000 (gid 1000, supplementary group 2000)."""
    return subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--groups=2000", "--", *command],
                          capture_output=True, text=True, timeout=HANG_BOUND)


@pytest.mark.parametrize("where", ["nfs-ganesha", "nfsd"])
def test_touch_by_a_group_writer_sets_the_servers_time(mount_on, where):
    """touch sends UTIME_NOW: the server allows "set to server time" to anyone who may write
    (RFC 8881 time_how4), while an explicit time needs the owner."""
    mnt = mount_on(where, options=["allow_other"])
    backing = mnt.backing / "shared"
    backing.write_bytes(b"x")
    os.chown(backing, 0, 2000)
    backing.chmod(0o664)
    os.utime(backing, ns=(10**18, 10**18))
    done = as_user("touch", mnt.path / "shared")
    assert done.returncode == 0, done.stderr
    assert abs(os.stat(backing).st_mtime - time.time()) < 600
    refused = as_user("touch", "-d", "2001-01-01", mnt.path / "shared")  # an explicit time: owner only
    assert refused.returncode != 0 and "not permitted" in refused.stderr, refused


@pytest.mark.parametrize("where", ["local-ext4", "smb-ext4", "nfs-ganesha"])
def test_touch_sets_the_current_time_everywhere(mount_on, where):
    """"Now" reaches every backend as a sentinel, and each sets its source's current time."""
    mnt = mount_on(where)
    (mnt.path / "f").write_bytes(b"x")
    os.utime(mnt.path / "f", ns=(10**18, 10**18))
    before = time.time()
    sh("touch", mnt.path / "f")
    st = os.stat(mnt.backing / "f")
    assert abs(st.st_mtime - before) < 600 and abs(st.st_atime - before) < 600, st


def test_a_listing_that_never_ends_fails(proxied):
    proxy, url, view = proxied
    for i in range(50):
        (view / f"f{i}").touch()
    with foreground_mount(url, ["soft", "timeo=50", "retrans=1"]) as mnt:
        proxy.mutator = looping = LoopingListing()
        ls = subprocess.run(["ls", mnt.path], capture_output=True, text=True, timeout=HANG_BOUND)
        assert ls.returncode != 0 and "Input/output error" in ls.stderr, ls
        print(f"ls gave up after {looping.readdirs} READDIRs: {ls.stderr.strip()}")
        assert looping.readdirs < 100
        assert any("READDIR" in line and "127.0.0.1" in line for line in mnt.log_lines()), mnt.log_lines()
        proxy.mutator = None
        assert len(os.listdir(mnt.path)) == 50


def garbled_requests(record):
    """Replies to SEQUENCE compounds get a garbage record mark; the rest pass."""
    found = compound_results(record)
    return b"\xde\xad\xbe\xef" + record if found and found[0][0] == ops.OP_SEQUENCE else RPC.frame(record)


def test_garbage_record_marks_reconnect_with_backoff(proxied):
    """A server that binds a new connection to the session but answers every request on it with a
    record mark claiming 1.5 GiB: the hard mount keeps trying, but backs off, and says so in a
    few lines."""
    proxy, url, view = proxied
    (view / "f").write_bytes(b"x")
    with foreground_mount(url, ["attr_timeout=0"]) as mnt:
        proxy.mutator = garbled_requests
        connections, lines, cpu = proxy.connections, len(mnt.log_lines()), mnt.cpu_seconds()
        started = time.monotonic()
        stat = subprocess.Popen(["stat", mnt.path / "f"], stdout=subprocess.DEVNULL)
        time.sleep(8)
        connections, lines = proxy.connections - connections, len(mnt.log_lines()) - lines
        elapsed, cpu = time.monotonic() - started, mnt.cpu_seconds() - cpu
        # The bound follows the time taken (a busy machine widens it); without backoff, hundreds.
        allowed = backoff_attempts(elapsed, RECONNECT_FIRST, RECONNECT_MAX)
        print(f"in {elapsed:.1f} s: {connections} connections ({allowed} allowed), {lines} log lines, {cpu:.2f} s CPU")
        assert stat.poll() is None  # hard: still waiting
        proxy.mutator = None
        assert stat.wait(HANG_BOUND) == 0  # and done once the server makes sense again
        assert connections <= allowed and lines <= 12, mnt.log_lines()[-20:]


def test_an_owner_int_refuses_is_nobody():
    """"²" is a digit to str.isdigit() but not to int(): an owner nobody can map, not a crash.

    On a ganesha of its own: once a client set owner "0" (ours sends numeric owners, as Linux
    does over AUTH_SYS), ganesha names root "0" instead of root@localdomain from then on."""
    if nfskit.missing_tools():
        pytest.skip(nfskit.missing_tools())
    with nfskit.ganesha_place() as lab, through_proxy(*lab) as (proxy, url, view):
        (view / "f").write_bytes(b"x")
        odd = "²@localdomain.x".encode()
        assert len(odd) == len(b"root@localdomain")  # ganesha's name for root, replaced in place
        with foreground_mount(url, ["attr_timeout=0"]) as mnt:
            proxy.mutator = lambda record: RPC.frame(record.replace(b"root@localdomain", odd))
            st = os.stat(mnt.path / "f")
            assert (st.st_uid, st.st_gid) == (65534, 65534)
            assert not any("Traceback" in line for line in mnt.log_lines()), mnt.log_lines()


class Workload:
    """Writes, reads with content checks, listings and stats, each worker on files of its own.

    A file's content is known once a write of all of it, its fsync and its close succeeded, and
    unknown after any of them failed; reads and stats check known files only."""

    def __init__(self, root, seed, workers=4):
        self.root = root
        self.rng = random.Random(seed)
        self.truth = {}  # name -> bytes, or None: unknown
        self.ops = self.errors = 0
        self.slowest = 0.0
        self.wrong = []
        self.names = {f"w{w}-{i}" for w in range(workers) for i in range(3)}
        self.workers = workers
        self.lock = threading.Lock()

    def run(self, until):
        threads = [threading.Thread(target=self._worker, args=(w, random.Random(self.rng.random()), until))
                   for w in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _worker(self, w, rng, until):
        while not until():
            name = f"w{w}-{rng.randrange(3)}"
            op = rng.choice((self._write, self._read, self._read, self._list, self._stat))
            started = time.monotonic()
            try:
                op(name, rng)
            except OSError:
                with self.lock:
                    self.errors += 1
            with self.lock:
                self.ops += 1
                self.slowest = max(self.slowest, time.monotonic() - started)

    def _write(self, name, rng):
        data = rng.randbytes(rng.choice((0, 1, 4096, 100_000, 300_000)))
        self.truth[name] = None
        fd = os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.truth[name] = data

    def _read(self, name, rng):
        known = self.truth.get(name)
        with open(self.root / name, "rb") as f:
            data = f.read()
        if known is not None and data != known:
            self.wrong.append(f"read {name}: {len(data)} bytes, {len(known)} written")

    def _list(self, name, rng):
        strange = set(os.listdir(self.root)) - self.names
        if strange:
            self.wrong.append(f"listing has {sorted(strange)}")

    def _stat(self, name, rng):
        known = self.truth.get(name)
        size = os.stat(self.root / name).st_size
        if known is not None and size != len(known):
            self.wrong.append(f"stat {name}: size {size}, {len(known)} written")


def test_randomized_mutations_never_kill_hang_or_lie(proxied):
    """At least 1 000 mutated replies under four kinds of work on a soft mount (0.3 s x 2).

    OFFLOADFS_SEED=<the seed printed> replays the same mutations in the same order and the same
    workload choices; which reply meets which mutation still depends on thread timing.
    Checked: no wrong data the protocol could catch, no request past the hang bound, no
    traceback, daemon RSS within 200 MiB of its start, and the mount healthy afterwards."""
    seed = int(os.environ.get("OFFLOADFS_SEED", random.randrange(1 << 32)))
    print(f"\nseed {seed}")
    proxy, url, view = proxied
    with foreground_mount(url, ["soft", "timeo=3", "retrans=1", "attr_timeout=0", "entry_timeout=0"]) as mnt:
        workload = Workload(mnt.path, seed, workers=8)
        for name in workload.names:
            workload._write(name, random.Random(name))
        rss_before = mnt.rss()
        proxy.mutator = mutator = NFSMutator(seed, rate=0.3)
        started = time.monotonic()
        # A guard only: 2 000 took 144 s here, and 1 982 took 151 s on a CI machine; the count is
        # halved for the suite's time (a new seed every run).
        workload.run(until=lambda: mutator.mutated >= MUTATIONS or time.monotonic() > started + 600)
        proxy.mutator = None
        print(f"{mutator.summary()} in {time.monotonic() - started:.0f} s")
        print(f"{workload.ops} operations, {workload.errors} failed, slowest {workload.slowest:.1f} s; "
              f"daemon RSS {rss_before >> 20} -> {mnt.rss() >> 20} MiB; {len(mnt.log_lines())} log lines")
        assert workload.wrong == []
        assert mutator.mutated >= MUTATIONS
        assert workload.slowest < HANG_BOUND
        assert mnt.rss() < rss_before + (200 << 20)
        assert not any("Traceback" in line for line in mnt.log_lines()), "\n".join(mnt.log_lines())
        # Healthy again: a fresh write of every file reads back (a request still caught in the
        # wreckage, or one slow on this busy machine, may time out once: the soft limit is 0.6 s).
        deadline = time.monotonic() + HANG_BOUND
        retries = 0
        for name in sorted(workload.names):
            while True:
                try:
                    workload._write(name, random.Random(name))
                    workload._read(name, None)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the mount does not come back"
                    retries += 1
        print(f"healthy again after {retries} failed operations")
        assert workload.wrong == [] and sorted(os.listdir(mnt.path)) == sorted(workload.names)
