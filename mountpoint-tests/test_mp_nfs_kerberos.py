"""offloadfs on NFS exports that take Kerberos (RPCSEC_GSS) from the lab's AD realm: nfs-ganesha's
(offloadfs/lab/addc.py nfs_kerberos_lab) and Linux nfsd's with rpc.svcgssd in the qemu guest
("nfsd-krb5", offloadfs/lab/nfsd/krb5.py), each test on both.

Each flavour reads, writes and copies; privacy keeps data whole through the
random data test; a context whose ticket ends is set up again from the
renewed cache; a user with no ticket of their own is refused; and each way
getting a ticket fails is one line of what to do.
"""
import contextlib
import errno
import functools
import os
import pwd
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from mpkit import MiB, sh
from nfskit import VIEW_OPTIONS
from test_mp_kerberos import FAKETIME, MISSING, SHORTEST_TICKET, lab_user, mount_fails  # noqa: F401 (a fixture)
from test_mp_random_data import random_run

from offloadfs.lab.addc import nfs_kerberos_lab
from offloadfs.lab.mount import offloadfs_mount, status
from offloadfs.lab.nfsd import ksmbd, nfsd_lab
from offloadfs.lab.samba import USER as LAB_USER
from offloadfs.lab.samba import ensure_user

pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs " + ", ".join(MISSING))

FLAVOURS = ("krb5", "krb5i", "krb5p")
SECTYPES = ("sys",) + FLAVOURS
# nfsd's guest boots the newest kernel apt knows (ksmbd.kernel(), 6.12): 6.1's nfsd answers every
# krb5p call of ours GARBAGE_ARGS (its unwrap fails), where 6.12's takes them.


@dataclass
class Place:
    """An export taking Kerberos: the server's `host`, the `realm`'s DC, `root` the export seen without
    the mount under test, `restart` the server's; `copies`: whether the server copies (COPY or CLONE)."""

    host: str
    realm: object
    root: Path
    restart: Callable
    copies: bool

    def fresh_dir(self):
        """(URL, path under root) of a new directory on the export."""
        name = f"t-{uuid.uuid4().hex[:10]}"
        path = self.root / name
        path.mkdir()
        path.chmod(0o777)
        return f"nfs://{self.host}/export/{name}", path


def restart_nfsd(guest):
    """nfsd stopped and started: its RPCSEC_GSS contexts flushed, no grace period to wait out."""
    status, out = guest.run("echo 0 > /proc/fs/nfsd/threads && date +%s > /proc/net/rpc/auth.rpcsec.context/flush"
                            " && nfsd-up && echo Y > /proc/fs/nfsd/v4_end_grace")
    assert status == 0, out


@pytest.fixture(scope="module", params=["nfs-ganesha", "nfsd-krb5"])
def lab(request):
    with contextlib.ExitStack() as stack:
        if request.param == "nfs-ganesha":
            lab = stack.enter_context(nfs_kerberos_lab())
            yield Place(lab.server.host, lab.realm, lab.server.path, lab.server.restart, copies=False)
            return
        # nfsd's export is seen through a mount with AUTH_SYS, as in nfskit.
        nfsd = stack.enter_context(nfsd_lab(kernel=ksmbd.kernel(), sectypes=SECTYPES))
        host = nfsd.guest.host
        view = stack.enter_context(offloadfs_mount(f"nfs://{host}/export", options=["sec=sys", *VIEW_OPTIONS]))
        yield Place(host, nfsd.realm, view, functools.partial(restart_nfsd, nfsd.guest), copies=True)


@pytest.fixture
def realm(lab, monkeypatch):
    """The lab realm's krb5.conf for this process and the mounts it starts; returns the DC."""
    monkeypatch.setenv("KRB5_CONFIG", str(lab.realm.krb5_conf))
    return lab.realm


def with_ticket(realm, tmp_path, monkeypatch, lifetime=None):
    ccache = realm.kinit(tmp_path / "cc", lifetime)
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{ccache}")
    return ccache


@pytest.mark.parametrize("sec", FLAVOURS)
def test_each_flavour_reads_writes_and_copies(lab, realm, tmp_path, monkeypatch, sec):
    ccache = with_ticket(realm, tmp_path, monkeypatch)
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url, options=[f"sec={sec}"]) as mnt:
        data = os.urandom(3 * MiB + 17)
        (mnt / "f").write_bytes(data)
        assert (backing / "f").read_bytes() == data
        (backing / "g").write_bytes(data[:1000])
        assert (mnt / "g").read_bytes() == data[:1000]
        sh("cp", mnt / "f", mnt / "copy")
        assert (backing / "copy").read_bytes() == data
        # nfsd copies under RPCSEC_GSS too (a same-server CLONE or COPY); ganesha 4.3 has neither.
        copied = status(mnt)["counters"]["copy_bytes"]
        assert copied["clone"] + copied["server_copy"] == (len(data) if lab.copies else 0), copied
    klist = subprocess.run(["klist", "-c", f"FILE:{ccache}"], capture_output=True, text=True).stdout
    assert f"nfs/{lab.host}@{realm.realm}" in klist  # the ticket for the host as the URL gives it


