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
import time

from cpbench import KiB, MiB, header, medians, row
from offloadfs.lab.demo import write_file
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.nfsd import nfsd_lab

# size -> repetitions: enough for a median where a run is cheap.
SIZES = {KiB: 7, MiB: 7, 16 * MiB: 5, 64 * MiB: 3, 256 * MiB: 2}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
MIN_SPEEDUP_64M = 20
NO_CACHE = ["attr_timeout=0", "entry_timeout=0"]


def measure(url, sizes):
    """{size: (median on, median off)}; the files are written and removed through a view without caches."""
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(offloadfs_mount(url, options=NO_CACHE))
        for size in sizes:
            write_file(view / f"src-{size}", size)
        on = stack.enter_context(offloadfs_mount(url))
        off = stack.enter_context(offloadfs_mount(url, options=["offload=off"]))
        return medians(on, off, view, sizes)


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
    print(header())
    for size, (on, off) in results.items():
        print(row("", size, sizes[size], on, off, MIN_SPEEDUP_64M if size == 64 * MiB else None))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
