"""NFS servers from the labs as places for the mountpoint tests.

Two places: "nfs-ganesha" (nfs-ganesha 4.3, FSAL VFS on an xfs loop
filesystem of this host) and "nfsd" (Linux nfsd 6.1 in a qemu guest). Each
lab serves the whole session; a test gets a fresh directory in the export
and both ways to reach it: the nfs:// URL it mounts, and a view of the same
directory that does not go through the mount under test.

For ganesha the view is the exported directory itself. The nfsd guest's disk
is inside qemu and this host has no kernel NFS client, so its view is a
second, independent offloadfs mount of the export (its own daemon, its own
NFS client ID, no attribute or name caching): what the mount under test did
must show there, its kernel caches cannot hide anything. A program on the
server is run inside the guest instead (NfsdGuest.run, test_mp_guest_writer):
the directory is /export/NAME there, NAME the view's directory name.

The nfsd guest's xfs is made without reflink: a CLONE is refused (NOTSUPP)
and a COPY is a real copy of the bytes inside the guest, slow enough under
TCG to be watched in flight and cancelled. nfsd_lab has no option for this;
its module's MKFS is replaced for the boot.
"""

import contextlib
import shutil
import uuid
from pathlib import Path

import pytest

from offloadfs.lab import nfsd as nfsd_module
from offloadfs.lab.ganesha import ganesha_lab
from offloadfs.lab.loopfs import MKFS
from offloadfs.lab.mount import offloadfs_mount

PLACES = ("nfs-ganesha", "nfsd", "nfsd-reflink")

NO_POSIX_ACL = "NFSv4 has no POSIX ACLs or security labels as extended attributes"

# What a mount of each export cannot do, as the reason a test that needs it is skipped.
CANNOT = {
    "nfs-ganesha": {
        "xattr": "nfs-ganesha 4.3 (FSAL VFS) has no NFSv4.2 user extended attributes (GETXATTR: NOTSUPP)",
        "posix_acl": NO_POSIX_ACL,
    },
    "nfsd": {"posix_acl": NO_POSIX_ACL},
    "nfsd-reflink": {"posix_acl": NO_POSIX_ACL},
}

# NFSv4 times carry nanoseconds, and both servers store them on xfs.
TIME_STEP_NS = 1

# The view of nfsd's export: no caching, so every stat and read asks the server.
VIEW_OPTIONS = ["attr_timeout=0", "entry_timeout=0"]


def missing_tools():
    """Why the NFS labs cannot run here, or None."""
    for tool, package in (("ganesha.nfsd", "nfs-ganesha nfs-ganesha-vfs"), ("qemu-system-x86_64", "qemu-system-x86"),
                          ("mkfs.xfs", "xfsprogs")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    return None


class Place:
    """One server's export: fresh directories in it, and their view."""

    def __init__(self, url, view):
        self.url = url.rstrip("/")
        self.view = Path(view)

    def fresh_dir(self):
        """(URL, view path) of a new empty directory in the export."""
        name = f"t-{uuid.uuid4().hex[:10]}"
        path = self.view / name
        path.mkdir()
        return f"{self.url}/{name}", path


@contextlib.contextmanager
def ganesha_place():
    """A Place on a ganesha lab (own namespace, xfs); yields (Place, lab)."""
    with ganesha_lab() as lab:
        server = lab.server
        yield Place(f"nfs://{server.host}{server.export}", server.path), lab


@contextlib.contextmanager
def nfsd_without_reflink(**kw):
    """nfsd_lab(**kw) with its xfs image made with reflink off."""
    mkfs = {**MKFS, "xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=0"]}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nfsd_module, "MKFS", mkfs)
        lab = nfsd_module.nfsd_lab(**kw)
        running = lab.__enter__()
    try:
        yield running
    finally:
        lab.__exit__(None, None, None)


@contextlib.contextmanager
def nfsd_place(lab=None):
    """A Place on a one-guest nfsd lab, ``lab`` or one booted here with reflink off; yields (Place, lab)."""
    with contextlib.ExitStack() as stack:
        if lab is None:
            lab = stack.enter_context(nfsd_without_reflink())
        guest = lab.guest
        url = f"nfs://{guest.host}{guest.export}"
        with offloadfs_mount(url, options=VIEW_OPTIONS) as view:
            yield Place(url, view), lab
