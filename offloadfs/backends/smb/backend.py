"""The SMB backend: one share (or a directory in it) on an SMB 2/3 server.

SMB names files by path, so a node is a small mutable object holding a
path in the share; the backend keeps path -> node so that a rename can move
the renamed node and everything below it (the filesystem keeps node objects
across renames).  Inode numbers are the server's file ids, and the filesystem
keeps one node per file id, so the backend does too: a node remembers every
name it was seen under (hard links, a rename by another client) and goes on
by another when one goes.  Most operations are one related compound (open +
work + close) and so one round trip.

Without unix extensions (Samba 4.17 offers SMB3 ones only in developer
builds) there are no symlinks, device nodes, owners or modes: modes come from
file_mode=/dir_mode=, chmod toggles the read-only attribute (as mount.cifs
does), chown is accepted and ignored, and xattrs are user.* names stored as
SMB extended attributes.

With multiuser (client.py) a request goes in its caller's session (_uid),
and a request on a handle in the session that opened it (``File.uid``),
whoever sends it: a write behind, a deferred close, a copy.  A handle is
never lent to another user: not a kept one (closetimeo=), not one borrowed
for a getattr, setattr or fsync, not the source of a copy; nor are listings
(their attributes answer lookups for a second) or directory leases, which
are not asked for.
"""
import collections
import errno
import functools
import hashlib
import logging
import os
import re
import stat
import time
import uuid

import trio
from smbprotocol import Dialects
from smbprotocol.file_info import InfoType

from .. import SourceError
from ..base import CALLER, NOW, Backend, DirItem, FsStat, Stat, user_xattr
from . import errors, info, leases, messages as m, posix, url, wire
from .capabilities import Capabilities, CopyLimits
from ..parallel import together
from .client import Client, ConnectionLost
from .errors import status_error, status_of

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
LIST_BUFFER = 65536
# A listing past these is taken for a server that never says STATUS_NO_MORE_FILES: each entry costs
# the daemon some hundred bytes until the listing is answered, so this bounds its memory too.
LIST_MAX_ENTRIES = 1 << 20
LIST_MAX_BYTES = 1 << 29  # of replies: a million entries with names of 255 UTF-16 units
# READ/WRITE size, below Samba's 8 MiB maximum: large reads and writes go as several at once, so the
# server handles one while the next crosses the link (1 Gbit lab: sequential 8 MiB writes 65 -> 104 MB/s).
PIECE = 1 << 20
LISTED_FOR = 1.0  # seconds a directory listing answers lookups (READDIRPLUS looks up every entry)
DIR_LEASES_MAX = 64  # directory leases held at once, each an open handle at the server
# What an SMB name cannot hold: a path separator, a stream name, wildcards, control characters (a POSIX
# open takes them all but / and NUL; \ is our separator in paths, so not that either)
BAD_NAME = re.compile(r'[\\:*?"<>|\x00-\x1f]')
# Longest share path we make, in UTF-8 bytes (not characters: 2-byte ones fail at the same byte count): Samba
# 4.17 creates directories deeper than this but answers their rmdir with OBJECT_NAME_INVALID (PATH_MAX, 4096
# with its NUL), so nothing longer is made or named.  SMB2's own limit, 32767 UTF-16 units, is far beyond.
MAX_PATH = 4095
CALLERS = object()  # _send's default: the caller's session


class Node:
    """A file or directory by its path in the share.

    ``paths``: every name it is known by, the last seen last (a dict for its
    order); ``path`` the one in use (None once all were removed through us).  ``files``: its open handles, which
    its attributes come from (an unlinked file has no path) and times must be set through (see setattr).
    ``changed_ns``: when we last changed its links or attributes; Samba reports the mtime as the change time,
    so that is the least ctime we report.  ``lease``: the leases.Lease its opens name, made at the first.
    ``nlink``: its link count as last known (see _nlink), or None.
    """
    __slots__ = ("path", "paths", "ino", "is_dir", "files", "changed_ns", "lease", "nlink")

    def __init__(self, path, ino, is_dir):
        self.path = path
        self.paths = {path: None}
        self.ino = ino
        self.is_dir = is_dir
        self.files = []
        self.changed_ns = 0
        self.lease = None
        self.nlink = None

    def changed(self):
        self.changed_ns = time.time_ns()


class File:
    """An open handle; after a reconnect, kept only if the server reconnects its durable handle (see _reopen).

    ``create_guid``: names the durable handle the server granted (None: not durable); ``lost``: why it could
    not be reconnected, after which every use fails; ``attributes``: what the open found, until opened() takes
    them; ``lease``: the lease it was opened under (None: a directory).
    """
    __slots__ = ("backend", "node", "access", "file_id", "generation", "create_guid", "lost", "sparse",
                 "resume_key", "key_generation", "attributes", "lease", "created", "watched", "uid")

    def __init__(self, backend, node, access, file_id, generation, uid=None):
        self.uid = uid  # whose session opened it (multiuser; None: the mount's)
        self.backend = backend
        self.node = node
        self.access = access
        self.file_id = file_id
        self.generation = generation
        self.create_guid = None
        self.lost = None
        self.sparse = False
        self.resume_key = None
        self.key_generation = 0
        self.attributes = None
        self.lease = None
        self.created = False  # the open created the file
        self.watched = False  # a directory's: a CHANGE_NOTIFY of ours is pending on it (Capabilities._watch)


