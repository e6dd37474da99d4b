"""Command line: `offloadfs mount|umount|status` and the mount(8) helper `mount.offloadfs`.

Every failure a user can cause ends as one line on stderr and a non-zero
exit, never a traceback.  `mount` returns once the kernel has spoken to the
daemon (INIT answered), so a script can use the mount on the next line.
"""
import argparse
import errno
import json
import logging
import logging.handlers
import os
import select
import sys
import time

from .backends import SourceError
from .fuse import mount as fusemount
from .options import OptionError, parse

STATUS_XATTR = "user.offloadfs.status"
READY_TIMEOUT = 30


class UsageError(Exception):
    pass


def _fail(msg):
    print(f"offloadfs: {msg}", file=sys.stderr)
    return 1


def _check_mountpoint(path):
    try:
        os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"mountpoint {path}: no such directory") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UsageError(f"mountpoint {path}: a dead offloadfs mount; run 'offloadfs umount {path}'") from None
        raise UsageError(f"mountpoint {path}: {e.strerror}") from None
    if not os.path.isdir(path):
        raise UsageError(f"mountpoint {path}: not a directory")
    if os.path.ismount(path):
        raise UsageError(f"mountpoint {path}: already a mount point")


def _setup_logging(debug, foreground):
    level = logging.DEBUG if debug else logging.INFO
    if foreground:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    elif os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler("/dev/log")
        handler.setFormatter(logging.Formatter("offloadfs[%(process)d]: %(message)s"))
    else:
        handler = logging.NullHandler()
    logging.basicConfig(level=level, handlers=[handler], force=True)


def do_mount(source, mountpoint, options, foreground):
    from . import daemon

    _check_mountpoint(mountpoint)
    # Resolved now, while nothing is mounted there: the daemon must never stat its own mount.
    config = parse(os.path.realpath(mountpoint), source, options)
    if foreground:
        _setup_logging(config.debug, True)
        daemon.run(config, on_ready=lambda: None)
        return 0
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _daemon_child(config, write_end)
    os.close(write_end)
    return _wait_ready(read_end, pid, config.mountpoint)


def _daemon_child(config, ready_fd):
    from . import daemon

    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    _setup_logging(config.debug, False)

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
    here = fusemount.is_mounted(mountpoint)
    dev = fusemount.device(mountpoint) if here else None
    elsewhere = fusemount.holders(mountpoint, dev)
    if not here and not elsewhere:
        raise UsageError(f"{mountpoint}: not an offloadfs mount")
    if force:
        fusemount.force_unmount(mountpoint, elsewhere)
        return 0
    if elsewhere:
        holders = ", ".join(f"pid {pid} {_comm(pid)}" for pid, _, _ in elsewhere[:3])
        what = "also mounted" if here else "not mounted here, but the daemon still serves it"
        raise UsageError(f"{mountpoint}: {what} in {len(elsewhere)} other mount namespace(s) ({holders}); "
                         f"'offloadfs umount --force {mountpoint}' ends it everywhere")
    try:
        fusemount.unmount(mountpoint, lazy=lazy)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise UsageError(f"{mountpoint}: busy (files open or a process inside); "
                             f"'offloadfs umount -l' detaches it now") from None
        raise UsageError(str(e)) from None
    return 0


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
            raise UsageError(f"{mountpoint}: not an offloadfs mount") from None
        raise UsageError(f"{mountpoint}: {e.strerror}") from None


def do_status(mountpoint, as_json):
    status = read_status(mountpoint)
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    c = status["counters"]
    print(f"{status['mountpoint']} (pid {status['pid']}, mounted {time.ctime(status['since'])})")
    for name, url in status["sources"].items():
        print(f"  source {name}: {url}")
    print(f"  copy requests: {c['copy_requests']}, errors: {c['copy_errors']}")
    for method, count in c["copies"].items():
        print(f"  {method:>17}: {count} copies, {c['copy_bytes'][method]} bytes")
    print(f"  read through FUSE: {c['fuse_read_bytes']} bytes, written: {c['fuse_write_bytes']} bytes")
    for cp in status["copies_in_flight"]:
        print(f"  in flight #{cp['id']}: {cp['method']} {cp['bytes_done']}/{cp['bytes_total']} bytes "
              f"{cp['source']} -> {cp['destination']}")
    return 0


def _parser():
    p = argparse.ArgumentParser(prog="offloadfs", description="FUSE filesystem with server-side copies")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount SOURCE (a path or URL) on MOUNTPOINT")
    m.add_argument("args", nargs="+", metavar="[SOURCE] MOUNTPOINT")
    m.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]")
    m.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    u = sub.add_parser("umount", help="unmount MOUNTPOINT")
    u.add_argument("mountpoint")
    u.add_argument("-l", "--lazy", action="store_true", help="detach now, clean up when no longer busy")
    u.add_argument("--force", action="store_true",
                   help="end the daemon, even if busy or other mount namespaces hold the mount")
    s = sub.add_parser("status", help="copies in flight and counters of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.command == "mount":
            if len(args.args) > 2:
                raise UsageError("mount takes [SOURCE] MOUNTPOINT")
            source = args.args[0] if len(args.args) == 2 else None
            return do_mount(source, args.args[-1], args.options, args.foreground)
        if args.command == "umount":
            return do_umount(args.mountpoint, args.lazy, args.force)
        return do_status(args.mountpoint, args.json)
    except (UsageError, OptionError, SourceError, fusemount.MountError, OSError) as e:
        return _fail(_describe(e))
    except KeyboardInterrupt:
        return 130


def mount_helper_main(argv=None):
    """mount(8) calls: mount.offloadfs SOURCE MOUNTPOINT [-sfnv] [-N ns] [-o OPTS] [-t TYPE]."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="mount.offloadfs")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[])
    for flag in ("-s", "-f", "-n", "-v"):
        p.add_argument(flag, action="store_true")
    p.add_argument("-t", dest="type")
    p.add_argument("-N", dest="namespace")
    args = p.parse_args(argv)
    # fstab needs a first field; with source=/config= options it is only a label.
    source = None if args.source in ("offloadfs", "none") else args.source
    return main(["mount", *([source] if source else []), args.mountpoint,
                 *[x for o in args.options for x in ("-o", o)]])
