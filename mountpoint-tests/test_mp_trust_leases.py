"""`trust_leases`: a recognised copy whose source's lease was held without a gap from its read to
the commit is not read back (issue #30: a mode that trusts more, as an explicit option).

The lease sees other clients of the server, never a program on the server itself (Samba with
`kernel oplocks = no`): that is the risk the option takes, and docs/consistency.md states.  What
these tests hold it to: with the lease unbroken nothing is read back, and where another client's
write broke it, the copy is read back and holds what was read.
"""

import os
import subprocess
from contextlib import ExitStack

import pytest
from mpkit import MiB, assert_same, rewrite_keeping_times
from test_mp_delegations import read_until_delegated
from test_mp_foreign_writers import REWRITE, SIZE, copy_by_hand

from offloadfs.lab.mount import offloadfs_mount

TRUST = ["offload=always", "trust_leases"]


@pytest.mark.parametrize("where", ["smb-btrfs", "smb-xfs"])
def test_a_copy_under_an_unbroken_lease_is_not_read_back(mount_on, where):
    mnt = mount_on(where, TRUST)
    data = os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(data)
    copy_by_hand(mnt.path / "src", mnt.path / "dst", lambda: None)  # the source open until the commit
    assert_same((mnt.backing / "dst").read_bytes(), data)
    c = mnt.counters()
    assert c["recognised_bytes"] >= SIZE - 2 * MiB, c
    assert c["recognised_verified"] == 0, c


def test_without_the_option_the_same_copy_is_read_back(mount_on):
    """The control: the default mount reads the copy back, so the test above measures the option."""
    mnt = mount_on("smb-btrfs", ["offload=always"])
    data = os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(data)
    copy_by_hand(mnt.path / "src", mnt.path / "dst", lambda: None)
    assert_same((mnt.backing / "dst").read_bytes(), data)
    assert mnt.counters()["recognised_verified"] > 0


@pytest.mark.parametrize("tool", ["rsync", "tar"])
def test_a_source_closed_before_the_commit_keeps_its_lease(mount_on, tool):
    """rsync's sender and tar c close the source before the copy's close commits it: the mount
    keeps the source open, and its lease held, until then."""
    mnt = mount_on("smb-btrfs", TRUST)
    data = os.urandom(SIZE)
    (mnt.backing / "in").mkdir()
    (mnt.backing / "in" / "src").write_bytes(data)
    if tool == "rsync":
        subprocess.run(["rsync", "-a", f"{mnt.path}/in/", f"{mnt.path}/out/"], check=True)
    else:
        (mnt.path / "out").mkdir()
        subprocess.run(f"tar -C {mnt.path}/in -cf - . | tar -C {mnt.path}/out -xf -", shell=True, check=True)
    assert_same((mnt.backing / "out" / "src").read_bytes(), data)
    c = mnt.counters()
    assert c["recognised_bytes"] >= SIZE - 2 * MiB, c
    assert c["recognised_verified"] == 0, c


@pytest.fixture
def two_clients(smb):
    with ExitStack() as stack:
        url, path = smb.fresh_dir("btrfs")
        ours = stack.enter_context(offloadfs_mount(url, options=[*smb.options(), *TRUST]))
        theirs = stack.enter_context(offloadfs_mount(url, options=smb.options()))
        yield ours, theirs, path


def test_a_second_clients_rewrite_breaks_the_lease_and_the_copy_is_read_back(two_clients):
    """Another client rewrites the source after it was read here, keeping its times: the break ends
    the trust, the copy is read back and holds what was read."""
    ours, theirs, backing = two_clients
    data = os.urandom(SIZE)
    (backing / "src").write_bytes(data)
    copy_by_hand(ours / "src", ours / "dst", lambda: rewrite_keeping_times(theirs / "src", os.urandom(REWRITE)))
    assert_same((backing / "dst").read_bytes(), data)


def test_an_nfs_copy_under_an_unbroken_delegation_is_not_read_back(mount_on):
    """The same through an NFS read delegation (Linux nfsd 6.1, whose change attribute proves
    nothing: without the option the copy is read back).  nfsd grants none while the view's CLOSE is
    on its way: the data is read until one is held, and so read again under it."""
    mnt = mount_on("nfsd", [*TRUST, "attr_timeout=3600", "entry_timeout=3600"])
    data = os.urandom(SIZE)
    (mnt.backing / "src").write_bytes(data)
    read_until_delegated(mnt, data, "src")
    copy_by_hand(mnt.path / "src", mnt.path / "dst", lambda: None)
    assert_same((mnt.backing / "dst").read_bytes(), data)
    c = mnt.counters()
    assert c["recognised_bytes"] >= SIZE - 2 * MiB, c
    assert c["recognised_verified"] == 0, c
