"""SMB3 directory leases (Samba 4.22): a directory's listing and the names it lacks, kept until the break.

Our mount lists a directory and holds a lease with read and handle caching on
it; Samba breaks the lease before another SMB client adds, removes or renames
a name in it.  The other client is a second offloadfs mount of the same
directory (its own connection).  Our mount's attribute and entry timeouts are
an hour: what it sees of another client's change comes from the break, never
from a clock.
"""

import contextlib
import os
import signal
import subprocess
import time

import pytest

from offloadfs.cli import read_status
from offloadfs.lab.mount import offloadfs_mount

KIND = "xfs"
HOLD = 30  # dir_cache_timeout=, as mount.cifs's default (ours is 0: a program on the server breaks no lease)
LONG = ["attr_timeout=3600", "entry_timeout=3600", f"dir_cache_timeout={HOLD}"]
BREAK_BOUND = 30  # seconds: a change that shows later came from no break (the timeouts are an hour)
HELD_LONG = ["attr_timeout=3600", "entry_timeout=3600", "dir_cache_timeout=3600"]  # the lease outlives BREAK_BOUND


@pytest.fixture
def two_mounts(smb422):
    """mounts(options) -> (ours, the other client's, the directory on the server): two mounts of one
    fresh directory of a 4.22 share, which holds a directory d with files f and g."""
    with contextlib.ExitStack() as stack:

        def make(options=LONG):
            url, path = smb422.fresh_dir(KIND)
            (path / "d").mkdir()
            for name in ("f", "g"):
                (path / "d" / name).write_bytes(b"x")
            ours = stack.enter_context(offloadfs_mount(url, options=[*options, *smb422.options()]))
            theirs = stack.enter_context(offloadfs_mount(url, options=smb422.options()))
            return ours, theirs, path

        yield make


def requests(mountpoint):
    """SMB requests the mount has sent, all commands together."""
    return sum(read_status(mountpoint)["counters"]["smb_requests"].values())


def seen(ours, names, bound=BREAK_BOUND):
    """Wait until ``ours``/d lists exactly ``names``, by readdir and by lookups of each name (the
    kernel's cache of names and of entries both), for at most ``bound`` seconds."""
    d = ours / "d"
    deadline = time.monotonic() + bound
    while True:
        listed = set(os.listdir(d))
        found = {n for n in ("f", "g", "new", "h") if os.path.exists(d / n)}
        if listed == found == names:
            return
        assert time.monotonic() < deadline, f"{d} lists {listed}, lookups find {found}, not {names}"
        time.sleep(0.05)


CHANGES = {
    "create": (lambda d: (d / "new").write_bytes(b"y"), {"f", "g", "new"}),
    "unlink": (lambda d: (d / "f").unlink(), {"g"}),
    "rename": (lambda d: (d / "g").rename(d / "h"), {"f", "h"}),
    "rename over": (lambda d: (d / "g").rename(d / "f"), {"f"}),
    "mkdir": (lambda d: (d / "new").mkdir(), {"f", "g", "new"}),
}


@pytest.mark.parametrize("change", CHANGES)
def test_another_clients_change_of_a_name_shows_at_the_break(two_mounts, change):
    """Listed and looked up (a name that is not there too: the kernel keeps that answer), then
    changed by the other client: our mount lists and looks up the change at once."""
    ours, theirs, _ = two_mounts()
    seen(ours, {"f", "g"})
    assert not os.path.exists(ours / "d" / "new")
    act, after = CHANGES[change]
    act(theirs / "d")
    seen(ours, after)


def test_each_change_shows_in_turn(two_mounts):
    """The lease is taken again with the next listing, and broken again by the next change."""
    ours, theirs, _ = two_mounts()
    seen(ours, {"f", "g"})
    d = theirs / "d"
    for act, after in ((lambda: (d / "new").write_bytes(b"y"), {"f", "g", "new"}),
                       (lambda: (d / "f").unlink(), {"g", "new"}),
                       (lambda: (d / "g").rename(d / "h"), {"new", "h"})):
        act()
        seen(ours, after)


