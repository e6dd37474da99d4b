"""Benchmark `cp` on Linux nfsd through offloadfs, with and without offload.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/nfs.py [--quick]

The lab's nfsd runs in a qemu guest (TCG, so slow: compare ratios, not
times), exporting an xfs with reflink: with offload a cp is a CLONE (or a
COPY), with -o offload=off the bytes cross the link twice. For each size it
times cp through a mount with offload and through one with offload=off and
prints the medians and their ratio. Offload must never lose (on/off <= 1.05)
and at 64 MiB it should win at least 20x; rows that miss are marked. Source
files are written through a third mount and every copy gets a new name
(deleted afterwards), so no run sees another's caches or leftovers.
"""

import argparse
import contextlib
import os
import statistics
import time

from offloadfs.lab.demo import timed_cp
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.nfsd import nfsd_lab

KiB, MiB = 1 << 10, 1 << 20
# size -> repetitions: enough for a median where a run is cheap.
SIZES = {KiB: 7, MiB: 7, 16 * MiB: 5, 64 * MiB: 3, 256 * MiB: 2}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
MAX_RATIO = 1.05
MIN_SPEEDUP_64M = 20
NO_CACHE = ["attr_timeout=0", "entry_timeout=0"]


def write_file(path, size):
    """`size` bytes nothing can mistake for a hole; every MiB differs."""
    block = os.urandom(min(size, MiB))
    with open(path, "wb") as f:
        for i, off in enumerate(range(0, size, MiB)):
            f.write((i.to_bytes(8, "little") + block)[: min(MiB, size - off)])
        os.fsync(f.fileno())


def label(size):
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size // unit} {name}"
    return f"{size} B"


def cp_once(mnt, view, src, dst):
    """Seconds of cp src dst in the mount; the copy is deleted through the view."""
    seconds = timed_cp(mnt / src, mnt / dst)
    (view / dst).unlink()
    return seconds


def measure(url, sizes):
    """{size: (median on, median off)}."""
    results = {}
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(offloadfs_mount(url, options=NO_CACHE))
        for size in sizes:
            write_file(view / f"src-{size}", size)
        on = stack.enter_context(offloadfs_mount(url))
        off = stack.enter_context(offloadfs_mount(url, options=["offload=off"]))
        for size, reps in sizes.items():
            src = f"src-{size}"
            times_on, times_off = [], []
            # Alternate the two so that a busy moment on the machine hits both alike.
            for i in range(reps):
                times_on.append(cp_once(on, view, src, f"{src}.on{i}"))
                times_off.append(cp_once(off, view, src, f"{src}.off{i}"))
            results[size] = (statistics.median(times_on), statistics.median(times_off))
            (view / src).unlink()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only, few repetitions")
    sizes = QUICK if parser.parse_args().quick else SIZES
    started = time.monotonic()
    with nfsd_lab() as lab:
        guest = lab.guest
        results = measure(f"nfs://{guest.host}{guest.export}", sizes)
    print(f"cp through offloadfs on Linux nfsd 6.1 (qemu TCG guest, xfs with reflink); median seconds; "
          f"{time.monotonic() - started:.0f} s in all")
    print(f"  {'size':>8} {'reps':>5} {'offload on':>11} {'offload=off':>12} {'off/on':>8} {'on/off':>7}")
    for size, (on, off) in results.items():
        ratio = on / off
        marks = []
        if ratio > MAX_RATIO:
            marks.append(f"offload slower (> {MAX_RATIO})")
        if size == 64 * MiB and off / on < MIN_SPEEDUP_64M:
            marks.append(f"under {MIN_SPEEDUP_64M}x")
        print(f"  {label(size):>8} {sizes[size]:>5} {on:11.4f} {off:12.4f} {off / on:7.1f}x {ratio:7.2f}  "
              f"{'; '.join(marks)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
