"""-o multiuser on a share of a Samba AD DC (issue #32): each local user reaches the share in an SMB
session of their own, from their own ticket cache, and the server checks their rights.

The DC's shares force no user (addc_lab(multiuser=True)): a session acts on the server as its domain
user, whom winbindd maps to a unix id, so a file's owner on the server says whose session made it.
The mount logs on as the lab user (root's session); local users ALICE and BOB have tickets of the
domain users alice and bob in /tmp/krb5cc_UID, MIT's default cache; NOTICKET has none.  DAVE's caches are
where pam_krb5, sssd or krb5.conf's default_ccache_name put them.
Every request on a handle must go in the session that opened it: Samba finds no handle of another
session, so data that arrives whole was written in its writer's session.
"""
import contextlib
import errno
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from mpkit import MiB, sh, sha256
from test_mp_kerberos import MISSING, SHORTEST_TICKET, fresh_dir
from test_mp_users import fork_as, read_then_write

from offloadfs.lab.addc import addc_lab
from offloadfs.lab.mount import offloadfs_mount, status

pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs " + ", ".join(MISSING))

ALICE, BOB, NOTICKET, CAROL = 61001, 61002, 61003, 61004  # CAROL: alice's principal, a ticket that expires


@pytest.fixture(scope="module")
def dc():
    with addc_lab(kinds=("xfs",), multiuser=True) as lab:
        yield lab.server


@pytest.fixture
def share(dc, tmp_path, monkeypatch):
    """(mountpoint, server-side directory, log) of a multiuser mount of a fresh directory, read-only
    handles kept open after their close (closetimeo=) to be taken back by the next open, and copies
    recognised in writes committed whatever the cost model says (on the lab's unshaped link it has
    them written)."""
    monkeypatch.setenv("KRB5_CONFIG", str(dc.krb5_conf))
    monkeypatch.delenv("PASSWD", raising=False)
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{dc.kinit(tmp_path / 'cc')}")
    caches = {uid: Path(f"/tmp/krb5cc_{uid}") for uid in (ALICE, BOB, NOTICKET)}
    try:
        for uid, user in ((ALICE, "alice"), (BOB, "bob")):
            give_ticket(dc, uid, user)
        caches[NOTICKET].unlink(missing_ok=True)
        url, backing = fresh_dir(dc, "xfs")
        log = tmp_path / "log"
        options = ["sec=krb5", "multiuser", "allow_other", "closetimeo=30", "offload=always",
                   f"logfile={log}"]
        with offloadfs_mount(url, options=options) as mnt:
            yield mnt, backing, log
    finally:
        for cache in caches.values():
            cache.unlink(missing_ok=True)


def give_ticket(dc, uid, user, lifetime=None, cache=None):
    """A ticket of domain user ``user`` in uid's cache (``cache``, else MIT's default for uid); its path."""
    cache = Path(cache or f"/tmp/krb5cc_{uid}")
    dc.kinit(cache, lifetime, principal=f"{user}@{dc.realm}")
    os.chown(cache, uid, uid)
    return cache


def as_user(uid, fn, *args):
    return fork_as(uid, fn, *args)()


def errno_of(fn, *args):
    """0 if ``fn(*args)`` succeeds, else its errno."""
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return 0


def write_new(path, data, piece=1 << 20):
    with open(path, "wb") as f:
        for at in range(0, len(data), piece):
            f.write(data[at:at + piece])


def write_into(path):
    with open(path, "r+b") as f:
        f.write(b"overwritten")


def only_for_its_owner(path):
    """Make the server-side file ``path`` readable by its owner alone: mode 600, no NT ACL of its own."""
    os.chmod(path, 0o600)
    try:
        os.removexattr(path, "security.NTACL")
    except OSError as e:
        if e.errno != errno.ENODATA:
            raise


def test_a_user_cannot_read_through_another_users_session(share):
    mnt, backing, _ = share
    as_user(ALICE, write_new, mnt / "private", b"alice's own")
    only_for_its_owner(backing / "private")
    assert as_user(ALICE, Path.read_bytes, mnt / "private") == b"alice's own"  # and her handle is kept open
    assert as_user(ALICE, os.access, mnt / "private", os.R_OK | os.W_OK)  # the server decides, not the modes shown
    assert as_user(BOB, errno_of, Path.read_bytes, mnt / "private") == errno.EACCES
    assert as_user(BOB, errno_of, write_into, mnt / "private") == errno.EACCES
    assert as_user(ALICE, Path.read_bytes, mnt / "private") == b"alice's own"
    assert (backing / "private").read_bytes() == b"alice's own"
    assert status(mnt)["counters"]["smb_user_sessions"] == 2


