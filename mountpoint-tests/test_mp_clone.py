"""`cp` on btrfs and xfs backing filesystems must become a clone.

The status counters say what the daemon did; filefrag on the backing files
shows the extents really are shared, so a counter alone cannot lie.
"""

import os
import re

import pytest
from mpkit import MiB, sh, sha256, write_file

EXTENT = re.compile(r"^\s*\d+:\s")


def extent_flags(path):
    """Flags of each extent of `path` as filefrag -v reports them."""
    lines = [ln for ln in sh("filefrag", "-v", path).splitlines() if EXTENT.match(ln)]
    return [ln.rsplit(":", 1)[1].strip() for ln in lines]


@pytest.mark.parametrize("kind", ["btrfs", "xfs"])
def test_cp_is_a_clone(kind, backing, mount):
    root = backing(kind)
    digest = write_file(root / "big", 256 * MiB)
    os.sync()
    mnt = mount(root)
    sh("cp", mnt.path / "big", mnt.path / "copy")
    counters = mnt.counters()
    assert counters["copies"].get("clone", 0) >= 1, counters
    assert counters["copy_bytes"].get("clone", 0) == 256 * MiB, counters
    assert sha256(root / "copy") == digest
    for name in ("big", "copy"):
        flags = extent_flags(root / name)
        assert flags and all("shared" in f for f in flags), (name, flags)
