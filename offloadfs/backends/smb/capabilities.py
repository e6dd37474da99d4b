"""The optional capabilities of the SMB backend: clone, server-side copy, sparse files, leases.

Copy offload is where SMB servers differ most, so each refusal is read as
"not this way" (NotSupported: the planner moves on) unless the connection
itself broke; the server's copychunk limits are learned from its refusal.
"""
import errno
import logging

import trio

from ..base import NotSupported
from ..parallel import copy_spans
from . import errors, info, leases, messages as m, wire
from .errors import status_error

log = logging.getLogger(__name__)

SEEK_DATA, SEEK_HOLE = 3, 4
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
COPY_PER_CALL = 256 << 20  # one server_copy call; the planner loops, so progress and interrupts land between
COPY_REQUESTS_IN_FLIGHT = 4
MAX_RANGES_BUFFER = 1 << 20
# CHANGE_NOTIFY's CompletionFilter (MS-SMB2 2.2.35): every change but an access time's (our own reads).
NOTIFY_FILTER = 0xFDF
NOTIFY_BUFFER = 4096  # what a change's answer may carry: we read none of it


class CopyLimits:
    """Copychunk limits of a server: start at 16 x 1 MiB, learn the real ones from its refusal."""

    def __init__(self, chunks=16, chunk_size=1 << 20, total=16 << 20):
        self.chunks, self.chunk_size, self.total = chunks, chunk_size, total

    def per_request(self):
        return min(self.total, self.chunks * self.chunk_size)


