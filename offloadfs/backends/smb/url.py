"""The source URL and mount options of an SMB source, checked before anything connects.

``smb://[DOMAIN;]user@host[:port]/share[/path]`` names the share; the options
follow mount.cifs where they mean the same thing.  The password never comes
from the URL or a mount option (both show in ``ps`` and /proc/mounts): it
comes from a credentials file that only its owner can read, or from the
PASSWD environment variable, as with mount.cifs.  A Kerberos logon needs
none: auth.py says how sec=, cruid= and keytab= choose the credentials.
"""
import os
import stat
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from smbprotocol.connection import Dialects

from .. import SourceError
from . import auth

OPTIONS = frozenset({"credentials", "username", "domain", "file_mode", "dir_mode", "seal", "vers", "port",
                     "closetimeo", "dir_cache_timeout", "posix", "noposix", "sec", "cruid", "keytab",
                     "multiuser"})
# mount.cifs options we take in another form
_PASSWORD_HINT = "the password goes in a credentials=FILE (a password= line, mode 0600) or in $PASSWD"
HINTS = {"user": "use username=NAME", "password": _PASSWORD_HINT, "pass": _PASSWORD_HINT}

DIALECTS = {
    "2.1": Dialects.SMB_2_1_0,
    "3": Dialects.SMB_3_0_0,
    "3.0": Dialects.SMB_3_0_0,
    "3.02": Dialects.SMB_3_0_2,
    "3.0.2": Dialects.SMB_3_0_2,
    "3.11": Dialects.SMB_3_1_1,
    "3.1.1": Dialects.SMB_3_1_1,
    "default": None,
}
# A credentials file's keys, by the prefix mount.cifs goes by (user=, pass=, dom= work too).
CREDENTIAL_KEYS = {"user": "username", "pass": "password", "dom": "domain"}


@dataclass(frozen=True)
class Target:
    """Everything needed to reach one share; the password is kept out of repr()."""
    host: str
    port: int
    share: str
    path: str  # inside the share, backslash-separated; "" is the share's root
    username: str
    domain: str
    password: str | None = field(repr=False)
    dialect: int | None  # None: the newest both sides speak
    seal: bool
    file_mode: int
    dir_mode: int
    close_after: int  # closetimeo=: seconds a released read-only handle under a lease stays open (SMBBackend.release)
    # dir_cache_timeout=: seconds a listing is kept under a directory lease (SMBBackend._hold_listing); 0: no
    # directory leases are asked for
    dir_cache: int
    posix: bool | None  # SMB 3.1.1 POSIX extensions: -o posix (required), -o noposix (never), else where offered
    sec: str = "ntlmssp"  # "krb5" or "ntlmssp" (auth.SECURITY)
    ccache: str | None = None  # the Kerberos credential cache ("TYPE:residual"); None: the library's default
    keytab: str | None = None  # keytab= : log on as the principal in username= with its key, no cache
    cruid: int | None = None  # cruid= : log on from this uid's cache, looked up at each logon (kerberos.user_cache)
    multiuser: bool = False  # each local user but root in a session of their own (client.py)

    @property
    def unc(self):
        return f"\\\\{self.host}\\{self.share}"


