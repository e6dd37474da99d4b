"""Private Samba servers for the SMB backend tests.

Each server is an `smbd --foreground` with its own smb.conf and state in a
temporary directory, so it never touches the machine's Samba setup, and binds
only the address it is given (a lab namespace's, or 127.0.0.1). Every share
needs the lab user's password; files are created as root (`force user`) so a
root-run test suite can inspect and prepare them directly on the server side.

samba_lab() bundles the usual set-up: one namespace per server, one share
per backing filesystem kind on a fresh loop filesystem, named after the kind,
and for the kinds asked a second, durable share on the same filesystem
(named KIND-durable; see DURABLE).

A server runs one of two Samba builds (see Samba): Debian 12's installed
4.17, or 4.22 from bookworm-backports, which scripts/setup unpacks under
/var/cache (never installed over 4.17) and whose shares offer the SMB 3.1.1
POSIX extensions and directory leases.
"""

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from offloadfs.lab import Lab
from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.net import server_namespace
from offloadfs.lab.server import ServerProcess

USER = "offloadfs-lab"
PASSWORD = "offloadfs-lab-password"
PORT = 445
STOP_TIMEOUT = 5
# Where scripts/setup unpacks Samba 4.22 from bookworm-backports (dpkg -x of its packages), beside the
# installed 4.17: machine-wide like the nfsd guest's cache, so every checkout on the machine finds it.
SAMBA_422_ROOT = Path("/var/cache/offloadfs-lab/samba-4.22")

GLOBAL = """\
[global]
server role = standalone server
interfaces = {host}
bind interfaces only = yes
smb ports = {port}
disable netbios = yes
server min protocol = SMB2_10
map to guest = never
# Otherwise new files get the owner's x bit (the DOS archive attribute).
map archive = no
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

# What a 4.22 server adds to [global]: directory leases (a global parameter; its default, auto, means on
# without clustering; they need smb2 leases, oplocks and no kernel oplocks, the defaults, and imply strict
# rename) and the SMB 3.1.1 POSIX extensions, for every share.  Without `mangled names = no` smbd lists
# names Windows cannot hold (a:b, what?) as 8.3 names, to POSIX clients too.
POSIX_GLOBAL = """\
smb3 directory leases = yes
smb3 unix extensions = yes
mangled names = no
"""

SHARE = """
[{name}]
path = {path}
read only = no
guest ok = no
valid users = {user}
force user = root
"""

# What Samba needs before a handle it granted as durable outlives its connection (smb.conf(5) "durable
# handles"); the defaults keep posix locking on, so other shares grant durable handles and then close them.
DURABLE = """\
kernel oplocks = no
kernel share modes = no
posix locking = no
"""


# Paths compiled into Samba builds: their modules (vfs, pdb, auth...), the helpers smbd starts
# (samba-dcerpcd when a client opens an RPC pipe, and the rpcd_* it starts in turn), and where smbd looks
# for winbindd's socket (smb.conf and WINBINDD_SOCKET_DIR do not move it).
MODULES_DIR = "/usr/lib/x86_64-linux-gnu/samba"
LIBEXEC_DIR = "/usr/libexec/samba"
RUN_DIR = "/run/samba"
# `sh -c MOUNTS RUN_DIR [SOURCE TARGET]... -- PROGRAM ARGS`, in a mount namespace of its own (unshare(1);
# mounts made outside still reach it): a tmpfs over RUN_DIR, each SOURCE bind-mounted over its TARGET,
# then the program.
MOUNTS = """[ ! -d "$0" ] || mount -t tmpfs none "$0" || exit
while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit; shift 2; done
shift; exec "$@"
"""


def write_credentials(path, username=USER, password=PASSWORD):
    """A mount.cifs-style credentials file, readable by root only; returns path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w") as f:
        f.write(f"username={username}\npassword={password}\n")
    return path


@dataclass(frozen=True)
class Samba:
    """One Samba build: how to run its programs (smbd, smbpasswd, smbstatus,
    testparm, smbclient) from where it lies.

    Every program runs with an empty RUN_DIR: no winbindd runs for the lab,
    but another Samba on the machine (a lab's AD DC) may run one there, and
    smbd would take its mapping of our user's SID to a uid unknown here,
    failing every logon (NT_STATUS_LOGON_FAILURE). Our smbds keep their own
    state in their own directories (GLOBAL).

    An unpacked build also runs with its libraries first on LD_LIBRARY_PATH,
    and with its own modules and helpers mounted over the installed build's:
    their paths are compiled in, so the installed 4.17's vfs_btrfs or
    samba-dcerpcd would be loaded and fail on 4.22's libraries.
    """

    version: str
    # "/" for the installed build, else the directory its packages were unpacked into.
    root: Path
    # Whether its shares offer the SMB 3.1.1 POSIX extensions and directory leases (POSIX_GLOBAL).
    posix: bool

    @property
    def installed(self):
        return self.root == Path("/")

    @property
    def available(self):
        return shutil.which("smbd") is not None if self.installed else (self.root / "usr/sbin/smbd").exists()

    def command(self, name, *args):
        """argv running its program `name` with `args`."""
        program, mounts = name, []
        if not self.installed:
            program = next(self.root / d / name for d in ("usr/sbin", "usr/bin") if (self.root / d / name).exists())
            mounts = [self.root / MODULES_DIR.lstrip("/"), MODULES_DIR,
                      self.root / LIBEXEC_DIR.lstrip("/"), LIBEXEC_DIR]
        return ["unshare", "--mount", "--propagation", "slave", "sh", "-c", MOUNTS, RUN_DIR, *mounts, "--", program, *args]

    @property
    def env(self):
        """The environment its programs run with."""
        env = dict(os.environ)
        if not self.installed:
            env["LD_LIBRARY_PATH"] = str(self.root / "usr/lib/x86_64-linux-gnu")
        return env


