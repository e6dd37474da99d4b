"""A private Samba Active Directory domain controller: a Kerberos realm and its file server, for the SMB
Kerberos tests.

`samba-tool domain provision` makes the domain (no DNS: the lab's krb5.conf
names the KDC's address outright); the `samba` daemon then runs the KDC and
smbd in a lab namespace, with one share per backing filesystem kind on a
fresh loop filesystem.  Provisioning takes seconds of CPU, so the provisioned
tree (domain, lab user and its keytab) is made once per machine under CACHE
and copied for each DC: the tree holds no address, and each copy gets an
smb.conf of its own.  The server's address changes per namespace and the
client asks for a ticket to cifs/ADDRESS (the host as given in the URL), so
each DC adds that name to its machine account at start.

For the NFS Kerberos tests, nfs_kerberos_lab() puts an nfs-ganesha beside
the DC in its namespace, with the keys of nfs/ADDRESS (a second name of the
DC's machine account) in a keytab of its own: ganesha accepts RPCSEC_GSS
contexts with libgssapi_krb5 and that keytab alone (no gssproxy, no
rpc.svcgssd, no KDC traffic of its own).

Clients use the lab's own krb5.conf (KRB5_CONFIG) and credential caches in
temporary files (KRB5CCNAME), made by `kinit` with a lifetime the test picks:
the KDC's own settings (``kdc:user ticket lifetime``) count in whole hours.

A DC for multiuser mounts (``multiuser=True``) has two more domain users,
MULTIUSER_USERS, made in its own copy at start, and shares without `force
user`: each session then acts as its own user on the server (winbindd maps
the user to a unix id), and the server checks each user's rights.  They keep
durable handles, which a reconnect must take back in the session of their user.
"""
import contextlib
import fcntl
import ipaddress
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from offloadfs.lab import Lab
from offloadfs.lab.loopfs import loop_filesystem, run
from offloadfs.lab.net import server_namespace
from offloadfs.lab.samba import DURABLE, Samba, SambaServer

REALM = "LAB.OFFLOADFS.TEST"
DOMAIN = "LAB"
DC_NAME = "dc"
USER = "labuser"
PASSWORD = "Lab-User-Pass1"
STALE_USER = "staleuser"
MULTIUSER_USERS = ("alice", "bob")  # domain users of a multiuser DC, with PASSWORD
ADMIN_PASSWORD = "Lab-Admin-Pass1"
CACHE = Path("/var/cache/offloadfs-lab")
# smbd asks winbindd for the unix ids of domain users at the socket path compiled into libwbclient
# (/run/samba/winbindd; neither smb.conf nor the environment moves it): one DC per machine at a time.
ONE_AT_A_TIME = "/run/lock/offloadfs-addc.lock"
_HELD = []  # the DCs this process runs (domain_controller): at most one
KDC_PORT = 88
SMB_PORT = 445

# Services the tests need: the KDC, the file server (s3fs), and winbindd, through which smbd maps
# domain users to unix ids; the rest (DNS, LDAP, replication, ...) would only cost start-up time.
GLOBAL = """\
[global]
netbios name = {dc}
workgroup = {domain}
realm = {realm}
server role = active directory domain controller
server services = s3fs, rpc, kdc, winbindd
interfaces = {host} {alias}
bind interfaces only = yes
disable netbios = yes
private dir = {dir}/private
lock directory = {dir}
state directory = {dir}/state
cache directory = {dir}/cache
binddns dir = {dir}/bind-dns
pid directory = {dir}/run
ncalrpc dir = {dir}/run/ncalrpc
log file = {dir}/smbd.log
max log size = 0
idmap_ldb:use rfc2307 = yes
load printers = no
printcap name = /dev/null
map archive = no
"""

SHARE = """
[{name}]
path = {path}
read only = no
{settings}vfs objects = {vfs}
"""


def samba_version():
    return run("samba", "--version").split()[-1]


