"""The NFSv4.1 client: one connection, one client ID and one session per server.

Every request is a COMPOUND that starts with SEQUENCE on a slot; the slot's
sequence ID gives exactly-once semantics across reconnects, so after a lost
connection a request is resent on the same slot with the same sequence ID
and the server either answers from its reply cache or runs it for the first
time.  Recovery climbs only as far as needed: a new connection is bound to
the old session (BIND_CONN_TO_SESSION); a lost session is replaced on the
same client ID (open state survives); a lost client ID (lease expired,
server restarted) means a new one, and ``generation`` goes up so that open
files get reopened.

The back channel runs on the same connection: CB_OFFLOAD ends asynchronous
copies, CB_RECALL gets delegations returned (we ask for none).

Hard mounts retry forever (a trio cancellation, e.g. an interrupted system
call, still ends the wait); soft mounts give up after timeo x (retrans + 1)
with ETIMEDOUT.  A server that breaks every connection (garbage, resets) is
reconnected after ever longer waits, and its trouble logged at most once a
while: a bad server must not cost a loop of connections and log lines.
"""
import contextlib
import errno
import logging
import os
import socket
from dataclasses import dataclass

import trio

from . import attrs, compound, errors, gss, ops, rpc
from .delegations import SEQ4_STATUS_REVOKED, Delegations
from .errors import NFSError
from .xdr import ProtocolError

log = logging.getLogger(__name__)

NFS4_PROGRAM, NFS_V4, NFSPROC4_COMPOUND = 100003, 4, 1
CB_PROGRAM = 0x40000000
MAX_SLOTS = 64
BACK_SLOTS = 4
RECORD_OVERHEAD = 64 << 10  # what we ask for beyond the largest READ/WRITE payload
IO_HEADROOM = 1024  # RPC and compound framing around a READ/WRITE payload
SEQ4_STATUS_CB_PATH_DOWN, SEQ4_STATUS_CB_PATH_DOWN_SESSION = 0x1, 0x200
ENDED_KEPT = 256  # ended copies whose late CB_OFFLOAD is ignored
ORPHAN_OFFLOAD = 300  # seconds an unclaimed CB_OFFLOAD is kept for a COPY reply still to come
ROOT_CRED = rpc.auth_sys(0, 0)
RECONNECT_FIRST, RECONNECT_MAX = 0.1, 10.0  # seconds before reconnecting, doubled while connections fail
TROUBLE_LOG_EVERY = 10.0  # seconds between two log lines about a failing server


def _io_size(wanted, server_max, channel_max):
    """The largest READ/WRITE payload: ours, the server's, the session's (less framing), in 4 KiB units."""
    size = min(wanted, server_max or wanted, channel_max - IO_HEADROOM)
    return max(4096, size & ~4095)


@dataclass(frozen=True)
class Settings:
    host: str
    port: int = 2049
    minorversion: int = 2
    soft: bool = False
    timeo: float = 60.0  # seconds one request may take before the connection is dropped and it is resent
    retrans: int = 2  # soft: resends before giving up
    rsize: int = 1 << 20
    wsize: int = 1 << 20
    connect_timeout: float = 15.0
    sec: str = None  # sys, krb5, krb5i, krb5p; None: what SECINFO_NO_NAME offers (sys if it is offered)
    ccache: str = None  # Kerberos: root's credential cache (None: the library's default), or
    keytab: str = None  # its keytab
    cruid: int = None  # or the uid whose cache it is, looked up at each context (kerberos.user_cache)


class _Again(Exception):
    """Send the compound again: after a backoff if ``wait`` (the server asked for time), on the same
    slot with the same sequence ID if ``resend`` (it may have run: the server must see a resend)."""

    def __init__(self, wait=False, resend=False):
        self.wait = wait
        self.resend = resend


class SlotTable:
    """The fore channel's slots: each carries its next sequence ID."""

    def __init__(self, size):
        self.size = size
        self.seqids = [1] * size
        self.uncertain = [False] * size  # a request was cut off: the server may or may not have run it
        self._free = list(range(size - 1, -1, -1))
        self._available = trio.Semaphore(size)

    async def acquire(self):
        await self._available.acquire()
        return self._free.pop()

    def release(self, slot):
        self._free.append(slot)
        self._available.release()


