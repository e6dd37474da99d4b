"""SMB wire structures: packing matches the specs' layouts, parsing round-trips, and
hostile or truncated replies raise WireError (never IndexError, never a loop)."""
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadfs.backends.smb import info, wire
from offloadfs.backends.smb.wire import WireError

HEADER = wire.HEADER_SIZE


def query_body(buffer, offset=HEADER + 8):
    """A QUERY_INFO / QUERY_DIRECTORY response body holding ``buffer``."""
    return struct.pack("<HHI", 9, offset, len(buffer)) + buffer


def ioctl_body(output, offset=HEADER + 48, count=None):
    head = struct.pack("<HHI16sIIIIII", 49, 0, 0, b"\0" * 16, 0, 0, offset, len(output) if count is None else count,
                       0, 0)
    return head + output


def dir_entry(name, file_id, attrs=0, eof=0, next_offset=0):
    raw = name.encode("utf-16-le")
    fixed = info.FileIdBothDirectoryInformation.FORMAT.pack(
        next_offset, 0, 1, 2, 3, 4, eof, 4096, attrs, len(raw), 0, 0, b"\0" * 24, file_id)
    return fixed + raw


def all_information(file_id, attrs, eof, nlink, times=(0, 0, 0, 0)):
    basic = struct.pack("<qqqqI4x", *times, attrs)
    standard = struct.pack("<qqIBBxx", 8192, eof, nlink, 0, bool(attrs & info.ATTR_DIRECTORY))
    rest = struct.pack("<qIIqIII", file_id, 0, 0, 0, 0, 0, 0)
    return basic + standard + rest


# -- response bodies -----------------------------------------------------------------


def test_create_response():
    body = wire.CreateResponse.FORMAT.pack(89, 0, 0, 2, 1, 2, 3, 4, 4096, 1234, 0x20, 0, b"F" * 16, 0, 0)
    r = wire.CreateResponse.unpack(body)
    assert (r.create_action, r.end_of_file, r.attributes, r.file_id) == (2, 1234, 0x20, b"F" * 16)
    with pytest.raises(WireError, match="CREATE"):
        wire.CreateResponse.unpack(body[:60])


def create_context(name, data, last):
    """2.2.13.2: one context, 8-byte aligned unless last."""
    head = wire.CreateResponse.CONTEXT.size
    entry = wire.CreateResponse.CONTEXT.pack(0, head, len(name), 0, head + 8, len(data)) + name.ljust(8, b"\0") + data
    entry += b"" if last else b"\0" * (-len(entry) % 8)
    return struct.pack("<I", 0 if last else len(entry)) + entry[4:]


def test_create_response_oplock_and_contexts():
    contexts = create_context(b"MxAc", b"\0" * 8, False) + create_context(b"DH2Q", b"\0" * 8, True)
    offset = wire.HEADER_SIZE + wire.CreateResponse.FORMAT.size
    body = wire.CreateResponse.FORMAT.pack(89, 9, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, b"F" * 16, offset, len(contexts))
    r = wire.CreateResponse.unpack(body + contexts)
    assert (r.oplock_level, r.contexts) == (9, [b"MxAc", b"DH2Q"])
    with pytest.raises(WireError):  # the contexts run past the reply
        wire.CreateResponse.unpack(body + contexts[:-1])
    looping = bytearray(contexts)
    looping[0:4] = struct.pack("<I", 4)  # the next context inside this one
    with pytest.raises(WireError, match="overlap"):
        wire.CreateResponse.unpack(body + bytes(looping))
    bad_name = bytearray(contexts)
    bad_name[6:8] = struct.pack("<H", 200)  # a name past the end
    with pytest.raises(WireError, match="create context"):
        wire.CreateResponse.unpack(body + bytes(bad_name))


KEY = bytes(range(100, 116))


def create_with(contexts, oplock=0xFF):
    offset = wire.HEADER_SIZE + wire.CreateResponse.FORMAT.size
    body = wire.CreateResponse.FORMAT.pack(89, oplock, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, b"F" * 16, offset, len(contexts))
    return wire.CreateResponse.unpack(body + contexts)


