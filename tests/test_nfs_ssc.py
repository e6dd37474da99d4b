"""Inter-server copy (RFC 7862 COPY_NOTIFY + COPY): the destination's server pulls the file.

First with scripted servers (what goes on the wire, which refusals are
remembered, cancellation), then between two Linux nfsd guests built with
CONFIG_NFSD_V4_2_INTER_SSC (the first run builds that nfsd, ~1.5 min, then
it is cached), through the backend and through a real mount.
"""
import os
import shutil
import signal
import subprocess

import pytest
import trio
import trio.testing

from backendkit import make, mounted

from offloadfs.backends.base import NotSupported
from offloadfs.backends.nfs import errors, ops
from offloadfs.backends.nfs.backend import NFSBackend
from offloadfs.backends.nfs.compound import Offload
from offloadfs.backends.nfs.errors import NFSError
from offloadfs.backends.nfs.session import Client, Settings
from offloadfs.backends.nfs.xdr import Packer, Unpacker
from offloadfs.lab import freeze
from offloadfs.planner import Endpoint, Planner
from offloadfs.stats import Stats

NOTIFY_SID = b"N" * 16
COPY_SID = b"C" * 16
VERIFIER = b"verifier"
SOURCE = ops.NetLoc(ops.NL4_NETADDR, ("tcp", "10.0.0.1.8.1"))


class FakeFile:
    """An open file whose open state is current (generation 0), so no OPEN goes out."""

    def __init__(self, fh):
        self.node = type("Node", (), {"fh": fh})()
        self.stateid = b"S" * 16
        self.generation = 0
        self.lock = trio.Lock()


def server(host, answer):
    """A backend whose compounds ``answer(op_list)`` answers (the last operation's result)."""
    b = NFSBackend(f"nfs://{host}/export", {})
    b.client = Client(Settings(host))
    b.client.address = (host, 2049)
    b.sent = []

    async def call(op_list, **kw):
        b.sent.append(op_list)
        return [None] * (len(op_list) - 1) + [await answer(op_list)]

    b._call = call
    return b


def source(answer=None, host="10.0.0.1"):
    """A source server that answers COPY_NOTIFY and its withdrawal."""
    async def notify(op_list):
        op = op_list[-1]
        if isinstance(op, ops.CopyNotify):
            return ops.Notified(NOTIFY_SID, [SOURCE], 10)
        assert isinstance(op, ops.OffloadCancel) and op.stateid == NOTIFY_SID
    return server(host, answer or notify)


def run(test):
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def test_netloc_and_the_copy_that_names_its_source():
    p = Packer()
    ops.Copy(NOTIFY_SID, COPY_SID, 0, 0, 5, False, [SOURCE]).encode(p)
    u = Unpacker(bytes(p.buf))
    u.fixed(32)
    assert (u.u64(), u.u64(), u.u64(), u.bool(), u.bool()) == (0, 0, 5, True, False)
    assert u.count(4, 4) == 1 and ops.NetLoc.decode(u) == SOURCE
    u.done()
    assert ops.NetLoc.address("10.213.0.3", 2049).value == ("tcp", "10.213.0.3.8.1")
    assert ops.NetLoc.address("fd00::3", 2049).value == ("tcp6", "fd00::3.8.1")

    p = Packer()  # COPY_NOTIFY4resok as Linux nfsd sends it
    p.i64(10)
    p.u32(0)
    p.fixed(NOTIFY_SID, 16)
    p.u32(1)
    SOURCE.encode(p)
    assert ops.CopyNotify(COPY_SID, SOURCE).decode(Unpacker(bytes(p.buf))) == ops.Notified(NOTIFY_SID, [SOURCE], 10)


def test_pull_is_notify_then_asynchronous_copy_then_withdrawal():
    async def main():
        async def copy(op_list):
            op = op_list[-1]
            if isinstance(op, ops.Copy):
                dst.client._offload_done(COPY_SID, Offload(errors.OK, ops.WriteResult(op.count, ops.UNSTABLE4,
                                                                                      VERIFIER), op.count))
                return ops.CopyResult(COPY_SID, ops.WriteResult(0, ops.UNSTABLE4, VERIFIER), False)
            assert isinstance(op, ops.Commit) and (op.offset, op.count) == (7, 100)
            return VERIFIER

        src, dst = source(), server("10.0.0.2", copy)
        assert await dst.inter_server_copy(src, FakeFile(b"src-fh"), 3, FakeFile(b"dst-fh"), 7, 100) == 100
        [[_, notify], [_, cancel]] = src.sent
        assert notify.destination == ops.NetLoc.address("10.0.0.2", 2049) and cancel.stateid == NOTIFY_SID
        [pull, _] = dst.sent
        assert [type(op) for op in pull] == [ops.PutFH, ops.SaveFH, ops.PutFH, ops.Copy]
        assert pull[0].fh == b"src-fh" and pull[2].fh == b"dst-fh"
        op = pull[-1]
        assert (op.src_stateid, op.src_offset, op.dst_offset, op.synchronous, op.sources) == (
            NOTIFY_SID, 3, 7, False, [SOURCE])
        assert not dst.client.offloads
    run(main)


