"""nfs://host[:port]/export[/path] and the NFS mount options."""
import os
from urllib.parse import unquote, urlsplit

from .. import kerberos
from .gss import SERVICES
from .session import Settings

# soft/hard, timeo (tenths of a second), retrans and sec mean what they mean to mount.nfs(8); keytab= and
# cruid= give root's Kerberos credentials as for SMB (cruid=: that uid's cache, looked up at each context).
OPTIONS = frozenset({"soft", "hard", "timeo", "retrans", "rsize", "wsize", "minorversion", "sec", "keytab",
                     "cruid"})
SECURITY = ("sys", *SERVICES)
# mount.nfs options we take in another form
_VERSION_HINT = "nfs:// is always NFSv4: use minorversion=2 (4.2, the default) or minorversion=1 (4.1)"
HINTS = {"vers": _VERSION_HINT, "nfsvers": _VERSION_HINT}
MIN_IO, MAX_IO = 4096, 16 << 20


def _number(options, name, low, high):
    value = options[name]
    if value is True or not str(value).isdigit():
        raise ValueError(f"option {name} needs a number ({name}=N)")
    n = int(value)
    if not low <= n <= high:
        raise ValueError(f"option {name}={n}: must be between {low} and {high}")
    return n


def _security(options, environ):
    """The Settings fields for sec=, keytab= and cruid=."""
    sec = options.get("sec")
    if sec is True or (sec is not None and sec not in SECURITY):
        raise ValueError(f"sec= takes one of {', '.join(SECURITY)}")
    keytab, cruid = options.get("keytab"), options.get("cruid")
    if keytab is True:
        raise ValueError("keytab= needs a value")
    if sec == "sys" and (keytab or cruid):
        raise ValueError("keytab= and cruid= are for Kerberos, not sec=sys")
    if keytab and cruid:
        raise ValueError("keytab= and cruid= both name credentials: give one")
    if sec != "sys" and not kerberos.available():
        if sec is not None:
            raise ValueError(kerberos.PACKAGES)
        return {"sec": "sys"}  # nothing else could work
    fields = {"sec": sec}
    if keytab:
        if not os.access(keytab, os.R_OK):
            raise ValueError(f"keytab={keytab}: not readable")
        fields["keytab"] = os.path.abspath(keytab)
    elif cruid:
        fields["cruid"] = kerberos.cruid_of(cruid)
    elif environ.get("KRB5CCNAME"):
        fields["ccache"] = kerberos.typed(environ["KRB5CCNAME"])
    return fields


def parse(url, options, environ=os.environ):
    """(Settings, [path components from the server's root]); ValueError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "nfs":
        raise ValueError("not an nfs:// URL")
    if parts.username or parts.password:
        raise ValueError("NFS URLs take no user name (requests go as the caller: their ids, or their "
                         "Kerberos ticket)")
    if parts.query or parts.fragment:
        raise ValueError("NFS URLs take no ?query or #fragment; give options with -o")
    host = parts.hostname
    if not host:
        raise ValueError("no server: use nfs://host[:port]/export[/path]")
    try:
        port = parts.port or 2049
    except ValueError:
        raise ValueError("bad port number") from None
    path = [unquote(c).encode() for c in parts.path.split("/") if c]
    if any(c in (b".", b"..") for c in path):
        raise ValueError("the path may not contain . or ..")
    if "soft" in options and "hard" in options:
        raise ValueError("give soft or hard, not both")
    for flag in ("soft", "hard"):
        if flag in options and options[flag] is not True:
            raise ValueError(f"option {flag} takes no value")
    settings = {"host": host, "port": port, "soft": "soft" in options, **_security(options, environ)}
    if "timeo" in options:
        settings["timeo"] = _number(options, "timeo", 1, 36000) / 10
    if "retrans" in options:
        settings["retrans"] = _number(options, "retrans", 0, 100)
    for name in ("rsize", "wsize"):
        if name in options:
            settings[name] = _number(options, name, MIN_IO, MAX_IO)
    if "minorversion" in options:
        settings["minorversion"] = _number(options, "minorversion", 1, 2)
    return Settings(**settings), path