def test_without_sec_the_server_chooses_and_sys_wins(lab, realm, tmp_path, monkeypatch):
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")  # no ticket: only AUTH_SYS can work
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url) as mnt:
        (mnt / "f").write_bytes(b"as root, AUTH_SYS")
    assert (backing / "f").read_bytes() == b"as root, AUTH_SYS"


def test_private_data_stays_whole(lab, realm, tmp_path, monkeypatch):
    with_ticket(realm, tmp_path, monkeypatch)
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url, options=["sec=krb5p"]) as mnt:
        random_run(mnt, backing, 2000)


def test_a_keytab_needs_no_cache(lab, realm, tmp_path, monkeypatch):
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url, options=["sec=krb5i", f"keytab={realm.keytab}"]) as mnt:
        (mnt / "f").write_bytes(b"at boot")
    assert (backing / "f").read_bytes() == b"at boot"
    assert not (tmp_path / "none").exists()


def test_a_user_without_a_ticket_is_refused(lab, realm, tmp_path, monkeypatch):
    """Root's requests go with the mount's ticket; another uid needs its own cache."""
    with_ticket(realm, tmp_path, monkeypatch)
    ensure_user()
    user = pwd.getpwnam(LAB_USER)
    cache = f"/tmp/krb5cc_{user.pw_uid}"
    assert not os.path.exists(cache)
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url, options=["sec=krb5", "allow_other"]) as mnt:
        (mnt / "root").write_bytes(b"root's")
        proc = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                               "cat", str(mnt / "root")], capture_output=True, text=True)
        assert proc.returncode != 0 and os.strerror(errno.EACCES) in proc.stderr, proc
        try:
            realm.kinit(cache)
            os.chown(cache, user.pw_uid, user.pw_gid)
            proc = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                                   "--clear-groups", "cat", str(mnt / "root")], capture_output=True, text=True)
        finally:
            os.unlink(cache)
        assert proc.stdout == "root's", proc


def test_each_failure_is_one_line(lab, realm, tmp_path, monkeypatch):
    url, _ = lab.fresh_dir()
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    assert "no Kerberos ticket: run kinit" in mount_fails(url, ["sec=krb5"])
    line = mount_fails(url, ["sec=krb5", f"keytab={realm.stale_keytab}"])
    assert "wrong keytab or password" in line, line


@pytest.mark.skipif(not os.path.exists(FAKETIME), reason="needs libfaketime (apt-get install libfaketime)")
@pytest.mark.parametrize("ahead, line", [("+1h", "clock skew too great"),
                                         ("+2d", "the Kerberos ticket has expired: run kinit again")])
def test_clock_skew_and_an_expired_ticket_are_one_line(lab, realm, tmp_path, monkeypatch, ahead, line):
    with_ticket(realm, tmp_path, monkeypatch)
    url, _ = lab.fresh_dir()
    # The mount's clock ahead of the KDC's: an hour is skew, two days outlive the ticket.
    monkeypatch.setenv("LD_PRELOAD", FAKETIME)
    monkeypatch.setenv("FAKETIME", ahead)
    monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    assert line in mount_fails(url, ["sec=krb5i"])


@pytest.mark.slow  # waits out a ticket: about three minutes
def test_a_context_whose_ticket_ended_is_set_up_again(lab, realm, tmp_path, monkeypatch):
    """The server refuses a context once its ticket has ended (RPCSEC_GSS_CREDPROBLEM); meanwhile the user
    renewed the cache, so a new context goes on with the I/O."""
    # A shorter ticket is refused as expired when the service ticket is asked for.
    ccache = with_ticket(realm, tmp_path, monkeypatch, f"{SHORTEST_TICKET}s")
    url, backing = lab.fresh_dir()
    log = tmp_path / "log"
    with offloadfs_mount(url, options=["sec=krb5i", f"logfile={log}"]) as mnt:
        (mnt / "f").write_bytes(b"before")
        realm.kinit(ccache)
        time.sleep(SHORTEST_TICKET + 2)
        (mnt / "g").write_bytes(b"after")
        assert (mnt / "f").read_bytes() == b"before"
    assert (backing / "g").read_bytes() == b"after"
    assert "RPCSEC_GSS context of uid 0 ended: setting up another" in log.read_text()


