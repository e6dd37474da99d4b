"""Asynchronous COPY bookkeeping with a scripted server: CB_OFFLOAD, OFFLOAD_STATUS, OFFLOAD_CANCEL.

A real server's copies on xfs finish at once (reflinks), so the waits, the
late or missing callback and the cancellation are driven here, on trio's
mock clock.
"""
import errno

import pytest
import trio
import trio.testing

from offloadfs.backends.base import NotSupported
from offloadfs.backends.nfs import errors, ops
from offloadfs.backends.nfs.backend import COPIES_IN_FLIGHT, COPY_PER_CALL, NFSBackend
from offloadfs.backends.nfs.compound import Offload
from offloadfs.backends.nfs.errors import NFSError
from offloadfs.backends.nfs.session import Client, Settings

SID = bytes(range(16))
VERIFIER = b"verifier"


class FakeFile:
    class node:
        fh = b"dst-fh"


def run(test):
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def backend(answer):
    """A backend whose compounds are answered by ``answer(op)`` (the last operation of each)."""
    b = NFSBackend("nfs://server/export", {})
    b.client = Client(Settings("server"))
    b.calls = []

    async def call(op_list, **kw):
        op = op_list[-1]
        b.calls.append(op)
        return [None] * (len(op_list) - 1) + [await answer(op)]

    b._call = call
    return b


def test_callback_ends_the_wait():
    async def main():
        async def answer(op):
            if isinstance(op, ops.OffloadStatus):
                if sum(isinstance(c, ops.OffloadStatus) for c in b.calls) == 2:
                    b.client._offload_done(SID, Offload(errors.OK, ops.WriteResult(10, ops.UNSTABLE4, VERIFIER), 10))
                return 5, None
            raise AssertionError(op)

        b = backend(answer)
        result = await b._await_offload(FakeFile, SID)
        assert result == ops.WriteResult(10, ops.UNSTABLE4, VERIFIER)
        assert not b.client.offloads
    run(main)


def test_callback_before_the_copy_reply_is_kept():
    async def main():
        b = backend(None)
        b.client._offload_done(SID, Offload(errors.OK, ops.WriteResult(7, ops.FILE_SYNC4, VERIFIER), 7))
        assert (await b._await_offload(FakeFile, SID)).count == 7
        assert b.calls == []
    run(main)


def test_finished_copy_without_callback_is_unknown():
    async def main():
        async def answer(op):
            raise NFSError(errors.BAD_STATEID, "OFFLOAD_STATUS")  # Linux nfsd once the copy is over

        b = backend(answer)
        assert await b._await_offload(FakeFile, SID) is None
    run(main)


def test_late_callback_after_bad_stateid():
    async def main():
        async def answer(op):
            async def later():
                await trio.sleep(1)
                b.client._offload_done(SID, Offload(errors.OK, ops.WriteResult(3, ops.FILE_SYNC4, VERIFIER), 3))
            nursery.start_soon(later)
            raise NFSError(errors.BAD_STATEID, "OFFLOAD_STATUS")

        async with trio.open_nursery() as nursery:
            b = backend(answer)
            assert (await b._await_offload(FakeFile, SID)).count == 3
    run(main)


def test_status_reporting_completion_and_failure_with_progress():
    async def main():
        async def answer(op):
            if isinstance(op, ops.OffloadStatus):
                return 4096, errors.OK
            assert isinstance(op, ops.Commit)
            return VERIFIER

        b = backend(answer)
        assert (await b._await_offload(FakeFile, SID)).count == 4096
        assert isinstance(b.calls[-1], ops.Commit)

        b = backend(answer)
        b.client._offload_done(SID, Offload(errors.NOSPC, None, 8192))
        assert (await b._await_offload(FakeFile, SID)).count == 8192  # the planner goes on from there

        b = backend(answer)
        b.client._offload_done(SID, Offload(errors.NOSPC, None, 0))
        with pytest.raises(OSError) as e:
            await b._await_offload(FakeFile, SID)
        assert e.value.status == errors.NOSPC
    run(main)


def test_cancelled_wait_ends_at_once_and_cancels_the_copy_in_the_background():
    """An interrupted cp must not wait on a stalled server: the wait ends with the cancellation, and
    OFFLOAD_CANCEL is sent again and again until the server answers."""
    async def main():
        stalled = 3

        async def answer(op):
            nonlocal stalled
            if isinstance(op, ops.OffloadStatus):
                return 1, None
            assert isinstance(op, ops.OffloadCancel) and op.stateid == SID
            if stalled:
                stalled -= 1
                await trio.sleep(10)
                raise OSError(errno.ETIMEDOUT, "no answer (soft mount)")
            return None

        b = backend(answer)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            b.client._nursery = nursery
            with trio.move_on_after(30):
                await b._await_offload(FakeFile, SID)
            assert trio.current_time() - start == 30, "the cancelled wait waited for the server"
            assert not b.client.offloads
        assert [type(c) for c in b.calls].count(ops.OffloadCancel) == 4
    run(main)


