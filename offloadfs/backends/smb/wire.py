"""SMB2 response bodies and FSCTL structures, packed and parsed with struct.

smbprotocol builds our requests, but we parse replies ourselves: its
Structure classes copy the remaining buffer at every field and lack the
FSCTLs that copy offload needs.  Every parser checks lengths and offsets
against the buffer it got, so a hostile or truncated reply raises WireError
instead of reading past the end or looping.
"""
import struct
from dataclasses import dataclass

HEADER_SIZE = 64  # offsets in responses count from the start of the SMB2 header

FSCTL_SRV_REQUEST_RESUME_KEY = 0x00140078
FSCTL_SRV_COPYCHUNK_WRITE = 0x001480F2
FSCTL_DUPLICATE_EXTENTS_TO_FILE = 0x00098344  # not in smbprotocol's CtlCode
FSCTL_SET_SPARSE = 0x000900C4
FSCTL_SET_ZERO_DATA = 0x000980C8
# MS-FSCC 2.3.64 FILE_SET_SPARSE_BUFFER, SetSparse TRUE: optional (no buffer means TRUE), but ksmbd
# refuses an FSCTL_SET_SPARSE without it (INVALID_PARAMETER).
SET_SPARSE = b"\x01"
FSCTL_QUERY_ALLOCATED_RANGES = 0x000940CF


class WireError(ValueError):
    """A reply that does not parse: truncated, or offsets pointing outside it."""


def _unpack(fmt: struct.Struct, data, offset=0, what="reply"):
    if len(data) < offset + fmt.size:
        raise WireError(f"{what}: {len(data) - offset} bytes, need {fmt.size}")
    return fmt.unpack_from(data, offset)


def _buffer(body, offset, length, what):
    """The bytes at a header-relative ``offset`` inside a response body."""
    if length == 0:
        return memoryview(body)[0:0]
    start = offset - HEADER_SIZE
    if start < 0 or start + length > len(body):
        raise WireError(f"{what}: buffer at {offset}+{length} outside a {len(body)}-byte body")
    return memoryview(body)[start:start + length]


# -- response bodies ------------------------------------------------------------


@dataclass(slots=True)
class Lease:
    """2.2.14.2.10 and .11 SMB2_CREATE_RESPONSE_LEASE(_V2): what the server granted.  ``epoch``: None for v1."""
    V1 = struct.Struct("<16sIIQ")  # key, state, flags, duration
    V2 = struct.Struct("<16sIIQ16sHH")  # then the parent's key, the epoch, reserved
    BREAK_IN_PROGRESS = 0x02  # flags: a break of this lease is under way
    key: bytes
    state: int
    flags: int
    epoch: int | None

    @classmethod
    def unpack(cls, data):
        if len(data) >= cls.V2.size:
            key, state, flags, _, _, epoch, _ = cls.V2.unpack_from(data)
            return cls(key, state, flags, epoch)
        key, state, flags, _ = _unpack(cls.V1, data, what="lease context")
        return cls(key, state, flags, None)


@dataclass(slots=True)
class CreateResponse:
    """2.2.14 SMB2 CREATE Response: the handle, what the open found, the oplock and create contexts granted."""
    FORMAT = struct.Struct("<HBBIqqqqqqII16sII")
    CONTEXT = struct.Struct("<IHHHHI")  # 2.2.13.2 SMB2_CREATE_CONTEXT: next, name offset/length, data offset/length
    oplock_level: int
    create_action: int
    end_of_file: int
    attributes: int
    file_id: bytes
    contexts: list  # names (bytes) of the create contexts in the reply
    lease: Lease | None  # the lease context, where the oplock level is a lease

    @classmethod
    def unpack(cls, body):
        (_, oplock, _, action, _, _, _, _, _, eof, attrs, _, file_id, offset, length) = _unpack(
            cls.FORMAT, body, what="CREATE")
        contexts = cls._contexts(_buffer(body, offset, length, "CREATE"))
        lease = contexts.get(b"RqLs")
        return cls(oplock, action, eof, attrs, file_id, list(contexts),
                   Lease.unpack(lease) if lease is not None and oplock == 0xFF else None)

    @classmethod
    def _contexts(cls, data):
        """{name: data} of each create context."""
        contexts = {}
        start = 0
        while len(data) > start:
            next_offset, name_offset, name_length, _, data_offset, data_length = _unpack(
                cls.CONTEXT, data, start, "create context")
            name = start + name_offset
            if name_offset < cls.CONTEXT.size or name + name_length > len(data):
                raise WireError(f"create context name at {name}+{name_length} outside {len(data)} bytes")
            value = start + data_offset
            if data_length and (data_offset < cls.CONTEXT.size or value + data_length > len(data)):
                raise WireError(f"create context data at {value}+{data_length} outside {len(data)} bytes")
            contexts[bytes(data[name:name + name_length])] = data[value:value + data_length]
            if next_offset == 0:
                break
            if next_offset < cls.CONTEXT.size:
                raise WireError("create contexts overlap")
            start += next_offset
        return contexts


