"""Command line: `offloadfs mount|umount|status` and the mount(8) helper `mount.offloadfs`.

Every failure a user can cause ends as one line on stderr and a non-zero
exit, never a traceback: 1 for a wrong invocation, 32 for a mount (or
unmount) that failed, as mount(8) and its helpers exit.  `mount` returns once
the kernel has spoken to the daemon (INIT answered), so a script can use the
mount on the next line.
"""
import argparse
import errno
import json
import logging
import os
import select
import signal
import sys
import time
from importlib import metadata

from . import logs
from .backends import SourceError
from .fuse import mount as fusemount
from .backends import scheme_of
from .options import OptionError, check_sources, parse

STATUS_XATTR = "user.offloadfs.status"
READY_TIMEOUT = 30
EX_USAGE, EX_FAIL = 1, 32  # mount(8): "incorrect invocation or permissions", "mount failure"


class UsageError(Exception):
    """The command line is wrong (exit 1)."""


class Failed(Exception):
    """The command was right but did not work (exit 32)."""


class NotMounted(UsageError):
    """Nothing of ours is mounted there: never was, or (under status --watch) no longer is."""


def _fail(msg, code=EX_FAIL):
    print(f"offloadfs: {msg}", file=sys.stderr)
    return code


def _check_mountpoint(path):
    try:
        os.stat(path)
    except FileNotFoundError:
        raise Failed(f"mountpoint {path}: no such directory") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise Failed(f"mountpoint {path}: a dead offloadfs mount; run 'offloadfs umount {path}'") from None
        raise Failed(f"mountpoint {path}: {e.strerror}") from None
    if not os.path.isdir(path):
        raise Failed(f"mountpoint {path}: not a directory")
    if os.path.ismount(path):
        raise Failed(f"mountpoint {path}: already a mount point")


def do_mount(source, mountpoint, options, foreground, fake=False, verbose=False, by_mount8=False):
    """Mount; ``fake`` (mount -f) checks the sources, mountpoint and options and stops short of mounting.

    ``by_mount8``: mount(8) runs us, for fstab or a systemd unit, where a network source needs _netdev.
    """
    from . import daemon

    # Resolved now, while nothing is mounted there: the daemon must never stat its own mount.
    config = parse(os.path.realpath(mountpoint), source, options)
    check_sources(config)
    _check_mountpoint(mountpoint)
    if by_mount8:
        _warn_without_netdev(config, options)
    if fake:
        return 0
    log = logs.choose(config.logfile, foreground)
    if verbose:
        print(f"offloadfs: {config.mountpoint}: logs go to {log.where}", flush=True)
    if foreground:
        log.install(config.debug)
        daemon.run(config, on_ready=lambda: None)
        return 0
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _daemon_child(config, log, write_end)
    os.close(write_end)
    return _wait_ready(read_end, pid, config.mountpoint)


def _warn_without_netdev(config, options):
    """systemd knows cifs and nfs for network filesystems, not offloadfs: without _netdev an fstab line or
    unit is mounted before the network is up, and its failure at boot ends in emergency mode."""
    network = sorted({scheme_of(url) for url in config.sources.values()} - {"file"})
    if network and "_netdev" not in (o for s in options for o in s.split(",")):
        print(f"offloadfs: warning: a {network[0]}:// source without _netdev: in fstab or a systemd unit "
              f"add _netdev, or it is mounted before the network is up and a failure at boot "
              f"ends in emergency mode", file=sys.stderr)


def _daemon_child(config, log, ready_fd):
    from . import daemon

    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    log.install(config.debug)

    def on_ready():
        os.write(ready_fd, b"ok\n")
        os.close(ready_fd)

    code = 0
    try:
        daemon.run(config, on_ready)
    except (fusemount.MountError, SourceError, OSError) as e:
        _tell(ready_fd, _describe(e))
        code = 1
    except BaseException as e:  # the parent must hear something, whatever broke
        logging.getLogger(__name__).exception("daemon failed")
        _tell(ready_fd, f"daemon failed: {e!r}")
        code = 1
    os._exit(code)


def _describe(e):
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def _tell(fd, msg):
    try:
        os.write(fd, msg.encode() + b"\n")
    except OSError:
        pass  # already reported ready; the log has it


