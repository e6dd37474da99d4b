"""The requests messages.py packs are byte for byte the ones smbprotocol's request structures pack."""
import uuid

import pytest
from smbprotocol.file_info import InfoType
from smbprotocol.ioctl import IOCTLFlags, SMB2IOCTLRequest
from smbprotocol.open import (
    ImpersonationLevel,
    SMB2CloseRequest,
    SMB2CreateRequest,
    SMB2FlushRequest,
    SMB2QueryDirectoryRequest,
    SMB2QueryInfoRequest,
    SMB2ReadRequest,
    SMB2SetInfoRequest,
    SMB2WriteRequest,
)
from smbprotocol.create_contexts import (
    SMB2CreateContextRequest,
    SMB2CreateDurableHandleReconnectV2,
    SMB2CreateDurableHandleRequestV2,
    SMB2CreateRequestLease,
    SMB2CreateRequestLeaseV2,
)

from offloadfs.backends.smb import info, messages as m
from offloadfs.backends.smb.connection import GuardedConnection

FID = bytes(range(16))


def structure(cls, **fields):
    s = cls()
    for name, value in fields.items():
        s[name] = value
    return s


def reference_create(path, access, disposition, options, oplock, contexts):
    s = structure(SMB2CreateRequest, requested_oplock_level=oplock,
                  impersonation_level=ImpersonationLevel.Impersonation, desired_access=access, file_attributes=0,
                  share_access=m.SHARE_ALL, create_disposition=disposition, create_options=options,
                  buffer_path=path.encode("utf-16-le") if path else b"\0\0")
    if contexts:
        s["buffer_contexts"] = SMB2CreateContextRequest.pack_multiple(list(contexts))
    return s


GUID = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
KEY = bytes(range(100, 116))
RH = m.LEASE_READ | m.LEASE_HANDLE


def reference_contexts(which):
    """smbprotocol's create contexts: none, a durable request, a durable reconnect, or those with a lease."""
    durable = structure(SMB2CreateDurableHandleRequestV2, create_guid=GUID, timeout=60_000)
    reconnect = structure(SMB2CreateDurableHandleReconnectV2, file_id=FID, create_guid=GUID)
    lease = structure(SMB2CreateRequestLease, lease_key=KEY, lease_state=RH)
    lease_v2 = structure(SMB2CreateRequestLeaseV2, lease_key=KEY, lease_state=RH, parent_lease_key=bytes(16),
                         epoch=b"\0\0")
    return {"none": [], "durable": [durable], "reconnect": [reconnect], "both": [reconnect, durable],
            "lease": [lease], "durable+lease": [durable, lease], "durable+lease2": [durable, lease_v2],
            "reconnect+lease2": [reconnect, lease_v2]}[which]


@pytest.mark.parametrize("path", ["", "a", "dir\\file.txt", "x" * 300])
@pytest.mark.parametrize("which", ["none", "durable", "reconnect", "both", "lease", "durable+lease", "durable+lease2",
                                   "reconnect+lease2"])
def test_create(path, which):
    contexts = {"none": [], "durable": [m.durable(GUID)], "reconnect": [m.durable_reconnect(FID, GUID)],
                "both": [m.durable_reconnect(FID, GUID), m.durable(GUID)], "lease": [m.lease(KEY, RH, False)],
                "durable+lease": [m.durable(GUID), m.lease(KEY, RH, False)],
                "durable+lease2": [m.durable(GUID), m.lease(KEY, RH, True)],
                "reconnect+lease2": [m.durable_reconnect(FID, GUID), m.lease(KEY, RH, True)]}[which]
    ours = m.create(path, m.READ | m.DELETE, m.OPEN_IF, m.NON_DIRECTORY_FILE, oplock=m.LEASE, contexts=contexts)
    ref = reference_create(path, m.READ | m.DELETE, m.OPEN_IF, m.NON_DIRECTORY_FILE, m.LEASE,
                           reference_contexts(which))
    assert ours.pack() == ref.pack()
    assert ours.COMMAND == ref.COMMAND and len(ours) == len(ref)


def test_close_and_flush():
    assert m.close(FID).pack() == structure(SMB2CloseRequest, file_id=FID).pack()
    assert m.close().pack() == structure(SMB2CloseRequest, file_id=m.RELATED).pack()
    assert m.flush(FID).pack() == structure(SMB2FlushRequest, file_id=FID).pack()


def test_read_and_write():
    ref = structure(SMB2ReadRequest, length=1 << 20, offset=5 << 30, file_id=FID, padding=0x50)
    assert m.read(FID, 5 << 30, 1 << 20).pack() == ref.pack()
    data = bytes(range(256)) * 9
    ref = structure(SMB2WriteRequest, offset=12345, file_id=FID, buffer=data)
    assert m.write(FID, 12345, data).pack() == ref.pack()
    assert m.write(FID, 0, memoryview(data)).pack() == structure(SMB2WriteRequest, file_id=FID, buffer=data).pack()


