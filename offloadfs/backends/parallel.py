"""One backend call as several server requests side by side.

Servers answer large READs, WRITEs and copies in pieces, and a lone request
leaves the link or the server idle between pieces; both network backends
split such calls and run the pieces at once.
"""
import trio


async def together(calls):
    """Run async calls side by side; their results in order.  The first failure cancels
    the rest and is raised as itself, not in an exception group."""
    results = [None] * len(calls)
    failure = None

    async def one(i, call):
        nonlocal failure
        try:
            results[i] = await call()
        except Exception as e:
            if failure is None:
                failure = e
            nursery.cancel_scope.cancel()

    if len(calls) == 1:
        return [await calls[0]()]
    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    if failure is not None:
        raise failure
    return results


async def copy_spans(copy, length, step, in_flight):
    """Copy ``length`` bytes as spans of ``step``, ``in_flight`` at once: ``copy(start, count)``
    copies one and may copy less, or raise (NotSupported: not this way).  Returns the bytes
    copied without a gap from the start (the caller goes on from there, and a failure of the
    span after them shows again there); raises only if the first span failed.

    Spans start in order, and none once one failed or came back short; those in flight
    finish, and may land past the gap: the caller must not count them (the planner cuts
    them off, see Planner._trim)."""
    if 0 < length <= step:
        return await copy(0, length)  # one span: in this task (a 1 KiB cp)
    spans = iter(range(0, length, step))
    results = {}
    stop = False

    async def worker():
        nonlocal stop
        for start in spans:  # shared by the workers: the next span to start
            if stop:
                return
            count = min(step, length - start)
            try:
                results[start] = n = await copy(start, count)
            except Exception as e:
                results[start] = e
                n = 0
            stop = stop or n < count

    async with trio.open_nursery() as nursery:
        for _ in range(min(in_flight, -(-length // step))):
            nursery.start_soon(worker)
    done = 0
    for start in range(0, length, step):
        n = results.get(start, 0)
        if isinstance(n, Exception):
            if done == 0:
                raise n
            break
        done += n
        if n < min(step, length - start):
            break
    return done
