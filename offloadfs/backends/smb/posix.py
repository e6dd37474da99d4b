"""SMB 3.1.1 POSIX extensions: the negotiate context, the create context and the POSIX information class.

A server that has them (Samba 4.22 with `smb3 unix extensions = yes`)
answers our SMB2_POSIX_EXTENSIONS_AVAILABLE negotiate context with its own.
Each open that carries the POSIX create context (with the mode of what it
creates) then has POSIX semantics: case-sensitive names, and
SMB2_FILE_POSIX_INFORMATION (in QUERY_INFO and QUERY_DIRECTORY) with the
file's mode, link count and owner and group as SIDs; Samba reports unix
ids as S-1-22-1-uid and S-1-22-2-gid.  Layouts: Samba's
librpc/idl/smb3posix.idl, the Linux cifs client's struct smb311_posix_qinfo.

smbprotocol knows no such negotiate context (its parser refuses the type),
so ours is spliced into the request it packed, and the server's cut out of
the reply before smbprotocol parses it.
"""
import stat
import struct

from .info import Attributes, from_filetime
from .wire import HEADER_SIZE, WireError, _unpack

NEGOTIATE_CONTEXT = 0x100  # SMB2_POSIX_EXTENSIONS_AVAILABLE
TAG = bytes.fromhex("93AD25509CB411E7B42383DE968BCD7C")  # its data, and the create context's name
FILE_POSIX_INFORMATION = 100  # QUERY_INFO and QUERY_DIRECTORY class

_CONTEXT = struct.Struct("<HHI")  # 2.2.3.1: type, data length, reserved
_REQUEST_COUNT = struct.Struct("<H")  # 2.2.3: NegotiateContextCount, at this offset in the request body
_REQUEST_COUNT_AT = 32
_REPLY = struct.Struct("<HHHH16sIIIIqqHHI")  # 2.2.4 up to NegotiateContextOffset

# The mode's file type travels as a number in bits 12-15 (Samba's unix_mode_to_wire), not as S_IFMT bits.
TYPE_SHIFT = 12
TYPES = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK)
UNIX_USERS = (1, 22, (1,))  # S-1-22-1-uid: revision, identifier authority, the sub-authorities before the id
UNIX_GROUPS = (1, 22, (2,))
# The owner of a file whose SID is not a unix id (Samba names users of its passdb by their domain SID,
# S-1-5-21-...-rid): the kernel's overflow id, "nobody", as NFS shows an owner it cannot map.
UNKNOWN_ID = 65534


def with_negotiate_context(body):
    """A packed SMB 3.1.1 NEGOTIATE request ``body`` with the POSIX negotiate context added at its end."""
    (count,) = _unpack(_REQUEST_COUNT, body, _REQUEST_COUNT_AT, "NEGOTIATE request")
    body = bytearray(body)
    body += bytes(-(HEADER_SIZE + len(body)) % 8)  # each context starts on 8 bytes
    body += _CONTEXT.pack(NEGOTIATE_CONTEXT, len(TAG), 0) + TAG
    _REQUEST_COUNT.pack_into(body, _REQUEST_COUNT_AT, count + 1)
    return bytes(body)


def split_negotiate_reply(body):
    """(whether the server offers POSIX extensions, ``body`` without its POSIX negotiate context).

    ``body``: a NEGOTIATE response after its header.  Contexts follow the
    security buffer to the end, each starting on 8 bytes; cutting one out
    keeps every other where its alignment wants it.
    """
    fields = _unpack(_REPLY, body, what="NEGOTIATE")
    count, offset = fields[3], fields[-1]
    if count == 0:
        return False, body
    start = offset - HEADER_SIZE
    if start < _REPLY.size or start > len(body):
        raise WireError(f"NEGOTIATE: contexts at {offset} outside a {len(body)}-byte reply")
    body = bytearray(body)
    at, offered = start, False
    for _ in range(count):
        kind, length, _ = _unpack(_CONTEXT, body, at, "negotiate context")
        end = at + _CONTEXT.size + length
        if end > len(body):
            raise WireError(f"negotiate context at {at}+{length} outside a {len(body)}-byte reply")
        step = min(end + (-end % 8), len(body))
        if kind == NEGOTIATE_CONTEXT:
            offered = offered or bytes(body[at + _CONTEXT.size:end]) == TAG
            del body[at:step]
            count -= 1
            struct.pack_into("<H", body, 6, count)
        else:
            at = step
    return offered, bytes(body)


