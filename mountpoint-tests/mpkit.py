"""Helpers shared by the mountpoint tests."""

import hashlib
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from offloadfs.lab.mount import status

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Mount:
    """A live offloadfs mount and what backs it (a dir, or {name: dir}).

    `cannot` maps what the backend cannot store ("symlink", "chmod", ...) to
    the reason, so a test that needs it is skipped, and says why;
    `time_step_ns` is the resolution of the timestamps it stores;
    `wait_closed(path)`, where given, returns once the store closed a file.
    """

    path: Path
    backing: object
    cannot: dict = field(default_factory=dict)
    time_step_ns: int = 1
    wait_closed: object = None

    def need(self, *what):
        """Skip the test unless the mount can do all of `what`."""
        reasons = [self.cannot[w] for w in what if w in self.cannot]
        if reasons:
            pytest.skip("; ".join(reasons))

    def can(self, what):
        return what not in self.cannot

    def stored_ns(self, ns):
        """A timestamp as it reads back after being set through the mount."""
        return ns - ns % self.time_step_ns

    def status(self):
        return status(self.path)

    def counters(self):
        return self.status()["counters"]

    def settle(self, path):
        """Return once the store behind the mount has closed backing file
        `path`: the kernel sends a close to the daemon without waiting."""
        if self.wait_closed:
            self.wait_closed(path)


def sh(*cmd, **kwargs):
    """Run a tool, failing the test with its stderr if it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}: exit {proc.returncode}: {proc.stderr}"
    return proc.stdout


def gone(pid):
    """The process ended (a zombie counts: init here reaps only now and then)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def backoff_attempts(seconds, first, most):
    """How many connection attempts a backoff allows in ``seconds`` of failures: one at once, then one
    after each wait, the waits doubling from ``first`` up to ``most``.  A bound that follows the time a
    test took, so a busy machine widens it rather than failing the test."""
    attempts, wait, at = 1, first, first
    while at <= seconds:
        attempts += 1
        wait = min(most, 2 * wait)
        at += wait
    return attempts


def assert_same(got, want, at=0):
    """Byte for byte, naming the first offset that differs (``at``: where ``got`` starts in its file).
    Not ``assert got == want``: on CI pytest diffs the two in full, for hours on a MiB."""
    assert len(got) == len(want), f"{len(got)} bytes, wanted {len(want)}"
    bad = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
    assert bad is None, f"first wrong byte at offset {at + bad}"


def rewrite_keeping_times(path, data, offset=0):
    """Rewrite ``path`` in place at ``offset``, then put its times back, as `cp -p`, `touch -r` and
    `tar x` leave them: on Samba no attribute then shows the change (issue #30)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


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


def tree_digest(root, modes=True):
    """{relative path: (kind, mode, content or link target)} of a tree;
    modes=False leaves modes out (for a place that does not keep them)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode if modes else None)
            else:
                out[rel] = ("file", st.st_mode if modes else None, st.st_size, sha256(p))
    return out


def make_tree(root, modes=True, symlink=True):
    """A small tree with nested dirs, an empty file, and unless told
    otherwise odd modes and a symlink."""
    (root / "d1" / "d2").mkdir(parents=True)
    write_file(root / "a", 100_000)
    write_file(root / "d1" / "b", 3 * MiB + 17)
    write_file(root / "d1" / "d2" / "c", 4096)
    (root / "empty").touch()
    if modes:
        os.chmod(root / "a", 0o600)
        os.chmod(root / "d1" / "d2", 0o750)
    if symlink:
        os.symlink("d1/b", root / "link")
