"""NFS wire layer: XDR, operation results, compounds, callbacks and attributes.

Encodings follow RFC 4506/8881/7862; hostile or truncated replies raise
ProtocolError (never IndexError, struct.error, a loop or a huge allocation).
"""
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offloadfs.backends.nfs import attrs, compound, errors, ops, rpc
from offloadfs.backends.nfs.backend import _assemble
from offloadfs.backends.nfs.errors import NFSError
from offloadfs.backends.nfs.xdr import Packer, ProtocolError, Unpacker

SID = bytes(range(16))


def packed(*items):
    """XDR bytes from (kind, value) pairs, written by hand to check the encoder against."""
    p = Packer()
    for kind, value in items:
        getattr(p, kind)(value)
    return p.bytes()


def result(num, status, body=b""):
    return packed(("u32", num), ("u32", status)) + body


def compound_reply(status, *results):
    return packed(("u32", status), ("opaque", b""), ("u32", len(results))) + b"".join(results)


# -- XDR ------------------------------------------------------------------------------


def test_opaque_is_padded_to_four_bytes():
    p = Packer()
    p.opaque(b"abcde")
    assert p.bytes() == b"\0\0\0\x05abcde\0\0\0"
    u = Unpacker(p.bytes())
    assert u.opaque(5) == b"abcde"
    u.done()


def test_round_trip_of_every_kind():
    p = Packer()
    p.u32(7)
    p.u64(1 << 40)
    p.i64(-3)
    p.bool(True)
    p.fixed(b"12345678", 8)
    p.bitmap(1 << 33 | 1)
    u = Unpacker(p.bytes())
    assert (u.u32(), u.u64(), u.i64(), u.bool(), u.fixed(8), u.bitmap()) == (7, 1 << 40, -3, True, b"12345678",
                                                                           1 << 33 | 1)
    u.done()


def test_truncated_input_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="truncated"):
        Unpacker(b"\0\0").u32()
    with pytest.raises(ProtocolError, match="truncated"):
        Unpacker(b"\0\0\0\x03ab").opaque(10)  # data shorter than its length
    with pytest.raises(ProtocolError, match="truncated"):
        Unpacker(b"\0\0\0\x03abc").opaque(10)  # the padding is missing


def test_length_past_the_buffer_allocates_nothing():
    hostile = b"\xff\xff\xff\xf0" + b"x" * 8
    with pytest.raises(ProtocolError):
        Unpacker(hostile).opaque(1 << 32)
    with pytest.raises(ProtocolError, match="at most"):
        Unpacker(hostile).opaque(1024)
    with pytest.raises(ProtocolError):
        Unpacker(hostile).count(1 << 32, 4)


def test_bool_enum_and_bitmap_bounds():
    with pytest.raises(ProtocolError, match="bool"):
        Unpacker(packed(("u32", 2))).bool()
    with pytest.raises(ProtocolError, match="unknown stable_how"):
        Unpacker(packed(("u32", 9))).enum(ops.STABLE_HOW, "stable_how")
    with pytest.raises(ProtocolError, match="bitmap"):
        Unpacker(packed(("u32", 9)) + bytes(36)).bitmap()


def test_garbage_after_a_message():
    u = Unpacker(b"\0\0\0\x01\0")
    u.u32()
    with pytest.raises(ProtocolError, match="garbage"):
        u.done()


# -- RPC ------------------------------------------------------------------------------


def test_auth_sys_credential_layout():
    flavor, body = rpc.auth_sys(1000, 100, [100, 27], b"host")
    assert flavor == 1
    assert body == packed(("u32", 0), ("opaque", b"host"), ("u32", 1000), ("u32", 100), ("u32", 2),
                          ("u32", 100), ("u32", 27))


@pytest.mark.parametrize("reply, message", [
    (packed(("u32", 1), ("u32", 0), ("u32", 2), ("u32", 2)), "RPC version mismatch"),
    (packed(("u32", 1), ("u32", 1), ("u32", 5)), "credentials refused"),
    (packed(("u32", 0), ("u32", 0), ("u32", 0), ("u32", 1)), "program not served"),
    (packed(("u32", 0), ("u32", 0), ("u32", 0), ("u32", 2), ("u32", 4), ("u32", 4)), "version not served"),
    (packed(("u32", 0), ("u32", 0), ("u32", 0), ("u32", 4)), "could not decode"),
])
def test_refused_calls(reply, message):
    with pytest.raises(rpc.RPCError, match=message):
        rpc.parse_reply(Unpacker(reply))


