"""Benchmark the memory of each client's daemon under parallel sequential I/O on a Samba share.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/memory.py [--quick] [--copies] [--out DIR]

One lab smbd behind smbdemo's 1 Gbit link serves an xfs share; offloadfs, `rclone mount` and smbnetfs
(peers.py) each mount it. On each mount in turn, 16 writers (`dd bs=1M` of 64 MiB each, new files) and 16
readers (`dd bs=1M` of 64 MiB files written on the server's side beforehand, so no client has them
cached) run at once. The resident memory of the daemon's processes (VmRSS, summed over its session) is
sampled every 50 ms: the table gives it before the load, its peak during it, and IDLE seconds after the
last dd ended. Writers copy files of random bytes from the local disk; every file written is checked on the
server. Goal (issue #8): offloadfs peak <= 150 MB,
idle <= 80 MB.

With --copies, offloadfs alone: four tools that copy with read() and write() (rsync -a twice,
shutil.copyfile, dd bs=1M) each copy a file of 1 GiB (--quick: 64 MiB) at once inside a btrfs share,
through a default mount, so their data is recognised and held until it is cloned on the server
(recognise.py, issue #10): the daemon's memory before, at the peak and idle after, and what was
recognised; every copy is checked on the server.

The results go to OUT/memory.json (--copies: memory-copies.json) and a plot of them beside it (report.py).
"""

import argparse
import contextlib
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import report
from offloadfs.lab.mount import status
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, sha256, share_mount
from peers import install_peers, rclone_mount, smbnetfs_mount

KIND = "xfs"
MiB = 1 << 20
FULL = {"streams": 16, "mib": 64}
QUICK = {"streams": 4, "mib": 16}
IDLE = 5  # seconds after the load: what a daemon keeps while nothing happens
SAMPLE = 0.05
PEAK_GOAL, IDLE_GOAL = 150, 80  # MB


