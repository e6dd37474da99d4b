"""_GuardedConnection's reply checks on replies built here.

The mountpoint tests (test_mp_hostile_smb) run them through a man in the
middle in front of Samba; a plaintext reply on an encrypted session cannot be
made that way (the proxy never sees the message id the encrypted request
carried), so these build the replies themselves.
"""
import uuid
from types import SimpleNamespace

import pytest

smbprotocol = pytest.importorskip("smbprotocol", reason="smbprotocol is not installed")
from smbprotocol.connection import Commands, Dialects  # noqa: E402
from smbprotocol.header import SMB2HeaderRequest, SMB2HeaderResponse, Smb2Flags  # noqa: E402

from offloadfs.backends.smb import client, errors  # noqa: E402

SESSION, MESSAGE, KEY = 7, 5, b"k" * 16


def connection(encrypt=False, sent=Commands.SMB2_READ):
    """A guarded connection (never connected) with one session and one request of command ``sent``."""
    conn = client._GuardedConnection(uuid.uuid4(), "127.0.0.1", 445)
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
    conn.verify_signature(reply(conn), SESSION)


@pytest.mark.parametrize("forge", ["unsigned flag", "altered data", "poses as session setup"])
def test_an_unsigned_or_altered_reply_is_refused(forge):
    conn = connection()
    if forge == "altered data":
        header = reply(conn)
        header["data"] = b"\x11\x00" + b"EVIL" * 8
    else:
        command = Commands.SMB2_SESSION_SETUP if forge == "poses as session setup" else Commands.SMB2_READ
        header = reply(conn, command=command, sign=False)
    with pytest.raises(client._Refused, match="signature does not match"):
        conn.verify_signature(header, SESSION)


def test_a_plaintext_reply_on_an_encrypted_session_is_refused():
    conn = connection(encrypt=True)
    with pytest.raises(client._Refused, match="unencrypted reply"):
        conn.verify_signature(reply(conn), SESSION)


def test_only_async_interim_replies_go_unverified():
    conn = connection()
    conn.verify_signature(reply(conn, status=errors.PENDING, flags=Smb2Flags.SMB2_FLAGS_ASYNC_COMMAND,
                                sign=False), SESSION)
    with pytest.raises(client._Refused):
        conn.verify_signature(reply(conn, status=errors.PENDING, sign=False), SESSION)


def test_a_frame_longer_than_the_server_may_send_is_refused_before_reading_it():
    conn = connection()
    conn.max_read_size = conn.max_write_size = conn.max_transact_size = 8 << 20
    reads = []

    def recv(n, timeout):
        reads.append(n)
        return b"\xff\xff\xff\xff", timeout

    conn.transport = SimpleNamespace(_recv=recv)
    with pytest.raises(client._Refused, match="over the 8454144-byte limit"):
        conn._recv_frame(600)
    assert reads == [4]