def test_unknown_reply_stat():
    with pytest.raises(ProtocolError):
        rpc.parse_reply(Unpacker(packed(("u32", 7))))


# -- compounds ------------------------------------------------------------------------


def test_compound_encoding():
    data = compound.encode([ops.PutRootFH(), ops.Lookup(b"export")], 2)
    assert data == packed(("opaque", b""), ("u32", 2), ("u32", 2), ("u32", 24), ("u32", 15), ("opaque", b"export"))


def test_compound_results_and_first_failure():
    op_list = [ops.PutFH(b"fh"), ops.Lookup(b"x"), ops.GetFH()]
    u = Unpacker(compound_reply(errors.NOENT, result(22, 0), result(15, errors.NOENT)))
    results, failure = compound.decode(u, op_list)
    assert results == [None]
    assert (failure.index, failure.status) == (1, errors.NOENT)


def test_compound_all_ok():
    op_list = [ops.PutRootFH(), ops.GetFH()]
    u = Unpacker(compound_reply(0, result(24, 0), result(10, 0, packed(("opaque", b"handle")))))
    assert compound.decode(u, op_list) == ([None, b"handle"], None)


def test_compound_failing_before_any_operation():
    results, failure = compound.decode(Unpacker(compound_reply(errors.MINOR_VERS_MISMATCH)), [ops.PutRootFH()])
    assert results == [] and failure.status == errors.MINOR_VERS_MISMATCH


def test_compound_result_for_another_operation():
    with pytest.raises(ProtocolError, match="operation 10"):
        compound.decode(Unpacker(compound_reply(0, result(10, 0, packed(("opaque", b"x"))))), [ops.PutRootFH()])


def test_compound_missing_results_without_error():
    with pytest.raises(ProtocolError, match="1 results for 2"):
        compound.decode(Unpacker(compound_reply(0, result(24, 0))), [ops.PutRootFH(), ops.GetFH()])


def test_compound_more_results_than_operations():
    with pytest.raises(ProtocolError):
        compound.decode(Unpacker(compound_reply(0, result(24, 0), result(24, 0))), [ops.PutRootFH()])


def test_setattr_error_carries_a_bitmap_and_copy_its_requirements():
    u = Unpacker(compound_reply(errors.PERM, result(34, errors.PERM, packed(("bitmap", 0)))))
    _, failure = compound.decode(u, [ops.SetAttr({attrs.MODE: 0o600})])
    assert failure.status == errors.PERM
    copy = ops.Copy(SID, SID, 0, 0, 10, False)
    u = Unpacker(compound_reply(errors.OFFLOAD_NO_REQS,
                                result(60, errors.OFFLOAD_NO_REQS, packed(("bool", True), ("bool", True)))))
    _, failure = compound.decode(u, [copy])
    assert failure.detail is True


def test_nfs_error_maps_to_errno():
    e = NFSError(errors.NOENT, "Lookup")
    assert e.errno == 2 and "NOENT" in e.strerror and e.status == errors.NOENT
    assert NFSError(99999).errno == 5  # unknown status: EIO


# -- operation results ----------------------------------------------------------------


def test_read_returning_more_than_asked_is_refused():
    body = packed(("bool", False), ("opaque", b"x" * 9))
    with pytest.raises(ProtocolError):
        ops.Read(SID, 0, 8).decode(Unpacker(body))
    assert ops.Read(SID, 0, 9).decode(Unpacker(body)) == (False, b"x" * 9)


def test_write_count_beyond_the_data_is_refused():
    body = packed(("u32", 5), ("u32", ops.UNSTABLE4)) + b"verifier"
    assert ops.Write(SID, 0, ops.UNSTABLE4, b"12345").decode(Unpacker(body)).count == 5
    with pytest.raises(ProtocolError, match="count 5"):
        ops.Write(SID, 0, ops.UNSTABLE4, b"1234").decode(Unpacker(body))


