"""The attribute checks and the cache's lifetimes, and the filesystem refusing what the kernel would not take."""
import dataclasses
import errno
import logging
import os
import stat
import time

import pytest

from offloadfs.backends.base import DirItem, Stat
from offloadfs.backends.local import LocalBackend
from offloadfs.cache import AHEAD_ITEMS, AttrCache, DirCache, problem
from offloadfs.filesystem import Filesystem, Options
from offloadfs.fuse.operations import Ctx
from offloadfs.stats import Stats

ROOT_CTX = Ctx(0, 0, 1)
GOOD = Stat(ino=5, mode=stat.S_IFREG | 0o644, size=3, mtime_ns=1)


def test_a_plausible_stat_passes():
    assert problem(GOOD) is None
    assert problem(dataclasses.replace(GOOD, size=(1 << 63) - 1, mtime_ns=-1, ino=(1 << 64) - 1)) is None


@pytest.mark.parametrize("change, what", [
    ({"size": (1 << 64) - 1}, "size"), ({"size": 1 << 63}, "size"), ({"size": -1}, "size"),
    ({"ino": 1 << 64}, "ino"), ({"blocks": -1}, "blocks"), ({"nlink": 1 << 32}, "nlink"),
    ({"uid": -2}, "uid"), ({"mode": 0o644}, "no such file type"), ({"mode": 0o170644}, "no such file type"),
    ({"mtime_ns": 1 << 100}, "mtime_ns"),
])
def test_impossible_values_are_named(change, what):
    assert what in problem(dataclasses.replace(GOOD, **change))


def test_a_changed_file_type_is_impossible_for_a_known_node():
    assert "type" in problem(GOOD, stat.S_IFDIR)
    assert problem(GOOD, stat.S_IFREG) is None


class Lying(LocalBackend):
    """A local source whose next getattr answers ``lie`` applied to the truth (no server sends it on demand)."""
    lie = None

    async def getattr(self, node, file=None):
        st = await super().getattr(node, file)
        lie, self.lie = self.lie, None
        return dataclasses.replace(st, **lie) if lie else st


