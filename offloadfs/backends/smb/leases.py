"""Leases: what lets the kernel keep a file's pages, and what makes a handle durable.

Every open of a file names its node's lease key, so our own opens of one file
share one lease and never break each other.  We ask for read and handle
caching (RH).  Read caching held means no other client has written the file
meanwhile: the server breaks it before another's write or truncate goes on.
Handle caching is what Samba makes a handle durable under (or a batch oplock).
No write caching: our writes go to the server as they come, and W would hold
every other client's open back until we answered its break.

The server breaks a lease with a message whose id is all ones.  smbprotocol's
receive worker looks every message up in its table of outstanding requests and
dies on that one, so a Listener sits in the table under that id.  A break is
acknowledged where the server asks, with the state it names; where read
caching goes, the backend's break callback hears of it (the file may change
from now on).

The server keeps leases per client GUID, which is new with every connection
(see client.py): a lease is held on one connection (``generation``), and one
of an older connection is gone.  ``period`` counts the spans over which read
caching was held without a gap; caching() hands out (key, period), which the
filesystem compares at the next open.  Where the order of an open's reply and
a break is not known (they arrive on different paths), the lower state wins:
a v2 lease's epochs say which came last, and any change we did not hear of as
it happened starts a new period.
"""
import logging
import threading
import uuid

import trio
from smbprotocol.header import Commands, SMB2HeaderRequest

from .. import base
from . import messages as m, wire

log = logging.getLogger(__name__)

UNSOLICITED = 0xFFFFFFFFFFFFFFFF
ASKED = m.LEASE_READ | m.LEASE_HANDLE


def _newer(epoch, than):
    """A 16-bit epoch later than ``than``, as the server counts (it wraps)."""
    return 0 < (epoch - than) & 0xFFFF < 0x8000


class Lease:
    """The lease of one node through one backend: its key, and what is held on which connection.  A
    directory's (SMB 3 directory leasing) is held by a listing's handle kept open, and its read caching
    says that no name in the directory changed (see SMBBackend._hold_listing)."""
    __slots__ = ("key", "backend", "node", "directory", "state", "epoch", "generation", "opens", "pending", "changes",
                 "period")

    def __init__(self, backend, node, directory=False):
        self.key = uuid.uuid4().bytes
        self.backend = backend
        self.node = node  # None until a create's reply says which file it is
        self.directory = directory  # its end by our own close is told too (see Capabilities.on_break)
        self.state = 0
        self.epoch = 0
        self.generation = 0
        self.opens = 0  # our handles open under it on ``generation``
        self.pending = 0  # opens under it sent on ``generation`` and not answered yet
        self.changes = 0  # breaks heard of: an open that saw another count in flight cannot order its reply
        self.period = 0

    def caching(self, generation):
        """(key, period) while read caching is held on connection ``generation``, else None."""
        if self.generation == generation and self.opens and self.state & m.LEASE_READ:
            return self.key, self.period
        return None

    def context(self, v2, parent=None):
        return m.lease(self.key, ASKED, v2, parent)

    def _set(self, state, epoch, continuous, notify=True):
        """The lease holds ``state`` now; ``continuous``: no change we did not hear of came between.
        Returns the events of the break callback, if it was told (base.dropped)."""
        held = self.state & m.LEASE_READ
        dropped = ()
        if not (held and continuous and state & m.LEASE_READ):
            self.period += 1
            if held and notify:
                dropped = self.backend._lease_broken(self.node)
        self.state, self.epoch = state, epoch
        return dropped

    def granted(self, got, seen):
        """An open sent when ``changes`` was ``seen`` came back with the lease context ``got`` (None: no lease)."""
        self.pending -= 1
        state = 0 if got is None or got.key != self.key else got.state
        if got is not None and got.flags & wire.Lease.BREAK_IN_PROGRESS:
            state &= ~m.LEASE_READ
        v2 = got is not None and got.epoch is not None
        if self.changes != seen and not (v2 and _newer(got.epoch, self.epoch)):
            self._set(state & self.state, self.epoch, True)  # a break came after the reply's state
        elif self.opens == 0:
            self._set(state, got.epoch if v2 else 0, False)  # a new lease
        elif v2:
            self._set(state, got.epoch, got.epoch == self.epoch)
        else:
            self._set(state, 0, state == self.state)
        self.opens += 1

    def broken(self, brk):
        """A break to ``brk.new``: never more than that from now on.  Returns what to wait for before
        acknowledging it (base.dropped)."""
        self.changes += 1
        epoch = brk.epoch if _newer(brk.epoch, self.epoch) else self.epoch
        return self._set(self.state & brk.new, epoch, True)

    def changed(self):
        """A directory's watch told of a change in it (SMBBackend._watch), which may break no lease (a program
        on the server): the lease counts as broken from now on, though the server still holds it."""
        self.changes += 1
        self._set(self.state, self.epoch, False)

    def closed(self, generation):
        """One of our handles under it, of connection ``generation``, closes."""
        if generation == self.generation and self.opens:
            self.opens -= 1
            if not self.opens:  # the server ends it with its last open
                self._set(0, self.epoch, True, notify=self.directory)


