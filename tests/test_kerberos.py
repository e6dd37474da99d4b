"""Where a user's Kerberos cache is found (offloadfs/backends/kerberos.py user_cache): the rules of
cifs.upcall and rpc.gssd, and that nothing but the user's own file is ever used.

The caches are real MIT FILE caches (format version 4, as kinit writes them) holding a TGT that
lasts as long as a test says; nothing talks to a KDC.
"""
import os
import struct
import time

import pytest

from offloadfs.backends import kerberos

pytestmark = pytest.mark.skipif(not kerberos.available(), reason=kerberos.PACKAGES)

UID, OTHER = 61101, 61102
REALM = b"LAB.TEST"


def data(b):
    return struct.pack(">I", len(b)) + b


def principal(*components, realm=REALM):
    return struct.pack(">II", 1, len(components)) + data(realm) + b"".join(map(data, components))


def write_cache(path, user, lasts, uid=UID, mode=0o600):
    """An MIT FILE cache at ``path`` of ``user``@REALM whose TGT ends ``lasts`` seconds from now
    (negative: it has expired), owned by ``uid`` with ``mode``."""
    now = int(time.time())
    client = principal(user.encode())
    tgt = (client + principal(b"krbtgt", REALM) + struct.pack(">HI", 18, 32) + bytes(32)
           + struct.pack(">IIIIBII", now - 60, now - 60, now + lasts, 0, 0, 0, 0) + struct.pack(">I", 0)
           + data(b"ticket") + data(b""))
    path.write_bytes(struct.pack(">HH", 0x0504, 0) + client + tgt)
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """CACHE_DIR for this test, and a krb5.conf of its own (no default_ccache_name)."""
    (tmp_path / "krb5.conf").write_text(f"[libdefaults]\n  default_realm = {REALM.decode()}\n")
    monkeypatch.setenv("KRB5_CONFIG", str(tmp_path / "krb5.conf"))
    caches = tmp_path / "caches"
    caches.mkdir(mode=0o1777)
    monkeypatch.setattr(kerberos, "CACHE_DIR", str(caches))
    return tmp_path


def found(uid=UID):
    with kerberos.user_cache(uid) as cache:
        import krb5

        context = krb5.init_context()
        copied = krb5.cc_resolve(context, cache.ccache.encode())
        servers = [b"/".join(c.server.components) for c in copied]
        assert servers == [b"krbtgt/" + REALM], servers  # the ticket itself is in the copy
        return cache.found, cache.principal


def refusal(uid=UID):
    with pytest.raises(kerberos.NoCache) as e:
        kerberos.user_cache(uid)
    return str(e.value)


def test_a_cache_with_sssds_random_suffix_is_found(tmp):
    cache = write_cache(tmp / "caches" / f"krb5cc_{UID}_abc123", "alice", 3600)
    assert found() == (f"FILE:{cache}", f"alice@{REALM.decode()}")


def test_of_several_the_longest_lasting_tgt_is_chosen(tmp):
    write_cache(tmp / "caches" / f"krb5cc_{UID}", "short", 600)
    write_cache(tmp / "caches" / f"krb5cc_{UID}_long", "long", 7200)
    write_cache(tmp / "caches" / f"krb5cc_{UID}_mid", "mid", 3600)
    write_cache(tmp / "caches" / f"krb5cc_{UID}1_other", "others", 9000, uid=UID)  # another uid's name
    assert found()[1] == f"long@{REALM.decode()}"


def test_an_expired_cache_is_passed_over(tmp):
    write_cache(tmp / "caches" / f"krb5cc_{UID}_old", "old", -60)
    assert "the Kerberos ticket has expired: run kinit again" in refusal()
    write_cache(tmp / "caches" / f"krb5cc_{UID}_new", "new", 600)
    assert found()[1] == f"new@{REALM.decode()}"


def test_a_cache_of_another_uid_is_never_used_whatever_its_name(tmp):
    cache = write_cache(tmp / "caches" / f"krb5cc_{UID}", "bob", 3600, uid=OTHER)
    assert refusal() == f"{cache} belongs to uid {OTHER}, not to the user"


def test_a_symbolic_link_is_never_followed(tmp):
    theirs = write_cache(tmp / f"krb5cc_{UID}_target", "alice", 3600)
    link = tmp / "caches" / f"krb5cc_{UID}"
    link.symlink_to(theirs)
    assert refusal() == f"{link} is a symbolic link, not the user's cache"


def test_a_cache_others_may_read_or_write_is_not_used(tmp):
    cache = write_cache(tmp / "caches" / f"krb5cc_{UID}", "alice", 3600, mode=0o644)
    assert refusal() == f"{cache} may be read or written by others (mode 644)"