def test_create_response_lease_v1_and_v2():
    v1 = struct.pack("<16sIIQ", KEY, 3, 0, 0)
    r = create_with(create_context(b"DH2Q", b"\0" * 8, False) + create_context(b"RqLs", v1, True))
    assert r.contexts == [b"DH2Q", b"RqLs"] and r.lease == wire.Lease(KEY, 3, 0, None)
    v2 = struct.pack("<16sIIQ16sHH", KEY, 7, 2, 0, bytes(16), 513, 0)
    assert create_with(create_context(b"RqLs", v2, True)).lease == wire.Lease(KEY, 7, 2, 513)
    assert create_with(create_context(b"RqLs", v1, True), oplock=0).lease is None  # not granted as a lease
    assert create_with(b"").lease is None
    with pytest.raises(WireError, match="lease"):
        create_with(create_context(b"RqLs", v1[:20], True))
    past = bytearray(create_context(b"RqLs", v1, True))
    past[12:16] = struct.pack("<I", 64)  # data longer than the reply
    with pytest.raises(WireError, match="data"):
        create_with(bytes(past))


def test_lease_break_notification():
    body = struct.pack("<HHI16sIIIII", 44, 9, 1, KEY, 7, 1, 0, 0, 0)
    assert wire.LeaseBreak.unpack(body) == wire.LeaseBreak(9, True, KEY, 7, 1)
    assert wire.LeaseBreak.unpack(struct.pack("<HHI16sIIIII", 44, 0, 0, KEY, 1, 0, 0, 0, 0)).ack_required is False
    with pytest.raises(WireError):
        wire.LeaseBreak.unpack(body[:30])
    with pytest.raises(WireError, match="size 24"):  # an oplock break's structure size
        wire.LeaseBreak.unpack(struct.pack("<H", 24) + body[2:])


def test_read_response_data_is_a_view_at_the_offset():
    data = b"0123456789"
    body = struct.pack("<HBxII4x", 17, HEADER + 16, len(data), 0) + data
    view = wire.ReadResponse.data(body)
    assert isinstance(view, memoryview) and bytes(view) == data
    # Offsets pointing before the body or past its end are refused.
    for offset, length in ((HEADER + 16, 11), (HEADER - 1, 1), (10, 5)):
        bad = struct.pack("<HBxII4x", 17, offset, length, 0) + data
        with pytest.raises(WireError, match="READ"):
            wire.ReadResponse.data(bad)
    with pytest.raises(WireError):
        wire.ReadResponse.data(body[:8])


def test_write_response_count():
    assert wire.WriteResponse.count(struct.pack("<H2xIIHH", 17, 4096, 0, 0, 0)) == 4096
    with pytest.raises(WireError):
        wire.WriteResponse.count(b"\x11\x00")


def test_query_response_buffer_bounds():
    assert bytes(wire.QueryResponse.buffer(query_body(b"abc"))) == b"abc"
    assert bytes(wire.QueryResponse.buffer(struct.pack("<HHI", 9, 0, 0))) == b""
    with pytest.raises(WireError, match="outside"):
        wire.QueryResponse.buffer(struct.pack("<HHI", 9, HEADER + 8, 100) + b"abc")


def test_ioctl_output_bounds():
    assert bytes(wire.IoctlResponse.output(ioctl_body(b"out"))) == b"out"
    with pytest.raises(WireError):
        wire.IoctlResponse.output(ioctl_body(b"out", count=4))
    with pytest.raises(WireError):
        wire.IoctlResponse.output(ioctl_body(b"out", offset=0))


# -- FSCTL structures -------------------------------------------------------------------


def test_resume_key():
    key = bytes(range(24))
    assert wire.ResumeKey.unpack(key + b"\0\0\0\0").key == key
    with pytest.raises(WireError, match="RESUME_KEY"):
        wire.ResumeKey.unpack(key)
    assert not wire.ResumeKey.unpack(key + b"\0\0\0\0").echoed


def test_a_resume_key_that_echoes_the_related_file_id_names_no_file():
    """ksmbd answers FSCTL_SRV_REQUEST_RESUME_KEY after a CREATE in one compound with the request's file id
    as the key: all ones, which no copychunk finds (OBJECT_NAME_NOT_FOUND)."""
    assert wire.ResumeKey.unpack(b"\xff" * 16 + bytes(8) + bytes(4)).echoed