@dataclass(slots=True)
class LeaseBreak:
    """2.2.23.2 Lease Break Notification: the lease ``key`` goes from ``current`` to ``new``; the server waits
    for our acknowledgment where ``ack_required``.  ``epoch``: the lease's after the break (v2 leases; 0 on v1)."""
    FORMAT = struct.Struct("<HHI16sIIIII")
    ACK_REQUIRED = 0x01
    epoch: int
    ack_required: bool
    key: bytes
    current: int
    new: int

    @classmethod
    def unpack(cls, body):
        size, epoch, flags, key, current, new, _, _, _ = _unpack(cls.FORMAT, body, what="lease break")
        if size != cls.FORMAT.size:
            raise WireError(f"lease break: structure size {size}")
        return cls(epoch, bool(flags & cls.ACK_REQUIRED), key, current, new)


class ReadResponse:
    """2.2.20 SMB2 READ Response: the data, without copying it out of the body."""
    FORMAT = struct.Struct("<HBxII4x")

    @classmethod
    def data(cls, body):
        _, offset, length, _ = _unpack(cls.FORMAT, body, what="READ")
        return _buffer(body, offset, length, "READ")


class WriteResponse:
    """2.2.22 SMB2 WRITE Response: how much the server wrote, which may be less than sent."""
    FORMAT = struct.Struct("<H2xI")

    @classmethod
    def count(cls, body):
        return _unpack(cls.FORMAT, body, what="WRITE")[1]


class QueryResponse:
    """2.2.34 QUERY_DIRECTORY and 2.2.38 QUERY_INFO Responses share this layout."""
    FORMAT = struct.Struct("<HHI")

    @classmethod
    def buffer(cls, body):
        _, offset, length = _unpack(cls.FORMAT, body, what="QUERY")
        return _buffer(body, offset, length, "QUERY")


class IoctlResponse:
    """2.2.32 SMB2 IOCTL Response: the FSCTL's output buffer."""
    FORMAT = struct.Struct("<HHI16sIIIIII")

    @classmethod
    def output(cls, body):
        fields = _unpack(cls.FORMAT, body, what="IOCTL")
        return _buffer(body, fields[6], fields[7], "IOCTL")


# -- FSCTL structures -----------------------------------------------------------


@dataclass(slots=True)
class ResumeKey:
    """2.2.32.3 SRV_REQUEST_RESUME_KEY Response: names the source of a copychunk."""
    FORMAT = struct.Struct("<24sI")
    key: bytes

    @classmethod
    def unpack(cls, data):
        return cls(_unpack(cls.FORMAT, data, what="SRV_REQUEST_RESUME_KEY")[0])

    @property
    def echoed(self):
        """True for ksmbd's answer to a request that named its file as the CREATE before it in a compound
        (file id all ones): its key is that file id as sent, which names no file."""
        return self.key.startswith(b"\xff" * 16)


@dataclass(slots=True)
class CopyChunkCopy:
    """2.2.31.1 SRV_COPYCHUNK_COPY: up to the server's chunk count of (src, dst, length) ranges."""
    HEAD = struct.Struct("<24sI4x")
    CHUNK = struct.Struct("<QQI4x")
    key: bytes
    chunks: list  # (source_offset, target_offset, length)

    def pack(self):
        return self.HEAD.pack(self.key, len(self.chunks)) + b"".join(self.CHUNK.pack(*c) for c in self.chunks)


@dataclass(slots=True)
class CopyChunkResponse:
    """2.2.32.1 SRV_COPYCHUNK_RESPONSE.

    On success: chunks and bytes written.  On STATUS_INVALID_PARAMETER the
    same fields carry the server's limits: chunks per request, bytes per
    chunk, bytes per request.
    """
    FORMAT = struct.Struct("<III")
    chunks_written: int
    chunk_bytes_written: int
    total_bytes_written: int

    @classmethod
    def unpack(cls, data):
        return cls(*_unpack(cls.FORMAT, data, what="SRV_COPYCHUNK_RESPONSE"))


@dataclass(slots=True)
class DuplicateExtents:
    """MS-FSCC 2.3.8 DUPLICATE_EXTENTS_DATA, with the source as a 16-byte SMB2 file id."""
    FORMAT = struct.Struct("<16sqqq")
    source_file_id: bytes
    source_offset: int
    target_offset: int
    length: int

    def pack(self):
        return self.FORMAT.pack(self.source_file_id, self.source_offset, self.target_offset, self.length)


@dataclass(slots=True)
class AllocatedRange:
    """MS-FSCC 2.3.52 FILE_ALLOCATED_RANGE_BUFFER: the query's input and each range of its output."""
    FORMAT = struct.Struct("<qq")
    offset: int
    length: int

    def pack(self):
        return self.FORMAT.pack(self.offset, self.length)

    @classmethod
    def unpack_list(cls, data):
        if len(data) % cls.FORMAT.size:
            raise WireError(f"QUERY_ALLOCATED_RANGES: {len(data)} bytes is not a whole number of ranges")
        ranges = [cls(*r) for r in cls.FORMAT.iter_unpack(data)]
        if any(r.offset < 0 or r.length < 0 for r in ranges):
            raise WireError("QUERY_ALLOCATED_RANGES: negative range")
        return ranges


@dataclass(slots=True)
class ZeroData:
    """MS-FSCC 2.3.83 FILE_ZERO_DATA_INFORMATION: deallocate [offset, beyond_final_zero) on a sparse file."""
    FORMAT = struct.Struct("<qq")
    offset: int
    beyond_final_zero: int

    def pack(self):
        return self.FORMAT.pack(self.offset, self.beyond_final_zero)
