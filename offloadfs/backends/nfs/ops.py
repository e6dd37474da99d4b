"""NFSv4.1/4.2 operations (RFC 8881, RFC 7862): one structure per operation.

Each operation encodes its arguments and decodes its result body when the
status is NFS4_OK (``decode_error`` for the few that carry a body on error).
Compound and callback framing live in compound.py; limits on everything the
server sends live here, next to the field they bound.
"""
import ipaddress
from dataclasses import dataclass, field

from . import attrs, errors
from .xdr import Packer, ProtocolError, Unpacker

FHSIZE = attrs.FHSIZE
OPAQUE_LIMIT = 1024
NAME_LIMIT = 4096
LINK_LIMIT = 4096
STATEID_SIZE = 16
XATTR_SIZE_MAX = 65536  # what Linux allows one extended attribute
ANONYMOUS = bytes(16)

OP_CLOSE, OP_COMMIT, OP_CREATE = 4, 5, 6
OP_DELEGRETURN, OP_GETATTR, OP_GETFH, OP_LINK = 8, 9, 10, 11
OP_LOOKUP, OP_OPEN, OP_PUTFH, OP_PUTROOTFH = 15, 18, 22, 24
OP_READ, OP_READDIR, OP_READLINK, OP_REMOVE, OP_RENAME = 25, 26, 27, 28, 29
OP_RESTOREFH, OP_SAVEFH, OP_SETATTR, OP_WRITE = 31, 32, 34, 38
OP_BIND_CONN_TO_SESSION, OP_EXCHANGE_ID, OP_CREATE_SESSION, OP_DESTROY_SESSION = 41, 42, 43, 44
OP_FREE_STATEID = 45
OP_SEQUENCE, OP_DESTROY_CLIENTID, OP_RECLAIM_COMPLETE = 53, 57, 58
OP_SECINFO, OP_SECINFO_NO_NAME = 33, 52
SECINFO_STYLE4_CURRENT_FH = 0
RPCSEC_GSS = 6
OP_ALLOCATE, OP_COPY, OP_COPY_NOTIFY, OP_DEALLOCATE = 59, 60, 61, 62
OP_OFFLOAD_CANCEL, OP_OFFLOAD_STATUS, OP_READ_PLUS, OP_SEEK, OP_CLONE = 66, 67, 68, 69, 71
OP_GETXATTR, OP_SETXATTR, OP_LISTXATTRS, OP_REMOVEXATTR = 72, 73, 74, 75  # RFC 8276

UNSTABLE4, DATA_SYNC4, FILE_SYNC4 = 0, 1, 2
STABLE_HOW = (UNSTABLE4, DATA_SYNC4, FILE_SYNC4)

SHARE_ACCESS_READ, SHARE_ACCESS_WRITE, SHARE_ACCESS_BOTH = 1, 2, 3
SHARE_WANT_NO_DELEG = 0x400
UNCHECKED4, GUARDED4 = 0, 1
CLAIM_NULL, CLAIM_PREVIOUS, CLAIM_FH = 0, 1, 4
DELEG_NONE, DELEG_READ, DELEG_WRITE, DELEG_NONE_EXT = 0, 1, 2, 3
NFS4_CONTENT_DATA, NFS4_CONTENT_HOLE = 0, 1
NL4_NAME, NL4_URL, NL4_NETADDR = 1, 2, 3
MAX_SOURCE_SERVERS = 16

CDFC4_FORE_OR_BOTH = 3
CREATE_SESSION_CONN_BACK_CHAN = 2


def stateid(u):
    return u.fixed(STATEID_SIZE)


def change_info(u):
    u.bool()
    u.u64()
    u.u64()


def write_verifier(u):
    return u.fixed(8)


class Op:
    num = 0

    def encode(self, p: Packer):
        pass

    def decode(self, u: Unpacker):
        return None

    def decode_error(self, u: Unpacker, status):
        """The body some operations carry with an error status; returned as the error's ``detail``."""
        return None


# -- filehandles and names ----------------------------------------------------------


@dataclass
class PutRootFH(Op):
    num = OP_PUTROOTFH


@dataclass
class PutFH(Op):
    fh: bytes
    num = OP_PUTFH

    def encode(self, p):
        p.opaque(self.fh)