def provisioned():
    """The cached provisioned tree (made on first use, under a lock: parallel runs share it)."""
    tree = CACHE / f"addc-{samba_version()}"
    if (tree / "done").exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "addc.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / "done").exists():
            return tree
        shutil.rmtree(tree, ignore_errors=True)
        run("samba-tool", "domain", "provision", f"--realm={REALM}", f"--domain={DOMAIN}", "--server-role=dc",
            "--dns-backend=NONE", "--use-rfc2307", f"--adminpass={ADMIN_PASSWORD}", f"--targetdir={tree}",
            f"--host-name={DC_NAME}", "--option=interfaces=127.0.0.1", "--option=bind interfaces only=yes")
        conf = f"--configfile={tree / 'etc/smb.conf'}"
        run("samba-tool", "user", "create", USER, PASSWORD, conf)
        run("samba-tool", "user", "setexpiry", USER, "--noexpiry", conf)
        run("samba-tool", "domain", "exportkeytab", str(tree / "user.keytab"), f"--principal={USER}@{REALM}", conf)
        # A keytab gone stale: its user's password changed after it was exported.
        run("samba-tool", "user", "create", STALE_USER, PASSWORD, conf)
        run("samba-tool", "domain", "exportkeytab", str(tree / "stale.keytab"), f"--principal={STALE_USER}@{REALM}",
            conf)
        run("samba-tool", "user", "setpassword", STALE_USER, f"--newpassword={PASSWORD}-changed", conf)
        (tree / "done").touch()
    return tree


@dataclass
class Share:
    name: str
    path: Path
    kind: str


class DomainController(SambaServer):
    """A running `samba` AD DC: KDC on port 88 and smbd on 445 of ``host``; stopped as an smbd is."""

    program = "samba"

    def __init__(self, shares, host, net, workdir):
        # The installed build, asking winbindd as it must: its own is the one that answers.
        super().__init__(shares, host, net, workdir, Samba(samba_version(), Path("/"), posix=False))
        self.realm = REALM
        self.username = USER
        self.password = PASSWORD
        self.principal = f"{USER}@{REALM}"
        self.keytab = workdir / "user.keytab"
        self.stale_keytab = workdir / "stale.keytab"
        self.stale_principal = f"{STALE_USER}@{REALM}"
        self.users = ()  # more domain users (MULTIUSER_USERS on a multiuser DC), with self.password
        self.alias = None  # a second address of the server, with no cifs/ service principal
        self.krb5_conf = workdir / "krb5.conf"
        self.nfs_keytab = workdir / "nfs.keytab"  # nfs/ADDRESS's keys, made by domain_controller(nfs_hosts=...)

    def command(self):
        return ["samba", "--foreground", "--no-process-group", "--model=single", "-s", str(self.conf)]

    def answers(self):
        """Both the KDC and smbd accept TCP connections."""
        for port in (KDC_PORT, SMB_PORT):
            try:
                socket.create_connection((self.host, port), timeout=0.2).close()
            except OSError:
                return False
        return True

    def environ(self, ccache):
        """The environment a client of this realm runs in, with its credentials in file ``ccache``."""
        return {**os.environ, "KRB5_CONFIG": str(self.krb5_conf), "KRB5CCNAME": f"FILE:{ccache}"}

    def kinit(self, ccache, lifetime=None, principal=None, password=None):
        """Get a TGT into file ``ccache``; ``lifetime``: kinit's -l (e.g. "30s"), else the KDC's default."""
        cmd = ["kinit", "-c", f"FILE:{ccache}"] + (["-l", lifetime] if lifetime else [])
        proc = subprocess.run([*cmd, principal or self.principal], input=f"{password or self.password}\n",
                              env=self.environ(ccache), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"kinit failed: {proc.stderr.strip()}")
        return ccache


def write_config(workdir, host, alias, shares, multiuser=False):
    text = GLOBAL.format(dc=DC_NAME.upper(), domain=DOMAIN, realm=REALM, host=host, alias=alias, dir=workdir)
    for share in shares.values():
        vfs = "dfs_samba4 acl_xattr" + (" btrfs" if share.kind == "btrfs" else "")
        settings = DURABLE if multiuser else "force user = root\n"
        text += SHARE.format(name=share.name, path=share.path, vfs=vfs, settings=settings)
    (workdir / "run").mkdir()
    (workdir / "smb.conf").write_text(text)
    (workdir / "krb5.conf").write_text(
        "[libdefaults]\n"
        f"  default_realm = {REALM}\n"
        "  dns_lookup_kdc = false\n  dns_lookup_realm = false\n"
        # The host as given (an address in the lab) is the service's name: no lookups to canonicalise it.
        "  rdns = false\n  dns_canonicalize_hostname = false\n"
        "[realms]\n"
        f"  {REALM} = {{\n    kdc = {host}\n  }}\n")


