"""An inter-server COPY under krb5 (issue #32), on two nfsd guests with a DC of their own.

Its own module: the DC takes a machine-wide lock, so its lab cannot start while
test_mp_nfs_kerberos's module-scoped nfsd-krb5 lab still holds its DC.
"""
import contextlib

import pytest
from mpkit import MiB, sh, sha256, write_file
from test_mp_nfs_kerberos import with_ticket

from offloadfs.lab.mount import offloadfs_mount, status
from offloadfs.lab.nfsd import nfsd_lab
from offloadfs.lab.nfsd.krb5 import secinfo


@pytest.fixture(scope="module")
def ssc_lab():
    """Two nfsd guests that copy between each other, their exports taking AUTH_SYS and krb5."""
    with contextlib.ExitStack() as stack:
        try:
            lab = stack.enter_context(nfsd_lab(guests=2, ssc=True, sectypes=("sys", "krb5")))
        except RuntimeError as e:  # no apt, no compiler, the nfsd build failed, a guest did not boot
            pytest.skip(f"no nfsd guests with inter-server copy: {e}")
        yield lab


def copied(mnt, source, target):
    """cp ``source`` to ``target`` in ``mnt``: the bytes each way of copying moved, errors, and the digest."""
    before = status(mnt)["counters"]
    sh("cp", source, target)
    after = status(mnt)["counters"]
    moved = {how: after["copy_bytes"][how] - before["copy_bytes"][how] for how in after["copy_bytes"]}
    return moved, after["copy_errors"] - before["copy_errors"], sha256(target)


def test_an_inter_server_copy_under_krb5_needs_a_source_that_takes_sys(ssc_lab, tmp_path, monkeypatch):
    """Issue #32: COPY_NOTIFY and COPY go under the caller's krb5 context, but the destination's nfsd pulls
    the source with its own client at sec=sys (hard-coded).  A source export that takes AUTH_SYS too is
    copied server to server; one that takes krb5 alone refuses the pull, and the mount streams, byte-exact."""
    monkeypatch.setenv("KRB5_CONFIG", str(ssc_lab.realm.krb5_conf))
    with_ticket(ssc_lab.realm, tmp_path, monkeypatch)
    a, b = ssc_lab.guests
    urls = {"a": f"nfs://{a.host}{a.export}", "b": f"nfs://{b.host}{b.export}"}
    size = 16 * MiB
    with offloadfs_mount(urls, options=["sec=krb5", "offload=always"]) as mnt:
        digest = write_file(mnt / "a" / "src", size)
        moved, errors, got = copied(mnt, mnt / "a" / "src", mnt / "b" / "pulled")
        assert (moved["inter_server_copy"], moved["stream"], errors, got) == (size, 0, 0, digest)
        status_, out = a.run(f"sec={secinfo(['krb5'])} nfsd-up")  # A's /export takes krb5 alone from now on
        assert status_ == 0, out
        moved, errors, got = copied(mnt, mnt / "a" / "src", mnt / "b" / "streamed")
        assert (moved["inter_server_copy"], moved["stream"], errors, got) == (0, size, 0, digest)