async def test_one_impossible_reply_fails_one_request_and_is_never_cached(tmp_path, caplog):
    (tmp_path / "f").write_bytes(b"abc")
    backend = Lying(str(tmp_path), {})
    fs = Filesystem({"s": backend}, Options(attr_timeout=0), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    for lie in ({"size": (1 << 64) - 1}, {"size": 1 << 63}, {"mode": stat.S_IFDIR | 0o755}):
        backend.lie = lie
        with caplog.at_level(logging.ERROR), pytest.raises(OSError) as e:
            await fs.getattr(ROOT_CTX, entry.nodeid, None)
        assert e.value.errno == errno.EIO
        assert str(tmp_path) in caplog.records[-1].getMessage()
        attr, _ = await fs.getattr(ROOT_CTX, entry.nodeid, None)  # the next request is served
        assert (attr.size, stat.S_IFMT(attr.mode)) == (3, stat.S_IFREG)
    backend.lie = {"size": 1 << 63}
    with pytest.raises(OSError):
        await fs.getattr(ROOT_CTX, 1, None)  # the root too
    assert (await fs.getattr(ROOT_CTX, 1, None))[0].mode & stat.S_IFDIR


async def test_cached_attributes_reach_the_kernel_with_the_time_they_have_left(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    fs = Filesystem({"s": LocalBackend(str(tmp_path), {})}, Options(attr_timeout=30), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    assert 29 < entry.attr_timeout <= 30
    inode = fs.inodes[entry.nodeid]
    inode.stat_expiry -= 20  # as if looked up 20 s ago
    _, ttl = await fs.getattr(ROOT_CTX, entry.nodeid, None)
    assert 9 < ttl <= 10


async def test_open_keeps_pages_only_of_a_file_that_did_not_change(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    fs = Filesystem({"s": LocalBackend(str(tmp_path), {})}, Options(), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    first = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    again = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    assert again.keep_cache
    (tmp_path / "f").write_bytes(b"changed by another client")
    second = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    assert not second.keep_cache
    attr, _ = await fs.getattr(ROOT_CTX, entry.nodeid, None)
    assert attr.size == 25
    for opened in (first, again, second):
        await fs.release(ROOT_CTX, entry.nodeid, opened.fh)


async def test_a_stat_after_a_change_does_not_hide_it_from_the_next_open(tmp_path):
    """`ls -l` hands out the new attributes, but the kernel keeps its pages on an mtime put back:
    the open compares with the open before, not with what the stat handed out."""
    (tmp_path / "f").write_bytes(b"abc")
    fs = Filesystem({"s": LocalBackend(str(tmp_path), {})}, Options(attr_timeout=0), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    first = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    st = os.stat(tmp_path / "f")
    (tmp_path / "f").write_bytes(b"xyz")
    os.utime(tmp_path / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
    await fs.getattr(ROOT_CTX, entry.nodeid, None)
    second = await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False)
    assert not second.keep_cache
    for opened in (first, second):
        await fs.release(ROOT_CTX, entry.nodeid, opened.fh)


async def test_pages_are_not_kept_where_the_attributes_prove_nothing(tmp_path):
    """Samba: an unchanged mtime, ctime and size do not prove the data unchanged."""
    (tmp_path / "f").write_bytes(b"abc")
    backend = LocalBackend(str(tmp_path), {})
    backend.exact_version = False
    fs = Filesystem({"s": backend}, Options(), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    opened = [await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False) for _ in range(2)]
    assert not opened[1].keep_cache
    for o in opened:
        await fs.release(ROOT_CTX, entry.nodeid, o.fh)


class _Leased(LocalBackend):
    """A local backend whose server promises to say when files change (Leases): ``span`` is what
    caching() says, the test's to set; ``broken`` the callback the filesystem gave."""
    span = 1

    def caching(self, node):
        return self.span

    def on_break(self, callback):
        self.broken = callback


async def test_with_leases_open_keeps_pages_only_under_one_held_since_the_open_before(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    backend = _Leased(str(tmp_path), {})
    backend.exact_version = False  # as on Samba
    fs = Filesystem({"s": backend}, Options(), Stats("/mnt", {}))
    await fs.start()
    entry = await fs.lookup(ROOT_CTX, 1, b"f")
    opened = []

    async def keeps():
        opened.append(await fs.open(ROOT_CTX, entry.nodeid, os.O_RDONLY, False))
        return opened[-1].keep_cache

    assert not await keeps()  # unchanged attributes prove nothing here
    assert await keeps()
    backend.span = None
    assert not await keeps()
    backend.span = 2
    assert not await keeps() and await keeps()
    backend.broken(fs.inodes[entry.nodeid].node)  # a break between two opens of one span
    assert not await keeps() and await keeps()
    for o in opened:
        await fs.release(ROOT_CTX, entry.nodeid, o.fh)


class _Dir:
    listing = None
    kernel_listing = None
    dir_changes = 0
    absent = None


OLD_DIR = Stat(ino=2, mode=stat.S_IFDIR | 0o755, mtime_ns=1_000_000_000, ctime_ns=1_000_000_000, change=7)


def test_a_listing_lives_on_while_its_directory_is_unchanged():
    cache, d = DirCache(1.0), _Dir()
    cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8)])
    assert cache.fresh(d) is d.listing
    assert cache.revalidate(d, dataclasses.replace(OLD_DIR, atime_ns=5)) is d.listing
    for change in ({"mtime_ns": 2}, {"ctime_ns": 2}, {"change": 8}):
        cache.store(d, OLD_DIR, [])
        assert cache.revalidate(d, dataclasses.replace(OLD_DIR, **change)) is None
        assert d.listing is None


def test_a_listing_of_a_directory_changed_just_before_is_fetched_again():
    """Within a timestamp step, a change after the listing could keep the directory's times."""
    cache, d = DirCache(1.0), _Dir()
    recent = dataclasses.replace(OLD_DIR, mtime_ns=time.time_ns())
    cache.store(d, recent, [])
    assert cache.fresh(d) is not None  # it answers for attr_timeout all the same
    assert cache.revalidate(d, recent) is None


def test_our_changes_update_the_listing_and_end_its_revalidation():
    cache, d = DirCache(1.0), _Dir()
    cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8)])
    cache.added(d, DirItem(b"b", 4, 4))
    assert cache.removed(d, b"a").ino == 3
    assert list(cache.fresh(d).items) == [b"b"]
    assert cache.revalidate(d, OLD_DIR) is None  # our change moved the directory's times


def test_listed_attributes_are_as_old_as_the_listing():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8, stat=GOOD)])
    assert cache.item_stat(d, listing.items[b"a"], listing) is GOOD
    listing.fetched -= 2  # revalidating the directory says nothing of its files' attributes
    assert cache.revalidate(d, OLD_DIR) is listing
    assert cache.item_stat(d, listing.items[b"a"], listing) is None


