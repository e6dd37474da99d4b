"""Benchmark `cp` on Samba shares through offloadfs, with and without offload.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/smb.py [--quick]

The lab's smbd sits behind a 1 Gbit link (tc tbf), with a btrfs (vfs_btrfs),
an xfs and an ext4 share. For each share and size it times cp through a mount
with offload and through one with -o offload=off and prints the medians and
their ratio. Offload must never lose (on/off <= 1.05) and at 1 GiB on btrfs
and xfs it should win at least 50x; rows that miss are marked. Source files
are written on the server side and every copy gets a new name (deleted on
the server afterwards), so no run sees another's caches or leftovers.
"""

import argparse
import contextlib
import statistics

from offloadfs.lab.demo import timed_cp, write_file
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
KINDS = ("btrfs", "xfs", "ext4")
# size -> repetitions: enough for a median where a run is cheap.
SIZES = {KiB: 7, MiB: 7, 16 * MiB: 5, 128 * MiB: 3, GiB: 2}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
MAX_RATIO = 1.05
MIN_SPEEDUP_1G = 50


def label(size):
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size // unit} {name}"
    return f"{size} B"


def cp_once(mnt, share, src, dst):
    """Seconds of cp src dst in the mount; the copy is deleted on the server."""
    seconds = timed_cp(mnt / src, mnt / dst)
    (share / dst).unlink()
    return seconds


def measure(server, kind, sizes):
    """{size: (median on, median off)} on share `kind`."""
    share = server.shares[kind].path
    for size in sizes:
        write_file(share / f"src-{size}", size)
    results = {}
    with contextlib.ExitStack() as stack:
        on = stack.enter_context(share_mount(server, kind))
        off = stack.enter_context(share_mount(server, kind, ["offload=off"]))
        for size, reps in sizes.items():
            src = f"src-{size}"
            times_on, times_off = [], []
            # Alternate the two so that a busy moment on the machine hits both alike.
            for i in range(reps):
                times_on.append(cp_once(on, share, src, f"{src}.on{i}"))
                times_off.append(cp_once(off, share, src, f"{src}.off{i}"))
            results[size] = (statistics.median(times_on), statistics.median(times_off))
            (share / src).unlink()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only, few repetitions")
    sizes = QUICK if parser.parse_args().quick else SIZES
    with samba_lab(KINDS, rate=RATE) as lab:
        table = {kind: measure(lab.server, kind, sizes) for kind in KINDS}
    print(f"cp through offloadfs on Samba shares, {RATE} link; median seconds")
    print(f"  {'share':6} {'size':>8} {'reps':>5} {'offload on':>11} {'offload=off':>12} {'off/on':>8} {'on/off':>7}")
    for kind, rows in table.items():
        for size, (on, off) in rows.items():
            ratio = on / off
            marks = []
            if ratio > MAX_RATIO:
                marks.append(f"offload slower (> {MAX_RATIO})")
            if size == GiB and kind != "ext4" and off / on < MIN_SPEEDUP_1G:
                marks.append(f"under {MIN_SPEEDUP_1G}x")
            print(f"  {kind:6} {label(size):>8} {sizes[size]:>5} {on:11.4f} {off:12.4f} {off / on:7.1f}x "
                  f"{ratio:7.2f}  {'; '.join(marks)}")


if __name__ == "__main__":
    main()
