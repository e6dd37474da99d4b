"""Benchmark tools that copy with read()+write() through offloadfs: recognised copies against sent bytes.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/detect.py [--size 64M] [--places smb,nfsd] [--links asymmetric] [--out DIR]

rsync -a of one big file (--size, default 1 GiB), shutil.copyfile of it, and `tar c | tar x` of a tree of
16 files as big in all, inside one share: a btrfs and an xfs share of the lab's smbd (`--places smb`, the
default) and the lab's nfsd guest (`nfsd`: qemu TCG, slow), each through three mounts: default (copies recognised and done on the
server), -o trust_leases (recognised copies under a lease not read back), -o detect_copies=off (every byte
goes up) and -o offload=off (--modes picks some). Once on a symmetric 1 Gbit link and
once on net.ASYMMETRIC (1 Gbit down, 50 Mbit up: a laptop at home), where the upload is the bottleneck:
at 1 GiB the runs without recognition take about 3 min each there, some 40 min in all. Every run gets a
fresh mount and a new destination, checked against its source and removed on the server side afterwards.
A row whose copy came out wrong is marked. The results go to OUT/detect.json and a plot of the seconds
to OUT/detect.png (report.py).
"""

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import time

import report
from cpbench import GiB, label
from offloadfs.lab.demo import write_file
from offloadfs.lab.mount import offloadfs_mount, status
from offloadfs.lab.net import ASYMMETRIC
from offloadfs.lab.nfsd import nfsd_lab
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, amount, share_mount

KINDS = ("btrfs", "xfs")
LINKS = {"symmetric": ("1 Gbit both ways", RATE), "asymmetric": ("1 Gbit down, 50 Mbit up", ASYMMETRIC)}
MODES = {"default": [], "trust_leases": ["trust_leases"], "detect_copies=off": ["detect_copies=off"],
         "offload=off": ["offload=off"]}
TREE_FILES = 16
NO_CACHE = ["attr_timeout=0", "entry_timeout=0"]
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_arg(text):
    """Bytes of "1G", "64M", "512K" or a plain number."""
    unit = UNITS.get(text[-1:].upper())
    return int(text[:-1]) * unit if unit else int(text)


def rsync(src, dst):
    subprocess.run(["rsync", "-a", src / "big", dst], check=True)


def copyfile(src, dst):
    shutil.copyfile(src / "big", dst)


def tar(src, dst):
    dst.mkdir()
    subprocess.run(f"tar -C '{src / 'tree'}' -cf - . | tar -C '{dst}' -xf -", shell=True, check=True)


def warm_up(mount_of, store):
    """One rsync -a through a default mount, not measured: the first copy in a lab's fresh share took
    2-6 s longer than the same copy after it, whatever the mount (rsync -a of 1 GiB, default mount:
    12.5-16.2 s first, 9.6-10.2 s after; rsync's own CPU 3.5-4.3 s against 1.4-1.9 s), and a read of the
    file first did not take that away."""
    with mount_of([]) as mnt:
        rsync(mnt, mnt / "warm-up")
    os.unlink(store / "warm-up")


TOOLS = {"rsync -a": (rsync, "big"), "shutil.copyfile": (copyfile, "big"), "tar c | tar x": (tar, "tree")}


