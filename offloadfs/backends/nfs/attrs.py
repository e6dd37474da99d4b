"""File attributes (fattr4): the few we ask for, decoded strictly, and the few we set.

An attrlist4 carries values back to back with no lengths, so an attribute we
cannot decode makes the rest unreadable: a reply with a bit we did not ask
for is a protocol error rather than a guess.
"""
import pwd
import grp
import stat

from ..base import NOW
from .xdr import Packer, ProtocolError, Unpacker

SUPPORTED_ATTRS, TYPE, CHANGE, SIZE, LEASE_TIME = 0, 1, 3, 4, 10
FILEHANDLE, FILEID, FILES_AVAIL, FILES_FREE, FILES_TOTAL = 19, 20, 21, 22, 23
MAXNAME, MAXREAD, MAXWRITE = 29, 30, 31
MODE, NUMLINKS, OWNER, OWNER_GROUP, RAWDEV = 33, 35, 36, 37, 41
SPACE_AVAIL, SPACE_FREE, SPACE_TOTAL, SPACE_USED = 42, 43, 44, 45
TIME_ACCESS, TIME_ACCESS_SET, TIME_METADATA, TIME_MODIFY, TIME_MODIFY_SET = 47, 48, 52, 53, 54
CLONE_BLKSIZE, CHANGE_ATTR_TYPE = 77, 79
# change_attr_type4 (RFC 7862 12.2.3): the change attribute moves on every change to the file (a
# counter), where the others are times (coarse, or put back) or unspecified.
EXACT_CHANGE = frozenset({0, 1, 2})  # MONOTONIC_INCR, VERSION_COUNTER, VERSION_COUNTER_NOPNFS

NF4REG, NF4DIR, NF4BLK, NF4CHR, NF4LNK, NF4SOCK, NF4FIFO, NF4ATTRDIR, NF4NAMEDATTR = range(1, 10)
FORMAT = {NF4REG: stat.S_IFREG, NF4DIR: stat.S_IFDIR, NF4BLK: stat.S_IFBLK, NF4CHR: stat.S_IFCHR,
          NF4LNK: stat.S_IFLNK, NF4SOCK: stat.S_IFSOCK, NF4FIFO: stat.S_IFIFO,
          NF4ATTRDIR: stat.S_IFDIR, NF4NAMEDATTR: stat.S_IFREG}
DTYPE = {NF4REG: 8, NF4DIR: 4, NF4BLK: 6, NF4CHR: 2, NF4LNK: 10, NF4SOCK: 12, NF4FIFO: 1}
SET_TO_SERVER_TIME4, SET_TO_CLIENT_TIME4 = 0, 1  # time_how4
NOBODY = 65534
MAX_OWNER = 1024
FHSIZE = 128


def bits(*attrs):
    mask = 0
    for a in attrs:
        mask |= 1 << a
    return mask


STAT = bits(TYPE, CHANGE, SIZE, FILEID, MODE, NUMLINKS, OWNER, OWNER_GROUP, RAWDEV, SPACE_USED,
            TIME_ACCESS, TIME_METADATA, TIME_MODIFY)
STATFS = bits(FILES_AVAIL, FILES_FREE, FILES_TOTAL, MAXNAME, SPACE_AVAIL, SPACE_FREE, SPACE_TOTAL)
DIRENT = bits(TYPE, FILEID)  # and, where the server has them, STAT and FILEHANDLE: see NFSBackend.listdir


def _time(u):
    seconds, nseconds = u.i64(), u.u32()
    if nseconds >= 1_000_000_000:
        raise ProtocolError(f"nfstime4 with {nseconds} nanoseconds")
    return seconds * 1_000_000_000 + nseconds


def filehandle(u):
    fh = u.opaque(FHSIZE, "filehandle")
    if not fh:
        raise ProtocolError("empty filehandle")
    return fh


def _device(u):
    """specdata4 (major, minor): each a uint32, but Linux device numbers as FUSE carries them
    (32 bits) hold a 12-bit major and a 20-bit minor."""
    major, minor = u.u32(), u.u32()
    if major >> 12 or minor >> 20:
        raise ProtocolError(f"device number {major}:{minor} out of range")
    return major, minor


