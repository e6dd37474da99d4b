"""Benchmark metadata-heavy work on a Samba share: offloadfs against rclone mount and smbnetfs.

Not a test: it prints tables and asserts nothing. Run as root:
    .venv/bin/python benchmarks/metadata.py [--quick] [--out DIR]

One lab smbd (Debian's 4.17, or with --samba 4.22 the lab's 4.22, whose directory leases offloadfs holds)
behind smbdemo's 1 Gbit link serves an xfs share; offloadfs, `rclone mount` (options in
peers.RCLONE_OPTIONS) and smbnetfs each mount it. Every round each tool works on a fresh directory of its
own, so none sees another's caches, and the tools take turns step by step, so a busy moment on the machine
hits all alike, each going first in a round of its own. The steps: create (`cp -r` of a local tree of
4 KiB files into the mount), `ls -lR` after dropping the kernel's caches (echo 3 >
/proc/sys/vm/drop_caches; each daemon keeps its own, and the server's are read back on its side: see
warm_server), `ls -lR` again at once (warm) and again 5 s later (past attr_timeout; each tool runs its three
`ls -lR` back to back, as another's drop_caches would make its warm run cold), `find | wc -l`, `stat` of every file, `du -s`, a re-read of a
64 MiB file (written and read once through the mount before the clock starts, then read again: what a
tool caches across a close and an open), `cp` of a 1 KiB file within the tree, `rm -rf`.
Each step's result is checked against the tree on the server side. The programs a step runs are read into
the page cache before its clock starts (see warm_programs).

offloadfs is mounted twice: as it comes, and trusting leases as mount.cifs does by default: closetimeo=1 (an
SMB handle kept open a second after its last close, see SMBBackend.release) and dir_cache_timeout=30 (a
listing kept under a directory lease, on a server that has them: 4.22), both off by default in offloadfs.

The first table gives the median seconds over the rounds and offloadfs / the faster peer (goal: <= 1.0;
rows that miss are marked); the next three what each step put on the client's link while its clock ran,
both ways: packets (a proxy for round trips, as no tool counts its SMB requests) and MiB (the re-read's row
says whether a tool read the file again), and the CPU time each tool's daemon processes spent on it
(which, unlike seconds, other work on the machine barely moves). `offloadfs status --json` counts no FUSE
requests, so a last pass mounts offloadfs again with `-o debug` and counts its FUSE requests per
step and opcode from the log (logging every request slows it down; only the counts matter there).
The results go to OUT/metadata.json and a plot of the seconds to OUT/metadata.png (report.py).
"""

import argparse
import collections
import contextlib
import functools
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import report
from local import drop_caches
from offloadfs.lab.mount import status
from offloadfs.lab.samba import SAMBA_417, SAMBA_422, samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount
from peers import RCLONE_OPTIONS, install_peers, offloadfs_debug_mount, rclone_mount, smbnetfs_mount

KIND = "xfs"
FULL = {"files": 2000, "dirs": 20, "rounds": 6}
QUICK = {"files": 200, "dirs": 20, "rounds": 1}
FILE_SIZE = 4096
BIG = 64 << 20  # the file the re-read step reads
SMALL = 1024  # the file the cp step copies
STEPS = ("create", "ls -lR", "ls -lR warm", "ls -lR 5 s on", "find | wc", "stat", "du -s", "re-read", "cp 1 KiB",
         "rm -rf")
# Steps one tool runs back to back before the next takes its turn: another tool's cold `ls -lR` drops the
# kernel's caches of every mount, so a warm run after it would be a cold one.
TOGETHER = ("ls -lR", "ls -lR warm", "ls -lR 5 s on")
LATER = 5  # seconds before "ls -lR 5 s on": past attr_timeout (1 s), within dir_cache_timeout (30 s)
PEERS = ("rclone mount", "smbnetfs")
KEEP_OPEN = "offloadfs closetimeo=1,dir_cache_timeout=30"
KEEP_OPEN_OPTIONS = KEEP_OPEN.split()[1].split(",")
MAX_RATIO = 1.0
REQUEST = re.compile(r"<- (\w+) unique=")


