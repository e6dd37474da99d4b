"""One SMB connection and session driven from trio, shared by every share of one server and user.

smbprotocol's Connection sends from the calling thread and receives in its
own worker thread, which sets a threading.Event on each Request.  We send
from trio worker threads (packing and signing cost milliseconds of CPU per
MiB, and a send can wait for the socket) and swap each Request's event for an
``_Arrival`` that also wakes the waiting trio task, so any number of requests
are in flight without a thread each.  Credits are counted before each send
(smbprotocol refuses a send it has no credits for instead of waiting), and
every request has a deadline: a server that stops answering gets its
connection shut down, which fails what was in flight with EIO.

After a drop the next request reconnects.  Handles are then stale
(``generation`` tells the backend so): durable ones are reconnected, others
reopened by path.  Each connection has an oplocks.Listener for the oplock
breaks that durable handles bring.  Each has a client GUID of its own:
Samba hands a new connection with a known GUID to the process that served
the old one, which may be the hung one we left, and it does not ask for the
old GUID on a durable reconnect (MS-SMB2 servers that do refuse it; the
backend then reopens by path).
"""
import logging
import socket
import uuid

import trio
from smbprotocol.connection import Connection
from smbprotocol.exceptions import SMBException, SMBResponseException
from smbprotocol.session import Session
from smbprotocol.tree import TreeConnect

from . import errors, oplocks
from .errors import ConnectionLost, status_error

