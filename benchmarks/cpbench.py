"""What the cp benchmarks share: timing cp with offload (the planner choosing), with the offload forced
(`offload=always`) and without it (`offload=off`) side by side, and printing rows."""
import itertools
import os
import statistics
import subprocess

from offloadfs.lab.demo import timed_cp
from offloadfs.cli import read_status
from report import GiB, KiB, MiB, draw_sizes, progress
from report import size_label as label

MAX_RATIO = 1.05  # offload must never lose: against the faster of always and off
WARM = 8 << 20  # bytes each mount reads and writes before the runs (see warm)
MODES = {"on": [], "always": ["offload=always"], "off": ["offload=off"]}  # tag -> mount options
# One letter a method in the "chosen" column: what moved the bytes of each run, in order.
LETTERS = {"clone": "c", "server_copy": "s", "inter_server_copy": "i", "stream": "S"}


def chosen(before, after):
    """The methods that moved bytes between two status counters, as letters; '>' marks a switch."""
    moved = "".join(LETTERS[m] for m, n in after["copy_bytes"].items() if n > before["copy_bytes"][m])
    switched = any(after[k] > before[k] for k in ("switched_to_stream", "switched_to_offload"))
    return ">".join(moved) if switched else moved or "-"


def medians(mounts, store, sizes, src_dir="", dst_dir="", sources=None, fresh=False):
    """{size: ({tag: median s}, [method letters of each run with offload=on])} of cp
    src_dir/src-SIZE dst_dir/... through each of ``mounts`` ({tag: mountpoint}, tags of MODES).

    The mounts take turns, each run in another of their orders, so that each follows each other
    as often (the copy just before one can still keep the server busy: turned in one direction only,
    offload on came after offload=off's 1 GiB stream twice as often as `always` did, and its clones
    took 1.2x theirs), and a busy moment on the machine hits all alike; each begins with nothing
    left dirty by the ones before it (sync; with both, the medians of a server-side copy of 1 GiB
    on an ext4 share came out 0.30-0.31 s, where single copies had taken 0.3-4.7 s); every copy gets a new
    name and is removed through ``store`` (where the files are seen without the mounts' caches), the
    sources at the end through ``sources`` (default: ``store``).  ``fresh``: every run copies its own
    clone of the source (made by cp through ``sources``, where it clones), so that no run finds the
    source in a cache an earlier one filled (an inter-server copy's puller caches what it read).

    Each mount first reads and writes WARM bytes, as a mount in use has (see warm).
    """
    for mnt in mounts.values():
        warm(mnt, store, f"src-{max(sizes)}", src_dir, dst_dir)
    results = {}
    with progress("cp", total=len(mounts) * sum(sizes.values())) as steps:
        for size, reps in sizes.items():
            src = f"src-{size}"
            times = {tag: [] for tag in mounts}
            runs = []
            orders = list(itertools.permutations(mounts))
            for i in range(reps):
                for tag in orders[i % len(orders)]:
                    mnt = mounts[tag]
                    dst, copied = f"{src}.{tag}{i}", src
                    if fresh:
                        copied = f"{dst}.src"
                        subprocess.run(["cp", (sources or store) / src, (sources or store) / copied], check=True)
                    os.sync()
                    before = read_status(mnt)["counters"]
                    times[tag].append(timed_cp(mnt / src_dir / copied, mnt / dst_dir / dst))
                    if fresh:
                        ((sources or store) / copied).unlink()
                    if tag == "on":
                        runs.append(chosen(before, read_status(mnt)["counters"]))
                    (store / dst).unlink()
                    steps.done(f"{label(size)} {tag}")
            results[size] = ({tag: statistics.median(t) for tag, t in times.items()}, runs)
            ((sources or store) / src).unlink()
    return results


def warm(mnt, store, src, src_dir, dst_dir):
    """Read WARM bytes of ``src`` and write as many new ones through ``mnt`` (removed through
    ``store``).  A mount's first reads and writes leave it slower for a while after, by some 0.4 ms
    a copy of 128 MiB on an xfs share (why, not found): offload on, which alone
    had streamed (to learn what streaming costs), came out 1.06-1.10x `always` with the same copies,
    0.98x once both had.  A mount in use has carried reads and writes, from which the planner
    learns what streaming costs."""
    with open(mnt / src_dir / src, "rb") as f:
        f.read(WARM)
    (mnt / dst_dir / "warm").write_bytes(os.urandom(WARM))
    (store / "warm").unlink()


def header(first=""):
    return (f"  {first:6} {'size':>8} {'reps':>5} {'offload on':>11} {'always':>9} {'offload=off':>12} "
            f"{'on/best':>8} {'off/on':>8}  chosen")


def row(first, size, reps, result, min_speedup=None):
    """One table line; marks a size where the planner lost against the faster of always and off
    (by over MAX_RATIO), or won less than ``min_speedup`` against off."""
    medians, runs = result
    on, always, off = medians["on"], medians["always"], medians["off"]
    marks = []
    if on / min(always, off) > MAX_RATIO:
        marks.append(f"planner slower (> {MAX_RATIO})")
    if min_speedup and off / on < min_speedup:
        marks.append(f"under {min_speedup}x")
    return (f"  {first:6} {label(size):>8} {reps:>5} {on:11.4f} {always:9.4f} {off:12.4f} "
            f"{on / min(always, off):8.2f} {off / on:7.1f}x  {' '.join(runs)}  {'; '.join(marks)}")


NAMES = {"on": "offload on", "always": "offload=always", "off": "offload=off"}  # MODES' tags, as the tables say


def as_json(results):
    """``medians``'s results, for report.save: a row a size."""
    return [{"bytes": size, "size": label(size), "median_seconds": {NAMES[tag]: s for tag, s in times.items()},
             "chosen": runs} for size, (times, runs) in results.items()]


def draw(ax, title, results):
    """``medians``'s results as seconds against size, a line a mode."""
    draw_sizes(ax, title, {NAMES[tag]: {size: times[tag] for size, (times, _) in results.items()} for tag in MODES})