def test_names_a_leased_listing_lacks_answer_past_attr_timeout_without_a_request(two_mounts):
    """attr_timeout=1: past it, a lookup of a name the listing lacks would have the directory's
    attributes asked for again, to revalidate the listing (the kernel keeps a "no such file" only
    for what is left of the listing's time).  Under the lease the kernel keeps it until the break,
    and nothing is asked."""
    ours, _, _ = two_mounts(["attr_timeout=1", "entry_timeout=3600", f"dir_cache_timeout={HOLD}"])
    d = ours / "d"
    assert sorted(os.listdir(d)) == ["f", "g"]
    names = ("absent", "new", "h")
    for name in names:
        assert not os.path.exists(d / name)
    time.sleep(2)
    before = requests(ours)
    for _ in range(3):
        for name in names:
            assert not os.path.exists(d / name)
    assert requests(ours) == before


def test_our_own_changes_keep_the_lease(two_mounts):
    """Our opens in the directory name its lease as their parent, so Samba breaks it for none of our
    own changes (the listing follows them itself): the lease is still held after them.  (A break
    would come before the reply to the change that caused it, on the same connection.)"""
    ours, _, _ = two_mounts()
    d = ours / "d"
    seen(ours, {"f", "g"})
    assert read_status(ours)["counters"]["smb_dir_leases"] == 1
    (d / "new").write_bytes(b"y")
    (d / "f").unlink()
    (d / "g").rename(d / "h")
    (d / "sub").mkdir()
    (d / "sub").rmdir()
    assert read_status(ours)["counters"]["smb_dir_leases"] == 1
    seen(ours, {"h", "new"})


def breaks(mountpoint):
    return read_status(mountpoint)["counters"]["smb_dir_lease_breaks"]


# Enough names that one we add keeps a listing: READDIRPLUS lists again once over an eighth of a listing's
# items came without attributes (cache.BARE_SHARE), as names we add do.
FILLER = [f"n{i:02}" for i in range(16)]


def test_our_own_link_keeps_the_lease(two_mounts):
    """A hard link adds a name to the directory: our link's open names the directory's lease as its
    parent, as our creates do, so Samba breaks no lease for it.  (The watch on the directory tells of the
    new name, ours too: the listing is fetched again, see test_a_program_on_the_server_shows_at_once.)"""
    ours, _, path = two_mounts()
    for name in FILLER:
        (path / "d" / name).write_bytes(b"")
    d = ours / "d"
    assert sorted(os.listdir(d)) == ["f", "g", *FILLER]
    os.link(d / "f", d / "l")
    assert sorted(os.listdir(d)) == ["f", "g", "l", *FILLER]
    assert breaks(ours) == 0


def test_our_own_rename_of_a_directory_keeps_the_leases(two_mounts):
    """The share's top, d and d/sub are listed, each under its lease.  Our rename of sub in d, then of
    d at the top, break none of them.  (The watches on the directories tell of the changed names,
    ours too: those listings are fetched again.)  What is below a renamed directory is listed
    again too: smbd refuses to rename a directory above a handle its process holds open, so those
    handles close first, and their leases end."""
    ours, _, path = two_mounts()
    (path / "d" / "sub").mkdir()
    (path / "d" / "sub" / "x").write_bytes(b"x")
    for name in FILLER:
        (path / name).write_bytes(b"")
        (path / "d" / name).write_bytes(b"")
    assert sorted(os.listdir(ours)) == ["d", *FILLER]
    assert sorted(os.listdir(ours / "d")) == ["f", "g", *FILLER, "sub"]
    assert os.listdir(ours / "d" / "sub") == ["x"]
    (ours / "d" / "sub").rename(ours / "d" / "moved")
    assert sorted(os.listdir(ours / "d")) == ["f", "g", "moved", *FILLER]
    assert os.listdir(ours / "d" / "moved") == ["x"]
    assert breaks(ours) == 0
    (ours / "d").rename(ours / "e")
    assert sorted(os.listdir(ours)) == ["e", *FILLER]
    assert sorted(os.listdir(ours / "e")) == ["f", "g", "moved", *FILLER]
    assert breaks(ours) == 0
    assert os.listdir(ours / "e" / "moved") == ["x"]


def test_a_lost_connection_ends_the_lease_at_once(two_mounts, smb422):
    """The smbd process of our connection is killed: the lease went with it, and no break will come
    for a change made before we reconnect.  The names it kept (a "no such file" among them) answer no
    more from that moment."""
    ours, theirs, server_dir = two_mounts()
    seen(ours, {"f", "g"})
    assert not os.path.exists(ours / "d" / "new")
    server = smb422.lab.server
    opens = smb422.open_files(server)[str(server_dir / "d")]["opens"]
    (pid,) = {int(o["server_id"]["pid"]) for o in opens.values()}
    os.kill(pid, signal.SIGKILL)
    (theirs / "d" / "new").write_bytes(b"y")
    seen(ours, {"f", "g", "new"}, bound=HOLD / 2)  # past that, the lease is given back anyway