def make_tree(root, files, dirs):
    """`files` files of FILE_SIZE bytes spread over `dirs` directories under root, on the local disk."""
    data = os.urandom(FILE_SIZE)
    for d in range(dirs):
        (root / f"d{d:02}").mkdir(parents=True)
    for i in range(files):
        (root / f"d{i % dirs:02}" / f"f{i:05}").write_bytes(data)


def run(*argv):
    """stdout of a command that must succeed."""
    return subprocess.run(list(map(str, argv)), check=True, capture_output=True, text=True).stdout


def check_tree(server_dir, local_tree):
    """The tree a tool wrote, as seen on the server itself: the same names and bytes as the local one."""
    def contents(root):
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    if contents(server_dir) != contents(local_tree):
        raise RuntimeError(f"{server_dir} on the server differs from {local_tree}")


def read_through(path):
    """Read a file to its end, as `cat` does; its length (as wc -c prints it)."""
    return run("sh", "-c", 'cat "$1" | wc -c', "sh", path)


def warm_programs():
    """Read the steps' programs into the page cache.  drop_caches (before each `ls -lR`) evicts them
    too, and the tools take turns: the first to run `find` after the last tool's `ls -lR` paid for
    reading sh, find and wc from disk (14 ms in a scratch run, near half of `find`'s time), and that
    was always offloadfs."""
    run("sh", "-c", "for p in cp ls find wc du rm; do $p --version; done")


def warm_server(share):
    """Read the share's directories and inodes back into the lab server's caches, on its side.
    drop_caches empties them with the client's (the lab's server and clients share one kernel),
    which no client's drop_caches does to a real file server: the tools that ask the server paid a
    cold disk that no user does (offloadfs's `find`: 0.022 s so, 0.014 s with the caches read back)."""
    run("ls", "-lR", share)


def step(name, local_tree, target, server_dir, files, dirs, meter=tuple):
    """Run step `name` on `target` (the tool's directory in its mount); check what it did; (seconds, and
    what each count `meter()` returns went up by while the clock ran)."""
    if name == "ls -lR":
        drop_caches()
        warm_server(server_dir.parent)
    elif name == "re-read":  # written through the mount: rclone sees no file made on the server for an hour
        run("cp", local_tree.parent / "big", target / "big")
        read_through(target / "big")  # the first read, for the tool to cache what it may
    elif name == "cp 1 KiB":
        run("cp", local_tree.parent / "small", target / "small")
    elif name == "ls -lR 5 s on":
        time.sleep(LATER)
    warm_programs()
    before = meter()
    start = time.monotonic()
    if name == "create":
        run("cp", "-r", local_tree, target)
    elif name.startswith("ls -lR"):
        out = run("ls", "-lR", target)
    elif name == "find | wc":
        out = run("sh", "-c", 'find "$1" | wc -l', "sh", target)
    elif name == "stat":
        out = run("sh", "-c", 'stat -c %s "$1"/*/* | wc -l', "sh", target)
    elif name == "du -s":
        run("du", "-s", target)
    elif name == "re-read":
        out = read_through(target / "big")
    elif name == "cp 1 KiB":
        run("cp", target / "small", target / "small-copy")
    else:
        run("rm", "-rf", target)
    seconds = time.monotonic() - start
    counted = [after - count for count, after in zip(before, meter())]
    if name == "create":
        check_tree(server_dir, local_tree)
    elif name.startswith("ls -lR") and sum(line.startswith("-") for line in out.splitlines()) != files:
        raise RuntimeError(f"ls -lR {target}: wrong number of files")
    elif name == "stat" and int(out) != files:
        raise RuntimeError(f"stat {target}/*/*: {out.strip()} files, wanted {files}")
    elif name == "re-read" and int(out) != BIG:
        raise RuntimeError(f"re-read {target}/big: {out.strip()} bytes, wanted {BIG}")
    elif name == "cp 1 KiB" and (server_dir / "small-copy").read_bytes() != (local_tree.parent / "small").read_bytes():
        raise RuntimeError(f"cp {target}/small: the copy differs on the server")
    elif name == "find | wc" and int(out) != files + dirs + 1:
        raise RuntimeError(f"find {target}: {out.strip()} entries, wanted {files + dirs + 1}")
    elif name == "rm -rf" and server_dir.exists():
        raise RuntimeError(f"rm -rf {target}: {server_dir} still there on the server")
    return (seconds, *counted)


