"""smbprotocol's Connection, with requests framed and replies parsed and verified here.

smbprotocol keeps negotiating and logging on.  After that it built a header
structure per request and parsed one per reply (an object per field), and
packed each reply again to check its signature: most of the daemon's CPU for
a metadata request.  Requests that messages.py packed go out, and every reply
comes in, through struct and the bytes as received instead; smbprotocol's own
requests (negotiate, logon, tree connect, echo, logoff) keep its structures,
and so do their replies.
"""
import functools
import hashlib
import hmac
import logging
import select
import socket
import struct
import threading
import time

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import cmac
from cryptography.hazmat.primitives.ciphers import aead, algorithms
from smbprotocol import Dialects
from smbprotocol.connection import Commands, Connection, SigningAlgorithms, SMB2Echo, SMB2TransformHeader
from smbprotocol.exceptions import SMBConnectionClosed, SMBException
from smbprotocol.header import SMB2HeaderResponse, Smb2Flags
from smbprotocol.transport import Tcp

from . import errors, leases, messages, posix

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 15  # connecting and logging on; then each tree connect
MIN_IO_SIZE = 65536  # the least a server may offer as its largest read, write or transaction
# A reply frame may hold the largest read the server allows plus headers: its SMB2 header and
# response, the other replies of a compound (a create and a close), a transform header.
FRAME_OVERHEAD = 65536

# 2.2.1.2: protocol, size, credit charge, channel sequence, reserved, command, credits asked, flags, next
# command, message id, process id, tree id, session id, signature.
REQUEST = struct.Struct("<4sHHHHHHIIQIIQ16s")
# A reply: status where the request has channel sequence and reserved; tree id or async id (8 bytes).
REPLY = struct.Struct("<4sHHIHHIIQQQ16s")
HEADER_SIZE = 64
PROTOCOL = b"\xfeSMB"
ENCRYPTED = b"\xfdSMB"
SIGNED = Smb2Flags.SMB2_FLAGS_SIGNED
RELATED = Smb2Flags.SMB2_FLAGS_RELATED_OPERATIONS
DFS = Smb2Flags.SMB2_FLAGS_DFS_OPERATIONS
ASYNC = Smb2Flags.SMB2_FLAGS_ASYNC_COMMAND  # on interim replies (MS-SMB2 3.3.4.2)
FROM_SERVER = Smb2Flags.SMB2_FLAGS_SERVER_TO_REDIR
NO_SIGNATURE = bytes(16)
GMAC_NONCE = struct.Struct("<QI")  # 3.1.4.1: the message id, then whether a reply (1) or a cancel (2)


class Sent:
    """A request messages.py packed, in the table of requests awaiting replies: what smbprotocol's Request
    holds that the receive worker and Client use, without the header structure, thread Event and clock
    reading that each Request costs."""
    __slots__ = ("command", "message_id", "session_id", "response", "response_event", "response_event_lock")

    def __init__(self, command, message_id, session_id):
        self.command = command
        self.message_id = message_id
        self.session_id = session_id
        self.response = None
        self.response_event = None
        self.response_event_lock = threading.Lock()


class Reply:
    """A reply to a request messages.py packed: what Client.call hands back.  ``data``: all after the header."""
    __slots__ = ("status", "message_id", "data")

    def __init__(self, status, message_id, data):
        self.status = status
        self.message_id = message_id
        self.data = data