@dataclass
class SaveFH(Op):
    num = OP_SAVEFH


@dataclass
class RestoreFH(Op):
    num = OP_RESTOREFH


@dataclass
class GetFH(Op):
    num = OP_GETFH

    def decode(self, u):
        return attrs.filehandle(u)


@dataclass
class Lookup(Op):
    name: bytes
    num = OP_LOOKUP

    def encode(self, p):
        p.opaque(self.name)


@dataclass
class GetAttr(Op):
    mask: int
    num = OP_GETATTR

    def encode(self, p):
        p.bitmap(self.mask)

    def decode(self, u):
        return attrs.decode(u, self.mask)


@dataclass
class SetAttr(Op):
    values: dict
    stateid: bytes = ANONYMOUS
    num = OP_SETATTR

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        attrs.encode(p, self.values)

    def decode(self, u):
        return u.bitmap()

    def decode_error(self, u, status):
        return u.bitmap()


@dataclass
class ReadLink(Op):
    num = OP_READLINK

    def decode(self, u):
        return u.opaque(LINK_LIMIT, "link text")


@dataclass
class Create(Op):
    """CREATE: directories, symlinks, devices, fifos, sockets (regular files use OPEN)."""
    type: int
    name: bytes
    values: dict
    link: bytes = b""
    rdev: tuple = (0, 0)
    num = OP_CREATE

    def encode(self, p):
        p.u32(self.type)
        if self.type == attrs.NF4LNK:
            p.opaque(self.link)
        elif self.type in (attrs.NF4BLK, attrs.NF4CHR):
            p.u32(self.rdev[0])
            p.u32(self.rdev[1])
        p.opaque(self.name)
        attrs.encode(p, self.values)

    def decode(self, u):
        change_info(u)
        return u.bitmap()


@dataclass
class Remove(Op):
    name: bytes
    num = OP_REMOVE

    def encode(self, p):
        p.opaque(self.name)

    def decode(self, u):
        change_info(u)


@dataclass
class Rename(Op):
    old: bytes
    new: bytes
    num = OP_RENAME

    def encode(self, p):
        p.opaque(self.old)
        p.opaque(self.new)

    def decode(self, u):
        change_info(u)
        change_info(u)


@dataclass
class Link(Op):
    name: bytes
    num = OP_LINK

    def encode(self, p):
        p.opaque(self.name)

    def decode(self, u):
        change_info(u)


@dataclass
class Entry:
    cookie: int
    name: bytes
    values: dict


@dataclass
class DirList:
    verifier: bytes
    entries: list
    eof: bool


@dataclass
class ReadDir(Op):
    cookie: int
    verifier: bytes
    dircount: int
    maxcount: int
    mask: int
    num = OP_READDIR

    def encode(self, p):
        p.u64(self.cookie)
        p.fixed(self.verifier, 8)
        p.u32(self.dircount)
        p.u32(self.maxcount)
        p.bitmap(self.mask)

    def decode(self, u):
        verifier = u.fixed(8)
        entries = []
        while u.bool():  # entries arrive as a linked list; the reply's size bounds it
            cookie = u.u64()
            name = u.opaque(NAME_LIMIT, "name")
            entries.append(Entry(cookie, name, attrs.decode(u, self.mask)))
        return DirList(verifier, entries, u.bool())


# -- open state ---------------------------------------------------------------------


@dataclass
class Opened:
    stateid: bytes
    delegation: bytes | None  # a delegation stateid the server granted anyway


