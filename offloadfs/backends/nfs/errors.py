"""nfsstat4 values and the errno each one means to a local program."""
import errno

OK = 0
PERM, NOENT, IO, NXIO, ACCESS, EXIST, XDEV = 1, 2, 5, 6, 13, 17, 18
NOTDIR, ISDIR, INVAL, FBIG, NOSPC, ROFS, MLINK = 20, 21, 22, 27, 28, 30, 31
NAMETOOLONG, NOTEMPTY, DQUOT, STALE = 63, 66, 69, 70
BADHANDLE = 10001
BAD_COOKIE = 10003
NOTSUPP = 10004
TOOSMALL = 10005
SERVERFAULT = 10006
BADTYPE = 10007
DELAY = 10008
EXPIRED = 10011
LOCKED = 10012
GRACE = 10013
FHEXPIRED = 10014
SHARE_DENIED = 10015
WRONGSEC = 10016
MINOR_VERS_MISMATCH = 10021
STALE_CLIENTID = 10022
STALE_STATEID = 10023
OLD_STATEID = 10024
BAD_STATEID = 10025
SYMLINK = 10029
ATTRNOTSUPP = 10032
NO_GRACE = 10033
BADXDR = 10036
OPENMODE = 10038
BADOWNER = 10039
BADCHAR = 10040
BADNAME = 10041
OP_ILLEGAL = 10044
FILE_OPEN = 10046
ADMIN_REVOKED = 10047
CB_PATH_DOWN = 10048
BADSESSION = 10052
BADSLOT = 10053
COMPLETE_ALREADY = 10054
CONN_NOT_BOUND_TO_SESSION = 10055
SEQ_MISORDERED = 10063
SEQUENCE_POS = 10064
REQ_TOO_BIG = 10065
REP_TOO_BIG = 10066
RETRY_UNCACHED_REP = 10068
TOO_MANY_OPS = 10070
OP_NOT_IN_SESSION = 10071
SEQ_FALSE_RETRY = 10076
DEADSESSION = 10078
WRONG_TYPE = 10083
DELEG_REVOKED = 10087
PARTNER_NOTSUPP = 10088
PARTNER_NO_AUTH = 10089
UNION_NOTSUPP = 10090
OFFLOAD_DENIED = 10091
WRONG_LFS = 10092
OFFLOAD_NO_REQS = 10094
NOXATTR = 10095
XATTR2BIG = 10096

# Open state is gone (lease expired, server restarted, state revoked): reopen and retry.
STATE_LOST = {EXPIRED, STALE_STATEID, BAD_STATEID, ADMIN_REVOKED, DELEG_REVOKED, STALE_CLIENTID}

ERRNO = {
    PERM: errno.EPERM, NOENT: errno.ENOENT, IO: errno.EIO, NXIO: errno.ENXIO, ACCESS: errno.EACCES,
    EXIST: errno.EEXIST, XDEV: errno.EXDEV, NOTDIR: errno.ENOTDIR, ISDIR: errno.EISDIR, INVAL: errno.EINVAL,
    FBIG: errno.EFBIG, NOSPC: errno.ENOSPC, ROFS: errno.EROFS, MLINK: errno.EMLINK,
    NAMETOOLONG: errno.ENAMETOOLONG, NOTEMPTY: errno.ENOTEMPTY, DQUOT: errno.EDQUOT, STALE: errno.ESTALE,
    BADHANDLE: errno.ESTALE, FHEXPIRED: errno.ESTALE, NOTSUPP: errno.EOPNOTSUPP, ATTRNOTSUPP: errno.EOPNOTSUPP,
    UNION_NOTSUPP: errno.EOPNOTSUPP, TOOSMALL: errno.EINVAL, BADTYPE: errno.EINVAL, SYMLINK: errno.ELOOP,
    WRONG_TYPE: errno.EINVAL, BADOWNER: errno.EINVAL, BADCHAR: errno.EINVAL, BADNAME: errno.EINVAL,
    SHARE_DENIED: errno.EACCES, OPENMODE: errno.EBADF, LOCKED: errno.EAGAIN, FILE_OPEN: errno.EBUSY,
    WRONGSEC: errno.EPERM, DELAY: errno.EAGAIN, GRACE: errno.EAGAIN, OFFLOAD_DENIED: errno.EOPNOTSUPP,
    PARTNER_NOTSUPP: errno.EOPNOTSUPP, PARTNER_NO_AUTH: errno.EPERM, WRONG_LFS: errno.EOPNOTSUPP,
    NOXATTR: errno.ENODATA, XATTR2BIG: errno.E2BIG,
}

NAMES = {v: k for k, v in globals().items() if isinstance(v, int) and k.isupper() and k != "OK"}


class NFSError(OSError):
    """An operation failed on the server; ``status`` is the nfsstat4, ``errno`` what it means locally.

    Like OSError(errno, ...), it comes as the matching subclass (FileNotFoundError for
    NFS4ERR_NOENT...), so callers catch it as they would a local error.
    """

    def __new__(cls, status, op="", detail=None):
        # OSError takes its arguments in __new__ once a subclass overrides it: all is set here.
        code = ERRNO.get(status, errno.EIO)
        name = NAMES.get(status, str(status))
        self = super().__new__(_subclass(code) if cls is NFSError else cls, code,
                               f"NFS4ERR_{name}" + (f" from {op}" if op else ""))
        self.status = status
        self.op = op
        self.detail = detail  # what the failed operation carried with the error (COPY: the sync wish)
        return self

    def __init__(self, *args, **kwargs):
        pass


_subclasses = {}


def _subclass(code):
    if code not in _subclasses:
        builtin = type(OSError(code, ""))
        _subclasses[code] = NFSError if builtin is OSError else type(f"NFS{builtin.__name__}", (NFSError, builtin), {})
    return _subclasses[code]
