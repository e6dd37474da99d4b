"""SMB 3.1.1 POSIX extensions: the negotiate context both ways, the POSIX information class and the
posix/noposix mount options, checked without a server (mountpoint-tests/test_mp_smb_posix.py mounts one)."""
import stat
import struct

import pytest

from offloadfs.backends.smb import posix
from offloadfs.backends.smb.url import parse
from offloadfs.backends.smb.wire import HEADER_SIZE, WireError
from smbprotocol.connection import SMB2NegotiateResponse, SMB3NegotiateRequest

REPLY = struct.Struct("<HHHH16sIIIIqqHHI")
CONTEXT = struct.Struct("<HHI")


def context(kind, data):
    return CONTEXT.pack(kind, len(data), 0) + data + bytes(-len(data) % 8)


def negotiate_reply(contexts):
    """An SMB 3.1.1 NEGOTIATE response body with an 8-byte security buffer and ``contexts`` (packed)."""
    security = b"NTLMSSP\0"
    head_size = REPLY.size
    offset = HEADER_SIZE + head_size + len(security)
    return REPLY.pack(65, 1, 0x311, len(contexts), bytes(16), 0, 1 << 20, 1 << 20, 1 << 20, 0, 0,
                      HEADER_SIZE + head_size, len(security), offset) + security + b"".join(contexts)


PREAUTH = context(1, struct.pack("<HHH", 1, 32, 1) + bytes(32))
SIGNING = context(8, struct.pack("<HH", 1, 2))


@pytest.mark.parametrize("where", [0, 1, 2])
def test_reply_without_its_posix_context_parses_in_smbprotocol(where):
    contexts = [PREAUTH, SIGNING]
    contexts.insert(where, context(posix.NEGOTIATE_CONTEXT, posix.TAG))
    offered, body = posix.split_negotiate_reply(negotiate_reply(contexts))
    assert offered
    reply = SMB2NegotiateResponse()
    reply.unpack(body)
    assert [c["context_type"].get_value() for c in reply["negotiate_context_list"]] == [1, 8]


def test_reply_without_posix_is_left_as_it_is():
    body = negotiate_reply([PREAUTH, SIGNING])
    assert posix.split_negotiate_reply(body) == (False, body)


def test_reply_with_a_context_past_its_end_is_refused():
    body = negotiate_reply([PREAUTH, context(posix.NEGOTIATE_CONTEXT, posix.TAG)])
    with pytest.raises(WireError):
        posix.split_negotiate_reply(body[:-4])


def test_request_gets_the_context_at_its_end():
    request = SMB3NegotiateRequest()
    request["dialects"] = [0x311]
    request["client_guid"] = bytes(16)
    request["negotiate_context_list"] = []
    body = posix.with_negotiate_context(request.pack())
    assert struct.unpack_from("<H", body, 32)[0] == 1
    assert (HEADER_SIZE + len(body) - 24) % 8 == 0
    assert body[-24:] == CONTEXT.pack(0x100, 16, 0) + posix.TAG


def sid(*parts):
    revision, authority, *subs = parts
    return struct.pack("<BB", revision, len(subs)) + authority.to_bytes(6, "big") + struct.pack(f"<{len(subs)}I", *subs)


def posix_info(inode, wire_mode, owner, group, nlink=1):
    return posix.FilePosixInformation.FORMAT.pack(0, 0, 0, 0, 3, 4096, 0x80, inode, 0, 0) + \
        posix.FilePosixInformation.CC.pack(nlink, 0, wire_mode) + owner + group


def test_posix_information_gives_type_mode_and_unix_ids():
    a, end = posix.FilePosixInformation.unpack(posix_info(7, 0o4755, sid(1, 22, 1, 1000), sid(1, 22, 2, 50), 2))
    assert (a.file_id, a.mode, a.uid, a.gid, a.nlink, a.size, a.allocation) == (
        7, stat.S_IFREG | 0o4755, 1000, 50, 2, 3, 4096)
    a, _ = posix.FilePosixInformation.unpack(posix_info(8, 1 << 12 | 0o700, sid(1, 5, 21, 1, 2, 3, 1000),
                                                        sid(1, 22, 2, 0)))
    assert (a.mode, a.uid, a.gid) == (stat.S_IFDIR | 0o700, posix.UNKNOWN_ID, 0)


@pytest.mark.parametrize("kind, mode", [(2, stat.S_IFLNK), (5, stat.S_IFIFO), (6, stat.S_IFSOCK)])
def test_file_types(kind, mode):
    assert posix.mode_from_wire(kind << 12 | 0o644) == mode | 0o644


