"""GuardedConnection's framing of requests and replies, and its reply checks, on messages built here.

The mountpoint tests (test_mp_hostile_smb) run them through a man in the
middle in front of Samba; a plaintext reply on an encrypted session cannot be
made that way (the proxy never sees the message id the encrypted request
carried), so these build the replies themselves.
"""
import os
import socket
import threading
import uuid
from types import SimpleNamespace

import pytest

smbprotocol = pytest.importorskip("smbprotocol", reason="smbprotocol is not installed")
from smbprotocol.connection import Commands, Connection, Dialects, SigningAlgorithms  # noqa: E402
from smbprotocol.header import SMB2HeaderRequest, SMB2HeaderResponse, Smb2Flags  # noqa: E402

import test_smb_messages  # noqa: E402
from offloadfs.backends.smb import connection as smbconn, errors, messages as m  # noqa: E402

FID = bytes(range(16))

SESSION, MESSAGE, KEY = 7, 5, b"k" * 16


def connection(encrypt=False, sent=Commands.SMB2_READ):
    """A guarded connection (never connected) with one session and one request of command ``sent``."""
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    conn.dialect = Dialects.SMB_3_0_0  # AES-CMAC signatures
    conn.session_table[SESSION] = SimpleNamespace(signing_key=KEY, encrypt_data=encrypt)
    request = SMB2HeaderRequest()
    request["command"] = sent
    conn.outstanding_requests[MESSAGE] = SimpleNamespace(message=request)
    return conn


def reply(conn, command=Commands.SMB2_READ, status=errors.SUCCESS, flags=0, sign=True):
    header = SMB2HeaderResponse()
    header["command"] = command
    header["status"] = status
    header["message_id"] = MESSAGE
    header["session_id"] = SESSION
    header["flags"] = Smb2Flags.SMB2_FLAGS_SERVER_TO_REDIR | flags
    header["data"] = b"\x11\x00" + b"DATA" * 8
    if sign:
        header["flags"].set_flag(Smb2Flags.SMB2_FLAGS_SIGNED)
        header["signature"] = conn._generate_signature(header.pack(), KEY, MESSAGE, True, command)
    return header


def test_a_signed_reply_passes():
    conn = connection()
    conn._verify(reply(conn).pack(), SESSION)


@pytest.mark.parametrize("forge", ["unsigned flag", "altered data", "poses as session setup"])
def test_an_unsigned_or_altered_reply_is_refused(forge):
    conn = connection()
    if forge == "altered data":
        header = reply(conn)
        header["data"] = b"\x11\x00" + b"EVIL" * 8
    else:
        command = Commands.SMB2_SESSION_SETUP if forge == "poses as session setup" else Commands.SMB2_READ
        header = reply(conn, command=command, sign=False)
    with pytest.raises(smbconn._Refused, match="signature does not match"):
        conn._verify(header.pack(), SESSION)


def test_a_plaintext_reply_on_an_encrypted_session_is_refused():
    conn = connection(encrypt=True)
    with pytest.raises(smbconn._Refused, match="unencrypted reply"):
        conn._verify(reply(conn).pack(), SESSION)


def test_only_async_interim_replies_go_unverified():
    conn = connection()
    conn._verify(reply(conn, status=errors.PENDING, flags=Smb2Flags.SMB2_FLAGS_ASYNC_COMMAND, sign=False).pack(),
                 SESSION)
    with pytest.raises(smbconn._Refused):
        conn._verify(reply(conn, status=errors.PENDING, sign=False).pack(), SESSION)


@pytest.mark.parametrize("sent", [Commands.SMB2_ECHO, Commands.SMB2_OPLOCK_BREAK], ids=["echo", "lease-break-ack"])
@pytest.mark.parametrize("encrypt", [False, True], ids=["signing", "encrypting"])
def test_an_echo_or_a_break_ack_answered_unsigned_passes(encrypt, sent):
    """ksmbd answers an ECHO without looking its session up (not signed: flag clear, the request's
    signature copied back; not encrypted), and signs no reply to a lease break acknowledgment."""
    conn = connection(encrypt, sent=sent)
    header = reply(conn, command=sent, sign=False)
    header["signature"] = os.urandom(16)
    conn._verify(header.pack(), SESSION)


@pytest.mark.parametrize("command", [Commands.SMB2_ECHO, Commands.SMB2_READ])
def test_a_reply_that_says_it_is_signed_is_verified_even_to_an_echo(command):
    conn = connection(sent=Commands.SMB2_ECHO)
    header = reply(conn, command=command)
    header["signature"] = os.urandom(16)
    with pytest.raises(smbconn._Refused, match="signature does not match"):
        conn._verify(header.pack(), SESSION)


