"""Private Samba servers for the SMB backend tests.

Each server is an `smbd --foreground` with its own smb.conf and state in a
temporary directory, so it never touches the machine's Samba setup, and binds
only the address it is given (a lab namespace's, or 127.0.0.1). Every share
needs the lab user's password; files are created as root (`force user`) so a
root-run test suite can inspect and prepare them directly on the server side.

samba_lab() bundles the usual set-up: one namespace per server, one share
per backing filesystem kind on a fresh loop filesystem, named after the kind.
"""

import contextlib
import os
import pwd
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from offloadfs.lab.loopfs import loop_filesystem, run
from offloadfs.lab.net import server_namespace

USER = "offloadfs-lab"
PASSWORD = "offloadfs-lab-password"
PORT = 445
START_TIMEOUT = 10
STOP_TIMEOUT = 5

GLOBAL = """\
[global]
server role = standalone server
interfaces = {host}
bind interfaces only = yes
smb ports = {port}
disable netbios = yes
server min protocol = SMB2_10
map to guest = never
load printers = no
printing = bsd
printcap name = /dev/null
disable spoolss = yes
passdb backend = tdbsam:{dir}/private/passdb.tdb
private dir = {dir}/private
lock directory = {dir}/lock
state directory = {dir}/state
cache directory = {dir}/cache
pid directory = {dir}/pid
ncalrpc dir = {dir}/ncalrpc
log file = {dir}/smbd.log
max log size = 0
"""

SHARE = """
[{name}]
path = {path}
read only = no
guest ok = no
valid users = {user}
force user = root
"""


def ensure_user():
    """Create the unix account Samba maps the lab user to, once per machine."""
    try:
        pwd.getpwnam(USER)
    except KeyError:
        proc = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            capture_output=True, text=True,
        )
        # A parallel run may have created it first.
        if proc.returncode != 0:
            pwd.getpwnam(USER)


def children(pid):
    """All descendants of pid (smbd forks one process per connection)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (entry / "stat").read_text()
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def signal_all(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids, timeout):
    """Wait until none of pids exists; True if they all went in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.01)
    return False


@dataclass
class Share:
    name: str
    path: Path
    kind: str


class SambaServer:
    """A running smbd; `shares` maps share name -> Share (server-side path)."""

    def __init__(self, shares, host, net, workdir):
        self.shares = shares
        self.host = host
        self.port = PORT
        self.net = net
        self.username = USER
        self.password = PASSWORD
        self.workdir = workdir
        self.conf = workdir / "smb.conf"
        self.log = workdir / "smbd.log"
        self.process = None

    def unc(self, share, path=""):
        """\\\\host\\share[\\path] for SMB clients."""
        return "\\\\" + "\\".join(p for p in (self.host, share, path.replace("/", "\\")) if p)

    def start(self):
        cmd = ["smbd", "--foreground", "--no-process-group", "-s", str(self.conf)]
        out = open(self.workdir / "smbd.out", "ab")
        with out:
            if self.net:
                self.process = self.net.popen(*cmd, stdout=out, stderr=out)
            else:
                self.process = subprocess.Popen(cmd, stdout=out, stderr=out)
        self.wait_ready()

    def wait_ready(self):
        """Return once smbd accepts TCP connections, from the client side."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.fail(f"smbd exited with {self.process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return
            time.sleep(0.01)
        self.fail(f"smbd not accepting on {self.host}:{self.port} after {START_TIMEOUT} s")

    def fail(self, why):
        self.stop()
        tail = "".join(
            path.read_text(errors="replace")[-3000:] for path in (self.workdir / "smbd.out", self.log) if path.exists()
        )
        raise RuntimeError(f"{why}; {self.workdir}:\n{tail}")

    def stop(self):
        """SIGTERM smbd (its children follow), SIGKILL whatever is left."""
        if self.process is None:
            return
        pids = [self.process.pid, *children(self.process.pid)]
        self.process.terminate()
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        if not wait_gone(pids, STOP_TIMEOUT):
            signal_all(pids, signal.SIGKILL)
            wait_gone(pids, STOP_TIMEOUT)
        self.process.wait()
        self.process = None

    def kill(self):
        """SIGKILL smbd and every connection process: a server crash."""
        pids = [self.process.pid, *children(self.process.pid)]
        signal_all(pids, signal.SIGKILL)
        self.process.wait()
        wait_gone(pids, STOP_TIMEOUT)
        self.process = None

    def restart(self):
        """Start again (after kill() or while running), same config and passwords."""
        self.stop()
        self.start()


def write_config(workdir, host, shares):
    for sub in ("private", "lock", "state", "cache", "pid", "ncalrpc"):
        (workdir / sub).mkdir()
    text = GLOBAL.format(host=host, port=PORT, dir=workdir)
    for share in shares.values():
        text += SHARE.format(name=share.name, path=share.path, user=USER)
        if share.kind == "btrfs":
            # Lets FSCTL_DUPLICATE_EXTENTS and copychunk clone on btrfs.
            text += "vfs objects = btrfs\n"
    (workdir / "smb.conf").write_text(text)


@contextlib.contextmanager
def smb_server(shares, net=None):
    """Yield a running SambaServer exporting shares {name: (path, kind)}.

    With a lab Namespace `net` smbd runs inside it and binds its server
    address; without, it binds 127.0.0.1. kind is the backing filesystem
    ("btrfs", "xfs", "ext4", ...). smbd and all its children are gone on exit.
    """
    shares = {name: Share(name, Path(path), kind) for name, (path, kind) in shares.items()}
    host = net.server_addr if net else "127.0.0.1"
    with tempfile.TemporaryDirectory(prefix="offloadfs-samba-") as tmp:
        workdir = Path(tmp)
        write_config(workdir, host, shares)
        ensure_user()
        proc = subprocess.run(
            ["smbpasswd", "-c", str(workdir / "smb.conf"), "-s", "-a", USER],
            input=f"{PASSWORD}\n{PASSWORD}\n", capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"smbpasswd failed: {proc.stdout}{proc.stderr}")
        server = SambaServer(shares, host, net, workdir)
        try:
            server.start()
            yield server
        finally:
            server.stop()


@dataclass
class Lab:
    """Servers of a samba_lab; `server` is the first."""

    servers: list

    @property
    def server(self):
        return self.servers[0]


@contextlib.contextmanager
def samba_lab(kinds=("btrfs", "xfs", "ext4"), rate=None, servers=1):
    """Yield a Lab of `servers` smbds, each in its own namespace (link shaped
    to `rate` if given) with one share per kind on a fresh loop filesystem."""
    with contextlib.ExitStack() as stack:
        started = []
        for _ in range(servers):
            net = stack.enter_context(server_namespace(rate))
            shares = {}
            for kind in kinds:
                root = stack.enter_context(loop_filesystem(kind))
                # A subdirectory keeps lost+found out of the share.
                (root / "share").mkdir()
                shares[kind] = (root / "share", kind)
            started.append(stack.enter_context(smb_server(shares, net)))
        yield Lab(started)
