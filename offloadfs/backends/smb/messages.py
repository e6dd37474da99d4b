"""SMB2 requests, built with smbprotocol's request structures (its Connection sends only those).

A request inside a related compound uses RELATED as its file id: "the handle
the CREATE before me opened", so open + query + close is one round trip.
"""
from collections import OrderedDict

from smbprotocol.create_contexts import (
    SMB2CreateContextRequest,
    SMB2CreateDurableHandleReconnectV2,
    SMB2CreateDurableHandleRequestV2,
)
from smbprotocol.file_info import InfoType
from smbprotocol.header import Commands
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
from smbprotocol.structure import BytesField, IntField, Structure

from .wire import FSCTL_SRV_REQUEST_RESUME_KEY

RELATED = b"\xff" * 16
COMMAND_NAMES = {v: k[len("SMB2_"):] for k, v in vars(Commands).items() if k.startswith("SMB2_")}

# Access masks (MS-SMB2 2.2.13.1).
READ_DATA = 0x00000001
WRITE_DATA = 0x00000002
APPEND_DATA = 0x00000004
READ_EA = 0x00000008
WRITE_EA = 0x00000010
READ_ATTRIBUTES = 0x00000080
WRITE_ATTRIBUTES = 0x00000100
DELETE = 0x00010000
SYNCHRONIZE = 0x00100000
READ = READ_DATA | READ_EA | READ_ATTRIBUTES | SYNCHRONIZE
WRITE = WRITE_DATA | APPEND_DATA | WRITE_EA | WRITE_ATTRIBUTES | SYNCHRONIZE

# Dispositions (2.2.13).
OPEN = 1
CREATE = 2
OPEN_IF = 3
OVERWRITE = 4
OVERWRITE_IF = 5

# Create options.
DIRECTORY_FILE = 0x00000001
NON_DIRECTORY_FILE = 0x00000040

# Oplock levels (2.2.13): a durable handle needs a batch oplock from Samba (or a lease, which we do not ask for).
NO_OPLOCK = 0x00
BATCH = 0x09
DURABLE_V2 = SMB2CreateDurableHandleRequestV2.NAME  # its response context has the same name

SHARE_ALL = 0x7  # read | write | delete: POSIX lets anyone open, rename and unlink anything
RESTART_SCAN = 0x01  # QUERY_DIRECTORY and QUERY_INFO (EAs) flag


def command(message):
    """The name of a request's command: CREATE, QUERY_INFO, ..."""
    return COMMAND_NAMES[message.COMMAND]


def create(path, access, disposition=OPEN, options=0, attributes=0, oplock=NO_OPLOCK, contexts=()):
    m = SMB2CreateRequest()
    m["requested_oplock_level"] = oplock
    m["impersonation_level"] = ImpersonationLevel.Impersonation
    m["desired_access"] = access
    m["file_attributes"] = attributes
    m["share_access"] = SHARE_ALL
    m["create_disposition"] = disposition
    m["create_options"] = options
    m["buffer_path"] = path.encode("utf-16-le", "surrogatepass") if path else b"\0\0"
    if contexts:
        m["buffer_contexts"] = SMB2CreateContextRequest.pack_multiple(list(contexts))
    return m


def durable(create_guid):
    """2.2.13.2.11: make the open durable; the server's default timeout, not persistent."""
    c = SMB2CreateDurableHandleRequestV2()
    c["create_guid"] = create_guid
    return c


def durable_reconnect(file_id, create_guid):
    """2.2.13.2.12: the durable open ``file_id`` of a lost connection, on this one."""
    c = SMB2CreateDurableHandleReconnectV2()
    c["file_id"] = file_id
    c["create_guid"] = create_guid
    return c


class OplockBreakAcknowledgment(Structure):
    """2.2.24.1, which smbprotocol lacks."""
    COMMAND = Commands.SMB2_OPLOCK_BREAK

    def __init__(self):
        self.fields = OrderedDict([
            ("structure_size", IntField(size=2, default=24)),
            ("oplock_level", IntField(size=1)),
            ("reserved", IntField(size=1)),
            ("reserved2", IntField(size=4)),
            ("file_id", BytesField(size=16)),
        ])
        super().__init__()


def oplock_break_ack(file_id):
    """Give up the oplock on ``file_id`` altogether."""
    m = OplockBreakAcknowledgment()
    m["oplock_level"] = NO_OPLOCK
    m["file_id"] = file_id
    return m


def close(file_id=RELATED):
    m = SMB2CloseRequest()
    m["file_id"] = file_id
    return m


def flush(file_id):
    m = SMB2FlushRequest()
    m["file_id"] = file_id
    return m


def read(file_id, offset, length):
    m = SMB2ReadRequest()
    m["length"] = length
    m["offset"] = offset
    m["file_id"] = file_id
    m["padding"] = 0x50  # where the server puts the data: right after the READ response header
    return m


def write(file_id, offset, data):
    m = SMB2WriteRequest()
    m["offset"] = offset
    m["file_id"] = file_id
    m["buffer"] = data
    return m


def query_info(info_class, file_id=RELATED, output_length=65536, info_type=InfoType.SMB2_0_INFO_FILE,
               input=b"", flags=0):
    m = SMB2QueryInfoRequest()
    m["info_type"] = info_type
    m["file_info_class"] = info_class
    m["output_buffer_length"] = output_length
    m["buffer"] = input
    m["flags"] = flags
    m["file_id"] = file_id
    return m


def query_fs_info(info_class, file_id=RELATED):
    return query_info(info_class, file_id, 4096, InfoType.SMB2_0_INFO_FILESYSTEM)


def set_info(info_class, buffer, file_id=RELATED):
    m = SMB2SetInfoRequest()
    m["info_type"] = InfoType.SMB2_0_INFO_FILE
    m["file_info_class"] = info_class
    m["buffer"] = buffer
    m["file_id"] = file_id
    return m


def query_directory(file_id, info_class, flags, output_length):
    m = SMB2QueryDirectoryRequest()
    m["file_information_class"] = info_class
    m["flags"] = flags
    m["file_id"] = file_id
    m["output_buffer_length"] = output_length
    m["buffer"] = "*".encode("utf-16-le")
    return m


def ioctl(file_id, ctl_code, input=b"", max_output=0):
    m = SMB2IOCTLRequest()
    m["ctl_code"].enum_strict = False  # FSCTL_DUPLICATE_EXTENTS_TO_FILE is not in its table
    m["ctl_code"] = ctl_code
    m["file_id"] = file_id
    m["buffer"] = input
    m["max_output_response"] = max_output
    m["flags"] = IOCTLFlags.SMB2_0_IOCTL_IS_FSCTL
    return m


def resume_key(file_id=RELATED):
    """FSCTL_SRV_REQUEST_RESUME_KEY: what names ``file_id`` as the source of a copychunk."""
    return ioctl(file_id, FSCTL_SRV_REQUEST_RESUME_KEY, b"", 32)
