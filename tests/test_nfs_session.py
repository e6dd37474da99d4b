"""The NFSv4.1 session against a scripted fake server: slots, sequence IDs and recovery.

Real servers rarely lose a request or a session on cue, so a small server
here does just enough NFSv4.1 (EXCHANGE_ID, CREATE_SESSION, SEQUENCE with a
per-slot sequence check, BIND_CONN_TO_SESSION, GETATTR) and misbehaves as
each test asks: drops the connection, never answers, forgets the session or
the client, answers DELAY.
"""
import itertools
import struct

import pytest
import trio
import trio.testing

from offloadfs.backends.nfs import attrs, errors, ops, rpc
from offloadfs.backends.nfs.session import RECORD_OVERHEAD, Client, Settings
from offloadfs.backends.nfs.xdr import Packer, Unpacker

PROBE = attrs.bits(attrs.TYPE)  # the GETATTR a test sends; setup asks for other attributes


class FakeServer:
    def __init__(self):
        # What to do with each probe: drop the connection or never answer (after running it, or
        # "-unseen": before), forget the session ("badsession") or the client ("stale"), "delay".
        self.plan = []
        self.clientids = itertools.count(100)
        self.clientid = None
        self.sessions = {}  # session id -> {slot: last sequence ID}
        self.sessions_made = 0
        self.exchanges = 0
        self.binds = 0
        self.misordered = 0
        self.busy = None  # a slot whose request is still running
        self.replay = errors.RETRY_UNCACHED_REP  # the answer to a sequence ID the slot used last
        self.lease = 90
        self.maxio = 1 << 20  # MAXREAD and MAXWRITE
        self.renewals = 0  # compounds of SEQUENCE alone
        self.current = None  # (slot, sequence ID) of the compound being run
        self.probes = []  # (slot, seqid) of every probe that ran
        self.port = None

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self.connection, listeners)

    async def connection(self, stream):
        buf = b""
        try:
            while True:
                while len(buf) < 4 or len(buf) < 4 + (struct.unpack(">I", buf[:4])[0] & 0x7FFFFFFF):
                    chunk = await stream.receive_some()
                    if not chunk:
                        return
                    buf += chunk
                size = struct.unpack(">I", buf[:4])[0] & 0x7FFFFFFF
                record, buf = buf[4:4 + size], buf[4 + size:]
                reply = self.call(Unpacker(record))
                if reply == "drop":
                    return
                if reply == "hang":
                    continue  # never answered; the rest of the connection goes on
                await stream.send_all(struct.pack(">I", 0x80000000 | len(reply)) + reply)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()

    def call(self, u):
        xid, _, _, _, _, proc = (u.u32() for _ in range(6))
        u.u32(), u.opaque(400), u.u32(), u.opaque(400)
        head = struct.pack(">6I", xid, rpc.REPLY, 0, 0, 0, 0)
        if proc == 0:
            return head
        u.opaque(1024)
        u.u32()
        if Unpacker(u.data, u.pos).u32() == 1 and Unpacker(u.data, u.pos + 4).u32() == ops.OP_SEQUENCE:
            self.renewals += 1
        results = []
        status = 0
        for _ in range(u.u32()):
            num = u.u32()
            status, body = self.op(num, u)
            if status in ("drop", "hang"):
                return status
            results.append(struct.pack(">II", num, status) + body)
            if status:
                break
        p = Packer()
        p.u32(status)
        p.opaque(b"")
        p.u32(len(results))
        return head + bytes(p.buf) + b"".join(results)

    def op(self, num, u):
        p = Packer()
        if num == ops.OP_EXCHANGE_ID:
            u.fixed(8), u.opaque(1024), u.u32(), u.u32(), u.u32()
            self.exchanges += 1
            self.clientid = next(self.clientids)
            p.u64(self.clientid)
            p.u32(1), p.u32(0), p.u32(0), p.u64(0), p.opaque(b"fake"), p.opaque(b"fake"), p.u32(0)
        elif num == ops.OP_CREATE_SESSION:
            clientid = u.u64()
            u.u32(), u.u32()
            for _ in range(2):
                [u.u32() for _ in range(6)], u.u32()
            u.u32()
            [u.u32() for _ in range(u.u32())]
            if clientid != self.clientid:
                return errors.STALE_CLIENTID, b""
            self.sessions_made += 1
            sid = struct.pack(">16s", b"session%d" % self.sessions_made)
            self.sessions[sid] = {}
            p.fixed(sid, 16), p.u32(1), p.u32(ops.CREATE_SESSION_CONN_BACK_CHAN)
            for attrs_ in ((1 << 21, 1 << 21, 8192, 16, 4), (16384, 16384, 0, 8, 1)):
                p.u32(0)
                for v in attrs_:
                    p.u32(v)
                p.u32(0)
        elif num == ops.OP_BIND_CONN_TO_SESSION:
            sid = u.fixed(16)
            u.u32(), u.u32()
            if sid not in self.sessions:
                return errors.BADSESSION, b""
            self.binds += 1
            p.fixed(sid, 16), p.u32(3), p.u32(0)
        elif num in (ops.OP_DESTROY_SESSION,):
            self.sessions.pop(u.fixed(16), None)
        elif num == ops.OP_DESTROY_CLIENTID:
            u.u64()
        elif num == ops.OP_SEQUENCE:
            sid, seqid, slot = u.fixed(16), u.u32(), u.u32()
            u.u32(), u.u32()
            action = self.plan[0] if self.plan and self._is_probe(u) else "ok"
            if action == "badsession":
                self.plan.pop(0)
                self.sessions.pop(sid, None)
            elif action == "stale":
                self.plan.pop(0)
                self.sessions.clear()
                self.clientid = None
            if sid not in self.sessions:
                return errors.BADSESSION, b""
            if action == "delay":
                self.plan.pop(0)
                return errors.DELAY, b""
            if action in ("drop-unseen", "hang-unseen"):  # lost before the server sees it
                self.plan.pop(0)
                return action.split("-")[0], b""
            slots = self.sessions[sid]
            last = slots.get(slot, 0)
            if seqid == last:
                return self.replay, b""
            if self.busy == slot:  # Linux nfsd, while the slot's request still runs
                self.busy = None
                self.misordered += 1
                return errors.SEQ_MISORDERED, b""
            if seqid != last + 1:
                self.misordered += 1
                return errors.SEQ_MISORDERED, b""
            slots[slot] = seqid
            self.current = (slot, seqid)
            p.fixed(sid, 16)
            for v in (seqid, slot, 3, 3, 0):
                p.u32(v)
        elif num == ops.OP_RECLAIM_COMPLETE:
            u.u32()
        elif num == ops.OP_PUTROOTFH:
            pass
        elif num == ops.OP_SECINFO_NO_NAME:
            u.u32()
            p.u32(1), p.u32(rpc.AUTH_SYS_FLAVOR)
        elif num == ops.OP_GETATTR:
            mask = u.bitmap()
            if mask == PROBE:
                action = self.plan.pop(0) if self.plan else "ok"
                self.probes.append(self.current)
                if action == "hang-busy":  # runs on and on: its slot stays busy for the next request
                    self.busy, action = self.current[0], "hang"
                if action in ("drop", "hang"):
                    return action, b""
                p.bitmap(PROBE)
                p.opaque(struct.pack(">I", attrs.NF4DIR))
            else:
                body = Packer()
                body.bitmap(PROBE | attrs.bits(attrs.LEASE_TIME, attrs.MAXREAD, attrs.MAXWRITE))
                body.u32(self.lease)
                body.u64(self.maxio)
                body.u64(self.maxio)
                p.bitmap(attrs.bits(attrs.SUPPORTED_ATTRS, attrs.LEASE_TIME, attrs.MAXREAD, attrs.MAXWRITE))
                p.opaque(bytes(body.buf))
        else:
            raise AssertionError(f"fake server got operation {num}")
        return 0, bytes(p.buf)

    @staticmethod
    def _is_probe(u):
        """Peek: is this compound SEQUENCE + PUTROOTFH + GETATTR(PROBE)?"""
        rest = Unpacker(u.data, u.pos)
        try:
            return rest.u32() == ops.OP_PUTROOTFH and rest.u32() == ops.OP_GETATTR and rest.bitmap() == PROBE
        except Exception:
            return False