def test_a_user_without_a_ticket_gets_eacces(share):
    mnt, _, log = share
    (mnt / "roots").write_bytes(b"in the mount's session")
    assert "roots" in as_user(ALICE, os.listdir, mnt)
    for _ in range(3):
        assert as_user(NOTICKET, errno_of, os.listdir, mnt) == errno.EACCES
        assert as_user(NOTICKET, errno_of, Path.read_bytes, mnt / "roots") == errno.EACCES
        assert as_user(NOTICKET, errno_of, write_new, mnt / "new", b"x") == errno.EACCES
    assert os.listdir(mnt) == ["roots"]  # root: the mount's own session
    refusals = [line for line in log.read_text().splitlines() if f"uid {NOTICKET} gets EACCES" in line]
    nothing = f"no credential cache /tmp/krb5cc_{NOTICKET} or /tmp/krb5cc_{NOTICKET}_*: run kinit"
    assert len(refusals) == 1 and nothing in refusals[0], refusals


def test_cp_is_the_servers_in_the_users_session(share):
    mnt, backing, _ = share
    as_user(ALICE, write_new, mnt / "big", os.urandom(16 * MiB))
    copier = dict(user=ALICE, group=ALICE, extra_groups=[])
    subprocess.run(["cp", mnt / "big", mnt / "copy"], check=True, **copier)
    assert sha256(backing / "copy") == sha256(backing / "big")
    assert status(mnt)["counters"]["copy_bytes"].get("server_copy") == 16 * MiB
    assert (backing / "copy").stat().st_uid == (backing / "big").stat().st_uid
    as_user(BOB, write_new, mnt / "bobs", b"bob's")
    bob = subprocess.run(["cp", mnt / "bobs", mnt / "copy"], capture_output=True, user=BOB, group=BOB,
                         extra_groups=[])
    assert bob.returncode != 0, bob
    assert as_user(BOB, errno_of, write_into, mnt / "copy") == errno.EACCES
    assert sha256(backing / "copy") == sha256(backing / "big")


def test_writes_behind_are_the_writers(share):
    mnt, backing, _ = share
    data = {uid: os.urandom(4 * MiB + uid) for uid in (ALICE, BOB)}
    for uid in data:
        as_user(uid, write_new, mnt / f"by-{uid}", data[uid])
    (mnt / "by-root").write_bytes(b"root's")
    owners = {name: (backing / name).stat().st_uid for name in (f"by-{ALICE}", f"by-{BOB}", "by-root")}
    assert len(set(owners.values())) == 3, owners  # three sessions, three domain users
    for uid in data:
        assert (backing / f"by-{uid}").read_bytes() == data[uid]


def write_around_a_break(path, ready, go, first, second):
    """Write ``first`` through an open of ``path``, say so on ``ready``, wait for ``go`` (the connection
    is broken meanwhile), then write ``second`` after it through the same open."""
    with open(path, "w+b") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        os.write(ready, b"r")
        assert os.read(go, 1) == b"g"
        os.pwrite(f.fileno(), second, len(first))
        os.fsync(f.fileno())


def test_sessions_and_durable_handles_come_back_in_their_users_session(share, dc):
    """The connection breaks under alice's open file: her session is set up again and her durable
    handle reconnected in it (Samba refuses another user's reconnect of it), and the boundary holds."""
    mnt, backing, log = share
    as_user(ALICE, write_new, mnt / "private", b"alice's own")
    only_for_its_owner(backing / "private")
    first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    finish = fork_as(ALICE, write_around_a_break, mnt / "f", ready_w, go_r, first, second)
    assert os.read(ready_r, 1) == b"r"
    sh("ss", "-K", "dst", dc.host, "dport", "=", "445")
    os.write(go_w, b"g")
    finish()
    assert (backing / "f").read_bytes() == first + second
    assert as_user(BOB, errno_of, Path.read_bytes, mnt / "private") == errno.EACCES
    assert as_user(ALICE, Path.read_bytes, mnt / "private") == b"alice's own"
    assert log.read_text().count(f"uid {ALICE}: session on {dc.host}") == 2