@pytest.mark.parametrize("input", [b"", b"\x01\x02\x03\x04ea-name\0"])
def test_query_info(input):
    ref = structure(SMB2QueryInfoRequest, info_type=InfoType.SMB2_0_INFO_FILE, file_info_class=info.FILE_FULL_EA,
                    output_buffer_length=4096, buffer=input, flags=m.RESTART_SCAN, file_id=FID)
    assert m.query_info(info.FILE_FULL_EA, FID, 4096, input=input, flags=m.RESTART_SCAN).pack() == ref.pack()
    ref = structure(SMB2QueryInfoRequest, info_type=InfoType.SMB2_0_INFO_FILESYSTEM,
                    file_info_class=info.FS_FULL_SIZE, output_buffer_length=4096, file_id=m.RELATED)
    assert m.query_fs_info(info.FS_FULL_SIZE).pack() == ref.pack()


def test_set_info():
    buffer = info.FileEndOfFileInformation(1 << 40).pack()
    ref = structure(SMB2SetInfoRequest, info_type=InfoType.SMB2_0_INFO_FILE, file_info_class=info.FILE_END_OF_FILE,
                    buffer=buffer, file_id=FID)
    assert m.set_info(info.FILE_END_OF_FILE, buffer, FID).pack() == ref.pack()


def test_query_directory():
    ref = structure(SMB2QueryDirectoryRequest, file_information_class=info.FILE_ID_BOTH_DIRECTORY,
                    flags=m.RESTART_SCAN, file_id=FID, output_buffer_length=1 << 20, buffer="*".encode("utf-16-le"))
    assert m.query_directory(FID, info.FILE_ID_BOTH_DIRECTORY, m.RESTART_SCAN, 1 << 20).pack() == ref.pack()


@pytest.mark.parametrize("input, out", [(b"", 0), (b"", 32), (bytes(24), 12)])
def test_ioctl(input, out):
    ref = SMB2IOCTLRequest()
    ref["ctl_code"].enum_strict = False
    for name, value in dict(ctl_code=0x00098344, file_id=FID, buffer=input, max_output_response=out,
                            flags=IOCTLFlags.SMB2_0_IOCTL_IS_FSCTL).items():
        ref[name] = value
    assert m.ioctl(FID, 0x00098344, input, out).pack() == ref.pack()


def test_credit_charges_are_smbprotocols():
    conn = GuardedConnection.__new__(GuardedConnection)
    conn.supports_multi_credit = True
    cases = [
        (m.read(FID, 0, 1 << 20), structure(SMB2ReadRequest, length=1 << 20, file_id=FID)),
        (m.read(FID, 0, 100), structure(SMB2ReadRequest, length=100, file_id=FID)),
        (m.write(FID, 0, bytes(65537)), structure(SMB2WriteRequest, file_id=FID, buffer=bytes(65537))),
        (m.query_directory(FID, 37, 0, 1 << 20), structure(SMB2QueryDirectoryRequest, file_id=FID,
                                                             output_buffer_length=1 << 20, buffer=b"*\0")),
        (m.close(FID), structure(SMB2CloseRequest, file_id=FID)),
        (m.query_info(info.FILE_ALL, FID, 65536), structure(SMB2QueryInfoRequest, output_buffer_length=65536)),
    ]
    for ours, ref in cases:
        assert conn._calculate_credit_charge(ours) == conn._calculate_credit_charge(ref), m.command(ours)
    conn.supports_multi_credit = False
    assert conn._calculate_credit_charge(m.read(FID, 0, 1 << 20)) == 0


def test_credit_charge_of_a_query_counts_what_it_sends_and_what_it_asks_back():
    """ksmbd (smb2misc.c) wants the charge of a QUERY_INFO to cover its input and output lengths summed,
    and refuses the whole compound when it falls short: a named EA query asking 64 KiB back needs 2."""
    conn = GuardedConnection.__new__(GuardedConnection)
    conn.supports_multi_credit = True
    named = m.query_info(info.FILE_FULL_EA, FID, 65536, input=info.GetEa(b"a").pack())
    assert conn._calculate_credit_charge(named) == 2
    assert conn._calculate_credit_charge(m.query_info(info.FILE_FULL_EA, FID, 65536)) == 1
    assert conn._calculate_credit_charge(m.set_info(info.FILE_FULL_EA, bytes(65537), FID)) == 2


def test_lease_break_acknowledgment():
    # 2.2.24.2: structure size 36, reserved, flags, the key, the state acknowledged, the duration.
    ack = m.lease_break_ack(KEY, m.LEASE_READ)
    assert ack.pack() == b"\x24\x00" + bytes(6) + KEY + b"\x01\x00\x00\x00" + bytes(8)
    assert m.command(ack) == "OPLOCK_BREAK"