def session_rss(sid):
    """Resident bytes of the processes in session `sid`."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    total += int((entry / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


class Sampler:
    """The peak of session_rss(sid) while the `with` block runs, sampled in a thread."""

    def __init__(self, sid):
        self.sid, self.peak, self._done = sid, 0, threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, session_rss(self.sid))
            time.sleep(SAMPLE)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def load(root, tree, local, size):
    """The writers (of `local`'s files) and readers at once under `root` (the tool's view of the share);
    returns seconds."""
    (root / tree).mkdir()
    procs = []
    for i in range(size["streams"]):
        procs.append(subprocess.Popen(["dd", f"if={local / f'w{i}'}", f"of={root / tree / f'w{i}'}", "bs=1M",
                                       "status=none"]))
        procs.append(subprocess.Popen(["dd", f"if={root / 'sources' / f'r{i}'}", "of=/dev/null", "bs=1M",
                                       "status=none"]))
    start = time.monotonic()
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{p.args} failed")
    return time.monotonic() - start


def measure(name, root, sid, share, local, size):
    before = session_rss(sid)
    with Sampler(sid) as sampler:
        seconds = load(root, name, local, size)
    time.sleep(IDLE)
    idle = session_rss(sid)
    for i in range(size["streams"]):
        if (share / name / f"w{i}").read_bytes() != (local / f"w{i}").read_bytes():
            raise RuntimeError(f"{name}: w{i} on the server is not what was written")
    return before, max(sampler.peak, before), idle, seconds


COPY_KIND = "btrfs"
COPIERS = {
    "rsync -a": lambda src, dst: ["rsync", "-a", src, dst],
    "rsync -a (2)": lambda src, dst: ["rsync", "-a", src, dst],
    "shutil.copyfile": lambda src, dst: ["python3", "-c", "import shutil, sys; shutil.copyfile(*sys.argv[1:])",
                                         src, dst],
    "dd bs=1M": lambda src, dst: ["dd", f"if={src}", f"of={dst}", "bs=1M", "status=none"],
}


def copies(mib, out):
    """Peak memory of one default mount while the COPIERS run at once, each on a file of its own."""
    with samba_lab((COPY_KIND,), rate=RATE) as lab:
        share = lab.server.shares[COPY_KIND].path
        for i in range(len(COPIERS)):
            with open(share / f"src{i}", "wb") as f:
                for _ in range(mib):
                    f.write(os.urandom(MiB))
        with share_mount(lab.server, COPY_KIND) as mnt:
            sid = status(mnt)["pid"]
            before = session_rss(sid)
            with Sampler(sid) as sampler:
                start = time.monotonic()
                procs = [subprocess.Popen(argv(mnt / f"src{i}", mnt / f"dst{i}"))
                         for i, argv in enumerate(COPIERS.values())]
                if any(p.wait() for p in procs):
                    raise RuntimeError("a copy failed")
                seconds = time.monotonic() - start
            time.sleep(IDLE)
            idle = session_rss(sid)
            counters = status(mnt)["counters"]
        wrong = [tool for i, tool in enumerate(COPIERS) if sha256(share / f"dst{i}") != sha256(share / f"src{i}")]
    print(f"daemon memory, {len(COPIERS)} copies by read()+write() at once ({', '.join(COPIERS)}), "
          f"{mib} MiB each, inside a Samba {COPY_KIND} share behind a {RATE} link; MB resident")
    print(f"  {'before':>8}{'peak':>8}{f'idle {IDLE} s':>10}{'seconds':>9}  recognised, committed")
    print(f"  {before / 1e6:8.0f}{max(sampler.peak, before) / 1e6:8.0f}{idle / 1e6:10.0f}{seconds:9.1f}  "
          f"{counters['recognised_bytes'] / MiB:.0f} MiB, {counters['recognised_committed']}, "
          f"{counters['recognised_written']} B written instead")
    print("every copy right" if not wrong else f"WRONG DATA: {', '.join(wrong)}")
    title = f"daemon memory, {len(COPIERS)} recognised copies of {mib} MiB at once, Samba {COPY_KIND} share"
    save(out, "memory-copies", title, {"offloadfs": (before, max(sampler.peak, before), idle, seconds)},
         {"mib": mib, "copiers": list(COPIERS), "recognised_bytes": counters["recognised_bytes"],
          "recognised_committed": counters["recognised_committed"],
          "recognised_written": counters["recognised_written"], "wrong": wrong})


def save(out, name, title, rows, extra):
    """OUT/NAME.json and OUT/NAME.png: each daemon's resident MB before, at the peak and idle after."""
    fields = ("before", "peak", f"idle {IDLE} s")
    fig, (ax,) = report.figure(title, 1)
    report.draw_bars(ax, "", {tool: dict(zip(fields, (b / 1e6 for b in rss[:3]))) for tool, rss in rows.items()},
                     "MB resident")
    report.save(out, name, {**extra, "link": RATE, "daemons": {
        tool: {"before_bytes": before, "peak_bytes": peak, "idle_bytes": idle, "seconds": seconds}
        for tool, (before, peak, idle, seconds) in rows.items()}}, fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 + 4 streams of 16 MiB; copies of 64 MiB")
    parser.add_argument("--copies", action="store_true", help="offloadfs alone: recognised copies at once")
    report.add_out_argument(parser)
    args = parser.parse_args()
    if args.copies:
        with report.progress("copies at once"):
            copies(64 if args.quick else 1024, args.out)
        return
    size = QUICK if args.quick else FULL
    install_peers()
    rows = {}
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offloadfs-membench-")))
        server = stack.enter_context(samba_lab((KIND,), rate=RATE)).server
        share = server.shares[KIND].path
        local = workdir / "local"
        for where in (share / "sources", local):
            where.mkdir()
        for i in range(size["streams"]):
            (share / "sources" / f"r{i}").write_bytes(os.urandom(size["mib"] * MiB))
            (local / f"w{i}").write_bytes(os.urandom(size["mib"] * MiB))
        ours = stack.enter_context(share_mount(server, KIND))
        mounts = {
            "offloadfs": (ours, status(ours)["pid"]),
            "rclone mount": stack.enter_context(rclone_mount(server, KIND, workdir)),
            "smbnetfs": stack.enter_context(smbnetfs_mount(server, KIND, workdir)),
        }
        with report.progress("each tool under load", total=len(mounts)) as steps:
            for tool, (root, sid) in mounts.items():
                os.listdir(root)
                subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=True)
                rows[tool] = measure(tool.split()[0], root, sid, share, local, size)
                steps.done(tool)
    print(f"daemon memory, {size['streams']} writers + {size['streams']} readers of {size['mib']} MiB each "
          f"(dd bs=1M) on a Samba {KIND} share behind a {RATE} link; MB resident (VmRSS of the daemon's session)")
    print(f"  {'tool':14}{'before':>10}{'peak':>10}{f'idle {IDLE} s':>12}{'seconds':>10}")
    for tool, (before, peak, idle, seconds) in rows.items():
        print(f"  {tool:14}{before / 1e6:10.0f}{peak / 1e6:10.0f}{idle / 1e6:12.0f}{seconds:10.1f}")
    _, peak, idle, _ = rows["offloadfs"]
    print(f"offloadfs goals: peak <= {PEAK_GOAL} MB: {'met' if peak / 1e6 <= PEAK_GOAL else 'MISSED'}; "
          f"idle <= {IDLE_GOAL} MB: {'met' if idle / 1e6 <= IDLE_GOAL else 'MISSED'}")
    save(args.out, "memory", f"daemon memory, {size['streams']} writers + {size['streams']} readers of "
         f"{size['mib']} MiB each on a Samba {KIND} share", rows, {"size": size})


if __name__ == "__main__":
    main()