def test_recognised_copies_are_their_writers(share):
    """A copy recognised in alice's writes is committed in her session, from what was served to her;
    bob writing the same bytes (a right guess of her file) recognises nothing of hers."""
    mnt, backing, _ = share
    data = os.urandom(8 * MiB + 12345)
    as_user(ALICE, write_new, mnt / "src", b"")  # hers; its data written on the server, so that reads reach us
    (backing / "src").write_bytes(data)
    only_for_its_owner(backing / "src")
    as_user(ALICE, read_then_write, mnt / "src", mnt / "copy")
    counters = status(mnt)["counters"]
    assert counters["recognised_bytes"] > 0 and sum(counters["recognised_committed"].values()) > 0, \
        {k: v for k, v in counters.items() if k.startswith("recogn")}
    assert (backing / "copy").read_bytes() == data
    assert (backing / "copy").stat().st_uid == (backing / "src").stat().st_uid
    as_user(BOB, write_new, mnt / "guess", data)
    assert status(mnt)["counters"]["recognised_bytes"] == counters["recognised_bytes"]
    assert (backing / "guess").read_bytes() == data
    assert (backing / "guess").stat().st_uid != (backing / "src").stat().st_uid


def test_an_expired_ticket_gets_eacces_until_kinit(share, dc):
    """A user whose ticket has expired gets EACCES, with the line that says to kinit, and no session;
    after kinit, the next request sets theirs up (no remount)."""
    mnt, _, log = share
    (mnt / "roots").write_bytes(b"in the mount's session")
    try:
        give_ticket(dc, CAROL, "alice", "2s")
        time.sleep(3)
        assert as_user(CAROL, errno_of, os.listdir, mnt) == errno.EACCES
        refusals = [line for line in log.read_text().splitlines() if f"uid {CAROL} gets EACCES" in line]
        assert len(refusals) == 1 and "the Kerberos ticket has expired: run kinit again" in refusals[0], refusals
        give_ticket(dc, CAROL, "alice")
        assert as_user(CAROL, os.listdir, mnt) == ["roots"]
    finally:
        Path(f"/tmp/krb5cc_{CAROL}").unlink(missing_ok=True)


def write_across_an_expiry(path, ready, go, first, second, wait):
    """Write ``first`` through an open of ``path``; past the ticket's end (``wait`` seconds) a listing
    must be refused; say so on ``ready`` and, once told on ``go`` (after a kinit), write ``second``
    through the same open.  Returns the listing's errno."""
    with open(path, "w+b") as f:
        f.write(first)
        f.flush()
        os.fsync(f.fileno())
        time.sleep(wait)
        refused = errno_of(os.listdir, os.path.dirname(path))
        os.write(ready, b"r")
        assert os.read(go, 1) == b"g"
        os.pwrite(f.fileno(), second, len(first))
        os.fsync(f.fileno())
    return refused


@pytest.mark.slow  # waits out a ticket: about three minutes
def test_a_users_expired_session_is_renewed_from_their_cache(share, dc):
    """Past her ticket's end CAROL gets EACCES (not the mount's session), and after her kinit her
    session is renewed, not made anew: her open file goes on."""
    mnt, backing, log = share
    give_ticket(dc, CAROL, "alice", f"{SHORTEST_TICKET}s")
    try:
        first, second = os.urandom(64 * 1024), os.urandom(64 * 1024)
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        finish = fork_as(CAROL, write_across_an_expiry, mnt / "f", ready_w, go_r, first, second, SHORTEST_TICKET + 15)
        assert os.read(ready_r, 1) == b"r"
        give_ticket(dc, CAROL, "alice")
        os.write(go_w, b"g")
        assert finish() == errno.EACCES
    finally:
        Path(f"/tmp/krb5cc_{CAROL}").unlink(missing_ok=True)
    assert (backing / "f").read_bytes() == first + second
    text = log.read_text()
    assert f"uid {CAROL} gets EACCES on {dc.host}: session expired, and renewing it failed" in text
    assert f"session on {dc.host} expired: renewed as alice@{dc.realm} from FILE:/tmp/krb5cc_{CAROL}" in text
    assert text.count(f"uid {CAROL}: session on") == 1


DAVE = 61005  # bob's principal, in caches where pam_krb5, sssd or krb5.conf put them (issue #32)


@contextlib.contextmanager
def mount_with_conf(dc, tmp_path, monkeypatch, libdefaults=""):
    """(mountpoint, log) of a multiuser mount whose daemon reads a krb5.conf of the test's own (with
    ``libdefaults``) before the lab's: KRB5_CONFIG lists both, and the first to say a thing is heard."""
    own = tmp_path / "krb5.conf"
    own.write_text(f"[libdefaults]\n{libdefaults}\n")
    monkeypatch.setenv("KRB5_CONFIG", f"{own}:{dc.krb5_conf}")
    monkeypatch.delenv("PASSWD", raising=False)
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{dc.kinit(tmp_path / 'cc')}")
    url, backing = fresh_dir(dc, "xfs")
    (backing / "f").write_bytes(b"for dave")
    log = tmp_path / "log"
    with offloadfs_mount(url, options=["sec=krb5", "multiuser", "allow_other", f"logfile={log}"]) as mnt:
        yield mnt, log


