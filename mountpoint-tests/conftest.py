"""Fixtures for tests that mount offloadfs for real and drive it with real tools.

Backing filesystems are loop images made once per session (making one per
test would dominate the runtime); each test gets its own fresh directory on
them and its own mounts, all removed after the test. The same goes for the
Samba lab: started on first use, shared by the session.

Tests that should hold wherever the files live take `mount_on(where)`, where
is "local-KIND" (a loop filesystem of that kind), "smb-KIND" (a Samba 4.17
share on one), "smb422-btrfs" or "smb422-xfs" (a Samba 4.22 share), "ksmbd-xfs"
(ksmbd's share, see smbkit), "nfs-ganesha" or "nfsd" (an NFS export, see nfskit).
"""

import os
import shutil
import uuid
from contextlib import ExitStack

import nfskit
import pytest
import smbkit
from mpkit import Mount

from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.samba import SAMBA_422


@pytest.fixture(autouse=True)
def _need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts and loop devices")


@pytest.fixture(scope="session")
def loopfs():
    """kind -> root of a loop filesystem, made on first use."""
    with ExitStack() as stack:
        roots = {}

        def get(kind):
            if kind not in roots:
                roots[kind] = stack.enter_context(loop_filesystem(kind))
            return roots[kind]

        yield get


@pytest.fixture
def backing(loopfs):
    """Factory: backing(kind) -> a new empty directory on that filesystem."""
    made = []

    def make(kind="ext4"):
        path = loopfs(kind) / f"t-{uuid.uuid4().hex[:10]}"
        path.mkdir()
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mount(backing):
    """Factory: mount(source or {name: source}, options) -> Mount.

    Depends on `backing` so mounts come down before their directories go.
    """
    with ExitStack() as stack:

        def make(source, options=()):
            path = stack.enter_context(offloadfs_mount(source, options=options))
            return Mount(path, source)

        yield make


@pytest.fixture
def mnt(mount, backing):
    """A default mount of a fresh directory on ext4."""
    return mount(backing("ext4"))


@pytest.fixture(scope="session")
def smb():
    """The session's SmbLab (two servers, a share per kind on each)."""
    if shutil.which("smbd") is None:
        pytest.skip("smbd is not installed (apt-get install samba samba-vfs-modules)")
    with smbkit.smb_lab() as lab:
        yield lab


@pytest.fixture(scope="session")
def smb422():
    """An SmbLab of one Samba 4.22 server (POSIX extensions and directory leases on), with a btrfs, an xfs
    and an xfs-durable share."""
    if not SAMBA_422.available:
        pytest.skip(f"Samba 4.22 is not unpacked at {SAMBA_422.root} (scripts/setup unpacks it from backports)")
    with smbkit.smb_lab(servers=1, kinds=("btrfs", "xfs"), durable=("xfs",), samba=SAMBA_422) as lab:
        yield lab


@pytest.fixture(scope="session")
def ksmbd():
    """A smbkit.KsmbdLab: ksmbd in an nfsd guest (durable handles on), its shares "xfs" (reflink on)
    and "tmpfs" (no NFS view: test_mp_smb reaches it through the guest's shell)."""
    why = nfskit.missing_tools()
    if why:
        pytest.skip(why)
    with smbkit.ksmbd_lab() as lab:
        yield lab


def _nfs_lab(start):
    why = nfskit.missing_tools()
    if why:
        pytest.skip(why)
    with start() as (place, lab):
        yield place, lab


@pytest.fixture(scope="session")
def ganesha():
    """(nfskit.Place, ganesha Lab) of the session's nfs-ganesha."""
    yield from _nfs_lab(nfskit.ganesha_place)


@pytest.fixture(scope="session")
def nfsd():
    """(nfskit.Place, NfsdLab) of the session's nfsd guest (xfs without reflink)."""
    yield from _nfs_lab(nfskit.nfsd_place)


@pytest.fixture(scope="session")
def nfsd_reflink(request):
    """(nfskit.Place, NfsdLab) of a second nfsd guest, whose xfs has reflink: copies are CLONEs.
    The guest is the root conftest's, which tests/test_nfs_nfsd uses too."""
    yield from _nfs_lab(lambda: nfskit.nfsd_place(request.getfixturevalue("nfsd_reflink_lab")))


FIXTURES = {"nfs-ganesha": "ganesha", "nfsd": "nfsd", "nfsd-reflink": "nfsd_reflink"}


@pytest.fixture
def mount_on(request, backing):
    """Factory: mount_on(where or {name: where}, options) -> Mount of fresh
    directories; mnt.backing is each as the machine holding it sees it.

    where is "local-KIND" (a loop filesystem of that kind), "smb-KIND" (the
    lab's share on one), "smb2-KIND" (the same on the lab's second server),
    "smb422-btrfs", "smb422-xfs" or "smb422-xfs-durable" (a share of the Samba 4.22 lab), "ksmbd-xfs",
    "nfs-ganesha", "nfsd" or "nfsd-reflink" (a directory in that server's
    export; its backing is the view nfskit describes).
    """
    with ExitStack() as stack:

        def place(where):
            """(source, backing path) of a fresh directory at `where`."""
            if where in nfskit.PLACES:
                place, _ = request.getfixturevalue(FIXTURES[where])
                url, path = place.fresh_dir()
                stack.callback(shutil.rmtree, path, ignore_errors=True)
                return url, path
            host, kind = where.split("-", 1)
            if host == "local":
                path = backing(kind)
                return str(path), path
            lab, server, share = smbkit.place(request, where)
            url, path = lab.fresh_dir(share, server=server)
            stack.callback(shutil.rmtree, path, ignore_errors=True)
            return url, path

        def make(where, options=()):
            if isinstance(where, str):
                source, path = place(where)
            else:
                made = {name: place(w) for name, w in where.items()}
                source = {name: src for name, (src, _) in made.items()}
                path = {name: p for name, (_, p) in made.items()}
            wheres = [where] if isinstance(where, str) else where.values()
            if isinstance(where, str) and where in nfskit.PLACES:
                mountpoint = stack.enter_context(offloadfs_mount(source, options=options))
                return Mount(mountpoint, path, nfskit.CANNOT[where], nfskit.TIME_STEP_NS)
            labs = []  # the SmbLabs serving the mount's places
            for w in wheres:
                if w.split("-")[0] in smbkit.HOSTS and (lab := smbkit.place(request, w)[0]) not in labs:
                    labs.append(lab)
            if not labs:
                return Mount(stack.enter_context(offloadfs_mount(source, options=options)), path)
            # Every lab has the same user and password: any one's credentials file serves.
            mountpoint = stack.enter_context(offloadfs_mount(source, options=[*options, *labs[0].options()]))

            def wait_closed(path):
                for lab in labs:
                    lab.wait_closed(path)

            cannot = smbkit.POSIX_CANNOT if {w.split("-")[0] for w in wheres} == {"smb422"} else smbkit.CANNOT
            return Mount(mountpoint, path, cannot, smbkit.TIME_STEP_NS, wait_closed)

        yield make