def create_context(mode=0):
    """The POSIX create context: POSIX semantics for this open; ``mode``: the permissions of what it creates."""
    return TAG, struct.pack("<I", mode & 0o7777)


def mode_from_wire(wire):
    kind = (wire >> TYPE_SHIFT) & 0xF
    if kind >= len(TYPES):
        raise WireError(f"POSIX information: unknown file type {kind}")
    return TYPES[kind] | (wire & 0o7777)


def _sid(data, offset, what):
    """(revision, authority, sub-authorities) of the SID at ``offset`` and the offset after it."""
    revision, n = _unpack(_SID_HEAD, data, offset, what)
    if n > 15:
        raise WireError(f"{what}: a SID of {n} sub-authorities")
    authority = int.from_bytes(bytes(data[offset + 2:offset + 8]), "big")
    subs = struct.Struct(f"<{n}I")
    return (revision, authority, _unpack(subs, data, offset + 8, what)), offset + 8 + subs.size


_SID_HEAD = struct.Struct("<BB6x")

# Samba's chmod from a POSIX client: a DACL of one ACE for S-1-5-88-3-mode (smbd's
# check_smb2_posix_chmod_ace), which it takes for the permission bits only: setuid, setgid and sticky
# cannot be set this way.
NFS_MODE = (1, 5, (88, 3))
SETTABLE_MODE = 0o777
OWNER, GROUP, DACL = 0x1, 0x2, 0x4  # AdditionalInformation: the parts of a security descriptor set
_SD = struct.Struct("<BBHIIII")  # MS-DTYP 2.4.6 self-relative: revision, sbz1, control, owner, group, sacl, dacl
_ACL = struct.Struct("<BBHHH")  # 2.4.5: revision, sbz1, size, ace count, sbz2
_ACE = struct.Struct("<BBHI")  # 2.4.4.2 ACCESS_ALLOWED_ACE: type, flags, size, mask, then the SID
SE_DACL_PRESENT = 0x0004
SE_SELF_RELATIVE = 0x8000


def pack_sid(kind, rid):
    """The SID ``kind`` (UNIX_USERS, UNIX_GROUPS, NFS_MODE) followed by ``rid``."""
    revision, authority, subs = kind
    subs = (*subs, rid)
    return struct.pack("<BB", revision, len(subs)) + authority.to_bytes(6, "big") + struct.pack(f"<{len(subs)}I",
                                                                                                  *subs)


def security_descriptor(uid=None, gid=None, mode=None):
    """(The self-relative security descriptor that sets what is not None, the parts it sets) as Samba takes
    them from a POSIX client: owner S-1-22-1-uid, group S-1-22-2-gid, a mode as NFS_MODE says."""
    body, offsets, parts = b"", [0, 0, 0, 0], 0
    for i, (value, kind, part) in enumerate([(uid, UNIX_USERS, OWNER), (gid, UNIX_GROUPS, GROUP)]):
        if value is not None:
            offsets[i] = _SD.size + len(body)
            body += pack_sid(kind, value)
            parts |= part
    if mode is not None:
        sid = pack_sid(NFS_MODE, mode & SETTABLE_MODE)
        ace = _ACE.pack(0, 0, _ACE.size + len(sid), 0) + sid
        offsets[3] = _SD.size + len(body)
        body += _ACL.pack(2, 0, _ACL.size + len(ace), 1, 0) + ace
        parts |= DACL
    control = SE_SELF_RELATIVE | (SE_DACL_PRESENT if mode is not None else 0)
    return _SD.pack(1, 0, control, *offsets) + body, parts


