"""What the SMB and NFS backends share about Kerberos: whose credential cache a mount uses, where a
user's own cache is, and one line for each way getting a ticket fails.

A user's cache (multiuser SMB mounts, NFS sec=krb5* for uids but root, and
the mount's own credentials with cruid=, as cifs.upcall looks up that uid's) is
looked for as the kernel clients' helpers do: first krb5.conf's
default_ccache_name expanded for that user (cifs.upcall's way: it takes
MIT's default cache in the user's own identity), then FILE or DIR caches in
/tmp named krb5cc_UID or krb5cc_UID_* (pam_krb5 and sssd add a random
suffix) owned by the user, as rpc.gssd scans its -d directory, the one whose
TGT lasts longest (cifs.upcall's rule when it scanned; rpc.gssd takes the
newest file).  The daemon is root and could read anyone's cache, so what it
reads must be the user's: a cache is opened without following a symbolic
link and used only if the file opened is theirs, a regular file no one else
may read or write; the daemon logs on from a copy in its own memory, made
from that open file, never by the name again (which may meanwhile point
elsewhere).  A persistent kernel keyring (KEYRING:persistent:UID) is the
user's by the kernel's say.  A cache whose TGT has expired is passed over.

MIT Kerberos (through pyspnego or python-gssapi) says what went wrong in a
paragraph of major and minor codes; failure() makes one line of it that
tells the user what to do.
"""
import ctypes
import ctypes.util
import errno
import functools
import importlib.util
import os
import pwd
import re
import stat
import time

NO_TICKET = "no Kerberos ticket: run kinit (or give keytab= or cruid=)"
# Substrings of MIT Kerberos messages, and the line each failure gets.
FAILURES = (
    ("No Kerberos credentials available", NO_TICKET),
    ("No credentials cache found", NO_TICKET),
    ("Ticket expired", "the Kerberos ticket has expired: run kinit again"),
    ("Clock skew too great", "clock skew too great between this machine and the KDC: set the clock (NTP)"),
    ("not found in Kerberos database", "the server's name is unknown to the KDC: give the server by the name "
                                       "its service principal has"),
    ("No key table entry found", "the keytab holds no key for that principal"),
    ("Key table file", "the keytab cannot be read"),
    ("Preauthentication failed", "the KDC refused the key or password (wrong keytab or password)"),
    ("Cannot find KDC", "no KDC known for the realm: check krb5.conf (KRB5_CONFIG)"),
    ("Cannot contact any KDC", "no KDC of the realm answers"),
)
PACKAGES = "Kerberos needs the Python packages gssapi and krb5: pip install 'offloadfs[kerberos]'"
KRB5_FCC_NOFILE = -1765328189  # MIT's "No credentials cache found"
CACHE_DIR = "/tmp"  # where pam_krb5, sssd and MIT's default put FILE caches
# krb5.conf(5) PARAMETER EXPANSION, as MIT expands them in the user's own processes (%{TEMP}: their
# TMPDIR is unknown here; helpers started by the kernel have none either, so MIT's /tmp).
TOKENS = {"uid": lambda uid: str(uid), "euid": lambda uid: str(uid), "USERID": lambda uid: str(uid),
          "username": lambda uid: pwd.getpwuid(uid).pw_name, "TEMP": lambda uid: "/tmp", "null": lambda uid: ""}


def available():
    """True if the Python packages Kerberos needs are installed."""
    return importlib.util.find_spec("gssapi") is not None and importlib.util.find_spec("krb5") is not None


def cruid_of(value):
    """The uid ``cruid=`` names (a uid or a user name); the cache is looked up by user_cache at each logon."""
    if value is True or not value:
        raise ValueError("cruid= needs a uid or a user name")
    try:
        return int(value) if value.isdigit() else pwd.getpwnam(value).pw_uid
    except KeyError:
        raise ValueError(f"cruid={value}: no such user") from None


class NoCache(Exception):
    """No credential cache of the user's can be used; the text says why, and what to do."""


class UserCache:
    """A user's credential cache as the daemon logs on with it: ``ccache``, a copy in the daemon's
    memory of the one ``found`` (where the system put it), the TGT of ``principal`` lasting until
    ``ends``.  Use it as a context manager: the copy is destroyed at its end."""

    def __init__(self, context, copy, found, principal, ends):
        import krb5

        self._context, self._copy = context, copy
        self.ccache = "MEMORY:" + krb5.cc_get_name(context, copy).decode()
        self.found, self.principal, self.ends = found, principal, ends

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import krb5

        krb5.cc_destroy(self._context, self._copy)


def user_cache(uid):
    """The UserCache of ``uid``: krb5.conf's default_ccache_name for them if it holds a valid TGT, else
    their cache in CACHE_DIR whose TGT lasts longest; NoCache if none will do.  For root (cruid=0 only:
    multiuser and NFS give root the mount's credentials) that is root's own default cache."""
    import krb5

    context = krb5.init_context()
    rejected = []

    def attempt(name):
        try:
            return copy_of(context, name, uid)
        except FileNotFoundError:
            return None
        except NoCache as e:
            rejected.append(str(e))
            return None

    configured = configured_cache(uid)
    best = configured and attempt(configured)
    if best:
        return best
    found = [cache for cache in map(attempt, scan(uid)) if cache is not None]
    if found:
        best = max(found, key=lambda cache: cache.ends)
        for other in found:
            if other is not best:
                other.__exit__()
        return best
    if rejected:
        raise NoCache("; ".join(dict.fromkeys(rejected)))  # a configured cache in CACHE_DIR is tried twice
    looked = [configured] if configured else []
    looked += [f"{CACHE_DIR}/krb5cc_{uid}", f"{CACHE_DIR}/krb5cc_{uid}_*"]
    raise NoCache(f"no credential cache {' or '.join(looked)}: run kinit")