async def started(nursery, lease=90, maxio=1 << 20, **settings):
    server = FakeServer()
    server.lease, server.maxio = lease, maxio
    await nursery.start(server.serve)
    client = Client(Settings("127.0.0.1", server.port, timeo=settings.pop("timeo", 2.0), **settings))
    client.users = 1
    await client.start()
    return server, client


async def probe(client):
    [_, values] = await client.compound([ops.PutRootFH(), ops.GetAttr(PROBE)])
    assert values == {attrs.TYPE: attrs.NF4DIR}


async def test_requests_take_turns_on_slots_with_rising_sequence_ids():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        async with trio.open_nursery() as calls:
            for _ in range(10):
                calls.start_soon(probe, client)
        assert len(server.probes) == 10 and len(set(server.probes)) == 10
        assert {slot for slot, _ in server.probes} <= set(range(4))
        await client.close()
        nursery.cancel_scope.cancel()


async def test_lost_connection_resends_on_the_same_slot_and_sequence_id():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["drop"]  # the server runs it, then the connection dies before the reply
        await probe(client)
        # ran once, resent with the same sequence ID (a replay: RETRY_UNCACHED_REP), then anew
        first, second = server.probes
        assert second == (first[0], first[1] + 1) and server.binds == 1 and server.sessions_made == 1
        generation = client.generation
        server.plan = ["drop-unseen"]  # lost before the server saw it: the resend is new to it
        await probe(client)
        assert server.probes[-1][1] == second[1] + 1 and client.generation == generation
        await client.close()
        nursery.cancel_scope.cancel()


