"""File and filesystem information classes (MS-FSCC 2.4, 2.5) that we query and set.

Times travel as FILETIME (100 ns since 1601); we keep nanoseconds since 1970,
so a timestamp set through us reads back exactly to 100 ns.
"""
import struct
from dataclasses import dataclass

from .wire import WireError, _unpack

# FileInformationClass / FileSystemInformationClass values.
FILE_BASIC = 4
FILE_STANDARD = 5
FILE_RENAME = 10
FILE_LINK = 11
FILE_DISPOSITION = 13
FILE_FULL_EA = 15
FILE_ALL = 18
FILE_END_OF_FILE = 20
FILE_ID_BOTH_DIRECTORY = 37
FS_ATTRIBUTE = 5
FS_FULL_SIZE = 7

ATTR_READONLY = 0x01
ATTR_DIRECTORY = 0x10
ATTR_NORMAL = 0x80  # "no attributes": 0 in FileBasicInformation means "leave unchanged"
FS_SUPPORTS_BLOCK_REFCOUNTING = 0x08000000

FILETIME_EPOCH = 116444736000000000  # 1970-01-01 in FILETIME units


def to_filetime(ns):
    return ns // 100 + FILETIME_EPOCH


def from_filetime(ft):
    return (ft - FILETIME_EPOCH) * 100 if ft else 0


@dataclass(slots=True)
class Attributes:
    """What a stat needs, from FileAllInformation or a directory entry."""
    file_id: int
    attributes: int
    size: int
    allocation: int
    nlink: int | None  # None: a directory entry carries no link count
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    btime_ns: int  # creation; made up (and moving) for files Samba did not create, so checked only on reopen
    delete_pending: bool = False  # unlinked, and gone once its last handle closes (FileAllInformation only)
    # From POSIX information (posix.py) only: the whole st_mode, the reparse tag, the owner and group.
    mode: int | None = None
    reparse_tag: int = 0
    uid: int | None = None
    gid: int | None = None

    @property
    def is_dir(self):
        return bool(self.attributes & ATTR_DIRECTORY)


class FileAllInformation:
    """2.4.2: Basic + Standard + Internal (the file id) + the rest, which we skip."""
    FORMAT = struct.Struct("<qqqqI4xqqIBBxxq")

    @classmethod
    def unpack(cls, data):
        (btime, atime, mtime, ctime, attrs, alloc, eof, nlink, delete_pending, _, file_id) = _unpack(
            cls.FORMAT, data, what="FileAllInformation")
        return Attributes(file_id, attrs, eof, alloc, nlink, from_filetime(atime), from_filetime(mtime),
                          from_filetime(ctime), from_filetime(btime), bool(delete_pending))


class FileStandardInformation:
    """2.4.41: sizes, link count, and whether it is a directory."""
    FORMAT = struct.Struct("<qqIBBxx")

    @classmethod
    def end_of_file(cls, data):
        return _unpack(cls.FORMAT, data, what="FileStandardInformation")[1]


class FileIdBothDirectoryInformation:
    """2.4.17: one directory entry; a QUERY_DIRECTORY reply is a chain of them."""
    FORMAT = struct.Struct("<IIqqqqqqIIIBx24sxxq")

    @classmethod
    def unpack_list(cls, data):
        """[(name, Attributes)] of every entry in the chain."""
        entries = []
        offset = 0
        while True:
            (next_offset, _, btime, atime, mtime, ctime, eof, alloc, attrs, name_len, _, _, _, file_id) = _unpack(
                cls.FORMAT, data, offset, "FileIdBothDirectoryInformation")
            start = offset + cls.FORMAT.size
            if name_len % 2 or start + name_len > len(data):
                raise WireError(f"FileIdBothDirectoryInformation: name of {name_len} bytes outside the reply")
            name = bytes(data[start:start + name_len]).decode("utf-16-le", "surrogatepass")
            entries.append((name, Attributes(file_id, attrs, eof, alloc, None, from_filetime(atime),
                                             from_filetime(mtime), from_filetime(ctime), from_filetime(btime))))
            if next_offset == 0:
                return entries
            if next_offset < cls.FORMAT.size or offset + next_offset >= len(data):
                raise WireError(f"FileIdBothDirectoryInformation: next entry at {offset}+{next_offset} "
                                f"outside a {len(data)}-byte reply")
            offset += next_offset


