"""The unit files in systemd/ are ones systemd accepts: `systemd-analyze verify` finds nothing.

verify needs no running systemd; it does run `man` for each Documentation= page, so
MANPATH points at this repository's man pages, and any warning at all fails the test.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
UNITS = sorted((ROOT / "systemd").glob("*.*mount"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_unit_verifies(unit):
    proc = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "MANPATH": str(ROOT / "man")})
    assert proc.returncode == 0 and not proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_units_for_every_kind_of_source():
    names = {p.name for p in UNITS}
    assert {"mnt-data.mount", "mnt-nas.mount", "mnt-nas.automount", "mnt-projects.mount"} <= names
    nas = (ROOT / "systemd" / "mnt-nas.mount").read_text()
    for needed in ("_netdev", "network-online.target", "credentials="):
        assert needed in nas
    assert "network-online.target" in (ROOT / "systemd" / "mnt-projects.mount").read_text()