def _wait_ready(fd, pid, mountpoint):
    deadline = time.monotonic() + READY_TIMEOUT
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        if data.endswith(b"\n"):
            break
    os.close(fd)
    msg = data.decode(errors="replace").strip()
    if msg == "ok":
        return 0
    if not msg:
        msg = "the daemon did not answer in time" if time.monotonic() >= deadline else "the daemon exited"
        if fusemount.is_mounted(mountpoint):
            fusemount.unmount(mountpoint, lazy=True)
    return _fail(msg)


def do_umount(mountpoint, lazy, force=False):
    mountpoint = os.path.realpath(mountpoint)
    here = fusemount.mount_entry(mountpoint) if fusemount.is_mounted(mountpoint) else None
    elsewhere = fusemount.holders(mountpoint, here and here.dev)
    if not here and not elsewhere:
        raise Failed(f"{mountpoint}: not an offloadfs mount")
    if force:
        fusemount.force_unmount(mountpoint, elsewhere)
        return 0
    # Copies the unmount here takes along (peers and slaves of a shared mount) do not keep the daemon.
    outliving = fusemount.outliving(elsewhere, here) if here else elsewhere
    if outliving:
        raise _held_elsewhere(mountpoint, outliving, "also mounted" if here else
                              "not mounted here, but the daemon still serves it")
    try:
        fusemount.unmount(mountpoint, lazy=lazy)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise Failed(f"{mountpoint}: busy (files open or a process inside); "
                         f"'offloadfs umount -l' detaches it now") from None
        raise Failed(str(e)) from None
    left = fusemount.holders(mountpoint, here.dev)
    if left:  # propagation other than mountinfo told
        raise _held_elsewhere(mountpoint, left, "unmounted here, but still mounted")
    return 0


def _held_elsewhere(mountpoint, copies, what):
    holders = ", ".join(f"pid {copy.pid} {_comm(copy.pid)}" for copy in copies[:3])
    return Failed(f"{mountpoint}: {what} in {len(copies)} other mount namespace(s) ({holders}); "
                  f"'offloadfs umount --force {mountpoint}' ends it everywhere")


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "(gone)"


def read_status(mountpoint):
    try:
        return json.loads(os.getxattr(mountpoint, STATUS_XATTR))
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UsageError(f"{mountpoint}: the daemon is gone; run 'offloadfs umount {mountpoint}'") from None
        if e.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise NotMounted(f"{mountpoint}: not an offloadfs mount") from None
        raise UsageError(f"{mountpoint}: {e.strerror}") from None


def do_status(mountpoint, as_json, watch=False):
    from . import statusview  # rich: only a status needs it

    def gather():
        if mountpoint is not None:
            return [read_status(mountpoint)]
        found = []
        for mp in fusemount.mounts():
            try:
                found.append(read_status(mp))
            except UsageError as e:  # dead, or going away: say so, and go on with the others
                found.append(str(e))
        return found

    if watch:
        return statusview.watch(gather, ended=NotMounted)
    statuses = gather()
    if not as_json:
        print(statusview.text(statuses) if statuses else "no offloadfs mounts")
    elif mountpoint is not None:
        print(json.dumps(statuses[0], indent=2))
    else:
        for line in (s for s in statuses if isinstance(s, str)):
            print(f"offloadfs: {line}", file=sys.stderr)
        print(json.dumps([s for s in statuses if not isinstance(s, str)], indent=2))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong command line exits 1 as mount(8) does, not 2."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def _help(title, rows):
    """A help section: one (name, what it does) row a line."""
    return f"{title}:\n" + "".join(f"  {name:<30} {what}\n" if len(name) < 30 else f"  {name}\n{'':33}{what}\n"
                                    for name, what in rows)