def parse(url, options, environ=os.environ):
    """A Target from the URL and the backend options; ValueError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "smb":
        raise ValueError("not an smb:// URL")
    if parts.password is not None:
        raise ValueError("a password in the URL shows in ps and /proc/mounts: remove it and use "
                         "-o credentials=FILE or the PASSWD environment variable")
    host = parts.hostname
    if not host:
        raise ValueError("no server in the URL (smb://[user@]host[:port]/share[/path])")
    try:
        url_port = parts.port
    except ValueError:
        raise ValueError("the port in the URL is not a number from 1 to 65535") from None
    names = [unquote(p) for p in parts.path.split("/") if p]
    if not names:
        raise ValueError("no share in the URL (smb://[user@]host[:port]/share[/path])")
    for name in names:
        if name in (".", "..") or "\\" in name or "\0" in name:
            raise ValueError(f"bad path element {name!r} in the URL")
    domain, user = "", unquote(parts.username) if parts.username else ""
    if ";" in user:
        domain, user = user.split(";", 1)

    creds = read_credentials(options["credentials"]) if "credentials" in options else {}
    user = _one_of("user name", user, _text(options, "username"), creds.get("username"))
    domain = _one_of("domain", domain, _text(options, "domain"), creds.get("domain"))
    password = creds.get("password", environ.get("PASSWD"))
    sec, ccache, keytab, cruid = auth.choose(options, user, domain, password, environ)
    if not user and (sec == "ntlmssp" or keytab):
        raise ValueError("no user name: give smb://user@host/share, -o username= or a credentials file"
                         + (" (keytab= logs on as the principal named there)" if keytab else ""))
    port = _one_of("port", url_port, _number(options, "port", 10), None)
    port = 445 if port is None else port
    if not 0 < port < 65536:
        raise ValueError(f"port {port}: must be from 1 to 65535")
    vers = _text(options, "vers") or "default"
    if vers not in DIALECTS:
        raise ValueError(f"vers={vers}: choose one of {', '.join(DIALECTS)}")
    seal = options.get("seal", False)
    if seal is not True and seal is not False:
        raise ValueError("seal takes no value")
    if seal and DIALECTS[vers] is not None and DIALECTS[vers] < Dialects.SMB_3_0_0:
        raise ValueError(f"seal needs SMB 3 (vers={vers} has no encryption)")
    posix = _posix(options, DIALECTS[vers])
    close_after = _number(options, "closetimeo", 10)
    if close_after is not None and close_after < 0:
        raise ValueError(f"closetimeo={close_after}: seconds, 0 or more")
    dir_cache = _number(options, "dir_cache_timeout", 10)
    if dir_cache is not None and dir_cache < 0:
        raise ValueError(f"dir_cache_timeout={dir_cache}: seconds, 0 or more")
    multiuser = options.get("multiuser", False)
    if multiuser is not True and multiuser is not False:
        raise ValueError("multiuser takes no value")
    if multiuser and sec != "krb5":
        raise ValueError("multiuser needs Kerberos (sec=krb5): each user logs on with their own ticket")
    return Target(host=host, port=port, share=names[0], path="\\".join(names[1:]), username=user or "",
                  domain=domain or "", password=password, dialect=DIALECTS[vers], seal=seal,
                  file_mode=_mode(options, "file_mode", 0o755), dir_mode=_mode(options, "dir_mode", 0o755),
                  close_after=close_after or 0, dir_cache=dir_cache or 0, posix=posix, sec=sec, ccache=ccache,
                  keytab=keytab, cruid=cruid, multiuser=multiuser)


def _posix(options, dialect):
    """-o posix: True, -o noposix: False, neither: None (used where the server offers them)."""
    given = {name: options.get(name, False) for name in ("posix", "noposix")}
    for name, value in given.items():
        if value is not True and value is not False:
            raise ValueError(f"{name} takes no value")
    if all(given.values()):
        raise ValueError("posix and noposix: choose one")
    if given["posix"] and dialect is not None and dialect < Dialects.SMB_3_1_1:
        raise ValueError("posix needs SMB 3.1.1 (vers=3.1.1 or the default)")
    return True if given["posix"] else False if given["noposix"] else None


def read_credentials(path):
    """username=/password=/domain= lines (or user=, pass=, dom=) of a file only its owner may read.

    What is wrong with the file is a SourceError: a mount that fails (exit 32), as with a missing source.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f"credentials file {path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"credentials file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise SourceError(f"credentials file {path}: readable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); run chmod 600 {path}")
        text = f.read().decode("utf-8", "replace")
    creds = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        key = key.strip().lower()
        key = next((full for prefix, full in CREDENTIAL_KEYS.items() if key.startswith(prefix)), None)
        if not eq or key is None:
            # Never quote the line: it may hold the password.
            raise SourceError(f"credentials file {path}, line {number}: expected username=, password= or domain=")
        creds[key] = value if key == "password" else value.strip()
    return creds


def _one_of(what, *values):
    """The value given, or None; two different values are an error."""
    given = {v for v in values if v not in (None, "")}
    if len(given) > 1:
        raise ValueError(f"{what} given twice with different values")
    return given.pop() if given else None


def _text(options, name):
    value = options.get(name)
    if value is True:
        raise ValueError(f"{name}= needs a value")
    return value


def _number(options, name, base):
    value = _text(options, name)
    if value is None:
        return None
    try:
        return int(value, base)
    except ValueError:
        raise ValueError(f"{name}={value}: not a number") from None


def _mode(options, name, default):
    mode = _number(options, name, 8)
    if mode is None:
        return default
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"{name}={options[name]}: not a permission mode")
    return mode
