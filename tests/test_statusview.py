"""What `offloadfs status` shows a person, worked out from the documented JSON."""
import time

from offloadfs import statusview
from offloadfs.stats import Stats


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
    stats.copy_bytes["clone"] = 3 << 20
    monkeypatch.setattr(time, "time", lambda: 1004.0)
    out = statusview.text([stats.snapshot(), "/mnt/y: the daemon is gone; run 'offloadfs umount /mnt/y'"])
    assert "  copies: 1 requests, 0 errors, 6.0 MiB kept off the network\n" in out
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
    assert "  recognised copies: 10.0 MiB recognised, 7.0 MiB committed (6.0 MiB read back), 3.0 MiB written after all\n" in out
    assert "    clone              1.0 MiB\n" in out
    assert "    server_copy        6.0 MiB\n" in out
    assert "    inter_server_copy" not in out.split("recognised copies:")[1]  # no line for what moved nothing