SOURCES = [
    ("/path, file:///path", "a local directory (also an export the kernel mounts)"),
    ("smb://[DOM;]user@host[:port]/share[/path]", "an SMB 2/3 share; password: credentials=FILE or $PASSWD"),
    ("nfs://host[:port]/export[/path]", "an NFSv4.2 (or 4.1) export"),
    ("(none)", "with -o source=NAME=SOURCE,... or -o config=FILE"),
]
MOUNT_OPTIONS = [
    ("ro, rw", "read-only or read-write"),
    ("nosuid, nodev, noexec, sync, noatime, nodiratime", "as in mount(8)"),
    ("allow_other", "let other users in (turns on default_permissions)"),
    ("default_permissions", "let the kernel check permissions"),
    ("uid=N, gid=N, umask=OCT", "owner, group and mode bits shown for every file (no owners: NFS, SMB POSIX)"),
    ("offload=on|off|always", "off: no clones or server-side copies; always: no cost model"),
    ("detect_copies=on|off", "off: data copied by read and write is written as it comes"),
    ("trust_leases", "no read-back of copies a lease proves (blind to programs on the server)"),
    ("passthrough", "reads and writes go straight to local backing files (root only)"),
    ("writeback_cache", "the kernel caches writes and sends them in bulk"),
    ("attr_timeout=S, entry_timeout=S", "how long the kernel may cache attributes, names"),
    ("debug", "log every request"),
    ("logfile=PATH", "log there, not to the journal, syslog or the default file"),
    ("source=NAME=SOURCE", "add SOURCE as top-level directory NAME (repeatable)"),
    ("config=FILE", "read sources from a TOML file's [sources] table"),
    ("SMB: credentials=FILE", "username=, password=, domain= lines; mode 0600"),
    ("SMB: username=, domain=, port=, file_mode=, dir_mode=, seal, vers=",
     "as in mount.cifs; vers: 3.1.1, 3.0.2, 3.0, 2.1"),
    ("SMB: closetimeo=SECONDS", "keep a released read-only handle open under its lease (0: off, the default)"),
    ("SMB: sec=krb5|ntlmssp, cruid=UID, keytab=FILE", "Kerberos from a ticket cache (cruid=: that user's, "
     "found as for multiuser) or keytab, or NTLM"),
    ("SMB: multiuser", "with allow_other and Kerberos: each user in a session of their own, from their own "
                       "cache (default_ccache_name, /tmp/krb5cc_UID[_*])"),
    ("SMB: dir_cache_timeout=SECONDS", "keep a listing under a directory lease (0: off, the default)"),
    ("SMB: posix, noposix", "SMB 3.1.1 POSIX extensions: require them / never ask (default: where offered)"),
    ("NFS: soft, hard, timeo=, retrans=, rsize=, wsize=, minorversion=", "as in nfs(5)"),
    ("NFS: sec=sys|krb5|krb5i|krb5p, cruid=UID, keytab=FILE",
     "AUTH_SYS or RPCSEC_GSS Kerberos (default: the server's choice, sys where offered)"),
    ("defaults, noauto, nofail, x-*, ...", "accepted and ignored, for fstab"),
    ("_netdev", "for fstab and units: tells systemd a smb:// or nfs:// mount needs the network"),
]
EXIT_STATUS = "exit status: 0 done, 1 wrong invocation or option, 32 the mount or unmount failed"


def _subcommand(sub, name, summary, examples, epilog=""):
    examples = "examples:\n" + "".join(f"  {e}\n" for e in examples)
    return sub.add_parser(name, help=summary, description=summary, epilog=f"{epilog}{examples}\n{EXIT_STATUS}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _parser():
    p = _Parser(prog="offloadfs", description="FUSE filesystem that turns copies into clones and "
                "server-side copies.  See offloadfs COMMAND --help and offloadfs(8).")
    p.add_argument("--version", action="version", version=f"%(prog)s {metadata.version('offloadfs')}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    m = _subcommand(sub, "mount", "mount SOURCE (a path or URL) on MOUNTPOINT", [
        "offloadfs mount /srv/data /mnt/data -o passthrough",
        "offloadfs mount smb://backup@nas/data /mnt/data -o credentials=/etc/offloadfs/nas.cred",
        "offloadfs mount nfs://filer/export/projects /mnt/projects -o soft",
        "offloadfs mount -o source=fast=/srv/btrfs,source=bulk=/srv/ext4 /mnt/all",
    ], _help("sources", SOURCES) + "\n" + _help("options (-o, comma-separated)", MOUNT_OPTIONS) + "\n")
    m.usage = "offloadfs mount [-h] [-f] [-v] [-o OPTION[,OPTION...]] [SOURCE] MOUNTPOINT"
    m.add_argument("args", nargs="+", metavar="[SOURCE] MOUNTPOINT",
                   help="SOURCE may be left out when -o source= or config= names the sources")
    m.add_argument("-o", dest="options", action="append", default=[], metavar="OPTION[,OPTION...]",
                   help="mount options, see below (repeatable)")
    m.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground, log to stderr")
    m.add_argument("-v", "--verbose", action="store_true", help="say where the daemon logs")
    u = _subcommand(sub, "umount", "unmount MOUNTPOINT (also after its daemon was killed)", [
        "offloadfs umount /mnt/data",
        "offloadfs umount -l /mnt/data",
        "offloadfs umount --force /mnt/data",
    ])
    u.add_argument("mountpoint", metavar="MOUNTPOINT", help="an offloadfs mount")
    u.add_argument("-l", "--lazy", action="store_true", help="detach now, clean up when no longer busy")
    u.add_argument("--force", action="store_true",
                   help="end the daemon, even if busy or other mount namespaces hold the mount")
    s = _subcommand(sub, "status", "copies in flight and counters of a mount, or of every mount", [
        "offloadfs status",
        "offloadfs status /mnt/data",
        "offloadfs status --watch /mnt/data",
        "offloadfs status /mnt/data --json",
    ])
    s.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?", help="an offloadfs mount (default: every one)")
    s.add_argument("--json", action="store_true", help="one JSON object (its keys are an interface)")
    s.add_argument("--watch", action="store_true", help="redraw live, with progress bars")
    return p


