"""One backend call as several server requests side by side.

Servers answer large READs, WRITEs and copies in pieces, and a lone request
leaves the link or the server idle between pieces; both network backends
split such calls and run the pieces at once.
"""
import trio

from .base import NotSupported


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


async def copy_spans(copy, length, step):
    """Copy ``length`` bytes as spans of ``step`` side by side: ``copy(start, count)`` copies one
    and may copy less, or raise NotSupported.  Returns the bytes copied without a gap from the
    start (the caller goes on from there); NotSupported only if the first span was refused."""
    starts = range(0, length, step)

    async def span(start):
        try:
            return await copy(start, min(step, length - start))
        except NotSupported as e:
            return e

    done = 0
    for start, n in zip(starts, await together([lambda s=s: span(s) for s in starts])):
        if isinstance(n, NotSupported):
            if done == 0:
                raise n
            break
        done += n
        if n < min(step, length - start):
            break
    return done
