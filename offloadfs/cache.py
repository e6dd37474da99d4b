"""What the filesystem caches about files, for how long, and when it asks the server again.

The guarantees are the Linux NFS client's.  An open() asks the server for the
file's attributes; the kernel keeps the file's cached pages only if the file
did not change since it last saw it (close-to-open).  A stat() without an
open may be at most attr_timeout old, counting the time the kernel holds an
answer: what the daemon hands on from its own cache carries only the time it
has left.  A file open in passthrough is never served from the cache: the
kernel writes it without us.  Directories keep their listings by the same
rules (DirCache).

Every Stat is checked where it enters (``check``): the kernel marks an inode
bad for the rest of the mount when handed an impossible attribute (a size
past LLONG_MAX, a type that changed), so one bad reply fails one request with
EIO, is never cached, and never reaches the kernel.
"""
import collections
import errno
import logging
import math
import stat
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

U32, U64 = 1 << 32, 1 << 64
LLONG_MAX = (1 << 63) - 1
NS = 1_000_000_000
TIME_MIN, TIME_END = -(1 << 63) * NS, (LLONG_MAX + 1) * NS  # seconds must fit the kernel's s64
RACY_NS = NS  # see DirCache: more than any server's timestamp step, and some clock skew
BARE_SHARE = 8  # READDIRPLUS lists again once over 1/8 of a listing's items came without attributes
# A round trip costs about as much as this many more entries in a listing: `find` over 20 SMB directories
# of 100 files took 0.14 s listing each again, 0.08 s asking each for its attributes (1 ms a round trip).
ENTRIES_A_ROUND_TRIP = 32
DT_DIR = stat.S_IFDIR >> 12
AHEAD_ITEMS = 1024  # listings of up to this many entries are fetched ahead of a walk (worth_listing_ahead)
KEPT_ITEMS = 32768  # entries of the listings kept for directories the kernel forgot (DirCache.forgotten)
VOUCHED_MAX = 4096  # entries of a watched listing whose attributes it vouches for (DirCache.vouches)
HELD_TTL = 3600.0  # seconds the kernel may keep what a watched listing vouches for: its end takes them back
ABSENT_MAX = 1024  # names a directory keeps as absent (DirCache.absent); past that, the expired go
CHANGED_MAX = 4096  # files whose last change through the mount is kept by identity (AttrCache.changed)
MIXED = "mixed"  # the kernel's cache of a directory's names may hold several listings (DirCache.kernel_read)
FILE_TYPES = frozenset({stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK,
                        stat.S_IFIFO, stat.S_IFSOCK})


def problem(st, fmt=None):
    """What is impossible about ``st`` (for a node of type ``fmt``, if known), or None.  Every entry
    of a listing passes here: the common case is one expression, the reasons are looked for after."""
    kind = st.mode & 0o170000
    if (0 <= st.size <= LLONG_MAX and 0 <= st.ino < U64 and 0 <= st.blocks < U64 and 0 <= st.mode < U32
            and 0 <= st.nlink < U32 and 0 <= st.uid < U32 and 0 <= st.gid < U32 and 0 <= st.rdev < U32
            and 0 <= st.blksize < U32 and kind in FILE_TYPES and (fmt is None or kind == fmt)
            and TIME_MIN <= st.atime_ns < TIME_END and TIME_MIN <= st.mtime_ns < TIME_END
            and TIME_MIN <= st.ctime_ns < TIME_END):
        return None
    if not 0 <= st.size <= LLONG_MAX:
        return f"size {st.size}"
    for name in ("ino", "blocks"):
        if not 0 <= getattr(st, name) < U64:
            return f"{name} {getattr(st, name)}"
    for name in ("mode", "nlink", "uid", "gid", "rdev", "blksize"):
        if not 0 <= getattr(st, name) < U32:
            return f"{name} {getattr(st, name)}"
    if stat.S_IFMT(st.mode) not in FILE_TYPES:
        return f"mode {st.mode:#o}: no such file type"
    if fmt is not None and stat.S_IFMT(st.mode) != fmt:
        return f"mode {st.mode:#o}: the file was of type {fmt:#o}"
    for name in ("atime_ns", "mtime_ns", "ctime_ns"):
        if not TIME_MIN <= getattr(st, name) < TIME_END:
            return f"{name} {getattr(st, name)}"
    return None