@dataclass(slots=True)
class FileFsFullSizeInformation:
    """2.5.4: sizes in allocation units."""
    FORMAT = struct.Struct("<qqqII")
    total_units: int
    caller_available_units: int
    actual_available_units: int
    sectors_per_unit: int
    bytes_per_sector: int

    @classmethod
    def unpack(cls, data):
        return cls(*_unpack(cls.FORMAT, data, what="FileFsFullSizeInformation"))


@dataclass(slots=True)
class FileFsAttributeInformation:
    """2.5.1: filesystem capability flags (block refcounting = duplicate extents) and name limit."""
    FORMAT = struct.Struct("<IiI")
    attributes: int
    max_name_length: int

    @classmethod
    def unpack(cls, data):
        attributes, max_name, _ = _unpack(cls.FORMAT, data, what="FileFsAttributeInformation")
        return cls(attributes, max_name)


@dataclass(slots=True)
class FileBasicInformation:
    """2.4.7 for SET_INFO: a zero time or attribute field means "leave unchanged"."""
    FORMAT = struct.Struct("<qqqqI4x")
    atime_ns: int | None = None
    mtime_ns: int | None = None
    attributes: int = 0

    def pack(self):
        def ft(ns):
            return 0 if ns is None else to_filetime(ns)
        return self.FORMAT.pack(0, ft(self.atime_ns), ft(self.mtime_ns), 0, self.attributes)


@dataclass(slots=True)
class FileEndOfFileInformation:
    """2.4.13: truncate or extend."""
    FORMAT = struct.Struct("<q")
    size: int

    def pack(self):
        return self.FORMAT.pack(self.size)


@dataclass(slots=True)
class FileRenameInformation:
    """2.4.37.2 (SMB2 layout), also the layout of FileLinkInformation (2.4.27.2).

    The new name is relative to the share's root, whatever directory it is in.
    """
    FORMAT = struct.Struct("<B7xQI")
    replace: bool
    name: str

    def pack(self):
        name = self.name.encode("utf-16-le", "surrogatepass")
        return self.FORMAT.pack(self.replace, 0, len(name)) + name


@dataclass(slots=True)
class FileDispositionInformation:
    """2.4.11: delete when the last handle closes."""
    delete: bool = True

    def pack(self):
        return bytes([self.delete])


@dataclass(slots=True)
class FullEa:
    """2.4.15 FILE_FULL_EA_INFORMATION: one extended attribute; a value of b"" deletes it."""
    HEAD = struct.Struct("<IBBH")
    name: bytes
    value: bytes

    @classmethod
    def pack_list(cls, eas):
        out = b""
        for i, ea in enumerate(eas):
            last = i == len(eas) - 1
            size = cls.HEAD.size + len(ea.name) + 1 + len(ea.value)
            padded = size + (0 if last else -size % 4)  # entries after the first start 4-byte aligned
            out += cls.HEAD.pack(0 if last else padded, 0, len(ea.name), len(ea.value))
            out += ea.name + b"\0" + ea.value + b"\0" * (padded - size)
        return out

    @classmethod
    def unpack_list(cls, data):
        eas = []
        offset = 0
        while len(data) - offset >= cls.HEAD.size:
            next_offset, _, name_len, value_len = cls.HEAD.unpack_from(data, offset)
            start = offset + cls.HEAD.size
            end = start + name_len + 1 + value_len
            if end > len(data):
                raise WireError(f"FileFullEaInformation: entry of {end - offset} bytes outside the reply")
            eas.append(cls(bytes(data[start:start + name_len]), bytes(data[start + name_len + 1:end])))
            if next_offset == 0:
                break
            if next_offset < end - offset:
                raise WireError("FileFullEaInformation: entries overlap")
            offset += next_offset
        return eas


@dataclass(slots=True)
class GetEa:
    """2.4.15.1 FILE_GET_EA_INFORMATION: the name of one EA to query."""
    name: bytes

    def pack(self):
        return struct.pack("<IB", 0, len(self.name)) + self.name + b"\0"
