"""COMPOUND framing (fore channel) and CB_COMPOUND handling (back channel).

A compound runs its operations in order and stops at the first failure, so
a reply holds a result per operation up to and including the failed one.
"""
from dataclasses import dataclass

from . import errors, ops
from .xdr import Packer, ProtocolError

MAX_CB_OPS = 16
OP_ILLEGAL = 10044
CB_RECALL, CB_RECALL_ANY, CB_SEQUENCE, CB_OFFLOAD = 4, 8, 11, 15
CB_KNOWN = range(3, 16)


@dataclass
class Failure:
    index: int
    status: int
    detail: object


def encode(op_list, minorversion):
    p = Packer()
    p.opaque(b"")  # tag
    p.u32(minorversion)
    p.u32(len(op_list))
    for op in op_list:
        p.u32(op.num)
        op.encode(p)
    return bytes(p.buf)


def decode(u, op_list):
    """(results of the operations that succeeded, Failure or None)."""
    status = u.u32()
    u.opaque(ops.OPAQUE_LIMIT, "tag")
    n = u.count(len(op_list), 8, "compound results")
    results = []
    for i in range(n):
        num = u.u32()
        if num != op_list[i].num and num != OP_ILLEGAL:
            raise ProtocolError(f"result {i} is for operation {num}, not {op_list[i].num}")
        op_status = u.u32()
        if num == OP_ILLEGAL and op_status == errors.OK:
            raise ProtocolError(f"result {i}: OP_ILLEGAL without an error")
        if op_status != errors.OK:
            detail = op_list[i].decode_error(u, op_status)
            u.done()
            return results, Failure(i, op_status, detail)
        results.append(op_list[i].decode(u))
    u.done()
    if status != errors.OK:
        if n == len(op_list):
            raise ProtocolError(f"compound failed with {status} though every operation succeeded")
        return results, Failure(n, status, None)  # failed before any operation ran (e.g. minor version)
    if n < len(op_list):
        raise ProtocolError(f"{n} results for {len(op_list)} operations, and no error")
    return results, None


@dataclass
class Offload:
    """A CB_OFFLOAD: how an asynchronous COPY ended."""
    status: int
    result: ops.WriteResult | None  # on success
    copied: int  # bytes copied (also on failure)


def callback(u, sessionid, back_slots, on_offload, on_recall):
    """Answer one CB_COMPOUND; returns the reply body.

    ``on_offload(stateid, Offload)`` and ``on_recall(stateid, fh)`` must not block:
    the reply goes back on the connection whose reader delivers everything else.
    """
    tag = u.opaque(ops.OPAQUE_LIMIT, "tag")
    u.u32()  # minor version
    u.u32()  # callback_ident (4.0 only)
    n = u.count(MAX_CB_OPS, 4, "callback operations")
    out = Packer()
    replies = 0
    status = errors.OK
    for i in range(n):
        num = u.u32()
        body = Packer()
        if num == CB_SEQUENCE:
            sid, seqid, slot, _highest, _cache = u.fixed(16), u.u32(), u.u32(), u.u32(), u.bool()
            for _ in range(u.count(MAX_CB_OPS, 20, "referring call lists")):
                u.fixed(16)
                for _ in range(u.count(1024, 8, "referring calls")):
                    u.u32()
                    u.u32()
            if i != 0:
                status = errors.SEQUENCE_POS
            elif sid != sessionid:
                status = errors.BADSESSION
            elif slot >= back_slots:
                status = errors.BADSLOT
            else:
                body.fixed(sid, 16)
                for v in (seqid, slot, back_slots - 1, back_slots - 1):
                    body.u32(v)
        elif i == 0:
            status = errors.OP_NOT_IN_SESSION
        elif num == CB_OFFLOAD:
            u.opaque(ops.FHSIZE, "filehandle")
            sid = ops.stateid(u)
            copy_status = u.u32()
            if copy_status == errors.OK:
                _, result = ops.write_response(u)
                on_offload(sid, Offload(copy_status, result, result.count))
            else:
                on_offload(sid, Offload(copy_status, None, u.u64()))
        elif num == CB_RECALL:
            sid = ops.stateid(u)
            u.bool()  # truncate
            on_recall(sid, u.opaque(ops.FHSIZE, "filehandle"))
        elif num == CB_RECALL_ANY:
            u.u32()
            u.bitmap()
        elif num in CB_KNOWN:
            status = errors.NOTSUPP  # layouts, notifications: nothing we asked for
        else:
            num, status = OP_ILLEGAL, errors.OP_ILLEGAL
        out.u32(num)
        out.u32(status)
        if status == errors.OK:
            out.buf += body.buf
        replies += 1
        if status != errors.OK:
            break
    head = Packer()
    head.u32(status)
    head.opaque(tag)
    head.u32(replies)
    return bytes(head.buf + out.buf)