def check(where, st, fmt=None):
    """``st`` as it came from ``where()`` (asked only for the log line: it walks the path); an impossible
    one fails the request, with one log line."""
    what = problem(st, fmt)
    if what is not None:
        log.error("%s: impossible attributes refused (%s)", where(), what)
        raise OSError(errno.EIO, f"impossible attributes from the server ({what})")
    return st


def version(st):
    """What changes whenever a file's data does (the kernel drops its pages on mtime or size)."""
    return st.mtime_ns, st.ctime_ns, st.size


class AttrCache:
    """Attributes per inode (held in the Inode's ``stat``, ``stat_expiry`` and ``stat_since``) and
    their lifetime; and, by identity, which files the mount changed lately (``changed``)."""

    def __init__(self, timeout):
        self.timeout = timeout
        self._changed = collections.OrderedDict()  # key -> monotonic: the mount's last change to the file, in order
        self._changed_horizon = float("-inf")  # monotonic: changes up to then are forgotten (see changed)

    def changed(self, key):
        """The mount changed the file of identity ``key`` (its data, attributes, or one of its names,
        which moves its link count and ctime): attributes listed before now are not its own any more.
        Kept by identity, not in the file's Inode: the kernel may forget the file (memory pressure)
        and look it up again by another name, from a listing fetched before the change.  Listed
        attributes are handed out for attr_timeout, so that is how long this is kept.  Past
        CHANGED_MAX files, the oldest go, and with them every listing fetched before their change."""
        now = time.monotonic()
        self._changed.pop(key, None)
        self._changed[key] = now
        while self._changed:  # attr_timeout=0 keeps none
            at = next(iter(self._changed.values()))
            if at > now - self.timeout and len(self._changed) <= CHANGED_MAX:
                return
            self._changed.popitem(last=False)
            self._changed_horizon = at  # past attr_timeout, it tells no listing still in use apart

    def changed_since(self, key, since):
        """True if the mount changed the file ``key`` at ``since`` (monotonic) or later, or may have."""
        return since <= self._changed_horizon or self._changed.get(key, since - 1) >= since

    def fresh(self, inode):
        """The cached attributes, or None when they must be asked for."""
        if inode.stat is None or inode.passthrough or time.monotonic() >= inode.stat_expiry:
            return None
        return inode.stat

    def store(self, where, inode, st, since=None, checked=False):
        """Keep ``st`` (checked, unless ``checked`` says it passed ``check`` already: then only its type
        is compared) for attr_timeout from ``since`` (monotonic: when the server gave it, if not just now)."""
        inode.stat = st if checked and st.mode & 0o170000 == inode.fmt else check(where, st, inode.fmt)
        inode.stat_since = time.monotonic() if since is None else since
        inode.stat_expiry = inode.stat_since + self.timeout
        return st

    @staticmethod
    def drop(inode):
        """The file changed: ask again next time (the last attributes stay, to compare on open)."""
        inode.stat_expiry = 0.0
        inode.stat_since = time.monotonic()

    def newer_than(self, key, inode, st, since):
        """True if we know better than ``st``, attributes of the file ``key`` listed at ``since``: we
        changed the file after that (whether or not it is known now), or its ``inode`` (None if the
        kernel holds none) learnt others since, or dropped them (expiry 0)."""
        if self.changed_since(key, since):
            return True
        if inode is None or inode.stat_since <= since:
            return False
        return inode.stat_expiry == 0.0 or inode.stat is None or version(inode.stat) != version(st)

    def ttl(self, inode):
        """How long the kernel may keep attributes of ``inode`` handed out now: what is left of
        ours, so that the two caches together stay within attr_timeout."""
        if inode.passthrough:
            return 0.0
        if inode.stat_expiry == math.inf:
            return HELD_TTL
        return max(0.0, min(self.timeout, inode.stat_expiry - time.monotonic()))

    def vouched(self, inode):
        """The attributes just stored for ``inode`` hold until a watched listing's lease ends
        (DirCache.vouches), which drops them."""
        inode.stat_expiry = math.inf

    def reopened(self, where, inode, st, lease=None):
        """An open() found ``st`` at the server: True if the file is as it was at the open before,
        with no change to its data made through this mount since, so the pages the kernel cached
        may stay.  ``st`` is what the kernel sees from now on.

        Not compared with the attributes last handed out: a stat after another client's rewrite
        (`ls -l`) would have handed the new ones out, while the kernel keeps its pages on an mtime
        put back.  Attributes prove the file unchanged only where they move with every change
        (``exact_version``); on Samba a rewrite by another client or a program on the server may
        leave them all as they were, and only ``lease`` can: a backend's promise held now
        (Leases.caching), held unbroken since the open before (kept in the Inode's ``lease``)."""
        now = (version(st), inode.data_changes)
        unchanged = inode.opened_as == now
        held = lease is not None and lease == inode.lease
        inode.opened_as, inode.lease = now, lease
        self.store(where, inode, st)
        return unchanged and (inode.source.backend.exact_version or held)