def unix_id(sid, unix):
    """The uid (or gid) that ``sid`` names where it is one of ``unix`` (UNIX_USERS, UNIX_GROUPS), else
    UNKNOWN_ID."""
    revision, authority, subs = sid
    prefix = unix[2]
    if (revision, authority) == unix[:2] and len(subs) == len(prefix) + 1 and subs[:len(prefix)] == prefix:
        return subs[-1]
    return UNKNOWN_ID


class FilePosixInformation:
    """SMB2_FILE_POSIX_INFORMATION: times, sizes (the end of file first, unlike FileAllInformation),
    attributes, inode, device, then link count, reparse tag, mode and the owner and group SIDs (what the
    POSIX create context's reply carries too)."""
    FORMAT = struct.Struct("<qqqqqqIqII")
    CC = struct.Struct("<III")  # link count, reparse tag, mode

    @classmethod
    def unpack(cls, data, offset=0, what="FilePosixInformation"):
        """(Attributes, the offset after it)."""
        btime, atime, mtime, ctime, eof, alloc, attrs, inode, _, _ = _unpack(cls.FORMAT, data, offset, what)
        offset += cls.FORMAT.size
        nlink, tag, wire = _unpack(cls.CC, data, offset, what)
        owner, offset = _sid(data, offset + cls.CC.size, what)
        group, offset = _sid(data, offset, what)
        a = Attributes(inode, attrs, eof, alloc, nlink, from_filetime(atime), from_filetime(mtime),
                       from_filetime(ctime), from_filetime(btime), mode=mode_from_wire(wire), reparse_tag=tag,
                       uid=unix_id(owner, UNIX_USERS), gid=unix_id(group, UNIX_GROUPS))
        return a, offset


class FilePosixDirectoryInformation:
    """One QUERY_DIRECTORY entry of class FILE_POSIX_INFORMATION: next offset, file index, the information,
    then the name's length and the name."""
    HEAD = struct.Struct("<II")
    NAME = struct.Struct("<I")

    @classmethod
    def unpack_list(cls, data):
        """[(name, Attributes)] of every entry in the chain."""
        entries = []
        offset = 0
        what = "FilePosixInformation entry"
        while True:
            next_offset, _ = _unpack(cls.HEAD, data, offset, what)
            a, at = FilePosixInformation.unpack(data, offset + cls.HEAD.size, what)
            (name_len,) = _unpack(cls.NAME, data, at, what)
            start = at + cls.NAME.size
            if name_len % 2 or start + name_len > len(data):
                raise WireError(f"{what}: name of {name_len} bytes outside the reply")
            entries.append((bytes(data[start:start + name_len]).decode("utf-16-le", "surrogatepass"), a))
            if next_offset == 0:
                return entries
            if next_offset < start + name_len - offset or offset + next_offset >= len(data):
                raise WireError(f"{what}: next entry at {offset}+{next_offset} outside a {len(data)}-byte reply")
            offset += next_offset


# -- symlinks and special files ---------------------------------------------------------------------------
#
# Samba 4.22 makes neither for an SMB2 client: a POSIX client creates a regular file and sets a reparse
# point on it (FSCTL_SET_REPARSE_POINT, which smbd keeps in an xattr), and smbd reports its type from
# the tag: a symlink for IO_REPARSE_TAG_SYMLINK, a FIFO, socket or device for IO_REPARSE_TAG_NFS
# (smb2_posix.c).  As the Linux cifs client does.  Such a file is opened as itself (OPEN_REPARSE_POINT),
# never followed by the server.