def test_refusals_are_remembered_for_the_server_or_the_pair():
    async def main():
        f = FakeFile(b"fh")
        status = None

        async def refuse(op_list):
            if isinstance(op_list[-1], ops.GetAttr):
                return {}
            raise NFSError(status, type(op_list[0]).__name__)

        dst = server("10.0.0.2", refuse)
        with pytest.raises(NotSupported):  # not an NFS source at all
            await dst.inter_server_copy(object(), f, 0, f, 0, 10)
        with pytest.raises(NotSupported):  # the same server through another session: it would mount itself
            await dst.inter_server_copy(source(host="10.0.0.2"), f, 0, f, 0, 10)
        assert not dst.sent

        status = errors.OFFLOAD_DENIED  # Linux nfsd could not mount this source
        with pytest.raises(NotSupported):
            await dst.inter_server_copy(source(), f, 0, f, 0, 10)
        dst.sent.clear()
        with pytest.raises(NotSupported):
            await dst.inter_server_copy(source(), f, 0, f, 0, 10)
        assert not dst.sent
        status = errors.STALE  # another source is asked; a server without inter-server copy refuses its filehandle
        with pytest.raises(NotSupported):
            await dst.inter_server_copy(source(host="10.0.0.3"), f, 0, f, 0, 10)
        assert isinstance(dst.sent[-1][-1], ops.GetAttr) and not dst.client.pulls  # ours checked: still good

        dst = server("10.0.0.2", refuse)
        status = errors.NOTSUPP  # a synchronous copy, or inter_copy_offload_enable off
        with pytest.raises(NotSupported):
            await dst.inter_server_copy(source(), f, 0, f, 0, 10)
        assert not dst.client.pulls

        async def no_notify(op_list):
            raise NFSError(errors.NOTSUPP, "CopyNotify")

        src = source(no_notify)
        dst = server("10.0.0.2", refuse)
        for _ in range(2):
            with pytest.raises(NotSupported):
                await dst.inter_server_copy(src, f, 0, f, 0, 10)
        assert len(src.sent) == 1 and not dst.sent

        dst.client.async_copies = False  # no CB_OFFLOAD, and a synchronous one is refused
        with pytest.raises(NotSupported):
            await dst.inter_server_copy(source(), f, 0, f, 0, 10)
        assert not dst.sent
    run(main)


def test_cancelled_pull_cancels_the_copy_and_the_notification():
    async def main():
        async def copy(op_list):
            op = op_list[-1]
            if isinstance(op, ops.Copy):
                return ops.CopyResult(COPY_SID, ops.WriteResult(0, ops.UNSTABLE4, VERIFIER), False)
            if isinstance(op, ops.OffloadStatus):
                return 1, None
            assert isinstance(op, ops.OffloadCancel) and op.stateid == COPY_SID

        src, dst = source(), server("10.0.0.2", copy)
        async with trio.open_nursery() as nursery:  # the client's, where the cancel goes out
            dst.client._nursery = nursery
            with trio.move_on_after(30) as timer:
                await dst.inter_server_copy(src, FakeFile(b"src-fh"), 0, FakeFile(b"dst-fh"), 0, 1 << 30)
        assert timer.cancelled_caught
        assert isinstance(dst.sent[-1][-1], ops.OffloadCancel)
        assert isinstance(src.sent[-1][-1], ops.OffloadCancel)
        assert not dst.client.offloads
    run(main)


# -- two Linux nfsd guests -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab():
    from offloadfs.lab.nfsd import nfsd_lab
    try:
        lab = nfsd_lab(guests=2, ssc=True)
        servers = lab.__enter__()
    except RuntimeError as e:  # no apt, no compiler, the build failed, a guest did not boot
        pytest.skip(f"no nfsd guests with inter-server copy: {e}")
    try:
        yield servers
    finally:
        lab.__exit__(None, None, None)