@pytest.fixture
def daves_caches():
    """Removes DAVE's caches in /tmp, before and after."""
    def clear():
        for cache in Path("/tmp").glob(f"krb5cc_{DAVE}*"):
            cache.unlink()
    clear()
    yield
    clear()


def test_a_ticket_with_sssds_random_suffix_is_found(dc, tmp_path, monkeypatch, daves_caches):
    give_ticket(dc, DAVE, "bob", "1h", f"/tmp/krb5cc_{DAVE}_abc123")  # one that ends sooner: passed over
    give_ticket(dc, DAVE, "bob", cache=f"/tmp/krb5cc_{DAVE}_XyZ789")
    with mount_with_conf(dc, tmp_path, monkeypatch) as (mnt, log):
        assert as_user(DAVE, Path.read_bytes, mnt / "f") == b"for dave"
    assert f"uid {DAVE}: session on {dc.host} as bob@{dc.realm} from FILE:/tmp/krb5cc_{DAVE}_XyZ789" in log.read_text()


def test_krb5_confs_default_ccache_name_is_followed(dc, tmp_path, monkeypatch, daves_caches):
    run = tmp_path / "run" / str(DAVE)
    run.mkdir(parents=True)
    os.chown(run, DAVE, DAVE)
    give_ticket(dc, DAVE, "bob", cache=run / "krb5cc")
    conf = f"  default_ccache_name = FILE:{tmp_path}/run/%{{uid}}/krb5cc"
    with mount_with_conf(dc, tmp_path, monkeypatch, conf) as (mnt, log):
        assert as_user(DAVE, Path.read_bytes, mnt / "f") == b"for dave"
    assert f"as bob@{dc.realm} from FILE:{run}/krb5cc" in log.read_text()


def test_a_cache_not_of_the_user_is_refused_whatever_its_name(dc, tmp_path, monkeypatch, daves_caches):
    """Bob's ticket in a file named for DAVE but owned by bob, and a link named for DAVE to bob's
    cache: neither is DAVE's, who gets EACCES."""
    give_ticket(dc, BOB, "bob", cache=f"/tmp/krb5cc_{DAVE}_planted")
    bobs = give_ticket(dc, BOB, "bob", cache=f"/tmp/krb5cc_{BOB}_ccache")
    try:
        Path(f"/tmp/krb5cc_{DAVE}").symlink_to(bobs)
        with mount_with_conf(dc, tmp_path, monkeypatch) as (mnt, log):
            assert as_user(DAVE, errno_of, Path.read_bytes, mnt / "f") == errno.EACCES
            assert as_user(BOB, Path.read_bytes, mnt / "f") == b"for dave"  # bob's cache is good, for bob
    finally:
        bobs.unlink()
    text = log.read_text()
    assert f"/tmp/krb5cc_{DAVE} is a symbolic link, not the user's cache" in text
    assert f"/tmp/krb5cc_{DAVE}_planted belongs to uid {BOB}, not to the user" in text


def test_a_persistent_keyring_cache_is_followed(dc, tmp_path, monkeypatch, daves_caches):
    """KEYRING:persistent:%{uid} (the RHEL and Fedora default): DAVE's kinit fills the kernel keyring
    kept for his uid, and the daemon, root, reaches it as the kernel lets root alone."""
    shared = Path(tempfile.mkdtemp(prefix="ccache-conf-"))  # a krb5.conf DAVE's kinit may read
    shared.chmod(0o755)
    env = {**os.environ, "KRB5_CONFIG": str(shutil.copy(dc.krb5_conf, shared)),
           "KRB5CCNAME": f"KEYRING:persistent:{DAVE}"}
    as_dave = ["setpriv", f"--reuid={DAVE}", f"--regid={DAVE}", "--clear-groups"]
    try:
        subprocess.run([*as_dave, "kinit", f"bob@{dc.realm}"], input=f"{dc.password}\n", env=env, check=True,
                       capture_output=True, text=True)
        conf = "  default_ccache_name = KEYRING:persistent:%{uid}"
        with mount_with_conf(dc, tmp_path, monkeypatch, conf) as (mnt, log):
            assert as_user(DAVE, Path.read_bytes, mnt / "f") == b"for dave"
    finally:
        subprocess.run([*as_dave, "kdestroy", "-A"], env=env)
        shutil.rmtree(shared)
    assert f"as bob@{dc.realm} from KEYRING:persistent:{DAVE}" in log.read_text()