SAMBA_417 = Samba("4.17", Path("/"), posix=False)
SAMBA_422 = Samba("4.22", SAMBA_422_ROOT, posix=True)


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


def proc_stats():
    """{pid: (state, ppid)} of every process."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (fields[0], int(fields[1]))
    return stats


def server_pids(pid, conf):
    """smbd `pid`, its descendants, and helpers started for `conf`.

    samba-dcerpcd (started when a client opens an RPC pipe) detaches from
    smbd, so it is found by the config path on its command line.
    """
    stats = proc_stats()
    found = {pid}
    for other in stats:
        with contextlib.suppress(OSError):
            if conf.encode() in Path(f"/proc/{other}/cmdline").read_bytes():
                found.add(other)
    grew = True
    while grew:
        kids = {p for p, (_, ppid) in stats.items() if ppid in found} - found
        found |= kids
        grew = bool(kids)
    return found


def signal_all(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids, timeout):
    """Wait until none of pids is alive; True if they all went in time.

    Zombies count as gone: init here reaps orphans only every ~2 s, and a
    zombie holds no sockets or files any more.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = proc_stats()
        if all(stats.get(pid, ("Z",))[0] == "Z" for pid in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


@dataclass
class Share:
    name: str
    path: Path
    kind: str
    durable: bool = False


class SambaServer(ServerProcess):
    """A running smbd; `shares` maps share name -> Share (server-side path)."""

    program = "smbd"

    def __init__(self, shares, host, net, workdir, samba):
        super().__init__(host, PORT, net, workdir, "smb.conf", "smbd.log")
        self.shares = shares
        self.samba = samba
        self.env = samba.env
        self.username = USER
        self.password = PASSWORD

    def run(self, name, *args, **kwargs):
        """subprocess.run of its Samba's program `name` (smbpasswd, smbstatus, testparm...)."""
        return subprocess.run(self.samba.command(name, *args), env=self.env, **kwargs)

    def unc(self, share):
        """The share's \\\\host\\share path for SMB clients."""
        return f"\\\\{self.host}\\{share}"

    def write_credentials(self, path):
        """A mount.cifs-style credentials file for the lab user, readable by root only; returns path."""
        return write_credentials(path, self.username, self.password)

    def command(self):
        return self.samba.command("smbd", "--foreground", "--no-process-group", "-s", str(self.conf))

    def answers(self):
        """smbd accepts TCP connections, from the client side."""
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
            return True
        return False

    def stop(self):
        """SIGTERM every smbd process, SIGKILL whatever is left after a while."""
        if self.process is None:
            return
        pids = server_pids(self.process.pid, str(self.conf))
        signal_all(pids, signal.SIGTERM)
        if not wait_gone(pids, STOP_TIMEOUT):
            signal_all(pids, signal.SIGKILL)
            wait_gone(pids, STOP_TIMEOUT)
        self.process.wait()
        self.process = None

    def kill(self):
        """SIGKILL smbd and every connection process: a server crash."""
        pids = server_pids(self.process.pid, str(self.conf))
        signal_all(pids, signal.SIGKILL)
        wait_gone(pids, STOP_TIMEOUT)
        self.process.wait()
        self.process = None



def write_config(workdir, host, shares, samba):
    for sub in ("private", "lock", "state", "cache", "pid", "ncalrpc"):
        (workdir / sub).mkdir()
    text = GLOBAL.format(host=host, port=PORT, dir=workdir)
    if samba.posix:
        text += POSIX_GLOBAL
    for share in shares.values():
        text += SHARE.format(name=share.name, path=share.path, user=USER)
        if share.kind == "btrfs":
            # Lets FSCTL_DUPLICATE_EXTENTS and copychunk clone on btrfs.
            text += "vfs objects = btrfs\n"
        if share.durable:
            text += DURABLE

    (workdir / "smb.conf").write_text(text)


@contextlib.contextmanager
def smb_server(shares, net=None, samba=SAMBA_417):
    """Yield a running SambaServer of build `samba` exporting shares {name: (path, kind[, durable])}.

    With a lab Namespace `net` smbd runs inside it and binds its server
    address; without, it binds 127.0.0.1. kind is the backing filesystem
    ("btrfs", "xfs", "ext4", ...); durable: the share keeps durable handles
    across a lost connection. smbd and all its children are gone on exit.
    """
    shares = {name: Share(name, Path(path), *rest) for name, (path, *rest) in shares.items()}
    host = net.server_addr if net else "127.0.0.1"
    with tempfile.TemporaryDirectory(prefix="offloadfs-samba-") as tmp:
        workdir = Path(tmp)
        write_config(workdir, host, shares, samba)
        ensure_user()
        server = SambaServer(shares, host, net, workdir, samba)
        proc = server.run("smbpasswd", "-c", str(server.conf), "-s", "-a", USER,
                          input=f"{PASSWORD}\n{PASSWORD}\n", capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"smbpasswd failed: {proc.stdout}{proc.stderr}")
        with server.running():
            yield server


@contextlib.contextmanager
def samba_lab(kinds=("btrfs", "xfs", "ext4"), rate=None, servers=1, durable=(), samba=SAMBA_417):
    """Yield a Lab of `servers` smbds of build `samba`, each in its own namespace (link shaped
    to `rate` if given: one rate or a (down, up) pair, as for
    net.server_namespace) with one share per kind on a fresh loop filesystem,
    and a KIND-durable share beside it for each kind in `durable`."""
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
                if kind in durable:
                    (root / "durable").mkdir()
                    shares[f"{kind}-durable"] = (root / "durable", kind, True)
            started.append(stack.enter_context(smb_server(shares, net, samba)))
        yield Lab(started)
