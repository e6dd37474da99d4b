"""The NFS backend: an export (or a directory in it) on an NFSv4.1/4.2 server.

Nodes are filehandles; inode numbers are the server's fileids.  Files are
open stateids, one open-owner per open file (two opens by one owner share a
stateid, and closing one would close both).  Writes go out UNSTABLE, several
at once, and are kept until a COMMIT with the same write verifier proves
them on disk; a changed verifier (the server restarted) sends them again.

NFSv4.2 gives the offload capabilities: COPY (synchronous for small ranges,
asynchronous with CB_OFFLOAD or OFFLOAD_STATUS for large ones), COPY_NOTIFY +
COPY between two servers, CLONE, SEEK, READ_PLUS, ALLOCATE/DEALLOCATE, and
user.* extended attributes (RFC 8276).
An operation a server answers NOTSUPP is remembered for that server, so the
next request moves on at once.

Requests go with the AUTH_SYS credential of the user they act for (CALLER:
the requester, or for an open file whoever opened it), so the server makes
new files theirs and checks their permissions, and a root-squashing export
lets users reach their own files.  Keeping the session alive goes as root.
Under sec=krb5, krb5i or krb5p the same requests go with that user's RPCSEC_GSS
context instead (gss.py): root's from the mount's credentials, anyone else's
from their own ticket cache.
"""
import collections
import errno
import itertools
import logging
import os
import stat

import trio

from .. import SourceError
from ..base import CALLER, Backend, DirItem, FsStat, NotSupported, Stat, user_xattr
from ..parallel import copy_spans, together
from . import attrs, errors, ops, url
from .errors import NFSError
from .session import Client

log = logging.getLogger(__name__)

IN_FLIGHT = 8  # READs or WRITEs of one call at once
SPARSE_RECHECK = 1.0  # seconds a file is taken to be sparse, or not
DIRTY_LIMIT = 64 << 20  # unstable bytes per file before a COMMIT
# The longest name, whatever the server says (the Linux client's NFS4_MAXNAMLEN): ganesha says
# 1024 for an xfs that takes 255, and the mount would pass that on.
MAXNAMLEN = 255
SYNC_COPY_LIMIT = 4 << 20  # larger copies run asynchronously
COPY_PER_CALL = 16 << 20  # bytes one COPY asks for
COPIES_IN_FLIGHT = 4  # COPYs of one server_copy call at once; the planner loops over calls (64 MiB),
# so progress reports and interrupts land between them
PULL_PER_CALL = 64 << 20  # one inter-server COPY: each costs a COPY_NOTIFY on the source first
POLL_START, POLL_MAX = 1.0, 5.0  # OFFLOAD_STATUS while waiting for CB_OFFLOAD
LATE_CALLBACK = 2.0  # how long a finished copy's CB_OFFLOAD may lag its OFFLOAD_STATUS
READDIR_MAX = 32768
# One listing's bounds: a server that never says eof must not grow a listing without end.
LISTING_MAX_ENTRIES = 1 << 20
LISTING_MAX_BYTES = 256 << 20  # of READDIR replies (maxcount each)
LIST_XATTRS_MAX = 65536
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
SEEK_DATA, SEEK_HOLE = 3, 4
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
# Answers that mean "not this way, for this pair or range" rather than "the copy failed".
COPY_UNSUPPORTED = {errors.XDEV, errors.INVAL, errors.WRONG_TYPE, errors.ISDIR, errors.OFFLOAD_DENIED,
                    errors.PARTNER_NOTSUPP, errors.UNION_NOTSUPP, errors.WRONG_LFS}
# An inter-server COPY's answers that mean "this server cannot pull from that one" (Linux nfsd:
# OFFLOAD_DENIED when it cannot mount the source or open the file there).
PULL_REFUSED = {errors.OFFLOAD_DENIED, errors.PARTNER_NOTSUPP, errors.PARTNER_NO_AUTH}
# What a server that takes no other server's filehandles answers the source's PUTFH with.
FOREIGN_FH_REFUSED = {errors.STALE, errors.BADHANDLE, errors.FHEXPIRED}


class Node:
    __slots__ = ("fh", "fmt")

    def __init__(self, fh, fmt):
        self.fh = fh
        self.fmt = fmt  # S_IFMT bits


class File:
    """An open file: its open stateid and the unstable writes not yet committed."""
    __slots__ = ("node", "access", "owner", "caller", "stateid", "generation", "dirty", "dirty_bytes", "lock",
                 "sparse", "sparse_until")

    def __init__(self, node, access, owner):
        self.node = node
        self.access = access
        self.owner = owner
        self.caller = CALLER.get()  # who opened it: a reclaim after a server restart goes as them
        self.stateid = None
        self.generation = -1
        self.dirty = []  # (offset, data, write verifier)
        self.dirty_bytes = 0
        self.lock = trio.Lock()
        self.sparse = False  # has holes: reads skip them (see NFSBackend.read)
        self.sparse_until = 0.0


def _access(flags):
    mode = flags & os.O_ACCMODE
    return {os.O_RDONLY: ops.SHARE_ACCESS_READ, os.O_WRONLY: ops.SHARE_ACCESS_WRITE}.get(mode, ops.SHARE_ACCESS_BOTH)