def test_readdir_entries():
    mask = attrs.DIRENT
    entry_attrs = packed(("bitmap", mask)) + packed(("opaque", packed(("u32", attrs.NF4DIR), ("u64", 77))))
    body = (b"cookieve" + packed(("bool", True), ("u64", 5), ("opaque", b"sub")) + entry_attrs
            + packed(("bool", False), ("bool", True)))
    page = ops.ReadDir(0, bytes(8), 100, 1000, mask).decode(Unpacker(body))
    assert page.verifier == b"cookieve" and page.eof
    assert [(e.cookie, e.name, e.values) for e in page.entries] == [(5, b"sub", {attrs.TYPE: attrs.NF4DIR,
                                                                                 attrs.FILEID: 77})]


def test_readdir_truncated_in_an_entry():
    body = b"cookieve" + packed(("bool", True), ("u64", 5), ("u32", 1000))
    with pytest.raises(ProtocolError):
        ops.ReadDir(0, bytes(8), 100, 1000, attrs.DIRENT).decode(Unpacker(body))


def _open_reply(delegation):
    return (SID + packed(("bool", True), ("u64", 1), ("u64", 2), ("u32", 4), ("bitmap", 0)) + delegation)


def test_open_results_with_and_without_delegation():
    opened = ops.Open(1, b"o", 0).decode(Unpacker(_open_reply(packed(("u32", ops.DELEG_NONE)))))
    assert opened.stateid == SID and opened.delegation is None
    read_deleg = packed(("u32", ops.DELEG_READ)) + SID[::-1] + packed(("bool", False), ("u32", 0), ("u32", 0),
                                                                        ("u32", 0), ("opaque", b"EVERYONE@"))
    assert ops.Open(1, b"o", 0).decode(Unpacker(_open_reply(read_deleg))).delegation == SID[::-1]
    write_deleg = packed(("u32", ops.DELEG_WRITE)) + SID + packed(("bool", False), ("u32", 2), ("u32", 1),
                                                                    ("u32", 512), ("u32", 0), ("u32", 0), ("u32", 0),
                                                                    ("opaque", b""))
    assert ops.Open(1, b"o", 0).decode(Unpacker(_open_reply(write_deleg))).delegation == SID
    none_ext = packed(("u32", ops.DELEG_NONE_EXT), ("u32", 1), ("bool", False))
    assert ops.Open(1, b"o", 0).decode(Unpacker(_open_reply(none_ext))).delegation is None
    with pytest.raises(ProtocolError, match="delegation type"):
        ops.Open(1, b"o", 0).decode(Unpacker(_open_reply(packed(("u32", 7)))))


def test_open_encodes_no_delegation_wish_and_claim():
    p = Packer()
    ops.Open(ops.SHARE_ACCESS_READ, b"owner", 42).encode(p)
    assert p.bytes() == packed(("u32", 0), ("u32", 0x401), ("u32", 0), ("u64", 42), ("opaque", b"owner"),
                               ("u32", 0), ("u32", ops.CLAIM_FH))
    p = Packer()
    ops.Open(ops.SHARE_ACCESS_BOTH, b"o", 1, b"new", ops.GUARDED4, {attrs.MODE: 0o640}).encode(p)
    assert p.bytes().endswith(packed(("u32", 1), ("u32", ops.GUARDED4), ("bitmap", 1 << attrs.MODE),
                                     ("opaque", packed(("u32", 0o640))), ("u32", ops.CLAIM_NULL),
                                     ("opaque", b"new")))
    p = Packer()
    ops.Open(ops.SHARE_ACCESS_READ, b"owner", 42, reclaim=True).encode(p)
    assert p.bytes().endswith(packed(("u32", 0), ("u32", ops.CLAIM_PREVIOUS), ("u32", ops.DELEG_NONE)))


def test_copy_results():
    sync = (packed(("u32", 0), ("u64", 4096), ("u32", ops.FILE_SYNC4)) + b"verifier"
            + packed(("bool", True), ("bool", True)))
    res = ops.Copy(SID, SID, 0, 0, 4096, True).decode(Unpacker(sync))
    assert res.callback is None and res.result.count == 4096 and res.synchronous
    asynchronous = (packed(("u32", 1)) + SID + packed(("u64", 0), ("u32", ops.UNSTABLE4)) + b"verifier"
                    + packed(("bool", True), ("bool", False)))
    assert ops.Copy(SID, SID, 0, 0, 1 << 30, False).decode(Unpacker(asynchronous)).callback == SID
    two_ids = packed(("u32", 2)) + SID + SID + packed(("u64", 0), ("u32", 0)) + b"verifier" + bytes(8)
    with pytest.raises(ProtocolError, match="callback ids"):
        ops.Copy(SID, SID, 0, 0, 1, False).decode(Unpacker(two_ids))