def test_copy_falls_back_to_synchronous_when_the_outcome_is_unknown():
    async def main():
        copies = []

        async def with_state(files, build, **kw):
            copy = build(SID, SID)[-1]
            copies.append(copy.synchronous)
            if not copy.synchronous:
                return [ops.CopyResult(SID, ops.WriteResult(0, ops.UNSTABLE4, VERIFIER), False)]
            return [ops.CopyResult(None, ops.WriteResult(4 << 20, ops.FILE_SYNC4, VERIFIER), True)]

        async def unknown(file, stateid):
            return None

        b = backend(None)
        b._with_state = with_state
        b._await_offload = unknown
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, COPY_PER_CALL) == 4 << 20
        assert copies == [False, True] and not b.client.async_copies
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 30) == 4 << 20
        assert copies[-1] is True and len(copies) == 3  # one COPY at a time now
    run(main)


def test_copy_retries_with_what_the_server_requires():
    async def main():
        copies = []

        async def with_state(files, build, **kw):
            copy = build(SID, SID)[-1]
            copies.append(copy.synchronous)
            if len(copies) == 1:
                raise NFSError(errors.OFFLOAD_NO_REQS, "Copy", True)  # the server copies synchronously only
            if len(copies) == 2:
                raise NFSError(errors.DELAY, "Copy")
            return [ops.CopyResult(None, ops.WriteResult(100, ops.FILE_SYNC4, VERIFIER), True)]

        b = backend(None)
        b._with_state = with_state
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, COPY_PER_CALL) == 100
        assert copies == [False, True, True]
    run(main)


def test_notsupp_is_remembered_and_other_refusals_are_per_request():
    async def main():
        status = errors.XDEV

        async def with_state(files, build, **kw):
            raise NFSError(status, "Copy")

        b = backend(None)
        b._with_state = with_state
        with pytest.raises(NotSupported):
            await b.server_copy(FakeFile, 0, FakeFile, 0, 10)
        assert ops.OP_COPY not in b.client.unsupported
        status = errors.NOTSUPP
        with pytest.raises(NotSupported):
            await b.server_copy(FakeFile, 0, FakeFile, 0, 10)
        assert ops.OP_COPY in b.client.unsupported
        status = errors.IO
        with pytest.raises(NotSupported):  # known unsupported: not even asked
            await b.server_copy(FakeFile, 0, FakeFile, 0, 10)
    run(main)


def test_unstable_copy_is_committed_and_a_changed_verifier_copies_again():
    async def main():
        verifiers = [b"rebooted", VERIFIER]

        async def with_state(files, build, **kw):
            return [ops.CopyResult(None, ops.WriteResult(100, ops.UNSTABLE4, VERIFIER), True)]

        async def answer(op):
            assert isinstance(op, ops.Commit) and (op.offset, op.count) == (5, 100)
            return verifiers.pop(0)

        b = backend(answer)
        b._with_state = with_state
        assert await b.server_copy(FakeFile, 0, FakeFile, 5, 100) == 100
        assert len(b.calls) == 2 and not verifiers
    run(main)


def spans_backend(answer):
    """A backend whose COPYs end, after a second, as ``answer(src_offset, count)`` says;
    ``b.peak`` is the most that ran at once."""
    b = backend(None)
    b.running = b.peak = 0

    async def with_state(files, build, **kw):
        copy = build(SID, SID)[-1]
        b.running += 1
        b.peak = max(b.peak, b.running)
        try:
            await trio.sleep(1)
            count = answer(copy.src_offset, copy.count)
        finally:
            b.running -= 1
        return [ops.CopyResult(None, ops.WriteResult(count, ops.FILE_SYNC4, VERIFIER), True)]

    b._with_state = with_state
    return b


def test_large_copies_keep_several_copies_in_flight():
    async def main():
        b = spans_backend(lambda offset, count: count)
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 40) == COPIES_IN_FLIGHT * COPY_PER_CALL
        assert b.peak == COPIES_IN_FLIGHT
        b.peak = 0
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, COPY_PER_CALL + 5) == COPY_PER_CALL + 5
        assert b.peak == 2
    run(main)


def test_only_the_part_without_a_gap_counts():
    async def main():
        def short_second(offset, count):
            return count // 2 if offset == COPY_PER_CALL else count
        b = spans_backend(short_second)
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 40) == COPY_PER_CALL * 3 // 2

        def refusing_third(offset, count):
            if offset == 2 * COPY_PER_CALL:
                raise NotSupported("COPY: not this range")
            return count
        b = spans_backend(refusing_third)
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 40) == 2 * COPY_PER_CALL

        def refusing_first(offset, count):
            if offset == 0:
                raise NotSupported("COPY: not this range")
            return count
        b = spans_backend(refusing_first)
        with pytest.raises(NotSupported):
            await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 40)

        def failing_fourth(offset, count):
            if offset == 3 * COPY_PER_CALL:
                raise NFSError(errors.IO, "COPY")
            return count
        b = spans_backend(failing_fourth)
        # An error after a first part is a short count: the next call, from there, gets the error.
        assert await b.server_copy(FakeFile, 0, FakeFile, 0, 1 << 40) == 3 * COPY_PER_CALL
        with pytest.raises(NFSError):
            await b.server_copy(FakeFile, 3 * COPY_PER_CALL, FakeFile, 3 * COPY_PER_CALL, 1 << 40)
    run(main)
