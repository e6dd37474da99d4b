"""Benchmark `cp` on Samba shares through offloadfs: the planner choosing, the offload forced, no offload.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/smb.py [--quick]

The lab's smbd sits behind a 1 Gbit link (tc tbf), with a btrfs (vfs_btrfs),
an xfs and an ext4 share. For each share and size it times cp through a mount
where the planner chooses, one with -o offload=always and one with -o
offload=off and prints the medians, the planner's against the faster of the
other two, and the methods it chose each run (see cpbench.chosen). The
planner must never lose (on/best <= 1.05) and at 1 GiB on btrfs
and xfs it should win at least 50x; rows that miss are marked. Source files
are written on the server side and every copy gets a new name (deleted on
the server afterwards), so no run sees another's caches or leftovers.
"""

import argparse
import contextlib

from cpbench import MODES, GiB, KiB, MiB, header, medians, row
from offloadfs.lab.demo import write_file
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount

KINDS = ("btrfs", "xfs", "ext4")
# size -> repetitions: enough for a median where a run is cheap.
SIZES = {KiB: 7, MiB: 7, 16 * MiB: 5, 128 * MiB: 3, GiB: 2}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
MIN_SPEEDUP_1G = 50


def measure(server, kind, sizes):
    """{size: (median on, median off)} on share `kind`."""
    share = server.shares[kind].path
    for size in sizes:
        write_file(share / f"src-{size}", size)
    with contextlib.ExitStack() as stack:
        mounts = {tag: stack.enter_context(share_mount(server, kind, opts)) for tag, opts in MODES.items()}
        return medians(mounts, share, sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only, few repetitions")
    sizes = QUICK if parser.parse_args().quick else SIZES
    with samba_lab(KINDS, rate=RATE) as lab:
        table = {kind: measure(lab.server, kind, sizes) for kind in KINDS}
    print(f"cp through offloadfs on Samba shares, {RATE} link; median seconds")
    print(header("share"))
    for kind, rows in table.items():
        for size, result in rows.items():
            wanted = MIN_SPEEDUP_1G if size == GiB and kind != "ext4" else None
            print(row(kind, size, sizes[size], result, wanted))


if __name__ == "__main__":
    main()
