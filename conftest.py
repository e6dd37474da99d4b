"""Servers that tests/ and mountpoint-tests/ share when one run takes both (scripts/test does).

Only servers no test restarts, stops or reconfigures belong here: tests that
do any of that start their own.
"""

import contextlib

import pytest


@pytest.fixture(scope="session")
def nfsd_reflink_lab():
    """A running one-guest nfsd lab whose xfs has reflink (nfsd_lab's default).  Booting a guest
    under TCG costs 7-9 s; test_nfs_nfsd and the mount tests' "nfsd-reflink" only make directories
    in its export."""
    from offloadfs.lab.nfsd import nfsd_lab
    with contextlib.ExitStack() as stack:
        try:
            lab = stack.enter_context(nfsd_lab())
        except RuntimeError as e:  # no apt, no compiler, the nfsd build failed, the guest did not boot
            pytest.skip(f"no nfsd guest: {e}")
        yield lab
