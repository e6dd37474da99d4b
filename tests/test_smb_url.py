"""smb:// URLs, mount options and credentials files, checked without a server."""
import pytest

from offloadfs.backends import SourceError, open_backend
from offloadfs.backends.smb import SMBBackend
from offloadfs.backends.smb.url import Dialects, parse
from offloadfs.options import parse as parse_mount_options

SECRET = "s3cr3t pass=word"


@pytest.fixture
def creds(tmp_path):
    """Factory: a credentials file with ``text`` and ``mode``."""
    def make(text=f"username=alice\npassword={SECRET}\n", mode=0o600):
        path = tmp_path / "cred"
        path.write_text(text)
        path.chmod(mode)
        return str(path)
    return make


def test_url_parts(creds):
    t = parse("smb://alice@files.example:4455/data/projects/x%20y", {"credentials": creds()})
    assert (t.host, t.port, t.share, t.path, t.username, t.domain) == (
        "files.example", 4455, "data", "projects\\x y", "alice", "")
    assert t.password == SECRET
    assert (t.dialect, t.seal, t.file_mode, t.dir_mode, t.close_after) == (None, False, 0o755, 0o755, 0)
    assert t.unc == "\\\\files.example\\data"


def test_domain_and_defaults(creds):
    t = parse("smb://CORP;alice@h/s", {"credentials": creds()})
    assert (t.domain, t.username, t.port, t.path) == ("CORP", "alice", 445, "")


def test_user_from_credentials_file_and_password_from_environment(creds):
    t = parse("smb://h/s", {"credentials": creds("username=bob\ndomain=D\n")}, environ={"PASSWD": "envpw"})
    assert (t.username, t.domain, t.password) == ("bob", "D", "envpw")


def test_options(creds):
    t = parse("smb://alice@h/s", {"credentials": creds(), "vers": "3.0", "seal": True, "file_mode": "0644",
                                  "dir_mode": "750", "port": "1445", "domain": "W", "closetimeo": "1"})
    assert (t.dialect, t.seal, t.file_mode, t.dir_mode, t.port, t.domain, t.close_after) == (
        Dialects.SMB_3_0_0, True, 0o644, 0o750, 1445, "W", 1)
    assert parse("smb://alice@h/s", {"credentials": creds(), "vers": "3.1.1"}).dialect == Dialects.SMB_3_1_1


@pytest.mark.parametrize("url, options, message", [
    ("smb://h", {}, "no share"),
    ("smb:///s", {}, "no server"),
    ("smb://alice@h:99999/s", {}, "port"),
    ("smb://alice@h/s/../t", {}, "bad path element"),
    ("smb://alice@h/s", {"vers": "1.0"}, "vers=1.0"),
    ("smb://alice@h/s", {"vers": "2.1", "seal": True}, "seal needs SMB 3"),
    ("smb://alice@h/s", {"seal": "yes"}, "seal takes no value"),
    ("smb://alice@h/s", {"file_mode": "abc"}, "not a number"),
    ("smb://alice@h/s", {"closetimeo": "-1"}, "closetimeo=-1"),
    ("smb://alice@h/s", {"dir_mode": "17777"}, "not a permission mode"),
    ("smb://alice@h:1445/s", {"port": "445"}, "port given twice"),
    ("smb://alice@h:0/s", {}, "port 0"),
    ("smb://alice@h/s", {"port": "0"}, "port 0"),
    ("smb://alice@h/s", {"username": "bob"}, "user name given twice"),
    ("smb://alice@h/s", {"username": True}, "needs a value"),
    ("smb://h/s", {}, "no user name"),
    ("smb://alice@h/s", {"multiuser": True}, "multiuser needs Kerberos"),
    ("smb://alice@h/s", {"multiuser": "1"}, "multiuser takes no value"),
])
def test_bad_urls_and_options(url, options, message):
    with pytest.raises(ValueError, match=message):
        parse(url, options, environ={"PASSWD": "x"})


def test_no_password():
    with pytest.raises(ValueError, match="no password"):
        parse("smb://alice@h/s", {}, environ={})


def test_password_in_url_is_refused_without_repeating_it():
    with pytest.raises(SourceError) as e:
        open_backend(f"smb://alice:{SECRET}@h/s", {})
    assert SECRET not in str(e.value) and "credentials" in str(e.value)


def test_credentials_file_readable_by_others_is_refused(creds):
    path = creds(mode=0o644)
    with pytest.raises(SourceError) as e:
        open_backend("smb://alice@h/s", {"credentials": path})
    assert "readable by group or others" in str(e.value) and f"chmod 600 {path}" in str(e.value)
    assert SECRET not in str(e.value)
    with pytest.raises(SourceError, match="readable by group"):
        parse("smb://alice@h/s", {"credentials": creds(mode=0o640)})


def test_credentials_file_errors_never_quote_a_line(creds):
    with pytest.raises(SourceError, match="line 2") as e:
        parse("smb://h/s", {"credentials": creds(f"username=a\n{SECRET}\n")})
    assert SECRET not in str(e.value)
    with pytest.raises(SourceError, match="No such file"):
        parse("smb://h/s", {"credentials": "/nonexistent/cred"})


def test_credentials_file_format(creds):
    t = parse("smb://h/s", {"credentials": creds(f"# comment\n\n  username = carol \npassword={SECRET}\n")})
    assert (t.username, t.password) == ("carol", SECRET)  # passwords keep spaces and '='


def test_credentials_file_short_keys_as_mount_cifs_reads_them(creds):
    t = parse("smb://h/s", {"credentials": creds(f"user=dave\npass={SECRET}\ndom=W\n")})
    assert (t.username, t.password, t.domain) == ("dave", SECRET, "W")


def test_password_stays_out_of_repr(creds):
    t = parse("smb://alice@h/s", {"credentials": creds()})
    assert SECRET not in repr(t)
    assert SECRET not in repr(SMBBackend("smb://alice@h/s", {"credentials": creds()}).__dict__)


def test_mount_options_reach_the_backend(creds):
    path = creds()
    config = parse_mount_options("/mnt", "smb://alice@h/s", [f"credentials={path},vers=3.0,seal,uid=1000"])
    assert config.backend_options == {"credentials": path, "vers": "3.0", "seal": True}
    assert SMBBackend.OPTIONS == {"credentials", "username", "domain", "file_mode", "dir_mode", "seal", "vers", "port",
                                  "closetimeo", "dir_cache_timeout", "posix", "noposix", "sec", "cruid", "keytab",
                                  "multiuser"}
    backend = open_backend("smb://alice@h/s", config.backend_options)
    assert isinstance(backend, SMBBackend) and backend.target.seal


def test_constructing_does_not_connect(creds):
    # An address nothing answers on: __init__ only checks its arguments.
    SMBBackend("smb://alice@192.0.2.1/s", {"credentials": creds()})


def test_password_from_the_process_environment(monkeypatch):
    monkeypatch.setenv("PASSWD", "from-env")
    assert parse("smb://alice@h/s", {}).password == "from-env"