def test_offload_status():
    assert ops.OffloadStatus(SID).decode(Unpacker(packed(("u64", 10), ("u32", 0)))) == (10, None)
    assert ops.OffloadStatus(SID).decode(Unpacker(packed(("u64", 10), ("u32", 1), ("u32", 0)))) == (10, 0)


def test_read_plus_segments_and_assembly():
    body = packed(("bool", False), ("u32", 2), ("u32", ops.NFS4_CONTENT_DATA), ("u64", 100), ("opaque", b"ab"),
                  ("u32", ops.NFS4_CONTENT_HOLE), ("u64", 102), ("u64", 1000))
    eof, segments = ops.ReadPlus(SID, 100, 10).decode(Unpacker(body))
    assert _assemble(100, 10, eof, segments) == (False, b"ab" + bytes(8))
    with pytest.raises(ProtocolError, match="read_plus content"):
        ops.ReadPlus(SID, 0, 10).decode(Unpacker(packed(("bool", False), ("u32", 1), ("u32", 5), ("u64", 0))))


def test_read_plus_nonsense_is_detected():
    # ganesha 4.3: one empty DATA segment for a range that holds data
    assert _assemble(0, 4096, False, [(0, b"", 0)]) is None
    assert _assemble(0, 4096, False, [(512, b"x", 1)]) is None  # a gap
    assert _assemble(0, 4096, False, [(0, b"xy", 2), (1, b"y", 1)]) is None  # an overlap
    assert _assemble(0, 4096, False, []) is None  # no progress
    assert _assemble(0, 4096, True, []) == (True, b"")  # end of file


def test_sequence_reply_for_another_slot_is_refused():
    seq = ops.Sequence(b"s" * 16, 5, 1, 3, False)
    good = b"s" * 16 + packed(("u32", 5), ("u32", 1), ("u32", 3), ("u32", 3), ("u32", 0))
    assert seq.decode(Unpacker(good)).highest_slot == 3
    bad = b"s" * 16 + packed(("u32", 5), ("u32", 2), ("u32", 3), ("u32", 3), ("u32", 0))
    with pytest.raises(ProtocolError):
        seq.decode(Unpacker(bad))


def test_exchange_id_with_state_protection_is_refused():
    body = packed(("u64", 1), ("u32", 1), ("u32", 0), ("u32", 1))
    with pytest.raises(ProtocolError, match="state protection"):
        ops.ExchangeId(bytes(8), b"me").decode(Unpacker(body))


# -- attributes -------------------------------------------------------------------------


def fattr(mask, body):
    return packed(("bitmap", mask), ("opaque", body))


def test_attribute_decoding():
    mask = attrs.bits(attrs.TYPE, attrs.SIZE, attrs.MODE, attrs.OWNER, attrs.TIME_MODIFY)
    body = packed(("u32", attrs.NF4REG), ("u64", 12), ("u32", 0o4755), ("opaque", b"1000"), ("i64", 5),
                  ("u32", 7))
    values = attrs.decode(Unpacker(fattr(mask, body)), attrs.STAT)
    assert values[attrs.SIZE] == 12 and values[attrs.TIME_MODIFY] == 5_000_000_007
    assert attrs.mode_of(values) == stat.S_IFREG | 0o4755
    assert attrs.uid_of(values[attrs.OWNER]) == 1000


def test_attributes_not_asked_for_are_refused():
    with pytest.raises(ProtocolError, match="not asked"):
        attrs.decode(Unpacker(fattr(1 << 12, b"")), attrs.STAT)  # ACL


def test_attribute_list_too_short_or_too_long():
    with pytest.raises(ProtocolError):
        attrs.decode(Unpacker(fattr(attrs.bits(attrs.SIZE), b"\0\0\0\0")), attrs.STAT)
    with pytest.raises(ProtocolError, match="garbage"):
        attrs.decode(Unpacker(fattr(attrs.bits(attrs.NUMLINKS), bytes(8))), attrs.STAT)