@dataclass
class Open(Op):
    """OPEN by filehandle (CLAIM_FH, ``name`` None) or by name in a directory, creating it if ``create``;
    with ``reclaim``, an open held before the server restarted (CLAIM_PREVIOUS, by filehandle).

    O_EXCL is GUARDED4 with the reply cached for a resend (EXCLUSIVE4_1 would survive a server
    restart between the create and its resend too, but sets attributes in a second round trip).
    """
    access: int
    owner: bytes
    clientid: int
    name: bytes | None = None
    create: int | None = None  # UNCHECKED4 / GUARDED4
    values: dict = field(default_factory=dict)
    reclaim: bool = False
    delegation: bool = False  # the server may grant one (else we want none)
    num = OP_OPEN

    def encode(self, p):
        p.u32(0)  # seqid: unused in 4.1
        p.u32(self.access | (0 if self.delegation else SHARE_WANT_NO_DELEG))
        p.u32(0)  # deny none
        p.u64(self.clientid)
        p.opaque(self.owner)
        if self.create is None:
            p.u32(0)  # OPEN4_NOCREATE
        else:
            p.u32(1)
            p.u32(self.create)
            attrs.encode(p, self.values)
        if self.reclaim:
            p.u32(CLAIM_PREVIOUS)
            p.u32(DELEG_NONE)  # no delegation was held
        elif self.name is None:
            p.u32(CLAIM_FH)
        else:
            p.u32(CLAIM_NULL)
            p.opaque(self.name)

    def decode(self, u):
        sid = stateid(u)
        change_info(u)
        u.u32()  # rflags
        u.bitmap()  # attrset
        kind = u.enum((DELEG_NONE, DELEG_READ, DELEG_WRITE, DELEG_NONE_EXT), "delegation type")
        deleg = None
        if kind in (DELEG_READ, DELEG_WRITE):
            deleg = stateid(u)
            u.bool()  # recall
            if kind == DELEG_WRITE:
                limit = u.enum((1, 2), "space limit")
                if limit == 1:
                    u.u64()
                else:
                    u.u32()
                    u.u32()
            u.u32()  # nfsace4: type, flag, mask, who
            u.u32()
            u.u32()
            u.opaque(OPAQUE_LIMIT, "ace who")
        elif kind == DELEG_NONE_EXT:
            why = u.enum(range(9), "why no delegation")
            if why in (1, 2):
                u.bool()
        return Opened(sid, deleg)


@dataclass
class Close(Op):
    stateid: bytes
    num = OP_CLOSE

    def encode(self, p):
        p.u32(0)
        p.fixed(self.stateid, STATEID_SIZE)

    def decode(self, u):
        return stateid(u)


@dataclass
class DelegReturn(Op):
    stateid: bytes
    num = OP_DELEGRETURN

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)


class FreeStateid(DelegReturn):
    """Let go of a stateid the server revoked (it stays, and SEQUENCE says so, until freed): the
    same arguments as DELEGRETURN."""
    num = OP_FREE_STATEID


# -- data ---------------------------------------------------------------------------


@dataclass
class Read(Op):
    stateid: bytes
    offset: int
    count: int
    num = OP_READ

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        p.u64(self.offset)
        p.u32(self.count)

    def decode(self, u):
        eof = u.bool()
        return eof, u.opaque(self.count, "read data")


@dataclass
class ReadPlus(Op):
    """READ_PLUS: the data as (eof, [(offset, bytes or None for a hole, length)]) in the asked range."""
    stateid: bytes
    offset: int
    count: int
    num = OP_READ_PLUS

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        p.u64(self.offset)
        p.u32(self.count)

    def decode(self, u):
        eof = u.bool()
        n = u.count(self.count + 1, 12, "read_plus segments")
        segments = []
        for _ in range(n):
            kind = u.enum((NFS4_CONTENT_DATA, NFS4_CONTENT_HOLE), "read_plus content")
            offset = u.u64()
            if kind == NFS4_CONTENT_DATA:
                data = u.opaque(self.count, "read_plus data")
                segments.append((offset, data, len(data)))
            else:
                segments.append((offset, None, u.u64()))
        return eof, segments


@dataclass
class WriteResult:
    count: int
    committed: int
    verifier: bytes


@dataclass
class Write(Op):
    stateid: bytes
    offset: int
    stable: int
    data: bytes
    num = OP_WRITE

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        p.u64(self.offset)
        p.u32(self.stable)
        p.opaque(self.data)

    def decode(self, u):
        count = u.u32()
        if count > len(self.data):
            raise ProtocolError(f"WRITE of {len(self.data)} bytes answered with count {count}")
        return WriteResult(count, u.enum(STABLE_HOW, "stable_how"), write_verifier(u))


@dataclass
class Commit(Op):
    offset: int = 0
    count: int = 0
    num = OP_COMMIT

    def encode(self, p):
        p.u64(self.offset)
        p.u32(self.count)

    def decode(self, u):
        return write_verifier(u)