def test_copychunk_copy_layout():
    key = b"K" * 24
    packed = wire.CopyChunkCopy(key, [(0, 4096, 1 << 20), (1 << 20, 5 << 20, 77)]).pack()
    assert len(packed) == 32 + 2 * 24
    assert packed[:24] == key and struct.unpack_from("<II", packed, 24) == (2, 0)
    assert struct.unpack_from("<QQII", packed, 32) == (0, 4096, 1 << 20, 0)
    assert struct.unpack_from("<QQII", packed, 56) == (1 << 20, 5 << 20, 77, 0)


def test_copychunk_response():
    r = wire.CopyChunkResponse.unpack(struct.pack("<III", 256, 1 << 20, 16 << 20))
    assert (r.chunks_written, r.chunk_bytes_written, r.total_bytes_written) == (256, 1 << 20, 16 << 20)
    with pytest.raises(WireError):
        wire.CopyChunkResponse.unpack(b"\0" * 11)


def test_duplicate_extents_layout():
    packed = wire.DuplicateExtents(b"S" * 16, 4096, 8192, 1 << 30).pack()
    assert len(packed) == 40
    assert struct.unpack("<16sqqq", packed) == (b"S" * 16, 4096, 8192, 1 << 30)


def test_allocated_ranges():
    ranges = [wire.AllocatedRange(0, 4096), wire.AllocatedRange(1 << 20, 1 << 20)]
    data = b"".join(r.pack() for r in ranges)
    assert wire.AllocatedRange.unpack_list(data) == ranges
    assert wire.AllocatedRange.unpack_list(b"") == []
    with pytest.raises(WireError, match="whole number"):
        wire.AllocatedRange.unpack_list(data[:-1])
    with pytest.raises(WireError, match="negative"):
        wire.AllocatedRange.unpack_list(struct.pack("<qq", 0, -1))


def test_zero_data():
    assert wire.ZeroData(4096, 8192).pack() == struct.pack("<qq", 4096, 8192)


# -- information classes ---------------------------------------------------------------------


def test_filetime_round_trip():
    for ns in (0 + 100, 1_500_000_000_123_456_700, 10**18):
        assert info.from_filetime(info.to_filetime(ns)) == ns
    assert info.from_filetime(0) == 0  # "no time": not 1601
    assert info.to_filetime(0) == info.FILETIME_EPOCH


def test_file_all_information():
    t = info.to_filetime(1_600_000_000_000_000_000)
    a = info.FileAllInformation.unpack(all_information(77, info.ATTR_DIRECTORY, 0, 3, (t, t + 1, t + 2, t + 3)))
    assert (a.file_id, a.is_dir, a.nlink, a.size, a.allocation) == (77, True, 3, 0, 8192)
    assert (a.btime_ns, a.atime_ns, a.mtime_ns, a.ctime_ns) == (
        1_600_000_000_000_000_000, 1_600_000_000_000_000_100, 1_600_000_000_000_000_200, 1_600_000_000_000_000_300)
    with pytest.raises(WireError, match="FileAllInformation"):
        info.FileAllInformation.unpack(all_information(1, 0, 0, 1)[:71])


def test_file_standard_information():
    assert info.FileStandardInformation.end_of_file(struct.pack("<qqIBBxx", 4096, 123, 1, 0, 0)) == 123
    with pytest.raises(WireError):
        info.FileStandardInformation.end_of_file(b"\0" * 10)


def test_directory_chain():
    first = dir_entry("één", 1, eof=5)
    first += b"\0" * (-len(first) % 8)
    second = dir_entry("dir", 2, attrs=info.ATTR_DIRECTORY)
    second += b"\0" * (-len(second) % 8)
    chain = (struct.pack("<I", len(first)) + first[4:] + struct.pack("<I", len(second)) + second[4:]
             + dir_entry("last", 3))
    entries = info.FileIdBothDirectoryInformation.unpack_list(chain)
    assert [(n, a.file_id, a.is_dir, a.size, a.nlink) for n, a in entries] == [
        ("één", 1, False, 5, None), ("dir", 2, True, 0, None), ("last", 3, False, 0, None)]  # no link count