def _run(command):
    """Run a command; what goes wrong is one line on stderr and mount(8)'s exit code."""
    try:
        return command()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE  # what the shell shows for a tool the closed pipe killed
    except (UsageError, OptionError) as e:
        return _fail(_describe(e), EX_USAGE)
    except (Failed, SourceError, fusemount.MountError, OSError) as e:
        return _fail(_describe(e))
    except KeyboardInterrupt:
        return 130


def main(argv=None):
    args = _parser().parse_args(argv)

    def command():
        if args.command == "mount":
            if len(args.args) > 2:
                raise UsageError("mount takes [SOURCE] MOUNTPOINT")
            source = args.args[0] if len(args.args) == 2 else None
            return do_mount(source, args.args[-1], args.options, args.foreground, verbose=args.verbose)
        if args.command == "umount":
            return do_umount(args.mountpoint, args.lazy, args.force)
        code = do_status(args.mountpoint, args.json, args.watch)
        sys.stdout.flush()  # a reader gone (`| head`) shows here, not as a complaint at exit
        return code

    return _run(command)


def mount_helper_main(argv=None):
    """mount(8) calls: mount.offloadfs SOURCE MOUNTPOINT [-sfnv] [-N ns] [-o OPTS] [-t TYPE]."""
    argv = sys.argv[1:] if argv is None else argv
    p = _Parser(prog="mount.offloadfs", formatter_class=argparse.RawDescriptionHelpFormatter,
                description="The mount(8) helper for offloadfs: mount(8) runs it for -t offloadfs "
                "and fstab lines of type offloadfs.  See mount.offloadfs(8).",
                epilog="examples:\n  mount -t offloadfs /srv/data /mnt/data -o passthrough\n"
                "  mount -t offloadfs smb://backup@nas/data /mnt/nas -o credentials=/etc/offloadfs/nas.cred\n"
                "  mount -t offloadfs offloadfs /mnt/all -o config=/etc/offloadfs.toml\n\n"
                "mounted, the type shows as fuse.offloadfs (FUSE's form): findmnt -t fuse.offloadfs\n\n" + EXIT_STATUS)
    p.add_argument("source", metavar="SOURCE", help="a path or URL; offloadfs or none with source=/config=")
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing directory")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTIONS",
                   help="mount options, as offloadfs mount -o (see offloadfs mount --help)")
    p.add_argument("-f", dest="fake", action="store_true", help="fake: check SOURCE, the options and MOUNTPOINT, mount nothing")
    p.add_argument("-s", action="store_true", help="sloppy (accepted; unknown options are still refused)")
    p.add_argument("-n", action="store_true", help="no mtab (there is none to write)")
    p.add_argument("-v", action="store_true", help="verbose: say where the daemon logs")
    p.add_argument("-t", dest="type", metavar="TYPE", help="offloadfs or fuse.offloadfs (ignored)")
    p.add_argument("-N", dest="namespace", metavar="NS", help="mount namespace (accepted, ignored)")
    args = p.parse_args(argv)
    # fstab needs a first field; with source=/config= options it is only a label.
    source = None if args.source in ("offloadfs", "none") else args.source
    return _run(lambda: do_mount(source, args.mountpoint, args.options, False, fake=args.fake, verbose=args.v,
                                 by_mount8=True))
