"""The directory cache: what it saves, and that it never shows more than attr_timeout of the past.

Requests are counted with `offloadfs status --json` (counters "listings" and
"lookups_absent": what the filesystem asked its backend); changes made
elsewhere are made on the server's own view of the directory.
"""

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from offloadfs.filesystem import AHEAD

WHERE = ["local-ext4", "smb-ext4", "nfs-ganesha"]
LONG = ["attr_timeout=30", "entry_timeout=30"]  # counting tests: nothing may expire while they run


def _counter(mnt, name):
    return mnt.status()["counters"][name]


def _tree(root, dirs=3, files=5):
    for d in range(dirs):
        (root / f"d{d}").mkdir()
        for f in range(files):
            (root / f"d{d}" / f"f{f}").write_bytes(b"x" * (f + 1))


def _find(path):
    return sorted(subprocess.run(["find", path], check=True, capture_output=True, text=True,
                                 timeout=60).stdout.split())


@pytest.mark.parametrize("where", WHERE)
def test_a_second_find_within_attr_timeout_lists_nothing_again(where, mount_on):
    mnt = mount_on(where, LONG)
    _tree(mnt.backing)
    first = _find(mnt.path)
    listed, looked_up = _counter(mnt, "listings"), _counter(mnt, "lookups")
    assert listed >= 4
    assert _find(mnt.path) == first
    assert _counter(mnt, "listings") == listed
    if not where.startswith("local"):  # local listings carry no attributes: a lookup is a system call
        assert _counter(mnt, "lookups") == looked_up  # READDIRPLUS answered from the listing


@pytest.mark.parametrize("where", WHERE)
def test_creating_files_costs_no_failing_lookups(where, mount_on):
    mnt = mount_on(where, LONG)
    (mnt.path / "d").mkdir()
    absent = _counter(mnt, "lookups_absent")
    subprocess.run(["sh", "-c", 'for i in $(seq 20); do echo $i > "$1/f$i"; done', "sh", mnt.path / "d"],
                   check=True, timeout=60)
    assert _counter(mnt, "lookups_absent") == absent
    assert sorted(os.listdir(mnt.backing / "d")) == sorted(f"f{i}" for i in range(1, 21))