async def test_lost_session_is_replaced_on_the_same_client_id():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["badsession"]
        await probe(client)
        assert server.sessions_made == 2 and server.exchanges == 1 and client.generation == 0
        await client.close()
        nursery.cancel_scope.cancel()


async def test_forgotten_client_means_a_new_one_and_reopened_files():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["stale"]
        await probe(client)
        assert server.exchanges == 2 and client.generation == 1
        await client.close()
        nursery.cancel_scope.cancel()


async def test_delay_is_waited_out():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["delay", "delay"]
        await probe(client)
        assert len(server.probes) == 1
        await client.close()
        nursery.cancel_scope.cancel()


async def test_cut_off_request_that_never_ran_leaves_the_slot_usable():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["hang-unseen"]
        with trio.move_on_after(0.3):
            await probe(client)
        for _ in range(6):  # every slot gets used again, the cut-off one too
            await probe(client)
        assert len(server.probes) == 6 and server.misordered == 1  # then the slot's sequence ID came back
        await client.close()
        nursery.cancel_scope.cancel()


async def test_cut_off_request_that_ran_leaves_the_slot_usable():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["hang"]
        with trio.move_on_after(0.3):
            await probe(client)  # the server ran it: its slot moved on
        for _ in range(6):
            await probe(client)
        assert len(server.probes) == 7 and server.misordered == 0
        await client.close()
        nursery.cancel_scope.cancel()


async def test_cut_off_request_still_running_leaves_the_slot_usable():
    """Linux nfsd answers SEQ_MISORDERED while the cut-off request still runs, and SEQ_FALSE_RETRY to the
    next request sent with the sequence ID taken back then: the cut-off one ran after all."""
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan, server.replay = ["hang-busy"], errors.SEQ_FALSE_RETRY
        with trio.move_on_after(0.3):
            await probe(client)
        for _ in range(6):
            await probe(client)
        assert len(server.probes) == 7 and server.misordered == 1
        await client.close()
        nursery.cancel_scope.cancel()


