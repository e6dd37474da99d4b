"""What the cp benchmarks share: timing cp with and without offload side by side, and printing rows."""
import statistics

from offloadfs.lab.demo import timed_cp

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_RATIO = 1.05  # offload must never lose


def label(size):
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size // unit} {name}"
    return f"{size} B"


def medians(on, off, store, sizes):
    """{size: (median s with offload, median s without)} of cp src-SIZE inside mounts ``on`` and ``off``.

    The two alternate, so that a busy moment on the machine hits both alike; every copy gets a new name
    and is removed through ``store`` (where the files are seen without either mount's caches).
    """
    results = {}
    for size, reps in sizes.items():
        src = f"src-{size}"
        times = {"on": [], "off": []}
        for i in range(reps):
            for tag, mnt in (("on", on), ("off", off)):
                dst = f"{src}.{tag}{i}"
                times[tag].append(timed_cp(mnt / src, mnt / dst))
                (store / dst).unlink()
        results[size] = (statistics.median(times["on"]), statistics.median(times["off"]))
        (store / src).unlink()
    return results


def header(first=""):
    return f"  {first:6} {'size':>8} {'reps':>5} {'offload on':>11} {'offload=off':>12} {'off/on':>8} {'on/off':>7}"


def row(first, size, reps, on, off, min_speedup=None):
    """One table line; marks a size where offload lost, or won less than ``min_speedup``."""
    marks = []
    if on / off > MAX_RATIO:
        marks.append(f"offload slower (> {MAX_RATIO})")
    if min_speedup and off / on < min_speedup:
        marks.append(f"under {min_speedup}x")
    return (f"  {first:6} {label(size):>8} {reps:>5} {on:11.4f} {off:12.4f} {off / on:7.1f}x "
            f"{on / off:7.2f}  {'; '.join(marks)}")
