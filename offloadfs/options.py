"""Mount options: parse `-o a,b=c` (and an optional config file) into one MountConfig.

Everything a user can get wrong is checked here, before the daemon forks, so
that a bad option is one clear line on stderr and nothing gets mounted.
"""
import os
import re
import tomllib
from dataclasses import dataclass, field

from .backends import SourceError, check_options, check_source, scheme_of, shown
from .filesystem import Options
from .fuse.mount import FLAG_OPTIONS, MS_RDONLY

# Options mount(8), fstab and systemd pass along that mean nothing to us.
IGNORED = {"defaults", "auto", "noauto", "nofail", "_netdev", "user", "users", "nouser", "owner",
           "group", "rw", "suid", "dev", "exec", "async", "atime", "relatime", "strictatime",
           "diratime", "loud", "silent"}
IGNORED_PREFIXES = ("x-", "comment=")
# mount.cifs's and mount.nfs's source forms, and how we write them: told from paths that do not exist.
OTHER_FORMS = ((re.compile(r"//([^/]+/.+)"), "an SMB share is written smb://{}"),
               (re.compile(r"([^/:]+):(/.*)"), "an NFS export is written nfs://{}{}"))
# The core's own options (FLAG_OPTIONS aside); backends list theirs in their OPTIONS.
FLAGS = ("allow_other", "default_permissions", "debug", "passthrough", "writeback_cache")
VALUED = ("uid", "gid", "umask", "attr_timeout", "entry_timeout", "offload", "detect_copies", "source", "config",
          "logfile")


class OptionError(ValueError):
    """A mount option or source is wrong; the message is meant for the user."""


@dataclass
class MountConfig:
    mountpoint: str
    sources: dict = field(default_factory=dict)  # name -> source URL or path
    flags: int = 0
    allow_other: bool = False
    default_permissions: bool = False
    debug: bool = False
    passthrough: bool = False
    writeback_cache: bool = False
    logfile: str = None  # where the daemon logs instead of the journal, syslog or the default file
    fs: Options = field(default_factory=Options)
    backend_options: dict = field(default_factory=dict)  # name -> value, or True for a flag
    options: list = field(default_factory=list)  # as given, for the log's first line

    @property
    def fsname(self):
        return ",".join(self.sources.values()) if len(self.sources) == 1 else "offloadfs"


def _int(name, value, base=10):
    try:
        n = int(value, base)
    except ValueError:
        raise OptionError(f"option {name}={value}: not a number") from None
    if n < 0:
        raise OptionError(f"option {name}={value}: must not be negative")
    return n


def _seconds(name, value):
    try:
        t = float(value)
    except ValueError:
        raise OptionError(f"option {name}={value}: not a number of seconds") from None
    if not 0 <= t <= 86400:
        raise OptionError(f"option {name}={value}: must be between 0 and 86400 seconds")
    return t


def _logfile(value):
    """Absolute (`mount -v` shows it), in a directory that exists: a typo is one line, nothing mounted."""
    path = os.path.abspath(value)
    if not os.path.isdir(os.path.dirname(path)):
        raise OptionError(f"option logfile={value}: {os.path.dirname(path)}: no such directory")
    return path


def _add_source(config, name, url):
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise OptionError(f"source name {name!r}: must be a plain directory name")
    if not url:
        raise OptionError(f"source {name}: no path or URL given")
    if name in config.sources:
        raise OptionError(f"source {name}: given twice")
    config.sources[name] = _source(url)


def _source(url):
    """A local path made absolute (mountinfo and status show it, and no one knows whose working
    directory a relative one meant), once it is told from another tool's form of a share."""
    if scheme_of(url) != "file" or url.startswith("file:"):
        return url
    if not os.path.exists(url):
        for form, ours in OTHER_FORMS:
            if match := form.fullmatch(url):
                raise OptionError(f"source {url}: no such directory; {ours.format(*match.groups())}")
    return os.path.abspath(url)


