"""Read delegations: the server's promise that no other client writes a file until it asks for it back.

A read open asks for no particular delegation, as the Linux client does; a write open or a create
asks for none.  The server (Linux nfsd; ganesha where configured) may grant a read delegation,
and recalls it with CB_RECALL before another client's or a local program's open for writing,
truncate, rename or removal goes on (nfsd's delegations are VFS leases, so programs on the server
break them too, where Samba's leases are blind to them).  While one is held, the kernel's pages of
the file stay good across our opens and closes, so it is kept after the last close, as the Linux
client keeps it, until recalled, until ``HELD_MAX`` newer ones push it out, or until we open the
file for writing ourselves (a read delegation covers no writes of ours: it is given back first).

``caching(fh)`` hands out the Delegation itself while it is held: the filesystem compares it with
the one of the open before (cache.AttrCache.reopened), and a delegation lost and granted again is
another object.  Everything that may end one without our DELEGRETURN ends them all: a new client
ID (the server forgot us), a lease that went unrenewed past its time (the server may have given
the file to another), a SEQUENCE reply saying state was revoked.

A CB_RECALL and the OPEN reply that granted the delegation come to different tasks, so the recall
may be handled first: a recalled stateid we did not know yet is remembered, and the grant that
brings it later is not taken.
"""
import collections
import logging

import trio

from .. import base

log = logging.getLogger(__name__)

HELD_MAX = 1024  # delegations kept at once; the oldest is given back first
RECALLED_KEPT = 64  # recalled stateids not yet seen granted

# SEQUENCE status flags: some of our state is gone without a recall we heard of.
SEQ4_STATUS_REVOKED = 0x8 | 0x10 | 0x20 | 0x40  # EXPIRED_ALL, EXPIRED_SOME, ADMIN, RECALLABLE


class Delegation:
    """One read delegation: its stateid, the node it was granted through, and who hears of its end."""
    __slots__ = ("stateid", "node", "ended", "generation")

    def __init__(self, stateid, node, ended, generation):
        self.stateid = stateid
        self.node = node
        self.ended = ended  # ended(node): the backend's Leases.on_break callback; the events it returns: see recalled
        self.generation = generation  # the client's, when granted


class Delegations:
    """The read delegations one NFS client holds, by filehandle."""

    def __init__(self, client):
        self.client = client
        self.held = collections.OrderedDict()  # fh -> Delegation, oldest first
        self._recalled = collections.OrderedDict()  # stateid "other" -> None

    def granted(self, node, stateid, ended):
        """An OPEN reply brought ``stateid`` for ``node``: keep it, or give it back at once (one held
        already, recalled before we saw it, or not wanted: ``ended`` None)."""
        if stateid is None:
            return
        known = self.held.get(node.fh)
        recalled = stateid[4:] in self._recalled
        self._recalled.pop(stateid[4:], None)
        if recalled or known is not None and known.stateid == stateid:
            return  # being given back already, or the one we hold
        if ended is None or known is not None:
            self.client.return_delegation(stateid, node.fh)
            return
        self.held[node.fh] = Delegation(stateid, node, ended, self.client.generation)
        if len(self.held) > HELD_MAX:
            _, oldest = self.held.popitem(last=False)
            self.client.return_delegation(oldest.stateid, oldest.node.fh)

    def caching(self, fh, now):
        """The Delegation held on ``fh`` while it is sure to be ours, else None."""
        d = self.held.get(fh)
        if d is None or d.generation != self.client.generation or now - self.client.renewed > self.client.lease:
            return None
        return d

    async def give_back(self, fh):
        """Return the delegation on ``fh`` before we open it for writing (it does not cover our writes)."""
        d = self.held.pop(fh, None)
        if d is not None:
            await self.client.delegreturn(d.stateid, fh)

    def recalled(self, stateid, fh):
        """CB_RECALL: the server wants it back. Must not block (the reader that answers the call runs it).

        The writer the server holds back goes on once we give it back: the give-back waits for
        the kernel to drop the file first (base.dropped, the events ``ended`` returns)."""
        d = self.held.get(fh)
        dropped = ()
        if d is not None and d.stateid[4:] == stateid[4:]:
            del self.held[fh]
            dropped = d.ended(d.node) or ()
        else:
            self._recalled[stateid[4:]] = None
            if len(self._recalled) > RECALLED_KEPT:
                self._recalled.popitem(last=False)
        if dropped:
            self.client.spawn(self._give_back_once, dropped, stateid, fh)
        else:
            self.client.return_delegation(stateid, fh)

    async def _give_back_once(self, dropped, stateid, fh):
        await base.dropped(dropped)
        await self.client.delegreturn(stateid, fh)

    async def return_all(self):
        """At unmount: give every delegation back.  A server recalls a delegation from a client that
        is gone only when the recall times out, and meanwhile holds back the other client's change
        (Linux nfsd: some 11 s for each removal of such a file)."""
        held, self.held = self.held, collections.OrderedDict()
        async with trio.open_nursery() as nursery:
            for d in held.values():
                nursery.start_soon(self.client.delegreturn, d.stateid, d.node.fh)

    def lost(self, why):
        """Every delegation may be gone without a recall: the files may have changed."""
        if self.held:
            log.info("NFS server %s: %d delegations lost (%s)", self.client.settings.host, len(self.held), why)
        held, self.held = self.held, collections.OrderedDict()
        for d in held.values():
            d.ended(d.node)
            if d.generation == self.client.generation:  # a forgotten client ID's are gone with it
                self.client.return_delegation(d.stateid, d.node.fh)
