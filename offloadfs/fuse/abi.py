"""The FUSE kernel ABI: opcodes, flags and wire structures of protocol 7.45.

Written from include/uapi/linux/fuse.h.  Structures are ``struct.Struct``
objects in native byte order, because /dev/fuse speaks the host's layout.
Nothing here knows about files on servers.
"""
import struct

KERNEL_VERSION = 7
KERNEL_MINOR_VERSION = 45
OLDEST_MINOR_VERSION = 31  # first version with the 64-byte INIT reply and MAX_PAGES
ROOT_ID = 1

# enum fuse_opcode
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
IOCTL = 39
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
SYNCFS = 50
STATX = 52
COPY_FILE_RANGE_64 = 53
OPCODE_NAMES = {v: k for k, v in dict(globals()).items() if k.isupper() and "VERSION" not in k and k != "ROOT_ID"}

# INIT flags (flags | flags2 << 32)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
HANDLE_KILLPRIV_V2 = 1 << 28
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
FOPEN_PASSTHROUGH = 1 << 7

# fuse_setattr_in.valid
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_CTIME = 1 << 10
FATTR_KILL_SUIDGID = 1 << 11

FUSE_GETATTR_FH = 1 << 0
FUSE_WRITE_KILL_SUIDGID = 1 << 2
FUSE_OPEN_KILL_SUIDGID = 1 << 0
FUSE_FSYNC_FDATASYNC = 1 << 0

# enum fuse_notify_code
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3

# ioctls on /dev/fuse: _IOW(229, 1, struct fuse_backing_map), _IOW(229, 2, uint32_t)
DEV_IOC_BACKING_OPEN = 0x4010E501
DEV_IOC_BACKING_CLOSE = 0x4004E502

# A request buffer must hold the largest WRITE plus its headers.
MIN_READ_BUFFER = 8192

in_header = struct.Struct("=IIQQIIIHH")
out_header = struct.Struct("=IiQ")
attr = struct.Struct("=QQQqqqIIIIIIIIII")  # times are signed: before 1970 is negative
entry_out = struct.Struct("=QQQQII" + attr.format[1:])
attr_out = struct.Struct("=QII" + attr.format[1:])
init_in = struct.Struct("=IIII")
init_in_flags2 = struct.Struct("=I")
init_out = struct.Struct("=IIIIHHIIHHIIH22x")
forget_in = struct.Struct("=Q")
batch_forget_in = struct.Struct("=II")
forget_one = struct.Struct("=QQ")
getattr_in = struct.Struct("=IIQ")
setattr_in = struct.Struct("=IIQQQQQQIIIIIIII")
mknod_in = struct.Struct("=IIII")
mkdir_in = struct.Struct("=II")
rename_in = struct.Struct("=Q")
rename2_in = struct.Struct("=QII")
link_in = struct.Struct("=Q")
open_in = struct.Struct("=II")
create_in = struct.Struct("=IIII")
open_out = struct.Struct("=QIi")
release_in = struct.Struct("=QIIQ")
flush_in = struct.Struct("=QIIQ")
read_in = struct.Struct("=QQIIQII")
write_in = struct.Struct("=QQIIQII")
write_out = struct.Struct("=II")
statfs_out = struct.Struct("=QQQQQIIII24x")
fsync_in = struct.Struct("=QII")
setxattr_in = struct.Struct("=II")
getxattr_in = struct.Struct("=II")
getxattr_out = struct.Struct("=II")
access_in = struct.Struct("=II")
interrupt_in = struct.Struct("=Q")
dirent = struct.Struct("=QQII")
lseek_in = struct.Struct("=QQII")
lseek_out = struct.Struct("=Q")
fallocate_in = struct.Struct("=QQQII")
ioctl_in = struct.Struct("=QIIQII")
copy_file_range_in = struct.Struct("=QQQQQQQ")
copy_file_range_out = struct.Struct("=Q")
notify_inval_inode_out = struct.Struct("=Qqq")
notify_inval_entry_out = struct.Struct("=QII")
backing_map = struct.Struct("=iIQ")

assert in_header.size == 40 and out_header.size == 16
assert attr.size == 88 and entry_out.size == 128 and attr_out.size == 104
assert init_out.size == 64 and setattr_in.size == 88 and statfs_out.size == 80
assert read_in.size == 40 and copy_file_range_in.size == 56 and fallocate_in.size == 32