log = logging.getLogger(__name__)
# smbprotocol logs every message structure at DEBUG and each connect step at INFO, spnego
# the NTLM tokens: far too much for -o debug or syslog, and tokens have no place in logs.
for noisy in ("smbprotocol", "spnego"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

CONNECT_TIMEOUT = 15  # connecting and logging on; then each tree connect
IO_TIMEOUT = 60  # any one request
CREDITS = 4096  # what we ask the server for (Samba grants up to 8192)
SPARE_CREDITS = 8  # never spent: smbprotocol's own requests (tree connect, keepalive echo) need some
CREDIT_SIZE = 65536


class _Arrival:
    """Stands in for a Request's response event and wakes the trio task waiting for it.

    smbprotocol's worker thread calls set() under the request's lock for each
    response (an interim STATUS_PENDING, then the final one), and without it
    when the connection dies.  That is all it asks of the event, as we never
    call Connection.receive(); a threading.Event would cost more than a read.
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
        if self._abandoned and self._final():
            self._forget()

    def _final(self):
        r = self._request.response
        return r is not None and r["status"].get_value() != errors.PENDING

    def _forget(self):
        self._conn.outstanding_requests.pop(self._request.message["message_id"].get_value(), None)

    async def wait(self):
        """The final response header, or None if the connection died first."""
        while True:
            await self._event.wait()
            with self._request.response_event_lock:
                if self._final():
                    return self._request.response
                if self._request.response is None or not self._conn.transport.connected:
                    return None
                self._event = trio.Event()  # an interim response: the final one follows

    def abandon(self):
        """Nobody waits any more: drop the response from the connection's table when it comes."""
        self._abandoned = True
        if self._final():
            self._forget()


class Client:
    """A connection, a session and its tree connects; reconnects on demand."""

    _shared = {}  # (trio token, server, user, ...) -> Client

    def __init__(self, target, key):
        self.target = target
        self.key = key
        self.token = trio.lowlevel.current_trio_token()
        self.conn = None
        self.session = None
        self.oplocks = None  # the current connection's oplocks.Listener
        self.trees = {}  # share -> tree id on the current connection
        self.generation = 0  # bumped per connection: handles of older ones are gone
        self.io_size = CREDIT_SIZE  # largest READ/WRITE, set from the server's limits and our credits
        self.users = 0
        self._lock = trio.Lock()
        self._reserved = 0  # credits promised to sends under way
        self._in_flight = 0  # credits charged to requests not answered yet
        self._credit_change = trio.Event()
        self._failures = 0  # failed connection attempts, and why the last one failed
        self._last_failure = ""

    @classmethod
    def shared(cls, target):
        """The Client for this server, user and security; one per trio run."""
        t = target
        key = (trio.lowlevel.current_trio_token(), t.host, t.port, t.username, t.domain, t.password, t.dialect,
               t.seal)
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
        conn = Connection(uuid.uuid4(), self.target.host, self.target.port, require_signing=True)
        try:
            session = await self._blocking(conn, self._connect_sync, conn)
        except SMBException as e:
            self._shutdown(conn)
            raise ConnectionLost(f"{self.where}: {self.scrub(str(e))}") from None
        except BaseException:
            self._shutdown(conn)
            raise
        self.conn, self.session = conn, session
        self.generation += 1
        self.oplocks = oplocks.Listener(self, conn)
        self.io_size = min(conn.max_read_size, conn.max_write_size,
                           max(CREDIT_SIZE, self._window(conn) // 4 * CREDIT_SIZE))
        log.info("connected to %s as %s: dialect 0x%x, %d credits, %d-byte I/O", self.where,
                 self.target.username, conn.dialect, self._window(conn), self.io_size)

    def _connect_sync(self, conn):
        t = self.target
        try:
            conn.connect(dialect=t.dialect, timeout=CONNECT_TIMEOUT)
        except ValueError as e:  # smbprotocol's word for "socket connect failed"
            raise ConnectionLost(f"cannot connect to {self.where}: {_reason(e)}") from None
        conn.transport.send = _LeanSend(conn.transport)
        user = f"{t.domain}\\{t.username}" if t.domain else t.username
        session = Session(conn, user, t.password, require_encryption=t.seal, auth_protocol="ntlm")
        try:
            session.connect()
        except SMBResponseException as e:
            if e.status == errors.LOGON_FAILURE:
                raise status_error(e.status, what=f"logon failure for user {user} on {self.where}") from None
            raise status_error(e.status, what=f"session setup for user {user} on {self.where}") from None
        except SMBException as e:
            raise ConnectionLost(f"session setup for user {user} on {self.where}: {self.scrub(str(e))}") from None
        conn.echo(sid=session.session_id, timeout=CONNECT_TIMEOUT, credit_request=CREDITS)
        return session

    async def tree_id(self, share):
        """(connection, tree id) for ``share``, connecting both as needed."""
        conn = self.conn
        if conn is not None and conn.transport.connected and share in self.trees:
            return conn, self.trees[share]
        failures = self._failures
        async with self._lock:
            if self.conn is None or not self.conn.transport.connected:
                if self._failures != failures:
                    # It failed while we waited: say so now instead of queueing one more try.
                    raise ConnectionLost(self._last_failure)
                try:
                    await self._connect()
                except OSError as e:
                    self._failures += 1
                    self._last_failure = e.strerror
                    raise
            conn = self.conn
            if share not in self.trees:
                tree = TreeConnect(self.session, f"\\\\{self.target.host}\\{share}")
                try:
                    await self._blocking(conn, tree.connect)
                except SMBResponseException as e:
                    raise status_error(e.status, what=f"share {share} on {self.where}") from None
                except SMBException as e:
                    raise ConnectionLost(f"share {share} on {self.where}: {self.scrub(str(e))}") from None
                self.trees[share] = tree.tree_connect_id
            return conn, self.trees[share]

    async def _blocking(self, conn, fn, *args):
        """Run one of smbprotocol's blocking steps; past the deadline, shut the connection so it returns."""
        with trio.move_on_after(CONNECT_TIMEOUT) as scope:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        if scope.cancelled_caught:
            self._shutdown(conn)
            raise ConnectionLost(f"{self.where} did not answer in {CONNECT_TIMEOUT} s")

    def scrub(self, text):
        """Text from a library, with the password cut out should it ever appear."""
        password = self.target.password
        return text.replace(password, "********") if password else text

    # -- requests -------------------------------------------------------------------

    async def call(self, share, messages, generation=None):
        """Send one request, or a related compound of several; [(status, body)] in order.

        ``generation``: the connection the request's handles (or resume key)
        came from; on any other it fails instead of naming something the new
        connection never issued.  Raises ConnectionLost when the connection
        breaks or the deadline passes before every response is in.  The caller
        checks the statuses.
        """
        conn, tid = await self.tree_id(share)
        if generation is not None and generation != self.generation:
            raise ConnectionLost(f"reconnected to {self.where}; the handle is gone")
        timeout = IO_TIMEOUT
        deadline = trio.current_time() + timeout
        charge = sum(max(1, conn._calculate_credit_charge(m)) for m in messages)
        with trio.CancelScope(deadline=deadline) as scope:
            await self._reserve(conn, charge)
        if scope.cancelled_caught:
            self._timed_out(conn, timeout)
        # A half-sent message would break the connection: the send is not
        # interrupted, but the deadline still applies.
        with trio.CancelScope(shield=True, deadline=deadline) as scope:
            self._reserved += charge
            try:
                arrivals = await trio.to_thread.run_sync(
                    self._send_sync, conn, messages, tid, self._credit_request(conn, charge),
                    abandon_on_cancel=True)
            finally:
                self._reserved -= charge
        if scope.cancelled_caught:
            self._timed_out(conn, timeout)
        self._in_flight += charge
        try:
            with trio.CancelScope(deadline=deadline) as scope:
                headers = [await a.wait() for a in arrivals]
        except BaseException:
            for a in arrivals:
                a.abandon()
            raise
        finally:
            self._in_flight -= charge
        if scope.cancelled_caught:
            self._timed_out(conn, timeout)
        results = []
        for header in headers:
            if header is None:
                self._shutdown(conn)
                raise ConnectionLost(f"connection to {self.where} lost")
            conn.outstanding_requests.pop(header["message_id"].get_value(), None)
            results.append((header["status"].get_value(), header["data"].get_value()))
        return results

    def _timed_out(self, conn, timeout):
        self._shutdown(conn)
        raise ConnectionLost(f"{self.where} did not answer in {timeout} s")

    async def call1(self, share, message, generation=None, what=""):
        """One request whose failure is an error; its response body."""
        [(status, body)] = await self.call(share, [message], generation)
        if status != errors.SUCCESS:
            raise status_error(status, body, what)
        return body

    def _send_sync(self, conn, messages, tid, credit_request):
        try:
            sid = next(iter(conn.session_table))
            if len(messages) == 1:
                requests = [conn.send(messages[0], sid=sid, tid=tid, credit_request=credit_request)]
            else:
                requests = conn.send_compound(messages, sid, tid, related=True)
        except (SMBException, OSError, StopIteration) as e:
            raise ConnectionLost(f"connection to {self.where} lost: {self.scrub(str(e))}") from None
        arrivals = []
        for request in requests:
            with request.response_event_lock:
                arrival = _Arrival(self.token, conn, request, self._credits_arrived)
                if request.response_event.is_set():
                    arrival.set()
                request.response_event = arrival
            arrivals.append(arrival)
        return arrivals

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
                raise ConnectionLost(f"connection to {self.where} lost")
            await self._credit_change.wait()

    def _credits_arrived(self):
        self._credit_change.set()
        self._credit_change = trio.Event()

    def _shutdown(self, conn):
        """Break a connection now: its sender and receiver threads see the socket die and return."""
        if self.conn is conn:
            self.conn = None
            self.trees = {}
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
            # Logging off closes every handle on the server; the socket closes either way.
            await trio.to_thread.run_sync(conn.disconnect, True, 5, abandon_on_cancel=True)
        self._shutdown(conn)


class _LeanSend:
    """Replaces Tcp.send: the length prefix and the message go out in one sendmsg, with no copies.

    Tcp.send packs both into a new string and re-slices the rest after every
    partial send, several copies of each 8 MiB write.
    """

    def __init__(self, transport):
        self.transport = transport
        transport._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # whole messages only

    def __call__(self, data):
        t = self.transport
        if not isinstance(data, bytes):
            data = data.pack()  # an encrypted message comes as its transform header structure
        if len(data) > t.MAX_SIZE:
            raise ValueError(f"SMB message of {len(data)} bytes exceeds {t.MAX_SIZE}")
        buffers = [len(data).to_bytes(4, "big"), memoryview(data)]
        with t._sock_lock:
            while buffers:
                sent = t._sock.sendmsg(buffers)
                while buffers and sent >= len(buffers[0]):
                    sent -= len(buffers.pop(0))
                if sent:
                    buffers[0] = buffers[0][sent:]


def _reason(e):
    cause = e.__cause__
    return getattr(cause, "strerror", None) or str(cause or e)
