"""offloadfs on the shares of a Samba AD DC, logged on with Kerberos (offloadfs/lab/addc.py).

A mount with a ticket from the caller's cache reads and writes, a cp inside
a share is still the server's, a sealed mount keeps data whole through the
random data test, a keytab logs on with nobody's cache, a ticket that
expires under a mount does not fail its I/O, and each way logging on can
fail is one line of what to do.
"""
import importlib.util
import os
import pwd
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from mpkit import MiB, sh, sha256, write_file
from test_mp_random_data import random_run

from offloadfs.lab.addc import addc_lab
from offloadfs.lab.mount import offloadfs_cli, offloadfs_mount, status
from offloadfs.lab.samba import USER as LAB_USER
from offloadfs.lab.samba import ensure_user

MISSING = [what for what, ok in (
    ("samba-ad-dc (apt-get install samba-ad-dc samba-ad-provision)", shutil.which("samba") and os.path.isdir(
        "/usr/share/samba/setup")),
    ("kinit (apt-get install krb5-user)", shutil.which("kinit")),
    ("the Python packages gssapi and krb5 (pip install 'offloadfs[kerberos]')",
     importlib.util.find_spec("gssapi") and importlib.util.find_spec("krb5")),
) if not ok]
pytestmark = pytest.mark.skipif(bool(MISSING), reason="needs " + ", ".join(MISSING))

FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
# The shortest ticket we saw Samba 4.17's file server take: it answered tickets of 60, 90 and 120 s
# with KRB_AP_ERR_TKT_EXPIRED at logon.
SHORTEST_TICKET = 150


@pytest.fixture(scope="module")
def dc():
    with addc_lab(kinds=("btrfs", "xfs")) as lab:
        yield lab.server


@pytest.fixture
def realm(dc, tmp_path, monkeypatch):
    """The lab realm's krb5.conf for this process and the mounts it starts; returns the DC."""
    monkeypatch.setenv("KRB5_CONFIG", str(dc.krb5_conf))
    monkeypatch.delenv("PASSWD", raising=False)
    return dc


def fresh_dir(dc, kind, host=None):
    """(URL without a user, server-side path) of a new directory in share ``kind``."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    path = dc.shares[kind].path / name
    path.mkdir()
    path.chmod(0o777)
    return f"smb://{host or dc.host}/{kind}/{name}", path


def with_ticket(realm, tmp_path, monkeypatch, lifetime=None, name="cc"):
    """kinit into a cache of this test's own, named by KRB5CCNAME for the mounts; its path."""
    ccache = realm.kinit(tmp_path / name, lifetime)
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{ccache}")
    return ccache


def mount_fails(url, options):
    """The one line a mount that must fail writes."""
    mountpoint = f"/tmp/offloadfs-krb-{uuid.uuid4().hex[:8]}"
    os.mkdir(mountpoint)
    try:
        proc = offloadfs_cli("mount", url, mountpoint, "-o", ",".join(options))
    finally:
        subprocess.run(["umount", mountpoint], capture_output=True)
        os.rmdir(mountpoint)
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_a_kerberos_mount_reads_and_writes(realm, tmp_path, monkeypatch):
    with_ticket(realm, tmp_path, monkeypatch)
    url, backing = fresh_dir(realm, "xfs")
    with offloadfs_mount(url, options=["sec=krb5"]) as mnt:
        data = os.urandom(3 * MiB + 17)
        (mnt / "f").write_bytes(data)
        assert (backing / "f").read_bytes() == data
        (backing / "g").write_bytes(data[:1000])
        assert (mnt / "g").read_bytes() == data[:1000]
    klist = subprocess.run(["klist", "-c", os.environ["KRB5CCNAME"]], capture_output=True, text=True).stdout
    assert f"cifs/{realm.host}@{realm.realm}" in klist  # the ticket for the host as the URL gives it