def test_directory_hostile_chains():
    one = dir_entry("x", 1)
    with pytest.raises(WireError, match="next entry"):  # points at itself: would loop forever
        info.FileIdBothDirectoryInformation.unpack_list(struct.pack("<I", 8) + one[4:])
    with pytest.raises(WireError, match="next entry"):  # points past the end
        info.FileIdBothDirectoryInformation.unpack_list(struct.pack("<I", 4096) + one[4:])
    with pytest.raises(WireError, match="name"):  # name longer than the reply
        info.FileIdBothDirectoryInformation.unpack_list(one[:-1])
    with pytest.raises(WireError):
        info.FileIdBothDirectoryInformation.unpack_list(one[:50])


def test_fs_information():
    s = info.FileFsFullSizeInformation.unpack(struct.pack("<qqqII", 1000, 400, 500, 8, 512))
    assert (s.total_units, s.caller_available_units, s.actual_available_units) == (1000, 400, 500)
    a = info.FileFsAttributeInformation.unpack(struct.pack("<IiI", 0x08000000, 255, 0))
    assert a.attributes & info.FS_SUPPORTS_BLOCK_REFCOUNTING and a.max_name_length == 255
    with pytest.raises(WireError):
        info.FileFsAttributeInformation.unpack(b"\0" * 8)


def test_set_information_layouts():
    basic = info.FileBasicInformation(atime_ns=None, mtime_ns=1_000_000_000, attributes=info.ATTR_NORMAL).pack()
    assert struct.unpack("<qqqqI4x", basic) == (0, 0, info.to_filetime(1_000_000_000), 0, info.ATTR_NORMAL)
    assert info.FileEndOfFileInformation(5).pack() == struct.pack("<q", 5)
    rename = info.FileRenameInformation(True, "a\\b").pack()
    assert rename[:20] == struct.pack("<B7xQI", 1, 0, 6) and rename[20:] == "a\\b".encode("utf-16-le")
    assert info.FileDispositionInformation().pack() == b"\1"
    assert info.GetEa(b"foo").pack() == struct.pack("<IB", 0, 3) + b"foo\0"


def test_full_ea_layout_and_round_trip():
    eas = [info.FullEa(b"a", b"1"), info.FullEa(b"long.name", b"value" * 10), info.FullEa(b"z", b"")]
    packed = info.FullEa.pack_list(eas)
    offset = 0
    for ea in eas[:-1]:
        next_offset = struct.unpack_from("<I", packed, offset)[0]
        assert next_offset % 4 == 0 and next_offset >= 8 + len(ea.name) + 1 + len(ea.value)
        offset += next_offset
    assert struct.unpack_from("<I", packed, offset)[0] == 0
    assert info.FullEa.unpack_list(packed) == eas


def test_full_ea_hostile():
    entry = info.FullEa.pack_list([info.FullEa(b"name", b"value")])
    with pytest.raises(WireError, match="outside"):
        info.FullEa.unpack_list(entry[:-1])
    overlapping = struct.pack("<I", 4) + entry[4:] + entry
    with pytest.raises(WireError, match="overlap"):
        info.FullEa.unpack_list(overlapping)


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=40)), max_size=5))
def test_full_ea_round_trip_property(pairs):
    eas = [info.FullEa(n, v) for n, v in pairs]
    assert info.FullEa.unpack_list(info.FullEa.pack_list(eas)) == eas


PARSERS = [
    wire.CreateResponse.unpack, wire.ReadResponse.data, wire.WriteResponse.count, wire.QueryResponse.buffer,
    wire.IoctlResponse.output, wire.ResumeKey.unpack, wire.CopyChunkResponse.unpack,
    wire.AllocatedRange.unpack_list, info.FileAllInformation.unpack, info.FileStandardInformation.end_of_file,
    info.FileIdBothDirectoryInformation.unpack_list, info.FileFsFullSizeInformation.unpack,
    info.FileFsAttributeInformation.unpack, info.FullEa.unpack_list,
]


@pytest.mark.parametrize("parse", PARSERS, ids=lambda p: p.__qualname__)
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300))
def test_garbage_raises_only_wire_error(parse, data):
    try:
        parse(data)
    except WireError:
        pass