def test_a_watched_listing_vouches_for_its_files_while_its_lease_holds():
    """Past attr_timeout, a listing watched under a held lease still answers for a file of one name; not for
    one of several names (a change made through another is told elsewhere), nor once the lease ends."""
    held = [True]
    cache, d = DirCache(1.0, lambda inode: held[0]), _Dir()
    several = dataclasses.replace(GOOD, nlink=2)
    listing = cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8, stat=GOOD), DirItem(b"b", 4, 8, stat=several)])
    listing.fetched -= 2
    assert cache.item_stat(d, listing.items[b"a"], listing) is None  # not watched
    listing.watched = True
    assert cache.item_stat(d, listing.items[b"a"], listing) is GOOD
    assert cache.fresh(d, stats=True) is listing
    assert cache.item_stat(d, listing.items[b"b"], listing) is None
    held[0] = False
    assert cache.item_stat(d, listing.items[b"a"], listing) is None
    assert cache.fresh(d, stats=True) is None


def test_a_listing_that_crossed_our_own_change_is_not_kept():
    """It may or may not hold the change: kept, it could hide a file we just made."""
    cache, d = DirCache(1.0), _Dir()
    changes = d.dir_changes
    cache.added(d, DirItem(b"new", 4, 8))
    listing = cache.store(d, OLD_DIR, [], changes=changes)
    assert listing.items == {} and d.listing is None


def test_readdirplus_wants_a_listing_whose_attributes_are_fresh():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8, stat=GOOD)])
    listing.fetched -= 2
    assert cache.revalidate(d, OLD_DIR) is listing
    assert cache.fresh(d) is listing  # names, for lookups and readdir
    assert cache.fresh(d, stats=True) is None  # a lookup per entry would cost more than a listing


def test_readdirplus_lists_again_once_many_entries_were_made_here():
    """Files made through us enter the listing without attributes: READDIRPLUS would look each up
    (`rm -rf` right after `cp -r`: a round trip a file) where one listing answers them all."""
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(10)])
    cache.added(d, DirItem(b"new0", 30, 8))
    assert cache.fresh(d, stats=True) is listing  # one lookup costs less than a listing
    cache.added(d, DirItem(b"new1", 31, 8))
    assert cache.fresh(d) is listing  # names: still good for lookups and readdir
    assert cache.fresh(d, stats=True) is None


def test_readdirplus_answers_with_names_until_a_walk_stats_what_it_lists():
    """`find` needs names only; the first file asked about after names alone says a walk wants the
    attributes (`ls -l`, `du`), and READDIRPLUS brings them for attr_timeout after."""
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(40)])
    assert cache.names_will_do(listing)
    cache.statting()
    assert not cache.names_will_do(listing)
    cache.statting_until = time.monotonic() - 0.1
    assert cache.names_will_do(listing)


def test_a_listing_of_subdirectories_is_fetched_again_for_their_versions():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(40)])
    cache.added(d, DirItem(b"sub", 9, 4))
    assert listing.dirs == 1 and cache.names_will_do(listing)
    cache.added(d, DirItem(b"sub2", 8, 4))
    assert not cache.names_will_do(listing)  # two round trips saved cost more than its 42 entries
    cache.removed(d, b"sub")
    assert listing.dirs == 1 and cache.names_will_do(listing)


def test_the_kernel_keeps_the_names_it_read_from_the_listing_we_hold():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(40)])
    assert cache.kernel_may_keep(d) is None  # it read nothing yet
    cache.kernel_read(d, listing, 0)
    cache.kernel_read(d, listing, 20)
    assert cache.kernel_may_keep(d) is listing
    listing.fetched -= 2
    assert cache.kernel_may_keep(d) is listing  # names alone, once the version is checked
    cache.statting()
    assert cache.kernel_may_keep(d) is None  # a walk wants the attributes: READDIRPLUS brings them
    cache.statting_until = 0.0
    cache.store(d, OLD_DIR, [])
    assert cache.kernel_may_keep(d) is None  # listed again since


