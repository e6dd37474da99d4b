"""The filesystem: FUSE operations on inodes and handles, turned into backend calls.

It owns the inode table (nodeid -> backend node, with the kernel's lookup
count), the names the kernel holds, and the open handles; cache.py decides
what is cached and for how long.  A file is known by its backend identity
(an NFS filehandle, an SMB file id), never by its inode number alone, and a
new identity gets a new nodeid: the kernel must not mix two files' pages.
A mount holds one or more sources; with several, the root is a directory of
their names, so that a copy between two servers still reaches us as one
copy request.
"""
import dataclasses
import errno
import contextlib
import functools
import itertools
import json
import logging
import os
import stat
import time
from dataclasses import dataclass, field

import trio

from .backends.base import CALLER, UNREACHABLE, Allocate, Caller, DirItem, Leases, Passthrough, SeekData, Stat, Watches
from .backends.parallel import together
from .cache import DT_DIR, HELD_TTL, AttrCache, DirCache, Listing, check, dtype
from .fuse.operations import DirEntry, Entry, Operations, Opened
from .planner import Endpoint, Planner, plan
from .recognise import Recogniser
from .writebehind import WriteBehind

log = logging.getLogger(__name__)

ROOT = 1
STATUS_XATTR = b"user.offloadfs.status"
SEEK_DATA, SEEK_HOLE = 3, 4
RENAME_EXCHANGE = 2
NAME_MAX = 255
# A lookup in a directory whose listing changed lists it again (rather than asking for the one
# name) if it held at most this many entries: a few round trips that answer the next lookups too.
RELIST_FOR_LOOKUP = 1024
AHEAD = 2  # listings fetched side by side ahead of a walk (see _walk_reached)


@dataclass
class Options:
    """What the filesystem layer takes from the mount options."""
    ro: bool = False
    uid: int | None = None
    gid: int | None = None
    umask: int | None = None
    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    offload: bool = True
    detect_copies: bool = True
    always_offload: bool = False  # offload=always: wherever possible, whatever the cost model says
    # A recognised copy whose source's lease or delegation held from its read to the commit is not read
    # back: the lease is blind to a program on the server itself (Samba's kernel oplocks = no).
    trust_leases: bool = False


@dataclass(slots=True)
class Source:
    name: str
    backend: object
    index: int
    local: bool = field(init=False)  # a local fd the kernel could write itself; asked once (a Protocol check is slow)
    leases: bool = field(init=False)  # the server says when a file changes (Leases): its attributes do not
    watches: bool = field(init=False)  # and when anything in a leased directory changes (Watches)

    def __post_init__(self):
        self.local = isinstance(self.backend, Passthrough)
        self.leases = isinstance(self.backend, Leases)
        self.watches = isinstance(self.backend, Watches)


@dataclass(slots=True)
class Inode:
    nodeid: int
    source: Source | None  # None: the synthetic root of a multi-source mount
    node: object
    key: tuple  # (source index, the backend's identity of the node)
    ino: int
    fmt: int  # S_IFMT bits: fixed for a nodeid (the kernel marks a node whose type changes bad)
    lookups: int = 0
    pinned: bool = False  # source roots live as long as the mount
    stat: Stat | None = None
    stat_expiry: float = 0.0
    stat_since: float = 0.0  # monotonic: when what we know of its attributes dates from
    parent: "Inode | None" = None  # where it was last looked up: for names in `offloadfs status`
    name: bytes = b""
    names: set = field(default_factory=set)  # (parent nodeid, name) the kernel may hold for it
    passthrough: int = 0  # handles open in passthrough: the kernel writes them without us
    listing: Listing | None = None  # directories: see cache.DirCache
    kernel_listing: object = None  # directories: what the kernel's cache of its names holds (DirCache.kernel_read)
    dir_changes: int = 0  # directories: how many changes we made to it (cache.DirCache.store)
    unread: int = 0  # directories: handles opened and not read yet (see getattr)
    absent: dict | None = None  # directories: names the server said are not there (cache.DirCache)
    vouched: dict | None = None  # directories: nodeid -> Inode of the files whose attributes their watched listing vouches for
    pending: object = None  # files: recognise.Pending, written data held for a copy
    data_changes: int = 0  # files: changes to the data made through this mount (recognise.version)
    opened_as: tuple | None = None  # files: (cache.version, data_changes) at the last open (AttrCache.reopened)
    behind: object = None  # files: writebehind.Behind, writes answered and still in flight
    lease: object = None  # files: the backend's lease at the last open (cache.AttrCache.reopened)


@dataclass(slots=True)
class Handle:
    inode: Inode
    file: object = None
    caller: Caller = field(default_factory=CALLER.get)  # who opened it: its requests act for them
    listing: list = field(default_factory=list)  # directories: the snapshot readdir pages through
    snapshot_of: Listing | None = None  # directories: the listing that snapshot was taken from
    unread: bool = False  # directories: opened, not read yet
    passthrough: bool = False
    append: bool = False  # opened O_APPEND, the kernel's cache aside: its writes go to the server's end
    # Opened for reading, as its opener asked: with the writeback cache a write-only open is made
    # read-write, and the kernel reads through it the pages it fills in part (for a user who may
    # only write the file); such reads are no data of the opener's to recognise (recognise.py).
    readable: bool = True
    writable: bool = False  # opened for writing: it hears of the writes behind that fail (writebehind.py)


@dataclass(slots=True)
class Fetching:
    """A directory's listing being fetched: who asks for it meanwhile waits, and shares its failure."""
    done: trio.Event = field(default_factory=trio.Event)
    failed: int | None = None  # the errno it failed with


def check_name(name, longest=NAME_MAX):
    """The kernel never sends these, but a name must never reach a backend that could escape with it.
    A name longer than ``longest`` (the source's limit) fails here, without asking the server."""
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise OSError(errno.EINVAL, "invalid name")
    if len(name) > longest:
        raise OSError(errno.ENAMETOOLONG, "name too long")


def _write_may_kill_setid(inode, flags):
    """Whether a write through a handle of ``inode`` opened with ``flags`` may have to clear its
    setuid or (group-executable) setgid bit, by the mode last known."""
    mode = inode.stat.mode if inode.stat is not None else 0
    setid = mode & stat.S_ISUID or (mode & stat.S_ISGID and mode & stat.S_IXGRP)
    return bool(setid) and flags & os.O_ACCMODE != os.O_RDONLY