@pytest.mark.parametrize("kind,method", [("btrfs", "clone"), ("xfs", "server_copy")])
def test_cp_in_a_share_is_still_the_servers(realm, tmp_path, monkeypatch, kind, method):
    with_ticket(realm, tmp_path, monkeypatch)
    url, backing = fresh_dir(realm, kind)
    digest = write_file(backing / "big", 32 * MiB)
    with offloadfs_mount(url) as mnt:  # no sec=: no password and a ticket cache mean Kerberos
        sh("cp", mnt / "big", mnt / "copy")
        copied = status(mnt)["counters"]["copy_bytes"]
    assert sha256(backing / "copy") == digest
    assert copied.get(method) == 32 * MiB, copied


def test_sealed_data_stays_whole(realm, tmp_path, monkeypatch):
    with_ticket(realm, tmp_path, monkeypatch)
    url, backing = fresh_dir(realm, "btrfs")
    with offloadfs_mount(url, options=["sec=krb5", "seal"]) as mnt:
        random_run(mnt, backing, 3000)


def test_a_keytab_needs_no_cache(realm, tmp_path, monkeypatch):
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")  # no ticket anywhere
    url, backing = fresh_dir(realm, "xfs")
    with offloadfs_mount(url, options=[f"keytab={realm.keytab}", f"username={realm.principal}"]) as mnt:
        (mnt / "f").write_bytes(b"at boot")
    assert (backing / "f").read_bytes() == b"at boot"
    assert not (tmp_path / "none").exists()  # the keytab's ticket stays in the daemon's memory


@pytest.fixture
def lab_user():
    """The lab's user (a uid of its own, so that no real user's cache is touched), with no cache of theirs
    in /tmp before or after."""
    ensure_user()
    user = pwd.getpwnam(LAB_USER)

    def clear():
        for cache in Path("/tmp").glob(f"krb5cc_{user.pw_uid}*"):
            cache.unlink()
    clear()
    yield user
    clear()


def give_ticket(realm, user, cache, lifetime=None):
    """kinit into ``cache`` as the lab's principal, and make the file ``user``'s."""
    realm.kinit(cache, lifetime)
    os.chown(cache, user.pw_uid, user.pw_gid)


def test_cruid_takes_that_users_cache(realm, tmp_path, monkeypatch, lab_user):
    uid = lab_user.pw_uid
    give_ticket(realm, lab_user, f"/tmp/krb5cc_{uid}")
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")  # the caller's own: no ticket
    url, backing = fresh_dir(realm, "xfs")
    with offloadfs_mount(url, options=[f"cruid={uid}"]) as mnt:
        (mnt / "f").write_bytes(b"as that user")
    assert (backing / "f").read_bytes() == b"as that user"


def test_cruid_finds_that_users_ticket_where_sssd_puts_it(realm, tmp_path, monkeypatch, lab_user):
    """Issue #32: cruid= looks the cache up as cifs.upcall does, /tmp/krb5cc_UID_XXXXXX included."""
    uid = lab_user.pw_uid
    give_ticket(realm, lab_user, f"/tmp/krb5cc_{uid}_abc123")
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    url, backing = fresh_dir(realm, "xfs")
    with offloadfs_mount(url, options=["sec=krb5", f"cruid={uid}"]) as mnt:
        (mnt / "f").write_bytes(b"as that user")
    assert (backing / "f").read_bytes() == b"as that user"


def test_cruid_never_takes_a_cache_not_of_that_user(realm, tmp_path, monkeypatch, lab_user):
    """A ticket in a file named for the uid but not theirs (root's here) fails the mount, in one line."""
    uid = lab_user.pw_uid
    realm.kinit(Path(f"/tmp/krb5cc_{uid}"))
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    url, _ = fresh_dir(realm, "xfs")
    line = mount_fails(url, [f"cruid={uid}"])
    assert f"cruid={uid} failed: /tmp/krb5cc_{uid} belongs to uid 0, not to the user" in line, line


