"""Which read delegations the NFS client holds, and when it lets go (backends/nfs/delegations.py).

The client is a stand-in: these are the bookkeeping rules the mount tests cannot reach on purpose
(a recall racing the grant, more delegations than kept, state lost without a recall)."""

from types import SimpleNamespace

import trio

from offloadfs.backends import base
from offloadfs.backends.nfs import delegations
from offloadfs.backends.nfs.backend import Node
from offloadfs.backends.nfs.delegations import Delegations


def sid(n):
    return bytes(4) + n.to_bytes(12, "big")


class FakeClient:
    def __init__(self):
        self.generation, self.renewed, self.lease = 0, 100.0, 90
        self.settings = SimpleNamespace(host="server")
        self.returned = []

    def return_delegation(self, stateid, fh):
        self.returned.append((stateid, fh))

    async def delegreturn(self, stateid, fh):
        self.returned.append((stateid, fh))

    def spawn(self, fn, *args):
        self.nursery.start_soon(fn, *args)


def held(n=1):
    client, ended = FakeClient(), []
    d = Delegations(client)
    nodes = [Node(b"fh%d" % i, 0o100000) for i in range(n)]
    for i, node in enumerate(nodes):
        d.granted(node, sid(i), ended.append)
    return client, d, nodes, ended


def test_a_grant_is_held_until_recalled_and_then_given_back():
    client, d, [node], ended = held()
    assert d.caching(node.fh, 101.0) is d.held[node.fh]
    d.recalled(sid(0), node.fh)
    assert d.caching(node.fh, 101.0) is None
    assert ended == [node] and client.returned == [(sid(0), node.fh)]


def test_a_recall_is_given_back_once_the_kernel_dropped_the_file():
    """The server lets the writer it holds back go on at our DELEGRETURN: pages the kernel read ahead
    under the delegation must be gone by then, or a read() after that write gets the old bytes."""
    client, node = FakeClient(), Node(b"fh", 0o100000)
    dropped = []

    def ended(node):
        dropped.append(trio.Event())
        return dropped

    async def main():
        async with trio.open_nursery() as client.nursery:
            d = Delegations(client)
            d.granted(node, sid(0), ended)
            d.recalled(sid(0), node.fh)
            await trio.sleep(1)
            assert client.returned == []  # the kernel still holds the pages
            dropped[0].set()
            await trio.sleep(0.01)
            assert client.returned == [(sid(0), node.fh)]

    trio.run(main)


def test_a_recall_waits_for_the_kernel_a_bounded_time(monkeypatch):
    monkeypatch.setattr(base, "DROP_BOUND", 0.2)
    client, node = FakeClient(), Node(b"fh", 0o100000)

    async def main():
        async with trio.open_nursery() as client.nursery:
            d = Delegations(client)
            d.granted(node, sid(0), lambda n: [trio.Event()])  # never set
            d.recalled(sid(0), node.fh)
            await trio.sleep(0.5)
            assert client.returned == [(sid(0), node.fh)]

    trio.run(main)


def test_a_recall_before_its_grant_is_seen_keeps_nothing():
    client, d, _, ended = held(0)
    node = Node(b"fh", 0o100000)
    d.recalled(sid(7), node.fh)  # the CB_RECALL was handled before the OPEN reply's task ran
    d.granted(node, sid(7), ended.append)
    assert d.caching(node.fh, 101.0) is None
    assert client.returned == [(sid(7), node.fh)] and ended == []  # given back once, by the recall


def test_a_second_grant_or_an_unwanted_one_goes_straight_back():
    client, d, [node], _ = held()
    first = d.held[node.fh]
    d.granted(node, sid(9), print)
    d.granted(node, sid(10), None)
    assert d.caching(node.fh, 101.0) is first
    assert client.returned == [(sid(9), node.fh), (sid(10), node.fh)]


def test_the_oldest_goes_back_past_the_limit(monkeypatch):
    monkeypatch.setattr(delegations, "HELD_MAX", 2)
    client, d, nodes, ended = held(3)
    assert [d.caching(n.fh, 101.0) is not None for n in nodes] == [False, True, True]
    assert client.returned == [(sid(0), nodes[0].fh)] and ended == []


def test_state_lost_without_a_recall_ends_them_all():
    client, d, nodes, ended = held(2)
    d.lost("test")
    assert ended == nodes and not d.held
    assert len(client.returned) == 2  # the server may still hold them: same client ID


def test_a_forgotten_client_id_or_an_unrenewed_lease_promises_nothing():
    client, d, [node], _ = held()
    assert d.caching(node.fh, 100.0 + 91) is None  # the server may have revoked it and let another write
    client.generation += 1
    assert d.caching(node.fh, 101.0) is None


def test_unmount_gives_every_one_back():
    """Else the server would recall them from a client that is gone, holding back other clients'
    changes to those files until the recall times out."""
    client, d, nodes, ended = held(3)
    trio.run(d.return_all)
    assert sorted(client.returned) == [(sid(i), n.fh) for i, n in enumerate(nodes)]
    assert not d.held and ended == []
