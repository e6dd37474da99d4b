"""One SMB connection and its sessions driven from trio, shared by every share of one server and user.

smbprotocol's Connection receives in its own worker thread, which sets a
threading.Event on each Request.  Small requests are framed and signed in the
trio thread and sent from it if the socket takes them at once; large ones
(signing costs milliseconds of CPU per MiB) and sends that would wait for the
socket go to trio worker threads.  Each Request's event is swapped for an
``_Arrival`` that also wakes the waiting trio task, so any number of requests
are in flight without a thread each.  Credits are counted before each send
(smbprotocol refuses a send it has no credits for instead of waiting), and
every request has a deadline: a server that stops answering gets its
connection shut down, which fails what was in flight with EIO.

The network may be hostile (see _GuardedConnection): every reply after
logon is verified, a reply that fails any check drops the connection, and
what was in flight fails with EIO and one line that says why.

After a drop the next request reconnects, at once if the connection had
served requests, else after a delay that doubles per failure (up to
RECONNECT_DELAY_MAX; requests meanwhile wait for the next try if it is
due within RETRY_WAIT, else fail at once).  Handles are then
stale (``generation`` tells the backend so): durable ones are reconnected,
others lost (EIO).  Each connection has a leases.Listener for the
lease breaks of its opens.  A new connection has the client GUID of the one
before: the server keys leases by it, and a durable handle's reconnect names
its lease.  After a server stopped answering it gets a new one: Samba hands a
new connection with a known GUID to the process that served the old one,
which would be the hung one we left (its durable handles are then lost).

With multiuser (-o multiuser, Kerberos only) each local user but root gets a
session of their own on the connection, as mount.cifs's: set up at their first
request from their own ticket cache, found where cifs.upcall and rpc.gssd
look (kerberos.user_cache), with tree connects of its own.  Their requests go in
that session, so the server checks the user's own rights.  A user it cannot
be set up for (no cache, an expired ticket) gets EACCES, never the mount's
session; the reason is logged once per uid.  A user's session whose ticket
expired is renewed from their cache, as the mount's is; until it can be
(they kinit), their requests get EACCES.  Sessions go with their
connection and are set up again at the user's next request after a
reconnect.  Root (uid 0), and the daemon's own work, use the mount's session.
"""
import contextlib
import dataclasses
import errno
import logging
import math
import socket
import time
import uuid

import trio
from smbprotocol.connection import Capabilities
from smbprotocol.exceptions import SMBException, SMBResponseException
from smbprotocol.session import Session
from smbprotocol.tree import TreeConnect

from .. import kerberos
from . import auth, errors, leases
from .connection import CONNECT_TIMEOUT, MIN_IO_SIZE, GuardedConnection, LeanSend, describe
from .errors import ConnectionLost, status_error

log = logging.getLogger(__name__)
# smbprotocol logs every message structure at DEBUG and each connect step at INFO, spnego
# the NTLM tokens: far too much for -o debug or syslog, and tokens have no place in logs.
# A dying receive worker logs a traceback per connection; the Client says why in one line instead.
for noisy in ("smbprotocol", "spnego"):
    logging.getLogger(noisy).setLevel(logging.CRITICAL)

IO_TIMEOUT = 60  # any one request
CREDITS = 4096  # what we ask the server for (Samba grants up to 8192)
SPARE_CREDITS = 8  # never spent: smbprotocol's own requests (tree connect, keepalive echo) need some
CREDIT_SIZE = 65536
INLINE_SEND = 65536  # bytes of requests framed and signed in the trio thread (tens of microseconds); more in a worker
RECONNECT_DELAY_MIN = 0.05  # seconds before the first retry once a connection failed without serving
RECONNECT_DELAY_MAX = 5
# A request finding the next try this near waits for it: a server that has just come back
# is then reached by the first request after it, not the first after the delay.
RETRY_WAIT = 1
LOG_INTERVAL = 10  # seconds between two log lines about one server's connections