class SMBBackend(Capabilities, Backend):
    OPTIONS = url.OPTIONS
    HINTS = url.HINTS

    def __init__(self, source_url, options):
        self.url = source_url
        self.target = url.parse(source_url, options)
        self.share = self.target.share
        self.per_user = self.target.multiuser
        self.client = None
        self.nodes = {}  # path -> Node, for every node the filesystem holds
        self.below = {}  # path -> the paths one level below it that are in nodes or have paths below them
        self.by_id = {}  # file id -> Node, the same nodes
        self.can_clone = False
        self.namelen = 255
        self.copy_limits = CopyLimits()
        self._reopening = trio.Lock()
        self._listed = {}  # path -> (Attributes, expiry) from the last listings; see lookup()
        self.deferred = {}  # Node -> (File, trio.CancelScope of its timer): released, kept open (see release)
        self.dir_leases = {}  # directory Node -> None: whose listing's handle is held (_hold_listing), oldest first
        self.dir_lease_breaks = 0  # breaks of those leases the server sent (our own changes should cause none)
        self.requests = collections.Counter()  # command name -> requests sent
        self.posix = False  # the connection has SMB 3.1.1 POSIX extensions: every open asks for POSIX semantics
        self.round_trips = 0  # requests and compounds sent, each answered before its caller goes on
        self.devices = {}  # (file id, creation time) -> st_rdev of the device nodes seen (see _read_devices)

    @property
    def owners_from_server(self):
        return self.posix  # without the extensions every file shows root (or uid=, gid=)

    def shares_server_with(self, other):
        # Resume keys and file ids are only good on the connection that issued them.
        return isinstance(other, SMBBackend) and self.client is not None and other.client is self.client

    # -- plumbing -------------------------------------------------------------------

    def counters(self):
        return {"smb_requests": dict(self.requests), "smb_round_trips": self.round_trips,
                "smb_handles_kept": len(self.deferred) - len(self.dir_leases), "smb_dir_leases": len(self.dir_leases),
                "smb_dir_lease_breaks": self.dir_lease_breaks, "smb_posix_sources": int(self.posix),
                "smb_user_sessions": len(self.client.sessions) if self.client is not None else 0}

    def _uid(self):
        """Whose session the caller's requests go in: theirs with multiuser, unless root; None: the mount's."""
        uid = CALLER.get().uid
        return uid if self.target.multiuser and uid != 0 else None

    async def _send(self, msgs, generation=None, uid=CALLERS, sent=None):
        """Every request of the backend goes out here (Client.call), counted for status and logged with -o debug:
        what a FUSE operation costs in round trips shows right under it in the log.  ``uid``: whose session
        (see _uid), the caller's unless given."""
        names = [m.command(msg) for msg in msgs]
        self.requests.update(names)
        self.round_trips += 1
        log.debug("   smb %s", "+".join(names))
        return await self.client.call(self.share, msgs, generation, self._uid() if uid is CALLERS else uid, sent)

    async def _send1(self, msg, generation=None, what="", uid=CALLERS):
        """One request whose failure is an error; its response body."""
        [(status, body)] = await self._send([msg], generation, uid)
        if status != errors.SUCCESS:
            raise status_error(status, body, what)
        return body

    async def _call(self, msgs, what="", generation=None):
        """A related compound whose every step must succeed; the response bodies."""
        results = await self._send(msgs, generation)
        for status, body in results:
            if status != errors.SUCCESS:
                raise status_error(status, body, what)
        return [body for _, body in results]

    async def _handle(self, file):
        """The file id of ``file`` on the current connection, its durable handle reconnected after a reconnect."""
        if file.lost:
            raise OSError(errno.EIO, file.lost)
        await self.client.tree_id(self.share, file.uid)
        if file.generation != self.client.generation:
            async with self._reopening:
                if file.lost:
                    raise OSError(errno.EIO, file.lost)
                if file.generation != self.client.generation:
                    await self._reopen(file)
        return file.file_id

    async def _reopen(self, file):
        """Reconnect ``file``'s durable handle; failing that, the handle is lost for good (EIO).

        Only the server can vouch that a file is the one we had, as we left it.
        While we were away the file may have been removed and restored from a
        backup: on xfs the new file gets the old inode number (Samba's file id),
        and `cp -a` keeps user.DOSATTRIB, where Samba keeps the creation time, so
        nothing a reopen by name could compare tells the two apart, and Samba's
        mtime and ctime can be frozen or put back.  Writes through such a reopen
        landed in the backup and said nothing of the bytes written before.  A
        durable reconnect is checked by Samba itself: it compares the file's
        device, inode, size, times and ctime (which no restore can put back) with
        what they were when our connection went (vfs_default_durable_reconnect),
        and refuses it after another client broke its handle caching (the H of
        its lease), or once smbd restarted.  Read-only handles follow the same
        rule: nothing exact tells a reader that the file still holds what it read.
        """
        generation = self.client.generation
        where = file.node.path or "a removed file"
        if file.create_guid is None:
            file.lost = f"{where}: lost in a reconnect (the server kept no durable handle)"
            raise OSError(errno.EIO, file.lost)
        try:
            new, _ = await self._open(file.node, _path(file.node), file.access, m.OPEN, m.NON_DIRECTORY_FILE, file)
        except ConnectionLost:
            raise
        except OSError as e:
            file.lost = f"{where}: lost in a reconnect (the server refused its durable handle: {e.strerror})"
            raise OSError(errno.EIO, file.lost) from None
        file.file_id, file.create_guid = new.file_id, new.create_guid
        file.generation = generation

    async def _file_call(self, file, msg):
        """The response body of one request on ``file``'s handle, which must succeed."""
        fid = await self._handle(file)
        return await self._send1(msg(fid), file.generation, file.node.path or "", file.uid)

    def _stat(self, a: info.Attributes):
        node = self.by_id.get(a.file_id)
        ctime_ns = max(a.ctime_ns, node.changed_ns) if node is not None else a.ctime_ns
        if a.mode is not None:
            return self._posix_stat(a, ctime_ns, self.devices.get((a.file_id, a.btime_ns), 0))
        if a.is_dir:
            mode = stat.S_IFDIR | self.target.dir_mode
        else:
            mode = stat.S_IFREG | self.target.file_mode
        if a.attributes & info.ATTR_READONLY:
            mode &= ~0o222
        # Samba counts a delete-pending name out already: 0 links for a file unlinked while open.
        nlink = _nlink(node, a)
        return Stat(ino=a.file_id, mode=mode, nlink=nlink if a.delete_pending else max(1, nlink), size=a.size,
                    blocks=(a.allocation + 511) // 512, blksize=1 << 20, atime_ns=a.atime_ns, mtime_ns=a.mtime_ns,
                    ctime_ns=ctime_ns)

    def _node(self, path, a: info.Attributes):
        """The node of file ``a``, now going by ``path``, the name it was just found under."""
        node = self.by_id.get(a.file_id)
        if node is None or node.is_dir != a.is_dir:  # Samba's file ids are inode numbers, which xfs reuses
            node = self.by_id[a.file_id] = Node(path, a.file_id, a.is_dir)
        old = self.nodes.get(path)
        if old is not None and old is not node:
            self._unname(old, path)  # the path now names another file
        node.path = path
        node.paths.pop(path, None)
        node.paths[path] = None
        self._name(path, node)
        return node

    def _name(self, path, node):
        self.nodes[path] = node
        while path:  # the share's root, "", is below nothing
            parent = path.rpartition("\\")[0]
            names = self.below.setdefault(parent, set())
            if path in names:
                break
            names.add(path)
            path = parent

    def _drop(self, path):
        """The node ``path`` named, which it names no more."""
        node = self.nodes.pop(path)
        while path and path not in self.nodes and not self.below.get(path):
            self.below.pop(path, None)
            parent = path.rpartition("\\")[0]
            names = self.below[parent]
            names.discard(path)
            if not names:
                del self.below[parent]
            path = parent
        return node

    def _known(self, path):
        """``path`` and the known paths below it, parents first."""
        found, walk = [], [path]
        while walk:
            p = walk.pop()
            if p in self.nodes:
                found.append(p)
            walk.extend(self.below.get(p, ()))
        return found

    @staticmethod
    def _unname(node, path):
        """``path`` no longer names ``node``: it goes on by the name last seen, if it has another."""
        node.paths.pop(path, None)
        if node.path == path:
            node.path = next(reversed(node.paths), None)

    def _removed(self, path):
        """``path`` and everything below it no longer exist."""
        for p in self._known(path):
            self._unname(self._drop(p), p)

    def _moved(self, old, new):
        self._removed(new)
        for p, node in [(p, self._drop(p)) for p in self._known(old)]:
            moved = new + p[len(old):]
            del node.paths[p]
            node.paths[moved] = None
            if node.path == p:
                node.path = moved
            self._name(moved, node)

    # -- POSIX extensions or not: what opens carry and what queries ask for --------------------------

    def _create(self, path, access, disposition=m.OPEN, options=0, mode=0, contexts=(), **kwargs):
        """A CREATE, with the POSIX create context where the connection has the extensions: Samba answers
        POSIX information only on such opens.  ``mode``: the permissions of what it creates."""
        if self.posix:
            contexts = [*contexts, posix.create_context(mode)]
            options |= posix.OPEN_REPARSE_POINT
        return m.create(self._wire_path(path), access, disposition, options, contexts=contexts, **kwargs)

    def _wire_path(self, path):
        """``path`` as the server takes it: a POSIX open separates names with /, where a \\ is a character
        (which _child refuses, so paths here keep \\ as their separator)."""
        return path.replace("\\", "/") if self.posix else path

    def _query_all(self, file_id=m.RELATED):
        if self.posix:
            return m.query_info(posix.FILE_POSIX_INFORMATION, file_id, 4096)
        return _query_all(file_id)

    def _attributes_in(self, body):
        """The Attributes in a QUERY_INFO response to _query_all."""
        data = wire.QueryResponse.buffer(body)
        return posix.FilePosixInformation.unpack(data)[0] if self.posix else info.FileAllInformation.unpack(data)

    def _list_page(self, file_id, flags):
        return m.query_directory(file_id, posix.FILE_POSIX_INFORMATION if self.posix else info.FILE_ID_BOTH_DIRECTORY,
                                 flags, LIST_BUFFER)

    @staticmethod
    def _posix_stat(a: info.Attributes, ctime_ns, rdev):
        return Stat(ino=a.file_id, mode=a.mode, nlink=a.nlink, uid=a.uid, gid=a.gid, rdev=rdev, size=a.size,
                    blocks=(a.allocation + 511) // 512, blksize=1 << 20, atime_ns=a.atime_ns, mtime_ns=a.mtime_ns,
                    ctime_ns=ctime_ns)

    def _child(self, dir, name):
        """The share path of ``name`` in ``dir``; names SMB cannot hold are EINVAL, never another path."""
        try:
            text = name.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise OSError(errno.EINVAL, "SMB names are Unicode: not valid UTF-8") from None
        if self.posix and ("\\" in text or "\0" in text):
            raise OSError(errno.EINVAL, "SMB names here cannot hold \\ or NUL")
        if not self.posix and BAD_NAME.search(text):
            raise OSError(errno.EINVAL, 'SMB names cannot hold \\ : * ? " < > | or control characters')
        parent = _path(dir)
        path = f"{parent}\\{text}" if parent else text
        if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH:
            raise OSError(errno.ENAMETOOLONG, f"SMB paths here end at {MAX_PATH} bytes")
        return path

    async def _stat_path(self, path):
        _, body, _ = await self._call([self._create(path, m.READ_ATTRIBUTES), self._query_all(), m.close()], path)
        return self._attributes_in(body)

    async def _reparse_point(self, path):
        """The reparse point of ``path`` (a POSIX open never follows it)."""
        _, body, _ = await self._call([self._create(path, m.READ_ATTRIBUTES),
                                       m.ioctl(m.RELATED, posix.FSCTL_GET_REPARSE_POINT, b"", posix.MAX_REPARSE),
                                       m.close()], path)
        return wire.IoctlResponse.output(body)

    async def _read_devices(self, found):
        """Learn the device numbers of the device nodes among ``found``, [(path, Attributes)], not known
        yet: a round trip each.  Samba 4.22 reports such a node's type in the POSIX information, but it is
        a regular file on the server, and the numbers are only in its reparse point (as the Linux cifs
        client reads them).  Known by file id and creation time, as xfs gives a removed file's inode number
        to the next new file; a reparse point that holds none (another client's layout) reads as 0."""
        for path, a in found:
            key = (a.file_id, a.btime_ns)
            if a.mode is None or not (stat.S_ISCHR(a.mode) or stat.S_ISBLK(a.mode)) or key in self.devices:
                continue
            try:
                self.devices[key] = os.makedev(*posix.device_number(await self._reparse_point(path)))
            except wire.WireError as e:
                log.debug("%s: no device number: %s", path, e)
                self.devices[key] = 0
            except FileNotFoundError:
                pass  # removed since: its numbers are nobody's concern

    async def _size(self, file):
        body = await self._file_call(file, lambda fid: m.query_info(info.FILE_STANDARD, fid, 64))
        return info.FileStandardInformation.end_of_file(wire.QueryResponse.buffer(body))

    # -- nodes ----------------------------------------------------------------------

    async def root(self):
        self.client = Client.shared(self.target)
        path = self.target.path
        try:
            conn, _ = await self.client.tree_id(self.share)
            self.posix = conn.posix
            a = await self._stat_path(path)
            _, body, _ = await self._call([self._create(path, m.READ_ATTRIBUTES), m.query_fs_info(info.FS_ATTRIBUTE),
                                           m.close()], path)
        except OSError as e:
            await self.client.release()
            self.client = None
            raise SourceError(self._describe(e)) from None
        fs = info.FileFsAttributeInformation.unpack(wire.QueryResponse.buffer(body))
        self.can_clone = bool(fs.attributes & info.FS_SUPPORTS_BLOCK_REFCOUNTING)
        self.namelen = fs.max_name_length or 255
        self.name_max = min(self.namelen, self.name_max)  # counted in UTF-16 units: a name has as many bytes or more
        return self._node(path, a), self._stat(a)

    def _describe(self, e):
        """Why root() failed, as one line for the user."""
        t = self.target
        if status_of(e) == errors.BAD_NETWORK_NAME:
            return f"{t.unc}: no such share"
        if status_of(e) is not None and e.errno == errno.ENOENT:
            return f"{t.unc}\\{t.path}: no such directory"
        return e.strerror

    async def lookup(self, dir, name):
        path = self._child(dir, name)
        try:
            a = await self._attributes(path)
            await self._read_devices([(path, a)])
        except FileNotFoundError:
            self._removed(path)  # by another client: what it named goes on by its other names
            raise
        return self._node(path, a), self._stat(a)

    async def _by_name(self, node, act):
        """``act(path)`` by the name of ``node`` seen last; a name that another client removed is
        forgotten and the one seen before it tried (SMB opens by name, and the kernel may come by
        another link of the file than the one we saw last)."""
        while True:
            path = _path(node)
            try:
                return await act(path)
            except FileNotFoundError:
                self._removed(path)
                self._unname(node, path)  # also where the path was taken since by another node
                if node.path is None:
                    raise

    async def _attributes(self, path):
        return self._from_listing(path) or await self._stat_path(path)

    def _from_listing(self, path):
        """The attributes of ``path`` from a listing of the last second, used once, or None.

        After a listing the kernel asks for every entry in turn (READDIRPLUS
        looks each up, ``ls -l`` stats each); the listing already holds that,
        so 2000 files cost one listing, not 2000 round trips.  Listings carry
        no link count (see _nlink), and any change made through us drops
        them.  Not for a name the filesystem holds a node by: it answers
        those from its own listing, and asks only where that is in doubt (an
        open checks that each name still leads to its file), which a listing
        from before cannot settle.
        """
        a, expiry, uid = self._listed.pop(path, (None, 0, None))
        return a if trio.current_time() < expiry and path not in self.nodes and uid == self._uid() else None

    def identity(self, node, st):
        return node.ino, node.is_dir  # the server's file id, which a file of the other type may get next

    def forget(self, node):
        if node in self.deferred:
            trio.lowlevel.spawn_system_task(self._close_deferred, node)
        for p in node.paths:
            if self.nodes.get(p) is node:
                self._drop(p)
        if self.by_id.get(node.ino) is node:
            del self.by_id[node.ino]

    async def getattr(self, node, file=None):
        """Through a handle where the node has one: an open file keeps its attributes once unlinked."""
        if file is not None:
            return self._stat(await self._file_attributes(file))
        a = await self._borrowing(None, node, self._files_of_caller(node)[:1], self._file_attributes)
        if a is not None:
            return self._stat(a)
        a = await self._by_name(node, self._attributes)
        if not _same(node, a):
            raise OSError(errno.ESTALE, f"{node.path}: replaced by another file")
        return self._stat(a)

    async def _file_attributes(self, file):
        body = await self._file_call(file, self._query_all)
        return self._attributes_in(body)

    async def setattr(self, node, file=None, *, mode=None, uid=None, gid=None, size=None,
                      atime_ns=None, mtime_ns=None):
        """Through ``file``, else through every writable handle of the node, else a handle of its own.

        The kernel sends utimes without a handle (cp -p sets times before it
        closes the copy), and in Samba the close of a handle that wrote stamps
        the close time over any time not set through that very handle.  So,
        as the Linux cifs client does, changes go through the writable handles.
        """
        self._listed.clear()
        if self.posix and (mode, uid, gid) != (None, None, None):
            await self._set_owner_and_mode(_path(node), uid, gid, mode)
            node.changed()
            if (size, atime_ns, mtime_ns) == (None, None, None):
                return await self.getattr(node, file)
            mode = None
        files = [file] if file is not None else [f for f in self._files_of_caller(node) if f.access & m.WRITE_DATA]
        # uid/gid: SMB without unix extensions has no owners to change (mount.cifs ignores them too).
        changes = []
        if size is not None:
            changes.append((info.FILE_END_OF_FILE, info.FileEndOfFileInformation(size).pack()))
        attributes = 0
        if mode is not None:
            # As mount.cifs: no write permission is the read-only attribute.
            a = await self._borrowing(file, node, files[:1], self._file_attributes) if files else None
            a = a or await self._stat_path(_path(node))
            wanted = a.attributes & ~info.ATTR_READONLY | (0 if mode & 0o200 else info.ATTR_READONLY)
            if wanted != a.attributes:
                attributes = wanted or info.ATTR_NORMAL
        if attributes:
            node.changed()
        if atime_ns is not None or mtime_ns is not None or attributes:
            now = time.time_ns()  # SMB has no "the server's time": set our clock's
            basic = info.FileBasicInformation(now if atime_ns == NOW else atime_ns,
                                              now if mtime_ns == NOW else mtime_ns, attributes).pack()
            changes.append((info.FILE_BASIC, basic))
        async def apply(f):
            for change in changes:
                await self._file_call(f, lambda fid: m.set_info(*change, fid))
            return True

        if await self._borrowing(file, node, files, apply):
            return await self.getattr(node, file)
        path = _path(node)
        await self._close_deferred_below(path)
        access = m.READ_ATTRIBUTES | m.WRITE_ATTRIBUTES | (m.WRITE_DATA if size is not None else 0)
        bodies = await self._call([self._create(path, access), *(m.set_info(*c) for c in changes), self._query_all(),
                                   m.close()], path)
        return self._stat(self._attributes_in(bodies[-2]))

    async def _set_owner_and_mode(self, path, uid, gid, mode):
        """chown and chmod with POSIX extensions: a security descriptor as Samba takes it (posix.py); the
        attributes after."""
        if mode is not None and stat.S_IMODE(mode) & ~posix.SETTABLE_MODE:
            raise OSError(errno.EPERM, "Samba sets no setuid, setgid or sticky bit from an SMB client")
        sd, parts = posix.security_descriptor(uid, gid, mode)
        access = (m.WRITE_DAC if parts & posix.DACL else 0) | (m.WRITE_OWNER if parts & ~posix.DACL else 0)
        await self._close_deferred_below(path)
        _, _, body, _ = await self._call([
            self._create(path, m.READ_ATTRIBUTES | access),
            m.set_info(0, sd, info_type=InfoType.SMB2_0_INFO_SECURITY, additional=parts), self._query_all(),
            m.close()], path)
        return self._attributes_in(body)

    async def _give_to_caller(self, path, dir, a):
        """The attributes of ``path``, which we just created as ``a``, made the caller's: new entries belong
        to the user who made them, as on a local filesystem, where the server made them as the share's
        user (root where the share forces it); with multiuser the server made them as the user already.
        Their group is the caller's, or the directory's where it is setgid.  Only for callers other than
        root (allow_other mounts): two round trips more, one to see whether the directory is setgid, one
        to set the owner."""
        caller = CALLER.get()
        if not self.posix or caller.uid == 0 or self.target.multiuser or (a.uid, a.gid) == (caller.uid, caller.gid):
            return a
        gid = caller.gid
        if dir.path is not None and (await self._stat_path(dir.path)).mode & stat.S_ISGID:
            gid = None
        return await self._set_owner_and_mode(path, caller.uid, gid, None)

    def _files_of_caller(self, node):
        """The handles of ``node`` that the caller may borrow: those opened in their session."""
        uid = self._uid()
        return [f for f in node.files if f.uid == uid]

    @staticmethod
    async def _borrowing(file, node, files, use):
        """``use`` each of ``files``; the last result, or None if none took it.  Handles borrowed
        from the node (no ``file`` given) may be released while we use them (the kernel does not
        wait for a release), or be lost in a reconnect: one closed meanwhile or lost is passed
        over, and the caller goes another way (a stat of the name, say, is not the lost handle's
        to fail)."""
        result = None
        for f in files:
            try:
                result = await use(f)
            except OSError as e:
                if file is not None or f.lost is None and (e.errno != errno.EBADF or f in node.files):
                    raise
        return result

    async def readlink(self, node):
        if not self.posix:
            raise OSError(errno.EINVAL, "SMB without unix extensions has no symlinks")
        path = _path(node)
        data = await self._reparse_point(path)
        try:
            return posix.symlink_target(data).encode("utf-8", "surrogateescape")
        except wire.WireError as e:
            raise OSError(errno.EINVAL, f"{path}: {e}") from None

    async def symlink(self, dir, name, target):
        if not self.posix:
            raise OSError(errno.EOPNOTSUPP, "SMB without unix extensions has no symlinks")
        try:
            text = target.decode("utf-8")
        except UnicodeDecodeError:
            raise OSError(errno.EINVAL, "SMB names are Unicode: not valid UTF-8") from None
        return await self._make(dir, name, m.NON_DIRECTORY_FILE, 0o777, posix.symlink_reparse(text))

    async def mknod(self, dir, name, mode, rdev):
        if stat.S_ISREG(mode):
            return await self._make(dir, name, m.NON_DIRECTORY_FILE, mode)
        if not self.posix:
            raise OSError(errno.EOPNOTSUPP, "SMB without unix extensions has only files and directories")
        if stat.S_IFMT(mode) not in posix.NFS_TYPES:
            raise OSError(errno.EINVAL, f"no such file type: 0o{stat.S_IFMT(mode):o}")
        reparse = posix.special_reparse(mode, os.major(rdev), os.minor(rdev))
        return await self._make(dir, name, m.NON_DIRECTORY_FILE, mode, reparse, rdev)

    async def mkdir(self, dir, name, mode):
        return await self._make(dir, name, m.DIRECTORY_FILE, mode)

    async def _make(self, dir, name, options, mode, reparse=None, rdev=0):
        """Create a file or directory; with ``reparse``, a symlink or special file (see posix.py), device
        ``rdev`` if it is a device node."""
        self._listed.clear()
        path = self._child(dir, name)
        if reparse is None:
            _, body, _ = await self._call([self._create(path, m.READ_ATTRIBUTES, m.CREATE, options, mode,
                                                        **self._ours(path)),
                                           self._query_all(), m.close()], path)
        else:
            body = await self._make_reparse_point(path, options, mode, reparse)
        a = await self._give_to_caller(path, dir, self._attributes_in(body))
        if rdev:
            self.devices[a.file_id, a.btime_ns] = rdev
        return self._node(path, a), self._stat(a)

    async def _make_reparse_point(self, path, options, mode, reparse):
        """A new file with reparse point ``reparse``, in one round trip; the reply to its query."""
        (status, body), (set_status, set_body), (_, query), _ = await self._send([
            self._create(path, m.READ_ATTRIBUTES | m.WRITE_ATTRIBUTES | m.WRITE_DATA, m.CREATE, options,
                         mode),
            m.ioctl(m.RELATED, posix.FSCTL_SET_REPARSE_POINT, reparse), self._query_all(), m.close()])
        if status != errors.SUCCESS:
            raise status_error(status, body, path)
        if set_status != errors.SUCCESS:
            await self._delete(path, options)  # not left behind as an empty file
            raise status_error(set_status, set_body, path)
        return query

    async def link(self, node, dir, name):
        self._listed.clear()
        path = self._child(dir, name)
        link = info.FileRenameInformation(False, self._wire_path(path)).pack()
        _, _, body, _ = await self._call([self._create(_path(node), m.READ_ATTRIBUTES | m.WRITE_ATTRIBUTES,
                                                       **self._ours(path)),
                                          m.set_info(info.FILE_LINK, link), self._query_all(), m.close()], path)
        a = self._attributes_in(body)
        node.changed()
        return self._node(path, a), self._stat(a)

    async def unlink(self, dir, name):
        await self._delete(self._child(dir, name), m.NON_DIRECTORY_FILE)

    async def rmdir(self, dir, name):
        await self._delete(self._child(dir, name), m.DIRECTORY_FILE)

    async def _delete(self, path, options):
        """Delete on close; open handles (ours share delete access) keep working until closed."""
        self._listed.clear()
        await self._close_deferred_below(path)
        dispose = m.set_info(info.FILE_DISPOSITION, info.FileDispositionInformation().pack())
        try:
            await self._call([self._create(path, m.DELETE | m.READ_ATTRIBUTES, m.OPEN, options, **self._ours(path)),
                              dispose, m.close()], path)
        except OSError as e:
            if status_of(e) != errors.CANNOT_DELETE:
                raise
            # Read-only: POSIX unlinks it anyway (the directory decides), so clear the attribute first.
            a = await self._stat_path(path)
            plain = info.FileBasicInformation(attributes=(a.attributes & ~info.ATTR_READONLY) or info.ATTR_NORMAL)
            await self._call([self._create(path, m.DELETE | m.READ_ATTRIBUTES | m.WRITE_ATTRIBUTES, m.OPEN, options,
                                           **self._ours(path)),
                              m.set_info(info.FILE_BASIC, plain.pack()), dispose, m.close()], path)
        _unlinked(self.nodes.get(path))
        self._removed(path)

    async def rename(self, dir, name, newdir, newname, flags):
        self._listed.clear()
        if flags & ~RENAME_NOREPLACE:
            raise OSError(errno.EINVAL, "SMB renames cannot exchange or leave whiteouts")
        old, new = self._child(dir, name), self._child(newdir, newname)
        if old == new:
            return
        replace = not flags & RENAME_NOREPLACE
        held = self.nodes.get(old) if self.nodes.get(old) in self.dir_leases else None
        await self._close_deferred_below(old, new, keep=held)
        try:
            await self._rename_on_server(old, new, replace, held)
        except OSError as e:
            if not replace or status_of(e) not in (errors.OBJECT_NAME_COLLISION, errors.ACCESS_DENIED):
                raise
            # Samba refuses where POSIX has a more precise answer, or none at all.
            try:
                src, dst = await self._stat_path(old), await self._stat_path(new)
            except OSError:
                raise e from None
            if src.file_id == dst.file_id:
                return  # two links to one file: rename does nothing
            if src.is_dir != dst.is_dir:
                raise OSError(errno.EISDIR if dst.is_dir else errno.ENOTDIR, f"{old} -> {new}") from None
            node = self.nodes.get(new)
            if not (self.posix and status_of(e) == errors.ACCESS_DENIED and node is not None and node.files):
                raise
            await self._replace_open_file(old, new)
        _changed(self.nodes.get(old))
        _unlinked(self.nodes.get(new))  # replaced
        self._moved(old, new)

    async def _rename_on_server(self, old, new, replace, held=None):
        """``held``: the directory at ``old``, whose listing's handle we keep open under its lease."""
        move = info.FileRenameInformation(replace, self._wire_path(new)).pack()
        await self._call([self._create(old, m.DELETE | m.READ_ATTRIBUTES, **self._ours(old, held)),
                          m.set_info(info.FILE_RENAME, move), m.close()], old)

    async def _replace_open_file(self, old, new):
        """Rename ``old`` over ``new``, which we hold open: smbd refuses a rename over a file its own
        process has open, even with POSIX semantics (rename_internals_fsp: "Target file open"), and the
        one process of our connection holds them all.  So ``new`` moves aside, ``old`` takes its name,
        and the file aside is unlinked: its handles go on, as POSIX wants.  Not atomic: for a moment
        the name is missing, where POSIX has it always name one file or the other."""
        parent = new.rpartition("\\")[0]
        aside = (f"{parent}\\" if parent else "") + f".offloadfs-replaced-{uuid.uuid4().hex}"
        await self._rename_on_server(new, aside, False)
        try:
            await self._rename_on_server(old, new, False)
        except OSError:
            await self._rename_on_server(aside, new, False)
            raise
        dispose = m.set_info(info.FILE_DISPOSITION, info.FileDispositionInformation().pack())
        await self._call([self._create(aside, m.DELETE | m.READ_ATTRIBUTES, m.OPEN, m.NON_DIRECTORY_FILE,
                                       **self._ours(aside)), dispose, m.close()], aside)

    # -- files ----------------------------------------------------------------------

    async def open(self, node, flags):
        truncate = flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY
        if truncate:
            self._listed.clear()  # a listing's size of the file is wrong from now on
        elif _access(flags) == m.READ and not node.is_dir:  # a directory's is a listing's (_hold_listing)
            file = await self._take_back(node)
            if file is not None:
                return file
        file, a = await self._by_name(node, lambda path: self._open(
            node, path, _access(flags), m.OVERWRITE if truncate else m.OPEN, 0 if node.is_dir else m.NON_DIRECTORY_FILE))
        if not _same(node, a):
            await self.release(file)
            raise OSError(errno.ESTALE, f"{node.path}: replaced by another file")
        node.files.append(file)
        file.attributes = a
        return file

    def open_checks(self, dir, name, node):
        """SMB opens by name and compares the file id: a node known by this name alone (no other
        to fall back to) fails where it leads elsewhere."""
        try:
            return list(node.paths) == [self._child(dir, name)]
        except OSError:
            return False

    def opened(self, file):
        """The QUERY_INFO in the open's own compound, taken once: close-to-open needs no second one."""
        a, file.attributes = file.attributes, None
        return self._stat(a) if a is not None else None

    async def create(self, dir, name, flags, mode):
        self._listed.clear()
        path = self._child(dir, name)
        if flags & os.O_EXCL:
            disposition = m.CREATE
        elif flags & os.O_TRUNC:
            disposition = m.OVERWRITE_IF
        else:
            disposition = m.OPEN_IF
        known = self.nodes.get(path)
        file, a = await self._open(None, path, _access(flags), disposition, m.NON_DIRECTORY_FILE, mode=mode,
                                   lease=self._lease_of(known) if known is not None and not known.is_dir else None)
        if file.created:
            a = await self._give_to_caller(path, dir, a)
        file.node = self._node(path, a)
        file.node.files.append(file)
        if file.node.lease is None:
            file.node.lease = file.lease
        if file.lease.node is None:
            file.lease.node = file.node
        return file.node, self._stat(a), file

    async def _open(self, node, path, access, disposition, options, reconnect=None, lease=None, retried=False,
                    mode=0):
        """A File and the attributes of what it opened, in one round trip (with its resume key, if readable).

        Files (not directories) are opened under a lease (see leases.py): the
        node's, ``lease`` where there is no node yet (create), a fresh one where
        the server refuses the node's (its key is the open handle of a file that
        no longer has this name).  They are asked to be durable, which the
        lease's handle caching lets Samba grant; ``reconnect``: the File of a
        lost connection whose durable handle to reconnect instead (with its
        lease, as MS-SMB2 3.2.4.3.5 asks).  Not interrupted (the request's
        deadline still applies): a handle the server opened after we stopped
        listening would stay open until we disconnect, holding off deletes and
        share modes.
        """
        if options & m.NON_DIRECTORY_FILE:
            lease = reconnect.lease if reconnect is not None else lease or self._lease_of(node)
        guid, contexts = None, []
        if reconnect is not None:
            guid = reconnect.create_guid
            contexts = [m.durable_reconnect(reconnect.file_id, guid)]
        elif options & m.NON_DIRECTORY_FILE:
            guid = uuid.uuid4()
            contexts = [m.durable(guid)]
        uid = reconnect.uid if reconnect is not None else self._uid()  # a durable handle's own user reconnects it
        conn, _ = await self.client.tree_id(self.share, uid)  # the connection whose listener hears the lease's breaks
        generation, listener = self.client.generation, self.client.leases
        if lease is not None:
            contexts.append(lease.context(conn.dialect >= Dialects.SMB_3_0_0, self._parent_key(path)))
            seen = listener.opening(lease)
        msgs = [self._create(path, access, disposition, options, mode, oplock=m.LEASE if lease else m.NO_OPLOCK,
                             contexts=contexts), self._query_all()]
        if access & m.READ_DATA and options & m.NON_DIRECTORY_FILE:
            msgs.append(m.resume_key())  # any file we may read may be the source of a server-side copy
        with trio.CancelScope(shield=True):
            try:
                (status, body), (q_status, query), *key = await self._send(msgs, generation, uid)
                created = wire.CreateResponse.unpack(body) if status == errors.SUCCESS else None
            except BaseException:
                if lease is not None:
                    listener.failed(lease)
                raise
            if lease is not None:
                if created is None:
                    listener.failed(lease)
                else:
                    listener.opened(lease, created.lease, seen)
            if status == errors.INVALID_PARAMETER and lease is not None and reconnect is None and not retried:
                return await self._open(node, path, access, disposition, options, lease=leases.Lease(self, node),
                                        retried=True, mode=mode)
            if status != errors.SUCCESS:
                raise status_error(status, body, path)
            file = File(self, node, access, created.file_id, generation, uid)
            file.created = created.create_action == m.FILE_CREATED
            file.lease = lease
            if reconnect is not None or m.DURABLE_V2 in created.contexts:
                file.create_guid = guid  # a reconnect names no context in its reply
            if key and key[0][0] == errors.SUCCESS:
                resume = wire.ResumeKey.unpack(wire.IoctlResponse.output(key[0][1]))
                if not resume.echoed:  # else _resume_key asks by the file id itself (ksmbd)
                    file.resume_key = resume.key
                    file.key_generation = file.generation
            try:
                if q_status != errors.SUCCESS:
                    raise status_error(q_status, query, path)
                a = self._attributes_in(query)
            except (OSError, wire.WireError):
                await self.release(file)
                raise
        return file, a

    async def read(self, file, offset, size):
        """The data as a memoryview into the response (no copy), short only at end of file."""
        step = min(self.client.io_size, PIECE)
        if size <= step:
            return await self._read(file, offset, size)
        pieces = await together([functools.partial(self._read, file, offset + start, min(step, size - start))
                                 for start in range(0, size, step)])
        data = []
        for p in pieces:
            data.append(p)
            if len(p) < step:
                break
        return b"".join(data)

    async def _read(self, file, offset, size):
        fid = await self._handle(file)
        [(status, body)] = await self._send([m.read(fid, offset, size)], file.generation, file.uid)
        if status == errors.END_OF_FILE:
            return b""
        if status != errors.SUCCESS:
            raise status_error(status, body, file.node.path or "")
        return wire.ReadResponse.data(body)

    async def write(self, file, offset, data):
        """All of ``data``, in pieces of the negotiated size written side by side.

        A server may write less than it was sent (smbprotocol's own loops miss
        that); each piece goes on from where the server stopped.
        """
        self._listed.clear()
        view = memoryview(data)
        step = min(self.client.io_size, PIECE)

        async def piece(start, end):
            while start < end:
                chunk = view[start:end]  # what callers write is not changed after (bytes, fresh buffers)
                body = await self._file_call(file, lambda fid: m.write(fid, offset + start, chunk))
                n = wire.WriteResponse.count(body)
                if not 0 < n <= end - start:
                    raise OSError(errno.EIO, f"server wrote {n} of {end - start} bytes")
                start += n

        await together([functools.partial(piece, start, min(start + step, len(view)))
                        for start in range(0, len(view), step)])
        return len(view)

    async def flush(self, file):
        """close(2) of a handle open for writing fails with EIO once the handle is lost in a reconnect,
        as its writes and fsync do: what it wrote before may be gone.  After a reconnect not yet seen
        by this handle, its durable handle is reconnected first; otherwise nothing is sent."""
        if file.access & m.WRITE_DATA and (file.lost or file.generation != self.client.generation):
            await self._handle(file)

    async def fsync(self, file, datasync):
        """A FLUSH needs a handle open for writing (else ACCESS_DENIED), and `sync FILE` fsyncs a
        read-only one: as the Linux cifs client does, flush through a handle of the file open for
        writing, and where none is open, leave the FLUSH out (the data written through handles
        since closed was in the server's hands at their close)."""
        if not file.access & m.WRITE_DATA:
            writable = (f for f in file.node.files if f.access & m.WRITE_DATA and f.lost is None and f.uid == file.uid)
            file = next(writable, None)
            if file is None:
                return
        await self._file_call(file, m.flush)

    async def release(self, file):
        """Closes the handle, or with closetimeo=N (as mount.cifs's option) keeps it open N seconds:
        the last read-only handle of a file whose lease holds read and handle caching.  An open of
        the file for reading meanwhile takes it back (_take_back), and since the lease was never
        given up, the kernel keeps the file's pages.  It is closed at the timeout, at a break of its
        lease, before our own unlink, rename or setattr by name (Samba leaves a file deleted under
        an open handle in place, delete-pending), when the filesystem forgets the node, and at
        unmount.  Handles open for writing close at once: their close is where a write error is
        last reported, and a durable handle's reconnect must stay exact.

        Off by default: for those N seconds the file counts as held open.  A program on the server
        rewrites it unseen (it breaks no lease: close-to-open holds only against SMB clients), and
        another client's delete leaves its name delete-pending (Samba breaks no lease for it: our
        handles share delete access) until the handle is closed."""
        node = file.node
        if node is not None and file in node.files:  # None: create() failed to open it
            node.files.remove(file)
            if (not node.files and node not in self.deferred and self._may_keep(file) and node.path is not None
                    and self.target.close_after):
                scope = trio.CancelScope()
                self.deferred[node] = file, scope
                trio.lowlevel.spawn_system_task(self._close_later, node, scope, self.target.close_after)
                return
        await self._close(file)

    def _may_keep(self, file):
        """True if ``file`` may stay open past its release, or be taken back: read-only, on the current
        connection, under a lease that holds read and handle caching there."""
        lease = file.lease
        return (file.access == m.READ and file.lost is None and lease is not None
                and file.generation == self.client.generation == lease.generation
                and lease.state & leases.ASKED == leases.ASKED)

    async def _take_back(self, node):
        """The handle kept open for ``node``, where it may be used again, with the attributes its name
        has now; else None (it is closed).  The name is asked, as an open would: Samba does not
        always break the lease's handle caching before another client renames the file (on a share
        without durable handles it does not), and the name may lead to another file now."""
        kept, _ = self.deferred.get(node, (None, None))
        if kept is None or kept.uid != self._uid():  # another user's stays kept for them
            return None
        file = self._undefer(node)
        try:
            a = await self._by_name(node, self._stat_path) if self._may_keep(file) else None
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._close(file)
            raise
        if a is None or not _same(node, a) or not self._may_keep(file):  # a break may come meanwhile
            await self._close(file)
            return None
        node.files.append(file)
        file.attributes = a
        return file

    def _undefer(self, node):
        """The handle kept open for ``node`` (its timer stopped), or None."""
        file, scope = self.deferred.pop(node, (None, None))
        self.dir_leases.pop(node, None)
        if scope is not None:
            scope.cancel()
        return file

    async def _close_later(self, node, scope, seconds):
        with scope:
            await trio.sleep(seconds)
        if not scope.cancelled_caught:
            await self._close_deferred(node)

    async def _close_deferred(self, node):
        """Close the handle kept open for ``node``, if any.  Also run as a system task: nothing may escape
        (a connection lost meanwhile, or the mount ended, took the handle with it)."""
        file = self._undefer(node)
        if file is not None:
            try:
                await self._close(file)
            except Exception as e:
                log.debug("closing a handle kept open: %s", e)

    def _deferred_broken(self, node):
        """A break of ``node``'s lease (see leases.Lease.broken): a handle kept open closes now."""
        if node in self.deferred:
            trio.lowlevel.spawn_system_task(self._close_deferred, node)

    async def _close_deferred_below(self, *paths, keep=None):
        """Close the handles kept open for ``paths`` and what is below them, but ``keep``'s, before our own
        change by name (smbd refuses to rename a directory above a handle its process holds open)."""
        if self.deferred:
            for node in [self.nodes[p] for path in paths for p in self._known(path)]:
                if node is not keep:
                    await self._close_deferred(node)

    async def _close(self, file):
        if file.lease is not None:
            self.client.leases.closed(file.lease, file.generation)
        if file.generation != self.client.generation:
            return  # its connection is gone, and the handle with it
        try:
            await self._send([m.close(file.file_id)], file.generation, file.uid)
        except ConnectionLost:
            pass

    async def listdir(self, node):
        """The open, the directory's attributes and the first two pages in one compound: a
        directory of one page (up to some 500 entries) is listed in one round trip, its second page
        the STATUS_NO_MORE_FILES that ends it.  Its handle is closed after the listing is answered,
        unless it holds a directory lease (see _hold_listing).  One that asks for a lease takes two:
        the open, then the pages, asked after the watch that comes with the lease (_watch)."""
        path, uid = _path(node), self._uid()
        conn, _ = await self.client.tree_id(self.share, uid)
        generation, listener = self.client.generation, self.client.leases
        lease = (self._lease_of(node) if conn.supports_directory_leasing and self.target.dir_cache
                 and not self.target.multiuser else None)
        seen = listener.opening(lease) if lease is not None else None
        # Naming the parent's lease: Samba keeps the parent key of the open that made a lease for every
        # open under it, and our rename of this directory goes under its lease (see _ours).
        leasing = {"oplock": m.LEASE, "contexts": [lease.context(True, self._parent_key(path))]} if lease else {}
        first_pages = [] if lease else [self._list_page(m.RELATED, m.RESTART_SCAN), self._list_page(m.RELATED, 0)]
        try:
            create, queried, *pages = await self._send([
                self._create(path, m.READ_DATA | m.READ_ATTRIBUTES | m.SYNCHRONIZE, m.OPEN, m.DIRECTORY_FILE,
                             **leasing),
                self._query_all(), *first_pages], generation, uid)
        except BaseException:
            if lease is not None:
                listener.failed(lease)
            raise
        expiry = trio.current_time() + LISTED_FOR
        created = wire.CreateResponse.unpack(create[1]) if create[0] == errors.SUCCESS else None
        if lease is not None:
            if created is None:
                listener.failed(lease)
            else:
                listener.opened(lease, created.lease, seen)
                if lease.changes != seen:  # a break came around the reply, for a change the listing may predate
                    self._lease_broken(node)
        if created is None:
            raise status_error(create[0], what=path)
        fid = created.file_id
        held = File(self, node, m.READ_DATA, fid, generation, uid)
        held.lease = lease
        found = []  # (name, path, Attributes) of each entry
        seen = _Pages(f"{self.client.where}: listing of {path or 'the share'}",
                      posix.FilePosixDirectoryInformation if self.posix else info.FileIdBothDirectoryInformation)
        try:
            if queried[0] != errors.SUCCESS:
                raise status_error(queried[0], what=path)
            a = self._attributes_in(queried[1])
            if not _same(node, a):
                raise OSError(errno.ESTALE, f"{path}: replaced by another directory")
            before = self._stat(a)
            if lease is not None:  # its pages after the watch, which then covers every file they list
                if lease.state & m.LEASE_READ:
                    await self._watch(held)
                pages = await self._send([self._list_page(fid, m.RESTART_SCAN), self._list_page(m.RELATED, 0)],
                                         generation, uid)
            while True:
                status, body = pages.pop(0)
                if status == errors.NO_MORE_FILES:
                    break
                if status != errors.SUCCESS:
                    raise status_error(status, what=path)
                for name, a in seen.entries(wire.QueryResponse.buffer(body)):
                    if name not in (".", ".."):
                        found.append((name, f"{path}\\{name}" if path else name, a))
                        self._listed[found[-1][1]] = (a, expiry, uid)
                if not pages:
                    pages = await self._send([self._list_page(fid, 0)], generation, uid)
            await self._read_devices([(p, a) for _, p, a in found])
        except BaseException:
            trio.lowlevel.spawn_system_task(self._close_listing, held)
            raise
        if not self._hold_listing(held):
            trio.lowlevel.spawn_system_task(self._close_listing, held)
        items = []
        for name, _, a in found:
            st = self._stat(a)
            items.append(DirItem(name.encode("utf-8", "surrogatepass"), a.file_id, st.mode >> 12, st))
        return before, items

    async def _close_listing(self, file):
        """Close a listing's handle.  Nothing waits for it, so nothing may escape: a connection lost
        meanwhile (or the mount ended) took the handle with it."""
        try:
            await self._close(file)
        except Exception as e:
            log.debug("closing a listing's handle: %s", e)

    def _hold_listing(self, file):
        """Keep the handle ``file`` of a listing open while its directory lease holds read caching
        (SMB3 directory leases: Samba 4.22 breaks it before another SMB client adds, removes or
        renames a name in the directory, or changes a file's size, times or attributes in it; not
        for a program on the server itself), so that the listing answers without asking again (see
        Capabilities.caching).  Held among the handles kept open (``deferred``): closed on a break
        of the lease, before our own unlink, rename or setattr by name (Samba refuses another
        client's rename of a directory above an open handle, ACCESS_DENIED, breaking only the
        handle caching of the lease), when the filesystem forgets the node, and at unmount; also
        dir_cache_timeout= seconds after the listing (a program on the server breaks no lease: its changes show
        once the lease is given back), and the oldest past DIR_LEASES_MAX directories.
        False if not held (the caller closes it)."""
        node, lease = file.node, file.lease
        if lease is None or not lease.state & m.LEASE_READ or node.path is None or file.generation != lease.generation:
            return False
        old = self._undefer(node)
        if old is not None:  # the same lease: its breaks are still heard while the new handle takes over
            trio.lowlevel.spawn_system_task(self._close_listing, old)
        scope = trio.CancelScope()
        self.deferred[node] = file, scope
        self.dir_leases[node] = None
        trio.lowlevel.spawn_system_task(self._close_later, node, scope, self.target.dir_cache)
        while len(self.dir_leases) > DIR_LEASES_MAX:
            oldest = next(iter(self.dir_leases))
            del self.dir_leases[oldest]
            trio.lowlevel.spawn_system_task(self._close_deferred, oldest)
        return True

    def _parent_key(self, path):
        """The key of the directory lease we hold on ``path``'s directory, or None.  An open of ours there
        names it as its lease's parent (MS-SMB2 2.2.13.2.10), and Samba 4.22 then breaks it for none of
        our creates, removals or renames in the directory (the listing follows those itself)."""
        parent = self.nodes.get(path.rpartition("\\")[0])
        return parent.lease.key if parent is not None and parent in self.dir_leases else None

    def _ours(self, path, held=None):
        """create() arguments for an open that only changes a name in ``path``'s directory: a lease of
        nothing (state 0) that names the directory's lease as its parent, where we hold one.  ``held``:
        the directory at ``path``, whose own lease we hold: the open goes under that lease, which Samba
        then does not break for the rename (it skips the opens of the renaming open's own lease)."""
        parent = self._parent_key(path)
        if held is not None:
            lease = m.lease(held.lease.key, held.lease.state, True, parent)
        elif parent is not None:
            lease = m.lease(uuid.uuid4().bytes, 0, True, parent)
        else:
            return {}
        return {"oplock": m.LEASE, "contexts": [lease]}

    async def statfs(self, node):
        path = _path(node)
        _, body, _ = await self._call([self._create(path, m.READ_ATTRIBUTES), m.query_fs_info(info.FS_FULL_SIZE),
                                       m.close()], path)
        s = info.FileFsFullSizeInformation.unpack(wire.QueryResponse.buffer(body))
        unit = s.sectors_per_unit * s.bytes_per_sector or 4096
        return FsStat(blocks=s.total_units, bfree=s.actual_available_units, bavail=s.caller_available_units,
                      bsize=unit, frsize=unit, namelen=self.namelen)

    # -- xattrs: user.* as SMB extended attributes ------------------------------------

    async def _eas(self, node, name=None):
        """{name: value} of the node's EAs (or just ``name``'s); an EA with no value does not exist."""
        path = _path(node)
        query = m.query_info(info.FILE_FULL_EA, output_length=65536, input=info.GetEa(name).pack() if name else b"",
                             flags=0 if name else m.RESTART_SCAN)
        create, result, _ = await self._send([self._create(path, m.READ_EA | m.READ_ATTRIBUTES), query, m.close()])
        for status, body in (create, result):
            if status == errors.NO_EAS_ON_FILE:
                return {}
            if status != errors.SUCCESS:
                raise status_error(status, body, path)
        eas = info.FullEa.unpack_list(wire.QueryResponse.buffer(result[1]))
        return {ea.name: ea.value for ea in eas if ea.value}

    async def _set_ea(self, node, name, value):
        path = _path(node)
        ea = info.FullEa.pack_list([info.FullEa(name, value)])
        await self._call([self._create(path, m.WRITE_EA | m.READ_ATTRIBUTES), m.set_info(info.FILE_FULL_EA, ea),
                          m.close()], path)

    def holds_xattr(self, name):
        return user_xattr(name)

    async def getxattr(self, node, name):
        ea = _ea_name(name)
        value = (await self._eas(node, ea)).get(ea)
        if value is None:
            raise OSError(errno.ENODATA, "no such attribute")
        return value

    async def setxattr(self, node, name, value, flags):
        ea = _ea_name(name)
        if not value:
            # EOPNOTSUPP, not EINVAL: copying tools then skip the attribute instead of failing.
            raise OSError(errno.EOPNOTSUPP, "SMB cannot store an empty attribute (an empty value deletes it)")
        if flags & (os.XATTR_CREATE | os.XATTR_REPLACE):
            exists = ea in await self._eas(node, ea)
            if flags & os.XATTR_CREATE and exists:
                raise OSError(errno.EEXIST, "attribute exists")
            if flags & os.XATTR_REPLACE and not exists:
                raise OSError(errno.ENODATA, "no such attribute")
        await self._set_ea(node, ea, bytes(value))

    async def listxattr(self, node):
        return [b"user." + name for name in await self._eas(node)]

    async def removexattr(self, node, name):
        ea = _ea_name(name)
        if ea not in await self._eas(node, ea):
            raise OSError(errno.ENODATA, "no such attribute")
        await self._set_ea(node, ea, b"")

    async def close(self):
        self._on_break = None  # unmounting: the kernel has no names left to drop
        for node in list(self.deferred):
            await self._close_deferred(node)
        if self.client is not None:
            await self.client.release()
            self.client = None

    def _same_connection(self, src_file, dst_file):
        """Whether the server finds ``src_file`` from a request on ``dst_file``: same connection and session."""
        return isinstance(src_file, File) and src_file.backend.client is self.client and src_file.uid == dst_file.uid

    async def _set_size(self, file, size):
        eof = info.FileEndOfFileInformation(size).pack()
        await self._file_call(file, lambda fid: m.set_info(info.FILE_END_OF_FILE, eof, fid))

    async def _file_request(self, file, msg, generation=None):
        """(status, body) of one request on ``file``'s handle; ``generation``: also that of a second file."""
        fid = await self._handle(file)
        if generation is not None and generation != file.generation:
            raise ConnectionLost("the two files are on different connections after a reconnect")
        [(status, body)] = await self._send([msg(fid)], file.generation, file.uid)
        return status, body


