"""The lease state of leases.py: when read caching counts as held without a gap, and when the break callback hears.

Breaks and open replies reach the lease by different paths (a break from the
receive worker at once, a reply once its task runs), so each case here is an
order the two may come in.
"""
import functools
from types import SimpleNamespace

import trio

from offloadfs.backends.smb import leases, messages as m, wire

R, RH = m.LEASE_READ, m.LEASE_READ | m.LEASE_HANDLE


class Backend:
    """What a Lease uses of SMBBackend: the break callback."""

    def __init__(self):
        self.broken = []

    def _lease_broken(self, node):
        self.broken.append(node)


def held(epoch=1):
    """A lease held RH on connection 1 by one open, and its backend."""
    backend = Backend()
    lease = leases.Lease(backend, "node")
    listener = SimpleNamespace(generation=1, leases={})
    seen = leases.Listener.opening(listener, lease)
    lease.granted(reply(lease, RH, epoch), seen)
    return lease, backend, listener


def reply(lease, state, epoch=None, flags=0):
    return wire.Lease(lease.key, state, flags, epoch)


def brk(lease, new, epoch=0):
    return wire.LeaseBreak(epoch, False, lease.key, RH, new)


def test_opens_that_join_the_lease_keep_caching_without_a_gap():
    lease, backend, listener = held()
    token = lease.caching(1)
    assert token is not None and lease.caching(2) is None  # another connection holds nothing
    seen = leases.Listener.opening(listener, lease)
    lease.granted(reply(lease, RH, 1), seen)
    assert lease.caching(1) == token and backend.broken == []


def test_a_break_of_read_caching_ends_it_and_calls_back():
    lease, backend, listener = held()
    token = lease.caching(1)
    lease.broken(brk(lease, m.LEASE_HANDLE, 2))
    assert lease.caching(1) is None and backend.broken == ["node"]
    seen = leases.Listener.opening(listener, lease)
    lease.granted(reply(lease, RH, 3), seen)  # granted again: a new span
    assert lease.caching(1) not in (None, token)


def test_a_break_that_leaves_read_caching_ends_nothing():
    lease, backend, _ = held()
    token = lease.caching(1)
    lease.broken(brk(lease, R, 2))
    assert lease.caching(1) == token and backend.broken == []


def test_a_reply_whose_epoch_moved_unseen_starts_a_new_span():
    """v2: the server changed the lease (a break and a grant we have not heard of yet)."""
    lease, backend, listener = held(epoch=4)
    token = lease.caching(1)
    seen = leases.Listener.opening(listener, lease)
    lease.granted(reply(lease, RH, 6), seen)
    assert lease.caching(1) not in (None, token) and backend.broken == ["node"]


def test_a_break_heard_before_an_older_reply_wins():
    lease, _, listener = held(epoch=1)
    seen = leases.Listener.opening(listener, lease)
    lease.broken(brk(lease, 0, 2))  # the break came first, the reply was older
    lease.granted(reply(lease, RH, 1), seen)
    assert lease.caching(1) is None


def test_v1_a_break_while_an_open_was_in_flight_leaves_the_lower_state():
    lease, _, listener = held(epoch=None)
    seen = leases.Listener.opening(listener, lease)
    lease.broken(brk(lease, m.LEASE_HANDLE))
    lease.granted(reply(lease, RH), seen)
    assert lease.caching(1) is None and lease.state == m.LEASE_HANDLE


def test_a_break_in_progress_is_no_read_caching():
    backend = Backend()
    lease = leases.Lease(backend, "node")
    listener = SimpleNamespace(generation=1, leases={})
    lease.granted(reply(lease, RH, 1, wire.Lease.BREAK_IN_PROGRESS), leases.Listener.opening(listener, lease))
    assert lease.caching(1) is None


def test_our_last_close_ends_the_lease_quietly_and_a_new_connection_loudly():
    lease, backend, listener = held()
    lease.closed(1)
    assert lease.caching(1) is None and backend.broken == []
    lease, backend, listener = held()
    listener.generation = 2  # reconnected: whatever happened meanwhile, we did not hear of it
    leases.Listener.opening(listener, lease)
    assert lease.caching(2) is None and backend.broken == ["node"]


def test_epochs_wrap():
    assert leases._newer(0, 0xFFFF) and leases._newer(5, 3) and not leases._newer(3, 5)
    assert not leases._newer(7, 7)


def test_a_break_is_acknowledged_once_the_kernel_dropped_the_file():
    """The other client's open goes on at our acknowledgment: pages the kernel read ahead under the
    lease must be gone by then, or a read() after that client's write gets the old bytes."""
    lease, backend, _ = held()
    dropped, sent = trio.Event(), []
    backend._lease_broken = lambda node: [dropped]
    backend._deferred_broken = lambda node: None

    async def send(messages, generation, uid):
        sent.append(messages)

    backend._send = send
    listener = SimpleNamespace(generation=1, leases={lease.key: lease}, client=SimpleNamespace(where="server"))
    listener._acknowledge = functools.partial(leases.Listener._acknowledge, listener)

    async def main():
        leases.Listener._broken(listener, wire.LeaseBreak(2, True, lease.key, RH, 0))
        await trio.sleep(0.5)
        assert sent == []  # the kernel still holds the pages
        dropped.set()
        await trio.sleep(0.01)
        assert len(sent) == 1

    trio.run(main)
