"""What every benchmark shares for its output: a progress display while it runs, and its results kept as
JSON and drawn as a PNG beside the table it prints.

A benchmark runs for minutes; without a display it looks hung.  Its printed table is for a person; the
JSON (with when, at which commit and with which arguments it was measured) is for tools and for
comparing runs, and the plot is what docs/benchmarks.md shows.  Results go to docs/benchmarks/ unless
``--out`` names another folder, so a run's output replaces the figures the docs show.
"""

import contextlib
import datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,  # noqa: E402
                           TimeRemainingColumn)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "benchmarks"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_live = None  # the Progress on screen: rich shows one live display at a time, so inner steps join it


def add_out_argument(parser):
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder for NAME.json and NAME.png (default: {DEFAULT_OUT.relative_to(ROOT)})")


class Steps:
    """One line of the progress display: ``done`` marks a step finished, ``say`` prints a line above it."""

    def __init__(self, bar, task):
        self._bar, self._task = bar, task

    def done(self, note=""):
        self._bar.update(self._task, advance=1, note=note)

    def say(self, text):
        self._bar.console.print(text, highlight=False)


@contextlib.contextmanager
def progress(description, total=None):
    """A progress line of ``total`` steps (None: unknown, a line that shows the time spent) on stderr,
    so that stdout keeps only the tables.  Inside another one it is a line of that display."""
    global _live
    if _live is not None:
        task = _live.add_task(description, total=total, note="")
        try:
            yield Steps(_live, task)
        finally:
            _live.remove_task(task)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        _live = bar
        try:
            yield Steps(bar, bar.add_task(description, total=total, note=""))
        finally:
            _live = None


def size_label(size):
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size >= unit:
            return f"{size // unit} {name}"
    return f"{size} B"


def figure(title, panels):
    """A figure of ``panels`` plots, at most three in a row; (figure, [axes])."""
    rows = -(-panels // 3)
    columns = -(-panels // rows)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False,
                             layout="constrained")
    fig.suptitle(textwrap.fill(title, 45 * columns))
    axes = list(axes.flat)
    for spare in axes[panels:]:
        spare.remove()
    return fig, axes[:panels]


def draw_sizes(ax, title, series, ylabel="seconds (median)"):
    """Lines of a value against size, both on log scales: ``series`` {label: {bytes: value}}."""
    for name, points in series.items():
        sizes = sorted(points)
        ax.plot(sizes, [points[s] for s in sizes], marker="o", label=name)
    every = sorted({s for points in series.values() for s in points})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(every, [size_label(s) for s in every])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    _plain_numbers(ax.yaxis)
    ax.set(title=title, xlabel="size", ylabel=ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")


def draw_bars(ax, title, groups, ylabel, log=False):
    """Grouped bars: ``groups`` {group: {series: value}}, a bar of each series in each group."""
    names = list(dict.fromkeys(name for values in groups.values() for name in values))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g, values in enumerate(groups.values()) if name in values]
        ax.bar(xs, [values[name] for values in groups.values() if name in values], width, label=name)
    ax.set_xticks(range(len(groups)), list(groups), fontsize="small")
    if log:
        ax.set_yscale("log")
        _plain_numbers(ax.yaxis)
    ax.set(title=title, ylabel=ylabel)
    ax.margins(y=0.3)  # room for the legend above the bars
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")


class _Plain(LogFormatter):
    """Log-scale ticks as 0.5, 2, 300 rather than 5x10^-1: the tables print them so."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:g}"


def _plain_numbers(axis):
    axis.set_major_formatter(_Plain())
    axis.set_minor_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _commit():
    """The commit measured, with '+' where the tree had changes; None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "") if head else None


def save(out, name, results, fig):
    """OUT/NAME.json (``results`` with when, at which commit and with which arguments they were
    measured) and OUT/NAME.png (``fig``); prints where they went, on stderr."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name,
              "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": _commit(), "arguments": sys.argv[1:], "results": results}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    fig.savefig(out / f"{name}.png", dpi=90)
    plt.close(fig)
    print(f"results: {out / name}.json, {out / name}.png", file=sys.stderr)