class Capabilities:
    """SeekData, Allocate, CloneRange, ServerCopy and Leases for SMBBackend (which provides the plumbing)."""
    clone_align = 4096  # what Samba's btrfs clone needs; MS-FSCC: the volume's cluster size
    _on_break = None
    notify_refused = False  # the server answered CHANGE_NOTIFY with "not supported": no watches (_watch)

    def caching(self, node):
        """While a lease with read caching is held on ``node``'s file: the same value for as long as it is
        held without a gap (no other client has written the file since it was first this value); else None.
        A directory's (see SMBBackend._hold_listing): no name in it has changed since."""
        lease = node.lease
        return None if lease is None or self.client is None else lease.caching(self.client.generation)

    def watched(self, node):
        """True while a change to any file in the directory ``node`` ends its ``caching`` value: a
        CHANGE_NOTIFY of ours is pending on the handle that holds its lease (see _watch)."""
        held = self.deferred.get(node) if node in self.dir_leases else None
        return held is not None and held[0].watched

    async def _watch(self, file):
        """Ask the server to tell of any change in the directory ``file`` has open (CHANGE_NOTIFY: a
        name added, removed or renamed, a file's size, times, attributes or security), by anyone:
        another client, a program on the server itself (which breaks no lease: Samba watches the
        directory with inotify; 4.17 and 4.22 told of a same-size rewrite put back with touch -r, and
        of a second write through another client's open handle), and ourselves.  Returns once the
        request is on the wire: Samba reads a connection's requests in order, so the listing asked
        after it is covered.  Each answer is a change: the lease counts as broken (leases.Lease.
        changed), and the watch goes on (Samba keeps what happens between two requests) until the
        handle closes (NOTIFY_CLEANUP) or the connection goes."""
        if self.notify_refused:
            return
        sent = trio.Event()
        trio.lowlevel.spawn_system_task(self._watching, file, sent)
        await sent.wait()

    async def _watching(self, file, sent):
        notify = m.change_notify(file.file_id, NOTIFY_FILTER, NOTIFY_BUFFER)
        while True:
            file.watched = True
            try:
                try:
                    [(status, _)] = await self._send([notify], file.generation, file.uid, sent)
                finally:
                    file.watched = False
                    sent.set()
            except Exception as e:  # the connection went, and its leases with it
                log.debug("watching a directory: %s", e)
                return
            if status == errors.NOTIFY_CLEANUP:
                return
            if errors.ERRNO.get(status) == errno.EOPNOTSUPP:
                self.notify_refused = True
                log.info("%s does not tell of changes in a directory (status %#x): files' attributes keep "
                         "attr_timeout", self.client.where, status)
            if file.lease is not None:
                file.lease.changed()
            if status not in (errors.SUCCESS, errors.NOTIFY_ENUM_DIR) or self.deferred.get(file.node, (None,))[0] is not file:
                return  # refused: the lease stays broken for the listing, and no request goes round again

    def on_break(self, callback):
        """``callback(node)`` from now on, in the trio thread, where read caching of ``node``'s file is lost
        other than by our own close: another client is about to change it, or the connection went.  For a
        directory, at our own close too (the caller may have handed out names for as long as it held)."""
        self._on_break = callback

    def _lease_broken(self, node):
        """The events of on_break's callback (base.dropped)."""
        if self._on_break is not None and node is not None:
            return self._on_break(node) or ()
        return ()

    def _lease_of(self, node):
        """The lease ``node``'s opens name (a fresh one where there is no node yet)."""
        if node is None:
            return leases.Lease(self, None)
        if node.lease is None:
            node.lease = leases.Lease(self, node, node.is_dir)
        return node.lease

    async def seek(self, file, offset, whence):
        """SEEK_DATA/SEEK_HOLE from the allocated ranges (exact on files marked sparse)."""
        if whence not in (SEEK_DATA, SEEK_HOLE):
            raise OSError(errno.EINVAL, "only SEEK_DATA and SEEK_HOLE")
        size = await self._size(file)
        if offset >= size:
            raise OSError(errno.ENXIO, "past end of file")
        ranges = await self._allocated(file, offset, size)
        if whence == SEEK_DATA:
            for r in ranges:
                if r.offset + r.length > offset:
                    return max(offset, r.offset)
            raise OSError(errno.ENXIO, "no data past the offset")
        pos = offset
        for r in ranges:
            if r.offset > pos:
                break
            pos = max(pos, r.offset + r.length)
        return min(pos, size)

    async def _allocated(self, file, offset, end):
        """FSCTL_QUERY_ALLOCATED_RANGES over [offset, end), sorted.

        Samba answers a too-small buffer with BUFFER_TOO_SMALL and nothing, so
        the buffer grows; Windows answers BUFFER_OVERFLOW with what fit, so the
        query goes on after the last range.
        """
        ranges = []
        out = 4096
        while offset < end:
            query = wire.AllocatedRange(offset, end - offset).pack()
            status, body = await self._file_request(
                file, lambda fid: m.ioctl(fid, wire.FSCTL_QUERY_ALLOCATED_RANGES, query, out))
            if status == errors.BUFFER_TOO_SMALL and out < MAX_RANGES_BUFFER:
                out *= 4
                continue
            if status not in (errors.SUCCESS, errors.BUFFER_OVERFLOW):
                raise status_error(status, body, file.node.path or "")
            got = wire.AllocatedRange.unpack_list(wire.IoctlResponse.output(body))
            ranges += got
            if status == errors.SUCCESS or not got:
                break
            offset = got[-1].offset + got[-1].length
        return sorted(ranges, key=lambda r: r.offset)

    async def allocate(self, file, mode, offset, length):
        """Punch a hole (on a file marked sparse first), or extend for plain allocation."""
        self._listed.clear()
        if mode == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE:
            if not file.sparse:
                await self._file_call(file, lambda fid: m.ioctl(fid, wire.FSCTL_SET_SPARSE, wire.SET_SPARSE))
                file.sparse = True
            zero = wire.ZeroData(offset, offset + length).pack()
            await self._file_call(file, lambda fid: m.ioctl(fid, wire.FSCTL_SET_ZERO_DATA, zero))
        elif mode == 0:
            # SMB has no range preallocation; a file that grows is at least the right size.
            if offset + length > await self._size(file):
                eof = info.FileEndOfFileInformation(offset + length).pack()
                await self._file_call(file, lambda fid: m.set_info(info.FILE_END_OF_FILE, eof, fid))
        else:
            raise OSError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x}")

    async def clone_range(self, src_file, src_offset, dst_file, dst_offset, length):
        """FSCTL_DUPLICATE_EXTENTS_TO_FILE, on shares with block refcounting (btrfs with vfs_btrfs).

        Offsets must be 4 KiB aligned and so must the length, unless the range
        ends at the source's end; an unaligned tail is left to the next method.
        The destination is sized first: into a shorter one the server clones
        nothing and still reports success.
        """
        self._listed.clear()
        if not self.can_clone:
            raise NotSupported("the share cannot duplicate extents")
        if not self._same_connection(src_file, dst_file) or src_file.backend.share != self.share:
            raise NotSupported("Samba finds the source handle only on the destination's share")
        if src_offset % self.clone_align or dst_offset % self.clone_align:
            raise NotSupported("offsets not 4 KiB aligned")
        if length % self.clone_align and src_offset + length != await src_file.backend._size(src_file):
            length -= length % self.clone_align
        if length == 0:
            raise NotSupported("less than 4 KiB to clone")
        src_fid = await src_file.backend._handle(src_file)
        old_size = await self._size(dst_file)
        if old_size < dst_offset + length:
            await self._set_size(dst_file, dst_offset + length)
        dup = wire.DuplicateExtents(src_fid, src_offset, dst_offset, length).pack()
        status, body = await self._file_request(
            dst_file, lambda fid: m.ioctl(fid, wire.FSCTL_DUPLICATE_EXTENTS_TO_FILE, dup), src_file.generation)
        if status != errors.SUCCESS:
            if old_size < dst_offset + length:
                await self._set_size(dst_file, old_size)
            # Both ends are open handles: a refusal means this pair or range cannot be cloned.
            raise NotSupported(f"duplicate extents refused (NTSTATUS 0x{status:08X})")
        return length

    async def server_copy(self, src_file, src_offset, dst_file, dst_offset, length):
        """FSCTL_SRV_COPYCHUNK_WRITE: several requests of up to the server's limit in flight.

        Returns the length of the prefix that was copied; a request that fails
        or copies less cuts the count there (the caller goes on from it).
        """
        self._listed.clear()
        if not self._same_connection(src_file, dst_file):
            raise NotSupported("source on another connection or in another user's session")
        if self.can_clone and not src_file.backend.can_clone:
            # Samba's vfs_btrfs looks another share's resume key up in its own table,
            # and crashes the connection's process if that table was never made.
            raise NotSupported("copychunk into a btrfs share from another kind of share")
        length = min(length, COPY_PER_CALL)
        key = await src_file.backend._resume_key(src_file)

        async def request(start, count):
            return await self._copychunk(key, src_file, src_offset + start, dst_file, dst_offset + start, count)

        return await copy_spans(request, length, self.copy_limits.per_request(), COPY_REQUESTS_IN_FLIGHT)

    async def _copychunk(self, key, src_file, src_offset, dst_file, dst_offset, length):
        """One or more COPYCHUNK_WRITE requests for a range; bytes copied from its start."""
        done = 0
        while done < length:
            limits = self.copy_limits
            n = min(length - done, limits.per_request())
            chunks = [(src_offset + done + o, dst_offset + done + o, min(limits.chunk_size, n - o))
                      for o in range(0, n, limits.chunk_size)]
            copy = wire.CopyChunkCopy(key, chunks).pack()
            status, body = await self._file_request(
                dst_file, lambda fid: m.ioctl(fid, wire.FSCTL_SRV_COPYCHUNK_WRITE, copy, 12), src_file.generation)
            if status == errors.SUCCESS:
                written = wire.CopyChunkResponse.unpack(wire.IoctlResponse.output(body)).total_bytes_written
                if not 0 < written <= n:
                    return done
                done += written
                if written < n:
                    return done
            elif status == errors.INVALID_PARAMETER and self._learn_limits(body, limits, len(chunks), n):
                continue
            elif status == errors.INVALID_VIEW_SIZE or done:
                return done  # the source ends inside the range, or the rest fails: a short count
            else:
                # Both ends are open handles, so any refusal is the server's copy giving
                # up (into a btrfs share from another one Samba answers "name not
                # found"); a copy by reading and writing shows any real error.
                raise NotSupported(f"copychunk refused (NTSTATUS 0x{status:08X})")
        return done

    def _learn_limits(self, body, used, chunks, n):
        """True if the refusal names limits smaller than those the request used (then they are kept)."""
        try:
            r = wire.CopyChunkResponse.unpack(wire.IoctlResponse.output(body))
        except wire.WireError:
            return False
        if not (r.chunks_written and r.chunk_bytes_written and r.total_bytes_written):
            return False
        learned = CopyLimits(r.chunks_written, r.chunk_bytes_written, r.total_bytes_written)
        if chunks <= learned.chunks and max(1, min(n, used.chunk_size)) <= learned.chunk_size and n <= learned.total:
            return False  # within the limits: something else is wrong
        self.copy_limits = learned
        log.info("%s: copychunk limits %d chunks of %d bytes, %d bytes a request", self.client.where,
                 learned.chunks, learned.chunk_size, learned.total)
        return True

    async def _resume_key(self, file):
        """The source's resume key from the current connection (a key from an older one kills Samba's);
        open() asks for it in its compound, so this asks only after a reconnect or a refusal there."""
        fid = await self._handle(file)
        if file.resume_key is None or file.key_generation != file.generation:
            body = await self._send1(m.resume_key(fid), file.generation, file.node.path or "")
            file.resume_key = wire.ResumeKey.unpack(wire.IoctlResponse.output(body)).key
            file.key_generation = file.generation
        return file.resume_key