# -- NFSv4.2 ------------------------------------------------------------------------


def write_response(u):
    """write_response4: (callback stateid or None, count, committed, verifier)."""
    ids = [stateid(u) for _ in range(u.count(1, 16, "callback ids"))]
    count = u.u64()
    committed = u.enum(STABLE_HOW, "stable_how")
    return (ids[0] if ids else None), WriteResult(count, committed, write_verifier(u))


@dataclass
class NetLoc:
    """netloc4: where one server of an inter-server copy is.  ``value`` is a name or URL
    (str), or for NL4_NETADDR a (netid, universal address) pair: ("tcp", "10.0.0.1.8.1")."""
    kind: int
    value: object

    @classmethod
    def address(cls, host, port):
        """The NL4_NETADDR of an IP address and port (RFC 5665 universal address)."""
        ip = ipaddress.ip_address(host)
        netid = "tcp" if ip.version == 4 else "tcp6"
        return cls(NL4_NETADDR, (netid, f"{ip.compressed}.{port >> 8}.{port & 0xFF}"))

    def encode(self, p):
        p.u32(self.kind)
        if self.kind == NL4_NETADDR:
            netid, uaddr = self.value
            p.opaque(netid.encode())
            p.opaque(uaddr.encode())
        else:
            p.opaque(self.value.encode())

    @classmethod
    def decode(cls, u):
        kind = u.enum((NL4_NAME, NL4_URL, NL4_NETADDR), "netloc type")
        if kind == NL4_NETADDR:
            netid = u.opaque(OPAQUE_LIMIT, "netid").decode(errors="replace")
            return cls(kind, (netid, u.opaque(OPAQUE_LIMIT, "universal address").decode(errors="replace")))
        return cls(kind, u.opaque(OPAQUE_LIMIT, "server name").decode(errors="replace"))


@dataclass
class CopyResult:
    callback: bytes | None  # the copy's stateid when it runs asynchronously
    result: WriteResult
    synchronous: bool


@dataclass
class Copy(Op):
    """COPY from the saved filehandle to the current one.

    With ``sources`` (where the source server is) it is an inter-server copy: the saved
    filehandle and ``src_stateid`` are the source server's, the latter from its COPY_NOTIFY.
    """
    src_stateid: bytes
    dst_stateid: bytes
    src_offset: int
    dst_offset: int
    count: int
    synchronous: bool
    sources: list = field(default_factory=list)  # NetLoc
    num = OP_COPY

    def encode(self, p):
        p.fixed(self.src_stateid, STATEID_SIZE)
        p.fixed(self.dst_stateid, STATEID_SIZE)
        p.u64(self.src_offset)
        p.u64(self.dst_offset)
        p.u64(self.count)
        p.bool(True)  # consecutive: a short count is a prefix
        p.bool(self.synchronous)
        p.u32(len(self.sources))
        for source in self.sources:
            source.encode(p)

    def decode(self, u):
        callback, result = write_response(u)
        u.bool()  # consecutive
        return CopyResult(callback, result, u.bool())

    def decode_error(self, u, status):
        if status == errors.OFFLOAD_NO_REQS:  # copy_requirements4: would the server copy synchronously?
            u.bool()
            return u.bool()
        return None


@dataclass
class Notified:
    stateid: bytes  # what the destination server reads the source file with
    sources: list  # NetLoc: where the destination server reaches this one
    lease: int  # seconds the destination has to start using the stateid


@dataclass
class CopyNotify(Op):
    """COPY_NOTIFY to the source server: let ``destination`` (a NetLoc) read the current file."""
    stateid: bytes
    destination: NetLoc
    num = OP_COPY_NOTIFY

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        self.destination.encode(p)

    def decode(self, u):
        lease = u.i64()
        u.u32()  # nanoseconds
        sid = stateid(u)
        sources = [NetLoc.decode(u) for _ in range(u.count(MAX_SOURCE_SERVERS, 8, "source servers"))]
        return Notified(sid, sources, lease)


@dataclass
class OffloadStatus(Op):
    """OFFLOAD_STATUS: (bytes copied so far, final status or None while running)."""
    stateid: bytes
    num = OP_OFFLOAD_STATUS

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)

    def decode(self, u):
        count = u.u64()
        complete = [u.u32() for _ in range(u.count(1, 4, "osr_complete"))]
        return count, (complete[0] if complete else None)