class _Arrival:
    """The response event of a connection.Sent: wakes the trio task waiting for its reply.

    The receive worker calls set() under the request's lock for each reply
    (an interim STATUS_PENDING, then the final one), and without it when the
    connection dies.

    The request and its arrival refer to each other: once done with it, the
    arrival lets go of the request, or the cycle would keep its reply (a whole
    read's data) until the garbage collector ran, which it seldom does under
    I/O and never while the daemon is idle (measured: 80 MB held after
    4 x 16 MiB written and read).
    """
    __slots__ = ("_token", "_conn", "_request", "_on_arrival", "_event", "_abandoned")

    def __init__(self, token, conn, request, on_arrival):
        self._token = token
        self._conn = conn
        self._request = request
        self._on_arrival = on_arrival
        self._event = trio.Event()
        self._abandoned = False

    def set(self):
        event = self._event
        try:
            self._token.run_sync_soon(self._arrived, event)
        except trio.RunFinishedError:
            pass

    def _arrived(self, event):
        event.set()
        self._on_arrival()
        if self._abandoned and self._request is not None and self._final():
            self._forget()

    def _final(self):
        r = self._request.response
        return r is not None and r.status != errors.PENDING

    def _forget(self):
        self._conn.outstanding_requests.pop(self._request.message_id, None)
        self._request = None

    async def wait(self):
        """The final connection.Reply, or None if the connection died first."""
        while True:
            await self._event.wait()
            request = self._request
            with request.response_event_lock:
                final = self._final()
                if final or request.response is None or not self._conn.transport.connected:
                    self._request = None
                    return request.response if final else None
                self._event = trio.Event()  # an interim response: the final one follows

    def abandon(self):
        """Nobody waits any more: drop the response from the connection's table when it comes."""
        self._abandoned = True
        if self._request is not None and self._final():
            self._forget()


