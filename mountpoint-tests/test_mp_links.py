"""Link counts and change times of hard links, as a directory listing hands them out.

A listing (READDIRPLUS on NFS, QUERY_DIRECTORY on SMB) brings every entry's
attributes, which answer the next lookups and stats for attr_timeout.  Two
ways that went wrong:

- NFS: the mount removed one name of a hard link (unlink, or a rename over
  it), or changed the file otherwise; the other name then still showed the
  listing's link count and ctime from before, once the kernel had forgotten
  the file (memory pressure, here drop_caches): the mount knew of its change
  only while the file was known.
- SMB: a listing carries no link count; the 1 it was given replaced the 2
  the mount knew.

Each case checks the mount against a second client of the same export or
share (another mount, or the server's own view), and the link count exactly.
The mounts keep attributes for 30 s, so that the listing is still fresh when
it is tested, however slow the server: nothing here waits for time to pass.
"""

import os
import subprocess
from pathlib import Path

import pytest

LONG = ["attr_timeout=30", "entry_timeout=30"]


def _forget():
    """The kernel forgets every name and file it is not using: the next stat is a lookup."""
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def _ls(path):
    """{name: link count} as `ls -l` shows them: the kernel reads the directory with READDIRPLUS,
    and stats every entry."""
    out = subprocess.run(["ls", "-l", path], check=True, capture_output=True, text=True, timeout=60).stdout
    return {line.split()[-1]: int(line.split()[1]) for line in out.splitlines()[1:]}


def _second(where, mnt, mount, request):
    """A second client's view of the mount's directory: another mount of the same export (nfsd's
    backing is one already, uncached), or the local directory."""
    if where == "nfs-ganesha":
        return mount(next(iter(mnt.status()["sources"].values())), ["attr_timeout=0", "entry_timeout=0"]).path
    return mnt.backing


# nfsd is slow (TCG): its file forgotten only, the case that failed (held, the kernel asks with a getattr)
PLACES = [(where, forgotten) for where in ("local-ext4", "nfs-ganesha") for forgotten in (False, True)]
PLACES.append(("nfsd", True))


# What is done to the file by its name d, and the link count it has after.
CHANGES = {
    "rename-over": (lambda d: os.rename(d / "s", d / "d"), 1),
    "unlink": (lambda d: os.unlink(d / "d"), 1),
    "link": (lambda d: os.link(d / "d", d / "l2"), 3),
    "chmod": (lambda d: os.chmod(d / "d", 0o600), 2),
}


@pytest.mark.parametrize("how", CHANGES)
@pytest.mark.parametrize("where,forgotten", PLACES, ids=[f"{w}-{'forgotten' if f else 'held'}" for w, f in PLACES])
def test_the_other_name_of_a_hard_link_shows_a_change(where, forgotten, how, mount_on, mount, request):
    """`touch s d; ln d l; ls -l; mv s d` (or `rm d`, `ln d l2`, `chmod 600 d`): l shows the link
    count, mode and ctime the server gave the file then, through this mount as through a second
    one, whether or not the kernel still held the file (pjdfstest unlink/00, rename/23)."""
    change, nlink = CHANGES[how]
    mnt = mount_on(where, LONG)
    d = mnt.path
    (d / "s").write_bytes(b"s")
    (d / "d").write_bytes(b"d")
    os.link(d / "d", d / "l")
    assert _ls(d) == {"s": 1, "d": 2, "l": 2}
    linked = os.stat(d / "l")
    change(d)
    if forgotten:
        _forget()
    st = os.stat(d / "l")
    truth = os.stat(_second(where, mnt, mount, request) / "l")
    assert truth.st_nlink == nlink
    assert (st.st_nlink, st.st_mode, st.st_ctime_ns) == (nlink, truth.st_mode, truth.st_ctime_ns)
    assert st.st_ctime_ns >= linked.st_ctime_ns


@pytest.mark.parametrize("where", ["smb-xfs", "smb-btrfs", "smb-ext4"])
def test_a_listing_keeps_the_link_count_it_lacks(where, mount_on):
    """`touch f; ln f g; ls -l; stat f g`: 2 links each, as on the server, in ls's lines too.  After
    `rm g; touch h`, the next listing (fetched again: h is not in the last one) gives f 1."""
    mnt = mount_on(where, LONG)
    d = mnt.path
    (d / "f").write_bytes(b"f")
    os.link(d / "f", d / "g")
    assert _ls(d) == {"f": 2, "g": 2}
    assert [os.stat(d / n).st_nlink for n in ("f", "g", mnt.backing / "f")] == [2, 2, 2]
    os.unlink(d / "g")
    (d / "h").write_bytes(b"h")
    assert _ls(d) == {"f": 1, "h": 1}
    assert os.stat(d / "f").st_nlink == os.stat(mnt.backing / "f").st_nlink == 1