def ksmbd_signed(conn, header):
    """``header`` packed and signed as ksmbd signs an error reply to a READ: over the frame's 4-byte
    length and the message."""
    header["flags"].set_flag(Smb2Flags.SMB2_FLAGS_SIGNED)
    header["signature"] = b"\0" * 16
    b = header.pack()
    signature = conn._generate_signature(len(b).to_bytes(4, "big") + b, KEY, MESSAGE, True, header["command"])
    return b[:48] + signature + b[64:]


@pytest.mark.parametrize("sent,status,ok", [(Commands.SMB2_READ, errors.END_OF_FILE, True),
                                            (Commands.SMB2_READ, errors.SUCCESS, False),
                                            (Commands.SMB2_WRITE, errors.END_OF_FILE, False)],
                         ids=["read-error", "read-data", "write-error"])
def test_a_read_error_signed_over_its_length_too_passes(sent, status, ok):
    """ksmbd 6.12 signs an error reply to a READ over the frame's length and the message (it takes the
    iovec before the reply's for the READ's data); only there is that signature taken."""
    conn = connection(sent=sent)
    header = reply(conn, command=sent, status=status, sign=False)
    header["data"] = b"\x09\x00" + bytes(7)
    if ok:
        conn._verify(ksmbd_signed(conn, header), SESSION)
    else:
        with pytest.raises(smbconn._Refused, match="signature does not match"):
            conn._verify(ksmbd_signed(conn, header), SESSION)


def test_a_read_error_signed_over_its_length_is_still_checked():
    conn = connection()  # a READ sent
    header = reply(conn, status=errors.END_OF_FILE, sign=False)
    header["data"] = b"\x09\x00" + bytes(7)
    b = bytearray(ksmbd_signed(conn, header))
    b[-1] ^= 1
    with pytest.raises(smbconn._Refused, match="signature does not match"):
        conn._verify(bytes(b), SESSION)


def test_only_an_echo_or_a_break_ack_may_come_back_unsigned():
    conn = connection()  # a READ sent
    with pytest.raises(smbconn._Refused, match="signature does not match"):
        conn._verify(reply(conn, command=Commands.SMB2_ECHO, sign=False).pack(), SESSION)


def test_a_frame_longer_than_the_server_may_send_is_refused_before_reading_it():
    conn = connection()
    conn.max_read_size = conn.max_write_size = conn.max_transact_size = 8 << 20
    conn.transport = transport(b"\xff\xff\xff\xff" + b"the rest")
    with pytest.raises(smbconn._Refused, match="over the 8454144-byte limit"):
        conn._recv_frame(600)
    assert conn.transport._sock.recv(100) == b"the rest"  # not read


def transport(stream):
    """What the receive worker uses of smbprotocol's Tcp, on a socket that holds ``stream``, then ends."""
    ours, theirs = socket.socketpair()
    theirs.sendall(stream)
    theirs.close()
    return SimpleNamespace(_sock=ours, _close_lock=threading.Lock(), connected=True, close=ours.close, send=None)


# -- framing: requests as smbprotocol would send them, replies into Requests ------------------------------------

TREE = 3


def sending(conn, signing=True):
    """``conn`` with a session and tree to send on; the bytes it sends collect in the list returned."""
    sent = []
    conn.session_table[SESSION] = SimpleNamespace(
        signing_key=KEY, signing_required=signing, encrypt_data=False,
        tree_connect_table={TREE: SimpleNamespace(is_dfs_share=False, encrypt_data=False)})
    conn.supports_multi_credit = True
    conn.transport = SimpleNamespace(send=sent.append, connected=True)
    conn.sequence_window = {"low": 10, "high": 200}
    return sent


@pytest.mark.parametrize("signing", [True, False])
def test_requests_go_out_as_smbprotocol_sends_them(signing):
    from smbprotocol.open import SMB2CloseRequest, SMB2QueryInfoRequest, SMB2ReadRequest, SMB2WriteRequest
    ours = [m.create("d\\f", m.READ), m.query_info(18, m.RELATED, 65536), m.close()]
    reference = [test_smb_messages.reference_create("d\\f", m.READ, m.OPEN, 0, m.NO_OPLOCK, ()),
                 test_smb_messages.structure(SMB2QueryInfoRequest, info_type=1, file_info_class=18,
                                             output_buffer_length=65536, file_id=m.RELATED),
                 test_smb_messages.structure(SMB2CloseRequest, file_id=m.RELATED)]
    big = ([m.read(FID, 0, 1 << 20)], [test_smb_messages.structure(SMB2ReadRequest, length=1 << 20, file_id=FID,
                                                                   padding=0x50)])
    data = os.urandom(60_001)  # a WRITE's data framed from a view of a larger buffer, padded before the next
    written = ([m.write(FID, 5, memoryview(b"x" + data + b"y")[1:-1]), m.close()],
               [test_smb_messages.structure(SMB2WriteRequest, offset=5, file_id=FID, buffer=data),
                test_smb_messages.structure(SMB2CloseRequest, file_id=m.RELATED)])
    for compound, expected in ((ours, reference), big, written):
        conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
        conn.dialect = Dialects.SMB_3_0_0
        wire = sending(conn, signing)
        requests, data = conn.frame(compound, SESSION, TREE, 64, len(compound) > 1, lambda r: threading.Event())
        conn.sequence_window = {"low": 10, "high": 200}
        Connection._send(conn, expected, SESSION, TREE, credit_request=64, related=len(compound) > 1)
        assert data == wire[0]
        assert [r.message_id for r in requests] == list(range(10, 10 + len(compound)))


