"""What `offloadfs status` shows a person, worked out from the documented JSON."""
import io
import time

from rich.console import Console

from offloadfs import statusview
from offloadfs.stats import METHODS, OFFLOADS, Stats

COLUMNS = 80


def test_snapshot_adds_rate_time_left_and_bytes_kept_off_the_network(monkeypatch):
    stats = Stats("/mnt", {"source": "/srv"})
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    copy = stats.start_copy("a", "b", 1000)
    stats.moved(copy, "server_copy", 100, True)
    stats.moved(copy, "stream", 150, True)
    monkeypatch.setattr(time, "time", lambda: 1005.0)
    snap = stats.snapshot()
    (flying,) = snap["copies_in_flight"]
    assert flying["bytes_per_second"] == 50.0 and flying["seconds_left"] == 15.0
    assert snap["counters"]["bytes_kept_off_network"] == 200
    stats.start_copy("c", "d", 10)
    assert stats.snapshot()["copies_in_flight"][1]["seconds_left"] is None  # nothing moved yet


def test_text_names_paths_percent_rate_and_time_left(monkeypatch):
    stats = Stats("/mnt/x", {"fast": "/srv/btrfs"})
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    copy = stats.start_copy("fast/big", "fast/copy", 1 << 30)
    stats.moved(copy, "stream", 512 << 20, True)
    clone = stats.start_copy("fast/a", "fast/b", 3 << 20)
    stats.moved(clone, "clone", 3 << 20, True)
    stats.end_copy(clone, False)
    monkeypatch.setattr(time, "time", lambda: 1004.0)
    out = statusview.text([stats.snapshot(), "/mnt/y: the daemon is gone; run 'offloadfs umount /mnt/y'"])
    assert "  copies: 2 requests, 0 errors, 6.0 MiB kept off the network\n" in out
    assert ("    #1 stream /mnt/x/fast/big -> /mnt/x/fast/copy\n"
            "       50% 512.0 MiB of 1.0 GiB, 128.0 MiB/s, 4s left\n") in out
    assert out.endswith("\n/mnt/y: the daemon is gone; run 'offloadfs umount /mnt/y'")


def test_sizes_and_durations():
    assert [statusview.size(n) for n in (0, 1023, 1024, 1536 << 20, 5 << 40)] == \
        ["0 B", "1023 B", "1.0 KiB", "1.5 GiB", "5.0 TiB"]
    assert [statusview.duration(s) for s in (None, 0.4, 59, 61, 3600 * 2 + 60 * 5)] == \
        ["?", "0s", "59s", "1m01s", "2h05m"]


def test_text_shows_recognised_copies_by_method_and_what_was_written_after_all():
    stats = Stats("/mnt/x", {"s": "smb://h/s"})
    stats.recognised_bytes = 10 << 20
    stats.recognised_committed["server_copy"] = 6 << 20
    stats.recognised_committed["clone"] = 1 << 20
    stats.recognised_written = 3 << 20
    stats.recognised_verified = 6 << 20
    out = statusview.text([stats.snapshot()])
    assert "  recognised copies: 10.0 MiB recognised, 7.0 MiB committed\n" in out
    assert "    6.0 MiB read back, 3.0 MiB written after all\n" in out
    assert "    clone              1.0 MiB\n" in out
    assert "    server_copy        6.0 MiB\n" in out
    assert "    inter_server_copy" not in out.split("recognised copies:")[1]  # no line for what moved nothing


def widest(monkeypatch):
    """A mount up for a day, with counts and sizes as wide as they get, and a copy in flight."""
    monkeypatch.setattr(time, "time", lambda: 1000.0)
    stats = Stats("/mnt/data", {"fast": "/srv/btrfs", "nas": "smb://backup@nas/data"})
    stats.copy_requests, stats.copy_errors = 12345678, 123456
    for method in METHODS:
        stats.copies[method], stats.copy_bytes[method] = 12345678, 1023 << 40
    stats.fuse_read_bytes = stats.fuse_write_bytes = 1023 << 40
    stats.recognised_bytes = stats.recognised_verified = stats.recognised_written = 1023 << 40
    for method in OFFLOADS:
        stats.recognised_committed[method] = 1023 << 40
    copy = stats.start_copy("fast/big", "nas/copy", 1023 << 30)
    stats.moved(copy, "inter_server_copy", 1000 << 30, True)
    monkeypatch.setattr(time, "time", lambda: 1000.0 + 86399)
    return stats.snapshot()


def test_text_fits_80_columns(monkeypatch):
    """Issue #31: the recognised line wrapped at 80 columns."""
    lines = statusview.text([widest(monkeypatch)]).splitlines()
    assert [line for line in lines if len(line) > COLUMNS] == []


def test_watch_fits_80_columns_unwrapped(monkeypatch):
    """What --watch draws on an 80-column terminal: each line of the text view whole on a line of
    its own (rich wraps a long one), and the bar with its progress on one line."""
    snap = widest(monkeypatch)
    screen = io.StringIO()
    Console(file=screen, width=COLUMNS, color_system=None).print(statusview._live([snap]))
    drawn = [line.rstrip() for line in screen.getvalue().splitlines()]
    text = statusview.text([snap]).splitlines()
    assert [line for line in text if line.rstrip() not in drawn and "%" not in line] == []
    progress = next(line.strip() for line in text if "%" in line)
    assert any(line.endswith(progress) and "\u2501" in line for line in drawn), "\n".join(drawn)
