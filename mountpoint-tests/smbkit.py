"""SMB shares from the Samba lab as places for the mountpoint tests.

One lab serves the whole session: two servers, each with a btrfs (vfs_btrfs),
an xfs and an ext4 share, and an ext4-durable share (Samba set to keep
durable handles across a lost connection) beside the ext4 one. A test gets a
fresh directory in a share and both ways to reach it: the smb:// URL it
mounts, and the server-side directory behind the share, where results are
checked without going through SMB.

A second lab, of one Samba 4.22 server (offloadfs.lab.samba.SAMBA_422) with a
btrfs and an xfs share, offers the SMB 3.1.1 POSIX extensions and directory
leases.

"ksmbd-xfs" is Linux's in-kernel SMB server (ksmbd, the kernel ksmbd.kernel() picks) sharing the xfs
disk (reflink on) of an nfsd guest (offloadfs.lab.nfsd): the server-side
directory there is that guest's NFS export, seen through nfskit's view.
"""

import contextlib
import json
import tempfile
import time
import uuid
from pathlib import Path

import nfskit

from offloadfs.lab.nfsd import ksmbd, nfsd_lab
from offloadfs.lab.samba import SAMBA_417, USER, samba_lab, write_credentials

KINDS = ("btrfs", "xfs", "ext4")

# What a mount of an SMB share cannot do (Samba 4.17 without unix
# extensions), as the reason a test that needs it is skipped.
CANNOT = {
    "symlink": "SMB without unix extensions has no symlinks",
    "mknod": "SMB without unix extensions has no device nodes or fifos",
    "chmod": "SMB keeps only the read-only bit of a mode (file_mode=/dir_mode= set the rest)",
    "chown": "SMB without unix extensions has no owners (chown is accepted and ignored)",
    "posix_acl": "SMB has no POSIX ACLs or security labels",
}

# What a mount of a share with SMB 3.1.1 POSIX extensions (Samba 4.22) cannot do: it has symlinks,
# special files, modes and owners, but the first two only as SMB clients see them (test_mp_smb_posix).
_REPARSE = ("Samba 4.22 keeps a POSIX client's {} as files with a reparse point: the server's own tools "
            "see regular files")
POSIX_CANNOT = {
    "symlink": _REPARSE.format("symlinks"),
    "mknod": _REPARSE.format("FIFOs and device nodes"),
    "setid": "Samba 4.22 sets no setuid, setgid or sticky bit from an SMB client",
    "posix_acl": CANNOT["posix_acl"],
}

# Places whose server raises a v2 lease's epoch at every open with its key, the state unchanged
# (ksmbd 6.12: epoch 1, 2, 3... for RH each time): to our mount the lease may have been broken and
# granted again in between, so each open drops the kernel's pages of the file and reads it again.
EPOCH_AT_EVERY_OPEN = {"ksmbd-xfs"}

# SMB timestamps count 100 ns steps.
TIME_STEP_NS = 100

# The SMB places' hosts ("HOST-SHARE", as mount_on takes them): the session fixture of the SmbLab that
# serves them, and which server of it.
HOSTS = {"smb": ("smb", 0), "smb2": ("smb", 1), "smb422": ("smb422", 0), "ksmbd": ("ksmbd", 0)}


def place(request, where):
    """(SmbLab, server index, share name) of the SMB place `where`, starting its lab if need be."""
    host, share = where.split("-", 1)
    fixture, server = HOSTS[host]
    return request.getfixturevalue(fixture), server, share


class SmbLab:
    """A running samba_lab and a credentials file for its user."""

    def __init__(self, lab, credentials):
        self.lab = lab
        self.credentials = credentials

    def options(self):
        """Mount options every mount of a lab share needs."""
        return [f"credentials={self.credentials}"]

    def url(self, kind, name="", server=0):
        """smb:// URL of directory `name` in share `kind` of lab server `server`."""
        s = self.lab.servers[server]
        return f"smb://{s.username}@{s.host}/{kind}/{name}".rstrip("/")

    def host(self, server=0):
        return self.lab.servers[server].host

    def fresh_dir(self, kind, server=0):
        """(URL, server-side path) of a new empty directory in share `kind`."""
        name = f"t-{uuid.uuid4().hex[:10]}"
        path = self.lab.servers[server].shares[kind].path / name
        path.mkdir()
        return self.url(kind, name, server), path

    def wait_closed(self, path, timeout=30):
        """Return once no lab server holds `path` (server side) open."""
        deadline = time.monotonic() + timeout
        while any(str(path) in self.open_files(s) for s in self.lab.servers):
            assert time.monotonic() < deadline, f"{path} still open on the server after {timeout} s"
            time.sleep(0.02)

    @staticmethod
    def open_files(server):
        """Server-side paths `server` has open, as smbstatus lists them."""
        out = server.run("smbstatus", "-s", server.conf, "-L", "-j", capture_output=True, text=True,
                         check=True).stdout
        return json.loads(out).get("open_files", {})


@contextlib.contextmanager
def smb_lab(servers=2, kinds=KINDS, rate=None, durable=("ext4",), samba=SAMBA_417):
    """Yield an SmbLab of Samba build `samba`; smbds, namespaces, loop
    filesystems and the credentials file are gone on exit."""
    with samba_lab(kinds, rate=rate, servers=servers, durable=durable, samba=samba) as lab, \
            tempfile.TemporaryDirectory() as tmp:
        credentials = lab.server.write_credentials(Path(tmp, "credentials"))
        yield SmbLab(lab, credentials)


class KsmbdLab:
    """The share "xfs" of ksmbd in an nfsd guest (`lab`, an NfsdLab); `view` is the nfskit.Place of
    the same export over NFS, where results are checked without going through ksmbd."""

    def __init__(self, lab, view, credentials):
        self.lab = lab
        self.view = view
        self.credentials = credentials

    options = SmbLab.options

    def host(self, server=0):
        return self.lab.guests[server].host

    def url(self, kind, name="", server=0):
        return f"smb://{USER}@{self.host(server)}/{kind}/{name}".rstrip("/")

    def fresh_dir(self, kind, server=0):
        """(URL, view path) of a new empty directory in share `kind`."""
        url, path = self.view.fresh_dir()
        return self.url(kind, path.name, server), path

    def wait_closed(self, path, timeout=30):
        """ksmbd 6.1 tells no one which files it holds open (no smbstatus, nothing in /proc or
        /sys): nothing to wait for."""


@contextlib.contextmanager
def ksmbd_lab():
    """Yield a KsmbdLab of one guest; the guest and the view are gone on exit."""
    with nfsd_lab(kernel=ksmbd.kernel(), ksmbd=True) as lab, nfskit.nfsd_place(lab) as (view, _), \
            tempfile.TemporaryDirectory() as tmp:
        yield KsmbdLab(lab, view, write_credentials(Path(tmp, "credentials")))