class Filesystem(Operations):
    def __init__(self, sources, options: Options, stats):
        """``sources``: {name: backend}; one source is mounted at the root itself."""
        self.options = options
        self.stats = stats
        self.planner = Planner(stats, options.offload, options.always_offload)
        self.sources = [Source(name, backend, i) for i, (name, backend) in enumerate(sources.items())]
        self.multi = len(self.sources) > 1
        self.cache = AttrCache(options.attr_timeout)
        self.dircache = DirCache(options.attr_timeout, self._dir_held)
        self._leased_dirs = {}  # (source index, node) -> the directory Inode whose listing a lease holds
        self.inodes = {}
        self.by_key = {}
        self.dentries = {}  # (parent nodeid, name) -> Inode: what unlink and rename change
        self.handles = {}
        self._nodeids = itertools.count(ROOT + 1)
        self._fhs = itertools.count(1)
        self.roots = {}  # source index -> its pinned root inode
        self.passthrough = False
        self.writeback = False
        self.kernel = None
        self._dropping = set()  # trio.Events of kernel names being dropped (see _drop_other_names)
        self._fetching = {}  # nodeid -> Fetching: a directory being listed (see _valid_listing)
        self.behind = WriteBehind(self._sent_behind, self._cut_behind, self._where)
        self.recogniser = None
        # Sources whose reads are remembered, and those whose writes are compared with them: the
        # pairs where the planner has an offload that spares moving the bytes.
        self.copies_from, self.copies_to = set(), set()
        if options.offload and options.detect_copies:
            self.recogniser = Recogniser(stats, self.planner, self._write_out, self.behind.settle, self.by_key.get,
                                         self._endpoint, trust_leases=options.trust_leases)

    async def start(self):
        """Open every source's root; runs before the mount so that bad sources fail the mount."""
        for src in self.sources:
            node, st = await src.backend.root()
            check(lambda: src.backend.url, st)
            if not stat.S_ISDIR(st.mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{src.backend.url}: not a directory")
            if self.multi:
                nodeid = next(self._nodeids)
            else:
                nodeid = ROOT
            inode = Inode(nodeid, src, node, (src.index, src.backend.identity(node, st)), st.ino, stat.S_IFDIR,
                          pinned=True)
            self._cache(inode, st)
            self.inodes[nodeid] = inode
            self.by_key[inode.key] = inode
            self.roots[src.index] = inode
            if src.leases:
                src.backend.on_break(functools.partial(self._lease_broken, src))
        if self.multi:
            self.inodes[ROOT] = Inode(ROOT, None, None, ("root",), ROOT, stat.S_IFDIR, pinned=True)
        for a in self.sources if self.recogniser else ():  # connected now: they know their servers
            for b in self.sources:
                if b.backend.offloads_spare_bytes and plan(Endpoint(a.backend, None, None, ""),
                                                           Endpoint(b.backend, None, None, ""), True)[:-1]:
                    self.copies_from.add(a.index)
                    self.copies_to.add(b.index)

    # -- plumbing -------------------------------------------------------------

    def init(self, conn):
        self.passthrough = conn.passthrough
        self.writeback = conn.writeback_cache
        self.kernel = conn.kernel

    def _inode(self, nodeid):
        try:
            return self.inodes[nodeid]
        except KeyError:
            raise OSError(errno.ESTALE, "unknown node") from None

    def _handle(self, fh):
        """The open handle; the rest of the request acts for whoever opened it, as a kernel NFS
        client does (the kernel's writeback, or a descriptor passed on, must not change who writes)."""
        try:
            h = self.handles[fh]
        except KeyError:
            raise OSError(errno.EBADF, "unknown handle") from None
        CALLER.set(h.caller)
        return h

    def _dir(self, nodeid):
        """A real directory of a source, for operations that change it."""
        inode = self._inode(nodeid)
        if inode.source is None:
            raise OSError(errno.EPERM, "the root of a multi-source mount holds only the sources")
        return inode

    def _name_max(self, nodeid):
        """The longest name the source of directory ``nodeid`` takes (Backend.name_max)."""
        inode = self.inodes.get(nodeid)
        return NAME_MAX if inode is None or inode.source is None else inode.source.backend.name_max

    def _writable(self):
        if self.options.ro:
            raise OSError(errno.EROFS, "read-only mount")

    def _ino_of(self, inode):
        return ROOT if inode.source is None else self._ino(inode.source, inode.ino)

    def _ino(self, source, ino):
        if not self.multi:
            return ino
        return (source.index + 1) << 56 | (ino & ((1 << 56) - 1))

    def _attr(self, inode, st):
        """What the kernel sees: our inode numbers, and the uid=/gid=/umask= options applied (uid= and
        gid= only where the source does not report owners itself: Backend.owners_from_server)."""
        o = self.options
        ino = self._ino_of(inode)
        changes = {} if ino == st.ino else {"ino": ino}
        written = max(inode.pending.end() if inode.pending is not None else 0, self.behind.end(inode))
        if written > st.size:
            changes["size"] = written  # what the application wrote, held or on its way
        if inode.source is None or not inode.source.backend.owners_from_server:
            if o.uid is not None:
                changes["uid"] = o.uid
            if o.gid is not None:
                changes["gid"] = o.gid
        if o.umask is not None:
            changes["mode"] = st.mode & ~o.umask
        return dataclasses.replace(st, **changes) if changes else st

    def _where(self, inode, name=None):
        """Source and path of a file, for a log line."""
        path = self._path(inode) + ("/" + os.fsdecode(name) if name else "")
        return f"{inode.source.backend.url} ({path or '/'})"

    def _cache(self, inode, st, since=None, checked=False):
        return self.cache.store(lambda: self._where(inode), inode, st, since, checked)

    def _stale(self, inode):
        """We changed ``inode``'s file: ask the server next time, and no listing from before answers for it."""
        self.cache.drop(inode)
        self.cache.changed(inode.key)

    def _ttl(self, inode):
        return self.options.attr_timeout if inode.source is None else self.cache.ttl(inode)

    def _entry(self, parent, name, node, st, since=None, vouched=False):
        """Hand one lookup reference to the kernel, reusing the nodeid of a known file.  ``vouched``: the
        parent's watched listing vouches for ``st`` (DirCache.vouches): the kernel keeps the name and the
        attributes until the listing's lease ends (_dir_lease_broken)."""
        source = parent.source
        try:
            key = (source.index, source.backend.identity(node, check(lambda: self._where(parent, name), st)))
        except BaseException:
            source.backend.forget(node)
            raise
        inode = self.by_key.get(key)
        if inode is None:
            inode = Inode(next(self._nodeids), source, node, key, st.ino, stat.S_IFMT(st.mode))
            self.inodes[inode.nodeid] = inode
            self.by_key[key] = inode
            if inode.fmt == stat.S_IFDIR:
                inode.listing = self.dircache.recalled(key)
        elif node is not inode.node:
            source.backend.forget(node)  # the same file again: keep the node we have
        if stat.S_ISDIR(st.mode) or st.nlink == 1:
            self._drop_other_names(inode, (parent.nodeid, name))
        self._cache(inode, st, since, checked=True)  # refuses a known file whose type changed: nothing is handed out
        if vouched:
            self._vouch(parent, inode)
        inode.lookups += 1
        self._name(parent, name, inode)
        return Entry(inode.nodeid, self._attr(inode, st), HELD_TTL if vouched else self.options.entry_timeout,
                     self._ttl(inode))

    def _vouch(self, dir, inode):
        """The attributes just stored for ``inode`` hold until the lease of ``dir``'s listing ends (_unvouch)."""
        self.cache.vouched(inode)
        if dir.vouched is None:
            dir.vouched = {}
        dir.vouched[inode.nodeid] = inode

    def _name(self, parent, name, inode):
        """The kernel holds ``name`` in ``parent`` for ``inode`` now."""
        inode.parent, inode.name = parent, name
        key = (parent.nodeid, name)
        old = self.dentries.get(key)
        if old is not inode:
            if old is not None:
                old.names.discard(key)
            self.dentries[key] = inode
            inode.names.add(key)

    def _drop_other_names(self, inode, key):
        """A file of one link (or a directory) found by ``key`` has no other name: any other the
        kernel holds was removed or replaced by another client, and its file number may have gone
        to this file (xfs reuses them at once).  Left there, the kernel would take two files for one,
        and a rename of one over the other would do nothing.  The kernel drops them once this
        request is answered (it holds the directory's lock until then)."""
        self._drop_names([other for other in inode.names if other != key])

    def _drop_names(self, keys):
        """Forget the kernel's names ``keys`` ((dir nodeid, name)): here at once, in the kernel in the
        background (it takes the directory's lock, which a request we are yet to answer may hold);
        opens wait for that in _check_name."""
        for key in keys:
            dir = self.inodes.get(key[0])
            if dir is not None:
                self._unname(dir, key[1], ours=False)
                self.dircache.drop(dir)
            if self.kernel is not None:
                done = trio.Event()
                self._dropping.add(done)
                trio.lowlevel.spawn_system_task(self._inval_entry, key, done)

    async def _inval_entry(self, key, done):
        try:
            await trio.to_thread.run_sync(self.kernel.notify_inval_entry, *key)
        except OSError as e:
            log.warning("dropping a name from the kernel's cache failed: %s", e)
        finally:
            self._dropping.discard(done)
            done.set()

    def _unname(self, parent, name, ours=True):
        """``name`` left ``parent`` (through us, unless not ``ours``): the file it named changed (link
        count, ctime); returns that file."""
        inode = self.dentries.pop((parent.nodeid, name), None)
        if inode is not None:
            inode.names.discard((parent.nodeid, name))
            (self._stale if ours else self.cache.drop)(inode)
        return inode

    def forget(self, nodeid, nlookup):
        inode = self.inodes.get(nodeid)
        if inode is None:
            return
        inode.lookups -= nlookup
        if inode.lookups <= 0 and not inode.pinned:
            del self.inodes[nodeid]
            self.by_key.pop(inode.key, None)
            if inode.fmt == stat.S_IFDIR:
                self.dircache.forgotten(inode.key, inode.listing)
                self._leased_dirs.pop((inode.source.index, inode.node), None)
                self._unvouch(inode)  # nothing would drop them at the lease's end
            for key in inode.names:
                if self.dentries.get(key) is inode:
                    del self.dentries[key]
            inode.source.backend.forget(inode.node)

    def begin(self, ctx):
        CALLER.set(Caller(ctx.uid, ctx.gid, ctx.pid))

    # -- names ------------------------------------------------------------------

    async def lookup(self, ctx, parent, name):
        check_name(name, self._name_max(parent))
        inode = self._inode(parent)
        if inode.source is None:
            for src in self.sources:
                if os.fsencode(src.name) == name:
                    root = self.roots[src.index]
                    st = await self._getattr(root, None)
                    root.lookups += 1
                    return Entry(root.nodeid, self._attr(root, st), self.options.entry_timeout, self._ttl(root))
            raise OSError(errno.ENOENT, "no such source")
        known = self.dentries.get((inode.nodeid, name))
        if known is not None:
            await self.behind.settle(known)  # its attributes must hold what we wrote
        listing = await self._valid_listing(inode, RELIST_FOR_LOOKUP)
        if listing is not None:
            return await self._lookup_listed(inode, name, listing)
        absent = self.dircache.absent_ttl(inode, name)
        if absent:
            return self._no_entry(absent)
        return await self._lookup(inode, name)

    def _no_entry(self, ttl):
        """A "no such file" answer, which the kernel may keep for ``ttl`` (what is left of ours)."""
        return Entry(0, None, min(self.options.entry_timeout, ttl), 0.0)

    async def _lookup_listed(self, inode, name, listing):
        """The entry of ``name`` in the directory ``inode`` that ``listing`` (valid) answers for."""
        if name not in listing.items:  # the kernel keeps the answer too, for what is left of the listing's time
            return self._no_entry(self.dircache.no_entry(inode, name))
        listed = self._listed(inode, name, listing)
        if listed is None and listing.named and listing.items[name].type != DT_DIR:  # see _attributes_listed
            relisted = await self._listing_for_stats(inode)
            if relisted is not None and relisted is not listing:
                return await self._lookup_listed(inode, name, relisted)
        if listed is not None:
            known = self.dentries.get((inode.nodeid, name))
            return self._entry(inode, name, *listed, listing.fetched,
                               self.dircache.vouches(inode, listing, listed[1], known))
        try:
            return await self._lookup(inode, name)
        except FileNotFoundError:
            self.dircache.drop(inode)  # it listed a name that is gone: list again next time
            raise

    def _listed(self, dir, name, listing):
        """(node, attributes) of ``name`` as the listing gave them, or None where a lookup must ask:
        they are too old, we changed the file since, or the listing carried no node and the kernel
        holds no file of that number by that name."""
        item = listing.items[name]
        known = self.dentries.get((dir.nodeid, name))
        st = self.dircache.item_stat(dir, item, listing, known)
        if st is None:
            return None
        node = item.node
        if node is None:
            if known is None or known.ino != st.ino:
                return None
            node = known.node
        key = (dir.source.index, dir.source.backend.identity(node, st))
        if self.cache.newer_than(key, self.by_key.get(key), st, listing.fetched):
            return None
        return node, st

    async def _lookup(self, dir, name):
        self.stats.lookups += 1
        asked, changes, watching = time.monotonic(), dir.dir_changes, self._watching(dir)
        try:
            node, st = await dir.source.backend.lookup(dir.node, name)
        except FileNotFoundError:
            self.stats.lookups_absent += 1
            self.dircache.absent(dir, name, asked, changes)
            raise
        return self._entry(dir, name, node, st, vouched=self._vouches_answer(dir, watching, st, name))

    def _watching(self, dir):
        """The listing of ``dir`` while it is watched under a held lease (DirCache.vouches), else None:
        taken before the server is asked about a file in it, whose answer then comes after the watch
        began, and is vouched for if that listing still holds (_vouches_answer)."""
        listing = dir.listing
        return listing if listing is not None and listing.watched and self.dircache.held(dir) else None

    def _vouches_answer(self, dir, watching, st, name):
        """True if the listing ``watching`` (from _watching, before the server was asked) vouches for the
        attributes ``st`` of ``name`` that the server gave."""
        return (watching is not None and dir.listing is watching
                and self.dircache.vouches(dir, watching, st, self.dentries.get((dir.nodeid, name))))

    async def _getattr(self, inode, file):
        if inode.source is None:
            t = int(self.stats.since * 1e9)
            return Stat(ino=ROOT, mode=stat.S_IFDIR | 0o755, nlink=2 + len(self.sources),
                        atime_ns=t, mtime_ns=t, ctime_ns=t)
        st = self.cache.fresh(inode)
        if st is None:
            await self.behind.settle(inode)  # else the server's answer may lack a write as it lands
            landed = self.behind.landed(inode)
            dir = inode.parent if inode.parent is not None and inode.parent.source is not None else None
            watching = None if dir is None else self._watching(dir)
            st = check(lambda: self._where(inode), await inode.source.backend.getattr(inode.node, file), inode.fmt)
            if self.behind.landed(inode) == landed:
                self._cache(inode, st, checked=True)
                if (watching is not None and self.dentries.get((dir.nodeid, inode.name)) is inode
                        and self._vouches_answer(dir, watching, st, inode.name)):
                    self._vouch(dir, inode)
                return st
            # A write began and landed meanwhile (another thread of the writer): not kept, and as big.
            st = dataclasses.replace(st, size=max(st.size, self.behind.landed_end(inode)))
        return st

    def getattr_now(self, ctx, nodeid, fh):
        inode = self.inodes.get(nodeid)
        st = None if inode is None or inode.source is None else self.cache.fresh(inode)
        return None if st is None else (self._attr(inode, st), self._ttl(inode))

    async def getattr(self, ctx, nodeid, fh):
        inode = self._inode(nodeid)
        if inode.source is not None and self.cache.fresh(inode) is None:
            if inode.unread:
                await self._list_ahead(inode)
            else:
                await self._attributes_listed(inode)
        file = self.handles[fh].file if fh in self.handles else None
        st = await self._getattr(inode, file)
        return self._attr(inode, st), self._ttl(inode)

    async def _attributes_listed(self, inode):
        """A file's attributes from its directory's listing, where that has them fresh; after a
        READDIRPLUS of names alone, the walk that stats the files lists the directory once (see
        _listing_for_stats).  Not that for a directory: a path walk through one asks for its
        attributes (a permission check), which must not cost its parent a listing."""
        dir = inode.parent
        if (dir is None or self.dentries.get((dir.nodeid, inode.name)) is not inode or inode.passthrough
                or self.behind.end(inode)):
            return
        listing = self.dircache.fresh(dir, stats=True)
        if listing is None:
            held = self.dircache.fresh(dir)
            if held is None or not held.named or inode.fmt == stat.S_IFDIR:
                return
            listing = await self._listing_for_stats(dir)
            if listing is None or listing is held:
                return
        if inode.name not in listing.items:
            return
        listed = self._listed(dir, inode.name, listing)
        if listed is not None and self.by_key.get((dir.source.index, dir.source.backend.identity(*listed))) is inode:
            self._cache(inode, listed[1], listing.fetched)
            if self.dircache.vouches(dir, listing, listed[1], inode):
                self._vouch(dir, inode)

    async def setattr(self, ctx, nodeid, ch):
        self._writable()
        inode = self._dir(nodeid)
        await self._settle(inode)  # a held copy landing later would undo a truncate, or move the mtime
        inode.data_changes += ch.size is not None
        file = self.handles[ch.fh].file if ch.fh in self.handles else None
        mode = ch.mode
        if ch.kill_suidgid and mode is None:
            mode = await self._killed_mode(inode, file)
        st = await inode.source.backend.setattr(  # NOW passes through: backends.base.NOW is the same
            inode.node, file, mode=mode, uid=ch.uid, gid=ch.gid, size=ch.size,
            atime_ns=ch.atime_ns, mtime_ns=ch.mtime_ns)
        self.cache.changed(inode.key)
        st = self._cache(inode, st)
        if ch.size is not None:
            self.behind.truncated(inode, ch.size)
        return self._attr(inode, st), self._ttl(inode)

    async def _killed_mode(self, inode, file):
        """The mode with setuid and group-executable setgid cleared, or None if nothing to clear,
        or if the server clears them itself (Backend.clears_setid_on_write)."""
        if inode.source.backend.clears_setid_on_write:
            return None
        mode = (await inode.source.backend.getattr(inode.node, file)).mode
        kill = stat.S_ISUID | (stat.S_ISGID if mode & stat.S_IXGRP else 0)
        return stat.S_IMODE(mode & ~kill) if mode & kill else None

    async def _kill_suidgid(self, inode, file):
        """A write or truncate by a user who may not keep setuid/setgid (HANDLE_KILLPRIV_V2 leaves
        clearing them to us): the mode we know goes, whoever clears them."""
        mode = await self._killed_mode(inode, file)
        if mode is not None:
            await inode.source.backend.setattr(inode.node, file, mode=mode)
        self._stale(inode)

    async def readlink(self, ctx, nodeid):
        inode = self._dir(nodeid)
        return await inode.source.backend.readlink(inode.node)

    async def _make(self, parent, name, call, *args):
        self._writable()
        check_name(name, self._name_max(parent))
        dir = self._dir(parent)
        async with self._changing(dir):
            node, st = await call(dir.source.backend)(dir.node, name, *args)
        entry = self._added(dir, name, node, st)
        if stat.S_ISDIR(st.mode):  # empty when made: its first lookups need no listing
            self.dircache.store(self.inodes[entry.nodeid], st, [])
        return entry

    def _added(self, dir, name, node, st):
        """We made ``name`` in ``dir``: hand it to the kernel, and the listing holds it at once."""
        self._stale(dir)
        entry = self._entry(dir, name, node, st)
        self.dircache.added(dir, DirItem(name, st.ino, dtype(st.mode)))
        return entry

    @contextlib.asynccontextmanager
    async def _changing(self, *dirs):
        """A change to ``dirs`` that fails leaves their listings in doubt (the server knew better)."""
        try:
            yield
        except BaseException:
            for dir in dirs:
                self.dircache.drop(dir)
            raise

    async def symlink(self, ctx, parent, name, target):
        return await self._make(parent, name, lambda b: b.symlink, target)

    async def mknod(self, ctx, parent, name, mode, rdev):
        return await self._make(parent, name, lambda b: b.mknod, mode, rdev)

    async def mkdir(self, ctx, parent, name, mode):
        return await self._make(parent, name, lambda b: b.mkdir, mode)

    async def link(self, ctx, nodeid, newparent, newname):
        self._writable()
        check_name(newname, self._name_max(newparent))
        inode = self._dir(nodeid)
        dir = self._dir(newparent)
        if dir.source is not inode.source:
            raise OSError(errno.EXDEV, "hard links stay within one source")
        async with self._changing(dir):
            node, st = await inode.source.backend.link(inode.node, dir.node, newname)
        self.cache.changed(inode.key)
        return self._added(dir, newname, node, st)

    async def _remove(self, parent, name, rmdir):
        self._writable()
        check_name(name, self._name_max(parent))
        dir = self._dir(parent)
        backend = dir.source.backend
        await self._settle(self.dentries.get((dir.nodeid, name)))
        async with self._changing(dir):
            await (backend.rmdir if rmdir else backend.unlink)(dir.node, name)
        self._stale(dir)
        self.dircache.removed(dir, name)
        self._unname(dir, name)

    async def unlink(self, ctx, parent, name):
        await self._remove(parent, name, False)

    async def rmdir(self, ctx, parent, name):
        await self._remove(parent, name, True)

    async def rename(self, ctx, parent, name, newparent, newname, flags):
        self._writable()
        check_name(name, self._name_max(parent))
        check_name(newname, self._name_max(newparent))
        old, new = self._dir(parent), self._dir(newparent)
        if old.source is not new.source:
            raise OSError(errno.EXDEV, "rename across sources")  # mv then copies, through us
        await self._settle(self.dentries.get((old.nodeid, name)), self.dentries.get((new.nodeid, newname)))
        async with self._changing(old, new):
            await old.source.backend.rename(old.node, name, new.node, newname, flags)
        self._stale(old)
        self._stale(new)
        item = self.dircache.removed(old, name)
        self.dircache.removed(new, newname)
        if item is None or flags & RENAME_EXCHANGE:
            self.dircache.drop(old)
            self.dircache.drop(new)
        else:
            self.dircache.added(new, DirItem(newname, item.ino, item.type))
        moved, replaced = self._unname(old, name), self._unname(new, newname)
        if moved is not None:
            self._name(new, newname, moved)
        if replaced is not None and flags & RENAME_EXCHANGE:
            self._name(old, name, replaced)

    # -- files ------------------------------------------------------------------

    def _open_flags(self, flags):
        flags &= ~getattr(os, "O_DIRECT", 0)  # page cache alignment rules are the kernel's business here
        if self.writeback:
            # The kernel's writeback cache reads pages of write-only files and appends itself.
            flags &= ~os.O_APPEND
            if flags & os.O_ACCMODE == os.O_WRONLY:
                flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
        if self.options.ro and flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only mount")
        return flags

    def _opened(self, inode, file, flags, readable, keep_cache=False):
        """A handle for ``file``, opened with ``flags`` (as _open_flags made them), ``readable`` as asked.

        Without the writeback cache the kernel appends at the size it holds, which may be older
        than another client's append: the daemon places a handle's appends at the server's end
        (_append_at) instead, and the kernel must keep the data out of its page cache, where it
        would sit at the place it asked for.  A write-only handle goes around the page cache too:
        through it the kernel ends a WRITE at every page it fills in part (two for most writes of
        `tar x`, which writes 10 KiB records cut at 512-byte headers) and copies the data once
        more; around it, each write(2) is one WRITE, and the kernel drops the pages it had cached
        over what was written (6.18), so other openers read what was written.

        A file with setuid or setgid open for writing is not passed through: the kernel would
        write the backing file as the daemon, root, and the bits would stay where a user's write
        must clear them (_kill_suidgid does, for writes through us)."""
        fh = next(self._fhs)
        backend = inode.source.backend
        backing = None
        if self.passthrough and isinstance(backend, Passthrough) and not _write_may_kill_setid(inode, flags):
            backing = backend.backing_fd(file)
        append = backing is None and bool(flags & os.O_APPEND)
        write_only = backing is None and flags & os.O_ACCMODE == os.O_WRONLY  # never so with the writeback cache
        h = self.handles[fh] = Handle(inode, file, passthrough=backing is not None, append=append, readable=readable,
                                      writable=flags & os.O_ACCMODE != os.O_RDONLY)
        if h.writable:
            self.behind.opened(inode, h)
        inode.passthrough += backing is not None
        return Opened(fh, backing_fd=backing, keep_cache=keep_cache, direct_io=append or write_only)

    async def open(self, ctx, nodeid, flags, kill_suidgid):
        """Close-to-open: the name still leads to the file, its attributes come from the server,
        and the kernel keeps the pages it cached only if the file is as it last saw it."""
        inode = self._dir(nodeid)
        checked = self._checked_by_open(inode)
        if checked:
            await self._dropped()
        else:
            await self._check_name(inode)
        await self.behind.settle(inode)  # attributes from the server must hold what we wrote
        backend = inode.source.backend
        readable = flags & os.O_ACCMODE != os.O_WRONLY
        flags = self._open_flags(flags)
        try:
            file = await backend.open(inode.node, flags)
        except OSError as e:
            if checked and e.errno in (errno.ESTALE, errno.ENOENT):
                await self._check_name(inode)  # drops the stale name here and in the kernel: ESTALE
            raise
        try:
            if flags & os.O_TRUNC:
                await self._settle(inode)  # the truncate came after what was written before
                inode.data_changes += 1
                self._stale(inode)
                self.behind.truncated(inode, 0)
                if kill_suidgid:
                    await self._kill_suidgid(inode, file)
                keep = False
            else:
                before, st = inode.stat, backend.opened(file) or await backend.getattr(inode.node, file)
                lease = backend.caching(inode.node) if inode.source.leases else None
                keep = self.cache.reopened(lambda: self._where(inode), inode, st, lease)
                if keep and st != before and self.kernel is not None:
                    # The data is as the kernel saw it, but not the rest (a link made elsewhere: Samba
                    # keeps the ctime): its pages stay, its attributes go.
                    self.kernel.notify_inval_inode(inode.nodeid, -1, 0)
        except BaseException:
            with trio.CancelScope(shield=True):
                await backend.release(file)
            raise
        return self._opened(inode, file, flags, readable, keep)

    def _lease_broken(self, source, node):
        """A backend's promise on ``node``'s file ended (Leases.on_break): another client is about to
        change it.  The kernel drops its pages and attributes now, not at the next open, and what
        recognition remembers of it is found no more.  Returns the events set once the kernel has
        dropped them (a backend that can, gives the promise back after).  A directory's: see
        _dir_lease_broken."""
        leased = self._leased_dirs.pop((source.index, node), None)
        if leased is not None:
            self._dir_lease_broken(leased)
            return []
        held = {h.inode.nodeid: h.inode for h in self.handles.values()
                if h.inode.node is node and h.inode.source is source}
        dropped = []
        for inode in held.values():
            inode.lease = None
            self.cache.drop(inode)
            if self.recogniser is not None:
                self.recogniser.served.now_at(inode.key, None)
            if self.kernel is not None:
                dropped.append(trio.Event())
                trio.lowlevel.spawn_system_task(self._invalidate, inode.nodeid, 0, -1, dropped[-1])
        return dropped

    def _dir_held(self, inode):
        """True while the listing of the directory ``inode`` is under a lease that has held without a gap
        since the listing was stored (cache.DirCache)."""
        listing = inode.listing
        return (listing is not None and listing.lease is not None
                and inode.source.backend.caching(inode.node) == listing.lease)

    def _dir_lease_broken(self, inode):
        """The lease on a directory's listing ended: another client is about to change a name in it (or
        we gave it up).  The listing and the names it answered absent go at once, here and in the
        kernel, with every name of it the kernel holds (a long entry_timeout kept them) and its own
        cache of the names; the next lookup or readdir lists again."""
        if self.inodes.get(inode.nodeid) is not inode:
            return
        listing = inode.listing
        names = set(listing.items) | (listing.denied or set()) if listing is not None else set()
        keys = [(inode.nodeid, name) for name in names
                if (inode.nodeid, name) in self.dentries or name in (listing.denied or ())]
        self.dircache.drop(inode)
        self.cache.drop(inode)
        self._drop_names(keys)
        self._unvouch(inode)
        if self.kernel is not None:
            trio.lowlevel.spawn_system_task(self._invalidate, inode.nodeid)

    def _unvouch(self, dir):
        """The attributes the listing of ``dir`` vouched for go, here and in the kernel (its pages of
        them stay: an open checks the file, see AttrCache.reopened)."""
        for inode in (dir.vouched or {}).values():  # the kernel may hold them past a refresh of ours (an open)
            if self.inodes.get(inode.nodeid) is inode:
                self.cache.drop(inode)
                if self.kernel is not None:
                    trio.lowlevel.spawn_system_task(self._invalidate, inode.nodeid, -1, 0)
        dir.vouched = None

    async def _invalidate(self, nodeid, offset=0, length=-1, done=None):
        """Drop the kernel's pages and attributes of ``nodeid`` (offset -1: its attributes alone): from a
        thread, since the kernel waits for the reads under way on them, which this thread answers.
        ``done``, an event, is set once it is over."""
        try:
            await trio.to_thread.run_sync(self.kernel.notify_inval_inode, nodeid, offset, length)
        except OSError as e:
            log.debug("invalidating node %d: %s", nodeid, e)  # the kernel forgot it meanwhile
        finally:
            if done is not None:
                done.set()

    def _checked_by_open(self, inode):
        """True if the open of ``inode`` itself checks the one name the kernel holds for it (see
        _check_name), so that no lookup need go first."""
        if len(inode.names) != 1:
            return False
        [(dir_id, name)] = inode.names
        dir = self.inodes.get(dir_id)
        return dir is not None and dir.source is inode.source and \
            inode.source.backend.open_checks(dir.node, name, inode.node)

    async def _check_name(self, inode):
        """Every name the kernel holds for ``inode`` must still lead to it at the server.

        Another client may have removed or replaced a name while the kernel
        still holds it (for up to entry_timeout): opening the old file would
        read stale data, or write where nobody will look again.  The open may
        have come by any of the file's names, so all are asked; a stale one is
        dropped here and in the kernel, and ESTALE makes the kernel walk the
        path once more, looking every name up afresh (the Linux NFS client
        revalidates a name on open too).  Names we removed ourselves are not
        held, so a reopen through /proc of an unlinked file still works.
        """
        await self._dropped()  # until then, the kernel may have come by a name we no longer hold
        stale = await self._stale_names(inode)
        if not stale:
            return
        self._drop_names(name for name, _ in stale)
        # The kernel's second walk may end at the file a stale name leads to now: that file's own
        # stale names go too, or its open would be refused as well (the kernel walks twice at most).
        for key in {key for _, key in stale if key is not None}:
            now = self.by_key.get(key)
            if now is not None and now is not inode:
                self._drop_names(name for name, _ in await self._stale_names(now))
        await self._dropped()  # the walk must not find them again
        raise OSError(errno.ESTALE, "a name of the file now leads elsewhere")

    async def _dropped(self):
        for done in list(self._dropping):
            await done.wait()

    async def _stale_names(self, inode):
        """((dir nodeid, name), key of the file it leads to now or None) for each name the kernel
        holds for ``inode`` that no longer leads to it."""
        stale = []
        for name in list(inode.names):
            dir = self.inodes.get(name[0])
            if dir is not None and dir.source is not None:
                key = await self._now_at(dir, name[1])
                if key != inode.key:
                    stale.append((name, key))
        return stale

    async def _now_at(self, dir, name):
        """The key of the file ``name`` in ``dir`` leads to at the server, or None if it is gone."""
        backend = dir.source.backend
        try:
            node, st = await backend.lookup(dir.node, name)
        except FileNotFoundError:
            return None
        key = (dir.source.index, backend.identity(node, st))
        known = self.by_key.get(key)
        if known is None or known.node is not node:
            backend.forget(node)
        return key

    async def create(self, ctx, parent, name, mode, flags):
        self._writable()
        check_name(name, self._name_max(parent))
        dir = self._dir(parent)
        async with self._changing(dir):
            readable = flags & os.O_ACCMODE != os.O_WRONLY
            flags = self._open_flags(flags)
            node, st, file = await dir.source.backend.create(dir.node, name, flags, mode)
        entry = self._added(dir, name, node, st)
        return entry, self._opened(self.inodes[entry.nodeid], file, flags, readable)

    async def read(self, ctx, nodeid, fh, offset, size):
        h = self._handle(fh)
        inode = h.inode
        await self._settle(inode)
        if self.recogniser is None or inode.source.index not in self.copies_from or not h.readable:
            started = trio.current_time()
            data = await inode.source.backend.read(h.file, offset, size)
        else:
            # The version is taken before the read: data changed after it is caught at commit.
            st = await self._getattr(inode, h.file)
            started = trio.current_time()
            data = await self.recogniser.read(h, offset, size, st)
        self.planner.carried(inode.source.backend, "read", started, len(data))
        self.stats.fuse_read_bytes += len(data)
        return data

    async def write(self, ctx, nodeid, fh, offset, data, kill_suidgid):
        h = self._handle(fh)
        self.behind.report(h.inode, h)
        if h.append:
            offset = await self._append_at(h)
        h.inode.data_changes += 1
        if self._recognising(h.inode):
            await self.recogniser.write(h, offset, data)
        else:
            await self._write_out(h, offset, data)
        self._wrote(h.inode, data)
        if kill_suidgid:
            await self._kill_suidgid(h.inode, h.file)
        return len(data)

    def write_now(self, nodeid, fh, offset, data, kill_suidgid):
        """A write that only joins data held for a recognised copy (Recogniser.write_now) is
        taken at once; any other is left to write."""
        h = self.handles.get(fh)
        if (h is None or h.append or kill_suidgid or not self._recognising(h.inode)
                or self.behind.unheard(h.inode, h) or not self.recogniser.write_now(h, offset, data)):
            return None
        h.inode.data_changes += 1
        self._wrote(h.inode, data)
        return len(data)

    def _recognising(self, inode):
        """Whether writes to ``inode`` go through the recogniser (recognise.py)."""
        return self.recogniser is not None and inode.source.index in self.copies_to

    def _wrote(self, inode, data):
        self.stats.fuse_write_bytes += len(data)
        self._stale(inode)

    async def _append_at(self, h):
        """Where an append through ``h`` goes: the end of the file as the server has it, once what
        we hold and have in flight for it is there (the NFS client appends at the size it
        revalidates, so does this).  The kernel's pages need no notice (one would wait on a page
        lock that a READ we have yet to answer may hold): it caches none past the end it knows,
        and drops the one holding that end after the write, which went around the page cache."""
        await self._settle(h.inode)
        return (await self._getattr(h.inode, h.file)).size

    async def _write_out(self, h, offset, data):
        """A plain write: to a remote file it goes behind (writebehind.py); a local file's (one
        the kernel could write itself) costs less written at once."""
        if h.inode.source.local:
            await self._send(h, offset, data)
        else:
            await self.behind.write(h.inode, h, offset, data)

    async def _sent_behind(self, h, offset, data):
        await self._send(h, offset, data)
        self._stale(h.inode)  # attributes asked for while it was on its way lack it

    async def _cut_behind(self, inode, h, size):
        await self.planner.trim(self._endpoint(inode, h.file), 0, size)
        self._stale(inode)

    async def _send(self, h, offset, data):
        """Write all of ``data``: the kernel takes a short write as an error for most callers."""
        n, started = 0, trio.current_time()
        while n < len(data):
            written = await h.inode.source.backend.write(h.file, offset + n, data[n:])
            if written <= 0:
                raise OSError(errno.EIO, "the server accepted no data")
            n += written
        self.planner.carried(h.inode.source.backend, "write", started, n)

    async def _settle(self, *inodes):
        """Commit what these files hold for recognised copies, and wait for their writes in flight:
        before anything that could tell."""
        for inode in inodes:
            if inode is not None and inode.pending is not None and await self.recogniser.commit(inode):
                self._stale(inode)
            if inode is not None:
                await self.behind.settle(inode)

    async def _settle_at_release(self, h):
        """The last chance for what ``h`` wrote: the kernel hears no error from a release."""
        p = h.inode.pending
        if p is not None and p.handle is h:
            try:
                await self._settle(h.inode)
            except OSError as e:
                log.error("%s: data written for a recognised copy could not be written at close: %s",
                          self._where(h.inode), e)
                self.recogniser.drop(p)
            p.handle = None
        await self.behind.settle(h.inode)
        self.behind.closed(h.inode, h)

    async def flush(self, ctx, nodeid, fh):
        """close(2) of a descriptor.  A read-only one has nothing of its own to write, and what
        others wrote is theirs to hear of (a `cat` must neither fail nor take a writer's error)."""
        h = self._handle(fh)
        if h.writable:
            await self._settle(h.inode)
            self.behind.report(h.inode, h)
        await h.inode.source.backend.flush(h.file)

    async def fsync(self, ctx, nodeid, fh, datasync):
        h = self._handle(fh)
        await self._settle(h.inode)
        self.behind.report(h.inode, h, clear=True)
        await h.inode.source.backend.fsync(h.file, datasync)

    async def release(self, ctx, nodeid, fh):
        h = self.handles.pop(fh, None)
        if h is not None:
            CALLER.set(h.caller)
            await self._settle_at_release(h)
            self._stale(h.inode)
            h.inode.passthrough -= h.passthrough
            await h.inode.source.backend.release(h.file)

    async def lseek(self, ctx, nodeid, fh, offset, whence):
        h = self._handle(fh)
        await self._settle(h.inode)
        backend = h.inode.source.backend
        if isinstance(backend, SeekData):
            return await backend.seek(h.file, offset, whence)
        size = (await backend.getattr(h.inode.node, h.file)).size
        if offset >= size:
            raise OSError(errno.ENXIO, "past end of file")
        return offset if whence == SEEK_DATA else size  # no hole information: all data

    async def fallocate(self, ctx, nodeid, fh, offset, length, mode):
        self._writable()
        h = self._handle(fh)
        backend = h.inode.source.backend
        if not isinstance(backend, Allocate):
            raise OSError(errno.EOPNOTSUPP, "the server cannot allocate")
        await self._settle(h.inode)
        h.inode.data_changes += 1
        await backend.allocate(h.file, mode, offset, length)
        self._stale(h.inode)

    async def copy_file_range(self, ctx, nodeid_in, fh_in, off_in, nodeid_out, fh_out, off_out, length, flags):
        self._writable()
        if flags:
            raise OSError(errno.EINVAL, "copy_file_range takes no flags")
        src, dst = self._handle(fh_in), self._handle(fh_out)
        await self._settle(src.inode, dst.inode)
        # The kernel bounded the copy by the size it was told; the same attributes, from the cache
        # while attr_timeout allows (cp's open has just fetched them), spare a small cp a round trip.
        sizes = await together([lambda: self._getattr(src.inode, src.file),
                                lambda: self._getattr(dst.inode, dst.file)])
        dst.inode.data_changes += 1
        try:
            return await self.planner.copy(self._endpoint(src.inode, src.file), off_in,
                                           self._endpoint(dst.inode, dst.file), off_out, length, sizes)
        finally:
            self._stale(dst.inode)  # a failed copy may have changed it too

    def _endpoint(self, inode, file):
        return Endpoint(inode.source.backend, inode.node, file, self._path(inode))

    def _path(self, inode):
        """The mount-relative path the inode was last seen under (a hint: renames may outdate it)."""
        names = []
        while inode is not None and inode.nodeid != ROOT:
            names.append(os.fsdecode(inode.name) if inode.parent else inode.source.name)
            inode = inode.parent
        return "/".join(reversed(names))

    # -- directories --------------------------------------------------------------

    def opendir_now(self, ctx, nodeid, flags):
        inode = self.inodes.get(nodeid)
        if inode is not None and inode.source is not None and inode.source.backend.per_user:
            return self._opened_dir(inode, False)  # each user's readdir is listed in their own session
        keep = None if inode is None else self._kernel_keeps_names_now(inode)
        return None if keep is None else self._opened_dir(inode, keep)

    async def opendir(self, ctx, nodeid, flags):
        inode = self._inode(nodeid)
        return self._opened_dir(inode, await self._kernel_keeps_names(inode))

    def _opened_dir(self, inode, keep):
        if not keep:
            inode.kernel_listing = None  # the kernel empties its cache of the names
        fh = next(self._fhs)
        self.handles[fh] = Handle(inode, unread=not keep)  # kept: checked now, and may never be read here
        inode.unread += not keep
        return Opened(fh, keep_cache=keep, cache_dir=inode.source is not None)

    def _kernel_keeps_names_now(self, inode):
        """True if the kernel may answer this open's reads from the names it cached (DirCache.
        kernel_may_keep): the directory's version is checked here, as a read would, since no read
        may reach us.  Past attr_timeout, the kernel then has the names without their attributes,
        as from a READDIRPLUS of names alone (``named``).  `find` over unchanged directories costs
        an open each, not a READDIRPLUS and a READDIR.  None where the server must say whether
        the directory changed (_kernel_keeps_names asks)."""
        kept = self.dircache.kernel_may_keep(inode) if inode.source is not None else None
        if kept is None:
            return False
        if self.dircache.fresh(inode, stats=True) is kept:
            return True
        valid = self.dircache.fresh(inode)
        return None if valid is None else self._keeps_names(inode, kept, valid)

    async def _kernel_keeps_names(self, inode):
        keep = self._kernel_keeps_names_now(inode)
        if keep is not None:
            return keep
        kept = self.dircache.kernel_may_keep(inode)
        try:
            valid = await self._revalidate(inode)
        except OSError as e:
            log.debug("%s: checking a listing: %s", self._where(inode), e)
            return False
        return self._keeps_names(inode, kept, valid)

    @staticmethod
    def _keeps_names(inode, kept, valid):
        """Whether the names the kernel keeps, ``kept``, are still the directory's listing ``valid``."""
        if valid is not kept or inode.kernel_listing is not kept:
            return False
        kept.named = kept.stats
        return True

    @staticmethod
    def _read(h):
        """The directory handle ``h`` was read from (or closed unread)."""
        if h.unread:
            h.unread = False
            h.inode.unread -= 1

    async def _list_ahead(self, inode):
        """The listing a directory opened and not read yet is about to need, fetched now: opendir(3)
        and fdopendir(3) fstat a directory before they read it, and the listing brings its
        attributes in the same round trip (one round trip a directory for `find` and `ls -lR`, not
        two).  Not for a directory known to be large: a handle held open unread (a dirfd for
        openat) would make every getattr of it a long listing.  Its errors are readdir's to report
        and the getattr then asks on its own, unless the server did not answer."""
        if inode.listing is not None and len(inode.listing.items) > RELIST_FOR_LOOKUP:
            return
        try:
            await self._valid_listing(inode, stats=True)
        except OSError as e:
            if e.errno in UNREACHABLE:
                raise
            log.debug("%s: listing ahead: %s", self._where(inode), e)

    async def readdir(self, ctx, nodeid, fh, offset, plus=False):
        h = self._handle(fh)
        self._read(h)
        self.stats.dir_reads += 1
        if offset == 0 or not h.listing:  # a new pass, or a seekdir() on a fresh handle
            h.snapshot_of, h.listing = await self._listing(h.inode, plus)
        if h.snapshot_of is not None:
            self.dircache.kernel_read(h.inode, h.snapshot_of, offset)
        return [DirEntry(name, ino, dtype, i + 1) for i, (name, ino, dtype) in
                enumerate(h.listing[offset:], start=offset)]

    async def readdirplus(self, ctx, nodeid, fh, offset, fits):
        """Each entry with its lookup, from the listing where it carried the attributes."""
        entries = await self.readdir(ctx, nodeid, fh, offset, plus=True)
        inode = self._inode(nodeid)
        listing = named = None
        if inode.source is not None:
            listing = self.dircache.fresh(inode, stats=True)
            named = None if listing is not None else self.dircache.fresh(inode)
            if named is not None:
                named.named = True
        out = []
        if named is not None:  # names alone but for directories the kernel holds (_named_entry): the
            for d in entries:  # fast path of a walk, taken for every directory it enters
                if not fits(d.name):
                    break
                entry = None
                if d.type == DT_DIR and d.name not in (b".", b".."):
                    entry = self._named_entry(inode, d.name, named)
                    if entry is not None:
                        d.ino = entry.attr.ino
                out.append((d, entry))
            return out
        for d in entries:
            if not fits(d.name):
                break
            entry = None
            if d.name not in (b".", b".."):
                try:
                    entry = await self._plus_entry(ctx, inode, d.name, listing)
                except FileNotFoundError:
                    pass  # vanished since listed: a zero entry tells the kernel nothing
                if entry is not None and entry.nodeid == 0:
                    entry = None
                if entry is not None:
                    d.ino = entry.attr.ino
            out.append((d, entry))
        return out

    async def _plus_entry(self, ctx, dir, name, listing):
        """The lookup of ``name`` in ``dir`` for a readdirplus reply: from ``listing`` (fresh, taken
        once for the whole reply) unless it is gone or the file has writes in flight, which a
        lookup waits for.  Asking the cache again for every entry cost more than the entry itself."""
        known = self.dentries.get((dir.nodeid, name))
        if listing is None or (known is not None and self.behind.end(known)):
            return await self.lookup(ctx, dir.nodeid, name)
        check_name(name)
        return await self._lookup_listed(dir, name, listing)

    def _named_entry(self, dir, name, listing):
        """The READDIRPLUS entry of ``name`` from a listing valid by its version whose attributes
        are past attr_timeout.  A directory the kernel holds by that name gets its node, with the
        attributes it was last handed and only what is left of their time (the kernel asks again
        past that), so that a walk enters it without a lookup.  Anything else gets a bare name
        (None), which costs least and which the kernel looks up when it needs more; so does a
        directory whose attributes we dropped for a change of ours."""
        item = listing.items.get(name)
        if item is None or item.type != DT_DIR:
            return None
        known = self.dentries.get((dir.nodeid, name))
        if (known is None or known.fmt != stat.S_IFDIR or known.ino != item.ino
                or known.stat is None or known.stat_expiry == 0.0):
            return None
        known.lookups += 1
        return Entry(known.nodeid, self._attr(known, known.stat),
                     min(self.options.entry_timeout, self.dircache.ttl(dir)), self._ttl(known))

    async def _listing(self, inode, plus):
        dots = [(b".", self._ino_of(inode), 4), (b"..", ROOT, 4)]  # d_ino 0 would hide ".."
        if inode.source is None:
            return None, dots + [(os.fsencode(s.name), self._ino_of(self.roots[s.index]), 4) for s in self.sources]
        listing = await self._valid_listing(inode, stats=plus)
        if not self.multi:  # the server's numbers, as _ino gives them
            return listing, dots + [(i.name, i.ino, i.type) for i in listing.items.values()]
        return listing, dots + [(i.name, self._ino(inode.source, i.ino), i.type) for i in listing.items.values()]

    async def _valid_listing(self, inode, relist_within=None, stats=False):
        """The directory's listing, revalidated or fetched again as the cache's rules say.  With
        ``relist_within`` (a lookup): None instead of fetching, unless the directory had a listing
        of at most that many entries (an unknown or large directory is asked for one name).
        ``stats``: see DirCache.fresh.  Where the source is per user, one listed for another user is
        dropped: it may hold what the caller cannot see."""
        uid = CALLER.get().uid
        per_user = inode.source.backend.per_user
        if per_user and inode.listing is not None and inode.listing.fetched_by != uid:
            self.dircache.drop(inode)
        listing = self.dircache.fresh(inode, stats)
        if listing is not None:
            return listing
        held = inode.listing
        if held is None and relist_within is not None:
            return None
        if held is not None and self.dircache.revalidates(held, stats):
            listing = self.dircache.fresh(inode) if stats and held.stats else None  # names alone will do
            if listing is None:
                listing = await self._revalidate(inode)
            if listing is not None:
                return listing
        if relist_within is not None and (held is None or len(held.items) > relist_within):
            self.dircache.drop(inode)
            return None
        key = (inode.nodeid, uid) if per_user else inode.nodeid
        fetching = self._fetching.get(key)
        if fetching is not None:  # listed ahead of a walk right now, or for another request: that answers
            await fetching.done.wait()
            if fetching.failed is not None:  # a timeout is paid once, not once a waiting request
                raise OSError(fetching.failed, os.strerror(fetching.failed))
            return await self._valid_listing(inode, relist_within, stats)
        self._fetching[key] = fetching = Fetching()
        try:
            if stats:
                self._walk_reached(inode)
            return await self._fetch_listing(inode)
        except OSError as e:
            if e.errno in UNREACHABLE:  # a refusal (EACCES) is not shared: a lookup may still ask alone
                fetching.failed = e.errno
            raise
        finally:
            del self._fetching[key]
            fetching.done.set()

    async def _fetch_listing(self, inode):
        self.stats.listings += 1
        asked, changes = time.monotonic(), inode.dir_changes
        if inode.source.leases:  # a break while the listing is made may be for a change it predates: not kept
            self._leased_dirs[(inode.source.index, inode.node)] = inode
        before, items = await inode.source.backend.listdir(inode.node)  # older than the items, as the version must be
        if not self.cache.newer_than(inode.key, inode, before, asked):  # unless we changed the directory meanwhile
            self._cache(inode, before, asked)
        listing = self.dircache.store(inode, before, items, asked, changes)
        listing.fetched_by = CALLER.get().uid
        if inode.source.leases and listing is inode.listing:
            backend = inode.source.backend
            listing.lease = backend.caching(inode.node)
            listing.watched = listing.lease is not None and inode.source.watches and backend.watched(inode.node)
        return listing

    def _walk_reached(self, dir):
        """A walk is about to wait for the listing of ``dir``: at the second subdirectory of a directory,
        the other ones it would list again are fetched ahead, AHEAD side by side, so that the walk
        finds them ready (cache.DirCache.walk_reached)."""
        parent = dir.parent
        if dir.source.backend.per_user:
            return  # listed ahead in no one's session
        if (parent is None or parent.listing is None or self.dentries.get((parent.nodeid, dir.name)) is not dir
                or not self.dircache.walk_reached(parent.listing)):
            return
        names = list(parent.listing.items)
        at = names.index(dir.name) + 1 if dir.name in names else 0
        ahead = []
        for name in names[at:] + names[:at]:  # in the order the walk read them
            sibling = self.dentries.get((parent.nodeid, name))
            if (sibling is not None and sibling is not dir and sibling.fmt == stat.S_IFDIR
                    and self.dircache.worth_listing_ahead(sibling)):
                ahead.append(sibling)
        if ahead:
            trio.lowlevel.spawn_system_task(self._list_ahead_of_walk, iter(ahead))

    async def _list_ahead_of_walk(self, dirs):
        """List ``dirs`` (an iterator), AHEAD at a time, while the walk goes on; an error is the walk's
        to meet when it gets there."""
        async def one_by_one():
            for dir in dirs:
                if (self.inodes.get(dir.nodeid) is dir and dir.nodeid not in self._fetching
                        and self.dircache.worth_listing_ahead(dir)):
                    self.stats.listings_ahead += 1
                    try:
                        await self._valid_listing(dir, stats=True)
                    except OSError as e:
                        log.debug("%s: listing ahead of a walk: %s", self._where(dir), e)
        async with trio.open_nursery() as nursery:
            for _ in range(AHEAD):
                nursery.start_soon(one_by_one)

    async def _revalidate(self, inode):
        """The directory's listing if its version is unchanged, by the attributes we hold while they
        are fresh (a lookup or listing of its parent just brought them), else by asking."""
        st = self.cache.fresh(inode)
        if st is not None:
            return self.dircache.revalidate(inode, st, inode.stat_since)
        return self.dircache.revalidate(inode, self._cache(inode, await inode.source.backend.getattr(inode.node)))

    async def _listing_for_stats(self, dir):
        """The kernel asks about a file of ``dir`` after READDIRPLUS gave it names alone: a walk
        stats what it lists (``ls -l``, ``du``).  One listing brings the attributes of all its files,
        and the walk's next directories bring theirs with their names (cache.DirCache).  None if
        the server refused the listing: the file is then asked about alone."""
        self.dircache.statting()
        try:
            return await self._valid_listing(dir, stats=True)
        except OSError as e:
            if e.errno in UNREACHABLE:
                raise
            log.debug("%s: listing for attributes: %s", self._where(dir), e)
            return None

    def releasedir(self, ctx, nodeid, fh):
        h = self.handles.pop(fh, None)
        if h is not None:
            self._read(h)

    async def fsyncdir(self, ctx, nodeid, fh, datasync):
        self._handle(fh)

    # -- the rest ------------------------------------------------------------------

    async def statfs(self, ctx, nodeid):
        inode = self._inode(nodeid)
        if inode.source is None:
            inode = self.roots[0]  # the synthetic root reports the first source
        return await inode.source.backend.statfs(inode.node)

    async def access(self, ctx, nodeid, mask):
        inode = self._inode(nodeid)
        st = self._attr(inode, await self._getattr(inode, None))
        if mask & os.W_OK and self.options.ro:
            raise OSError(errno.EROFS, "read-only mount")
        # Where each user reaches the source in a session of their own, the server decides at the open, as
        # for root: the owner and modes shown (file_mode=, uid=) are not what it checks (mount.cifs's noperm).
        if ctx.uid == 0 or inode.source is not None and inode.source.backend.per_user:
            if mask & os.X_OK and not (st.mode & 0o111 or stat.S_ISDIR(st.mode)):
                raise OSError(errno.EACCES, "permission denied")
            return
        shift = 6 if ctx.uid == st.uid else 3 if ctx.gid == st.gid else 0
        if (st.mode >> shift) & mask != mask:
            raise OSError(errno.EACCES, "permission denied")

    def no_such_xattr(self, nodeid, name):
        inode = self.inodes.get(nodeid)
        return inode is not None and inode.source is not None and not inode.source.backend.holds_xattr(name)

    async def getxattr(self, ctx, nodeid, name):
        if nodeid == ROOT and name == STATUS_XATTR:
            return json.dumps(self.stats.snapshot((src.backend for src in self.sources), ctx.uid)).encode()
        inode = self._inode(nodeid)
        if inode.source is None:
            raise OSError(errno.ENODATA, "no such attribute")
        return await inode.source.backend.getxattr(inode.node, name)

    async def setxattr(self, ctx, nodeid, name, value, flags):
        self._writable()
        inode = self._dir(nodeid)
        await inode.source.backend.setxattr(inode.node, name, value, flags)
        self._stale(inode)

    async def listxattr(self, ctx, nodeid):
        inode = self._inode(nodeid)
        if inode.source is None:
            return []
        return await inode.source.backend.listxattr(inode.node)

    async def removexattr(self, ctx, nodeid, name):
        self._writable()
        inode = self._dir(nodeid)
        await inode.source.backend.removexattr(inode.node, name)
        self._stale(inode)

    async def close(self):
        for h in list(self.handles.values()):
            if h.file is not None:
                with trio.CancelScope(shield=True):
                    await self._settle_at_release(h)
                with trio.CancelScope(shield=True):
                    await h.inode.source.backend.release(h.file)
        self.handles.clear()
        for src in self.sources:
            await src.backend.close()