def test_bad_times_and_types():
    with pytest.raises(ProtocolError, match="nanoseconds"):
        attrs.decode(Unpacker(fattr(attrs.bits(attrs.TIME_ACCESS), packed(("i64", 0), ("u32", 10**9)))), attrs.STAT)
    with pytest.raises(ProtocolError, match="file type"):
        attrs.decode(Unpacker(fattr(attrs.bits(attrs.TYPE), packed(("u32", 42)))), attrs.STAT)
    for major, minor in ((1 << 31, 0), (1 << 12, 0), (0, 1 << 20)):  # more than FUSE's 32-bit rdev holds
        with pytest.raises(ProtocolError, match="device number"):
            attrs.decode(Unpacker(fattr(attrs.bits(attrs.RAWDEV), packed(("u32", major), ("u32", minor)))),
                         attrs.STAT)
    assert attrs.decode(Unpacker(fattr(attrs.bits(attrs.RAWDEV), packed(("u32", 4095), ("u32", (1 << 20) - 1)))),
                        attrs.STAT) == {attrs.RAWDEV: (4095, (1 << 20) - 1)}


def test_owner_names():
    assert attrs.uid_of(b"0") == 0
    assert attrs.uid_of(b"1000@example.org") == 1000
    assert attrs.uid_of(b"root@localdomain") == 0
    assert attrs.uid_of(b"no-such-user-here@x") == attrs.NOBODY
    assert attrs.gid_of(b"\xff\xfe") == attrs.NOBODY
    for odd in ("²", "١٢", "99999999999", "4294967295", "a\0b"):  # digits to isdigit, too big, NUL
        assert attrs.uid_of(odd.encode()) == attrs.NOBODY, odd


def test_attribute_encoding_is_in_bit_order():
    p = Packer()
    attrs.encode(p, {attrs.TIME_MODIFY_SET: 1_500_000_000, attrs.MODE: 0o640, attrs.SIZE: 3, attrs.OWNER: 7})
    body = packed(("u64", 3), ("u32", 0o640), ("opaque", b"7"), ("u32", 1), ("i64", 1), ("u32", 500_000_000))
    assert p.bytes() == fattr(attrs.bits(attrs.SIZE, attrs.MODE, attrs.OWNER, attrs.TIME_MODIFY_SET), body)


# -- callbacks ----------------------------------------------------------------------------


SESSION = b"S" * 16


def cb_compound(*op_bodies, tag=b"t"):
    return packed(("opaque", tag), ("u32", 2), ("u32", 0), ("u32", len(op_bodies))) + b"".join(op_bodies)


def cb_sequence(session=SESSION, slot=0):
    return packed(("u32", compound.CB_SEQUENCE)) + session + packed(("u32", 3), ("u32", slot), ("u32", 0),
                                                                    ("bool", False), ("u32", 0))


def run_callback(data):
    seen = []
    reply = compound.callback(Unpacker(data), SESSION, 4, lambda s, o: seen.append(("offload", s, o)),
                              lambda s, fh: seen.append(("recall", s, fh)))
    return Unpacker(reply), seen


def test_cb_offload_is_delivered_and_answered():
    offload = (packed(("u32", compound.CB_OFFLOAD), ("opaque", b"fh")) + SID
               + packed(("u32", 0), ("u32", 0), ("u64", 1 << 20), ("u32", ops.FILE_SYNC4)) + b"verifier")
    u, seen = run_callback(cb_compound(cb_sequence(), offload))
    assert (u.u32(), u.opaque(100), u.u32()) == (0, b"t", 2)
    assert (u.u32(), u.u32(), u.fixed(16), u.u32(), u.u32(), u.u32(), u.u32()) == (
        compound.CB_SEQUENCE, 0, SESSION, 3, 0, 3, 3)
    assert (u.u32(), u.u32()) == (compound.CB_OFFLOAD, 0)
    u.done()
    [(kind, sid, outcome)] = seen
    assert kind == "offload" and sid == SID and outcome.result.count == 1 << 20


def test_cb_offload_failure_carries_the_bytes_copied():
    offload = packed(("u32", compound.CB_OFFLOAD), ("opaque", b"fh")) + SID + packed(("u32", errors.NOSPC),
                                                                                     ("u64", 4096))
    _, [(_, _, outcome)] = run_callback(cb_compound(cb_sequence(), offload))
    assert (outcome.status, outcome.copied, outcome.result) == (errors.NOSPC, 4096, None)