FSCTL_SET_REPARSE_POINT = 0x000900A4
FSCTL_GET_REPARSE_POINT = 0x000900A8
OPEN_REPARSE_POINT = 0x00200000  # create option
TAG_SYMLINK = 0xA000000C
TAG_NFS = 0x80000014
SYMLINK_RELATIVE = 0x1
_REPARSE = struct.Struct("<IHH")  # MS-FSCC 2.1.2.1: tag, data length, reserved
_SYMLINK = struct.Struct("<HHHHI")  # 2.1.2.4: substitute name offset and length, print name's, flags
_NFS_TYPE = struct.Struct("<Q")  # MS-FSCC 2.1.2.6: the type, then its data
_DEVICE = struct.Struct("<II")  # major, minor
NFS_TYPES = {stat.S_IFLNK: 0x014B4E4C, stat.S_IFCHR: 0x00524843, stat.S_IFBLK: 0x004B4C42,
             stat.S_IFIFO: 0x4F464946, stat.S_IFSOCK: 0x4B434F53}  # "LNK", "CHR", "BLK", "FIFO", "SOCK"
MAX_REPARSE = 16384  # MS-FSCC: a reparse point holds at most 16 KiB


def _reparse(tag, data):
    return _REPARSE.pack(tag, len(data), 0) + data


def symlink_reparse(target):
    """The reparse point of a symlink to ``target`` (str), the name as the link holds it."""
    name = target.encode("utf-16-le", "surrogatepass")
    flags = 0 if target.startswith("/") else SYMLINK_RELATIVE
    return _reparse(TAG_SYMLINK, _SYMLINK.pack(0, len(name), len(name), len(name), flags) + name + name)


def special_reparse(mode, major=0, minor=0):
    """The reparse point of a FIFO, socket or device node (``mode``'s type)."""
    kind = stat.S_IFMT(mode)
    data = _NFS_TYPE.pack(NFS_TYPES[kind])
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        data += _DEVICE.pack(major, minor)
    return _reparse(TAG_NFS, data)


def _reparse_body(data):
    """(tag, data) of a reparse point."""
    tag, length, _ = _unpack(_REPARSE, data, what="reparse point")
    body = data[_REPARSE.size:_REPARSE.size + length]
    if len(body) != length:
        raise WireError(f"reparse point: {length} bytes of data, {len(body)} there")
    return tag, body


def device_number(data):
    """(major, minor) of a device node's reparse point, an NFS one of type CHR or BLK: where the server
    keeps them, as it reports a device node as such but with the device of its own file system."""
    tag, body = _reparse_body(data)
    kind = _unpack(_NFS_TYPE, body, what="NFS reparse point")[0] if tag == TAG_NFS else None
    if kind not in (NFS_TYPES[stat.S_IFCHR], NFS_TYPES[stat.S_IFBLK]):
        raise WireError(f"reparse point of tag 0x{tag:08X}: not a device node")
    return _unpack(_DEVICE, body, _NFS_TYPE.size, "NFS device reparse point")


def symlink_target(data):
    """The target (str) of a symlink's reparse point: a SYMLINK one, or an NFS one of type LNK."""
    tag, body = _reparse_body(data)
    if tag == TAG_SYMLINK:
        offset, size, _, _, _ = _unpack(_SYMLINK, body, what="symlink reparse point")
        name = bytes(body[_SYMLINK.size + offset:_SYMLINK.size + offset + size])
        if len(name) != size or size % 2:
            raise WireError("symlink reparse point: its name outside it")
    elif tag == TAG_NFS and _unpack(_NFS_TYPE, body, what="NFS reparse point")[0] == NFS_TYPES[stat.S_IFLNK]:
        name = bytes(body[_NFS_TYPE.size:])
        if len(name) % 2:
            raise WireError("NFS symlink reparse point: half a character")
    else:
        raise WireError(f"reparse point of tag 0x{tag:08X}: not a symlink")
    return name.decode("utf-16-le", "surrogatepass")

