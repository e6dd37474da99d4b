"""`offloadfs status` for people: a mount's counters and its copies in flight, once or live (--watch).

Works from the JSON snapshot alone (README, "Status"); rate and time left are
worked out here from ``bytes_done`` and ``started`` as the daemon does, so a
daemon started before an upgrade still shows them.
"""
import os
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .stats import progress

WATCH_INTERVAL = 0.5
BAR = 40  # columns of a progress bar at most


def size(n):
    """Negative too: recognised copies read back and written after all keep less than nothing off
    the network."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def duration(seconds):
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _header(status):
    c = status["counters"]
    lines = [f"{status['mountpoint']}: pid {status['pid']}, mounted {time.ctime(status['since'])}, "
             f"up {duration(time.time() - status['since'])}"]
    lines += [f"  source {name}: {url}" for name, url in status["sources"].items()]
    lines.append(f"  copies: {c['copy_requests']} requests, {c['copy_errors']} errors, "
                 f"{size(c['bytes_kept_off_network'])} kept off the network")
    lines += [f"    {method:<18} {count:>6} copies {size(c['copy_bytes'][method]):>12}"
              for method, count in c["copies"].items()]
    lines += _recognised(c)
    lines.append(f"  through FUSE: {size(c['fuse_read_bytes'])} read, {size(c['fuse_write_bytes'])} written")
    return lines


def _recognised(c):
    """Copies found in plain writes (recognise.py): committed by each offload, or written after all.
    Nothing from a daemon older than the counters."""
    if "recognised_bytes" not in c:
        return []
    by_method = c.get("recognised_committed", {})
    lines = [f"  recognised copies: {size(c['recognised_bytes'])} recognised, "
             f"{size(sum(by_method.values()))} committed",
             f"    {size(c.get('recognised_verified', 0))} read back, "
             f"{size(c.get('recognised_written', 0))} written after all"]
    lines += [f"    {method:<18} {size(n)}" for method, n in by_method.items() if n]
    return lines


def _copy(status, cp):
    """(the copy's first line, its progress line without the bar)."""
    mp = status["mountpoint"]
    p = progress(cp["bytes_done"], cp["bytes_total"], cp["started"], time.time())
    percent = 100 * cp["bytes_done"] // cp["bytes_total"] if cp["bytes_total"] else 100
    return (f"#{cp['id']} {cp['method']} {os.path.join(mp, cp['source'])} -> {os.path.join(mp, cp['destination'])}",
            f"{percent}% {size(cp['bytes_done'])} of {size(cp['bytes_total'])}, "
            f"{size(p['bytes_per_second'])}/s, {duration(p['seconds_left'])} left")


def text(statuses):
    """The view of each mount (a status dict, or a line saying why there is none), as plain text."""
    lines = []
    for status in statuses:
        if isinstance(status, str):
            lines.append(status)
            continue
        lines += _header(status)
        if status["copies_in_flight"]:
            lines.append("  in flight:")
        for cp in status["copies_in_flight"]:
            what, how = _copy(status, cp)
            lines += [f"    {what}", f"       {how}"]
    return "\n".join(lines)


def _live(statuses):
    parts = []
    for status in statuses:
        if isinstance(status, str):
            parts.append(Text(status))
            continue
        parts.append(Text("\n".join(_header(status))))
        if status["copies_in_flight"]:
            parts.append(Text("  in flight:"))
        for cp in status["copies_in_flight"]:
            what, how = _copy(status, cp)
            # The bar takes what the progress leaves of the line, up to BAR: whole lines at 80 columns.
            bars = Table.grid(padding=(0, 1))
            bars.add_column(width=5)
            bars.add_column(max_width=BAR)
            bars.add_column(no_wrap=True)
            bars.add_row("", ProgressBar(total=max(cp["bytes_total"], 1), completed=cp["bytes_done"], width=None),
                         how)
            parts += [Text(f"    {what}"), bars]
    return Group(*parts)


def watch(gather, ended):
    """Redraw ``gather()`` until interrupted.  ``ended`` from it, once drawn, is the mount gone
    (unmounted): said, and the watch is done; any other error ends it as that error (the daemon died)."""
    statuses = gather()
    with Live(_live(statuses), console=Console(), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(WATCH_INTERVAL)
                statuses = gather()
                live.update(_live(statuses), refresh=True)
        except KeyboardInterrupt:
            return 0
        except ended:
            pass
    for status in statuses:
        print(f"offloadfs: {status['mountpoint']}: the mount has ended", file=sys.stderr)
    return 0