def test_a_request_beyond_the_credits_is_refused():
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    wire = sending(conn)
    conn.sequence_window = {"low": 10, "high": 20}
    with pytest.raises(smbprotocol.exceptions.SMBException, match="requires 16 credits"):
        conn.frame([m.read(FID, 0, 1 << 20)], SESSION, TREE, 1, False, lambda r: threading.Event())
    assert wire == [] and conn.outstanding_requests == {}


def signed_reply(conn, message_id, data, status=errors.SUCCESS, command=Commands.SMB2_READ, credits=1):
    header = SMB2HeaderResponse()
    header["command"] = command
    header["status"] = status
    header["message_id"] = message_id
    header["session_id"] = SESSION
    header["credit_response"] = credits
    header["flags"] = Smb2Flags.SMB2_FLAGS_SERVER_TO_REDIR | Smb2Flags.SMB2_FLAGS_SIGNED
    header["data"] = data
    header["signature"] = conn._generate_signature(header.pack(), KEY, message_id, True, command)
    return header.pack()


def receiving(conn, frames):
    """Run conn's receive worker over ``frames`` (each a whole SMB2 frame), then an orderly end of stream."""
    conn.transport = transport(b"".join(len(f).to_bytes(4, "big") + f for f in frames))
    conn.max_read_size = conn.max_write_size = conn.max_transact_size = 1 << 20
    conn._process_message_thread()


def sent_requests(conn, n):
    sending(conn)
    return conn.frame([m.read(FID, 0, 100) for _ in range(n)], SESSION, TREE, 1, False, lambda r: threading.Event())[0]


def test_a_compound_reply_reaches_each_request_with_its_credits():
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    conn.dialect = Dialects.SMB_3_0_0
    first, second = sent_requests(conn, 2)
    one = signed_reply(conn, 10, b"\x11\x00" + b"ONE." * 3)  # 78 bytes: padded to 80 in the compound
    one = one[:20] + (80).to_bytes(4, "little") + one[24:] + bytes(2)
    one = one[:48] + bytes(16) + one[64:]
    one = one[:48] + conn._generate_signature(one, KEY, 10, True, Commands.SMB2_READ) + one[64:]
    two = signed_reply(conn, 11, b"\x11\x00" + b"TWO." * 3, status=errors.END_OF_FILE, credits=5)
    receiving(conn, [one + two])
    assert conn._t_exc is None
    assert (first.response.status, bytes(first.response.data)) == (errors.SUCCESS, b"\x11\x00" + b"ONE." * 3 + bytes(2))
    assert (second.response.status, bytes(second.response.data)) == (errors.END_OF_FILE, b"\x11\x00" + b"TWO." * 3)
    assert conn.sequence_window["high"] == 200 + 1 + 5


@pytest.mark.parametrize("forge", ["altered", "unsigned", "past its end", "never sent"])
def test_a_bad_reply_ends_the_connection_and_reaches_no_request(forge):
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    conn.dialect = Dialects.SMB_3_0_0
    [request] = sent_requests(conn, 1)
    frame = signed_reply(conn, 99 if forge == "never sent" else 10, b"\x11\x00" + b"DATA" * 4)
    if forge == "altered":
        frame = frame[:-4] + b"EVIL"
    elif forge == "unsigned":
        flags = int.from_bytes(frame[16:20], "little") & ~Smb2Flags.SMB2_FLAGS_SIGNED
        frame = frame[:16] + flags.to_bytes(4, "little") + frame[20:48] + bytes(16) + frame[64:]
    elif forge == "past its end":
        frame = frame[:20] + (len(frame) + 8).to_bytes(4, "little") + frame[24:]
    receiving(conn, [frame])
    assert conn._t_exc is not None
    assert request.response is None


