"""SMB2 requests, packed here; smbprotocol's Connection puts the header on them and signs them.

A request inside a related compound uses RELATED as its file id: "the handle
the CREATE before me opened", so open + query + close is one round trip.
"""
import struct

from smbprotocol.file_info import InfoType
from smbprotocol.header import Commands
from smbprotocol.open import ImpersonationLevel

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
WRITE_DAC = 0x00040000
WRITE_OWNER = 0x00080000
SYNCHRONIZE = 0x00100000
READ = READ_DATA | READ_EA | READ_ATTRIBUTES | SYNCHRONIZE
WRITE = WRITE_DATA | APPEND_DATA | WRITE_EA | WRITE_ATTRIBUTES | SYNCHRONIZE

# Dispositions (2.2.13).
OPEN = 1
CREATE = 2
OPEN_IF = 3
OVERWRITE = 4
OVERWRITE_IF = 5

FILE_CREATED = 2  # a CREATE response's CreateAction (2.2.14): the open made the file

# Create options.
DIRECTORY_FILE = 0x00000001
NON_DIRECTORY_FILE = 0x00000040

# Oplock levels (2.2.13): files are opened with a lease (leases.py), directories with nothing.
NO_OPLOCK = 0x00
LEASE = 0xFF
# Lease states (2.2.13.2.8): what the holder may cache; the server breaks them when others would see it stale.
LEASE_READ = 0x01
LEASE_HANDLE = 0x02
LEASE_WRITE = 0x04
PARENT_LEASE_KEY_SET = 0x04  # lease v2 flag (2.2.13.2.10)
REQUEST_LEASE = b"RqLs"  # 2.2.13.2.8 and .10; its response context has the same name
DURABLE_V2 = b"DH2Q"  # 2.2.13.2.11; its response context has the same name
DURABLE_RECONNECT_V2 = b"DH2C"  # 2.2.13.2.12

SHARE_ALL = 0x7  # read | write | delete: POSIX lets anyone open, rename and unlink anything
RESTART_SCAN = 0x01  # QUERY_DIRECTORY and QUERY_INFO (EAs) flag
IS_FSCTL = 0x00000001  # IOCTL flag (2.2.31)


def command(message):
    """The name of a request's command: CREATE, QUERY_INFO, ..."""
    return COMMAND_NAMES[message.COMMAND]


class Request:
    """One request's body as it goes on the wire, behind the header smbprotocol's Connection puts on it.

    smbprotocol's request structures build an object per field and work out
    each length and offset when packed: about a third of the daemon's time
    for a stat (create + query + close) went into them.  These are packed
    once, with struct.  ``payload``: the larger of what it sends and what it
    asks back, for the credit charge (MS-SMB2 3.2.4.1.5).  ``data``: bytes that
    follow ``body`` as they are (a WRITE's), copied only into the frame: two
    copies of their own before it cost a 1 MiB write 0.07-0.4 ms.
    """
    __slots__ = ("COMMAND", "body", "payload", "data")

    def __init__(self, command, body, payload=1, data=b""):
        self.COMMAND = command
        self.body = body
        self.payload = payload
        self.data = data

    def pack(self):
        return self.body + self.data

    def __len__(self):
        return len(self.body) + len(self.data)


# The fixed parts of each request (2.2.13 and on), after the 64-byte header.
_CREATE = struct.Struct("<HBBIQQIIIIIHHII")
_CLOSE = struct.Struct("<HHI16s")  # and FLUSH
_READ = struct.Struct("<HBBIQ16sIIIHH")
_WRITE = struct.Struct("<HHIQ16sIIHHI")
_QUERY_INFO = struct.Struct("<HBBIHHIII16s")
_SET_INFO = struct.Struct("<HBBIHHI16s")
_QUERY_DIRECTORY = struct.Struct("<HBBI16sHHI")
_IOCTL = struct.Struct("<HHI16sIIIIIIII")
_CHANGE_NOTIFY = struct.Struct("<HHI16sII")
_LEASE = struct.Struct("<16sIIQ")  # key, state, flags, duration (2.2.13.2.8)
_LEASE_V2 = struct.Struct("<16sIIQ16sHH")  # then the parent's key, the epoch, reserved (2.2.13.2.10)
_LEASE_BREAK_ACK = struct.Struct("<HHI16sIQ")
_CONTEXT = struct.Struct("<IHHHHI")
_DURABLE = struct.Struct("<IIQ16s")  # timeout, flags, reserved, create GUID
_DURABLE_RECONNECT = struct.Struct("<16s16sI")  # file id, create GUID, flags
_HEADER = 64
# How long a durable handle waits for our reconnect, asked for: a timeout of 0 leaves it to the server,
# Samba's 60 s but ksmbd's 1.6 s, less than a reconnect under load took (the handle was gone, EIO).
DURABLE_TIMEOUT_MS = 60_000


def create(path, access, disposition=OPEN, options=0, attributes=0, oplock=NO_OPLOCK, contexts=()):
    """``contexts``: (name, data) of each create context (2.2.13.2)."""
    name = path.encode("utf-16-le", "surrogatepass") if path else b""
    contexts = _contexts(contexts)
    buffer = name or b"\0\0"  # the buffer is never empty, even for the share's root
    offset = 0
    if contexts:
        buffer += bytes(-len(buffer) % 8)
        offset = _HEADER + _CREATE.size + len(buffer)
    fixed = _CREATE.pack(57, 0, oplock, ImpersonationLevel.Impersonation, 0, 0, access, attributes, SHARE_ALL,
                         disposition, options, _HEADER + _CREATE.size, len(name), offset, len(contexts))
    return Request(Commands.SMB2_CREATE, fixed + buffer + contexts)