def test_the_kernel_keeps_nothing_it_may_have_read_from_two_listings():
    cache, d = DirCache(1.0), _Dir()
    first = cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8)])
    cache.kernel_read(d, first, 0)
    second = cache.store(d, OLD_DIR, [DirItem(b"b", 4, 8)])
    cache.kernel_read(d, second, 0)  # another handle read the new one: which did the kernel keep?
    d.listing = first
    assert cache.kernel_may_keep(d) is None
    d.listing = second
    assert cache.kernel_may_keep(d) is None
    d.kernel_listing = None  # an open that did not let it keep them emptied its cache
    cache.kernel_read(d, second, 5)  # a read from the middle of a listing fills no cache from the top
    assert cache.kernel_may_keep(d) is None


def test_a_walk_lists_ahead_from_its_second_subdirectory_within_attr_timeout():
    cache, top = DirCache(1.0), _Dir()
    parent = cache.store(top, OLD_DIR, [DirItem(b"d%d" % i, 10 + i, 4) for i in range(5)])
    assert not cache.walk_reached(parent)  # `ls -l d0` alone says nothing of d1 ... d4
    parent.walked -= 2
    assert not cache.walk_reached(parent)  # nor `ls -l d1` long after
    assert cache.walk_reached(parent)
    assert not cache.walk_reached(parent)  # once
    parent.walked -= 2
    assert not cache.walk_reached(parent)  # a later walk over the same listing, revalidated since
    assert cache.walk_reached(parent)


def test_what_is_listed_ahead_is_what_readdirplus_would_list_again():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(40)])
    assert not cache.worth_listing_ahead(d)  # its attributes are fresh
    listing.fetched -= 2
    assert not cache.worth_listing_ahead(d)  # names alone will do, once its version is checked
    cache.statting()
    assert cache.worth_listing_ahead(d)  # a walk that stats wants the attributes
    cache.statting_until = 0.0
    cache.added(d, DirItem(b"new", 4, 8))
    assert cache.worth_listing_ahead(d)  # changed by us: no version to check it by
    cache.store(d, OLD_DIR, [DirItem(b"f%d" % i, 10 + i, 8, stat=GOOD) for i in range(AHEAD_ITEMS + 1)]).fetched -= 2
    cache.statting()
    assert not cache.worth_listing_ahead(d)  # too large to fetch on a guess
    assert not cache.worth_listing_ahead(_Dir())  # never listed


def test_a_revalidation_by_older_attributes_keeps_the_listing_only_as_long_as_they_last():
    cache, d = DirCache(1.0), _Dir()
    listing = cache.store(d, OLD_DIR, [DirItem(b"a", 3, 8)])
    listing.expiry = 0.0
    assert cache.revalidate(d, OLD_DIR, time.monotonic() - 0.8) is listing
    assert listing.expiry - time.monotonic() <= 0.2


def test_an_absent_name_answers_until_we_make_it_or_the_directory_changes():
    cache, d = DirCache(1.0), _Dir()
    cache.absent(d, b"new", time.monotonic(), d.dir_changes)
    assert 0.9 < cache.absent_ttl(d, b"new") <= 1.0 and cache.absent_ttl(d, b"other") == 0.0
    cache.added(d, DirItem(b"new", 30, 8))
    assert cache.absent_ttl(d, b"new") == 0.0
    asked, changes = time.monotonic(), d.dir_changes
    cache.added(d, DirItem(b"mine", 31, 8))  # while the server was asked about "late"
    cache.absent(d, b"late", asked, changes)
    assert cache.absent_ttl(d, b"late") == 0.0  # its answer may predate our change
    cache.absent(d, b"gone", time.monotonic() - 2.0, d.dir_changes)
    assert cache.absent_ttl(d, b"gone") == 0.0  # asked more than attr_timeout ago
    cache.absent(d, b"x", time.monotonic(), d.dir_changes)
    cache.store(d, OLD_DIR, [])
    assert cache.revalidate(d, dataclasses.replace(OLD_DIR, change=8)) is None  # changed elsewhere
    assert cache.absent_ttl(d, b"x") == 0.0


class _File:
    stat, stat_expiry, stat_since, passthrough, fmt = None, 0.0, 0.0, 0, stat.S_IFREG