def make_sources(root, size):
    """A file `big` of `size` bytes and a tree of TREE_FILES files as big in all, in two directories;
    on disk before it returns, so that no write-back runs under a measured copy."""
    write_file(root / "big", size)
    for i in range(TREE_FILES):
        part = root / "tree" / f"d{i % 2}"
        part.mkdir(parents=True, exist_ok=True)
        write_file(part / f"f{i}", size // TREE_FILES)
    os.sync()


def digests(path):
    """{relative path: sha256} of a file or of every file in a tree."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    result = {}
    for f in files:
        with open(f, "rb") as stream:
            result[str(f.relative_to(path))] = hashlib.file_digest(stream, "sha256").hexdigest()
    return result


def run(mount, link, store, tool, serial, wanted):
    """(seconds, bytes sent up, bytes received, recognised bytes, of those read back, right) of one tool
    in a fresh mount;
    ``wanted``: the digests of its source."""
    fn, source = TOOLS[tool]
    name = f"copy-{serial}"
    with mount() as mnt:
        before = link.counters()
        start = time.monotonic()
        fn(mnt, mnt / name)
        seconds = time.monotonic() - start
        after = link.counters()
        counters = status(mnt)["counters"]
    right = digests(store / name) == wanted
    (shutil.rmtree if (store / name).is_dir() else os.unlink)(store / name)
    return (seconds, after.tx - before.tx, after.rx - before.rx, counters.get("recognised_bytes", 0),
            counters.get("recognised_verified", 0), right)


def measure(place, mount_of, link, store, modes):
    """Rows (place, tool, mode, seconds, up, down, recognised, read back, right) of every tool through
    each of ``modes``."""
    rows, serial = [], 0
    with report.progress(place, total=len(TOOLS) * len(modes)) as steps:
        for tool, (_, source) in TOOLS.items():
            wanted = digests(store / source)  # once, not for each run: on the nfsd guest each read back is slow
            for mode in modes:
                options = MODES[mode]
                serial += 1
                result = run(lambda: mount_of(options), link, store, tool, serial, wanted)
                rows.append((place, tool, mode, *result))
                steps.say(f"  {place} {tool} {mode}: {result[0]:.2f} s, {amount(result[1])} up")
                steps.done(f"{tool} {mode}")
    return rows


def samba_rows(link_rate, size, modes):
    with samba_lab(KINDS, rate=link_rate) as lab:
        server = lab.server
        rows = []
        for kind in KINDS:
            store = server.shares[kind].path
            make_sources(store, size)
            warm_up(lambda options, kind=kind: share_mount(server, kind, options), store)
            rows += measure(f"smb-{kind}", lambda options, kind=kind: share_mount(server, kind, options),
                            server.net, store, modes)
        return rows


def nfsd_rows(link_rate, size, modes):
    with nfsd_lab(rate=link_rate) as lab, contextlib.ExitStack() as stack:
        url = f"nfs://{lab.guest.host}{lab.guest.export}"
        # Written and checked through a mount without caches: the guest's disk is not ours to look into.
        view = stack.enter_context(offloadfs_mount(url, options=NO_CACHE))
        make_sources(view, size)
        warm_up(lambda options: offloadfs_mount(url, options=options), view)
        return measure("nfsd", lambda options: offloadfs_mount(url, options=options), lab.net, view, modes)


def table(rows):
    """Lines: each run, its time and bytes up, and both beside the default mount's run of the same tool."""
    base = {(place, tool): (seconds, up) for place, tool, mode, seconds, up, *_ in rows if mode == "default"}
    lines = [f"  {'place':9} {'tool':16} {'mount':18} {'seconds':>8} {'up':>10} {'down':>10} {'recognised':>10} "
             f"{'read back':>10} {'time/default':>12} {'up/default':>10}"]
    for place, tool, mode, seconds, up, down, recognised, read_back, right in rows:
        base_s, base_up = base[place, tool]
        up_ratio = f"{up / base_up:9.1f}x" if base_up else f"{'-':>10}"
        lines.append(f"  {place:9} {tool:16} {mode:18} {seconds:8.2f} {amount(up):>10} {amount(down):>10} "
                     f"{amount(recognised):>10} {amount(read_back):>10} {seconds / base_s:11.1f}x {up_ratio}"
                     f"{'' if right else '  WRONG DATA'}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=size_arg, default=GiB, help="bytes of the big file and of the tree "
                        "(1G, 64M, ...; default 1G)")
    parser.add_argument("--places", type=lambda text: text.split(","), default=["smb"],
                        help="smb (the lab's btrfs and xfs shares), nfsd (its guest: slow) or both (smb,nfsd)")
    parser.add_argument("--links", type=lambda text: text.split(","), default=list(LINKS),
                        help="symmetric, asymmetric or both (the default: symmetric,asymmetric)")
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES),
                        help=f"the mounts compared, default first (default: {','.join(MODES)})")
    report.add_out_argument(parser)
    args = parser.parse_args()
    rows_of = {"smb": samba_rows, "nfsd": nfsd_rows}
    if not args.places or not set(args.places) <= rows_of.keys():
        parser.error(f"--places: a comma-separated list of {', '.join(rows_of)}")
    if not args.links or not set(args.links) <= LINKS.keys():
        parser.error(f"--links: a comma-separated list of {', '.join(LINKS)}")
    if not args.modes or args.modes[0] != "default" or not set(args.modes) <= MODES.keys():
        parser.error(f"--modes: default, then any of {', '.join(list(MODES)[1:])}")
    results = {}
    with report.progress("links", total=len(args.links)) as steps:
        for name, rate in (LINKS[link] for link in args.links):
            results[name] = [row for place in args.places for row in rows_of[place](rate, args.size, args.modes)]
            steps.done(name)
    for name, rows in results.items():
        print(f"\nread()+write() copies of {label(args.size)} through offloadfs, {name}; one run each")
        print("\n".join(table(rows)))
    save(args.out, args.size, results)


def save(out, size, results):
    """OUT/detect.json and OUT/detect.png: each tool's seconds through each mount, a plot a link."""
    fig, axes = report.figure(f"read()+write() copies of {label(size)} through offloadfs", len(results))
    for ax, (name, rows) in zip(axes, results.items()):
        groups = {}
        for place, tool, mode, seconds, *_ in rows:
            groups.setdefault(f"{tool}\n{place}", {})[mode] = seconds
        report.draw_bars(ax, name, groups, "seconds")
    fields = ("place", "tool", "mount", "seconds", "bytes_up", "bytes_down", "recognised", "read_back", "right")
    report.save(out, "detect", {"bytes": size, "links": {name: [dict(zip(fields, row)) for row in rows]
                                                         for name, rows in results.items()}}, fig)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