def test_no_cache_says_where_it_looked(tmp):
    d = tmp / "caches"
    assert refusal() == f"no credential cache {d}/krb5cc_{UID} or {d}/krb5cc_{UID}_*: run kinit"


def test_an_empty_persistent_keyring_is_no_cache(tmp):
    (tmp / "krb5.conf").write_text("[libdefaults]\n  default_ccache_name = KEYRING:persistent:%{uid}\n")
    d = tmp / "caches"
    looked = f"KEYRING:persistent:{UID} or {d}/krb5cc_{UID} or {d}/krb5cc_{UID}_*"
    assert refusal() == f"no credential cache {looked}: run kinit"


def test_default_ccache_name_is_followed_first(tmp):
    (tmp / "krb5.conf").write_text("[libdefaults]\n  default_ccache_name = FILE:%s/run/%%{uid}/krb5cc\n" % tmp)
    (tmp / "run" / str(UID)).mkdir(parents=True)
    write_cache(tmp / "caches" / f"krb5cc_{UID}", "scanned", 9000)
    configured = write_cache(tmp / "run" / str(UID) / "krb5cc", "configured", 600)
    assert found() == (f"FILE:{configured}", f"configured@{REALM.decode()}")
    configured.unlink()
    assert found()[1] == f"scanned@{REALM.decode()}"


def test_cruid_0_is_roots_own_default_cache(tmp):
    """cruid=0 looks root's cache up by the same rules: krb5.conf's default_ccache_name as root's kinit
    takes it, else /tmp/krb5cc_0[_*]; a file there must still be root's alone."""
    (tmp / "krb5.conf").write_text("[libdefaults]\n  default_ccache_name = FILE:%s/run/%%{uid}/krb5cc\n" % tmp)
    (tmp / "run" / "0").mkdir(parents=True)
    write_cache(tmp / "caches" / "krb5cc_0", "scanned", 9000, uid=0)
    configured = write_cache(tmp / "run" / "0" / "krb5cc", "configured", 600, uid=0)
    assert found(0) == (f"FILE:{configured}", f"configured@{REALM.decode()}")
    configured.unlink()
    assert found(0)[1] == f"scanned@{REALM.decode()}"
    os.chown(tmp / "caches" / "krb5cc_0", OTHER, OTHER)
    assert refusal(0) == f"{tmp}/caches/krb5cc_0 belongs to uid {OTHER}, not to the user"


def dir_collection(path):
    """A DIR cache at ``path`` whose primary holds alice's ticket; the ticket file's path."""
    path.mkdir(parents=True)
    ticket = write_cache(path / "tktAbCd", "alice", 600)
    (path / "primary").write_text("tktAbCd\n")
    os.chown(path / "primary", UID, UID)
    os.chmod(path / "primary", 0o600)
    return ticket


def test_a_dir_collections_primary_is_followed(tmp):
    (tmp / "krb5.conf").write_text("[libdefaults]\n  default_ccache_name = DIR:%s/run/%%{uid}\n" % tmp)
    ticket = dir_collection(tmp / "run" / str(UID))
    assert found() == (f"FILE:{ticket}", f"alice@{REALM.decode()}")


def test_a_dir_collection_in_the_cache_dir_is_found(tmp):
    ticket = dir_collection(tmp / "caches" / f"krb5cc_{UID}_dir")
    assert found() == (f"FILE:{ticket}", f"alice@{REALM.decode()}")


@pytest.mark.parametrize("template, expanded", [
    ("FILE:/tmp/krb5cc_%{uid}", f"FILE:/tmp/krb5cc_{UID}"),
    ("/run/user/%{euid}/cc_%{USERID}%{null}", f"FILE:/run/user/{UID}/cc_{UID}"),
    ("%{TEMP}/krb5cc_%{uid}", f"FILE:/tmp/krb5cc_{UID}"),
    ("KEYRING:persistent:%{uid}", f"KEYRING:persistent:{UID}"),
    ("FILE:/tmp/krb5cc", None),  # the same for every user: root's, never a user's
    ("FILE:/tmp/%{LIBDIR}/cc_%{uid}", None),  # a token we cannot expand for another user
])
def test_default_ccache_name_is_expanded_for_the_user(tmp, template, expanded):
    (tmp / "krb5.conf").write_text(f"[libdefaults]\n  default_ccache_name = {template}\n")
    assert kerberos.configured_cache(UID) == expanded


def test_username_is_the_users_name(tmp):
    (tmp / "krb5.conf").write_text("[libdefaults]\n  default_ccache_name = FILE:/home/%{username}/cc\n")
    assert kerberos.configured_cache(0) == "FILE:/home/root/cc"  # root's own, for cruid=0
    assert kerberos.configured_cache(1) == "FILE:/home/daemon/cc"  # Debian's uid 1