def test_a_program_on_the_server_shows_at_once(two_mounts):
    """A program on the server breaks no lease, but Samba tells of its changes (CHANGE_NOTIFY, which the
    lease's handle keeps pending): a name it creates and a file it appends to show at once, with every
    timeout an hour."""
    ours, _, server_dir = two_mounts(HELD_LONG)
    seen(ours, {"f", "g"})
    assert os.stat(ours / "d" / "f").st_size == 1
    (server_dir / "d" / "new").write_bytes(b"y")
    seen(ours, {"f", "g", "new"})
    with open(server_dir / "d" / "f", "ab") as f:
        f.write(b"more")
    deadline = time.monotonic() + BREAK_BOUND
    while os.stat(ours / "d" / "f").st_size != 5:
        assert time.monotonic() < deadline, "the size the program on the server gave never showed"
        time.sleep(0.05)


def test_a_second_write_through_another_clients_handle_shows_at_once(two_mounts):
    """Samba breaks no lease for a second write through an open handle; it tells of it.  Each look
    lists the directory, whose listing (kept under the lease) carries the files' sizes."""
    ours, theirs, _ = two_mounts(HELD_LONG)
    d = ours / "d"

    def size_shows(size, what):
        deadline = time.monotonic() + BREAK_BOUND
        while not (sorted(os.listdir(d)) == ["f", "g"] and os.stat(d / "g").st_size == size):
            assert time.monotonic() < deadline, f"the {what} write never showed"
            time.sleep(0.05)

    seen(ours, {"f", "g"})
    with open(theirs / "d" / "g", "r+b") as f:
        f.write(b"ab")
        f.flush()
        os.fsync(f.fileno())
        size_shows(2, "first")
        f.write(b"cd")
        f.flush()
        os.fsync(f.fileno())
        size_shows(4, "second")


def test_a_warm_ls_lR_past_attr_timeout_asks_nothing(two_mounts):
    """attr_timeout=1: past it, files' attributes would be asked for again (or the directory listed
    again).  A watched listing vouches for them until a change is told: a second `ls -lR` a while
    later sends nothing but the share root's own attributes, which no listing holds."""
    ours, _, _ = two_mounts(["attr_timeout=1", "entry_timeout=1", f"dir_cache_timeout={HOLD}"])
    for sub in ("a", "b"):
        (ours / "d" / sub).mkdir()
        for i in range(5):
            (ours / "d" / sub / f"x{i}").write_bytes(b"z" * i)
    asked = []
    for _ in range(3):  # our own changes are told back late on a loaded machine: each ends a listing's watch
        time.sleep(1.5)
        subprocess.run(["ls", "-lR", str(ours)], check=True, capture_output=True)
        time.sleep(2)
        before = read_status(ours)["counters"]
        listed = subprocess.run(["ls", "-lR", str(ours)], check=True, capture_output=True, text=True).stdout
        after = read_status(ours)["counters"]
        assert "x4" in listed
        asked.append(after["smb_round_trips"] - before["smb_round_trips"])
        if asked[-1] <= 1:
            return
    raise AssertionError(f"round trips of each warm ls -lR: {asked}")


def test_a_change_shows_in_a_file_opened_since_its_listing(two_mounts):
    """The kernel keeps a file's attributes that a watched listing vouched for; an open since then
    refreshes ours but not the kernel's: the change told must still reach the kernel's, which an fstat
    of the open file reads (no lookup of the name refreshes them)."""
    ours, _, server_dir = two_mounts(HELD_LONG)
    seen(ours, {"f", "g"})
    assert os.stat(ours / "d" / "f").st_size == 1
    with open(ours / "d" / "f", "rb") as held:
        with open(server_dir / "d" / "f", "ab") as f:
            f.write(b"more")
        deadline = time.monotonic() + BREAK_BOUND
        while os.fstat(held.fileno()).st_size != 5:
            assert time.monotonic() < deadline, "the kernel kept the size from before the change"
            time.sleep(0.05)