def test_cruid_renews_from_that_users_cache_as_found_then(realm, tmp_path, monkeypatch, lab_user):
    """The session's ticket expires; before it did, the user got a new one in a cache of another name (as
    sssd names each logon's): the session is renewed from that one, looked up again, and I/O goes on."""
    uid = lab_user.pw_uid
    give_ticket(realm, lab_user, f"/tmp/krb5cc_{uid}_first", f"{SHORTEST_TICKET}s")
    expires = time.monotonic() + SHORTEST_TICKET
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    url, backing = fresh_dir(realm, "xfs")
    written = bytearray()
    log = tmp_path / "log"
    with offloadfs_mount(url, options=[f"cruid={uid}", f"logfile={log}"]) as mnt:
        renewed = False
        with open(mnt / "f", "wb", buffering=0) as f:
            while time.monotonic() < expires + 20:
                if not renewed and time.monotonic() > expires - 60:
                    give_ticket(realm, lab_user, f"/tmp/krb5cc_{uid}_second")
                    renewed = True
                block = os.urandom(64 * 1024)
                f.write(block)
                os.fsync(f.fileno())
                written += block
                time.sleep(1)
    assert (backing / "f").read_bytes() == written
    text = log.read_text()
    assert f"cruid={uid}: session on {realm.host} as {realm.principal}" in text, text
    assert f"session on {realm.host} expired: renewed as {realm.principal}" in text, text
    assert f"from FILE:/tmp/krb5cc_{uid}_second" in text, text


def test_each_failure_is_one_line(realm, tmp_path, monkeypatch):
    url, _ = fresh_dir(realm, "xfs")
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{tmp_path / 'none'}")
    assert "no Kerberos ticket: run kinit" in mount_fails(url, ["sec=krb5"])
    line = mount_fails(url, [f"keytab={realm.stale_keytab}", f"username={realm.stale_principal}"])
    assert "wrong keytab or password" in line, line
    with_ticket(realm, tmp_path, monkeypatch)
    alias_url, _ = fresh_dir(realm, "xfs", host=realm.alias)
    assert "the server's name is unknown to the KDC" in mount_fails(alias_url, ["sec=krb5"])


@pytest.mark.skipif(not os.path.exists(FAKETIME), reason="needs libfaketime (apt-get install libfaketime)")
def test_clock_skew_is_one_line(realm, tmp_path, monkeypatch):
    with_ticket(realm, tmp_path, monkeypatch)
    url, _ = fresh_dir(realm, "xfs")
    # The mount's clock an hour ahead of the server's; its timers (monotonic) as they are.
    monkeypatch.setenv("LD_PRELOAD", FAKETIME)
    monkeypatch.setenv("FAKETIME", "+1h")
    monkeypatch.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
    assert "clock skew too great" in mount_fails(url, ["sec=krb5"])


@pytest.mark.slow  # waits out a ticket: about three minutes
def test_io_goes_on_when_the_ticket_expires(realm, tmp_path, monkeypatch):
    """A file kept open and written through the expiry of the session's ticket; meanwhile the user renewed
    the cache (kinit, as k5start would).  A second cache left to expire then fails a mount in one line."""
    ccache = with_ticket(realm, tmp_path, monkeypatch, f"{SHORTEST_TICKET}s")
    expiring = realm.kinit(tmp_path / "expiring", f"{SHORTEST_TICKET}s")
    expires = time.monotonic() + SHORTEST_TICKET
    url, backing = fresh_dir(realm, "xfs")
    written = bytearray()
    log = tmp_path / "log"
    with offloadfs_mount(url, options=["sec=krb5", f"logfile={log}"]) as mnt:
        renewed = False
        with open(mnt / "f", "wb", buffering=0) as f, open(mnt / "f", "rb", buffering=0) as back:
            while time.monotonic() < expires + 20:
                if not renewed and time.monotonic() > expires - 60:
                    realm.kinit(ccache)
                    renewed = True
                block = os.urandom(64 * 1024)
                f.write(block)
                os.fsync(f.fileno())
                written += block
                assert os.pread(back.fileno(), len(block), len(written) - len(block)) == block
                time.sleep(1)
        sh("cp", mnt / "f", mnt / "g")
        assert (mnt / "g").read_bytes() == written
    assert (backing / "f").read_bytes() == written
    assert f"session on {realm.host} expired: renewed as the principal of FILE:{ccache}" in log.read_text()
    monkeypatch.setenv("KRB5CCNAME", f"FILE:{expiring}")
    assert "the Kerberos ticket has expired: run kinit again" in mount_fails(url, ["sec=krb5"])