_DECODE = {
    SUPPORTED_ATTRS: lambda u: u.bitmap(),
    TYPE: lambda u: u.enum(FORMAT, "file type"),
    CHANGE: Unpacker.u64,
    SIZE: Unpacker.u64,
    LEASE_TIME: Unpacker.u32,
    FILEHANDLE: filehandle,
    FILEID: Unpacker.u64,
    FILES_AVAIL: Unpacker.u64,
    FILES_FREE: Unpacker.u64,
    FILES_TOTAL: Unpacker.u64,
    MAXNAME: Unpacker.u32,
    MAXREAD: Unpacker.u64,
    MAXWRITE: Unpacker.u64,
    MODE: Unpacker.u32,
    NUMLINKS: Unpacker.u32,
    OWNER: lambda u: u.opaque(MAX_OWNER, "owner"),
    OWNER_GROUP: lambda u: u.opaque(MAX_OWNER, "owner_group"),
    RAWDEV: _device,
    SPACE_AVAIL: Unpacker.u64,
    SPACE_FREE: Unpacker.u64,
    SPACE_TOTAL: Unpacker.u64,
    SPACE_USED: Unpacker.u64,
    TIME_ACCESS: _time,
    TIME_METADATA: _time,
    TIME_MODIFY: _time,
    CLONE_BLKSIZE: Unpacker.u32,
    CHANGE_ATTR_TYPE: Unpacker.u32,
}


def decode(u, asked):
    """A fattr4 -> {attribute number: value}; only attributes in ``asked`` may appear."""
    mask = u.bitmap()
    if mask & ~asked:
        raise ProtocolError(f"attributes {mask & ~asked:#x} sent but not asked for")
    body = Unpacker(u.opaque(u.left(), "attrlist"))
    values = {}
    n = 0
    while mask >> n:
        if mask >> n & 1:
            values[n] = _DECODE[n](body)
        n += 1
    body.done()
    return values


def _id(name, lookup):
    """An owner string -> a numeric id: "1000", "1000@domain" or "user@domain" (idmapping on);
    nobody for what maps to no id (str.isdigit takes "²" and "١", which int() refuses or reads)."""
    text = bytes(name).split(b"@", 1)[0].decode("utf-8", "replace")
    if text.isascii() and text.isdigit():
        number = int(text)
        return number if number < 0xFFFFFFFF else NOBODY  # -1 means "no id" to the kernel
    try:
        return lookup(text)
    except (KeyError, ValueError):  # ValueError: a NUL in the name
        return NOBODY


def uid_of(name):
    return _id(name, lambda n: pwd.getpwnam(n).pw_uid)


def gid_of(name):
    return _id(name, lambda n: grp.getgrnam(n).gr_gid)


def mode_of(values):
    return FORMAT.get(values.get(TYPE), stat.S_IFREG) | values.get(MODE, 0) & 0o7777


def encode(p: Packer, values):
    """A fattr4 from {attribute number: value}: mode, size, owner/group ids, times (ns, or base.NOW)."""
    body = Packer()
    for attr in sorted(values):
        v = values[attr]
        if attr == SIZE:
            body.u64(v)
        elif attr == MODE:
            body.u32(v & 0o7777)
        elif attr in (OWNER, OWNER_GROUP):
            body.opaque(str(v).encode())
        elif attr in (TIME_ACCESS_SET, TIME_MODIFY_SET) and v == NOW:
            body.u32(SET_TO_SERVER_TIME4)  # allowed to anyone who may write; a time of ours needs the owner
        elif attr in (TIME_ACCESS_SET, TIME_MODIFY_SET):
            body.u32(SET_TO_CLIENT_TIME4)
            seconds, ns = divmod(v, 1_000_000_000)
            body.i64(seconds)
            body.u32(ns)
        else:
            raise ValueError(f"cannot set attribute {attr}")
    p.bitmap(bits(*values))
    p.opaque(body.buf)