class _Pages:
    """Ends a listing whose server sends one page again or more than any directory holds.

    A server that answers every QUERY_DIRECTORY with the same page (and never
    STATUS_NO_MORE_FILES) kept ls running while the daemon grew without end.
    No directory lists the same entries twice, so a page seen before (by
    digest) ends the listing, as does going past LIST_MAX_BYTES of replies or
    LIST_MAX_ENTRIES entries.
    """

    def __init__(self, what, layout):
        self.what = what
        self.layout = layout  # the information class of its entries
        self.seen = set()
        self.size = 0
        self.count = 0

    def entries(self, page):
        """[(name, Attributes)] of the listing's next ``page``; OSError(EIO) if it cannot be one."""
        digest = hashlib.blake2b(page, digest_size=16).digest()
        if digest in self.seen:
            raise self._refuse("the server sent the same page twice")
        self.seen.add(digest)
        entries = self.layout.unpack_list(page)
        self.size += len(page)
        self.count += len(entries)
        if self.size > LIST_MAX_BYTES or self.count > LIST_MAX_ENTRIES:
            raise self._refuse(f"more than {LIST_MAX_ENTRIES} entries or {LIST_MAX_BYTES} bytes")
        return entries

    def _refuse(self, why):
        log.warning("%s: %s; giving up", self.what, why)
        return OSError(errno.EIO, f"{self.what}: {why}")