def test_contexts_are_set_up_again_after_a_server_restart(lab, realm, tmp_path, monkeypatch):
    """A restarted server knows no context: it answers RPCSEC_GSS_CREDPROBLEM, and the client sets up
    another and sends the request again."""
    with_ticket(realm, tmp_path, monkeypatch)
    url, backing = lab.fresh_dir()
    log = tmp_path / "log"
    with offloadfs_mount(url, options=["sec=krb5p", f"logfile={log}"]) as mnt:
        (mnt / "f").write_bytes(b"before")
        lab.restart()
        (mnt / "g").write_bytes(b"after")
        assert (mnt / "f").read_bytes() == b"before"
    assert (backing / "g").read_bytes() == b"after"
    assert "RPCSEC_GSS context of uid 0 gone (auth_stat 13): setting up another" in log.read_text()


def user_reads(lab, user):
    """``user``'s cat of a file root wrote through a new sec=krb5 mount (its CompletedProcess)."""
    url, _ = lab.fresh_dir()
    with offloadfs_mount(url, options=["sec=krb5", "allow_other"]) as mnt:
        (mnt / "root").write_bytes(b"root's")
        return subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
                               "cat", str(mnt / "root")], capture_output=True, text=True)


@pytest.fixture
def user_caches(lab_user):
    """The lab user, with no cache of theirs in /tmp before or after."""
    return lab_user


def give_ticket(realm, user, cache):
    realm.kinit(cache)
    os.chown(cache, user.pw_uid, user.pw_gid)


def test_a_users_ticket_where_sssd_puts_it_is_found(lab, realm, tmp_path, monkeypatch, user_caches):
    """Issue #32: pam_krb5 and sssd name a user's cache /tmp/krb5cc_UID_XXXXXX, as rpc.gssd finds it."""
    user = user_caches
    with_ticket(realm, tmp_path, monkeypatch)
    give_ticket(realm, user, f"/tmp/krb5cc_{user.pw_uid}_abc123")
    assert user_reads(lab, user).stdout == "root's"


def test_krb5_confs_default_ccache_name_is_followed(lab, realm, tmp_path, monkeypatch, user_caches):
    user = user_caches
    own = tmp_path / "krb5.conf"
    own.write_text(f"[libdefaults]\n  default_ccache_name = DIR:{tmp_path}/run/%{{uid}}\n")
    monkeypatch.setenv("KRB5_CONFIG", f"{own}:{realm.krb5_conf}")  # the first file to say a thing is heard
    with_ticket(realm, tmp_path, monkeypatch)
    collection = tmp_path / "run" / str(user.pw_uid)
    collection.mkdir(parents=True)
    give_ticket(realm, user, collection / "tktAbC123")
    (collection / "primary").write_text("tktAbC123\n")
    os.chown(collection / "primary", user.pw_uid, user.pw_gid)
    os.chmod(collection / "primary", 0o600)
    assert user_reads(lab, user).stdout == "root's"


def test_a_cache_not_of_the_user_is_refused_whatever_its_name(lab, realm, tmp_path, monkeypatch, user_caches):
    """A ticket in a file named for the user but owned by another uid is not theirs: EACCES."""
    user = user_caches
    with_ticket(realm, tmp_path, monkeypatch)
    cache = f"/tmp/krb5cc_{user.pw_uid}"
    realm.kinit(cache)
    os.chown(cache, user.pw_uid + 1, user.pw_gid)
    proc = user_reads(lab, user)
    assert proc.returncode != 0 and os.strerror(errno.EACCES) in proc.stderr, proc


def test_cruid_finds_that_users_ticket_where_sssd_puts_it(lab, realm, tmp_path, monkeypatch, user_caches):
    """Issue #32: the mount's own contexts with cruid= come from that uid's cache as a user's are found."""
    user = user_caches
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")  # the caller's own: no ticket
    give_ticket(realm, user, f"/tmp/krb5cc_{user.pw_uid}_abc123")
    url, backing = lab.fresh_dir()
    with offloadfs_mount(url, options=["sec=krb5", f"cruid={user.pw_uid}"]) as mnt:
        (mnt / "f").write_bytes(b"as that user")
    assert (backing / "f").read_bytes() == b"as that user"


def test_cruid_never_takes_a_cache_not_of_that_user(lab, realm, tmp_path, monkeypatch, user_caches):
    """A ticket in a file named for the uid but not theirs (root's here) fails the mount, in one line."""
    uid = user_caches.pw_uid
    realm.kinit(f"/tmp/krb5cc_{uid}")
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    url, _ = lab.fresh_dir()
    line = mount_fails(url, ["sec=krb5", f"cruid={uid}"])
    assert f"cruid={uid}: /tmp/krb5cc_{uid} belongs to uid 0, not to the user" in line, line

