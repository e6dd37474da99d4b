"""ONC RPC (RFC 5531) over one TCP connection, both ways.

Calls are multiplexed by XID: any number may be in flight, and the reader
task hands each reply to whoever waits for it.  NFSv4.1 runs the back
channel on the same connection, so the reader also receives CALLs from the
server and answers them (in tasks of their own: answering may need a
fore-channel round trip, which this very reader must deliver).
"""
import itertools
import logging
import os
import struct

import trio

from .xdr import Packer, ProtocolError, Unpacker

log = logging.getLogger(__name__)

CALL, REPLY = 0, 1
MSG_ACCEPTED, MSG_DENIED = 0, 1
SUCCESS, PROG_UNAVAIL, PROG_MISMATCH, PROC_UNAVAIL, GARBAGE_ARGS, SYSTEM_ERR = range(6)
RPC_MISMATCH, AUTH_ERROR = 0, 1
AUTH_NONE_FLAVOR, AUTH_SYS_FLAVOR = 0, 1
MAX_AUTH_BYTES = 400
LAST_FRAGMENT = 0x80000000
# A record may come in fragments, but a server that sends them smaller than this on average (a
# flood of empty ones costs CPU and nothing else) breaks the protocol; a few tiny ones are fine.
FRAGMENT_FLOOR = 1024

AUTH_NONE = (AUTH_NONE_FLAVOR, b"")


class ConnectionLost(Exception):
    """The connection closed (or was closed) before the reply came; the call may or may not have run."""


class RPCError(Exception):
    """The server refused the call at the RPC level (no such program, bad credentials...)."""


class AuthError(RPCError):
    """The server refused the call's credentials; ``stat`` is the auth_stat (RFC 5531, RFC 2203)."""

    def __init__(self, stat):
        super().__init__(f"credentials refused (auth_stat {stat})")
        self.stat = stat


def auth_sys(uid, gid, gids=(), machine=b"offloadfs"):
    """An AUTH_SYS credential (flavor, body)."""
    p = Packer()
    p.u32(0)  # stamp
    p.opaque(machine[:255])
    p.u32(uid)
    p.u32(gid)
    gids = list(gids)[:16]
    p.u32(len(gids))
    for g in gids:
        p.u32(g)
    return (AUTH_SYS_FLAVOR, p.bytes())


def caller_cred(caller):
    """AUTH_SYS for a backends.base.Caller: their uid, primary and supplementary groups."""
    return auth_sys(caller.uid, caller.gid, caller.groups())


def _auth(u):
    flavor = u.u32()
    return flavor, u.opaque(MAX_AUTH_BYTES, "auth body")


def parse_reply(u):
    """Check an accepted, successful reply header (after xid and msg_type); the server's verifier
    (flavor, body). The results follow in ``u``."""
    stat = u.enum((MSG_ACCEPTED, MSG_DENIED), "reply_stat")
    if stat == MSG_DENIED:
        why = u.enum((RPC_MISMATCH, AUTH_ERROR), "reject_stat")
        if why == RPC_MISMATCH:
            raise RPCError(f"RPC version mismatch (server takes {u.u32()}-{u.u32()})")
        raise AuthError(u.u32())
    verifier = _auth(u)  # AUTH_NONE or AUTH_SYS: nothing to check; RPCSEC_GSS: gss.py checks it
    accept = u.u32()
    if accept == SUCCESS:
        return verifier
    if accept == PROG_MISMATCH:
        raise RPCError(f"program version not served (server takes {u.u32()}-{u.u32()})")
    names = {PROG_UNAVAIL: "program not served", PROC_UNAVAIL: "procedure not served",
             GARBAGE_ARGS: "the server could not decode our arguments", SYSTEM_ERR: "server system error"}
    raise RPCError(names.get(accept, f"accept_stat {accept}"))


class _Pending:
    __slots__ = ("event", "body", "verifier", "error")

    def __init__(self):
        self.event = trio.Event()
        self.body = None
        self.verifier = None
        self.error = None


