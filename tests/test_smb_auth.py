"""How the SMB mount options pick the logon (sec=, cruid=, keytab=) and its credentials, without a server."""
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import spnego

from offloadfs.backends import kerberos
from offloadfs.backends.smb import auth
from offloadfs.backends.smb.client import Client
from offloadfs.backends.smb.errors import ConnectionLost
from offloadfs.backends.smb.url import parse

PASSWORD = {"PASSWD": "pw"}


@pytest.fixture
def keytab(tmp_path):
    path = tmp_path / "user.keytab"
    path.write_bytes(b"\x05\x02")
    return str(path)


@pytest.mark.parametrize("options, environ, sec", [
    ({}, PASSWORD, "ntlmssp"),  # as before, and as mount.cifs
    ({}, {"KRB5CCNAME": "FILE:/tmp/cc"}, "krb5"),  # no password, a ticket cache: Kerberos
    ({}, {**PASSWORD, "KRB5CCNAME": "FILE:/tmp/cc"}, "ntlmssp"),  # the password says NTLM
    ({"sec": "krb5"}, {}, "krb5"),
    ({"sec": "krb5i"}, {}, "krb5"),  # we always sign
    ({"sec": "krb5"}, PASSWORD, "krb5"),  # a ticket got with the password
    ({"sec": "ntlmssp"}, PASSWORD, "ntlmssp"),
    ({"sec": "ntlmsspi"}, PASSWORD, "ntlmssp"),
    ({"cruid": "0"}, {}, "krb5"),
])
def test_sec_chosen(options, environ, sec):
    assert parse("smb://alice@h/s", options, environ=environ).sec == sec


def test_cache_from_the_environment_or_cruid():
    assert parse("smb://h/s", {"sec": "krb5"}, environ={"KRB5CCNAME": "FILE:/tmp/a"}).ccache == "FILE:/tmp/a"
    assert parse("smb://h/s", {"sec": "krb5"}, environ={"KRB5CCNAME": "/tmp/b"}).ccache == "FILE:/tmp/b"
    assert parse("smb://h/s", {"sec": "krb5"}, environ={}).ccache is None  # the library's default
    t = parse("smb://h/s", {"cruid": "1234"}, environ={"KRB5CCNAME": "FILE:/tmp/a"})
    assert (t.ccache, t.cruid) == (None, 1234)  # looked up at each logon (Client._log_on)
    assert parse("smb://h/s", {"cruid": "root"}, environ={}).cruid == 0


def test_keytab_logs_on_as_the_user_named(keytab):
    t = parse("smb://h/s", {"keytab": keytab, "username": "svc@CORP.EXAMPLE"}, environ=PASSWORD)
    assert (t.sec, t.keytab, t.ccache) == ("krb5", keytab, None)
    user, password, protocol = auth.credential(t)
    assert user == spnego.KerberosKeytab(keytab=keytab, principal="svc@CORP.EXAMPLE")
    assert (password, protocol) == (None, "kerberos")


def test_keytab_path_made_absolute(keytab, monkeypatch):
    monkeypatch.chdir(os.path.dirname(keytab))
    t = parse("smb://svc@h/s", {"keytab": "user.keytab", "domain": "corp.example"}, environ={})
    assert t.keytab == keytab
    assert auth.credential(t)[0].principal == "svc@CORP.EXAMPLE"


def test_credentials_handed_to_spnego():
    ntlm = parse("smb://CORP;alice@h/s", {}, environ=PASSWORD)
    assert auth.credential(ntlm) == ("CORP\\alice", "pw", "ntlm")
    cache = parse("smb://h/s", {"sec": "krb5"}, environ={"KRB5CCNAME": "FILE:/tmp/a"})
    assert auth.credential(cache) == (spnego.KerberosCCache(ccache="FILE:/tmp/a"), None, "kerberos")
    password = parse("smb://alice@h/s", {"sec": "krb5", "domain": "corp.example"}, environ=PASSWORD)
    assert auth.credential(password) == ("alice@CORP.EXAMPLE", "pw", "kerberos")
    default = parse("smb://h/s", {"sec": "krb5"}, environ={})
    assert auth.credential(default) == (None, None, "kerberos")


@pytest.mark.parametrize("options, environ, message", [
    ({"sec": "krb6"}, {}, "sec=krb6: choose one of"),
    ({"sec": True}, {}, "sec= needs a value"),
    ({"sec": "ntlmssp"}, {}, "no password"),
    ({}, {}, "no password.*sec=krb5"),
    ({"sec": "ntlmssp", "cruid": "0"}, PASSWORD, "are for Kerberos"),
    ({"cruid": "no-such-user-here"}, {}, "cruid=no-such-user-here: no such user"),
    ({"cruid": True}, {}, "cruid= needs"),
    ({"keytab": "/nonexistent/keytab"}, {}, "not readable"),
    ({"keytab": True}, {}, "keytab= needs a value"),
])
def test_bad_logon_options(options, environ, message):
    with pytest.raises(ValueError, match=message):
        parse("smb://alice@h/s", options, environ=environ)