def _same(node, a: info.Attributes):
    """``a`` is of ``node``'s file, as far as SMB tells: the same file id and type."""
    return (a.file_id, a.is_dir) == (node.ino, node.is_dir)


def _path(node):
    if node.path is None:
        raise OSError(errno.ENOENT, "removed")
    return node.path


def _access(flags):
    mode = flags & os.O_ACCMODE
    if mode == os.O_RDONLY:
        return m.READ
    if mode == os.O_WRONLY:
        return m.WRITE | m.READ_ATTRIBUTES
    return m.READ | m.WRITE


def _changed(node):
    if node is not None:
        node.changed()


def _unlinked(node):
    """A name of ``node`` went, through us: its other links, if any, see the link count drop."""
    if node is not None:
        node.changed()
        if node.nlink:
            node.nlink -= 1


def _nlink(node, a):
    """The link count of the file ``a`` (of ``node``, if known).  A directory listing carries none: the
    count the node last had answers, else 1, as the Linux cifs client makes up for a file it did
    not know (and keeps what it knew), so that `ls -l` does not undo what a stat found."""
    if a.nlink is None:
        return node.nlink if node is not None and node.nlink is not None and node.is_dir == a.is_dir else 1
    if node is not None and node.is_dir == a.is_dir:
        node.nlink = a.nlink
    return a.nlink


def _query_all(file_id=m.RELATED):
    # 64 KiB (one credit): the reply ends with the file's path, which may be long.
    return m.query_info(info.FILE_ALL, file_id, 65536)


def _ea_name(name):
    """The SMB EA name of a user.* xattr name; EOPNOTSUPP for any other, which SMB cannot hold."""
    if not user_xattr(name):
        raise OSError(errno.EOPNOTSUPP, "SMB stores only user.* attributes")
    return name[5:]
