"""Benchmark offloadfs against its backing directory, side by side.

Not a test: it prints figures and asserts nothing. Run as root:
    .venv/bin/python benchmarks/local.py [--size-mib N] [--quick] [--out DIR]

Throughput and stat() use a tmpfs backing directory so the figures show what
offloadfs itself costs, not the disk.  The cp table times cp on a btrfs loop
filesystem (an offloaded copy is a clone) and an ext4 one (copy_file_range, the
kernel copying the bytes) through a mount where the planner chooses, one with
-o offload=always and one with -o offload=off, taking turns (cpbench.py): the
planner must never lose (on/best <= 1.05). The results go to OUT/local.json
and a plot of them to OUT/local.png (report.py).
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import cpbench
import report
from cpbench import MODES, GiB, KiB, MiB, header, medians, row
from offloadfs.lab.demo import write_file
from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount

STAT_FILES = 1000
CP_KINDS = ("btrfs", "ext4")
CP_SIZES = {KiB: 12, MiB: 12, 16 * MiB: 6, 128 * MiB: 6, GiB: 6}  # size -> runs of each mode: each order as often
QUICK = {KiB: 6, MiB: 6, 16 * MiB: 6, 128 * MiB: 6}


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


def cp_table(kind, sizes):
    """{size: ({mode: median s}, [methods chosen])} of cp on a fresh ``kind`` loop filesystem.

    Room for every copy at once: each is removed on the filesystem itself, but the mount that made
    it holds it (an O_PATH descriptor) until the kernel forgets the name."""
    room = sum(3 * runs * size for size, runs in sizes.items()) + 2 * sum(sizes) + GiB
    with loop_filesystem(kind, size=room) as root, contextlib.ExitStack() as stack:
        for size in sizes:
            write_file(root / f"src-{size}", size)
        mounts = {tag: stack.enter_context(offloadfs_mount(root, options=opts)) for tag, opts in MODES.items()}
        return medians(mounts, root, sizes)


def save(out, size, tp, st, cp):
    """OUT/local.json and OUT/local.png: throughput and stat() as bars, cp on each filesystem against size."""
    fig, axes = report.figure("offloadfs on local directories", 2 + len(cp))
    report.draw_bars(axes[0], f"sequential 1 MiB I/O, {size // MiB} MiB, tmpfs",
                     {way: {name: rates[i] for name, rates in tp.items()} for i, way in enumerate(("write", "read"))},
                     "MiB/s")
    report.draw_bars(axes[1], f"stat(), {STAT_FILES} files",
                     {when: {name: us[i] for name, us in st.items()} for i, when in enumerate(("cold", "cached"))},
                     "median microseconds", log=True)
    for ax, (kind, rows) in zip(axes[2:], cp.items()):
        cpbench.draw(ax, f"cp on {kind}", rows)
    results = {"throughput_mib_s": {name: dict(zip(("write", "read"), rates)) for name, rates in tp.items()},
               "io_mib": size // MiB,
               "stat_us": {name: dict(zip(("cold", "cached"), us)) for name, us in st.items()},
               "cp": {kind: cpbench.as_json(rows) for kind, rows in cp.items()}}
    report.save(out, "local", results, fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="cp up to 128 MiB, 6 runs a size")
    report.add_out_argument(parser)
    args = parser.parse_args()
    size = args.size_mib * MiB
    cp_sizes = QUICK if args.quick else CP_SIZES
    with report.progress("throughput and stat()") as steps, tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        tp = throughput(Path(tmp), size)
        steps.done("throughput")
        st = stat_latency(Path(tmp))
    cp = {kind: cp_table(kind, cp_sizes) for kind in CP_KINDS}

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
    print("cp on local loop filesystems; median seconds")
    print(header("fs"))
    for kind, rows in cp.items():
        for n, result in rows.items():
            print(row(kind, n, cp_sizes[n], result))
    save(args.out, size, tp, st, cp)


if __name__ == "__main__":
    main()