class _Throttled:
    """A log line at most every ``every`` seconds; the next one says how many were held back."""

    def __init__(self, every):
        self.every = every
        self.next = float("-inf")
        self.held = 0

    def __call__(self, level, msg, *args):
        now = trio.current_time()
        if now < self.next:
            self.held += 1
            return
        if self.held:
            msg += f" ({self.held} more such line(s) held back)"
        log.log(level, msg, *args)
        self.next, self.held = now + self.every, 0


class _Offload:
    def __init__(self, waited):
        self.done = trio.Event()
        self.outcome = None  # compound.Offload
        self.waited = waited  # False: a CB_OFFLOAD that came before its COPY reply
        self.born = trio.current_time()


class Client:
    _shared = {}  # (trio token, Settings) -> Client

    def __init__(self, settings: Settings):
        self.settings = settings
        self.conn = None
        self.clientid = None
        self.create_seq = 0
        self.sessionid = None
        self.table = None
        self.fore = None
        self.generation = 0  # bumped when the server forgot our state: reopen files
        self.lease = 90
        self.rsize, self.wsize = settings.rsize, settings.wsize  # ours until the server's are known
        self.supported_attrs = 0  # some servers refuse a GETATTR that names attributes they lack
        self.security = None  # gss.Security under sec=krb5*, else requests go with AUTH_SYS
        self.renewed = 0.0
        self.unsupported = set()  # NFSv4.2 operations this server answered NOTSUPP
        self.async_copies = True  # asynchronous COPY, while CB_OFFLOAD reaches us
        self.pulls = True  # inter-server COPY into this server, until it answers NOTSUPP
        self.refused_sources = set()  # (host, port) of servers it could not pull from
        self.address = None  # (ip, port) we reach the server at: how COPY_NOTIFY names it
        self.offloads = {}  # copy stateid "other" -> _Offload
        self.open_files = set()  # the backends' files with open state, reclaimed after a server restart
        self.delegations = Delegations(self)
        self._reclaiming = False  # a new client ID has not yet reclaimed and sent RECLAIM_COMPLETE
        self._ended = {}  # stateid "other" of copies no longer waited for (insertion-ordered, capped)
        self.users = 0
        self.failed_connections = 0  # in a row, with no good reply on any: sets the reconnect backoff
        self._trouble = _Throttled(TROUBLE_LOG_EVERY)
        self._verifier = os.urandom(8)
        self._owner = f"offloadfs/{socket.gethostname()}/{os.getpid()}/{os.urandom(6).hex()}".encode()
        self._lock = trio.Lock()  # one recovery at a time
        self._starting = trio.Lock()
        self._nursery = None
        self._stop = None
        self._started = False

    @classmethod
    def shared(cls, settings):
        key = (trio.lowlevel.current_trio_token(), settings)
        client = cls._shared.get(key)
        if client is None:
            client = cls._shared[key] = cls(settings)
        client.users += 1
        return client

    # -- start and stop ----------------------------------------------------------------

    async def start(self, path=()):
        """Connect, and set up client ID and session, choosing the flavour for ``path`` (see
        _choose_security); OSError with a clear message if the server fails us."""
        async with self._starting:
            if self._started:
                return
            self._stop = trio.Event()
            ready = trio.Event()
            trio.lowlevel.spawn_system_task(self._services, ready)
            await ready.wait()
            try:
                async with self._lock:
                    await self._recover()
                await self._choose_security(path)
                [_, values] = await self.compound([ops.PutRootFH(), ops.GetAttr(attrs.bits(
                    attrs.SUPPORTED_ATTRS, attrs.LEASE_TIME, attrs.MAXREAD, attrs.MAXWRITE))])
            except (rpc.ConnectionLost, rpc.RPCError, ProtocolError) as e:
                await self._shutdown()
                raise OSError(errno.EIO, f"NFS server {self.settings.host}: {e}") from None
            except BaseException:
                await self._shutdown()
                raise
            self.supported_attrs = values.get(attrs.SUPPORTED_ATTRS, 0)
            self.lease = max(5, values.get(attrs.LEASE_TIME, 90))
            self.rsize = _io_size(self.settings.rsize, values.get(attrs.MAXREAD), self.fore.max_response)
            self.wsize = _io_size(self.settings.wsize, values.get(attrs.MAXWRITE), self.fore.max_request)
            self.conn.max_record = self._max_record()
            self.renewed = trio.current_time()
            self.spawn(self._renew)
            self._started = True

    async def _choose_security(self, path):
        """sec= as given, else the server's choice for the mount's ``path`` (components from its root): AUTH_SYS
        where it takes it (as mount.nfs), else the first Kerberos flavour it lists.  Each component on the way
        down is asked for in turn (an export in the server's pseudo file system may take other flavours than
        the directories above it, and refuse the others' LOOKUP with WRONGSEC)."""
        if self.settings.sec is not None:
            self._secure(self.settings.sec)
            return
        queries = [[*map(ops.Lookup, path[:i]), ops.SecInfo(path[i])] for i in range(len(path))]
        for query in queries or [[ops.SecInfoNoName()]]:
            try:
                *_, offered = await self.compound([ops.PutRootFH(), *query])
            except NFSError as e:
                log.debug("SECINFO on %s: %s; keeping what we have", self.settings.host, e)
                return
            names = [gss.flavour_name(*flavour) for flavour in offered]
            self._secure("sys" if "sys" in names or not any(names) else next(name for name in names if name))

    def _secure(self, sec):
        if sec == "sys":
            self.security = None
        elif self.security is None or self.security.service != gss.SERVICES[sec]:
            log.info("NFS server %s: sec=%s", self.settings.host, sec)
            self.security = gss.Security(sec, self.settings.host, self.settings.ccache, self.settings.keytab,
                                         self.settings.cruid)

    def cred(self, caller=None):
        """The credential of a request acting for ``caller`` (a backends.base.Caller), or for the client
        itself (None: root)."""
        if self.security is not None:
            return self.security.for_user(0 if caller is None else caller.uid)
        return ROOT_CRED if caller is None else rpc.caller_cred(caller)

    def spawn(self, fn, *args):
        """Run ``fn(*args)`` in the background; a failure is logged, never allowed to take the client down."""
        self._nursery.start_soon(self._guarded, fn, args)

    @staticmethod
    async def _guarded(fn, args):
        try:
            await fn(*args)
        except Exception:
            log.exception("NFS client task %s failed", fn.__name__)

    async def _services(self, ready):
        """A nursery for the readers and background tasks, living as long as the client."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def close(self):
        """Drop a user; the last one ends the session and client ID (best effort, a few seconds at most)."""
        self.users -= 1
        if self.users > 0:
            return
        self._shared.pop((trio.lowlevel.current_trio_token(), self.settings), None)
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5):
                if self.conn is not None and not self.conn.closed and self.sessionid is not None:
                    try:
                        await self.delegations.return_all()
                        await self._solo(ops.DestroySession(self.sessionid))
                        await self._solo(ops.DestroyClientId(self.clientid))
                        if self.security is not None:
                            await self.security.destroy_all(self.conn)
                    except (OSError, rpc.ConnectionLost, rpc.RPCError, ProtocolError) as e:
                        log.debug("NFS session teardown: %s", e)
            await self._shutdown()

    async def _shutdown(self):
        if self.conn is not None:
            await self.conn.close("client closed")
        self._started = False
        self._stop.set()

    # -- connection and session recovery -------------------------------------------------

    async def _connect(self):
        s = self.settings
        try:
            with trio.fail_after(s.connect_timeout):
                stream = await trio.open_tcp_stream(s.host, s.port)
        except trio.TooSlowError:
            raise OSError(errno.ETIMEDOUT, f"no answer from {s.host}:{s.port} in {s.connect_timeout:g} s") from None
        except OSError as e:
            raise OSError(e.errno or errno.EHOSTUNREACH, f"cannot connect to {s.host}:{s.port}: "
                          f"{e.strerror or e}") from None
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.address = stream.socket.getpeername()[:2]
        conn = rpc.Connection(stream, self._on_call, self._max_record(), s.timeo)
        self.spawn(self._serve, conn)
        return conn

    def _max_record(self):
        """The largest record a server may send: the largest READ or WRITE (as negotiated, once
        it is) and the framing around it."""
        return max(self.rsize, self.wsize) + RECORD_OVERHEAD

    async def _serve(self, conn):
        await conn.serve()
        if conn.garbage is not None:
            self._trouble(logging.WARNING, "NFS server %s sent garbage, dropping the connection: %s",
                          self.settings.host, conn.garbage)

    async def _backoff(self):
        """Wait before a new connection while the last ones brought no good reply: RECONNECT_FIRST,
        doubled each time up to RECONNECT_MAX or timeo (a soft mount's requests must not spend
        their time waiting); a reply that decodes starts over."""
        if self.failed_connections:
            cap = min(RECONNECT_MAX, self.settings.timeo)
            await trio.sleep(min(RECONNECT_FIRST * 2 ** (self.failed_connections - 1), cap))
        self.failed_connections += 1

    async def _solo(self, op):
        """A compound of one session-less operation (EXCHANGE_ID, CREATE_SESSION...)."""
        try:
            with trio.fail_after(self.settings.timeo):
                u = await self.conn.call(NFS4_PROGRAM, NFS_V4, NFSPROC4_COMPOUND, ROOT_CRED,
                                         compound.encode([op], self.settings.minorversion))
        except trio.TooSlowError:
            await self.conn.close("no answer")
            raise rpc.ConnectionLost(f"no answer from {self.settings.host} in {self.settings.timeo:g} s") from None
        results, failure = compound.decode(u, [op])
        if failure is not None:
            raise NFSError(failure.status, type(op).__name__)
        return results[0]

    async def _recover(self):
        """Get a usable connection and session, going only as far back as needed; after a new
        client ID, take the open files back and end our part of the grace period."""
        await self._reestablish()
        if self._reclaiming:
            await self._reclaim()
            await self._reclaim_complete()
            self._reclaiming = False

    async def _reestablish(self):
        fresh = self.conn is None or self.conn.closed
        if fresh:
            await self._backoff()
            self.conn = await self._connect()
        if self.sessionid is not None:
            if not fresh:
                return
            try:
                await self._solo(ops.BindConnToSession(self.sessionid))
                return
            except NFSError as e:
                if e.status not in (errors.BADSESSION, errors.DEADSESSION):
                    raise
                log.info("NFS session on %s lost; creating another", self.settings.host)
                self.sessionid = None
        if self.clientid is not None:
            try:
                await self._create_session()
                return
            except NFSError as e:
                if e.status not in (errors.STALE_CLIENTID, errors.EXPIRED):
                    raise
                log.warning("NFS server %s forgot us (restarted or lease expired): taking open files back",
                            self.settings.host)
                self._forgotten()
        try:
            res = await self._solo(ops.ExchangeId(self._verifier, self._owner))
        except NFSError as e:
            if e.status == errors.MINOR_VERS_MISMATCH:
                raise OSError(errno.EPROTONOSUPPORT, f"{self.settings.host} does not speak NFSv4."
                              f"{self.settings.minorversion} (try minorversion=1)") from None
            raise
        self.clientid, self.create_seq = res.clientid, res.sequenceid
        self._reclaiming = True
        await self._create_session()

    async def _reclaim(self):
        """Take the open files back (CLAIM_PREVIOUS) while the restarted server's grace period
        keeps their state for us: a plain OPEN would have to wait the grace period out (90 s on
        Linux).  A file the server does not give back is reopened as usual when next used."""
        for file in list(self.open_files):
            if file.generation == self.generation:
                continue  # taken back before the connection dropped
            try:
                [_, opened] = await self._sequenced(
                    [ops.PutFH(file.node.fh), ops.Open(file.access, file.owner, 0, reclaim=True)],
                    cred=self.cred(file.caller))
            except NFSError as e:
                log.info("NFS server %s did not give an open file back (%s)", self.settings.host, e.strerror)
                if e.status == errors.NO_GRACE:
                    return  # no grace period (the lease expired, or the server keeps none): no reclaims
                continue
            except _Again as e:
                if e.wait:
                    continue
                raise rpc.ConnectionLost("lost the connection or session while reclaiming") from None
            file.stateid, file.generation = opened.stateid, self.generation
            if opened.delegation is not None:
                self.return_delegation(opened.delegation, file.node.fh)

    async def _reclaim_complete(self):
        for _ in range(10):
            try:
                await self._sequenced([ops.ReclaimComplete()])
                return
            except NFSError as e:
                if e.status == errors.COMPLETE_ALREADY:
                    return
                raise
            except _Again:
                await trio.sleep(0.1)
        raise rpc.ConnectionLost("RECLAIM_COMPLETE keeps failing")

    async def _create_session(self):
        s = self.settings
        io = max(s.rsize, s.wsize) + RECORD_OVERHEAD
        fore = ops.ChannelAttrs(io, io, 16 << 10, 16, MAX_SLOTS)
        back = ops.ChannelAttrs(16 << 10, 16 << 10, 0, 8, BACK_SLOTS)
        res = await self._solo(ops.CreateSession(self.clientid, self.create_seq, fore, back, CB_PROGRAM))
        self.create_seq = (self.create_seq + 1) & 0xFFFFFFFF
        self.sessionid = res.sessionid
        self.fore = res.fore
        if not res.flags & ops.CREATE_SESSION_CONN_BACK_CHAN:
            self.async_copies = False  # no back channel: CB_OFFLOAD could not reach us
        self.table = SlotTable(max(1, min(res.fore.max_requests, MAX_SLOTS)))

    async def _ready(self):
        """A usable connection and session; failed tries close the connection, so the next one
        waits out the reconnect backoff."""
        while self.conn is None or self.conn.closed or self.sessionid is None:
            async with self._lock:
                if self.conn is not None and not self.conn.closed and self.sessionid is not None:
                    break
                try:
                    await self._recover()
                    break
                except (OSError, rpc.ConnectionLost, rpc.RPCError, ProtocolError) as e:
                    self._trouble(logging.WARNING, "NFS server %s not usable, still trying: %s",
                                  self.settings.host, e)
                    if self.conn is not None:
                        await self.conn.close(str(e))

    # -- compounds --------------------------------------------------------------------------

    async def compound(self, op_list, cred=None, cache=False, retry_delay=True):
        """Run SEQUENCE + ``op_list``; the results of ``op_list``, or NFSError for the first that failed.

        ``cache``: ask the server to keep the reply for a resend (for what must not run twice).
        ``retry_delay``: wait and resend on NFS4ERR_DELAY (else it is raised).
        ``cred``: as cred() gives (None: the client's own).
        """
        cred = cred or self.cred()
        if not self.settings.soft:
            return await self._retrying(op_list, cred, cache, retry_delay)
        limit = self.settings.timeo * (self.settings.retrans + 1)
        try:
            with trio.fail_after(limit):
                return await self._retrying(op_list, cred, cache, retry_delay)
        except trio.TooSlowError:
            raise OSError(errno.ETIMEDOUT, f"NFS server {self.settings.host} did not answer "
                          f"in {limit:g} s (soft mount)") from None

    async def _retrying(self, op_list, cred, cache, retry_delay):
        delay = 0.05
        held = None  # (table, slot): kept while a lost request is resent with the same sequence ID
        try:
            while True:
                await self._ready()
                if held is not None and held[0] is not self.table:
                    held[0].release(held[1])  # that session is gone, and its slots with it
                    held = None
                if held is None:
                    table = self.table
                    held = (table, await table.acquire())
                table, slot = held
                if table is not self.table or self.sessionid is None:
                    continue  # the session went while we waited for the slot: recover first
                try:
                    return await self._try_slot(self.conn, table, self.sessionid, slot, op_list, cred, cache,
                                                retry_delay)
                except _Again as again:
                    if not again.resend:
                        table.release(slot)
                        held = None
                    if again.wait:
                        await trio.sleep(delay)
                        delay = min(delay * 2, 2.0)
        finally:
            if held is not None:
                held[0].release(held[1])

    async def _sequenced(self, op_list, cred=None, cache=False, retry_delay=True):
        """One try on one slot; _Again when the compound must be resent."""
        cred = cred or self.cred()
        conn, table, sessionid = self.conn, self.table, self.sessionid
        slot = await table.acquire()
        try:
            return await self._try_slot(conn, table, sessionid, slot, op_list, cred, cache, retry_delay)
        finally:
            table.release(slot)

    async def _try_slot(self, conn, table, sessionid, slot, op_list, cred, cache, retry_delay):
        for op in op_list:
            if isinstance(op, ops.Open):
                op.clientid = self.clientid
        seq = ops.Sequence(sessionid, table.seqids[slot], slot, table.size - 1, cache)
        full = [seq] + op_list
        args = compound.encode(full, self.settings.minorversion)
        try:
            with trio.move_on_after(self.settings.timeo) as timer:
                u = await conn.call(NFS4_PROGRAM, NFS_V4, NFSPROC4_COMPOUND, cred, args)
        except rpc.ConnectionLost:
            raise _Again(resend=True) from None
        except (ProtocolError, rpc.RPCError) as e:
            self._trouble(logging.WARNING, "NFS server %s refused or garbled a reply: %s", self.settings.host, e)
            self._cut_off(table, slot)
            await conn.close(str(e))
            raise OSError(errno.EIO, f"NFS server {self.settings.host}: {e}") from None
        except trio.Cancelled:
            self._cut_off(table, slot)
            raise
        if timer.cancelled_caught:
            self._trouble(logging.WARNING, "NFS server %s not answering for %g s; reconnecting",
                          self.settings.host, self.settings.timeo)
            await conn.close("request timed out")
            raise _Again(resend=True)
        try:
            results, failure = compound.decode(u, full)
        except ProtocolError as e:
            self._trouble(logging.WARNING, "NFS server %s sent an undecodable reply: %s", self.settings.host, e)
            self._cut_off(table, slot)
            await conn.close(f"protocol error: {e}")
            raise OSError(errno.EIO, f"NFS server {self.settings.host} sent a broken reply: {e}") from None
        self.failed_connections = 0
        if failure is not None and failure.index == 0:
            self._sequence_failed(table, slot, failure.status)
        table.seqids[slot] = (table.seqids[slot] + 1) & 0xFFFFFFFF
        table.uncertain[slot] = False
        self.renewed = trio.current_time()
        if results[0].status_flags & (SEQ4_STATUS_CB_PATH_DOWN | SEQ4_STATUS_CB_PATH_DOWN_SESSION):
            self.spawn(self._rebind, conn)
            self.delegations.lost("the back channel is down: recalls cannot reach us")
        if results[0].status_flags & SEQ4_STATUS_REVOKED:
            self.delegations.lost("the server revoked state")
        if failure is None:
            return results[1:]
        status = failure.status
        if status == errors.GRACE or (status == errors.DELAY and retry_delay):
            raise _Again(wait=True)
        if status in (errors.STALE_CLIENTID, errors.BADSESSION, errors.DEADSESSION):
            self._forget(table, client=status == errors.STALE_CLIENTID)
            raise _Again()
        if status == errors.RETRY_UNCACHED_REP and failure.index == 1:
            raise _Again()  # a resend of one that ran, reply not kept (ganesha says so here): send anew
        raise NFSError(status, type(full[failure.index]).__name__, failure.detail)

    @staticmethod
    def _cut_off(table, slot):
        """We stopped waiting for a request that may have run: assume it did, check on the slot's next use."""
        table.seqids[slot] = (table.seqids[slot] + 1) & 0xFFFFFFFF
        table.uncertain[slot] = True

    def _sequence_failed(self, table, slot, status):
        """SEQUENCE itself failed: the slot's sequence ID was not used up."""
        if status == errors.DELAY:
            raise _Again(wait=True)  # the slot is still busy with an earlier request
        if status == errors.SEQ_MISORDERED and table.uncertain[slot]:
            table.seqids[slot] -= 1  # the cut-off request never ran
            table.uncertain[slot] = False
            raise _Again()
        if status == errors.RETRY_UNCACHED_REP:
            table.seqids[slot] += 1  # it ran but its reply is gone: what we send is idempotent or cached
            raise _Again()
        if status == errors.SEQ_FALSE_RETRY:
            # The sequence ID of a cut-off request, taken back on SEQ_MISORDERED that meant "still
            # running" (Linux nfsd): it ran after all, and this request is a new one.
            table.seqids[slot] += 1
            raise _Again()
        if status in (errors.BADSESSION, errors.DEADSESSION, errors.BADSLOT, errors.SEQ_MISORDERED):
            self._forget(table)
            raise _Again()
        if status in (errors.STALE_CLIENTID, errors.EXPIRED):
            self._forget(table, client=True)
            raise _Again()
        if status == errors.CONN_NOT_BOUND_TO_SESSION:
            self._forget(table)
            raise _Again()
        raise NFSError(status, "SEQUENCE")

    def _forget(self, table, client=False):
        """The session (or the client ID) is gone; the next compound recovers."""
        if table is not self.table:
            return  # already replaced
        self.sessionid = None
        if client and self.clientid is not None:
            self._forgotten()

    def _forgotten(self):
        """The server forgot our client ID, and with it every open and delegation."""
        self.clientid = None
        self.generation += 1
        self.delegations.lost("the server forgot our client ID")

    async def _rebind(self, conn):
        """The server lost our back channel: bind this connection to the session again."""
        async with self._lock:
            if conn is self.conn and not conn.closed and self.sessionid is not None:
                try:
                    await self._solo(ops.BindConnToSession(self.sessionid))
                except (OSError, rpc.ConnectionLost, rpc.RPCError, ProtocolError) as e:
                    log.warning("cannot rebind the NFS back channel: %s", e)

    async def _renew(self):
        """Keep the lease alive while idle: an empty SEQUENCE every third of the lease."""
        while True:
            await trio.sleep(max(1.0, self.renewed + self.lease / 3 - trio.current_time()))
            if trio.current_time() - self.renewed >= self.lease / 3:
                try:
                    await self.compound([])
                except OSError as e:
                    log.warning("NFS lease renewal on %s failed: %s", self.settings.host, e)
                    if trio.current_time() - self.renewed > self.lease:
                        self.delegations.lost("the lease was not renewed in time")
                    await trio.sleep(1)

    # -- back channel -------------------------------------------------------------------------

    async def _on_call(self, prog, vers, proc, u):
        if prog != CB_PROGRAM:
            return None
        if proc == 0:
            return b""
        return compound.callback(u, self.sessionid, BACK_SLOTS, self._offload_done, self.delegations.recalled)

    def offload(self, stateid):
        """The record an asynchronous copy's end lands in (CB_OFFLOAD may come before the COPY reply)."""
        record = self.offloads.setdefault(stateid[4:], _Offload(True))
        record.waited = True
        return record

    def offload_ended(self, stateid):
        """Nobody waits for this copy any more: drop its record, and ignore a CB_OFFLOAD still on
        its way (a cancelled copy reports its end too)."""
        key = stateid[4:]
        self.offloads.pop(key, None)
        self._ended[key] = None
        if len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    def _offload_done(self, stateid, outcome):
        key = stateid[4:]
        if key in self._ended:
            return
        now = trio.current_time()
        for other, record in list(self.offloads.items()):  # early callbacks whose COPY reply never came
            if not record.waited and now - record.born > ORPHAN_OFFLOAD:
                del self.offloads[other]
        record = self.offloads.setdefault(key, _Offload(False))
        record.outcome = outcome
        record.done.set()

    def return_delegation(self, stateid, fh):
        """Give a delegation back (recalled, or granted though we asked for none), in the background."""
        self.spawn(self.delegreturn, stateid, fh)

    async def delegreturn(self, stateid, fh):
        """DELEGRETURN; one the server revoked meanwhile is freed, so SEQUENCE stops flagging it."""
        try:
            await self.compound([ops.PutFH(fh), ops.DelegReturn(stateid)])
        except NFSError as e:
            log.debug("DELEGRETURN: %s", e)
            if e.status == errors.DELEG_REVOKED:
                with contextlib.suppress(OSError):
                    await self.compound([ops.FreeStateid(stateid)])
        except OSError as e:
            log.debug("DELEGRETURN: %s", e)