def test_cb_recall():
    recall = packed(("u32", compound.CB_RECALL)) + SID + packed(("bool", False), ("opaque", b"fh"))
    _, seen = run_callback(cb_compound(cb_sequence(), recall))
    assert seen == [("recall", SID, b"fh")]


def test_callback_for_another_session_or_slot():
    u, seen = run_callback(cb_compound(cb_sequence(b"X" * 16), packed(("u32", compound.CB_RECALL))))
    assert u.u32() == errors.BADSESSION and not seen
    u, _ = run_callback(cb_compound(cb_sequence(slot=9)))
    assert u.u32() == errors.BADSLOT


def test_callback_without_sequence_and_unknown_operations():
    u, _ = run_callback(cb_compound(packed(("u32", compound.CB_RECALL_ANY), ("u32", 0), ("u32", 0))))
    assert u.u32() == errors.OP_NOT_IN_SESSION
    u, _ = run_callback(cb_compound(cb_sequence(), packed(("u32", 5000))))
    assert u.u32() == errors.OP_ILLEGAL
    u.opaque(10)
    assert u.u32() == 2
    u.u32(), u.u32(), u.fixed(16), u.u32(), u.u32(), u.u32(), u.u32()
    assert (u.u32(), u.u32()) == (compound.OP_ILLEGAL, errors.OP_ILLEGAL)
    u, _ = run_callback(cb_compound(cb_sequence(), packed(("u32", 5))))  # CB_LAYOUTRECALL: known, not ours
    assert u.u32() == errors.NOTSUPP


def test_callback_with_too_many_operations():
    with pytest.raises(ProtocolError):
        run_callback(packed(("opaque", b""), ("u32", 2), ("u32", 0), ("u32", 1000)))


# -- fuzzing: nothing but ProtocolError (or a clean result) from any bytes ------------------

FUZZ_OPS = [
    [ops.Sequence(SESSION, 1, 0, 0, False), ops.PutFH(b"fh"), ops.GetAttr(attrs.STAT)],
    [ops.PutFH(b"fh"), ops.ReadDir(0, bytes(8), 100, 1000, attrs.DIRENT)],
    [ops.PutFH(b"fh"), ops.Open(1, b"o", 0), ops.GetFH()],
    [ops.PutFH(b"fh"), ops.ReadPlus(SID, 0, 100), ops.Read(SID, 0, 100)],
    [ops.ExchangeId(bytes(8), b"me")],
    [ops.CreateSession(1, 1, ops.ChannelAttrs(1, 1, 1, 1, 1), ops.ChannelAttrs(1, 1, 1, 1, 1), 1)],
    [ops.PutFH(b"fh"), ops.SaveFH(), ops.PutFH(b"fh"), ops.Copy(SID, SID, 0, 0, 1, False),
     ops.OffloadStatus(SID), ops.Seek(SID, 0, True), ops.Write(SID, 0, 0, b"abc"), ops.Commit()],
]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(FUZZ_OPS) - 1), st.binary(max_size=300))
def test_fuzzed_compound_replies(which, tail):
    op_list = FUZZ_OPS[which]
    # A plausible start (status, tag, count, first op number) so the fuzz reaches the operation decoders.
    data = packed(("u32", 0), ("opaque", b""), ("u32", len(op_list)), ("u32", op_list[0].num)) + tail
    try:
        compound.decode(Unpacker(data), op_list)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_callbacks(tail):
    data = packed(("opaque", b""), ("u32", 2), ("u32", 0), ("u32", 2)) + cb_sequence() + tail
    try:
        compound.callback(Unpacker(data), SESSION, 4, lambda s, o: None, lambda s, f: None)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100))
def test_fuzzed_rpc_replies(data):
    try:
        rpc.parse_reply(Unpacker(data))
    except (ProtocolError, rpc.RPCError):
        pass


def test_inconsistent_compound_status():
    with pytest.raises(ProtocolError, match="every operation succeeded"):
        compound.decode(Unpacker(compound_reply(errors.IO, result(24, 0))), [ops.PutRootFH()])
    with pytest.raises(ProtocolError, match="OP_ILLEGAL"):
        compound.decode(Unpacker(compound_reply(0, result(compound.OP_ILLEGAL, 0))), [ops.PutRootFH()])
