"""Private nfs-ganesha servers for the NFS backend tests.

Each server is a foreground `ganesha.nfsd` with its own config, log, pid file
and recovery directory in a temporary directory, bound only to the address it
is given (a lab namespace's, or 127.0.0.1), so it never meets the machine's
own NFS setup. It speaks NFSv4.1 and 4.2 only (no rpcbind, NLM, RQUOTA or
UDP) and skips the grace period, so it serves ~30 ms after start. It needs
no dbus or rpcbind: without them it logs a few CRIT/MAJ lines ("dbus_bus_get
failed", "Cannot register NFS V4 on TCP") and carries on. The default log
level (NIV_EVENT) is kept, so no -N.

ganesha_lab() bundles the usual set-up: one namespace per server, each
exporting a directory on a fresh xfs loop filesystem as /export.
"""

import contextlib
import os
import signal
import socket
import struct
import subprocess
import tempfile
from pathlib import Path

from offloadfs.lab import Lab
from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.net import server_namespace
from offloadfs.lab.server import ServerProcess

PORT = 2049
EXPORT = "/export"
DOMAIN = "localdomain"
STOP_TIMEOUT = 5
# Otherwise every start looks for a keytab and logs its absence.
NO_KRB5 = "NFS_KRB5 {\n    Active_krb5 = false;\n}"
# The acceptor's name as a host-based service: nfs@ADDRESS is nfs/ADDRESS in the keytab (the lab's
# krb5.conf turns off canonicalisation).
KRB5 = """\
NFS_KRB5 {{
    Active_krb5 = true;
    KeytabPath = {keytab};
    PrincipalName = "nfs@{host}";
}}"""
# Principals become local users through libnfsidmap's static table, as idmapd.conf gives it.
IDMAP = "[General]\nDomain = {domain}\n"
IDMAP_KRB5 = "[Translation]\nGSS-Methods = static\n[Static]\n{principal} = root\n"
NFS_PROGRAM = 100003

CONFIG = """\
NFS_CORE_PARAM {{
    Protocols = 4;
    Bind_Addr = {host};
    NFS_Port = {port};
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}}
NFSV4 {{
    Minor_Versions = 1, 2;
    {grace}
    RecoveryBackend = fs;
    RecoveryRoot = {dir}/recovery;
    # Owners go out as name@localdomain whatever the host's DNS domain, which
    # libnfsidmap would use otherwise: tests rewrite those names in replies.
    IdmapConf = {dir}/idmapd.conf;
}}
{krb5}
EXPORT {{
    Export_Id = 1;
    Path = {path};
    Pseudo = {export};
    Access_Type = RW;
    Squash = {squash};
    Protocols = 4;
    Transports = TCP;
    SecType = {sectype};
    # Tests change files behind the server's back; never serve stale attributes.
    Attr_Expiration_Time = 0;
    FSAL {{
        Name = VFS;
    }}
}}
"""


def nfs_null(host, port=PORT, timeout=1.0):
    """True if an NFSv4 NULL call over TCP gets an accepted, successful reply.

    Accepting TCP alone proves little: a server may listen before its RPC
    service is registered, and a qemu guest's port can look open early.
    """
    xid = int.from_bytes(os.urandom(4), "big")
    # xid, CALL, RPC version 2, program, version 4, procedure 0, AUTH_NONE cred and verifier.
    call = struct.pack(">10I", xid, 0, 2, NFS_PROGRAM, 4, 0, 0, 0, 0, 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">I", 0x80000000 | len(call)) + call)
            reply = b""
            while len(reply) < 4 + 24:
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    # record mark, xid, REPLY, MSG_ACCEPTED, verifier flavor, verifier length, SUCCESS
    _, rxid, kind, stat, _, vlen, accept = struct.unpack(">7I", reply[:28])
    return (rxid, kind, stat, vlen, accept) == (xid, 1, 0, 0, 0)


class GaneshaServer(ServerProcess):
    """A running ganesha.nfsd exporting `path` (server side) as `export`."""

    program = "ganesha.nfsd"

    def __init__(self, path, host, port, net, workdir):
        super().__init__(host, port, net, workdir, "ganesha.conf", "ganesha.log")
        self.path = path
        self.export = EXPORT

    def command(self):
        return ["ganesha.nfsd", "-F", "-L", str(self.log), "-f", str(self.conf), "-p", str(self.workdir / "pid")]

    def answers(self):
        return nfs_null(self.host, self.port, timeout=0.2)

    def signal(self, sig):
        """Send sig and wait for the process to end; False if it did not in time."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(sig)
        try:
            self.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self):
        """SIGTERM (a clean shutdown), SIGKILL if it takes too long."""
        if self.process is None:
            return
        if not self.signal(signal.SIGTERM):
            self.signal(signal.SIGKILL)
        self.process = None

    def kill(self):
        """SIGKILL: a server crash. Client state survives only in the recovery directory."""
        if self.process is not None:
            self.signal(signal.SIGKILL)
            self.process = None



@contextlib.contextmanager
def ganesha_server(path, net=None, port=PORT, root_squash=False, grace=None, realm=None, sectypes=("sys",)):
    """Yield a running GaneshaServer exporting directory `path` as /export.

    With a lab Namespace `net` ganesha runs inside it and binds its server
    address; without, it binds 127.0.0.1. With `root_squash` root's requests
    become nobody's, as on most real exports. Without `grace` (seconds) a
    restarted server has no grace period: clients cannot reclaim, nor wait.
    With `realm` (an addc.DomainController made with nfs_hosts=[its address], in
    the same namespace) ganesha takes Kerberos with its nfs/ keys, and the realm's user
    is root on the export; `sectypes` are the flavours the export takes.
    The process is gone on exit.
    """
    host = net.server_addr if net else "127.0.0.1"
    with tempfile.TemporaryDirectory(prefix="offloadfs-ganesha-") as tmp:
        workdir = Path(tmp)
        (workdir / "recovery").mkdir()
        idmap = IDMAP.format(domain=DOMAIN)
        krb5 = NO_KRB5
        if realm is not None:
            idmap += IDMAP_KRB5.format(principal=realm.principal)
            krb5 = KRB5.format(keytab=realm.nfs_keytab, host=host)
        (workdir / "idmapd.conf").write_text(idmap)
        (workdir / "ganesha.conf").write_text(CONFIG.format(
            host=host, port=port, dir=workdir, path=path, export=EXPORT, krb5=krb5, sectype=", ".join(sectypes),
            squash="Root_Squash" if root_squash else "No_Root_Squash",
            grace="Graceless = true;" if grace is None else
                  f"Graceless = false; Grace_Period = {grace}; Lease_Lifetime = {grace};"))
        server = GaneshaServer(Path(path), host, port, net, workdir)
        if realm is not None:
            server.env = {**os.environ, "KRB5_CONFIG": str(realm.krb5_conf)}
        with server.running():
            yield server


@contextlib.contextmanager
def ganesha_lab(rate=None, servers=1, kind="xfs", root_squash=False, grace=None):
    """Yield a Lab of `servers` ganeshas, each in its own namespace (link
    shaped to `rate` if given: one rate or a (down, up) pair, as for
    net.server_namespace) exporting a directory on a fresh `kind` loop
    filesystem; `root_squash` and `grace` as for ganesha_server."""
    with contextlib.ExitStack() as stack:
        started = []
        for _ in range(servers):
            net = stack.enter_context(server_namespace(rate))
            root = stack.enter_context(loop_filesystem(kind))
            (root / "export").mkdir()
            started.append(stack.enter_context(ganesha_server(root / "export", net, root_squash=root_squash, grace=grace)))
        yield Lab(started)
