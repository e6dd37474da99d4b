"""The lab's mutating proxy: records pass whole, mutations reach the client, ends are ends."""
import socket
import threading

import pytest

from offloadfs.lab.proxy import CLOSE, RPC, SMB, Proxy, RandomMutator


@pytest.fixture
def echo():
    """A loopback server that answers every record it gets with the same record, in the given framing."""
    servers = []

    def start(framing):
        listener = socket.create_server(("127.0.0.1", 0))
        servers.append(listener)

        def serve(conn):
            while (record := framing.read(conn)) is not None:
                conn.sendall(framing.frame(record))
            conn.close()

        def accept():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return listener.getsockname()

    yield start
    for s in servers:
        s.close()


def _ask(port, data, framing):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        return framing.read(s)


@pytest.mark.parametrize("framing", [SMB, RPC])
def test_records_pass_whole(echo, framing):
    with Proxy(echo(framing), framing) as proxy:
        assert _ask(proxy.port, framing.frame(b"x" * 100_000), framing) == b"x" * 100_000
        assert (proxy.replies, proxy.connections) == (1, 1)


def test_rpc_fragments_are_joined_for_the_mutator(echo):
    seen = []
    with Proxy(echo(RPC), RPC) as proxy:
        proxy.mutator = lambda record: seen.append(record) or RPC.frame(record)
        fragments = (3).to_bytes(4, "big") + b"abc" + RPC.frame(b"def")
        assert _ask(proxy.port, fragments, RPC) == b"abcdef"
    assert seen == [b"abcdef"]


def test_mutations_reach_the_client_and_close_ends(echo):
    with Proxy(echo(SMB), SMB) as proxy:
        proxy.mutator = lambda record: SMB.frame(record.upper())
        assert _ask(proxy.port, SMB.frame(b"abc"), SMB) == b"ABC"
        proxy.mutator = lambda record: CLOSE
        assert _ask(proxy.port, SMB.frame(b"abc"), SMB) is None


def test_random_mutator_is_reproducible():
    def run(seed):
        m = RandomMutator(SMB, seed, rate=0.5)
        return [m(bytes(range(64))) for _ in range(200)], m.counts

    assert run(7) == run(7)
    outs, counts = run(7)
    assert sum(counts.values()) > 50 and all(counts.values())
