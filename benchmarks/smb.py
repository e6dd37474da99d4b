"""Benchmark `cp` on Samba shares through offloadfs: the planner choosing, the offload forced, no offload.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/smb.py [--quick] [--out DIR]

The lab's smbd sits behind a 1 Gbit link (tc tbf), with a btrfs (vfs_btrfs),
an xfs and an ext4 share. For each share and size it times cp through a mount
where the planner chooses, one with -o offload=always and one with -o
offload=off and prints the medians, the planner's against the faster of the
other two, and the methods it chose each run (see cpbench.chosen). The
planner must never lose (on/best <= 1.05) and at 1 GiB on btrfs
and xfs it should win at least 50x; rows that miss are marked. Source files
are written on the server side and every copy gets a new name (deleted on
the server afterwards), so no run sees another's caches or leftovers.

A last table puts offloadfs's `cp` of 1 KiB and 1 MiB inside the xfs share beside the same `cp` through
`rclone mount` and smbnetfs (peers.py), the three taking turns: goal (issue #8) no slower than the faster
peer. The results go to OUT/smb.json and a plot of them to OUT/smb.png (report.py).
"""

import argparse
import contextlib
import statistics
import tempfile

import cpbench
import report
from cpbench import MODES, GiB, KiB, MiB, header, label, medians, row
from offloadfs.lab.demo import timed_cp, write_file
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount
from peers import install_peers, rclone_mount, smbnetfs_mount

KINDS = ("btrfs", "xfs", "ext4")
# size -> repetitions: each order of the three mounts as often (cpbench.medians).
SIZES = {KiB: 12, MiB: 12, 16 * MiB: 6, 128 * MiB: 6, GiB: 6}
QUICK = {KiB: 3, MiB: 3, 16 * MiB: 1}
MIN_SPEEDUP_1G = 50
PEER_KIND = "xfs"
PEER_SIZES = {KiB: 9, MiB: 9}


def measure(server, kind, sizes):
    """{size: (median on, median off)} on share `kind`."""
    share = server.shares[kind].path
    for size in sizes:
        write_file(share / f"src-{size}", size)
    with contextlib.ExitStack() as stack:
        mounts = {tag: stack.enter_context(share_mount(server, kind, opts)) for tag, opts in MODES.items()}
        return medians(mounts, share, sizes)


def against_peers(server, sizes):
    """{size: {tool: median s}} of cp inside the PEER_KIND share through offloadfs, rclone mount and smbnetfs."""
    share = server.shares[PEER_KIND].path
    for size in sizes:
        write_file(share / f"peer-{size}", size)  # before rclone's directory cache first looks
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="offloadfs-smbbench-"))
        mounts = {"offloadfs": stack.enter_context(share_mount(server, PEER_KIND, [])),
                  "rclone mount": stack.enter_context(rclone_mount(server, PEER_KIND, workdir))[0],
                  "smbnetfs": stack.enter_context(smbnetfs_mount(server, PEER_KIND, workdir))[0]}
        results = {}
        with report.progress("cp beside the peers", total=len(mounts) * sum(sizes.values())) as steps:
            for size, reps in sizes.items():
                src = f"peer-{size}"
                times = {tool: [] for tool in mounts}
                tools = list(mounts)
                for i in range(reps):
                    for tool in tools[i % len(tools):] + tools[:i % len(tools)]:
                        dst = f"{src}.{i}.{tool.split()[0]}"
                        times[tool].append(timed_cp(mounts[tool] / src, mounts[tool] / dst))
                        (share / dst).unlink()
                        steps.done(f"{label(size)} {tool}")
                (share / src).unlink()
                results[size] = {tool: statistics.median(t) for tool, t in times.items()}
    return results


def save(out, table, peers):
    """OUT/smb.json and OUT/smb.png: cp on each share, and beside the peers, against size."""
    fig, axes = report.figure(f"cp through offloadfs on Samba shares, {RATE} link", len(table) + 1)
    for ax, (kind, rows) in zip(axes, table.items()):
        cpbench.draw(ax, f"{kind} share", rows)
    report.draw_sizes(axes[-1], f"{PEER_KIND} share, beside the peers",
                      {tool: {size: times[tool] for size, times in peers.items()} for tool in next(iter(peers.values()))})
    results = {"link": RATE, "shares": {kind: cpbench.as_json(rows) for kind, rows in table.items()},
               "peers": [{"bytes": size, "size": label(size), "median_seconds": times} for size, times in peers.items()]}
    report.save(out, "smb", results, fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only, few repetitions")
    report.add_out_argument(parser)
    args = parser.parse_args()
    quick = args.quick
    sizes = QUICK if quick else SIZES
    peer_sizes = {size: 3 for size in PEER_SIZES} if quick else PEER_SIZES
    install_peers()
    with samba_lab(KINDS, rate=RATE) as lab:
        table = {kind: measure(lab.server, kind, sizes) for kind in KINDS}
        peers = against_peers(lab.server, peer_sizes)
    print(f"cp through offloadfs on Samba shares, {RATE} link; median seconds")
    print(header("share"))
    for kind, rows in table.items():
        for size, result in rows.items():
            wanted = MIN_SPEEDUP_1G if size == GiB and kind != "ext4" else None
            print(row(kind, size, sizes[size], result, wanted))
    print(f"\ncp inside the {PEER_KIND} share beside the peers, {RATE} link; median seconds")
    print(f"  {'size':>8} {'reps':>5} {'offloadfs':>10} {'rclone mount':>13} {'smbnetfs':>9} {'ours/peer':>10}")
    for size, medians_ in peers.items():
        ratio = medians_["offloadfs"] / min(medians_["rclone mount"], medians_["smbnetfs"])
        print(f"  {label(size):>8} {peer_sizes[size]:>5} {medians_['offloadfs']:10.4f} {medians_['rclone mount']:13.4f} "
              f"{medians_['smbnetfs']:9.4f} {ratio:10.2f}{'  slower than a peer' if ratio > 1 else ''}")
    save(args.out, table, peers)


if __name__ == "__main__":
    main()
