"""ONC RPC over a stream: XID multiplexing, record marking, callbacks, and a dying peer."""
import contextlib
import struct

import pytest
import trio
import trio.testing

from offloadfs.backends.nfs import rpc
from offloadfs.backends.nfs.xdr import Packer, Unpacker


def record(data, last=True):
    return struct.pack(">I", (0x80000000 if last else 0) | len(data)) + data


def accepted(xid, body=b""):
    p = Packer()
    for v in (xid, rpc.REPLY, rpc.MSG_ACCEPTED, 0, 0, rpc.SUCCESS):
        p.u32(v)
    return p.bytes() + body


class Peer:
    """The server end of a memory stream: reads our calls' records, writes raw bytes back."""

    def __init__(self, stream):
        self.stream = stream
        self.buf = b""

    async def read_record(self):
        while True:
            if len(self.buf) >= 4:
                (header,) = struct.unpack(">I", self.buf[:4])
                size = header & 0x7FFFFFFF
                if len(self.buf) >= 4 + size:
                    data, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
                    return data
            chunk = await self.stream.receive_some()
            if not chunk:
                return None
            self.buf += chunk

    async def read_call(self):
        """(xid, procedure, args) of our next call."""
        u = Unpacker(await self.read_record())
        xid, kind, _vers, _prog, _v, proc = (u.u32() for _ in range(6))
        assert kind == rpc.CALL
        u.u32(), u.opaque(400), u.u32(), u.opaque(400)
        return xid, proc, bytes(u.data[u.pos:])


async def on_call(prog, vers, proc, args):
    if prog != 77:
        return None
    return b"pong" + bytes(args.data[args.pos:])


async def connected(nursery, max_record=1 << 20):
    ours, theirs = trio.testing.memory_stream_pair()
    conn = rpc.Connection(ours, on_call, max_record, 60)
    nursery.start_soon(conn.serve)
    return conn, Peer(theirs)


async def test_calls_are_matched_to_replies_by_xid():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)
        answers = {}

        async def call(arg):
            u = await conn.call(100003, 4, 1, rpc.AUTH_NONE, arg)
            answers[arg] = bytes(u.data[u.pos:])

        nursery.start_soon(call, b"aaaa")
        nursery.start_soon(call, b"bbbb")
        first = await peer.read_call()
        second = await peer.read_call()
        await peer.stream.send_all(record(accepted(99999)))  # nobody waits for this one
        for xid, _, args in (second, first):
            await peer.stream.send_all(record(accepted(xid, args.upper())))
        while len(answers) < 2:
            await trio.sleep(0.01)
        assert answers == {b"aaaa": b"AAAA", b"bbbb": b"BBBB"}
        await conn.close()


async def test_fragmented_reply_is_reassembled():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)

        async def reply():
            xid, _, _ = await peer.read_call()
            data = accepted(xid, b"12345678")
            await peer.stream.send_all(record(data[:10], last=False) + record(data[10:]))

        nursery.start_soon(reply)
        u = await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")
        assert bytes(u.data[u.pos:]) == b"12345678"
        await conn.close()


async def test_oversized_record_drops_the_connection():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery, max_record=64)

        async def reply():
            xid, _, _ = await peer.read_call()
            await peer.stream.send_all(record(b"x" * 40, last=False) + record(b"y" * 40))

        nursery.start_soon(reply)
        with pytest.raises(rpc.ConnectionLost, match="protocol error"):
            await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")
        with pytest.raises(rpc.ConnectionLost):
            await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")


async def test_fragment_flood_drops_the_connection():
    """200 000 empty fragments before a reply would cost a fraction of a second of CPU each time."""
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery, max_record=64 << 10)

        async def flood():
            xid, _, _ = await peer.read_call()
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await peer.stream.send_all(record(b"", last=False) * 200_000 + record(accepted(xid)))

        nursery.start_soon(flood)
        with pytest.raises(rpc.ConnectionLost, match="fragments"):
            await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")
        assert conn.garbage == f"record in more than {16 + 64} fragments"


async def test_peer_closing_fails_waiting_calls():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)

        async def hang_up():
            await peer.read_call()
            await peer.stream.aclose()

        nursery.start_soon(hang_up)
        with pytest.raises(rpc.ConnectionLost, match="closed"):
            await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")


async def test_garbage_reply_header_drops_the_connection():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)

        async def garbage():
            xid, _, _ = await peer.read_call()
            await peer.stream.send_all(record(struct.pack(">II", xid, 7)))

        nursery.start_soon(garbage)
        with pytest.raises(rpc.ConnectionLost, match="msg_type"):
            await conn.call(1, 1, 1, rpc.AUTH_NONE, b"")


async def test_refused_call_raises_rpc_error():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)

        async def refuse():
            xid, _, _ = await peer.read_call()
            await peer.stream.send_all(record(struct.pack(">6I", xid, 1, 0, 0, 0, rpc.PROC_UNAVAIL)))

        nursery.start_soon(refuse)
        with pytest.raises(rpc.RPCError, match="procedure"):
            await conn.call(1, 1, 9, rpc.AUTH_NONE, b"")
        await conn.close()


async def test_calls_from_the_server_are_answered():
    async with trio.open_nursery() as nursery:
        conn, peer = await connected(nursery)
        for xid, prog, accept, body in ((5, 77, rpc.SUCCESS, b"pong!"), (6, 78, rpc.PROG_UNAVAIL, b"")):
            call = struct.pack(">10I", xid, rpc.CALL, 2, prog, 1, 1, 0, 0, 0, 0) + b"!"
            await peer.stream.send_all(record(call))
            assert await peer.read_record() == struct.pack(">6I", xid, rpc.REPLY, 0, 0, 0, accept) + body
        await conn.close()