def dtype(mode):
    """The DT_* value of a file of ``mode`` (DT_REG is S_IFREG >> 12, and so on)."""
    return stat.S_IFMT(mode) >> 12


def dir_version(st):
    """What changes whenever a directory's entries do: its times, and NFS's change attribute."""
    return st.change, st.mtime_ns, st.ctime_ns


@dataclass(slots=True)
class Listing:
    items: dict  # name -> DirItem: every entry but . and ..
    version: tuple | None  # the directory's, from before the listing; None once we changed it since
    racy: bool  # the directory changed so close to the listing that a change after it may keep its times
    stats: bool  # its items carry attributes (SMB, NFS)
    fetched: float  # monotonic: the items' own attributes are as old as this
    expiry: float  # monotonic: until then, the listing answers without asking the server
    bare: int = 0  # items we added since, without attributes
    dirs: int = 0  # items that are directories
    named: bool = False  # READDIRPLUS handed out its names without their attributes (DirCache.names_will_do)
    walked: float = float("-inf")  # monotonic: a walk listed a first subdirectory (DirCache.walk_reached)
    ahead: bool = False  # the others were fetched ahead of that walk
    lease: object = None  # what Leases.caching said of the directory when it was stored (DirCache.held)
    watched: bool = False  # and that lease ends at any change to a file in it (Watches): it vouches for their attributes
    denied: set = None  # names answered absent for as long as the lease holds (DirCache.no_entry)
    fetched_by: int = 0  # the uid it was listed for (Backend.per_user)