@pytest.mark.parametrize("where", WHERE)
def test_a_name_found_absent_is_not_asked_for_again(where, mount_on):
    """cp asks for its destination twice before it makes it: its stat, then the lookup the kernel
    makes for an O_EXCL open whatever it holds.  The server's "no such file" answers the second
    too, in a directory we hold no listing of; our own create makes the name at once."""
    mnt = mount_on(where, LONG)
    (mnt.backing / "d").mkdir()
    absent = _counter(mnt, "lookups_absent")
    with pytest.raises(FileNotFoundError):
        os.stat(mnt.path / "d" / "new")
    os.close(os.open(mnt.path / "d" / "new", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    assert _counter(mnt, "lookups_absent") == absent + 1
    assert os.stat(mnt.path / "d" / "new").st_size == 0
    assert (mnt.backing / "d" / "new").exists()


@pytest.mark.parametrize("where", WHERE)
def test_a_name_found_absent_shows_within_attr_timeout_once_made_elsewhere(where, mount_on):
    mnt = mount_on(where)  # attr_timeout=1
    (mnt.backing / "d").mkdir()
    with pytest.raises(FileNotFoundError):
        os.stat(mnt.path / "d" / "new")
    (mnt.backing / "d" / "new").write_bytes(b"n")
    assert _wait_for(lambda: os.path.exists(mnt.path / "d" / "new"), 1.5)


def _wait_for(what, timeout):
    """what() once it holds, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not (value := what()) and time.monotonic() < end:
        time.sleep(0.1)
    return value


@pytest.mark.parametrize("where", WHERE)
def test_another_clients_changes_show_within_attr_timeout(where, mount_on):
    mnt = mount_on(where)  # attr_timeout=1
    for name in ("gone", "old"):
        (mnt.backing / name).write_bytes(b"x")
    assert sorted(os.listdir(mnt.path)) == ["gone", "old"]
    with pytest.raises(FileNotFoundError):
        os.stat(mnt.path / "new")  # a negative answer the kernel and the daemon may keep
    (mnt.backing / "new").write_bytes(b"n")
    (mnt.backing / "gone").unlink()
    (mnt.backing / "old").rename(mnt.backing / "renamed")
    time.sleep(1.5)  # attr_timeout, with room for the server's own caches
    assert sorted(os.listdir(mnt.path)) == ["new", "renamed"]
    assert os.stat(mnt.path / "new").st_size == 1
    for name in ("gone", "old"):
        with pytest.raises(FileNotFoundError):
            os.stat(mnt.path / name)
    # A lookup alone, without a listing in between, sees the next one too.
    (mnt.backing / "newer").write_bytes(b"nn")
    assert _wait_for(lambda: os.path.exists(mnt.path / "newer"), 1.5)


@pytest.mark.parametrize("where", WHERE)
def test_our_own_changes_show_at_once(where, mount_on):
    mnt = mount_on(where, LONG)
    p = mnt.path
    (p / "a").write_bytes(b"a")
    (p / "b").write_bytes(b"b")
    assert sorted(os.listdir(p)) == ["a", "b"]
    (p / "c").write_bytes(b"c")
    (p / "a").unlink()
    (p / "b").rename(p / "b2")
    (p / "dir").mkdir()
    (p / "dir" / "inner").write_bytes(b"i")
    assert sorted(os.listdir(p)) == ["b2", "c", "dir"]
    assert os.listdir(p / "dir") == ["inner"]
    (p / "dir" / "inner").rename(p / "moved")
    (p / "dir").rmdir()
    os.link(p / "c", p / "c2")
    expected = ["b2", "c", "c2", "moved"]
    assert sorted(os.listdir(p)) == sorted(expected)
    assert (p / "b2").read_bytes() == b"b"
    with pytest.raises(FileNotFoundError):
        os.stat(p / "a")
    with pytest.raises(OSError) as e:
        os.stat(p / "dir")
    assert e.value.errno == errno.ENOENT
    assert sorted(os.listdir(mnt.backing)) == sorted(expected)


@pytest.mark.parametrize("where", WHERE)
def test_our_write_shows_in_the_next_listing_at_once(where, mount_on):
    """The listing's attributes are older than the write: `ls -l` (READDIRPLUS) must not show them."""
    mnt = mount_on(where, LONG)
    (mnt.backing / "f").write_bytes(b"x")
    assert _ls_sizes(mnt.path)["f"] == 1
    (mnt.path / "f").write_bytes(b"y" * 1000)
    assert _ls_sizes(mnt.path)["f"] == 1000
    assert os.stat(mnt.path / "f").st_size == 1000


def _ls_sizes(path):
    out = subprocess.run(["ls", "-ln", path], check=True, capture_output=True, text=True, timeout=60).stdout
    return {line.split()[-1]: int(line.split()[4]) for line in out.splitlines()[1:]}


@pytest.mark.parametrize("where", WHERE)
def test_listed_attributes_are_the_files(where, mount_on):
    """`ls -l` takes its sizes and times from READDIRPLUS: they are the server's."""
    mnt = mount_on(where)
    for i in range(5):
        f = mnt.backing / f"f{i}"
        f.write_bytes(b"y" * (1000 * i + 7))
        os.utime(f, ns=(1_600_000_000_123_456_700 + i, 1_500_000_000_987_654_300 + i * 10**9))
    (mnt.backing / "sub").mkdir()
    out = subprocess.run(["ls", "-ln", "--time-style=+%s", mnt.path], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    listed = {line.split()[-1]: line.split() for line in out.splitlines()[1:]}
    for i in range(5):
        want = os.stat(mnt.backing / f"f{i}")
        assert int(listed[f"f{i}"][4]) == want.st_size
        assert int(listed[f"f{i}"][5]) == int(want.st_mtime)
        got = os.stat(mnt.path / f"f{i}")
        assert (got.st_size, mnt.stored_ns(got.st_mtime_ns)) == (want.st_size, mnt.stored_ns(want.st_mtime_ns))
    assert listed["sub"][0].startswith("d")


def test_an_nfs_listing_carries_what_readdirplus_needs(mount_on):
    """READDIR asks for each entry's attributes and filehandle: `ls -l` then looks up nothing."""
    mnt = mount_on("nfs-ganesha")
    _tree(mnt.backing, dirs=2, files=10)
    lookups = _counter(mnt, "lookups")
    subprocess.run(["ls", "-lR", mnt.path], check=True, capture_output=True, timeout=60)
    assert _counter(mnt, "lookups") == lookups


def test_a_listing_brings_the_directory_version_it_is_kept_by(mount_on):
    """A directory listed again past attr_timeout costs one round trip, and its handle's close after
    it: the listing's compound brings the directory's attributes (the version the listing is kept
    by, taken before it), and they answer the fstat opendir(3) makes before it reads."""
    mnt = mount_on("smb-ext4", ["attr_timeout=0.3", "entry_timeout=60"])
    (mnt.backing / "d").mkdir()
    (mnt.backing / "d" / "a").touch()
    assert os.listdir(mnt.path / "d") == ["a"]
    (mnt.backing / "d" / "b").touch()
    time.sleep(0.6)  # the listing and the directory's attributes are both past attr_timeout
    before = mnt.counters()
    assert sorted(os.listdir(mnt.path / "d")) == ["a", "b"]

    def trips():
        after = mnt.counters()
        closes = after["smb_requests"]["CLOSE"] - before["smb_requests"].get("CLOSE", 0)
        return closes and after["smb_round_trips"] - before["smb_round_trips"]
    assert _wait_for(trips, 30) == 2  # (the handle's close goes out after the listing: a hang guard)


def _listed_then_aged(mnt, dirs=3):
    """A tree listed once (`ls -lR`, attributes and all), then left past attr_timeout unchanged."""
    _tree(mnt.backing, dirs)
    time.sleep(1.1)  # else the listings are "racy" (cache.RACY_NS), and fetched again whatever the version
    subprocess.run(["ls", "-lR", mnt.path], check=True, capture_output=True, timeout=60)
    time.sleep(1.5)  # attr_timeout=1: the listings and every attribute in them are old now


@pytest.mark.parametrize("where", WHERE)
def test_a_find_past_attr_timeout_lists_no_unchanged_directory_of_files_again(where, mount_on):
    """`find` wants names only: a directory of files whose version is unchanged answers from its
    listing.  The top one, all subdirectories, is listed again: that brings their versions."""
    mnt = mount_on(where)
    _listed_then_aged(mnt)
    listed = _counter(mnt, "listings")
    assert len(_find(mnt.path)) == 1 + 3 + 15
    assert _counter(mnt, "listings") <= listed + 1


@pytest.mark.parametrize("where", WHERE)
def test_a_find_past_attr_timeout_reads_unchanged_directories_from_the_kernels_cache(where, mount_on):
    """An unchanged directory's names, as the kernel read them last, answer `find` from the kernel's
    own cache (no READDIR reaches the daemon); one another client changed is read again and shows
    the change.  The top one, listed again for its subdirectories' versions, is read again too."""
    mnt = mount_on(where)
    _listed_then_aged(mnt)
    (mnt.backing / "d1" / "new").write_bytes(b"n")
    read = _counter(mnt, "dir_reads")
    found = _find(mnt.path)
    assert str(mnt.path / "d1" / "new") in found and len(found) == 1 + 3 + 15 + 1
    assert _counter(mnt, "dir_reads") - read <= 2 + 2  # the top and d1: READDIRPLUS, then READDIR at the end


@pytest.mark.parametrize("where", WHERE)
def test_a_walk_that_stats_after_a_find_sees_fresh_attributes_listing_each_directory_once(where, mount_on):
    """After `find` got names only, `ls -l` and `stat` still see what another client wrote (a file's
    size moves its directory's version not at all), and `ls -l` fetches its directory's listing once
    rather than asking for each file."""
    mnt = mount_on(where)
    _listed_then_aged(mnt)
    (mnt.backing / "d1" / "f2").write_bytes(b"z" * 5000)
    os.truncate(mnt.backing / "d2" / "f3", 0)
    _find(mnt.path)
    listed, looked_up = _counter(mnt, "listings"), _counter(mnt, "lookups")
    sizes = _ls_sizes(mnt.path / "d1")
    assert sizes == {f"f{f}": 5000 if f == 2 else f + 1 for f in range(5)}
    assert _counter(mnt, "listings") <= listed + 1
    if not where.startswith("local"):
        assert _counter(mnt, "lookups") == looked_up
    assert os.stat(mnt.path / "d2" / "f3").st_size == 0
    out = subprocess.run(["du", "-ab", mnt.path], check=True, capture_output=True, text=True, timeout=60).stdout
    du = {os.path.relpath(line.split("\t")[1], mnt.path): int(line.split("\t")[0]) for line in out.splitlines()}
    assert du["d1/f2"] == 5000 and du["d2/f3"] == 0 and du["d0/f4"] == 5


@pytest.mark.parametrize("where", WHERE[1:])  # local listings carry no attributes: nothing to list ahead
def test_a_walk_that_stats_lists_the_next_directories_ahead_each_once(where, mount_on):
    """`du` after `find` (names alone) waits for each directory's listing; from the second on, the
    ones it will need are fetched ahead, side by side, and none twice.  They still show what another
    client wrote."""
    mnt = mount_on(where)
    _listed_then_aged(mnt, dirs=6)
    (mnt.backing / "d4" / "f1").write_bytes(b"z" * 3000)
    _find(mnt.path)
    listed, ahead = _counter(mnt, "listings"), _counter(mnt, "listings_ahead")
    out = subprocess.run(["du", "-ab", mnt.path], check=True, capture_output=True, text=True, timeout=60).stdout
    du = {os.path.relpath(line.split("\t")[1], mnt.path): int(line.split("\t")[0]) for line in out.splitlines()}
    assert du["d4/f1"] == 3000 and du["d5/f4"] == 5 and du["d0/f0"] == 1
    assert _counter(mnt, "listings_ahead") - ahead >= AHEAD  # more, unless the walk overtakes them
    assert _counter(mnt, "listings") - listed <= 6 + 1  # each directory once (and the top, if it aged)


@pytest.mark.parametrize("forgotten", [False, True], ids=["", "forgotten"])
@pytest.mark.parametrize("where", WHERE[1:])
def test_a_walk_over_a_tree_we_just_made_lists_the_next_directories_ahead(where, forgotten, mount_on):
    """Our own creates leave listings without attributes and without a version: `ls -lR` lists
    every directory again, and from the second on the next ones are fetched ahead, none twice;
    also once the kernel forgot the directories (drop_caches between `cp -r` and `ls -lR`)."""
    mnt = mount_on(where)
    _tree(mnt.path, dirs=6)
    time.sleep(1.5)  # past attr_timeout
    if forgotten:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
    listed, ahead = _counter(mnt, "listings"), _counter(mnt, "listings_ahead")
    out = subprocess.run(["ls", "-lR", mnt.path], check=True, capture_output=True, text=True, timeout=60).stdout
    assert sum(line.startswith("-") for line in out.splitlines()) == 6 * 5
    assert _counter(mnt, "listings_ahead") - ahead >= AHEAD  # more, unless the walk overtakes them
    assert _counter(mnt, "listings") - listed <= 6 + 1  # each directory once (and the top)


@pytest.mark.parametrize("where", WHERE)
def test_a_listing_outlives_the_kernel_forgetting_its_directory(where, mount_on):
    """drop_caches (or memory pressure) makes the kernel forget the directories it is not using; the
    daemon keeps their listings, which revalidate as before once the kernel looks them up again."""
    mnt = mount_on(where)
    _listed_then_aged(mnt)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    listed = _counter(mnt, "listings")
    assert len(_find(mnt.path)) == 1 + 3 + 15
    assert _counter(mnt, "listings") <= listed + 1


@pytest.mark.parametrize("where", WHERE)
def test_a_find_that_looks_up_a_forgotten_subdirectory_lists_nothing_again(where, mount_on):
    """A directory of many files and one subdirectory the kernel forgot: find looks the subdirectory
    up by name, which asks for it alone and does not take find for a walk that stats its files."""
    mnt = mount_on(where)
    for i in range(40):
        (mnt.backing / f"f{i}").write_bytes(b"x")
    (mnt.backing / "sub").mkdir()
    for i in range(3):
        (mnt.backing / "sub" / f"g{i}").write_bytes(b"y")
    time.sleep(1.1)  # not "racy" (cache.RACY_NS)
    subprocess.run(["ls", "-lR", mnt.path], check=True, capture_output=True, timeout=60)
    time.sleep(1.5)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    listed = _counter(mnt, "listings")
    assert len(_find(mnt.path)) == 1 + 40 + 1 + 3
    assert _counter(mnt, "listings") == listed
