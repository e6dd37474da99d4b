"""Benchmark `cp` on Linux nfsd through offloadfs: the planner choosing, the offload forced, no offload.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/nfs.py [--quick] [--between] [--out DIR]

The lab's nfsd runs in a qemu guest (TCG, so slow: compare ratios, not
times), exporting an xfs with reflink: with offload a cp is a CLONE (or a
COPY), with -o offload=off the bytes cross the link twice. With --between,
two guests and a cp from one to the other through one mount of both (an
inter-server COPY_NOTIFY + COPY, or streaming). For each size it times cp
through a mount where the planner chooses, one with offload=always and one
with offload=off, taking turns, and prints the medians, the planner's
against the faster of the other two, and the methods it chose each run
(c clone, s server-side copy, i inter-server copy, S stream; i>S: switched
mid-copy; between guests every run copies a fresh clone of the source, as
the pulling guest caches what it read). The planner must never lose (on/best <= 1.05) and at 64 MiB in
one guest it should win at least 20x; rows that miss are marked. Source
files are written through another mount and every copy gets a new name
(deleted afterwards), so no run sees another's caches or leftovers. The results go to OUT/nfs.json
(--between: nfs-between.json) and a plot of them beside it (report.py).
"""

import argparse
import contextlib
import os
import time

import cpbench
import report
from cpbench import MODES, KiB, MiB, header, medians, row
from offloadfs.lab.demo import write_file
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.nfsd import nfsd_lab

# size -> repetitions: each order of the three mounts as often (cpbench.medians).
SIZES = {KiB: 12, MiB: 12, 16 * MiB: 6, 64 * MiB: 6, 256 * MiB: 6}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
BETWEEN = {KiB: 12, MiB: 12, 16 * MiB: 6, 64 * MiB: 6, 128 * MiB: 6}  # the sizes
MIN_SPEEDUP_64M = 20
NO_CACHE = ["attr_timeout=0", "entry_timeout=0"]


def measure(url, sizes):
    """{size: ({mode: median s}, methods chosen)}; the files are written and removed through a view without caches."""
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(offloadfs_mount(url, options=NO_CACHE))
        for size in sizes:
            write_file(view / f"src-{size}", size)
        mounts = {tag: stack.enter_context(offloadfs_mount(url, options=opts)) for tag, opts in MODES.items()}
        return medians(mounts, view, sizes)


def measure_between(urls, sizes):
    """The same for cp a/src b/dst through one mount of both servers; sources written and copies
    removed through views without caches."""
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(offloadfs_mount(url, options=NO_CACHE)) for url in urls)
        for size in sizes:
            write_file(a / f"src-{size}", size)
        sources = {"a": urls[0], "b": urls[1]}
        mounts = {tag: stack.enter_context(offloadfs_mount(sources, options=opts)) for tag, opts in MODES.items()}
        return medians(mounts, b, sizes, "a", "b", sources=a, fresh=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only, few repetitions")
    parser.add_argument("--between", action="store_true", help="cp from one nfsd guest to another")
    report.add_out_argument(parser)
    args = parser.parse_args()
    started = time.monotonic()
    if args.between:
        sizes = QUICK if args.quick else BETWEEN
        with nfsd_lab(guests=2, ssc=True) as lab:
            results = measure_between([f"nfs://{g.host}{g.export}" for g in lab.guests], sizes)
        what = "from one Linux nfsd 6.1 guest to another (qemu TCG, xfs, inter-server copy)"
    else:
        sizes = QUICK if args.quick else SIZES
        with nfsd_lab() as lab:
            guest = lab.guest
            results = measure(f"nfs://{guest.host}{guest.export}", sizes)
        what = "on Linux nfsd 6.1 (qemu TCG guest, xfs with reflink)"
    print(f"cp through offloadfs {what}; median seconds; {time.monotonic() - started:.0f} s in all")
    print(header())
    for size, result in results.items():
        wanted = MIN_SPEEDUP_64M if size == 64 * MiB and not args.between else None
        print(row("", size, sizes[size], result, wanted))
    name = "nfs-between" if args.between else "nfs"
    fig, (ax,) = report.figure(f"cp through offloadfs {what}", 1)
    cpbench.draw(ax, "", results)
    report.save(args.out, name, {"where": what, "copies": cpbench.as_json(results)}, fig)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