class NFSBackend(Backend):
    OPTIONS = url.OPTIONS
    HINTS = url.HINTS
    clears_setid_on_write = True  # as the Linux client has it; nfsd and ganesha do (test_mp_posix)
    owners_from_server = True  # requests carry their caller's ids (AUTH_SYS)

    def __init__(self, source_url, options):
        self.url = source_url
        self.settings, self.path = url.parse(source_url, options)
        self.client = None
        self.supported = self.stat_attrs = 0  # attributes the server has, and those of a Stat
        self.clone_blksize = 0
        self._owners = itertools.count(1)
        self.requests = collections.Counter()  # operation name -> sent in a compound

    def counters(self):
        return {"nfs_requests": dict(self.requests),
                "nfs_delegations": len(self.client.delegations.held) if self.client is not None else 0}

    def shares_server_with(self, other):
        # Stateids and filehandles are only good within one client's state on one server.
        return isinstance(other, NFSBackend) and self.client is not None and other.client is self.client

    # -- plumbing ------------------------------------------------------------------------

    async def _call(self, op_list, **kw):
        self.requests.update(type(op).__name__.upper() for op in op_list if not isinstance(op, ops.PutFH))
        return await self.client.compound(op_list, cred=self.client.cred(CALLER.get()), **kw)

    def _stat(self, v):
        rawdev = v.get(attrs.RAWDEV, (0, 0))
        return Stat(ino=v.get(attrs.FILEID, 0), mode=attrs.mode_of(v), nlink=v.get(attrs.NUMLINKS, 1),
                    uid=attrs.uid_of(v.get(attrs.OWNER, b"0")), gid=attrs.gid_of(v.get(attrs.OWNER_GROUP, b"0")),
                    rdev=os.makedev(*rawdev), size=v.get(attrs.SIZE, 0),
                    blocks=(v.get(attrs.SPACE_USED, 0) + 511) // 512, blksize=self.client.wsize,
                    atime_ns=v.get(attrs.TIME_ACCESS, 0), mtime_ns=v.get(attrs.TIME_MODIFY, 0),
                    ctime_ns=v.get(attrs.TIME_METADATA, 0), change=v.get(attrs.CHANGE, 0))

    def _node_stat(self, fh, values):
        st = self._stat(values)
        return Node(fh, stat.S_IFMT(st.mode)), st

    def _supported(self, op, what):
        if self.settings.minorversion < 2 or op in self.client.unsupported:
            raise NotSupported(f"{what}: not offered by this server")

    def _unsupported(self, op, e, what):
        """Remember a NOTSUPP for this server; NotSupported for answers that mean "not this way"."""
        if e.status == errors.NOTSUPP:
            log.info("NFS server %s does not support %s", self.settings.host, what)
            self.client.unsupported.add(op)
            return NotSupported(f"{what}: not supported by the server")
        return None

    def _refused(self, op, e, what):
        """NotSupported for an offload the server will not do (NOTSUPP remembered, or a refusal
        of this pair of files), else None: the error is a real one."""
        unsupported = self._unsupported(op, e, what)
        if unsupported is None and e.status in COPY_UNSUPPORTED:
            return NotSupported(f"{what}: {e.strerror}")
        return unsupported

    async def _with_state(self, files, build, **kw):
        """Run the compound ``build(*stateids)``, reopening files whose open state the server lost."""
        for attempt in range(3):
            for f in files:
                await self._ensure_open(f)
            sids = [f.stateid for f in files]
            try:
                return await self._call(build(*sids), **kw)
            except NFSError as e:
                if e.status not in errors.STATE_LOST or attempt == 2:
                    raise
                log.info("open state lost (%s); reopening", e.strerror)
                for f, sid in zip(files, sids):
                    if f.stateid == sid:
                        f.generation = -1

    async def _ensure_open(self, file):
        if file.generation == self.client.generation:
            return
        async with file.lock:
            if file.generation != self.client.generation:
                await self._open_state(file)

    async def _open_state(self, file):
        """Open ``file`` again by its filehandle, once the server lost its state and did not give it
        back (no grace period, or a lease expired or revoked).  The filehandle proves the file is
        ours, where SMB's file id does not: Linux nfsd's and ganesha's (FSAL VFS) carry the inode's
        generation beside its number (xfs_fs_encode_fh), so a file removed and restored from backup
        under the old inode number is another filehandle, and the old one is refused, STALE
        (test_mp_restore)."""
        reading = file.access == ops.SHARE_ACCESS_READ
        if not reading:
            await self.client.delegations.give_back(file.node.fh)
        generation = self.client.generation
        [_, opened] = await self._call([ops.PutFH(file.node.fh),
                                        ops.Open(file.access, file.owner, 0, delegation=reading)])
        file.stateid, file.generation = opened.stateid, generation
        self.client.open_files.add(file)
        self.client.delegations.granted(file.node, opened.delegation, self._delegation_ended if reading else None)

    # -- Leases: read delegations (delegations.py) ------------------------------------------------

    _on_break = None

    def caching(self, node):
        """While we hold a read delegation on ``node``'s file: that Delegation; else None."""
        return self.client.delegations.caching(node.fh, trio.current_time())

    def on_break(self, callback):
        """``callback(node)`` from now on, in the trio thread, where a delegation ends other than by
        our own writing open: recalled, or maybe lost with our state at the server."""
        self._on_break = callback

    def _delegation_ended(self, node):
        if self._on_break is not None:
            return self._on_break(node)
        return ()

    def _new_file(self, node, flags):
        return File(node, _access(flags), b"offloadfs-open-%d" % next(self._owners))

    # -- names and attributes ----------------------------------------------------------------

    async def root(self):
        self.client = Client.shared(self.settings)
        where = "/" + "/".join(c.decode(errors="replace") for c in self.path)
        try:
            await self.client.start(self.path)
            self.supported = self.client.supported_attrs  # ask for no others: some servers refuse them
            self.stat_attrs = attrs.STAT & self.supported
            try:
                res = await self._call([ops.PutRootFH()] + [ops.Lookup(c) for c in self.path] + [
                    ops.GetFH(), ops.GetAttr(self.stat_attrs | attrs.bits(attrs.CLONE_BLKSIZE, attrs.CHANGE_ATTR_TYPE,
                                                                          attrs.MAXNAME) & self.supported)])
            except NFSError as e:
                if e.status in (errors.NOENT, errors.NOTDIR):
                    raise SourceError(f"{self.url}: no export or directory {where} on {self.settings.host}") from None
                if e.status == errors.WRONGSEC:
                    raise SourceError(f"{self.url}: the server takes another flavour for {where}: leave sec= out "
                                      "to take its choice") from None
                if e.status in (errors.ACCESS, errors.PERM):
                    raise SourceError(f"{self.url}: the server refuses us {where} ({e.strerror})") from None
                raise
        except BaseException:
            client, self.client = self.client, None
            with trio.CancelScope(shield=True):
                await client.close()
            raise
        fh, values = res[-2], res[-1]
        self.clone_blksize = values.get(attrs.CLONE_BLKSIZE, 0)
        self.exact_version = values.get(attrs.CHANGE_ATTR_TYPE) in attrs.EXACT_CHANGE
        log.info("%s: change attribute type %s", self.url, values.get(attrs.CHANGE_ATTR_TYPE, "not given"))
        self.name_max = min(values.get(attrs.MAXNAME, MAXNAMLEN), MAXNAMLEN)
        return self._node_stat(fh, values)

    async def lookup(self, dir, name):
        _, _, fh, values = await self._call([ops.PutFH(dir.fh), ops.Lookup(name), ops.GetFH(),
                                             ops.GetAttr(self.stat_attrs)])
        return self._node_stat(fh, values)

    def forget(self, node):
        pass  # a filehandle holds nothing on the server

    def identity(self, node, st):
        return node.fh  # a fileid may name the next new file at once (xfs), a filehandle never

    async def getattr(self, node, file=None):
        _, values = await self._call([ops.PutFH(node.fh), ops.GetAttr(self.stat_attrs)])
        return self._stat(values)

    async def setattr(self, node, file=None, *, mode=None, uid=None, gid=None, size=None,
                      atime_ns=None, mtime_ns=None):
        values = {}
        if mode is not None:
            values[attrs.MODE] = mode
        if uid is not None:
            values[attrs.OWNER] = uid
        if gid is not None:
            values[attrs.OWNER_GROUP] = gid
        if size is not None:
            values[attrs.SIZE] = size
        if atime_ns is not None:
            values[attrs.TIME_ACCESS_SET] = atime_ns
        if mtime_ns is not None:
            values[attrs.TIME_MODIFY_SET] = mtime_ns
        if not values:
            return await self.getattr(node, file)

        def build(sid=ops.ANONYMOUS):
            return [ops.PutFH(node.fh), ops.SetAttr(values, sid), ops.GetAttr(self.stat_attrs)]

        if size is not None and file is not None and file.access & ops.SHARE_ACCESS_WRITE:
            await self._commit(file)  # a later resend of old unstable writes must not undo the truncation
            res = await self._with_state([file], build)
        else:
            res = await self._call(build())
        return self._stat(res[-1])

    async def readlink(self, node):
        _, target = await self._call([ops.PutFH(node.fh), ops.ReadLink()])
        return target

    async def _create(self, dir, op):
        res = await self._call([ops.PutFH(dir.fh), op, ops.GetFH(), ops.GetAttr(self.stat_attrs)], cache=True)
        return self._node_stat(res[-2], res[-1])

    async def mknod(self, dir, name, mode, rdev):
        fmt = stat.S_IFMT(mode)
        if fmt == stat.S_IFREG:
            node, st, file = await self.create(dir, name, os.O_WRONLY | os.O_EXCL, mode)
            await self.release(file)
            return node, st
        types = {stat.S_IFIFO: attrs.NF4FIFO, stat.S_IFSOCK: attrs.NF4SOCK,
                 stat.S_IFCHR: attrs.NF4CHR, stat.S_IFBLK: attrs.NF4BLK}
        if fmt not in types:
            raise OSError(errno.EINVAL, "unknown file type")
        return await self._create(dir, ops.Create(types[fmt], name, {attrs.MODE: mode},
                                                  rdev=(os.major(rdev), os.minor(rdev))))

    async def mkdir(self, dir, name, mode):
        return await self._create(dir, ops.Create(attrs.NF4DIR, name, {attrs.MODE: mode}))

    async def symlink(self, dir, name, target):
        return await self._create(dir, ops.Create(attrs.NF4LNK, name, {}, link=target))

    async def link(self, node, dir, name):
        res = await self._call([ops.PutFH(node.fh), ops.SaveFH(), ops.PutFH(dir.fh), ops.Link(name),
                                ops.RestoreFH(), ops.GetAttr(self.stat_attrs)], cache=True)
        return node, self._stat(res[-1])

    async def unlink(self, dir, name):
        await self._call([ops.PutFH(dir.fh), ops.Remove(name)], cache=True)

    rmdir = unlink  # REMOVE takes either; the kernel checked the type already

    async def rename(self, dir, name, newdir, newname, flags):
        if flags & RENAME_EXCHANGE or flags & ~(RENAME_EXCHANGE | RENAME_NOREPLACE):
            raise OSError(errno.EINVAL, "NFS cannot exchange names")
        if flags & RENAME_NOREPLACE:
            try:
                await self._call([ops.PutFH(newdir.fh), ops.Lookup(newname)])
                raise OSError(errno.EEXIST, "target exists")
            except NFSError as e:
                if e.status != errors.NOENT:
                    raise
        await self._call([ops.PutFH(dir.fh), ops.SaveFH(), ops.PutFH(newdir.fh), ops.Rename(name, newname)],
                         cache=True)

    # -- open files -------------------------------------------------------------------------------

    async def open(self, node, flags):
        if node.fmt == stat.S_IFLNK:
            raise OSError(errno.ELOOP, "is a symlink")
        if node.fmt == stat.S_IFDIR:
            raise OSError(errno.EISDIR, "is a directory")
        file = self._new_file(node, flags)
        await self._ensure_open(file)
        if flags & os.O_TRUNC:
            try:
                await self._with_state([file], lambda sid: [ops.PutFH(node.fh), ops.SetAttr({attrs.SIZE: 0}, sid)])
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self.release(file)
                raise
        return file

    async def create(self, dir, name, flags, mode):
        file = self._new_file(None, flags)
        values = {attrs.MODE: mode}
        if flags & os.O_TRUNC:
            values[attrs.SIZE] = 0
        how = ops.GUARDED4 if flags & os.O_EXCL else ops.UNCHECKED4
        generation = self.client.generation
        res = await self._call([ops.PutFH(dir.fh), ops.Open(file.access, file.owner, 0, name, how, values),
                                ops.GetFH(), ops.GetAttr(self.stat_attrs)], cache=True)
        _, opened, fh, values = res
        node, st = self._node_stat(fh, values)
        file.node, file.stateid, file.generation = node, opened.stateid, generation
        self.client.open_files.add(file)
        self.client.delegations.granted(node, opened.delegation, None)
        return node, st, file

    async def read(self, file, offset, size):
        if await self._sparse(file):
            return await self._read_sparse(file, offset, size)
        return await self._read_dense(file, offset, size)

    async def _sparse(self, file):
        """Whether the file has holes (space used < size); asked of the server at most once a second."""
        now = trio.current_time()
        if now >= file.sparse_until:
            st = await self.getattr(file.node, file)
            file.sparse = st.blocks * 512 < st.size
            file.sparse_until = now + SPARSE_RECHECK
        return file.sparse

    async def _read_sparse(self, file, offset, size):
        """Holes are found by SEEK and filled here, not sent over the link: READ_PLUS would, but
        ganesha 4.3's is broken and nfsd 6.1 sends holes as zeros."""
        out = bytearray()
        pos, end = offset, offset + size
        while pos < end:
            try:
                data_at = await self.seek(file, pos, SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                eof = (await self.getattr(file.node, file)).size  # a hole up to the end of the file
                out += bytes(max(0, min(end, eof) - pos))
                break
            if data_at > pos:
                out += bytes(min(data_at, end) - pos)
                pos = min(data_at, end)
                continue
            want = min(await self.seek(file, pos, SEEK_HOLE), end) - pos
            data = await self._read_dense(file, pos, want)
            out += data
            if len(data) < want:
                break  # end of file
            pos += want
        return bytes(out)

    async def _read_dense(self, file, offset, size):
        out = bytearray()
        step = self.client.rsize
        while len(out) < size:
            start = offset + len(out)
            want = size - len(out)
            pieces = [(start + i, min(step, want - i)) for i in range(0, min(want, step * IN_FLIGHT), step)]
            results = await together([lambda o=o, n=n: self._read_piece(file, o, n) for o, n in pieces])
            for (eof, data), (_, n) in zip(results, pieces):
                out += data
                if eof or not data:
                    return bytes(out)
                if len(data) < n:
                    break  # a short read: what the later pieces got is at the wrong place
        return bytes(out)

    async def _read_piece(self, file, offset, count):
        if self.settings.minorversion >= 2 and ops.OP_READ_PLUS not in self.client.unsupported:
            try:
                res = await self._with_state([file], lambda sid: [ops.PutFH(file.node.fh),
                                                                   ops.ReadPlus(sid, offset, count)])
            except NFSError as e:
                if not self._unsupported(ops.OP_READ_PLUS, e, "READ_PLUS"):
                    raise
            else:
                data = _assemble(offset, count, *res[-1])
                if data is not None:
                    return data
                if ops.OP_READ_PLUS not in self.client.unsupported:
                    log.warning("NFS server %s answers READ_PLUS with nonsense; using READ", self.settings.host)
                    self.client.unsupported.add(ops.OP_READ_PLUS)
        res = await self._with_state([file], lambda sid: [ops.PutFH(file.node.fh), ops.Read(sid, offset, count)])
        return res[-1]

    async def write(self, file, offset, data):
        view = memoryview(data)
        step = self.client.wsize
        starts = list(range(0, len(view), step))
        for i in range(0, len(starts), IN_FLIGHT):
            await together([lambda s=s: self._write_piece(file, offset + s, view[s:s + step])
                            for s in starts[i:i + IN_FLIGHT]])
        if file.dirty_bytes > DIRTY_LIMIT:
            await self._commit(file)
        return len(view)

    async def _write_piece(self, file, offset, data):
        done = 0
        while done < len(data):
            piece = bytes(data[done:])
            res = await self._with_state([file], lambda sid: [ops.PutFH(file.node.fh),
                                                               ops.Write(sid, offset + done, ops.UNSTABLE4, piece)])
            result = res[-1]
            if result.count == 0:
                raise OSError(errno.EIO, "the server wrote nothing")
            if result.committed == ops.UNSTABLE4:
                file.dirty.append((offset + done, piece[:result.count], result.verifier))
                file.dirty_bytes += result.count
            done += result.count

    async def _commit(self, file):
        """COMMIT the unstable writes made so far; those written under another verifier than
        COMMIT's go again. Writes landing meanwhile (writes behind, side by side) are left for the
        next COMMIT: only a server that loses the same writes again and again is an error."""
        for _ in range(3):
            dirty, file.dirty, file.dirty_bytes = file.dirty, [], 0
            if not dirty:
                return
            try:
                [_, verifier] = await self._call([ops.PutFH(file.node.fh), ops.Commit()])
            except BaseException:
                file.dirty = dirty + file.dirty
                file.dirty_bytes = sum(len(d) for _, d, _ in file.dirty)
                raise
            lost = [(o, d) for o, d, v in dirty if v != verifier]
            if not lost:
                return
            log.warning("NFS server %s restarted before committing %d writes; sending them again",
                        self.settings.host, len(lost))
            for o, d in lost:
                await self._write_piece(file, o, d)
        raise OSError(errno.EIO, "the server keeps losing unstable writes")

    async def flush(self, file):
        await self._commit(file)  # close-to-open: what one descriptor wrote is on disk when it closes

    async def fsync(self, file, datasync):
        await self._commit(file)

    async def release(self, file):
        try:
            await self._commit(file)
        finally:
            self.client.open_files.discard(file)
            if file.stateid is not None and file.generation == self.client.generation:
                try:
                    await self._call([ops.PutFH(file.node.fh), ops.Close(file.stateid)])
                except NFSError as e:
                    if e.status not in errors.STATE_LOST:
                        raise

    # -- directories and the rest ------------------------------------------------------------------

    async def listdir(self, node):
        """Every entry, page by page; EIO for a listing that would never end: a page without
        entries or eof, a cookie seen before (the same page again), more than the bounds."""
        items = []
        cookies = set()
        cookie, verifier = 0, bytes(8)
        # Each entry's attributes and filehandle: what a lookup would give (the kernel's READDIRPLUS).
        mask = (attrs.DIRENT | self.stat_attrs | attrs.bits(attrs.FILEHANDLE)) & self.supported
        for _ in range(LISTING_MAX_BYTES // READDIR_MAX):
            read = ops.ReadDir(cookie, verifier, READDIR_MAX // 4, READDIR_MAX, mask)
            if cookie:
                _, page = await self._call([ops.PutFH(node.fh), read])
            else:  # the directory's version along with the first page, taken before it
                _, values, page = await self._call([ops.PutFH(node.fh), ops.GetAttr(self.stat_attrs), read])
                before = self._stat(values)
            for e in page.entries:
                if e.cookie in cookies:
                    raise self._endless(f"READDIR repeats cookie {e.cookie}")
                cookies.add(e.cookie)
                if e.name not in (b".", b".."):
                    items.append(self._item(e))
            if page.eof:
                return before, items
            if not page.entries:
                raise self._endless("READDIR made no progress")
            if len(cookies) > LISTING_MAX_ENTRIES:
                raise self._endless(f"READDIR gave more than {LISTING_MAX_ENTRIES} entries")
            cookie, verifier = page.entries[-1].cookie, page.verifier
        raise self._endless(f"READDIR gave more than {LISTING_MAX_BYTES >> 20} MiB")

    def _item(self, e):
        v = e.values
        item = DirItem(e.name, v.get(attrs.FILEID, 0), attrs.DTYPE.get(v.get(attrs.TYPE), 0))
        if attrs.FILEHANDLE in v and attrs.TYPE in v:
            item.node, item.stat = self._node_stat(v[attrs.FILEHANDLE], v)
        return item

    def _endless(self, what):
        log.warning("NFS server %s: %s; the listing fails", self.settings.host, what)
        return OSError(errno.EIO, f"NFS server {self.settings.host}: {what}")

    async def statfs(self, node):
        _, v = await self._call([ops.PutFH(node.fh), ops.GetAttr(attrs.STATFS & self.supported)])
        frsize = 4096
        return FsStat(blocks=v.get(attrs.SPACE_TOTAL, 0) // frsize, bfree=v.get(attrs.SPACE_FREE, 0) // frsize,
                      bavail=v.get(attrs.SPACE_AVAIL, 0) // frsize, files=v.get(attrs.FILES_TOTAL, 0),
                      ffree=v.get(attrs.FILES_FREE, 0), bsize=self.client.wsize,
                      namelen=min(v.get(attrs.MAXNAME, MAXNAMLEN), MAXNAMLEN), frsize=frsize)

    # NFSv4.2 extended attributes (RFC 8276) hold the user namespace only, named without "user.".

    def _xattr_name(self, name):
        if not self.holds_xattr(name):
            raise OSError(errno.EOPNOTSUPP, "NFS holds only user.* attributes (no labels, no POSIX ACLs)")
        if self.settings.minorversion < 2 or ops.OP_GETXATTR in self.client.unsupported:
            raise OSError(errno.EOPNOTSUPP, "the server keeps no extended attributes")
        return name[5:]

    async def _xattr_call(self, node, op):
        try:
            return (await self._call([ops.PutFH(node.fh), op], cache=not isinstance(op, ops.GetXattr)))[-1]
        except NFSError as e:
            if self._unsupported(ops.OP_GETXATTR, e, "extended attributes"):
                raise OSError(errno.EOPNOTSUPP, "the server keeps no extended attributes") from None
            raise

    def holds_xattr(self, name):
        return user_xattr(name)

    async def getxattr(self, node, name):
        key = self._xattr_name(name)
        return await self._xattr_call(node, ops.GetXattr(key))

    async def setxattr(self, node, name, value, flags):
        key = self._xattr_name(name)
        option = {os.XATTR_CREATE: ops.SETXATTR4_CREATE, os.XATTR_REPLACE: ops.SETXATTR4_REPLACE}.get(
            flags, ops.SETXATTR4_EITHER)
        await self._xattr_call(node, ops.SetXattr(option, key, bytes(value)))

    async def listxattr(self, node):
        if self.settings.minorversion < 2 or ops.OP_GETXATTR in self.client.unsupported:
            return []
        names, cookie = [], 0
        while True:
            try:
                cookie, page, eof = await self._xattr_call(node, ops.ListXattrs(cookie, LIST_XATTRS_MAX))
            except OSError as e:
                if e.errno == errno.EOPNOTSUPP:
                    return []
                raise
            names += [b"user." + n for n in page]
            if eof:
                return names
            if not page:
                raise OSError(errno.EIO, "LISTXATTRS made no progress")

    async def removexattr(self, node, name):
        key = self._xattr_name(name)
        await self._xattr_call(node, ops.RemoveXattr(key))

    async def close(self):
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()

    # -- NFSv4.2 capabilities ---------------------------------------------------------------------

    @property
    def clone_align(self):
        return self.clone_blksize or 1

    async def clone_range(self, src_file, src_offset, dst_file, dst_offset, length):
        self._supported(ops.OP_CLONE, "CLONE")
        if src_offset % self.clone_align or dst_offset % self.clone_align:
            raise NotSupported("CLONE: offsets not aligned to the clone block size")
        try:
            await self._with_state([src_file, dst_file], lambda s, d: [
                ops.PutFH(src_file.node.fh), ops.SaveFH(), ops.PutFH(dst_file.node.fh),
                ops.Clone(s, d, src_offset, dst_offset, length)])
        except NFSError as e:
            refused = self._refused(ops.OP_CLONE, e, "CLONE")
            if refused:
                raise refused from None
            raise
        return length

    async def server_copy(self, src_file, src_offset, dst_file, dst_offset, length):
        """COPY up to COPIES_IN_FLIGHT x COPY_PER_CALL bytes.  Large copies go as several asynchronous
        COPYs side by side (a server runs each in its own thread); the count returned is the part
        done without a gap from the start, and the planner goes on from there."""
        self._supported(ops.OP_COPY, "COPY")
        # Synchronous COPYs come back short (nfsd: 4 MiB), which would cut the spans after them off.
        spans = COPIES_IN_FLIGHT if self.client.async_copies else 1
        return await copy_spans(
            lambda start, count: self._copy(src_file, src_offset + start, dst_file, dst_offset + start, count),
            min(length, spans * COPY_PER_CALL), COPY_PER_CALL, spans)

    async def _copy(self, src_file, src_offset, dst_file, dst_offset, count):
        """One COPY of ``count`` bytes (the server may copy fewer), committed."""
        # Asynchronous only where CB_OFFLOAD can reach us: OFFLOAD_STATUS alone cannot tell how it ended.
        synchronous = count <= SYNC_COPY_LIMIT or not self.client.async_copies
        for attempt in range(4):
            try:
                res = await self._with_state([src_file, dst_file], lambda s, d: [
                    ops.PutFH(src_file.node.fh), ops.SaveFH(), ops.PutFH(dst_file.node.fh),
                    ops.Copy(s, d, src_offset, dst_offset, count, synchronous)], retry_delay=False)
            except NFSError as e:
                refused = self._refused(ops.OP_COPY, e, "COPY")
                if refused:
                    raise refused from None
                if e.status == errors.OFFLOAD_NO_REQS:
                    synchronous = not synchronous if e.detail is None else e.detail
                    continue
                if e.status == errors.DELAY:
                    synchronous = True
                    await trio.sleep(0.1 * (attempt + 1))
                    continue
                raise
            copy = res[-1]
            if copy.callback is None:
                result = copy.result
            else:
                result = await self._await_offload(dst_file, copy.callback)
                if result is None:
                    log.warning("NFS server %s ended a copy without telling how; copying synchronously from "
                                "now on", self.settings.host)
                    self.client.async_copies = False
                    synchronous = True
                    continue
            if await self._committed(dst_file, dst_offset, result):
                return result.count
            log.warning("NFS server %s restarted during a copy; copying again", self.settings.host)
        raise NotSupported("COPY: the server keeps failing")

    async def inter_server_copy(self, src_backend, src_file, src_offset, dst_file, dst_offset, length):
        """Have this server pull a range of a file on ``src_backend``'s server (RFC 7862, 4.2).

        COPY_NOTIFY asks the source server to let this one read the file and answers a stateid
        for that and the addresses to reach it at; COPY hands both to this server, which mounts
        the source itself.  Only an asynchronous COPY may go between servers (Linux nfsd answers
        a synchronous one NOTSUPP), so the outcome comes by CB_OFFLOAD.
        """
        source = self._pull_source(src_backend)
        count = min(length, PULL_PER_CALL)
        stateid, sources = await src_backend._copy_notify(src_file, ops.NetLoc.address(*self.client.address))
        try:
            return await self._pull(source, stateid, sources, src_file, src_offset, dst_file, dst_offset, count)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await src_backend._end_notify(src_file, stateid)

    def _pull_source(self, src_backend):
        """The source server as (host, port); NotSupported at once when this pair cannot copy."""
        if not isinstance(src_backend, NFSBackend) or src_backend.client is None:
            raise NotSupported("inter-server COPY: the source is not on an NFS server")
        if self.settings.minorversion < 2 or src_backend.settings.minorversion < 2:
            raise NotSupported("inter-server COPY: needs NFSv4.2 on both sides")
        if not self.client.pulls or ops.OP_COPY in self.client.unsupported:
            raise NotSupported(f"inter-server COPY: {self.settings.host} does not copy from other servers")
        if ops.OP_COPY_NOTIFY in src_backend.client.unsupported:
            raise NotSupported(f"inter-server COPY: {src_backend.settings.host} does not let others copy from it")
        if src_backend.client.address == self.client.address:
            # One server through two sessions: it would mount itself (a loopback mount can deadlock).
            raise NotSupported("inter-server COPY: both files are on one server")
        source = (src_backend.settings.host, src_backend.settings.port)
        if source in self.client.refused_sources:
            raise NotSupported(f"inter-server COPY: {self.settings.host} could not copy from {source[0]}")
        if not self.client.async_copies:
            raise NotSupported("inter-server COPY: asynchronous only, and CB_OFFLOAD does not reach us")
        return source

    async def _copy_notify(self, file, destination):
        """(stateid, source server addresses) from COPY_NOTIFY, on the source's backend."""
        try:
            [_, notified] = await self._with_state([file], lambda sid: [
                ops.PutFH(file.node.fh), ops.CopyNotify(sid, destination)])
        except NFSError as e:
            refused = self._refused(ops.OP_COPY_NOTIFY, e, "COPY_NOTIFY")
            if refused:
                raise refused from None
            raise
        # None named: the address we reach it at (a COPY with no source would be an intra-server one).
        return notified.stateid, notified.sources or [ops.NetLoc.address(*self.client.address)]

    async def _end_notify(self, file, stateid):
        """OFFLOAD_CANCEL on the source: the copy is over, withdraw what COPY_NOTIFY allowed
        (else it lingers for a lease)."""
        try:
            await self._call([ops.PutFH(file.node.fh), ops.OffloadCancel(stateid)])
        except OSError as e:
            log.debug("OFFLOAD_CANCEL of a copy notification: %s", e)

    async def _pull(self, source, stateid, sources, src_file, src_offset, dst_file, dst_offset, count):
        """The destination's part of an inter-server copy: COPY, then wait for CB_OFFLOAD."""
        for attempt in range(4):
            try:
                res = await self._with_state([dst_file], lambda d: [
                    ops.PutFH(src_file.node.fh), ops.SaveFH(), ops.PutFH(dst_file.node.fh),
                    ops.Copy(stateid, d, src_offset, dst_offset, count, False, sources)], retry_delay=False)
                copy = res[-1]
                result = copy.result if copy.callback is None else await self._await_offload(dst_file, copy.callback)
            except NFSError as e:
                await self._pull_failed(e, source, dst_file, attempt)
                continue
            if result is None:
                log.warning("NFS server %s ended a copy without telling how; no more inter-server copies",
                            self.settings.host)
                self.client.async_copies = False
                raise NotSupported("inter-server COPY: outcome unknown")
            if await self._committed(dst_file, dst_offset, result):
                return result.count
            log.warning("NFS server %s restarted during a copy; copying again", self.settings.host)
        raise NotSupported("inter-server COPY: the server keeps failing")

    async def _pull_failed(self, e, source, dst_file, attempt):
        """Sort a failed inter-server COPY: NotSupported (remembered where it will not change),
        a return to try again, or the error itself."""
        what = f"inter-server COPY from {source[0]} to {self.settings.host}"
        if e.status == errors.NOTSUPP:
            log.info("NFS server %s does not copy from other servers", self.settings.host)
            self.client.pulls = False
            raise NotSupported(f"{what}: not supported") from None
        if e.status in FOREIGN_FH_REFUSED and e.op == "PutFH":
            await self.getattr(dst_file.node)  # our own filehandle gone stale: that error, not this
            log.info("NFS server %s takes no other server's filehandles: no inter-server copies", self.settings.host)
            self.client.pulls = False
            raise NotSupported(f"{what}: the source's filehandle refused") from None
        if e.status in PULL_REFUSED:
            log.warning("%s refused (%s); such copies stream from now on", what, e.strerror)
            self.client.refused_sources.add(source)
            raise NotSupported(f"{what}: {e.strerror}") from None
        if e.status in COPY_UNSUPPORTED:
            raise NotSupported(f"{what}: {e.strerror}") from None
        if e.status == errors.DELAY:  # Linux nfsd: too many copies in flight
            await trio.sleep(0.1 * (attempt + 1))
            return
        raise e

    async def _committed(self, file, offset, result):
        """COMMIT what a copy wrote unstably; False if the server lost it (the write verifier changed)."""
        if result.committed == ops.FILE_SYNC4 or result.count == 0:
            return True
        count = result.count if result.count <= 0xFFFFFFFF else 0  # 0: through the end of the file
        [_, verifier] = await self._call([ops.PutFH(file.node.fh), ops.Commit(offset, count)])
        return verifier == result.verifier

    async def _await_offload(self, dst_file, stateid):
        """How an asynchronous COPY ended (a WriteResult), from CB_OFFLOAD or OFFLOAD_STATUS; None if unknown.

        OFFLOAD_STATUS covers a late callback, but Linux nfsd never reports completion there and
        answers BAD_STATEID once the copy is over, so that answer means "over: the callback should
        be on its way".  A cancelled wait cancels the copy on the server.
        """
        record = self.client.offload(stateid)
        fh = dst_file.node.fh
        interval = POLL_START
        try:
            while not record.done.is_set():
                with trio.move_on_after(interval):
                    await record.done.wait()
                if record.done.is_set():
                    break
                try:
                    [_, (count, complete)] = await self._call([ops.PutFH(fh), ops.OffloadStatus(stateid)])
                except NFSError as e:
                    if e.status == errors.NOTSUPP:
                        interval = POLL_MAX  # nothing to ask: wait for the callback
                        continue
                    if e.status not in (errors.BAD_STATEID, errors.OLD_STATEID, errors.STALE_STATEID):
                        raise
                    with trio.move_on_after(LATE_CALLBACK):
                        await record.done.wait()
                    if not record.done.is_set():
                        return None
                    break
                if complete is not None:
                    if complete != errors.OK and count == 0:
                        raise NFSError(complete, "COPY")
                    return await self._stable(dst_file, count)
                interval = min(interval * 2, POLL_MAX)
        except trio.Cancelled:
            self.client.spawn(self._cancel_offload, fh, stateid)
            raise
        finally:
            self.client.offload_ended(stateid)
        outcome = record.outcome
        if outcome.status == errors.OK:
            return outcome.result
        if outcome.copied == 0:
            raise NFSError(outcome.status, "COPY")
        return await self._stable(dst_file, outcome.copied)  # a partial copy: the planner goes on from there

    async def _cancel_offload(self, fh, stateid):
        """OFFLOAD_CANCEL of a copy nobody waits for, in the background: the interrupted request is
        answered at once, and a stalled server gets the cancel once it answers again.  Tried for a
        lease: a server that heard nothing from us that long drops our state, copies included."""
        with trio.move_on_after(self.client.lease):
            while True:
                try:
                    await self._call([ops.PutFH(fh), ops.OffloadCancel(stateid)])
                    return
                except NFSError as e:  # BAD_STATEID: the copy is over already
                    log.debug("OFFLOAD_CANCEL: %s", e)
                    return
                except OSError as e:  # a soft mount's timeout: the server still does not answer
                    log.debug("OFFLOAD_CANCEL, trying again: %s", e)
                    await trio.sleep(1)

    async def _stable(self, file, count):
        """A WriteResult for ``count`` bytes copied under no known verifier: COMMIT now, check nothing."""
        if count:
            await self._call([ops.PutFH(file.node.fh), ops.Commit()])
        return ops.WriteResult(count, ops.FILE_SYNC4, bytes(8))

    async def seek(self, file, offset, whence):
        if whence not in (SEEK_DATA, SEEK_HOLE):
            raise OSError(errno.EINVAL, "only SEEK_DATA and SEEK_HOLE go to the server")
        if self.settings.minorversion >= 2 and ops.OP_SEEK not in self.client.unsupported:
            try:
                [_, (eof, found)] = await self._with_state([file], lambda sid: [
                    ops.PutFH(file.node.fh), ops.Seek(sid, offset, whence == SEEK_HOLE)])
            except NFSError as e:
                if not self._unsupported(ops.OP_SEEK, e, "SEEK"):
                    raise
            else:
                if whence == SEEK_DATA and eof:
                    raise OSError(errno.ENXIO, "no data past the offset")
                return found
        size = (await self.getattr(file.node, file)).size  # no hole information: all data
        if offset >= size:
            raise OSError(errno.ENXIO, "past end of file")
        return offset if whence == SEEK_DATA else size

    async def allocate(self, file, mode, offset, length):
        if mode == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE:
            op, deallocate = ops.OP_DEALLOCATE, True
        elif mode in (0, FALLOC_FL_KEEP_SIZE):
            op, deallocate = ops.OP_ALLOCATE, False
            if mode == FALLOC_FL_KEEP_SIZE:  # ALLOCATE grows the file: stop at its end
                length = min(offset + length, (await self.getattr(file.node, file)).size) - offset
                if length <= 0:
                    return
        else:
            raise OSError(errno.EOPNOTSUPP, "NFS allocates and punches holes, nothing else")
        if self.settings.minorversion < 2 or op in self.client.unsupported:
            raise OSError(errno.EOPNOTSUPP, "the server cannot allocate")
        try:
            await self._with_state([file], lambda sid: [ops.PutFH(file.node.fh),
                                                         ops.Allocate(sid, offset, length, deallocate)])
        except NFSError as e:
            self._unsupported(op, e, "DEALLOCATE" if deallocate else "ALLOCATE")
            raise


def _assemble(offset, count, eof, segments):
    """READ_PLUS segments -> (eof, bytes), or None when they make no sense (gaps, overlaps, no progress)."""
    out = bytearray()
    for seg_offset, data, length in segments:
        if seg_offset != offset + len(out) or length == 0:
            return None
        length = min(length, count - len(out))
        out += data[:length] if data is not None else bytes(length)
        if len(out) >= count:
            break
    if not out and not eof:
        return None
    return eof, bytes(out)