def test_directory_entries():
    def entry(name, inode, last):
        n = name.encode("utf-16-le")
        body = posix_info(inode, 0o644, sid(1, 22, 1, 0), sid(1, 22, 2, 0)) + struct.pack("<I", len(n)) + n
        size = 8 + len(body) + -(8 + len(body)) % 8
        return struct.pack("<II", 0 if last else size, 0) + body + bytes(size - 8 - len(body))
    entries = posix.FilePosixDirectoryInformation.unpack_list(entry("a", 1, False) + entry("Bee", 2, True))
    assert [(name, a.file_id) for name, a in entries] == [("a", 1), ("Bee", 2)]
    with pytest.raises(WireError):
        posix.FilePosixDirectoryInformation.unpack_list(entry("a", 1, True)[:-3])


def test_options(tmp_path):
    creds = tmp_path / "cred"
    creds.write_text("username=u\npassword=p\n")
    creds.chmod(0o600)
    url, base = "smb://h/s", {"credentials": str(creds)}
    assert parse(url, base).posix is None
    assert parse(url, {**base, "posix": True}).posix is True
    assert parse(url, {**base, "noposix": True}).posix is False
    for bad, message in [({"posix": True, "noposix": True}, "choose one"), ({"posix": "1"}, "takes no value"),
                         ({"posix": True, "vers": "3.0"}, "3.1.1")]:
        with pytest.raises(ValueError, match=message):
            parse(url, {**base, **bad})


def test_chmod_descriptor_is_one_ace_for_the_nfs_mode_sid():
    sd, parts = posix.security_descriptor(mode=0o4751)
    assert parts == posix.DACL
    revision, _, control, owner, group, sacl, dacl = struct.unpack_from("<BBHIIII", sd)
    assert (revision, control, owner, group, sacl, dacl) == (1, 0x8004, 0, 0, 0, 20)
    acl_revision, _, size, count, _ = struct.unpack_from("<BBHHH", sd, dacl)
    assert (acl_revision, size, count, len(sd)) == (2, len(sd) - dacl, 1, dacl + size)
    assert sd[dacl + 16:] == sid(1, 5, 88, 3, 0o751)  # the bits above 0777 cannot be set this way


def test_chown_descriptor_names_unix_ids():
    sd, parts = posix.security_descriptor(uid=1000, gid=50)
    assert parts == posix.OWNER | posix.GROUP
    _, _, control, owner, group, _, dacl = struct.unpack_from("<BBHIIII", sd)
    assert (control, dacl) == (0x8000, 0)
    assert sd[owner:group] == sid(1, 22, 1, 1000) and sd[group:] == sid(1, 22, 2, 50)
    assert posix.security_descriptor(gid=7) == (struct.pack("<BBHIIII", 1, 0, 0x8000, 0, 20, 0, 0) +
                                                sid(1, 22, 2, 7), posix.GROUP)


@pytest.mark.parametrize("target", ["x", "/etc/hostname", "d\u00e9j\u00e0/../x", "a\\b"])
def test_symlink_reparse_point_round_trip(target):
    data = posix.symlink_reparse(target)
    tag, length, _ = struct.unpack_from("<IHH", data)
    assert (tag, length + 8) == (posix.TAG_SYMLINK, len(data))
    flags = struct.unpack_from("<I", data, 16)[0]
    assert flags == (0 if target.startswith("/") else posix.SYMLINK_RELATIVE)
    assert posix.symlink_target(data) == target


def test_symlink_target_of_an_nfs_link_and_refusals():
    name = "t".encode("utf-16-le")
    nfs_link = struct.pack("<IHHQ", posix.TAG_NFS, 8 + len(name), 0, 0x014B4E4C) + name
    assert posix.symlink_target(nfs_link) == "t"
    for bad in [posix.special_reparse(stat.S_IFIFO), posix.symlink_reparse("abc")[:-2], b"\x0c\x00\x00\xa0"]:
        with pytest.raises(WireError):
            posix.symlink_target(bad)


def test_special_file_reparse_points():
    assert posix.special_reparse(stat.S_IFIFO | 0o644) == struct.pack("<IHHQ", posix.TAG_NFS, 8, 0, 0x4F464946)
    assert posix.special_reparse(stat.S_IFCHR, 1, 3) == struct.pack("<IHHQII", posix.TAG_NFS, 16, 0, 0x00524843, 1, 3)


def test_device_numbers_of_device_reparse_points_and_refusals():
    assert posix.device_number(posix.special_reparse(stat.S_IFCHR, 1, 3)) == (1, 3)
    assert posix.device_number(posix.special_reparse(stat.S_IFBLK, 259, 1 << 20)) == (259, 1 << 20)
    for bad in [posix.special_reparse(stat.S_IFIFO), posix.special_reparse(stat.S_IFBLK, 7, 0)[:-4],
                posix.symlink_reparse("x")]:
        with pytest.raises(WireError):
            posix.device_number(bad)