def add_alias(net):
    """A second address beside the server's (the last of its /24: the nfsd lab's guests take the first
    ones), for a client that names the server by something the KDC has no service principal for."""
    alias = str(ipaddress.ip_network(f"{net.server_addr}/24", strict=False)[-2])
    # The server's device: the link's end, or the bridge that took its address (nfsd lab).
    device = run("ip", "-n", net.name, "-o", "addr", "show", "to", net.server_addr).split()[1]
    run("ip", "-n", net.name, "addr", "add", f"{alias}/24", "dev", device)
    return alias


class SecondDomainController(Exception):
    """A DC asked for while this process runs one: it would wait on its own lock for ever."""


@contextlib.contextmanager
def domain_controller(shares, net, nfs_hosts=(), multiuser=False):
    """Yield a running DomainController in lab Namespace ``net`` exporting shares {name: (path, kind)};
    waits for one that another run holds to stop (see ONE_AT_A_TIME).  For each address in ``nfs_hosts``
    the machine account also gets nfs/ADDRESS, whose keys go to ``nfs_keytab`` for the NFS servers there.
    ``multiuser``: see the module.  SecondDomainController while this process runs one already (a test
    module's lab still up): the lock would make it wait for itself.  Not a RuntimeError, which labs that
    cannot start turn into a skip."""
    if _HELD:
        raise SecondDomainController(f"a Samba AD DC already runs in this process ({_HELD[0]}): one at a time")
    shares = {name: Share(name, Path(path), kind) for name, (path, kind) in shares.items()}
    tree = provisioned()
    with open(ONE_AT_A_TIME, "w") as lock, tempfile.TemporaryDirectory(prefix="offloadfs-addc-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        workdir = Path(tmp) / "dc"
        shutil.copytree(tree, workdir, symlinks=True)
        alias = add_alias(net)
        write_config(workdir, net.server_addr, alias, shares, multiuser)
        conf = f"--configfile={workdir / 'smb.conf'}"
        run("samba-tool", "spn", "add", f"cifs/{net.server_addr}", f"{DC_NAME.upper()}$", conf)
        users = MULTIUSER_USERS if multiuser else ()
        for user in users:
            run("samba-tool", "user", "create", user, PASSWORD, conf)
        server = DomainController(shares, net.server_addr, net, workdir)
        for host in nfs_hosts:
            nfs_principal = f"nfs/{host}"
            run("samba-tool", "spn", "add", nfs_principal, f"{DC_NAME.upper()}$", conf)
            run("samba-tool", "domain", "exportkeytab", str(server.nfs_keytab), f"--principal={nfs_principal}", conf)
        server.alias = alias
        server.users = users
        _HELD.append(net.server_addr)
        try:
            with server.running():
                yield server
        finally:
            _HELD.remove(net.server_addr)


@contextlib.contextmanager
def addc_lab(kinds=("btrfs", "xfs"), rate=None, multiuser=False):
    """Yield a Lab of one DC in its own namespace, with one share per kind on a fresh loop filesystem;
    ``multiuser``: see the module."""
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(server_namespace(rate))
        shares = {}
        for kind in kinds:
            root = stack.enter_context(loop_filesystem(kind))
            if multiuser:
                root.parent.chmod(0o711)  # each session's own unix id reaches the share (mkdtemp made it 0700)
            (root / "share").mkdir()
            shares[kind] = (root / "share", kind)
        yield Lab([stack.enter_context(domain_controller(shares, net, multiuser=multiuser))])


@contextlib.contextmanager
def nfs_kerberos_lab(rate=None, sectypes=("sys", "krb5", "krb5i", "krb5p")):
    """Yield a Lab of one nfs-ganesha taking Kerberos from a DC of the realm in the same namespace, exporting
    a directory on a fresh xfs loop filesystem with flavours ``sectypes``; ``lab.realm`` is the DC."""
    from offloadfs.lab.ganesha import ganesha_server  # the SMB-only labs need no ganesha

    with contextlib.ExitStack() as stack:
        net = stack.enter_context(server_namespace(rate))
        root = stack.enter_context(loop_filesystem("xfs"))
        (root / "export").mkdir()
        dc = stack.enter_context(domain_controller({}, net, nfs_hosts=[net.server_addr]))
        lab = Lab([stack.enter_context(ganesha_server(root / "export", net, realm=dc, sectypes=sectypes))])
        lab.realm = dc
        yield lab