class Client:
    """A connection, a session and its tree connects; reconnects on demand."""

    _shared = {}  # (trio token, server, user, ...) -> Client

    def __init__(self, target, key):
        self.target = target
        self.key = key
        self.token = trio.lowlevel.current_trio_token()
        self.conn = None
        self.session = None  # the mount's own
        self.sessions = {}  # uid -> that user's Session on the current connection (multiuser)
        self.leases = None  # the current connection's leases.Listener
        self.trees = {}  # (uid, share) -> tree id on the current connection; uid None: the mount's session
        self.generation = 0  # bumped per connection: handles of older ones are gone
        self.guid = uuid.uuid4()  # the client GUID of our connections; a new one after a hang (see the module)
        self.io_size = CREDIT_SIZE  # largest READ/WRITE, set from the server's limits and our credits
        self.users = 0
        self._lock = trio.Lock()
        self._renewing = trio.Lock()  # one re-authentication at a time
        self._renewals = {}  # uid (None: the mount's) -> its session's renewals after it expired
        self._refused = {}  # uid -> why their session could not be set up, as last logged
        # The thread that finishes a message half sent from the trio thread (LeanSend.try_now): one at a
        # time, as it holds the socket, and never behind the threads waiting for the socket.
        self._finishing = trio.CapacityLimiter(1)
        self._reserved = 0  # credits promised to sends under way
        self._in_flight = 0  # credits charged to requests not answered yet
        self._credit_change = trio.Event()
        self._failures = 0  # failed connection attempts, and why the last one failed
        self._last_failure = ""
        self._delay = 0  # before the next attempt: doubles while connections fail without serving
        self._not_before = 0.0  # trio time of the next attempt
        self._served = 0  # the generation that last answered a request
        self._log_connected = _LogLimit(logging.INFO)  # apart, so that a success never hides the failure after it
        self._log_failure = _LogLimit(logging.WARNING)

    @classmethod
    def shared(cls, target):
        """The Client for this server, user and security; one per trio run."""
        t = target
        key = (trio.lowlevel.current_trio_token(), t.host, t.port, t.username, t.domain, t.password, t.dialect,
               t.seal, t.posix, t.sec, t.ccache, t.keytab, t.cruid)
        client = cls._shared.get(key)
        if client is None:
            client = cls._shared[key] = cls(target, key)
        client.users += 1
        return client

    async def release(self):
        self.users -= 1
        if self.users == 0:
            self._shared.pop(self.key, None)
            await self.close()

    # -- connecting ---------------------------------------------------------------

    @property
    def where(self):
        return f"{self.target.host}:{self.target.port}" if self.target.port != 445 else self.target.host

    async def _connect(self):
        """Connect, log on and get credits; errors say what failed, never with the password."""
        self.conn = None
        self.trees = {}
        self.sessions = {}
        conn = GuardedConnection(self.guid, self.target.host, self.target.port, require_signing=True)
        conn.want_posix = self.target.posix is not False
        conn.client_capabilities |= Capabilities.SMB2_GLOBAL_CAP_DIRECTORY_LEASING  # see SMBBackend._hold_listing
        try:
            session = await self._blocking(conn, self._connect_sync, conn)
        except BaseException:
            self._shutdown(conn)
            raise
        self.conn, self.session = conn, session
        self.generation += 1
        self.leases = leases.Listener(self, conn)
        self.io_size = min(conn.max_read_size, conn.max_write_size,
                           max(CREDIT_SIZE, self._window(conn) // 4 * CREDIT_SIZE))
        self._log_connected("connected to %s as %s: dialect 0x%x, %d credits, %d-byte I/O%s", self.where,
                            auth.who(self.target), conn.dialect, self._window(conn), self.io_size,
                            ", POSIX extensions" if conn.posix else "")

    def _connect_sync(self, conn):
        t = self.target
        try:
            conn.connect(dialect=t.dialect, timeout=CONNECT_TIMEOUT)
        except ValueError as e:
            if isinstance(e.__cause__, OSError):  # smbprotocol's word for "socket connect failed"
                raise ConnectionLost(f"cannot connect to {self.where}: {_reason(e)}") from None
            raise self._setup_failed("negotiate", e) from None
        except Exception as e:
            raise self._setup_failed("negotiate", e) from None
        if t.posix and not conn.posix:
            raise ConnectionLost(f"{self.where} does not offer SMB 3.1.1 POSIX extensions (-o posix; Samba 4.22 "
                                 "and later offer them with smb3 unix extensions = yes)")
        sizes = {"read": conn.max_read_size, "write": conn.max_write_size, "transaction": conn.max_transact_size}
        for what, size in sizes.items():
            if size < MIN_IO_SIZE:
                raise ConnectionLost(f"negotiate with {self.where} failed: largest {what} of {size} bytes "
                                     f"offered, less than {MIN_IO_SIZE}")
        conn.sender = conn.transport.send = LeanSend(conn.transport)
        session = self._log_on(conn)
        try:
            conn.echo(sid=session.session_id, timeout=CONNECT_TIMEOUT, credit_request=CREDITS)
        except Exception as e:
            raise self._setup_failed("the first echo", e) from None
        return session

    def _log_on(self, conn, t=None):
        """smbprotocol's Session, set up with the credentials auth.credential picks from Target ``t`` (the
        mount's, unless a user's); with cruid= from that uid's cache as found now."""
        t = t or self.target
        if t.cruid is not None:
            with self._cruid_cache() as cache:
                session = self._log_on(conn, self.user_target(cache))
            log.info("cruid=%d: session on %s as %s from %s", t.cruid, self.where, cache.principal, cache.found)
            return session
        user, password, protocol = auth.credential(t)
        session = Session(conn, user, password, require_encryption=t.seal, auth_protocol=protocol)
        try:
            session.connect()
            if session.encrypt_data:
                conn.verify_logon(session)
        except Exception as e:
            raise self._logon_failed(e, t) from None
        return session

    def _logon_failed(self, e, t=None):
        """The ConnectionLost for a failed logon with Target ``t``: Kerberos failures in one line of what to do."""
        t = t or self.target
        line = kerberos.failure(e) if t.sec == "krb5" else None
        if line:
            return ConnectionLost(f"Kerberos logon as {auth.who(t)} to {self.where} failed: {line}")
        logon = isinstance(e, SMBResponseException) and e.status == errors.LOGON_FAILURE
        whom = f" for user {auth.who(t)}"
        return self._setup_failed("logon failure" if logon else "session setup", e, whom)

    def _setup_failed(self, what, e, whom=""):
        """The ConnectionLost for a step of connecting that failed with ``e``: its status, or what was wrong.

        Never the errno of the status: replies before logon are not signed, so
        anyone on the path can make them say anything.
        """
        if isinstance(e, SMBResponseException):
            return ConnectionLost(f"{what}{whom} on {self.where} (NTSTATUS 0x{e.status:08X})")
        return ConnectionLost(f"{what}{whom} on {self.where} failed: {self.scrub(describe(e))}")

    async def tree_id(self, share, uid=None):
        """(connection, tree id) for ``share`` in the session of ``uid`` (None: the mount's), connecting,
        logging on and connecting the tree as needed."""
        conn = self.conn
        if conn is not None and conn.transport.connected and (uid, share) in self.trees:
            return conn, self.trees[uid, share]
        failures = self._failures
        async with self._lock:
            if self.conn is not None and not self.conn.transport.connected:
                self._lost(self.conn)
            if self.conn is None:
                if self._failures != failures:
                    # It failed while we waited: say so now instead of queueing one more try.
                    raise ConnectionLost(self._last_failure)
                wait = self._not_before - trio.current_time()
                if wait > RETRY_WAIT:
                    raise ConnectionLost(f"{self._last_failure} (next try in {wait:.1f} s)")
                await trio.sleep(max(0, wait))
                try:
                    await self._connect()
                except OSError as e:
                    self.guid = uuid.uuid4()  # an old process of ours may hold it, hung
                    self._failures += 1
                    self._last_failure = e.strerror
                    self._back_off()
                    self._log_failure("%s", e.strerror)
                    raise
            conn = self.conn
            if (uid, share) not in self.trees:
                session = self.session if uid is None else await self._user_session(conn, uid)
                tree = TreeConnect(session, f"\\\\{self.target.host}\\{share}")
                try:
                    await self._blocking(conn, tree.connect)
                except SMBResponseException as e:
                    raise status_error(e.status, what=f"share {share} on {self.where}") from None
                except Exception as e:
                    raise self._lost(conn, self._setup_failed(f"share {share}", e).strerror) from None
                self.trees[uid, share] = tree.tree_connect_id
            return conn, self.trees[uid, share]

    def user_target(self, cache):
        """The Target a session logs on with from kerberos.UserCache ``cache`` (a multiuser user's, or the
        mount's with cruid=): the cache's principal, nothing of the mount's credentials."""
        return dataclasses.replace(self.target, username=cache.principal, domain="", password=None, keytab=None,
                                   ccache=cache.ccache, cruid=None)

    async def _user_session(self, conn, uid):
        """The session of ``uid`` on ``conn``, set up now if it has none (under self._lock); EACCES if it
        cannot be (the connection's own failures stay ConnectionLost)."""
        session = self.sessions.get(uid)
        if session is not None:
            return session
        with await self._user_cache(uid) as cache:
            target = self.user_target(cache)
            try:
                session = await self._blocking(conn, self._log_on, conn, target)
            except ConnectionLost as e:
                if conn.transport.connected:
                    raise self._refuse(uid, e.strerror) from None
                raise
        self.sessions[uid] = session
        self._refused.pop(uid, None)
        log.info("uid %d: session on %s as %s from %s", uid, self.where, cache.principal, cache.found)
        return session

    async def _user_cache(self, uid, failing=""):
        """kerberos.user_cache(uid); EACCES if none will do, ``failing`` said before why."""
        try:
            return await trio.to_thread.run_sync(kerberos.user_cache, uid)
        except kerberos.NoCache as e:
            raise self._refuse(uid, f"{failing}{e}") from None

    def _cruid_cache(self, failing=""):
        """kerberos.user_cache of the mount's cruid= (blocking); ConnectionLost, ``failing`` before the
        line of why, if none will do."""
        cruid = self.target.cruid
        try:
            return kerberos.user_cache(cruid)
        except kerberos.NoCache as e:
            raise ConnectionLost(f"{failing}Kerberos logon to {self.where} from the cache of cruid={cruid} "
                                 f"failed: {e}") from None

    def _refuse(self, uid, why):
        """The EACCES for a user whose session cannot be set up; logged once per uid and reason."""
        if self._refused.get(uid) != why:
            self._refused[uid] = why
            log.warning("uid %d gets EACCES on %s: %s", uid, self.where, why)
        return PermissionError(errno.EACCES, f"no session for uid {uid}: {why}")


    def _back_off(self):
        self._delay = min(RECONNECT_DELAY_MAX, max(RECONNECT_DELAY_MIN, 2 * self._delay))
        self._not_before = trio.current_time() + self._delay

    def _lost(self, conn, why=None):
        """``conn`` is gone (shut down here, or dead of itself): note why and when to try again.

        A connection that served no request before it went counts as a
        failed attempt: a server (or a man in the middle) that ends every
        connection at once must not get one per request.
        """
        if why is None:
            why = describe(conn._t_exc) if conn._t_exc is not None else "closed"
        lost = ConnectionLost(f"connection to {self.where} lost: {self.scrub(why)}")
        if self.conn is conn:  # the first to notice
            self._last_failure = lost.strerror
            if self._served != self.generation:
                self._back_off()
            self._log_failure("%s", lost.strerror)
        self._shutdown(conn)
        return lost

    async def _blocking(self, conn, fn, *args):
        """Run one of smbprotocol's blocking steps; past the deadline, shut the connection so it returns."""
        with trio.move_on_after(CONNECT_TIMEOUT) as scope:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        if scope.cancelled_caught:
            self.guid = uuid.uuid4()
            self._shutdown(conn)
            raise ConnectionLost(f"{self.where} did not answer in {CONNECT_TIMEOUT} s")

    def scrub(self, text):
        """Text from a library, with the password cut out should it ever appear."""
        password = self.target.password
        return text.replace(password, "********") if password else text

    # -- requests -------------------------------------------------------------------

    async def call(self, share, messages, generation=None, uid=None, sent=None):
        """Send one request, or a related compound of several, in the session of ``uid`` (None: the
        mount's); [(status, body)] in order.

        A request the server refused unprocessed because the session's ticket
        had expired goes again once the session is set up anew (auth.reauthenticate).
        ``sent`` (a trio.Event), for a request the server answers only when something happens
        (CHANGE_NOTIFY): set once the request is on the wire, and the answer is awaited with no
        deadline (the connection's loss still ends the wait).
        """
        renewals = self._renewals.get(uid, 0)
        results = await self._call(share, messages, generation, uid, sent)
        if any(status == errors.NETWORK_SESSION_EXPIRED for status, _ in results):
            await self._reauthenticate(renewals, uid)
            results = await self._call(share, messages, generation, uid, sent)
        return results

    async def _reauthenticate(self, renewals, uid):
        """Renew the session, unless another request did since ours went (``renewals``: the count then).
        A user's that cannot be renewed stays, expired: EACCES until a renewal after their kinit, which
        keeps their handles."""
        async with self._renewing:
            conn = self.conn
            session = self.session if uid is None else self.sessions.get(uid)
            if self._renewals.get(uid, 0) != renewals or conn is None or session is None:
                return
            failing = "session expired, and renewing it failed: "
            if uid is not None:
                cache = await self._user_cache(uid, failing)
            elif self.target.cruid is not None:
                try:
                    cache = await trio.to_thread.run_sync(self._cruid_cache, failing)
                except ConnectionLost as e:
                    raise self._lost(conn, e.strerror) from None
            else:
                cache = None
            target = self.target if cache is None else self.user_target(cache)
            with cache or contextlib.nullcontext():
                try:
                    await self._blocking(conn, auth.reauthenticate, conn, session, target, self.target.host)
                except ConnectionLost:
                    raise
                except Exception as e:
                    why = failing + self._logon_failed(e, target).strerror
                    if uid is None:
                        raise self._lost(conn, why) from None
                    raise self._refuse(uid, why) from None
            self._renewals[uid] = renewals + 1
            whence = "" if cache is None else f" from {cache.found}"
            log.info("session on %s expired: renewed as %s%s", self.where, auth.who(target), whence)

    async def _call(self, share, messages, generation=None, uid=None, sent=None):
        """Send and wait, as call() says, once.

        ``generation``: the connection the request's handles (or resume key)
        came from; on any other it fails instead of naming something the new
        connection never issued.  Raises ConnectionLost when the connection
        breaks or the deadline passes before every response is in.  The caller
        checks the statuses.
        """
        conn, tid = await self.tree_id(share, uid)
        sid = (self.session if uid is None else self.sessions[uid]).session_id
        if generation is not None and generation != self.generation:
            raise ConnectionLost(f"reconnected to {self.where}; the handle is gone")
        timeout = IO_TIMEOUT
        deadline = trio.current_time() + timeout
        charge = sum(max(1, conn._calculate_credit_charge(m)) for m in messages)
        if self._window(conn) - self._reserved - SPARE_CREDITS < charge:
            with trio.CancelScope(deadline=deadline) as scope:
                await self._reserve(conn, charge)
            if scope.cancelled_caught:
                self._timed_out(conn, timeout)
        credit_request = self._credit_request(conn, charge)
        if sum(len(m) for m in messages) <= INLINE_SEND:
            arrivals, data = self._frame(conn, messages, sid, tid, credit_request)
            rest = self._sending(conn, conn.sender.try_now, data)
            if rest is not None:
                finish, holds_lock = rest
                await self._in_thread(conn, deadline, self._sending, conn, finish,
                                      limiter=self._finishing if holds_lock else None)
        else:
            self._reserved += charge  # until the worker has taken its message ids
            try:
                arrivals = await self._in_thread(conn, deadline, self._send_sync, conn, messages, sid, tid,
                                                credit_request)
            finally:
                self._reserved -= charge
        if sent is not None:
            sent.set()
            deadline = math.inf
        self._in_flight += charge
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                replies = [await a.wait() for a in arrivals]
        except BaseException:
            for a in arrivals:
                a.abandon()
            raise
        finally:
            self._in_flight -= charge
        if scope.cancelled_caught:
            self._timed_out(conn, timeout)
        results = []
        for reply in replies:
            if reply is None:
                raise self._lost(conn)
            conn.outstanding_requests.pop(reply.message_id, None)
            results.append((reply.status, reply.data))
        self._served = self.generation
        self._delay = 0
        return results

    async def _in_thread(self, conn, deadline, fn, *args, limiter=None):
        """``fn(*args)`` in a worker thread: a send, which must not stop half way, but within the deadline."""
        with trio.CancelScope(shield=True, deadline=deadline):
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=limiter)
        self._timed_out(conn, IO_TIMEOUT)  # the deadline passed

    def _timed_out(self, conn, timeout):
        self.guid = uuid.uuid4()  # not to the hung process again (see the module)
        raise self._lost(conn, f"did not answer in {timeout} s")

    def _frame(self, conn, messages, sid, tid, credit_request):
        """(An _Arrival for each message, the bytes that send them): GuardedConnection.frame, errors as ConnectionLost."""
        if sid not in conn.session_table:
            raise ConnectionLost(f"connection to {self.where} lost: no session")
        requests, data = self._sending(conn, conn.frame, messages, sid, tid, credit_request, len(messages) > 1,
                                       lambda request: _Arrival(self.token, conn, request, self._credits_arrived))
        return [r.response_event for r in requests], data

    def _send_sync(self, conn, messages, sid, tid, credit_request):
        """Frame and send in a worker thread (a large write: signing it takes milliseconds); the arrivals."""
        arrivals, data = self._frame(conn, messages, sid, tid, credit_request)
        self._sending(conn, conn.sender, data)
        return arrivals

    def _sending(self, conn, step, *args):
        """``step(*args)``, with smbprotocol's errors and the socket's as ConnectionLost."""
        try:
            return step(*args)
        except Exception as e:
            # smbprotocol raises here whatever killed its receive worker, malformed replies included.
            if not isinstance(e, (SMBException, OSError)) and e is not conn._t_exc:
                raise
            raise ConnectionLost(f"connection to {self.where} lost: {self.scrub(describe(e))}") from None

    @staticmethod
    def _window(conn):
        return conn.sequence_window["high"] - conn.sequence_window["low"]

    def _credit_request(self, conn, charge):
        """Ask back what this request spends, plus what brings the window up to CREDITS."""
        short = CREDITS - self._window(conn) - self._in_flight
        return min(charge + max(0, short), 8192)

    async def _reserve(self, conn, charge):
        while self._window(conn) - self._reserved - SPARE_CREDITS < charge:
            if self.conn is not conn or not conn.transport.connected:
                raise ConnectionLost(self._last_failure or f"connection to {self.where} lost")
            await self._credit_change.wait()

    def _credits_arrived(self):
        self._credit_change.set()
        self._credit_change = trio.Event()

    def _shutdown(self, conn):
        """Break a connection now: its sender and receiver threads see the socket die and return."""
        if self.conn is conn:
            self.conn = None
            self.trees = {}
            self.sessions = {}
        sock = getattr(conn.transport, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._credits_arrived()

    async def close(self):
        conn, self.conn = self.conn, None
        if conn is None:
            return
        with trio.move_on_after(5):
            # Logging off closes every handle on the server; the socket closes either way, whatever the
            # server answers (Samba 4.17 may refuse a tree disconnect: ACCESS_DENIED).
            try:
                await trio.to_thread.run_sync(conn.disconnect, True, 5, abandon_on_cancel=True)
            except Exception as e:
                log.debug("logging off %s: %s", self.where, self.scrub(describe(e)))
        self._shutdown(conn)


def _reason(e):
    cause = e.__cause__
    return getattr(cause, "strerror", None) or str(cause or e)


class _LogLimit:
    """Logs at most one line per LOG_INTERVAL; the next one says how many were held back.

    A server that drops every connection would otherwise write a line per
    attempt into syslog.
    """

    def __init__(self, level):
        self._level = level
        self._next = 0.0
        self._held = 0

    def __call__(self, message, *args):
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            message += " (%d more such messages held back)"
            args += (self._held,)
        log.log(self._level, message, *args)
        self._held = 0
        self._next = now + LOG_INTERVAL