def configured_cache(uid):
    """krb5.conf's default_ccache_name expanded for ``uid``, or None: unset, the same as root's (the
    daemon's own, not the user's) for a uid but root, or with a token that cannot be expanded for them."""
    template = default_ccache_name()
    if template is None:
        return None
    try:
        theirs, roots = expand(template, uid), expand(template, 0)
    except KeyError:  # an unknown token, or a uid with no name for %{username}
        return None
    return typed(theirs) if uid == 0 or theirs != roots else None


def expand(template, uid):
    """``template`` with its %{...} tokens as they stand for ``uid``; KeyError for one unknown."""
    return re.sub(r"%\{([^}]*)\}", lambda m: TOKENS[m.group(1)](uid), template)


@functools.cache
def _libkrb5():
    """MIT's libkrb5, loaded once: find_library runs ldconfig in a child process each time."""
    return ctypes.CDLL(ctypes.util.find_library("krb5"))


def default_ccache_name():
    """[libdefaults] default_ccache_name as krb5.conf says it (KRB5_CONFIG, its includes), tokens
    unexpanded, or None; read through MIT's own profile library, which pykrb5 does not offer."""
    lib = _libkrb5()
    context, profile, value = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    if lib.krb5_init_context(ctypes.byref(context)):
        return None
    try:
        if lib.krb5_get_profile(context, ctypes.byref(profile)):
            return None
        try:
            if lib.profile_get_string(profile, b"libdefaults", b"default_ccache_name", None, None,
                                      ctypes.byref(value)) or not value.value:
                return None
            try:
                return ctypes.string_at(value.value).decode()
            finally:
                lib.profile_release_string(value)
        finally:
            lib.profile_release(profile)
    finally:
        lib.krb5_free_context(context)


def scan(uid):
    """The caches of ``uid``'s name in CACHE_DIR: krb5cc_UID and krb5cc_UID_*, FILE or DIR."""
    names = []
    with os.scandir(CACHE_DIR) as entries:
        for entry in entries:
            if entry.name == f"krb5cc_{uid}" or entry.name.startswith(f"krb5cc_{uid}_"):
                kind = "DIR" if entry.is_dir(follow_symlinks=False) else "FILE"
                names.append(f"{kind}:{entry.path}")
    return sorted(names)


def copy_of(context, name, uid):
    """A UserCache copied from cache ``name`` if it is ``uid``'s and holds a valid TGT; NoCache says
    why not, FileNotFoundError if there is no such cache."""
    kind, _, residual = name.partition(":")
    if kind == "FILE":
        fd = open_own(residual, uid)
        try:
            return copied(context, f"FILE:/proc/self/fd/{fd}", name)
        finally:
            os.close(fd)
    if kind == "DIR":
        return copy_of(context, f"FILE:{subsidiary(residual, uid)}", uid)
    if kind == "KEYRING" and residual.split(":")[:2] == ["persistent", str(uid)]:
        return copied(context, name, name)
    raise NoCache(f"{name}: a cache of this kind is not reachable from the daemon")


def subsidiary(residual, uid):
    """The file of DIR cache ``residual``: the one named, or the collection's primary."""
    if residual.startswith(":"):
        return residual[1:]
    fd = open_own(os.path.join(residual, "primary"), uid)
    try:
        primary = os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if not primary.startswith("tkt") or "/" in primary:
        raise NoCache(f"DIR:{residual}: its primary names no ticket file")
    return os.path.join(residual, primary)


def open_own(path, uid):
    """A descriptor of file ``path`` if it is ``uid``'s own: no symbolic link, a regular file of theirs
    that no one else may read or write; NoCache says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NoCache(f"{path} is a symbolic link, not the user's cache") from None
        if e.errno == errno.ENOENT:
            raise FileNotFoundError(path) from None
        raise NoCache(f"{path}: {e.strerror}") from None
    st = os.fstat(fd)
    why = (f"belongs to uid {st.st_uid}, not to the user" if st.st_uid != uid
           else "is not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"may be read or written by others (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o077
           else None)
    if why:
        os.close(fd)
        raise NoCache(f"{path} {why}")
    return fd


def copied(context, source, found):
    """A UserCache copied from the cache named ``source`` (the one ``found``, as the user knows it)."""
    import krb5

    try:
        cache = krb5.cc_resolve(context, source.encode())
        principal = krb5.cc_get_principal(context, cache)
        creds = list(cache)
    except krb5.Krb5Error as e:
        if e.err_code == KRB5_FCC_NOFILE:  # an empty keyring
            raise FileNotFoundError(found) from None
        raise NoCache(f"{found}: not a credential cache ({e})") from None
    realm = principal.realm
    tgt = [c.times.endtime for c in creds
           if c.server.realm == realm and c.server.components == [b"krbtgt", realm]]
    if not tgt:
        raise NoCache(f"{found}: holds no TGT: run kinit")
    ends = max(tgt)
    if ends <= time.time():
        raise NoCache(f"{found}: the Kerberos ticket has expired: run kinit again")
    copy = krb5.cc_new_unique(context, b"MEMORY")
    krb5.cc_initialize(context, copy, principal)
    for c in creds:
        krb5.cc_store_cred(context, copy, c)
    name = krb5.unparse_name_flags(context, principal).decode()
    return UserCache(context, copy, found, name, ends)


def typed(name):
    """A cache name as MIT wants it, TYPE:residual; a bare path is a FILE cache."""
    return name if re.match(r"^[A-Z_]+:", name) else f"FILE:{name}"


def failure(e):
    """One line for a failed Kerberos logon ``e`` (any exception whose text is MIT's), or None."""
    text = str(e)
    for needle, line in FAILURES:
        if needle in text:
            return line
    return None