class TestTwoGuests:
    """Guest A's file copied to guest B by B's nfsd; one pair of guests for all."""

    pytestmark = [
        pytest.mark.slow,
        pytest.mark.skipif(os.geteuid() != 0, reason="nfsd labs need root (namespaces, taps)"),
        pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
        pytest.mark.skipif(shutil.which("mkfs.xfs") is None, reason="xfsprogs is not installed"),
    ]

    @pytest.fixture
    def urls(self, lab):
        return [f"nfs://{guest.host}/export" for guest in lab.guests]

    async def test_copy_moves_nothing_through_us(self, lab, urls):
        data = os.urandom(1 << 20) * 16
        a_url, b_url = urls
        async with mounted(a_url) as (a, a_root), mounted(b_url) as (b, b_root):
            src_node, src = await make(a, a_root, b"src", data)
            dst_node, dst = await make(b, b_root, b"dst")
            outcomes = []
            done = b.client._offload_done
            b.client._offload_done = lambda sid, outcome: (outcomes.append(outcome), done(sid, outcome))
            stats = Stats("/mnt", {"a": a_url, "b": b_url})
            before = lab.net.counters()
            start = trio.current_time()
            n = await Planner(stats).copy(Endpoint(a, src_node, src, "a/src"), 0,
                                          Endpoint(b, dst_node, dst, "b/dst"), 0, 1 << 30)
            took = trio.current_time() - start
            after = lab.net.counters()
            print(f"\n16 MiB from guest to guest in {took:.2f} s")
            assert n == len(data)
            assert stats.copy_bytes["inter_server_copy"] == len(data) and stats.copy_bytes["stream"] == 0
            assert [o.copied for o in outcomes] == [len(data)]  # one CB_OFFLOAD for the lot
            assert (after.rx - before.rx) + (after.tx - before.tx) < 1 << 20  # the data went guest to guest
            assert await b.read(dst, 0, len(data) + 1) == data
            await a.release(src)
            await b.release(dst)

    async def test_cancelled_copy_stops_on_both_servers(self, urls):
        data = os.urandom(1 << 20) * 64
        a_url, b_url = urls
        async with mounted(a_url) as (a, a_root), mounted(b_url) as (b, b_root):
            _, src = await make(a, a_root, b"big", data)
            _, dst = await make(b, b_root, b"big-copy")
            sent = {a: [], b: []}
            for backend, log in sent.items():
                def record(op_list, call=backend._call, log=log, **kw):
                    log.append(type(op_list[-1]))
                    return call(op_list, **kw)
                backend._call = record

            # Hold CB_OFFLOAD back until the cancel is over: the order CI once saw (it came late).
            held, on_offload = [], b.client._offload_done
            b.client._offload_done = lambda sid, outcome: held.append((sid, outcome))

            async def cancel_once_running():
                while not b.client.offloads:  # the COPY was answered: the server copies now
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_once_running)
                await b.inter_server_copy(a, src, 0, dst, 0, len(data))
                raise AssertionError("64 MiB copied before the cancellation landed")
            assert sent[b][-1] is ops.OffloadCancel and sent[a][-1] is ops.OffloadCancel
            with trio.move_on_after(10):  # nfsd reports the cancelled copy's end too
                while not held:
                    await trio.sleep(0.05)
            b.client._offload_done = on_offload
            for sid, outcome in held:
                on_offload(sid, outcome)
            assert not b.client.offloads  # a late CB_OFFLOAD leaves nothing behind
            done = 0  # and the servers copy on afterwards
            while done < len(data):
                done += await b.inter_server_copy(a, src, done, dst, done, len(data) - done)
            assert await b.read(dst, 0, len(data)) == data
            await a.release(src)
            await b.release(dst)

    async def test_copy_cancelled_before_its_reply_stops_too(self, lab, urls):
        """Interrupted before the destination answers the COPY, there is no copy stateid to cancel,
        but withdrawing the source's permission ends the copy.  The destination guest is paused
        while the COPY is out, so that its answer cannot come first."""
        data = os.urandom(1 << 20) * 64
        a_url, b_url = urls
        qemu = lab.guests[1].process.pid
        async with mounted(a_url) as (a, a_root), mounted(b_url) as (b, b_root):
            _, src = await make(a, a_root, b"early", data)
            dst_node, dst = await make(b, b_root, b"early-copy")
            call = b._call

            async def pause_on_copy(op_list, **kw):
                if isinstance(op_list[-1], ops.Copy):
                    await trio.to_thread.run_sync(freeze, qemu)
                    nursery.start_soon(cancel_soon)
                return await call(op_list, **kw)

            async def cancel_soon():
                await trio.sleep(0.5)
                nursery.cancel_scope.cancel()

            b._call = pause_on_copy
            try:
                async with trio.open_nursery() as nursery:
                    await b.inter_server_copy(a, src, 0, dst, 0, len(data))
                    raise AssertionError("the COPY was answered by a paused server")
            finally:
                os.kill(qemu, signal.SIGCONT)
            b._call = call
            await trio.sleep(15)  # a copy left running does these 64 MiB in a few seconds
            size = (await b.getattr(dst_node, dst)).size
            print(f"\n{size >> 20} MiB copied after a cancel before the COPY reply")
            assert size < len(data), "the servers copied on after the cancel"
            await a.release(src)
            await b.release(dst)

    def test_cp_between_two_sources_of_one_mount(self, urls):
        from offloadfs.lab.mount import offloadfs_mount, status
        data = os.urandom(1 << 20) * 8
        with offloadfs_mount({"a": urls[0], "b": urls[1]}) as mnt:
            (mnt / "a/cp-src").write_bytes(data)
            subprocess.run(["cp", str(mnt / "a/cp-src"), str(mnt / "b/cp-dst")], check=True, timeout=120)
            counters = status(mnt)["counters"]
            assert counters["copies"]["inter_server_copy"] == 1
            assert counters["copy_bytes"]["inter_server_copy"] == len(data)
            assert (mnt / "b/cp-dst").read_bytes() == data