def _contexts(contexts):
    """One buffer of create contexts, each starting on 8 bytes: next, name offset and length, reserved, data
    offset and length, then the name and the data, each padded to 8."""
    bodies = []
    for name, data in contexts:
        body = name + bytes(-len(name) % 8 if data else 0) + data
        bodies.append((_CONTEXT.size + len(name) + (-len(name) % 8) if data else 0, name, data,
                       body + bytes(-len(body) % 8)))
    return b"".join(_CONTEXT.pack(0 if i == len(bodies) - 1 else _CONTEXT.size + len(body), _CONTEXT.size,
                                  len(name), 0, data_offset, len(data)) + body
                    for i, (data_offset, name, data, body) in enumerate(bodies))


def durable(create_guid):
    """Make the open durable for DURABLE_TIMEOUT_MS, not persistent."""
    return DURABLE_V2, _DURABLE.pack(DURABLE_TIMEOUT_MS, 0, 0, create_guid.bytes)


def durable_reconnect(file_id, create_guid):
    """The durable open ``file_id`` of a lost connection, on this one."""
    return DURABLE_RECONNECT_V2, _DURABLE_RECONNECT.pack(file_id, create_guid.bytes, 0)


def lease(key, state, v2, parent=None):
    """Ask for a lease of ``state`` under ``key``: v2 on SMB 3.x (the server then numbers its changes with
    epochs; ours starts at 0), v1 on 2.1.  ``parent``: the key of the directory lease we hold on the
    file's directory (v2 only), which the open's changes there then do not break."""
    if v2:
        return REQUEST_LEASE, _LEASE_V2.pack(key, state, PARENT_LEASE_KEY_SET if parent else 0, 0, parent or bytes(16),
                                             0, 0)
    return REQUEST_LEASE, _LEASE.pack(key, state, 0, 0)


def lease_break_ack(key, state):
    """2.2.24.2: the lease ``key`` now holds ``state``, what its break asked for."""
    return Request(Commands.SMB2_OPLOCK_BREAK, _LEASE_BREAK_ACK.pack(36, 0, 0, key, state, 0))


def close(file_id=RELATED):
    return Request(Commands.SMB2_CLOSE, _CLOSE.pack(24, 0, 0, file_id))


def flush(file_id):
    return Request(Commands.SMB2_FLUSH, _CLOSE.pack(24, 0, 0, file_id))


def read(file_id, offset, length):
    # Padding 0x50: where the server puts the data, right after the READ response header.
    return Request(Commands.SMB2_READ, _READ.pack(49, 0x50, 0, length, offset, file_id, 0, 0, 0, 0, 0) + b"\0",
                   length)


def write(file_id, offset, data):
    """``data``: any bytes-like object that stays as it is until the request is framed."""
    fixed = _WRITE.pack(49, _HEADER + _WRITE.size, len(data), offset, file_id, 0, 0, 0, 0, 0)
    return Request(Commands.SMB2_WRITE, fixed, len(data), data)


def query_info(info_class, file_id=RELATED, output_length=65536, info_type=InfoType.SMB2_0_INFO_FILE,
               input=b"", flags=0):
    """Charged for input and output summed: 3.2.4.1.5 asks for the larger, but ksmbd counts both and
    refuses the whole compound when the charge falls short (a named EA query asking 64 KiB back)."""
    fixed = _QUERY_INFO.pack(41, info_type, info_class, output_length, _HEADER + _QUERY_INFO.size if input else 0,
                             0, len(input), 0, flags, file_id)
    return Request(Commands.SMB2_QUERY_INFO, fixed + input, len(input) + output_length)


def query_fs_info(info_class, file_id=RELATED):
    return query_info(info_class, file_id, 4096, InfoType.SMB2_0_INFO_FILESYSTEM)


def set_info(info_class, buffer, file_id=RELATED, info_type=InfoType.SMB2_0_INFO_FILE, additional=0):
    """``additional``: for a security descriptor, which of its parts to set (2.2.39 AdditionalInformation)."""
    fixed = _SET_INFO.pack(33, info_type, info_class, len(buffer), _HEADER + _SET_INFO.size, 0, additional,
                           file_id)
    return Request(Commands.SMB2_SET_INFO, fixed + buffer, len(buffer))


def query_directory(file_id, info_class, flags, output_length):
    pattern = "*".encode("utf-16-le")
    fixed = _QUERY_DIRECTORY.pack(33, info_class, flags, 0, file_id, _HEADER + _QUERY_DIRECTORY.size, len(pattern),
                                  output_length)
    return Request(Commands.SMB2_QUERY_DIRECTORY, fixed + pattern, max(len(pattern), output_length))


def change_notify(file_id, completion_filter, output_length):
    """CHANGE_NOTIFY (2.2.35) on the directory ``file_id``, for the directory itself (not its tree)."""
    fixed = _CHANGE_NOTIFY.pack(32, 0, output_length, file_id, completion_filter, 0)
    return Request(Commands.SMB2_CHANGE_NOTIFY, fixed, output_length)


def ioctl(file_id, ctl_code, input=b"", max_output=0):
    offset = _HEADER + _IOCTL.size if input else 0
    fixed = _IOCTL.pack(57, 0, ctl_code, file_id, offset, len(input), 0, offset, 0, max_output, IS_FSCTL, 0)
    return Request(Commands.SMB2_IOCTL, fixed + input, max(len(input), max_output))


def resume_key(file_id=RELATED):
    """FSCTL_SRV_REQUEST_RESUME_KEY: what names ``file_id`` as the source of a copychunk."""
    return ioctl(file_id, FSCTL_SRV_REQUEST_RESUME_KEY, b"", 32)
