"""NTSTATUS codes and the errno a local filesystem would give for each.

The statuses the backend acts on itself (end of file, end of a listing, a
buffer too small, ...) have names as well.
"""
import errno
import os

SUCCESS = 0x00000000
PENDING = 0x00000103
NOTIFY_CLEANUP = 0x0000010B  # a CHANGE_NOTIFY ended by the close of its handle
NOTIFY_ENUM_DIR = 0x0000010C  # changes too many to tell one by one
MORE_PROCESSING_REQUIRED = 0xC0000016
BUFFER_OVERFLOW = 0x80000005
NO_MORE_FILES = 0x80000006
INVALID_PARAMETER = 0xC000000D
END_OF_FILE = 0xC0000011
BUFFER_TOO_SMALL = 0xC0000023
INVALID_VIEW_SIZE = 0xC000001F
ACCESS_DENIED = 0xC0000022
OBJECT_NAME_COLLISION = 0xC0000035
NO_EAS_ON_FILE = 0xC0000052
CANNOT_DELETE = 0xC0000121
LOGON_FAILURE = 0xC000006D
BAD_NETWORK_NAME = 0xC00000CC
NETWORK_SESSION_EXPIRED = 0xC000035C

ERRNO = {
    0x80000005: errno.ERANGE,  # BUFFER_OVERFLOW
    0x80000012: errno.ENODATA,  # NO_MORE_EAS
    0xC0000001: errno.EIO,  # UNSUCCESSFUL
    0xC0000002: errno.EOPNOTSUPP,  # NOT_IMPLEMENTED
    0xC0000004: errno.EINVAL,  # INFO_LENGTH_MISMATCH
    0xC0000008: errno.EBADF,  # INVALID_HANDLE
    0xC000000D: errno.EINVAL,  # INVALID_PARAMETER
    0xC000000E: errno.ENODEV,  # NO_SUCH_DEVICE
    0xC000000F: errno.ENOENT,  # NO_SUCH_FILE
    0xC0000010: errno.EOPNOTSUPP,  # INVALID_DEVICE_REQUEST
    0xC0000022: errno.EACCES,  # ACCESS_DENIED
    0xC0000023: errno.ERANGE,  # BUFFER_TOO_SMALL
    0xC0000024: errno.EINVAL,  # OBJECT_TYPE_MISMATCH
    0xC0000033: errno.EINVAL,  # OBJECT_NAME_INVALID
    0xC0000034: errno.ENOENT,  # OBJECT_NAME_NOT_FOUND
    0xC0000035: errno.EEXIST,  # OBJECT_NAME_COLLISION
    0xC0000039: errno.ENOTDIR,  # OBJECT_PATH_INVALID
    0xC000003A: errno.ENOENT,  # OBJECT_PATH_NOT_FOUND
    0xC000003B: errno.EINVAL,  # OBJECT_PATH_SYNTAX_BAD
    0xC0000043: errno.EBUSY,  # SHARING_VIOLATION
    0xC0000044: errno.EDQUOT,  # QUOTA_EXCEEDED
    0xC000004F: errno.EOPNOTSUPP,  # EAS_NOT_SUPPORTED
    0xC0000050: errno.E2BIG,  # EA_TOO_LARGE
    0xC0000051: errno.ENODATA,  # NONEXISTENT_EA_ENTRY
    0xC0000052: errno.ENODATA,  # NO_EAS_ON_FILE
    0xC0000053: errno.EIO,  # EA_CORRUPT_ERROR
    0xC0000054: errno.EACCES,  # FILE_LOCK_CONFLICT
    0xC0000055: errno.EACCES,  # LOCK_NOT_GRANTED
    0xC0000056: errno.ENOENT,  # DELETE_PENDING
    0xC0000061: errno.EPERM,  # PRIVILEGE_NOT_HELD
    0xC000006D: errno.EACCES,  # LOGON_FAILURE
    0xC000007F: errno.ENOSPC,  # DISK_FULL
    0xC000009A: errno.ENOMEM,  # INSUFFICIENT_RESOURCES
    0xC00000A2: errno.EROFS,  # MEDIA_WRITE_PROTECTED
    0xC00000B5: errno.ETIMEDOUT,  # IO_TIMEOUT
    0xC00000BA: errno.EISDIR,  # FILE_IS_A_DIRECTORY
    0xC00000BB: errno.EOPNOTSUPP,  # NOT_SUPPORTED
    0xC00000CC: errno.ENOENT,  # BAD_NETWORK_NAME
    0xC00000D4: errno.EXDEV,  # NOT_SAME_DEVICE
    0xC0000101: errno.ENOTEMPTY,  # DIRECTORY_NOT_EMPTY
    0xC0000103: errno.ENOTDIR,  # NOT_A_DIRECTORY
    0xC0000106: errno.ENAMETOOLONG,  # NAME_TOO_LONG
    0xC0000120: errno.EINTR,  # CANCELLED
    0xC0000121: errno.EACCES,  # CANNOT_DELETE
    0xC0000128: errno.EBADF,  # FILE_CLOSED
    0xC0000203: errno.EIO,  # USER_SESSION_DELETED
    0xC0000280: errno.ELOOP,  # STOPPED_ON_SYMLINK
    0xC000035C: errno.EIO,  # NETWORK_SESSION_EXPIRED
    0xC0000904: errno.EFBIG,  # FILE_TOO_LARGE
}


def status_error(status, body=b"", what=""):
    """The OSError for a request the server failed with ``status``.

    A plain OSError(errno, ...) so that it is a FileNotFoundError,
    FileExistsError, ... as a local filesystem's would be; ``status`` and
    ``body`` (the response body: a copychunk request that was too large
    answers with the server's limits) ride along as attributes.
    """
    code = ERRNO.get(status, errno.EIO)
    e = OSError(code, f"{what or os.strerror(code)} (NTSTATUS 0x{status:08X})")
    e.status = status
    e.body = body
    return e


def status_of(e):
    """The NTSTATUS an OSError came from, or None."""
    return getattr(e, "status", None)


class ConnectionLost(OSError):
    """The connection broke or the server stopped answering; the request's fate is unknown."""

    def __init__(self, why):
        super().__init__(errno.EIO, why)