async def test_soft_mount_gives_up_on_a_silent_server():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery, soft=True, timeo=0.3, retrans=1)
        server.plan = ["hang"] * 10
        with trio.fail_after(30):  # gives up after 2 x 0.3 s; a hard mount would wait for ever
            with pytest.raises(TimeoutError, match="soft"):
                await probe(client)
        server.plan = []
        await probe(client)
        await client.close()
        nursery.cancel_scope.cancel()


async def test_hard_mount_reconnects_after_a_silent_server_times_out():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery, timeo=0.3)
        server.plan = ["hang"]
        with trio.fail_after(5):
            await probe(client)
        assert server.binds >= 1
        await client.close()
        nursery.cancel_scope.cancel()


async def test_idle_client_renews_its_lease():
    """Renewals come every lease / 3 while idle, none while traffic renews it.  The bounds follow the
    time the test took, so a busy machine makes them wider, never the test wrong."""
    period = 2  # lease / 3
    start = trio.current_time()  # before the client's start: its lease is renewed no earlier
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery, lease=3 * period)
        with trio.fail_after(60):  # a guard against a wedged renewer only
            while server.renewals < 2:
                await trio.sleep(0.05)
        assert server.renewals <= (trio.current_time() - start) // period
        idle, last, gaps = server.renewals, trio.current_time(), 0
        for _ in range(30):
            await probe(client)
            now = trio.current_time()
            gaps += (now - last) // period  # a pause this long (a busy machine) may need a renewal
            last = now
            await trio.sleep(0.2)  # busy: no renewal needed
        # (+1: the renewal that may be under way as the traffic starts)
        assert server.renewals - idle <= 1 + gaps, (server.renewals, idle, gaps)
        await client.close()
        nursery.cancel_scope.cancel()


async def test_offload_records_survive_an_early_callback_and_ignore_a_late_one():
    client = Client(Settings("192.0.2.1"))
    early, late = b"\0\0\0\1" + b"e" * 12, b"\0\0\0\1" + b"l" * 12
    client._offload_done(early, "early outcome")  # CB_OFFLOAD before the COPY reply
    record = client.offload(early)
    assert record.done.is_set() and record.outcome == "early outcome"
    client.offload_ended(early)
    client.offload(late)
    client.offload_ended(late)  # cancelled: the server reports its end afterwards
    client._offload_done(late, "late outcome")
    assert client.offloads == {}


def test_unclaimed_callbacks_are_dropped_after_a_while():
    async def body():
        client = Client(Settings("192.0.2.1"))
        client._offload_done(b"\0\0\0\1" + b"o" * 12, "orphan")  # its COPY reply never came
        await trio.sleep(301)
        client._offload_done(b"\0\0\0\1" + b"n" * 12, "new")
        assert list(client.offloads) == [b"n" * 12]
    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_requests_waiting_for_a_slot_when_the_session_goes_recover_first():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        server.plan = ["badsession"]
        with trio.fail_after(5):
            async with trio.open_nursery() as calls:
                for _ in range(12):  # more than the slots: most wait for one while the session goes
                    calls.start_soon(probe, client)
        assert server.sessions_made == 2
        await client.close()
        nursery.cancel_scope.cancel()


async def test_records_are_bounded_by_the_negotiated_io_size():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery, maxio=64 << 10)
        assert client.conn.max_record == (64 << 10) + RECORD_OVERHEAD
        server.plan = ["drop"]
        await probe(client)  # on a new connection
        assert server.binds == 1 and client.conn.max_record == (64 << 10) + RECORD_OVERHEAD
        await client.close()
        nursery.cancel_scope.cancel()
