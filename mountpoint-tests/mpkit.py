"""Helpers shared by the mountpoint tests."""

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from offloadfs.lab.mount import status

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Mount:
    """A live offloadfs mount and what backs it (a dir, or {name: dir})."""

    path: Path
    backing: object

    def status(self):
        return status(self.path)

    def counters(self):
        return self.status()["counters"]


def sh(*cmd, **kwargs):
    """Run a tool, failing the test with its stderr if it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}: {proc.stderr}"
    return proc.stdout


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def write_file(path, size):
    """Write `size` bytes nothing can deduplicate or mistake for a hole.

    Large files repeat one random MiB with a counter in front of every
    block: cheap to make, yet every block differs.
    """
    block = os.urandom(min(size, MiB)) if size else b""
    with open(path, "wb") as f:
        for i, off in enumerate(range(0, size, MiB)):
            chunk = (i.to_bytes(8, "little") + block)[: min(MiB, size - off)]
            f.write(chunk)
    return sha256(path)


def total_copies(counters):
    return sum(counters["copies"].values())


def tree_digest(root):
    """{relative path: (kind, mode, content or link target)} of a tree."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, st.st_size, sha256(p))
    return out


def make_tree(root):
    """A small tree with nested dirs, odd modes, an empty file and a symlink."""
    (root / "d1" / "d2").mkdir(parents=True)
    write_file(root / "a", 100_000)
    write_file(root / "d1" / "b", 3 * MiB + 17)
    write_file(root / "d1" / "d2" / "c", 4096)
    (root / "empty").touch()
    os.chmod(root / "a", 0o600)
    os.chmod(root / "d1" / "d2", 0o750)
    os.symlink("d1/b", root / "link")
