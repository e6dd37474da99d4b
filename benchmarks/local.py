"""Benchmark offloadfs against its backing directory, side by side.

Not a test: it prints figures and asserts nothing. Run as root:
    .venv/bin/python benchmarks/local.py [--size-mib N]

Throughput and stat() use a tmpfs backing directory so the figures show what
offloadfs itself costs, not the disk; the cp comparison uses a btrfs loop
filesystem, where an offloaded copy becomes a clone.
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount

MiB = 1 << 20
STAT_FILES = 1000


def drop_caches(level=3):
    """Flush and drop the page cache (3) or only dentries and inodes (2)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{level}\n")


def write_mibs(path, size):
    """MiB/s of 1 MiB sequential writes, including the final fsync."""
    block = os.urandom(MiB)
    start = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(size // MiB):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    return size / MiB / (time.monotonic() - start)


def read_mibs(path):
    """MiB/s of 1 MiB sequential reads from a cold cache."""
    drop_caches()
    start = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    size = 0
    while chunk := os.read(fd, MiB):
        size += len(chunk)
    os.close(fd)
    return size / MiB / (time.monotonic() - start)


def stat_us(paths):
    """Median microseconds of one stat() over `paths`."""
    times = []
    for p in paths:
        start = time.perf_counter()
        os.stat(p)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def throughput(backing, size):
    """{label: (write MiB/s, read MiB/s)} for the backing dir and three mounts."""
    results = {"backing": (write_mibs(backing / "tp", size), read_mibs(backing / "tp"))}
    for label, options in (("offloadfs", []), ("offloadfs writeback_cache", ["writeback_cache"]),
                           ("offloadfs passthrough", ["passthrough"])):
        with offloadfs_mount(backing, options=options) as mnt:
            results[label] = (write_mibs(mnt / "tp", size), read_mibs(mnt / "tp"))
    os.unlink(backing / "tp")
    return results


def stat_latency(backing):
    """{label: (cold us, cached us)}; cold is right after dropping dentries
    and inodes, and attr_timeout=0 sends every stat() to the daemon."""
    d = backing / "stat"
    d.mkdir()
    for i in range(STAT_FILES):
        (d / f"f{i}").touch()
    names = [f"stat/f{i}" for i in range(STAT_FILES)]

    def measure(root):
        paths = [root / n for n in names]
        drop_caches(2)
        return stat_us(paths), stat_us(paths)

    results = {"backing": measure(backing)}
    for label, options in (("offloadfs", []), ("offloadfs attr_timeout=0",
                                               ["attr_timeout=0", "entry_timeout=0"])):
        with offloadfs_mount(backing, options=options) as mnt:
            results[label] = measure(mnt)
    return results


def timed_cp(src, dst):
    start = time.monotonic()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    return time.monotonic() - start


def cp_times(size):
    """Seconds for cp of `size` bytes with offload and with offload=off."""
    with loop_filesystem("btrfs", size=4 * size + (1 << 30)) as root:
        with offloadfs_mount(root) as mnt:
            write_mibs(mnt / "big", size)
            offload = timed_cp(mnt / "big", mnt / "copy1")
        with offloadfs_mount(root, options=["offload=off"]) as mnt:
            streamed = timed_cp(mnt / "big", mnt / "copy2")
    return offload, streamed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    size = parser.parse_args().size_mib * MiB
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        tp = throughput(Path(tmp), size)
        st = stat_latency(Path(tmp))
    offload, streamed = cp_times(size)

    base_w, base_r = tp["backing"]
    print(f"sequential 1 MiB I/O, {size // MiB} MiB, tmpfs backing")
    print(f"  {'':24} {'write MiB/s':>12} {'read MiB/s':>12} {'write ratio':>12} {'read ratio':>11}")
    for label, (w, r) in tp.items():
        print(f"  {label:24} {w:12.0f} {r:12.0f} {w / base_w:12.2f} {r / base_r:11.2f}")
    print(f"stat() median latency in us, {STAT_FILES} files")
    print(f"  {'':24} {'cold':>8} {'cached':>8} {'cold ratio':>11} {'cached ratio':>13}")
    base_cold, base_cached = st["backing"]
    for label, (cold, cached) in st.items():
        print(f"  {label:24} {cold:8.1f} {cached:8.1f} {cold / base_cold:11.1f} {cached / base_cached:13.1f}")
    print(f"cp {size // MiB} MiB on btrfs")
    print(f"  offload on          {offload:8.3f} s")
    print(f"  offload=off         {streamed:8.3f} s  ({streamed / max(offload, 1e-6):.0f}x)")


if __name__ == "__main__":
    main()