def link_counts(net):
    """(packets, bytes) that crossed the client end of the lab link so far, both ways."""
    stats = Path("/sys/class/net", net.client_if, "statistics")
    return tuple(sum(int((stats / f"{way}_{what}").read_text()) for way in ("rx", "tx"))
                 for what in ("packets", "bytes"))


def counts(net, sid):
    """What measure() keeps of a step: (packets, bytes) on the client's link, CPU seconds of session `sid`."""
    return (*link_counts(net), session_cpu(sid))


def session_cpu(sid):
    """CPU seconds used so far by the processes of session `sid`, with their reaped children's."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:
                    ticks += sum(map(int, fields[11:15]))  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(server, mounts, local_tree, size):
    """{tool: {step: [(seconds, packets, MiB on the link, daemon CPU seconds) per round]}}.

    `mounts` maps tool -> (its view of the share, the session id of its daemon's processes).
    """
    share = server.shares[KIND].path
    results = {tool: collections.defaultdict(list) for tool in mounts}
    tools = list(mounts)
    for r in range(size["rounds"]):
        # Each tool goes first in a round of its own: of two mounts running the same code, the first to create
        # was some 10 % slower than the second in 5 rounds of 6, with or without `sync` and 3 s of quiet
        # before it (scratch A/B, cause not found), and offloadfs used to go first every time.
        order = tools[r % len(tools):] + tools[:r % len(tools)]
        for group in groups():
            for tool in order:
                root, sid = mounts[tool]
                tree = f"{tool.split()[0]}-{tools.index(tool)}-{r}"
                for name in group:
                    seconds, packets, nbytes, cpu = step(name, local_tree, root / tree, share / tree, size["files"],
                                                         size["dirs"], functools.partial(counts, server.net, sid))
                    results[tool][name].append((seconds, packets, nbytes / (1 << 20), cpu))
    return results


def groups():
    """STEPS, each alone but for those run TOGETHER."""
    out = []
    for name in STEPS:
        if name in TOGETHER and out and out[-1][0] in TOGETHER:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def requests_per_step(server, local_tree, size, workdir):
    """{step: Counter(opcode: count)} of offloadfs's FUSE requests, from a `-o debug` mount's log."""
    counts = {}
    share = server.shares[KIND].path
    with offloadfs_debug_mount(server, KIND, workdir) as (mnt, log):
        for name in STEPS:
            offset = log.stat().st_size
            step(name, local_tree, mnt / "debug", share / "debug", size["files"], size["dirs"])
            with open(log) as f:
                f.seek(offset)
                counts[name] = collections.Counter(REQUEST.findall(f.read()))
    return counts


def medians(results):
    """{tool: {step: [median seconds, packets, MiB on the link, CPU seconds]}} of ``measure``'s rounds."""
    return {tool: {name: [statistics.median(column) for column in zip(*runs)] for name, runs in steps.items()}
            for tool, steps in results.items()}


def save(out, results, requests, size):
    """OUT/metadata.json and OUT/metadata.png: each step's median seconds by tool."""
    median = medians(results)
    fig, (ax,) = report.figure(f"metadata on a Samba {KIND} share, {RATE} link: {size['files']} files of 4 KiB "
                               f"in {size['dirs']} directories", 1)
    report.draw_bars(ax, "", {name: {tool: median[tool][name][0] for tool in median} for name in STEPS},
                     f"seconds (median of {size['rounds']})", log=True)
    report.save(out, "metadata", {
        "link": RATE, "share": KIND, "size": size, "rclone_options": list(RCLONE_OPTIONS),
        "steps": {name: {tool: dict(zip(("seconds", "packets", "link_mib", "cpu_seconds"), median[tool][name]))
                         for tool in median} for name in STEPS},
        "fuse_requests": {name: dict(counter) for name, counter in requests.items()}}, fig)


def width(tool):
    """Characters of a tool's column."""
    return max(14, len(tool) + 2)


def print_tables(results, requests, size):
    median = medians(results)
    tools = list(median)
    print(f"metadata on a Samba {KIND} share behind a {RATE} link: {size['files']} files of 4 KiB in "
          f"{size['dirs']} directories; median of {size['rounds']} round(s); "
          f"rclone mount {' '.join(RCLONE_OPTIONS)}")
    print("seconds")
    heading = f"  {'step':12}" + "".join(f"{tool:>{width(tool)}}" for tool in tools)
    print(heading + f"{'offloadfs/peer':>16}")
    for name in STEPS:
        ours = median["offloadfs"][name][0]
        peer = min(median[tool][name][0] for tool in PEERS)
        mark = "  slower than a peer" if ours / peer > MAX_RATIO else ""
        print(f"  {name:12}" + "".join(f"{median[tool][name][0]:{width(tool)}.3f}" for tool in tools)
              + f"{ours / peer:16.2f}{mark}")
    for column, title, form in ((1, "packets on the client's link, both ways", ".0f"),
                                (2, "MiB on the client's link, both ways", ".2f"),
                                (3, "CPU seconds of each tool's daemon processes", ".2f")):
        print(title)
        print(heading)
        for name in STEPS:
            print(f"  {name:12}" + "".join(f"{median[tool][name][column]:{width(tool)}{form}}" for tool in tools))
    print("offloadfs FUSE requests per step (-o debug pass)")
    for name, counter in requests.items():
        top = ", ".join(f"{op} {n}" for op, n in counter.most_common())
        print(f"  {name:12} {sum(counter.values()):7}  {top}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 files, one round")
    parser.add_argument("--samba", choices=("4.17", "4.22"), default="4.17",
                        help="the server: 4.22 has SMB3 directory leases, which offloadfs holds")
    report.add_out_argument(parser)
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    install_peers()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offloadfs-metabench-")))
        local_tree = workdir / "tree"
        make_tree(local_tree, size["files"], size["dirs"])
        for name, length in (("big", BIG), ("small", SMALL)):
            (workdir / name).write_bytes(os.urandom(length))
        samba = SAMBA_422 if args.samba == "4.22" else SAMBA_417
        server = stack.enter_context(samba_lab((KIND,), rate=RATE, samba=samba)).server
        ours = stack.enter_context(share_mount(server, KIND))
        keeps_open = stack.enter_context(share_mount(server, KIND, KEEP_OPEN_OPTIONS))
        mounts = {
            "offloadfs": (ours, status(ours)["pid"]),  # the daemon leads a session of its own
            KEEP_OPEN: (keeps_open, status(keeps_open)["pid"]),
            "rclone mount": stack.enter_context(rclone_mount(server, KIND, workdir)),
            "smbnetfs": stack.enter_context(smbnetfs_mount(server, KIND, workdir)),
        }
        for root, _ in mounts.values():
            os.listdir(root)  # connected and logged in before the clock starts
        with report.progress(f"{size['rounds']} round(s) of {len(STEPS)} steps, then a -o debug pass"):
            results = measure(server, mounts, local_tree, size)
            requests = requests_per_step(server, local_tree, size, workdir)
    print_tables(results, requests, size)
    save(args.out, results, requests, size)


if __name__ == "__main__":
    main()
