"""A sparse file over 4 GiB: offsets and lengths past 32 bits must survive.

cp treats a sparse-looking file with SEEK_DATA + read/write, so a second test
sends the copy request itself with os.copy_file_range and checks the whole
5 GiB went to the daemon as one request. Contents are checked at the data
ranges and at probes in the holes, not by hashing 5 GiB.
"""

import os

import pytest
from mpkit import GiB, sh

SIZE = 5 * GiB
CHUNK = 64 * 1024
OFFSETS = [0, GiB + 123, 4 * GiB - 2048, SIZE - CHUNK - 5]
HOLES = [2 * GiB, 3 * GiB + 7, 4 * GiB + (1 << 20), SIZE - CHUNK - 4096 - 5]


def make_sparse(path):
    """truncate -s 5G, then write random data at OFFSETS; return {offset: data}."""
    sh("truncate", "-s", str(SIZE), path)
    written = {}
    fd = os.open(path, os.O_WRONLY)
    try:
        for off in OFFSETS:
            written[off] = os.urandom(CHUNK)
            assert os.pwrite(fd, written[off], off) == CHUNK
    finally:
        os.close(fd)
    return written


def check_copy(path, written):
    assert os.stat(path).st_size == SIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, data in written.items():
            assert os.pread(fd, CHUNK, off) == data, f"data at {off}"
        for off in HOLES:
            assert os.pread(fd, 4096, off) == bytes(4096), f"hole at {off}"
    finally:
        os.close(fd)


def test_cp_sparse_file_over_4gib(mnt):
    written = make_sparse(mnt.path / "sparse")
    sh("cp", mnt.path / "sparse", mnt.path / "copy")
    check_copy(mnt.path / "copy", written)
    check_copy(mnt.backing / "copy", written)


@pytest.mark.parametrize("kind", ["btrfs", "xfs"])
def test_copy_request_over_4gib_is_one_request(kind, backing, mount):
    mnt = mount(backing(kind))
    written = make_sparse(mnt.path / "sparse")
    before = mnt.counters()
    src = os.open(mnt.path / "sparse", os.O_RDONLY)
    dst = os.open(mnt.path / "copy", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert os.copy_file_range(src, dst, SIZE) == SIZE
    finally:
        os.close(src)
        os.close(dst)
    after = mnt.counters()
    assert after["copy_requests"] - before["copy_requests"] == 1
    assert sum(after["copy_bytes"].values()) - sum(before["copy_bytes"].values()) == SIZE
    check_copy(mnt.path / "copy", written)
    check_copy(mnt.backing / "copy", written)
