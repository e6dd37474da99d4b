"""Oplock breaks: the server's unsolicited messages, answered so that handles can be durable.

Samba makes a handle durable only with a batch oplock (or a lease with
handle caching).  It breaks the oplock when anyone else opens the file for
its data or to delete or rename it, another handle of ours included, with a
message whose id is all ones, and holds that open back until we answer.
smbprotocol's receive worker looks every message up in its table of
outstanding requests and dies on that one, so a Listener sits in the table
under that id.  It gives each oplock up at once (acknowledged to none): the
other open goes on, and our handle stops being durable, so after a lost
connection it is reopened by path and checked instead of reconnected.
"""
import logging
import threading

import trio
from smbprotocol.header import Commands, SMB2HeaderRequest

from . import messages

log = logging.getLogger(__name__)

UNSOLICITED = 0xFFFFFFFFFFFFFFFF
OPLOCK_BREAK_SIZE = 24  # 2.2.23.1; a lease break (2.2.23.2) is longer, and we take no leases


class Listener:
    """The break notifications of one connection, and the oplocks its handles hold.

    Stands in for smbprotocol's Request: the worker reads ``session_id``,
    ``message["reserved"]`` and ``message["command"]``, then sets
    ``response`` and calls ``response_event.set()`` under
    ``response_event_lock`` (also, with nothing new, when the connection dies).
    """

    def __init__(self, client, conn):
        self.client = client
        self.generation = client.generation
        self.held = {}  # file id -> share, of the handles holding an oplock
        self.early = set()  # file ids broken before their open's reply was handled (see hold)
        self.session_id = None
        self.message = SMB2HeaderRequest()
        self.message["command"] = Commands.SMB2_OPLOCK_BREAK
        self.response = None
        self.response_event = self
        self.response_event_lock = threading.Lock()
        conn.outstanding_requests[UNSOLICITED] = self

    def hold(self, file_id, share):
        """A handle of ``share`` on this connection was granted an oplock."""
        if file_id in self.early:
            self.early.discard(file_id)
            trio.lowlevel.spawn_system_task(self._give_up, file_id, share)
        else:
            self.held[file_id] = share

    def release(self, file_id):
        self.held.pop(file_id, None)
        self.early.discard(file_id)

    def set(self):
        """In the receive worker: a message arrived, or the connection died."""
        header, self.response = self.response, None
        if header is None or header["command"].get_value() != Commands.SMB2_OPLOCK_BREAK:
            return
        body = header["data"].get_value()
        if len(body) == OPLOCK_BREAK_SIZE:
            try:
                self.client.token.run_sync_soon(self._broken, bytes(body[8:24]))
            except trio.RunFinishedError:
                pass

    def _broken(self, file_id):
        share = self.held.pop(file_id, None)
        if share is None:
            # The open's reply arrived just before and its task has not run yet.
            self.early.add(file_id)
        else:
            trio.lowlevel.spawn_system_task(self._give_up, file_id, share)

    async def _give_up(self, file_id, share):
        try:
            await self.client.call(share, [messages.oplock_break_ack(file_id)], self.generation)
        except OSError as e:
            # The connection went, or the handle was closed meanwhile: the oplock went with it.
            log.debug("oplock break of %s not acknowledged: %s", file_id.hex(), e)
