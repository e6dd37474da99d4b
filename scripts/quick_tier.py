"""pytest plugin for `scripts/test --quick`: tests that start a lab server are skipped.

Every lab server (Samba, ganesha, the nfsd guest) runs in a network namespace
made by offloadfs.lab.net.server_namespace, so skipping there leaves exactly the
unit tests and the local mounts, without a list of files to keep up to date.
Loaded with -p before the tests import the lab, so their own imports of
server_namespace already get this one.
"""
import contextlib

import pytest

from offloadfs.lab import net


@contextlib.contextmanager
def _no_server(rate=None):
    pytest.skip("quick tier: needs a lab server")
    yield


net.server_namespace = _no_server