@dataclass
class OffloadCancel(Op):
    stateid: bytes
    num = OP_OFFLOAD_CANCEL

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)


@dataclass
class Clone(Op):
    src_stateid: bytes
    dst_stateid: bytes
    src_offset: int
    dst_offset: int
    count: int
    num = OP_CLONE

    def encode(self, p):
        p.fixed(self.src_stateid, STATEID_SIZE)
        p.fixed(self.dst_stateid, STATEID_SIZE)
        p.u64(self.src_offset)
        p.u64(self.dst_offset)
        p.u64(self.count)


@dataclass
class Seek(Op):
    """SEEK: (eof, offset) of the next data (``hole`` False) or hole at or after ``offset``."""
    stateid: bytes
    offset: int
    hole: bool
    num = OP_SEEK

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        p.u64(self.offset)
        p.u32(NFS4_CONTENT_HOLE if self.hole else NFS4_CONTENT_DATA)

    def decode(self, u):
        return u.bool(), u.u64()


@dataclass
class Allocate(Op):
    """ALLOCATE, or DEALLOCATE (punch a hole) with ``deallocate``."""
    stateid: bytes
    offset: int
    length: int
    deallocate: bool = False

    @property
    def num(self):
        return OP_DEALLOCATE if self.deallocate else OP_ALLOCATE

    def encode(self, p):
        p.fixed(self.stateid, STATEID_SIZE)
        p.u64(self.offset)
        p.u64(self.length)


# -- extended attributes (RFC 8276: the user namespace, names without "user.") -----------

SETXATTR4_EITHER, SETXATTR4_CREATE, SETXATTR4_REPLACE = 0, 1, 2


@dataclass
class GetXattr(Op):
    name: bytes
    num = OP_GETXATTR

    def encode(self, p):
        p.opaque(self.name)

    def decode(self, u):
        return u.opaque(XATTR_SIZE_MAX, "xattr value")


@dataclass
class SetXattr(Op):
    option: int
    name: bytes
    value: bytes
    num = OP_SETXATTR

    def encode(self, p):
        p.u32(self.option)
        p.opaque(self.name)
        p.opaque(self.value)

    def decode(self, u):
        change_info(u)


@dataclass
class ListXattrs(Op):
    """LISTXATTRS: (next cookie, names, eof)."""
    cookie: int
    maxcount: int
    num = OP_LISTXATTRS

    def encode(self, p):
        p.u64(self.cookie)
        p.u32(self.maxcount)

    def decode(self, u):
        cookie = u.u64()
        names = [u.opaque(NAME_LIMIT, "xattr name") for _ in range(u.count(self.maxcount, 4, "xattr names"))]
        return cookie, names, u.bool()


@dataclass
class RemoveXattr(Op):
    name: bytes
    num = OP_REMOVEXATTR

    def encode(self, p):
        p.opaque(self.name)

    def decode(self, u):
        change_info(u)


# -- client and session -------------------------------------------------------------


@dataclass
class ExchangeIdResult:
    clientid: int
    sequenceid: int
    flags: int
    server_major: bytes
    server_scope: bytes


@dataclass
class ExchangeId(Op):
    verifier: bytes
    owner: bytes
    num = OP_EXCHANGE_ID

    def encode(self, p):
        p.fixed(self.verifier, 8)
        p.opaque(self.owner)
        p.u32(0)  # flags
        p.u32(0)  # SP4_NONE
        p.u32(0)  # no implementation id

    def decode(self, u):
        clientid, seq, flags = u.u64(), u.u32(), u.u32()
        protect = u.u32()
        if protect != 0:
            raise ProtocolError(f"state protection {protect} granted but not asked for")
        u.u64()  # server owner minor id
        major = u.opaque(OPAQUE_LIMIT, "server owner")
        scope = u.opaque(OPAQUE_LIMIT, "server scope")
        for _ in range(u.count(1, 20, "implementation ids")):
            u.opaque(OPAQUE_LIMIT, "implementation domain")
            u.opaque(OPAQUE_LIMIT, "implementation name")
            u.i64()
            u.u32()
        return ExchangeIdResult(clientid, seq, flags, major, scope)