def test_a_send_the_socket_cannot_take_at_once_is_finished_whole_before_any_other():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ours = socket.create_connection(listener.getsockname())
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    server = listener.accept()[0]
    with listener, ours, server:
        transport = SimpleNamespace(_sock=ours, _sock_lock=threading.Lock(), MAX_SIZE=1 << 24)
        sender = smbconn.LeanSend(transport)
        big, small = os.urandom(1 << 20), b"next message"
        rest, holds_lock = sender.try_now(big)
        assert holds_lock and transport._sock_lock.locked()  # half sent, the rest still to go
        later, holds_lock = sender.try_now(small)  # meanwhile: must wait for the rest, not cut into it
        assert not holds_lock
        received = bytearray()
        reader = threading.Thread(target=lambda: received.extend(read_all(server, 4 + len(big) + 4 + len(small))))
        reader.start()
        rest()
        later()
        reader.join(10)
        assert bytes(received) == len(big).to_bytes(4, "big") + big + len(small).to_bytes(4, "big") + small
        assert sender.try_now(small) is None  # room again: sent at once
        assert read_all(server, 4 + len(small))[4:] == small


def read_all(sock, n):
    data = bytearray()
    while len(data) < n:
        data += sock.recv(n - len(data))
    return bytes(data)


@pytest.mark.parametrize("dialect, algorithm", [(Dialects.SMB_2_1_0, None), (Dialects.SMB_3_0_0, None),
                                                (Dialects.SMB_3_1_1, SigningAlgorithms.AES_GMAC),
                                                (Dialects.SMB_3_1_1, SigningAlgorithms.AES_CMAC)])
@pytest.mark.parametrize("command", [Commands.SMB2_READ, Commands.SMB2_CANCEL])
def test_a_signature_is_smbprotocols(dialect, algorithm, command):
    """Signatures are made in place (no copy of a 1 MiB message to zero its field): the same as
    smbprotocol's, for each algorithm, on requests and replies."""
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    conn.dialect, conn.signing_algorithm_id = dialect, algorithm
    msg = bytearray(os.urandom(200))
    msg[48:64] = bytes(16)
    for response in (False, True):
        assert conn.signature(memoryview(msg), KEY, 77, response, command) == \
            conn._generate_signature(bytes(msg), KEY, 77, response, command)


def test_a_reply_that_stops_coming_is_refused_and_an_idle_stream_times_out(monkeypatch):
    """Frames are received in place (_recv_into) with Tcp._recv's waits: nothing at all within the
    idle timeout is a TimeoutError (the worker echoes), half a frame that stops is refused."""
    conn = connection()
    conn.max_read_size = conn.max_write_size = conn.max_transact_size = 1 << 20
    ours, theirs = socket.socketpair()
    conn.transport = SimpleNamespace(_sock=ours, _close_lock=threading.Lock(), connected=True, close=ours.close)
    with pytest.raises(TimeoutError):
        conn._recv_frame(0.1)
    theirs.sendall((100).to_bytes(4, "big") + b"half")
    monkeypatch.setattr(smbconn, "CONNECT_TIMEOUT", 0.1)
    with pytest.raises(smbconn._Refused, match="did not come whole"):
        conn._recv_frame(0.1)
    theirs.close()


def test_a_stream_that_ends_within_a_frame_ends_the_worker_quietly():
    conn = connection()
    conn.max_read_size = conn.max_write_size = conn.max_transact_size = 1 << 20
    conn.transport = transport((100).to_bytes(4, "big") + b"half")
    assert conn._recv_frame(600) == b""


@pytest.mark.parametrize("first", [errors.NETWORK_SESSION_EXPIRED, errors.SUCCESS])
def test_only_replies_after_a_session_expired_in_their_compound_go_unverified(first):
    """Samba 4.17 signs the related replies after a STATUS_NETWORK_SESSION_EXPIRED wrong (seen at a
    multiuser user's ticket's end); the compound is sent again (or fails) after a re-authentication."""
    conn = smbconn.GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
    conn.dialect = Dialects.SMB_3_0_0
    create, query = sent_requests(conn, 2)
    one = signed_reply(conn, 10, bytes(8), status=first)
    one = one[:20] + (len(one)).to_bytes(4, "little") + one[24:]
    one = one[:48] + bytes(16) + one[64:]
    one = one[:48] + conn._generate_signature(one, KEY, 10, True, Commands.SMB2_READ) + one[64:]
    two = signed_reply(conn, 11, bytes(8), status=errors.INVALID_PARAMETER)
    flags = int.from_bytes(two[16:20], "little") | Smb2Flags.SMB2_FLAGS_RELATED_OPERATIONS
    two = two[:16] + flags.to_bytes(4, "little") + two[20:48] + b"wrong signature!" + two[64:]
    receiving(conn, [one + two])
    if first == errors.SUCCESS:
        assert conn._t_exc is not None and query.response is None
    else:
        assert conn._t_exc is None
        assert (create.response.status, query.response.status) == (first, errors.INVALID_PARAMETER)