def test_keytab_needs_a_user_and_no_cruid(keytab):
    with pytest.raises(ValueError, match="no user name.*keytab= logs on as the principal"):
        parse("smb://h/s", {"keytab": keytab}, environ={})
    with pytest.raises(ValueError, match="both name credentials"):
        parse("smb://a@h/s", {"keytab": keytab, "cruid": "0"}, environ={})


@pytest.mark.parametrize("text, line", [
    ("Minor (2529639053): No Kerberos credentials available (default cache: FILE:/tmp/x)", "no Kerberos ticket"),
    ("Minor (2529639107): No credentials cache found, Context: Getting GSSAPI credential", "no Kerberos ticket"),
    ("Minor (2529638944): Ticket expired, Context: Processing security token", "has expired"),
    ("Minor (2529638949): Clock skew too great", "clock skew"),
    ("Minor (2529638919): Server not found in Kerberos database", "unknown to the KDC"),
    ("Minor (2529638936): Preauthentication failed", "wrong keytab or password"),
    ("something else entirely", None),
])
def test_one_line_per_failure(text, line):
    got = kerberos.failure(Exception(f"Failed to authenticate with server: SpnegoError: {text}"))
    assert got == line if line is None else line in got


async def test_a_users_session_logs_on_with_their_cache_alone():
    """multiuser: nothing of the mount's credentials (keytab, user, password) goes into a user's logon."""
    t = parse("smb://alice@h/s", {"sec": "krb5", "multiuser": True}, environ=PASSWORD)
    theirs = SimpleNamespace(ccache="MEMORY:copy", principal="bob@LAB.TEST")
    user = Client(t, None).user_target(theirs)
    (cache, _, protocol) = auth.credential(user)
    assert isinstance(cache, spnego.KerberosCCache) and protocol == "kerberos"
    assert (cache.ccache, cache.principal, user.password) == ("MEMORY:copy", "bob@LAB.TEST", None)


async def test_cruid_logs_on_from_that_users_own_cache_alone(monkeypatch):
    """cruid=: the cache is looked up at logon by user_cache's rules, so one in /tmp/krb5cc_UID that is
    not that user's fails the logon with the line that says why."""
    monkeypatch.delenv("KRB5_CONFIG", raising=False)
    uid = 61998
    client = Client(parse("smb://h/s", {"cruid": str(uid)}, environ={}), None)
    cache = Path(f"/tmp/krb5cc_{uid}")
    cache.write_bytes(b"")
    cache.chmod(0o600)
    try:
        with pytest.raises(ConnectionLost) as e:
            client._log_on(None)
    finally:
        cache.unlink()
    assert e.value.strerror == (f"Kerberos logon to h from the cache of cruid={uid} failed: "
                                f"/tmp/krb5cc_{uid} belongs to uid {os.getuid()}, not to the user")


async def test_a_user_without_their_own_cache_gets_eacces(caplog, monkeypatch):
    """No cache, or one that is not the user's (anyone may make /tmp/krb5cc_UID for a uid that has
    none): EACCES before anything is sent, logged once per uid and reason."""
    monkeypatch.delenv("KRB5_CONFIG", raising=False)
    client = Client(parse("smb://h/s", {"sec": "krb5", "multiuser": True}, environ={}), None)
    uid = 61999
    cache = Path(f"/tmp/krb5cc_{uid}")
    cache.unlink(missing_ok=True)
    nothing = f"no credential cache /tmp/krb5cc_{uid} or /tmp/krb5cc_{uid}_*: run kinit"
    for _ in range(2):
        with pytest.raises(PermissionError, match=re.escape(nothing)):
            await client._user_session(None, uid)
    cache.write_bytes(b"")
    cache.chmod(0o600)
    try:
        for _ in range(2):
            with pytest.raises(PermissionError, match=f"belongs to uid {os.getuid()}, not to the user"):
                await client._user_session(None, uid)
    finally:
        cache.unlink()
    logged = [r.getMessage().partition(": ")[2] for r in caplog.records if f"uid {uid} gets EACCES" in r.getMessage()]
    assert logged == [nothing, f"/tmp/krb5cc_{uid} belongs to uid {os.getuid()}, not to the user"]
