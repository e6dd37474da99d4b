"""offloadfs on NFS servers that misbehave, and on a network that lies.

The lab's mutating proxy (offloadfs.lab.proxy) sits between the mount and
the session's nfs-ganesha and rewrites, stalls or cuts the server's replies.
NFS over AUTH_SYS has no integrity protection: a changed READ payload is
indistinguishable from the file's data, so these tests check only what the
protocol can tell (framing, XDR, statuses, listings) and that every failure
is one clear EIO within the mount's timeout, never a hang or a dead daemon.
"""

import os
import subprocess
import time

import pytest
from mpkit import sh

HANG_BOUND = 30  # seconds: anything slower is a hang


def as_user(*command):
    """Run a command as uid 1000 (gid 1000, supplementary group 2000)."""
    return subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--groups=2000", "--", *command],
                          capture_output=True, text=True, timeout=HANG_BOUND)


def test_touch_by_a_group_writer_sets_the_servers_time(mount_on):
    """touch sends UTIME_NOW: the server allows "set to server time" to anyone who may write
    (RFC 8881 time_how4), while an explicit time needs the owner."""
    mnt = mount_on("nfs-ganesha", options=["allow_other"])
    backing = mnt.backing / "shared"
    backing.write_bytes(b"x")
    os.chown(backing, 0, 2000)
    backing.chmod(0o664)
    os.utime(backing, ns=(10**18, 10**18))
    done = as_user("touch", mnt.path / "shared")
    assert done.returncode == 0, done.stderr
    assert abs(os.stat(backing).st_mtime - time.time()) < 600
    refused = as_user("touch", "-d", "2001-01-01", mnt.path / "shared")  # an explicit time: owner only
    assert refused.returncode != 0 and "not permitted" in refused.stderr, refused


@pytest.mark.parametrize("where", ["local-ext4", "smb-ext4", "nfs-ganesha"])
def test_touch_sets_the_current_time_everywhere(mount_on, where):
    """"Now" reaches every backend as a sentinel, and each sets its source's current time."""
    mnt = mount_on(where)
    (mnt.path / "f").write_bytes(b"x")
    os.utime(mnt.path / "f", ns=(10**18, 10**18))
    before = time.time()
    sh("touch", mnt.path / "f")
    st = os.stat(mnt.backing / "f")
    assert abs(st.st_mtime - before) < 600 and abs(st.st_atime - before) < 600, st
