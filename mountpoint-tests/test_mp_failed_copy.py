"""What a copy that fails part way leaves: what a plain cp leaves, a correct prefix of the source.

A copy moves several pieces at once (writes of a streamed chunk side by
side, server-side copies in flight together), so a later piece may land
while an earlier one fails.  The destination must then hold no more than
the part copied without a gap from the start, and cp must fail.
"""

import shutil
import subprocess

import pytest
from mpkit import MiB, write_file
from smbkit import smb_lab
from test_mp_smb import wait_for_copy

from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount, status

SMALL_FS = 128 * MiB  # the destination's filesystem
SIZE = 192 * MiB  # a file that does not fit on it


def assert_prefix(source, destination, copied):
    """``destination`` holds the first bytes of ``source`` and nothing else, and no more than ``copied``."""
    size = destination.stat().st_size
    with open(source, "rb") as src, open(destination, "rb") as dst:
        for off in range(0, size, MiB):
            want, got = src.read(MiB), dst.read(MiB)
            assert got == want[:len(got)], f"{destination}: wrong from {off >> 20} MiB on (size {size})"
    assert size <= copied, f"{destination}: {size} bytes, but only {copied} were copied"


def copied(counters):
    """Bytes the daemon reports moved into files, by copies and by writes."""
    return sum(counters["copy_bytes"].values()) + counters["fuse_write_bytes"]


def cp_fails(src, dst):
    cp = subprocess.run(["cp", src, dst], capture_output=True, text=True, timeout=300)
    print(f"cp exit {cp.returncode}: {cp.stderr.strip()}")
    assert cp.returncode != 0, "cp reported success although the destination is full"
    assert cp.stderr.strip(), "cp failed without saying why"


def test_streamed_copy_onto_a_full_filesystem(backing):
    """Between two sources on different filesystems the daemon streams: ENOSPC part way."""
    with loop_filesystem("ext4", size=SMALL_FS) as small:
        src = backing("ext4")
        write_file(src / "big", SIZE)
        with offloadfs_mount({"a": src, "b": small}) as mnt:
            cp_fails(mnt / "a" / "big", mnt / "b" / "copy")
            counters = status(mnt)["counters"]
            assert counters["copy_bytes"]["stream"] > 0, counters
            assert_prefix(src / "big", small / "copy", copied(counters))
