"""Mutators for the lab proxy that aim at NFSv4.1 replies (see proxy.py).

A COMPOUND reply is read only as far as the tests need: the leading results
of known shape (SEQUENCE, PUTFH, GETATTR), then the offset of the next one.
"""
import random

from offloadfs.backends.nfs import ops
from offloadfs.backends.nfs.xdr import ProtocolError, Unpacker
from offloadfs.lab.proxy import RPC, RandomMutator

# How to step over a result after its status.
SKIP_RESULT = {ops.OP_SEQUENCE: lambda u: u.fixed(36), ops.OP_PUTFH: lambda u: None,
               ops.OP_GETATTR: lambda u: (u.bitmap(), u.opaque(1 << 16))}


def compound_results(record):
    """[(operation, offset of its status)] of a COMPOUND reply, as far as results of known shape
    allow: the first result of another (or a failed one) is the last listed; None if the record
    is no accepted reply."""
    try:
        u = Unpacker(record)
        _xid, kind, reply_stat = u.u32(), u.u32(), u.u32()
        if kind != 1 or reply_stat != 0:
            return None
        u.u32(), u.opaque(400)  # verifier
        if u.u32() != 0:
            return None
        u.u32(), u.opaque(1024)  # compound status, tag
        found = []
        for _ in range(u.u32()):
            op, at = u.u32(), u.pos
            found.append((op, at))
            if u.u32() != 0 or op not in SKIP_RESULT:
                break
            SKIP_RESULT[op](u)
        return found
    except ProtocolError:
        return None


class LoopingListing:
    """Answers every READDIR with the first page it saw, eof never set: a listing that never ends.
    ``fresh_cookies``: each entry of each answer gets a cookie never used before (so only the
    listing's bounds can end it)."""

    def __init__(self, fresh_cookies=False):
        self.fresh_cookies = fresh_cookies
        self.page = None
        self.readdirs = 0
        self._cookie = 1 << 40

    def __call__(self, record):
        found = compound_results(record)
        if not found or found[-1][0] != ops.OP_READDIR or record[found[-1][1]:found[-1][1] + 4] != bytes(4):
            return RPC.frame(record)
        self.readdirs += 1
        start = found[-1][1] + 4  # the READDIR result after its status: verifier, entries, eof
        if self.page is None:
            self.page = record[start:-4]
        page = self._renumbered(self.page) if self.fresh_cookies else self.page
        return RPC.frame(record[:start] + page + bytes(4))

    def _renumbered(self, page):
        data = bytearray(page)
        u = Unpacker(page, 8)  # past the cookie verifier
        while u.bool():
            self._cookie += 1
            data[u.pos:u.pos + 8] = self._cookie.to_bytes(8, "big")
            u.u64(), u.opaque(1 << 16)  # cookie, name
            u.bitmap(), u.opaque(1 << 16)  # attributes
        return bytes(data)


class NFSMutator:
    """RandomMutator's kinds that break framing or timing, plus mutations aimed at NFS fields:
    an operation's status, the xid, the length of an attribute list, a bit of the RPC header.

    Byte flips are kept off the payload (READ data, names, attribute values): AUTH_SYS has no
    integrity, so the client cannot tell a flipped byte of data from the file's own, and a
    workload could not check what it reads.  Everything left here, the client can detect.
    """

    GENERIC = ("truncate", "long", "short", "repeat", "stall", "close", "reset")
    NFS = ("status", "xid", "attrsize", "header")
    # OK, IO, STALE, SERVERFAULT, DELAY, BADSESSION, SEQ_MISORDERED, RETRY_UNCACHED_REP, nonsense
    STATUSES = (0, 5, 70, 10006, 10008, 10052, 10063, 10068, 0xFFFFFFFF)

    def __init__(self, seed, rate):
        self.rng = random.Random(seed)
        self.rate = rate
        self.generic = RandomMutator(RPC, seed, rate=1.0, kinds=self.GENERIC)
        self.counts = dict.fromkeys(self.NFS, 0)
        self.mutated = 0

    def __call__(self, record):
        rng = self.rng
        if rng.random() >= self.rate:
            return RPC.frame(record)
        self.mutated += 1
        kind = rng.choice(self.GENERIC + self.NFS)
        if kind in self.GENERIC:
            self.generic.kinds = (kind,)
            return self.generic(record)
        self.counts[kind] += 1
        data = bytearray(record)
        found = compound_results(record) or []
        if kind == "status" and found:
            _, at = rng.choice(found)
            data[at:at + 4] = rng.choice(self.STATUSES).to_bytes(4, "big")
        elif kind == "xid" and len(data) >= 4:
            xid = int.from_bytes(data[:4], "big")
            data[:4] = ((xid + rng.choice((1, -1, 1 << 31))) & 0xFFFFFFFF).to_bytes(4, "big")
        elif kind == "attrsize" and found and found[-1][0] == ops.OP_GETATTR:
            at = found[-1][1] + 4
            at += 4 + 4 * int.from_bytes(data[at:at + 4], "big")  # past the bitmap: the attrlist's length
            if at + 4 <= len(data):
                size = int.from_bytes(data[at:at + 4], "big")
                lie = rng.choice((0, size - 4, size + 4, 0xFFFFFFFF)) & 0xFFFFFFFF
                data[at:at + 4] = lie.to_bytes(4, "big")
        elif kind == "header" and len(data) >= 24:
            data[rng.randrange(24)] ^= 1 << rng.randrange(8)
        return RPC.frame(bytes(data))

    def summary(self):
        generic = {k: v for k, v in self.generic.counts.items() if v}
        return f"{self.mutated} replies mutated: {generic} {self.counts}"