class LeanSend:
    """Replaces Tcp.send: the length prefix and the message go out in one sendmsg, with no copies.

    Tcp.send packs both into a new string and re-slices the rest after every
    partial send, several copies of each 8 MiB write.  ``try_now`` sends from
    the trio thread what the socket takes without waiting: a small request
    then costs no hand-off to a worker thread and back.
    """

    def __init__(self, transport):
        self.transport = transport
        transport._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # whole messages only

    def __call__(self, data):
        with self.transport._sock_lock:
            self._push(self._buffers(data))

    def try_now(self, data):
        """Send ``data`` if the socket takes it at once: None, else (what finishes the send, to run in a
        thread; True if it holds the socket's lock until then).

        A message half sent holds the socket's lock until that finishes it:
        nothing else may go out between its two halves.  Its thread must not
        wait for a place behind threads that wait for the lock (Client gives it
        a limiter of its own): they would wait for each other for ever.
        """
        lock = self.transport._sock_lock
        if not lock.acquire(blocking=False):
            return functools.partial(self, data), False
        try:
            buffers = self._buffers(data)
            try:
                self._push(buffers, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        except BaseException:
            lock.release()
            raise
        if not buffers:
            lock.release()
            return None
        return functools.partial(self._finish, buffers), True

    def _finish(self, buffers):
        try:
            self._push(buffers)
        finally:
            self.transport._sock_lock.release()

    def _buffers(self, data):
        if not isinstance(data, (bytes, bytearray)):
            data = data.pack()  # an encrypted message comes as its transform header structure
        if len(data) > self.transport.MAX_SIZE:
            raise ValueError(f"SMB message of {len(data)} bytes exceeds {self.transport.MAX_SIZE}")
        return [len(data).to_bytes(4, "big"), memoryview(data)]

    def _push(self, buffers, flags=0):
        """Send ``buffers``, taking off each what went; with MSG_DONTWAIT, BlockingIOError once the socket is full."""
        sock = self.transport._sock
        while buffers:
            sent = sock.sendmsg(buffers, (), flags)
            while buffers and sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            if sent:
                buffers[0] = buffers[0][sent:]


class _Refused(SMBException):
    """A reply the guarded connection will not take; its text says why, in words for the log."""


# What we send that ksmbd answers unsigned (GuardedConnection).
UNSIGNED_BY_KSMBD = (Commands.SMB2_ECHO, Commands.SMB2_OPLOCK_BREAK)


class GuardedConnection(Connection):
    """smbprotocol's Connection with the checks a man in the middle must not get past.

    smbprotocol verified a reply only if the reply said it was signed, so
    clearing SMB2_FLAGS_SIGNED let forged data through; and it accepted a
    plaintext reply on a session that encrypts.  MS-SMB2 3.2.5.1.3: once a
    session signs, every reply is verified except interim STATUS_PENDING ones
    (async; they carry no result) and oplock/lease breaks (message id all ones, session 0: leases.Listener
    takes lease breaks; a forged one only makes us drop a cache and give a lease up).  ksmbd (Linux
    6.1 to 6.12) answers an ECHO without looking up its session: neither signed (flag clear, the
    request's signature copied back) nor encrypted; and it signs no reply to a lease break
    acknowledgment.  So a reply to either that does not say it is signed passes: an echo's carries
    no data, an acknowledgment's is not read (leases.Listener), and both carry credits, which the
    server polices itself.  ksmbd 6.12 signs an error reply to a READ over the frame's 4-byte length
    and the message (for a READ it signs the last two iovecs, header and data; an error reply is one,
    the length before it): such a reply is verified that way too, as the message alone does not pass.  Which request a
    reply answers is taken from the request we sent, never from the reply, so
    a reply that poses as a SESSION_SETUP one is verified too.  Decrypted
    replies were authenticated by AES-GCM/CCM and pass.

    A compound sent on an expired session (a user's under multiuser, or the mount's) comes back with
    STATUS_NETWORK_SESSION_EXPIRED in its first reply, signed, and Samba 4.17 signs the related replies
    after it wrong: those pass unverified.  Client.call sends the whole compound again after
    re-authenticating, or fails it, so nothing they say is ever used.

    The length in front of each reply is not covered by any signature:
    smbprotocol allocated whatever it said (0xFFFFFFFF: 4 GiB).  Frames over
    what the server may send are refused before anything is allocated.
    """

    want_posix = False  # ask for SMB 3.1.1 POSIX extensions (posix.py); ``posix``: whether the server offers them
    posix = False

    def send(self, message, *args, **kwargs):
        """smbprotocol's send, with the POSIX negotiate context added to its 3.1.1 NEGOTIATE where wanted."""
        negotiate = message.COMMAND == Commands.SMB2_NEGOTIATE and "negotiate_context_list" in message.fields
        if self.want_posix and negotiate:
            message = messages.Request(Commands.SMB2_NEGOTIATE, posix.with_negotiate_context(message.pack()))
        return super().send(message, *args, **kwargs)

    def _calculate_credit_charge(self, message):
        """smbprotocol's charge, for the requests messages.py packs (3.2.4.1.5)."""
        if not isinstance(message, messages.Request):
            return super()._calculate_credit_charge(message)
        if not self.supports_multi_credit:
            return 0
        return (max(0, message.payload - 1) >> 16) + 1

    # -- framing ------------------------------------------------------------------

    def frame(self, msgs, session_id, tree_id, credit_request, related, event_for):
        """(Requests, the bytes to send) for requests messages.py packed: message ids taken, signed, sealed.

        ``event_for(request)``: what the receive worker sets when the reply comes or the connection dies; in
        place before the request is in the table, where the worker may find it at once.

        What smbprotocol's _send does up to the send itself, which is the
        caller's (Client.call: at once from the trio thread when it can).
        """
        self._check_worker_running()
        session = self.session_table[session_id]
        tree = session.tree_connect_table.get(tree_id)
        if tree is None:
            raise SMBException(f"Cannot find Tree with the ID {tree_id} in the session tree table")
        flags = (SIGNED if session.signing_required and session.signing_key else 0) | \
            (DFS if tree.is_dfs_share else 0)
        frames, requests = [], []
        for i, message in enumerate(msgs):
            size = len(message)
            last = i == len(msgs) - 1
            padding = b"" if last else bytes(-(HEADER_SIZE + size) % 8)  # each starts on 8 bytes
            charge = self._calculate_credit_charge(message)
            with self.sequence_lock:
                window = self.sequence_window
                if charge > window["high"] - window["low"]:
                    raise SMBException(f"Request requires {charge} credits but only "
                                       f"{window['high'] - window['low']} credits are available")
                mid = window["low"]
                window["low"] += max(charge, 1)
            header = REQUEST.pack(PROTOCOL, HEADER_SIZE, charge, 0, 0, message.COMMAND, credit_request or charge,
                                  flags | (RELATED if i and related else 0),
                                  0 if last else HEADER_SIZE + size + len(padding), mid, 0, tree_id, session_id,
                                  NO_SIGNATURE)
            frame = bytearray().join((header, message.body, message.data, padding))
            if flags & SIGNED:
                frame[48:64] = self.signature(frame, session.signing_key, mid, False, message.COMMAND)
            frames.append(frame)
            request = Sent(message.COMMAND, mid, session_id)
            request.response_event = event_for(request)
            self.outstanding_requests[mid] = request
            requests.append(request)
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        if session.encrypt_data or tree.encrypt_data:
            data = self._encrypt(bytes(data), session)
        return requests, data

    # -- receiving ----------------------------------------------------------------

    def _process_message_thread(self):
        """smbprotocol's receive worker, on the bytes of each reply.  Whatever goes wrong ends the connection."""
        try:
            while True:
                try:
                    frame = self._recv_frame(self._receive_timeout)
                except TimeoutError as e:
                    self._keep_alive(e)
                    continue
                if not frame:
                    return
                encrypted = frame[:4] == ENCRYPTED
                if encrypted:
                    transform = SMB2TransformHeader()
                    transform.unpack(bytes(frame))
                    frame = self._decrypt(transform)
                frame = memoryview(frame)  # each message in place: a READ's data goes on as a view of it
                start, expired = 0, False
                while True:
                    if len(frame) - start < HEADER_SIZE:
                        raise _Refused(f"a {len(frame) - start}-byte reply, shorter than an SMB2 header")
                    _, _, _, status, _, _, flags, next_command, *_ = REPLY.unpack_from(frame, start)
                    end = start + next_command if next_command else len(frame)
                    if next_command and (next_command < HEADER_SIZE or end > len(frame)):
                        raise _Refused(f"a compound reply whose next message is at {next_command}, past its end")
                    self._arrived(frame[start:end], encrypted, expired and bool(flags & RELATED))
                    expired = expired or status == errors.NETWORK_SESSION_EXPIRED
                    if not next_command:
                        break
                    start = end
        except Exception as e:
            self._t_exc = e
            self.disconnect(False)
        finally:
            for request in tuple(self.outstanding_requests.values()):
                request.response_event.set()

    def _keep_alive(self, idle):
        """Nothing came for a while: echo, as smbprotocol does; an echo unanswered since the last time ends it."""
        for r in self.outstanding_requests.values():
            if r.response is None and not isinstance(r, Sent) and \
                    r.message["command"].get_value() == Commands.SMB2_ECHO and r.message["reserved"].get_value() == 1:
                raise SMBConnectionClosed("Connection timed out. Server did not respond within timeout.") from idle
        for sid in tuple(self.session_table):
            self.send(SMB2Echo(), sid=sid).message["reserved"] = 1  # marks it as our keep-alive

    def _arrived(self, b, encrypted, unverified=False):
        """One reply, ``b`` from its header to the next one's: checked (unless ``unverified``: see the class),
        its credits counted, handed to its Request."""
        protocol, _, _, status, command, credits, flags, _, mid, _, session_id, _ = REPLY.unpack_from(b)
        if protocol != PROTOCOL:
            raise _Refused("a reply that is not SMB2")
        request = self.outstanding_requests[mid]
        ours = isinstance(request, Sent)
        sent = _command(request)
        if sent != Commands.SMB2_SESSION_SETUP:
            session_id = request.session_id  # 3.2.5.1.2: the session of the request, not what the reply says
        if not encrypted and not unverified:
            self._verify(b, session_id)
        if credits == 0 and not self.supports_multi_credit:
            credits = 1  # the window moves all the same
        with self.sequence_lock:
            self.sequence_window["high"] += credits
        if ours:
            # A READ's body stays a view of the frame, its data handed on without a copy.
            response = Reply(status, mid, b[HEADER_SIZE:] if command == Commands.SMB2_READ else bytes(b[HEADER_SIZE:]))
        else:
            b = bytes(b)
            if sent == Commands.SMB2_NEGOTIATE:
                self.preauth_integrity_hash_value.append(b)  # as it came, with any POSIX context
                if self.want_posix and status == errors.SUCCESS:
                    self.posix, body = posix.split_negotiate_reply(b[HEADER_SIZE:])
                    b = b[:HEADER_SIZE] + body
            response = SMB2HeaderResponse()
            response.unpack(b)
            if sent == Commands.SMB2_SESSION_SETUP and status == errors.MORE_PROCESSING_REQUIRED:
                self.preauth_integrity_session_hash_value[mid].append(b)
            elif sent == Commands.SMB2_SESSION_SETUP and status == errors.SUCCESS:
                self.logon_reply = response  # for Client._connect_sync to verify once the session has keys
        with request.response_event_lock:
            if flags & ASYNC and not ours:
                request.async_id = b[32:40]  # smbprotocol's receive() waits on it; we never cancel ours
            request.response = response
            request.response_event.set()
            if not ours and request.message["reserved"].get_value() == 1:
                self.outstanding_requests.pop(mid, None)  # a keep-alive echo

    def _verify(self, b, session_id):
        """Check reply ``b`` (a whole message of its frame, as it came) as the class docstring says."""
        _, _, _, status, command, _, flags, _, mid, _, _, signature = REPLY.unpack_from(b)
        if status == errors.PENDING and flags & ASYNC:
            return
        if mid == leases.UNSOLICITED:
            if command != Commands.SMB2_OPLOCK_BREAK:
                raise _Refused("an unsolicited message that is not an oplock break")
            return
        request = self.outstanding_requests.get(mid)
        sent = None if request is None else _command(request)
        if sent in (Commands.SMB2_NEGOTIATE, Commands.SMB2_SESSION_SETUP) and (
                not flags & SIGNED or status == errors.PENDING or command == Commands.SMB2_SESSION_SETUP):
            return  # before the session has keys; a logon's last reply is checked once it has (verify_logon)
        if sent in UNSIGNED_BY_KSMBD and not flags & SIGNED:
            return  # see the class docstring
        session = self.session_table.get(session_id)
        if session is None or session.signing_key is None:
            raise _Refused(f"a reply for session {session_id}, which has no keys")
        if session.encrypt_data:
            raise _Refused("an unencrypted reply on an encrypted session")
        if not isinstance(b, memoryview) or b.readonly:
            b = memoryview(bytearray(b))
        b[48:64] = NO_SIGNATURE  # signed as sent: with its signature zero
        expected = self.signature(b, session.signing_key, mid, bool(flags & FROM_SERVER), command)
        if sent == Commands.SMB2_READ and status != errors.SUCCESS and not hmac.compare_digest(expected, signature):
            # ksmbd's (see the class docstring): a small reply, one copy
            framed = memoryview(len(b).to_bytes(4, "big") + bytes(b))
            expected = self.signature(framed, session.signing_key, mid, bool(flags & FROM_SERVER), command)
        b[48:64] = signature
        if not hmac.compare_digest(expected, signature):
            raise _Refused("a reply whose signature does not match (altered on the way)")

    def signature(self, msg, key, mid, response, command):
        """smbprotocol's _generate_signature of ``msg`` (its signature field zero), without copying
        it twice to zero the field; AES-GMAC keeps its key schedule per key."""
        if self.dialect >= Dialects.SMB_3_1_1 and self.signing_algorithm_id is not None:
            algorithm = self.signing_algorithm_id
        elif self.dialect >= Dialects.SMB_3_0_0:
            algorithm = SigningAlgorithms.AES_CMAC
        else:
            algorithm = SigningAlgorithms.HMAC_SHA256
        if algorithm == SigningAlgorithms.AES_GMAC:
            info = (1 if response else 0) | (2 if command == Commands.SMB2_CANCEL else 0)
            return _gmac(key).encrypt(GMAC_NONCE.pack(mid, info), b"", msg)
        if algorithm == SigningAlgorithms.AES_CMAC:
            mac = cmac.CMAC(algorithms.AES(key))
            mac.update(msg)
            return mac.finalize()
        return hmac.new(key, msg, hashlib.sha256).digest()[:16]

    def verify_logon(self, session):
        """Verify the final SESSION_SETUP reply of a session that encrypts.

        smbprotocol verifies it only on a session that signs; its signature is
        what vouches for the unsigned negotiate and setup replies before it.
        """
        try:
            super().verify_signature(self.logon_reply, session.session_id, force=True)
        except SMBException:
            raise _Refused("a logon reply whose signature does not match (altered on the way)") from None

    def _recv_frame(self, timeout):
        """Tcp.recv, refusing a frame larger than the server may send before reading it.

        Once its length is in, a frame must come whole within CONNECT_TIMEOUT
        (or keep coming: after that smbprotocol waits a second per piece).  A
        length that claims more than the server sent would otherwise hold
        every reply behind it for IO_TIMEOUT, and a TimeoutError would make
        smbprotocol's worker carry on in the middle of a frame.
        """
        length = bytearray(4)
        if not self._recv_into(memoryview(length), timeout):
            return b""
        size = int.from_bytes(length, "big")
        limit = self.frame_limit()
        if size > limit:
            raise _Refused(f"a {size}-byte reply, over the {limit}-byte limit")
        frame = bytearray(size)
        try:
            if not self._recv_into(memoryview(frame), CONNECT_TIMEOUT):
                return b""
        except TimeoutError as e:
            raise _Refused(f"a {size}-byte reply that did not come whole in {CONNECT_TIMEOUT} s ({e})") from None
        return frame

    def _recv_into(self, view, timeout):
        """Fill ``view`` from the socket as Tcp._recv would (waiting at least a second for each
        piece, ``timeout`` in all; False once the stream has ended), but in place: Tcp._recv
        received each piece, copied it into a buffer and the buffer into bytes, which with the
        signature's two copies cost the receiving thread a fifth of the daemon's CPU on reads."""
        transport = self.transport
        sock = transport._sock
        got, deadline = 0, time.monotonic() + timeout
        while got < len(view):
            with transport._close_lock:
                if not transport.connected:
                    return False
                try:
                    n = sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if not select.select([sock], [], [], max(left, 1))[0]:
                        raise TimeoutError(f"recv idle for {timeout - left:.1f}s ({got}/{len(view)} bytes)") from None
                    continue
                except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
                    n = 0  # as Tcp._recv: the peer went away, an end of stream
            if n == 0:
                transport.close()
                return False
            got += n
        return True

    def frame_limit(self):
        """The largest reply frame the server may send: 2.1 allows 24 bits of length."""
        sizes = (self.max_read_size, self.max_write_size, self.max_transact_size)
        if None in sizes:
            return MIN_IO_SIZE + FRAME_OVERHEAD  # negotiate and session setup replies are small
        return min(Tcp.MAX_SIZE, max(sizes) + FRAME_OVERHEAD)


@functools.lru_cache(maxsize=8)
def _gmac(key):
    return aead.AESGCM(key)


def _command(request):
    """The command a Request (or leases.Listener) went out with."""
    return request.command if isinstance(request, Sent) else request.message["command"].get_value()


def describe(e):
    """What a failure inside smbprotocol says about the server's replies, in one line."""
    if isinstance(e, InvalidTag):
        return "a reply that fails decryption (altered on the way)"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, KeyError):
        return f"a reply to a request never sent (message id {e})"
    if isinstance(e, SMBException):
        return str(e)
    return f"a malformed reply ({type(e).__name__}: {e})"


