"""A mutating TCP proxy that plays a broken server or a man in the middle.

It listens on loopback in front of a real server (Samba, ganesha, nfsd) and
passes requests through untouched; every whole reply record the server sends
goes through ``Proxy.mutator`` first, which returns the bytes the client gets
instead (``proxy.frame(record)`` for a faithful copy, ``b""`` to swallow it:
a stall) or ``CLOSE`` / ``RESET`` to end the connection.  Replies are seen
as whole records so that a mutation can aim at a field: SMB's are framed by
the 4-byte direct-TCP header, ONC RPC's by record marks (fragments are
joined into one record, and ``frame`` sends it back as one fragment).

Threads, not trio: the tests drive the mount with blocking tools, and the
proxy must keep serving while they wait.
"""
import random
import socket
import threading

CLOSE = object()  # close both sides of the connection
RESET = object()  # abort the client's side with a TCP RST
LAST_FRAGMENT = 1 << 31


def _recv_exact(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class SMB:
    """Direct TCP transport (MS-SMB2 2.1): a zero byte and a 24-bit length, then the message."""

    @staticmethod
    def read(sock):
        header = _recv_exact(sock, 4)
        return None if header is None else _recv_exact(sock, int.from_bytes(header, "big"))

    @staticmethod
    def frame(record):
        return len(record).to_bytes(4, "big") + record


class RPC:
    """ONC RPC record marking (RFC 5531 11): fragments with a last-fragment bit, joined into one record."""

    @staticmethod
    def read(sock):
        parts = []
        while True:
            mark = _recv_exact(sock, 4)
            if mark is None:
                return None
            mark = int.from_bytes(mark, "big")
            part = _recv_exact(sock, mark & ~LAST_FRAGMENT)
            if part is None:
                return None
            parts.append(part)
            if mark & LAST_FRAGMENT:
                return b"".join(parts)

    @staticmethod
    def frame(record):
        return (LAST_FRAGMENT | len(record)).to_bytes(4, "big") + record


class Proxy:
    """Forwards 127.0.0.1:``port`` to ``target``; use as a context manager.

    ``mutator(record) -> bytes | CLOSE | RESET`` is read for every reply, so a
    test can change it while connections are open; None passes replies on.
    ``replies`` counts the replies seen, ``connections`` the connections accepted.
    """

    def __init__(self, target, framing):
        self.target = target
        self.framing = framing
        self.mutator = None
        self.replies = 0
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()
        self._socks = set()
        self._lock = threading.Lock()
        self._closed = False

    def frame(self, record):
        return self.framing.frame(record)

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._closed = True
        self._listener.close()
        self.drop()

    def drop(self):
        """Close every open connection (as a link that went down would); new ones are still accepted."""
        with self._lock:
            socks, self._socks = self._socks, set()
        for s in socks:
            _close(s)

    def _accept(self):
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self.connections += 1
                self._socks |= {client, server}
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    def _requests(self, client, server):
        try:
            while chunk := client.recv(1 << 20):
                server.sendall(chunk)
        except OSError:
            pass
        self._end(client, server)

    def _replies(self, server, client):
        try:
            while (record := self.framing.read(server)) is not None:
                self.replies += 1
                mutator = self.mutator
                out = self.frame(record) if mutator is None else mutator(record)
                if out is RESET:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                if out is CLOSE or out is RESET:
                    break
                client.sendall(out)
        except OSError:
            pass
        self._end(client, server)

    def _end(self, *socks):
        with self._lock:
            self._socks -= set(socks)
        for s in socks:
            _close(s)


def _close(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class RandomMutator:
    """Mutates a share of replies at random, the way a broken server or a bad link would; seeded.

    Kinds: truncate the record, lie about its length (longer or shorter
    than the data), flip bytes, overwrite a 2-, 4- or 8-byte field with an
    extreme value, repeat an earlier reply, stall, close, reset.  ``counts``
    says how often each kind was used, ``mutated`` how many replies in all.
    """

    KINDS = ("truncate", "long", "short", "flip", "field", "repeat", "stall", "close", "reset")

    def __init__(self, framing, seed, rate=0.2, kinds=KINDS):
        self.framing = framing
        self.rng = random.Random(seed)
        self.rate = rate
        self.kinds = kinds
        self.counts = dict.fromkeys(kinds, 0)
        self.mutated = 0
        self._previous = None

    def __call__(self, record):
        previous, self._previous = self._previous, record
        if self.rng.random() >= self.rate_for(record):
            return self.framing.frame(record)
        kind = self.rng.choice(self.kinds)
        self.counts[kind] += 1
        self.mutated += 1
        return self.mutate(kind, record, previous)

    def rate_for(self, record):
        """The share of replies like ``record`` to mutate: a subclass may spare some (a handshake)."""
        return self.rate

    def mutate(self, kind, record, previous):
        """What the client gets instead of ``record``; a subclass may add kinds."""
        rng = self.rng
        n = len(record)
        if kind == "truncate":
            return self.framing.frame(record[:rng.randrange(n)] if n else record)
        if kind in ("long", "short"):
            lie = n + rng.choice((1, 100, 1 << 16)) if kind == "long" else rng.randrange(n) if n else 0
            return _header_with(self.framing, lie) + record
        if kind == "flip":
            data = bytearray(record)
            for _ in range(rng.randint(1, 8)):
                if data:
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return self.framing.frame(bytes(data))
        if kind == "field":
            width = rng.choice((2, 4, 8))
            if n < width:
                return self.framing.frame(record)
            at = rng.randrange(n - width + 1)
            value = rng.choice((0, (1 << 8 * width) - 1, 1 << (8 * width - 1), rng.getrandbits(8 * width)))
            data = record[:at] + value.to_bytes(width, "little" if self.framing is SMB else "big") + record[at + width:]
            return self.framing.frame(data)
        if kind == "repeat":
            return self.framing.frame(previous if previous is not None else record)
        if kind == "stall":
            return b""
        return CLOSE if kind == "close" else RESET


def _header_with(framing, length):
    """A record header that claims ``length`` bytes."""
    if framing is RPC:
        return (LAST_FRAGMENT | length & ~LAST_FRAGMENT).to_bytes(4, "big")
    return (length & 0xFFFFFFFF).to_bytes(4, "big")