class Listener:
    """The lease breaks of one connection, and the leases its opens hold or ask for.

    Stands in for smbprotocol's Request: the worker reads ``session_id``,
    ``message["reserved"]`` and ``message["command"]``, then sets
    ``response`` and calls ``response_event.set()`` under
    ``response_event_lock`` (also, with nothing new, when the connection dies).
    """

    def __init__(self, client, conn):
        self.client = client
        self.generation = client.generation
        self.leases = {}  # key -> Lease, of the opens held or under way on this connection
        self.session_id = None
        self.message = SMB2HeaderRequest()
        self.message["command"] = Commands.SMB2_OPLOCK_BREAK
        self.response = None
        self.response_event = self
        self.response_event_lock = threading.Lock()
        conn.outstanding_requests[UNSOLICITED] = self

    def opening(self, lease):
        """An open under ``lease`` goes out on this connection: its breaks are heard from now.  Returns
        what ``opened`` needs back."""
        if lease.generation != self.generation:
            lease._set(0, 0, False)  # gone with its connection; any change may have come meanwhile
            lease.generation, lease.opens, lease.pending = self.generation, 0, 0
        lease.pending += 1
        self.leases[lease.key] = lease
        return lease.changes

    def opened(self, lease, got, seen):
        """The open came back with the lease context ``got`` (None: no lease)."""
        if lease.generation == self.generation:
            lease.granted(got, seen)

    def failed(self, lease):
        """The open did not open anything."""
        if lease.generation == self.generation:
            lease.pending -= 1
            self._forget(lease)

    def closed(self, lease, generation):
        lease.closed(generation)
        if lease.generation == self.generation:
            self._forget(lease)

    def _forget(self, lease):
        if not lease.opens and not lease.pending:
            self.leases.pop(lease.key, None)

    def set(self):
        """In the receive worker: a message arrived, or the connection died."""
        header, self.response = self.response, None
        if header is None:
            self._in_trio(self._gone)
            return
        if header["command"].get_value() != Commands.SMB2_OPLOCK_BREAK:
            return
        try:
            brk = wire.LeaseBreak.unpack(header["data"].get_value())
        except wire.WireError as e:
            # Not a lease break (an oplock break: we take no oplocks), or malformed; unsigned either way.
            log.debug("%s: unsolicited message ignored: %s", self.client.where, e)
            return
        self._in_trio(self._broken, brk)

    def _in_trio(self, fn, *args):
        try:
            self.client.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def _gone(self):
        """In the trio thread: the connection died, and its leases with it.  A directory's says so now
        (the names it kept answer no more, and its handle is dropped); a file's at its next open."""
        for lease in list(self.leases.values()):
            if lease.directory and lease.generation == self.generation and lease.node is not None:
                lease._set(0, lease.epoch, False)
                lease.backend._deferred_broken(lease.node)

    def _broken(self, brk):
        """In the trio thread, from the trio token: whatever this raises would end the daemon."""
        lease = self.leases.get(brk.key)
        if lease is None:
            return  # its last handle was closed meanwhile, which ends it
        if lease.directory:
            lease.backend.dir_lease_breaks += 1
        dropped = ()
        try:
            dropped = lease.broken(brk) or ()
            if lease.node is not None:
                lease.backend._deferred_broken(lease.node)  # a handle kept open past its release closes
        except Exception:
            log.exception("%s: a lease break's callback failed", self.client.where)
        if brk.ack_required:  # the other client's open goes on at our answer: the kernel drops the file first
            trio.lowlevel.spawn_system_task(self._acknowledge, lease, brk.new, dropped)

    async def _acknowledge(self, lease, state, dropped):
        await base.dropped(dropped)
        try:
            # In the mount's session: the server keys leases by connection (client GUID), not session.
            await lease.backend._send([m.lease_break_ack(lease.key, state)], self.generation, None)
        except OSError as e:
            # The connection went, or the handles were closed meanwhile: the lease went with them.
            log.debug("lease break not acknowledged: %s", e)