class Connection:
    """One TCP connection.  ``serve()`` must run (in a nursery) for replies and callbacks to arrive.

    ``on_call(prog, vers, proc, args: Unpacker)`` answers a call from the server:
    it returns the reply's result bytes, or None for "program not served".
    A record is at most ``max_record`` bytes; a server that takes no bytes of
    ours for ``send_timeout`` seconds is gone.
    """

    def __init__(self, stream, on_call, max_record, send_timeout):
        self.stream = stream
        self.on_call = on_call
        self.max_record = max_record
        self.send_timeout = send_timeout
        self.pending = {}
        self.closed = None  # why, once closed
        self.garbage = None  # what the server sent that broke the protocol, if that ended it
        self._xids = itertools.count(int.from_bytes(os.urandom(4), "big") >> 1)
        self._send_lock = trio.Lock()
        self._buf = bytearray()

    # -- sending ---------------------------------------------------------------------

    async def _send(self, record):
        """Send one record whole: a record cut short by a cancellation would corrupt the stream."""
        if self.closed:
            raise ConnectionLost(self.closed)
        data = struct.pack(">I", LAST_FRAGMENT | len(record)) + record
        with trio.CancelScope(shield=True):
            async with self._send_lock:
                if self.closed:
                    raise ConnectionLost(self.closed)
                with trio.move_on_after(self.send_timeout) as timer:
                    try:
                        await self.stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                        await self.close(f"send failed: {e}")
                        raise ConnectionLost(self.closed) from None
                if timer.cancelled_caught:
                    await self.close(f"the server took nothing for {self.send_timeout:g} s")
                    raise ConnectionLost(self.closed)

    async def call(self, prog, vers, proc, cred, args):
        """Send a call; its results (after the accepted-SUCCESS header) as an Unpacker.

        ``cred``: (flavor, body), or an object whose ``call`` does the same under RPCSEC_GSS
        (gss.UserCredential)."""
        if not isinstance(cred, tuple):
            return await cred.call(self, prog, vers, proc, args)
        return (await self.call_verified(prog, vers, proc, cred, args))[0]

    async def call_verified(self, prog, vers, proc, cred, args, sign=None):
        """As call, with ``sign(header)`` making the verifier from the header bytes (AUTH_NONE without);
        (results, the reply's verifier as (flavor, body))."""
        xid = next(self._xids) & 0xFFFFFFFF
        p = Packer()
        for v in (xid, CALL, 2, prog, vers, proc, cred[0]):
            p.u32(v)
        p.opaque(cred[1])
        if sign is None:
            p.u32(AUTH_NONE_FLAVOR)
            p.u32(0)
        else:
            mic = sign(p.bytes())  # over the header up to and including the credential
            p.u32(cred[0])
            p.opaque(mic)
        p.buf += args
        waiter = self.pending[xid] = _Pending()
        try:
            await self._send(bytes(p.buf))
            await waiter.event.wait()
        finally:
            self.pending.pop(xid, None)
        if waiter.error is not None:
            raise waiter.error
        return waiter.body, waiter.verifier

    # -- receiving -------------------------------------------------------------------

    async def _read(self, n):
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(n - len(self._buf), 65536))
            if not chunk:
                raise ConnectionLost("the server closed the connection")
            self._buf += chunk
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def _record(self):
        parts = []
        total = 0
        while True:
            (header,) = struct.unpack(">I", await self._read(4))
            size = header & ~LAST_FRAGMENT
            total += size
            if total > self.max_record:
                raise ProtocolError(f"record of more than {total} bytes (at most {self.max_record})")
            if len(parts) > self.max_record // FRAGMENT_FLOOR + 16:
                raise ProtocolError(f"record in more than {len(parts)} fragments "
                                    f"(at most one a KiB of {self.max_record} bytes, and 16)")
            parts.append(await self._read(size))
            if header & LAST_FRAGMENT:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    async def serve(self):
        """Read until the connection ends; then every waiting call fails with ConnectionLost
        (and ``garbage`` says what broke the protocol, if that was why)."""
        reason = "closed"
        try:
            async with trio.open_nursery() as nursery:
                try:
                    while True:
                        self._dispatch(await self._record(), nursery)
                except ConnectionLost as e:
                    reason = str(e)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                    reason = self.closed or f"connection lost: {e}"
                except ProtocolError as e:
                    self.garbage = str(e)  # the owner of the connection says so, naming the server
                    reason = f"protocol error: {e}"
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.close(reason)

    def _dispatch(self, record, nursery):
        u = Unpacker(record)
        xid = u.u32()
        kind = u.enum((CALL, REPLY), "msg_type")
        if kind == REPLY:
            waiter = self.pending.pop(xid, None)
            if waiter is None:
                return  # the caller gave up (cancelled or timed out)
            try:
                waiter.verifier = parse_reply(u)
                waiter.body = u
            except (ProtocolError, RPCError) as e:
                waiter.error = e
            waiter.event.set()
            return
        rpcvers, prog, vers, proc = u.u32(), u.u32(), u.u32(), u.u32()
        _auth(u)
        _auth(u)
        if rpcvers != 2:
            raise ProtocolError(f"callback with RPC version {rpcvers}")
        nursery.start_soon(self._answer, xid, prog, vers, proc, u)

    async def _answer(self, xid, prog, vers, proc, args):
        try:
            result = await self.on_call(prog, vers, proc, args)
            accept = PROG_UNAVAIL if result is None else SUCCESS
        except ProtocolError as e:
            log.warning("undecodable callback from the NFS server: %s", e)
            result, accept = None, GARBAGE_ARGS
        except Exception:
            log.exception("answering a callback from the NFS server failed")
            result, accept = None, SYSTEM_ERR
        p = Packer()
        for v in (xid, REPLY, MSG_ACCEPTED, AUTH_NONE_FLAVOR, 0, accept):
            p.u32(v)
        if result:
            p.buf += result
        try:
            await self._send(bytes(p.buf))
        except ConnectionLost:
            pass

    async def close(self, reason="closed"):
        if self.closed:
            return
        self.closed = reason
        for waiter in self.pending.values():
            waiter.error = ConnectionLost(reason)
            waiter.event.set()
        self.pending.clear()
        with trio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
