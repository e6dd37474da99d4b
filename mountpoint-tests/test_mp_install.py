"""The install README gives, followed from a freshly built wheel as a Debian 12 admin would.

The wheel is built once from a copy of the source tree and installed, without the
lab extra (so without pyroute2) and at the versions CI tests, into a venv of
Debian's python3. README's steps run inside a private mount namespace whose /opt,
/usr/local and /usr/sbin are overlays: mount(8) and man see the links the steps
make there, and nothing is left on the machine afterwards.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PREFIX = "/opt/offloadfs"
# README, "Install": the steps after `apt install python3-venv fuse3 man-db`, WHEEL being the wheel's path.
INSTALL = f"""
python3 -m venv {PREFIX}
{PREFIX}/bin/pip install -q "$WHEEL"
ln -sf {PREFIX}/bin/offloadfs /usr/local/bin/
ln -sf {PREFIX}/bin/mount.offloadfs /sbin/
mkdir -p /usr/local/share/man/man8
ln -sf {PREFIX}/share/man/man8/*.8 /usr/local/share/man/man8/
"""
UNITS = f"{PREFIX}/share/doc/offloadfs/examples/systemd"
OVERLAID = ("/opt", "/usr/local", "/usr/sbin")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Tests reach no host outside the lab: pip takes what scripts/setup downloaded (the pinned set and
# the build backend), and nothing from an index.
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"
OFFLINE = ("--no-index", "--find-links", WHEELHOUSE)


def run(*cmd, check=True, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert not check or proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    return proc


def build_wheel(tmp):
    """Build from a copy of the tracked and unignored files: an in-tree build/ could ship stale modules."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout
    src = tmp / "src"
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *OFFLINE, "-w", tmp / "dist", src)
    (wheel,) = (tmp / "dist").glob("offloadfs-*.whl")
    return wheel


class Namespace:
    """A mount namespace kept by a bind mount of its file, entered with nsenter for each command."""

    def __init__(self, tmp):
        self.dir = tmp / "ns"
        self.dir.mkdir()
        run("mount", "--bind", self.dir, self.dir)
        run("mount", "--make-private", self.dir)
        self.file = self.dir / "mnt"
        self.file.touch()
        run("unshare", f"--mount={self.file}", "--propagation", "private", "true")
        for i, path in enumerate(OVERLAID):
            upper, work = tmp / f"upper{i}", tmp / f"work{i}"
            upper.mkdir()
            work.mkdir()
            self.run("mount", "-t", "overlay", "overlay", "-o",
                     f"lowerdir={path},upperdir={upper},workdir={work}", path)

    def run(self, *cmd, check=True, env=None):
        env = {"PATH": PATH, "LANG": "C.UTF-8", **(env or {})}
        return run("nsenter", f"--mount={self.file}", *map(str, cmd), check=check, env=env)

    def close(self):
        run("umount", self.file)
        run("umount", self.dir)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: mount namespaces and mounts")
    if not WHEELHOUSE.is_dir():
        pytest.fail(f"{WHEELHOUSE} is missing: run scripts/setup")
    tmp = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp)
    ns = Namespace(tmp)
    try:
        ns.run("bash", "-euc", INSTALL, env={"WHEEL": wheel, "PIP_CONSTRAINT": ROOT / "constraints.txt",
                                             "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": WHEELHOUSE})
        yield ns
    finally:
        ns.close()


def test_version(installed):
    want = run(sys.executable, "-c", "from importlib import metadata; print(metadata.version('offloadfs'))")
    assert installed.run("offloadfs", "--version").stdout == f"offloadfs {want.stdout}"


def test_licence_travels_with_the_package(installed):
    code = ("from importlib import metadata\n"
            "d = metadata.distribution('offloadfs')\n"
            "print(d.metadata['License-Expression'], [f.name for f in d.files if f.name == 'LICENSE'])\n")
    assert installed.run(f"{PREFIX}/bin/python", "-c", code).stdout == "MIT ['LICENSE']\n"


def test_core_needs_no_lab(installed):
    """Every module but offloadfs.lab (and __main__, which runs the CLI) imports without pyroute2."""
    code = ("import importlib, pkgutil, offloadfs\n"
            "for m in pkgutil.walk_packages(offloadfs.__path__, 'offloadfs.'):\n"
            "    if not m.name.startswith(('offloadfs.lab', 'offloadfs.__main__')):\n"
            "        importlib.import_module(m.name)\n"
            "import pyroute2\n")
    proc = installed.run(f"{PREFIX}/bin/python", "-c", code, check=False)
    assert "No module named 'pyroute2'" in proc.stderr and proc.stderr.count("Error") == 1, proc.stderr


def test_mount_helper_is_where_mount_looks(installed):
    assert installed.run("readlink", "-e", "/sbin/mount.offloadfs").stdout == f"{PREFIX}/bin/mount.offloadfs\n"


@pytest.mark.parametrize("page", ["offloadfs", "mount.offloadfs"])
def test_man_finds_the_page(installed, page):
    """Through the link in /usr/local/share/man (man -w names the file the link leads to)."""
    assert installed.run("man", "-w", page).stdout == f"{PREFIX}/share/man/man8/{page}.8\n"


def test_units_verify(installed):
    units = installed.run("sh", "-c", f"ls {UNITS}/*").stdout.split()
    assert len(units) == 4
    proc = installed.run("systemd-analyze", "verify", *units, check=False)
    assert proc.returncode == 0 and not proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_mount_t_offloadfs(installed, tmp_path):
    src, mp = tmp_path / "src", tmp_path / "mp"
    src.mkdir()
    mp.mkdir()
    (src / "f").write_bytes(b"through the installed helper")
    installed.run("mount", "-t", "offloadfs", src, mp)
    try:
        assert installed.run("cat", mp / "f").stdout == "through the installed helper"
        assert "offloadfs" in installed.run("findmnt", "-n", "-o", "FSTYPE", mp).stdout
    finally:
        installed.run("offloadfs", "umount", mp)