def read_config_file(config, path):
    """A TOML file with a [sources] table: name = "path or URL"."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise OptionError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise OptionError(f"config {path}: {e}") from None
    sources = data.get("sources")
    if not isinstance(sources, dict) or not sources:
        raise OptionError(f"config {path}: needs a [sources] table with name = \"path or URL\" lines")
    unknown = set(data) - {"sources"}
    if unknown:
        raise OptionError(f"config {path}: unknown table {sorted(unknown)[0]!r}")
    for name, url in sources.items():
        if not isinstance(url, str):
            raise OptionError(f"config {path}: source {name} must be a string")
        _add_source(config, name, url)


def parse(mountpoint, source, option_strings):
    """Build a MountConfig from the positional SOURCE (or None) and the -o strings."""
    config = MountConfig(mountpoint=mountpoint, options=[o for s in option_strings for o in s.split(",") if o])
    fs = config.fs
    for opt in config.options:
        name, eq, value = opt.partition("=")
        if opt in IGNORED or opt.startswith(IGNORED_PREFIXES):
            continue
        if name in FLAG_OPTIONS and not eq:
            config.flags |= FLAG_OPTIONS[name]
            fs.ro = fs.ro or name == "ro"
        elif name in FLAGS and not eq:
            setattr(config, name, True)
        elif name in ("uid", "gid") and eq:
            setattr(fs, name, _int(name, value))
        elif name == "umask" and eq:
            fs.umask = _int(name, value, 8) & 0o777
        elif name in ("attr_timeout", "entry_timeout") and eq:
            setattr(fs, name, _seconds(name, value))
        elif name == "offload" and value in ("on", "off", "always"):
            fs.offload, fs.always_offload = value != "off", value == "always"
        elif name == "detect_copies" and value in ("on", "off"):
            fs.detect_copies = value == "on"
        elif name == "trust_leases" and not eq:
            fs.trust_leases = True
        elif name == "source" and eq:
            src_name, _, url = value.partition("=")
            _add_source(config, src_name, url)
        elif name == "config" and eq:
            read_config_file(config, value)
        elif name == "logfile" and eq:
            config.logfile = _logfile(value)
        elif name == "offload":
            raise OptionError(f"option {opt}: use offload=on, offload=off or offload=always")
        elif name == "detect_copies":
            raise OptionError(f"option {opt}: use detect_copies=on or detect_copies=off")
        elif name in VALUED:
            raise OptionError(f"option {name} needs a value: {name}=...")
        else:
            config.backend_options[name] = value if eq else True  # checked once the sources are known
    if source is not None:
        if config.sources:
            raise OptionError("give either SOURCE or source=/config= options, not both")
        config.sources["source"] = _source(source)
    if not config.sources:
        raise OptionError("no source: give SOURCE, or -o source=NAME=SOURCE or -o config=FILE")
    try:
        check_options(config.sources.values(), config.backend_options)
    except SourceError as e:
        raise OptionError(str(e)) from None
    if config.passthrough and os.geteuid() != 0:
        # The kernel lets only root register backing files: every open would fail with EPERM.
        raise OptionError("passthrough needs root (the kernel refuses a user's backing files)")
    if config.passthrough and config.writeback_cache:
        raise OptionError("passthrough and writeback_cache exclude each other")
    if config.flags & MS_RDONLY:
        fs.ro = True
    multiuser = config.backend_options.get("multiuser") is True
    if multiuser and not config.allow_other:
        raise OptionError("multiuser needs allow_other: it is for mounts that other users reach")
    if config.allow_other and not multiuser:
        # The daemon reaches the sources as root: other users must meet the kernel's checks.  With
        # multiuser each user reaches the server in a session of their own, and the server checks.
        config.default_permissions = True
    return config


def check_sources(config):
    """Check every source as its mount would, reaching no server (mount -f stops after this):
    a malformed URL or option is an OptionError, a source that is not there a SourceError."""
    for url in config.sources.values():
        try:
            check_source(url, config.backend_options)
        except ValueError as e:
            raise OptionError(f"source {shown(url)}: {e}") from None