@dataclass
class ChannelAttrs:
    max_request: int
    max_response: int
    max_response_cached: int
    max_operations: int
    max_requests: int

    def encode(self, p):
        p.u32(0)  # header pad
        for v in (self.max_request, self.max_response, self.max_response_cached,
                  self.max_operations, self.max_requests):
            p.u32(v)
        p.u32(0)  # no RDMA

    @classmethod
    def decode(cls, u):
        u.u32()
        values = [u.u32() for _ in range(5)]
        for _ in range(u.count(1, 4, "rdma_ird")):
            u.u32()
        return cls(*values)


@dataclass
class SessionResult:
    sessionid: bytes
    flags: int
    fore: ChannelAttrs
    back: ChannelAttrs


@dataclass
class CreateSession(Op):
    clientid: int
    sequence: int
    fore: ChannelAttrs
    back: ChannelAttrs
    cb_program: int
    num = OP_CREATE_SESSION

    def encode(self, p):
        p.u64(self.clientid)
        p.u32(self.sequence)
        p.u32(CREATE_SESSION_CONN_BACK_CHAN)
        self.fore.encode(p)
        self.back.encode(p)
        p.u32(self.cb_program)
        p.u32(1)  # one callback security flavor:
        p.u32(0)  # AUTH_NONE

    def decode(self, u):
        sessionid = u.fixed(16)
        u.u32()
        flags = u.u32()
        return SessionResult(sessionid, flags, ChannelAttrs.decode(u), ChannelAttrs.decode(u))


@dataclass
class BindConnToSession(Op):
    sessionid: bytes
    num = OP_BIND_CONN_TO_SESSION

    def encode(self, p):
        p.fixed(self.sessionid, 16)
        p.u32(CDFC4_FORE_OR_BOTH)
        p.bool(False)

    def decode(self, u):
        u.fixed(16)
        direction = u.enum((1, 2, 3), "channel direction")
        u.bool()
        return direction


@dataclass
class DestroySession(Op):
    sessionid: bytes
    num = OP_DESTROY_SESSION

    def encode(self, p):
        p.fixed(self.sessionid, 16)


@dataclass
class DestroyClientId(Op):
    clientid: int
    num = OP_DESTROY_CLIENTID

    def encode(self, p):
        p.u64(self.clientid)


@dataclass
class ReclaimComplete(Op):
    num = OP_RECLAIM_COMPLETE

    def encode(self, p):
        p.bool(False)


class _SecInfoOp(Op):
    def decode(self, u):
        """[(flavor, mechanism OID, service)], best first; OID and service for RPCSEC_GSS only."""
        flavours = []
        for _ in range(u.count(64, 4, "secinfo")):
            flavor = u.u32()
            if flavor == RPCSEC_GSS:
                oid = u.opaque(64, "sec_oid4")
                u.u32()  # qop
                flavours.append((flavor, oid, u.u32()))
            else:
                flavours.append((flavor, None, None))
        return flavours


@dataclass
class SecInfo(_SecInfoOp):
    """The flavours the server takes for ``name`` in the current directory (it consumes the filehandle)."""
    name: bytes
    num = OP_SECINFO

    def encode(self, p):
        p.opaque(self.name)


@dataclass
class SecInfoNoName(_SecInfoOp):
    """The flavours the server takes for the current filehandle."""
    num = OP_SECINFO_NO_NAME

    def encode(self, p):
        p.u32(SECINFO_STYLE4_CURRENT_FH)


@dataclass
class SequenceResult:
    highest_slot: int
    target_highest_slot: int
    status_flags: int


@dataclass
class Sequence(Op):
    sessionid: bytes
    seqid: int
    slot: int
    highest_slot: int
    cache: bool
    num = OP_SEQUENCE

    def encode(self, p):
        p.fixed(self.sessionid, 16)
        p.u32(self.seqid)
        p.u32(self.slot)
        p.u32(self.highest_slot)
        p.bool(self.cache)

    def decode(self, u):
        if u.fixed(16) != self.sessionid or u.u32() != self.seqid or u.u32() != self.slot:
            raise ProtocolError("SEQUENCE answered for another session, slot or sequence")
        return SequenceResult(u.u32(), u.u32(), u.u32())