def test_a_listing_does_not_hand_out_attributes_older_than_ours():
    attrs, f = AttrCache(1.0), _File()
    listed_at = time.monotonic()
    attrs.store(lambda: "test", f, GOOD)
    assert not attrs.newer_than("f", f, GOOD, listed_at)  # the same attributes, learnt again
    assert attrs.newer_than("f", f, dataclasses.replace(GOOD, size=9), listed_at)
    AttrCache.drop(f)  # dropped: another client removed a name of it
    assert attrs.newer_than("f", f, GOOD, listed_at)
    assert not attrs.newer_than("f", f, GOOD, time.monotonic())  # a listing after that


def test_a_change_of_ours_outlives_the_file_being_forgotten(monkeypatch):
    """What we changed is known by identity: a listing from before answers for it no more, even
    once the kernel forgot the file (no inode), until the listing's attributes expire anyway."""
    now = [100.0]
    monkeypatch.setattr("offloadfs.cache.time.monotonic", lambda: now[0])
    attrs = AttrCache(1.0)
    listed_at = now[0]
    now[0] += 0.1
    attrs.changed("f")  # an unlink of its other name
    assert attrs.newer_than("f", None, GOOD, listed_at)
    assert not attrs.newer_than("g", None, GOOD, listed_at)
    assert not attrs.newer_than("f", None, GOOD, now[0] + 0.01)  # listed after the change
    now[0] += 1.5
    attrs.changed("g")  # "f" goes: a listing from before it would be past attr_timeout
    assert list(attrs._changed) == ["g"]
    assert not attrs.newer_than("f", None, GOOD, now[0] - 0.5)


def test_no_change_is_kept_without_an_attr_timeout():
    attrs = AttrCache(0.0)
    attrs.changed("f")
    assert not attrs._changed


def test_changes_past_the_bound_forget_every_listing_from_before(monkeypatch):
    monkeypatch.setattr("offloadfs.cache.CHANGED_MAX", 2)
    attrs = AttrCache(1.0)
    listed_at = time.monotonic()
    for key in ("a", "b", "c"):
        attrs.changed(key)
    assert len(attrs._changed) == 2
    assert attrs.newer_than("a", None, GOOD, listed_at)  # forgotten, so in doubt
    assert attrs.newer_than("z", None, GOOD, listed_at)  # so is every file listed before "a" changed
    assert not attrs.newer_than("z", None, GOOD, time.monotonic())


def test_listings_of_forgotten_directories_are_kept_within_a_bound(monkeypatch):
    monkeypatch.setattr("offloadfs.cache.KEPT_ITEMS", 3)
    cache, a, b = DirCache(1.0), _Dir(), _Dir()
    first = cache.store(a, OLD_DIR, [DirItem(b"x", 3, 8), DirItem(b"y", 4, 8)])
    cache.forgotten("a", first)
    cache.forgotten("b", cache.store(b, OLD_DIR, [DirItem(b"z", 5, 8), DirItem(b"w", 6, 8)]))
    assert cache.recalled("a") is None  # the first forgotten went first
    assert list(cache.recalled("b").items) == [b"z", b"w"] and cache.recalled("b") is None
    a.listing = cache.store(a, OLD_DIR, [DirItem(b"x", 3, 8)])
    cache.added(a, DirItem(b"new", 7, 8))
    cache.forgotten("a", a.listing)  # changed by us since: its version says nothing, its size does
    a.listing = cache.recalled("a")
    assert list(a.listing.items) == [b"x", b"new"]
    assert not cache.revalidates(a.listing, stats=False)


def test_a_leased_listing_answers_names_past_its_time_and_not_attributes():
    """While a directory lease holds (DirCache.held), the names and the names it lacks answer past
    attr_timeout, racy or not, and the kernel may keep a "no such file" until the break; the items'
    attributes keep their time (a second write through another client's open handle breaks nothing)."""
    held = {"now": True}
    cache, d = DirCache(0.0, lambda inode: held["now"]), _Dir()
    cache.store(d, dataclasses.replace(OLD_DIR, mtime_ns=time.time_ns()), [DirItem(b"a", 3, 8, Stat(3, stat.S_IFREG))])
    assert cache.fresh(d) is d.listing
    assert cache.fresh(d, stats=True) is None
    assert cache.no_entry(d, b"b") == float("inf") and d.listing.denied == {b"b"}
    held["now"] = False
    assert cache.fresh(d) is None
    assert cache.no_entry(d, b"c") == 0.0 and d.listing.denied == {b"b"}