class DirCache:
    """Complete listings of directories (held in the Inode's ``listing``), the NFS client's way.

    A listing answers readdir and lookups, a name it lacks included (ENOENT with no request),
    for attr_timeout after it was fetched.  Later, the directory's attributes are asked for
    (one small request) and the listing lives on for another attr_timeout if the directory's
    version is the one taken *before* the listing (an older version only costs a new listing;
    a newer one could hide a change).  Timestamps have steps (a jiffy, 100 ns on SMB), so a
    directory that changed within RACY_NS of the listing may change again with the same times:
    such a listing is fetched again instead (git's "racy" index entries).  Our own changes
    update the listing in place and clear its version: it answers until it expires, then is
    fetched again, as its directory's times moved under us.

    Without a listing, a name the server said is absent answers its next lookups for
    attr_timeout too (held in the Inode's ``absent``), until we make it or learn that the
    directory changed.

    A READDIRPLUS (every readdir from its start) may carry its entries' attributes, which are
    no older than attr_timeout, or names alone: the kernel cannot say whether it wants the
    attributes (``ls -l``, ``du``) or not (``find``).  Past attr_timeout, an unchanged
    directory answers with names (its subdirectories by the nodes the kernel holds); the first
    file of it the kernel then asks about lists the directory again, which answers the others,
    and tells that a walk is statting files: for attr_timeout after, READDIRPLUS lists again
    and carries the attributes, as the kernel's NFS client decides per directory.  A listing of
    many subdirectories is fetched again rather than revalidated: it brings each subdirectory's
    version with its attributes, which then revalidate their listings with no request of their own.

    While the backend holds a directory lease on it (``held``, see Leases), a listing and the
    names it lacks answer without asking, past attr_timeout too: the server breaks the lease
    before another client changes a name in it, and the break drops them (Filesystem._lease_broken).
    Its items' attributes keep their time: a lease says nothing of a write to an open file.
    """

    def __init__(self, timeout, held=lambda inode: False):
        self.timeout = timeout
        self.held = held  # held(inode): its listing is under a directory lease that holds now
        self.statting_until = 0.0  # monotonic: a walk stats the files it lists (see statting)
        self._kept = collections.OrderedDict()  # key -> Listing of a directory the kernel forgot
        self._kept_items = 0

    def forgotten(self, key, listing):
        """The kernel forgot the directory of identity ``key`` (memory pressure, drop_caches), which
        held ``listing``: kept for when the kernel looks it up again (it answers and revalidates as
        before; one we changed since, with no version, is fetched again, but says the directory is
        known and how large, see worth_listing_ahead), up to KEPT_ITEMS entries in all, the longest
        forgotten going first."""
        if listing is None:
            return
        self.recalled(key)
        self._kept[key] = listing
        self._kept_items += len(listing.items)
        while self._kept_items > KEPT_ITEMS:
            self._kept_items -= len(self._kept.popitem(last=False)[1].items)

    def recalled(self, key):
        """The listing kept for the directory of identity ``key``, or None; it is kept no more."""
        listing = self._kept.pop(key, None)
        if listing is not None:
            self._kept_items -= len(listing.items)
        return listing

    def fresh(self, inode, stats=False):
        """The listing while it may answer without asking, or None.  With ``stats`` (READDIRPLUS),
        a listing that carries attributes only while they are fresh and but a few of its items
        lack them (files made here since): past that, listing again costs less than a lookup per
        entry (a round trip each, against one for up to some 500 entries)."""
        listing = inode.listing
        if listing is None:
            return None
        if stats and listing.stats and listing.bare * BARE_SHARE > len(listing.items):
            return None
        until = listing.fetched + self.timeout if stats and listing.stats else listing.expiry
        if time.monotonic() < until or (listing.watched or not (stats and listing.stats)) and self.held(inode):
            return listing
        return None

    def store(self, inode, before, items, asked=None, changes=None):
        """Keep ``items``, listed after the directory had the attributes ``before``; ``asked``
        (monotonic): when the listing was asked for, if not just now.  A listing asked for
        when ``inode.dir_changes`` was ``changes`` is handed back but not kept if we changed the
        directory meanwhile: it may or may not hold that change."""
        asked = time.monotonic() if asked is None else asked
        racy = max(before.mtime_ns, before.ctime_ns) >= time.time_ns() - RACY_NS
        listing = Listing({i.name: i for i in items}, dir_version(before), racy,
                          any(i.stat is not None for i in items), asked, asked + self.timeout,
                          dirs=sum(i.type == DT_DIR for i in items))
        if changes is None or changes == inode.dir_changes:
            inode.listing = listing
        return listing

    def revalidate(self, inode, st, since=None):
        """The directory had the attributes ``st`` at ``since`` (monotonic; None: now): the listing,
        valid again until attr_timeout after that, or None (dropped)."""
        listing = inode.listing
        if listing is None or listing.racy or listing.version != dir_version(st):
            inode.listing = None
            if listing is not None and listing.version not in (None, dir_version(st)):
                inode.absent = None  # changed by someone else: those names may be there now
            return None
        listing.expiry = (time.monotonic() if since is None else since) + self.timeout
        return listing

    @staticmethod
    def kernel_read(inode, listing, offset):
        """The kernel read the entries of ``listing`` from ``offset`` on, and keeps them in its cache of
        the directory's names (FOPEN_CACHE_DIR; emptied at every open we do not let it keep them,
        held in the Inode's ``kernel_listing``).  That cache holds one listing only if every read
        since it was emptied came from one listing, starting at the top; else it is MIXED, never
        kept again until emptied."""
        if inode.kernel_listing is None and offset == 0:
            inode.kernel_listing = listing
        elif inode.kernel_listing is not listing:
            inode.kernel_listing = MIXED

    def kernel_may_keep(self, inode):
        """The listing the kernel's cache of names was read from, if it is the one we hold and would
        answer READDIRPLUS now, or once its version is checked, with no more than those names: its
        attributes are fresh (lookups answer from them), or old and no walk stats files
        (names_will_do); else None."""
        listing = inode.kernel_listing
        if listing is not inode.listing or listing is None:
            return None
        if self.fresh(inode, stats=True) is listing or self.revalidates(listing, stats=True):
            return listing
        if self.held(inode) and (not listing.stats or self.names_will_do(listing)):
            return listing
        return None

    def revalidates(self, listing, stats):
        """True if ``listing``, past its time, may live on once its directory's version is checked (for
        READDIRPLUS, with ``stats``: it then answers with names alone, see names_will_do); False if it
        must be fetched again."""
        return (not listing.racy and listing.version is not None
                and (not (stats and listing.stats) or self.names_will_do(listing)))

    def names_will_do(self, listing):
        """True if READDIRPLUS may answer from ``listing`` once its attributes are past attr_timeout,
        with names alone: no walk is statting files, and the listing holds too few subdirectories
        to be worth fetching again for their versions (see the class)."""
        return (time.monotonic() >= self.statting_until
                and listing.dirs * ENTRIES_A_ROUND_TRIP < len(listing.items))

    def statting(self):
        """A file of a listing answered with names alone was asked about: a walk stats what it lists."""
        self.statting_until = time.monotonic() + self.timeout

    def walk_reached(self, parent):
        """READDIRPLUS, or a walk that stats, is about to wait for the listing of a subdirectory of the
        directory whose listing is ``parent``: True at the second within attr_timeout, once.  A walk
        goes through them one by one, each a round trip it waits for: the rest are fetched ahead,
        side by side, while it works on the others (worth_listing_ahead).  One alone (`ls -l dir`)
        says nothing of the others."""
        now = time.monotonic()
        if now - parent.walked >= self.timeout:  # the first (a listing may live on for many walks)
            parent.walked, parent.ahead = now, False
            return False
        if parent.ahead:
            return False
        parent.ahead = True
        return True

    def worth_listing_ahead(self, inode):
        """True if READDIRPLUS would fetch the listing of ``inode`` again: we hold one (so it is no
        stranger, and it is small) that is past its time and may not be revalidated."""
        listing = inode.listing
        return (listing is not None and len(listing.items) <= AHEAD_ITEMS
                and self.fresh(inode, stats=True) is None and not self.revalidates(listing, stats=True))

    def ttl(self, inode):
        """How long a negative answer from the listing may be kept by the kernel: under a directory
        lease, until its break (the caller caps it at entry_timeout)."""
        if inode.listing is None:
            return 0.0
        if self.held(inode):
            return float("inf")
        return max(0.0, inode.listing.expiry - time.monotonic())

    def no_entry(self, inode, name):
        """``ttl`` of the answer that the listing lacks ``name``; one kept past the listing's time is
        remembered (up to ABSENT_MAX names), so that the lease's break can take it back from the kernel."""
        ttl = self.ttl(inode)
        if ttl == float("inf"):
            listing = inode.listing
            if listing.denied is None:
                listing.denied = set()
            if len(listing.denied) >= ABSENT_MAX:
                return max(0.0, listing.expiry - time.monotonic())
            listing.denied.add(name)
        return ttl

    def absent(self, inode, name, asked, changes):
        """The server said ``name`` is not in the directory ``inode``, asked at ``asked``
        (monotonic) when ``inode.dir_changes`` was ``changes``: kept unless we changed the
        directory meanwhile (the answer may predate our change)."""
        if changes != inode.dir_changes:
            return
        now = time.monotonic()
        if inode.absent is None:
            inode.absent = {}
        elif len(inode.absent) >= ABSENT_MAX:
            inode.absent = {n: until for n, until in inode.absent.items() if until > now}
            if len(inode.absent) >= ABSENT_MAX:
                inode.absent.clear()
        inode.absent[name] = asked + self.timeout

    @staticmethod
    def absent_ttl(inode, name):
        """How much longer ``name`` is known to be absent from ``inode``; 0.0: ask."""
        until = None if inode.absent is None else inode.absent.get(name)
        return 0.0 if until is None else max(0.0, until - time.monotonic())

    def item_stat(self, dir, item, listing, known=None):
        """The attributes the listing of ``dir`` carried for ``item``, while they are fresh enough to hand
        on, or vouched for (``vouches``; ``known``: the Inode the kernel holds by that name, if any)."""
        if item.stat is None:
            return None
        if time.monotonic() < listing.fetched + self.timeout or self.vouches(dir, listing, item.stat, known):
            return item.stat
        return None

    def vouches(self, dir, listing, st, known=None):
        """True if the listing of ``dir`` vouches for ``st``, the attributes of a file in it, past
        attr_timeout: it is watched (every change to a file in the directory ends its lease, and the
        lease's end drops them, here and in the kernel: Filesystem._dir_lease_broken), and the file
        has no other name (a change made through another directory's name is told to that one).  A
        subdirectory's only while its own listing, ``known``'s, is watched too: a name changed in
        it moves its times, which only its own watch tells of."""
        if not (listing.watched and len(listing.items) <= VOUCHED_MAX and self.held(dir)):
            return False
        if stat.S_ISDIR(st.mode):
            return known is not None and known.listing is not None and known.listing.watched and self.held(known)
        return st.nlink == 1

    @staticmethod
    def added(inode, item):
        """We made ``item`` in the directory."""
        inode.dir_changes += 1
        if inode.absent:
            inode.absent.pop(item.name, None)
        listing = inode.listing
        if listing is not None:
            old = listing.items.get(item.name)
            listing.bare += (item.stat is None) - (old is not None and old.stat is None)
            listing.dirs += (item.type == DT_DIR) - (old is not None and old.type == DT_DIR)
            listing.items[item.name] = item
            listing.version = None

    @staticmethod
    def removed(inode, name):
        """We removed ``name`` from the directory; returns what the listing held for it, or None."""
        inode.dir_changes += 1
        if inode.listing is None:
            return None
        listing = inode.listing
        listing.version = None
        item = listing.items.pop(name, None)
        listing.bare -= item is not None and item.stat is None
        listing.dirs -= item is not None and item.type == DT_DIR
        return item

    @staticmethod
    def drop(inode):
        """In doubt (a change that failed, an exchange): ask the server next time."""
        inode.dir_changes += 1
        inode.listing = None
        inode.absent = None
