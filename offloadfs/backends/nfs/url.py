"""nfs://host[:port]/export[/path] and the NFS mount options."""
from urllib.parse import unquote, urlsplit

from .session import Settings

# soft/hard, timeo (tenths of a second) and retrans mean what they mean to mount.nfs(8).
OPTIONS = frozenset({"soft", "hard", "timeo", "retrans", "rsize", "wsize", "minorversion"})
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


def parse(url, options):
    """(Settings, [path components from the server's root]); ValueError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "nfs":
        raise ValueError("not an nfs:// URL")
    if parts.username or parts.password:
        raise ValueError("NFS URLs take no user name (AUTH_SYS sends the caller's ids)")
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
    settings = {"host": host, "port": port, "soft": "soft" in options}
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
