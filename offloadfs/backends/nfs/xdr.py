"""XDR (RFC 4506) encoding and a strict decoder.

Everything a server sends is hostile until decoded: every length is checked
against a limit and against the bytes actually left before anything is
sliced or allocated, every enum and bool against its values, so a broken or
malicious reply is a ``ProtocolError`` and never a crash or a huge
allocation.
"""
import struct

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")


class ProtocolError(Exception):
    """The peer sent something that breaks the protocol; the connection cannot be trusted."""


def _pad(n):
    return -n & 3


class Packer:
    __slots__ = ("buf",)

    def __init__(self):
        self.buf = bytearray()

    def u32(self, v):
        self.buf += _U32.pack(v)

    def u64(self, v):
        self.buf += _U64.pack(v)

    def i64(self, v):
        self.buf += _I64.pack(v)

    def bool(self, v):
        self.u32(1 if v else 0)

    def fixed(self, data, size):
        if len(data) != size:
            raise ValueError(f"fixed opaque of {size} bytes given {len(data)}")
        self.buf += data
        self.buf += bytes(_pad(size))

    def opaque(self, data):
        self.u32(len(data))
        self.buf += data
        self.buf += bytes(_pad(len(data)))

    def bitmap(self, bits):
        """A bitmap4 from a Python int (bit n = attribute n)."""
        words = []
        while bits:
            words.append(bits & 0xFFFFFFFF)
            bits >>= 32
        self.u32(len(words))
        for w in words:
            self.u32(w)

    def bytes(self):
        return bytes(self.buf)


class Unpacker:
    __slots__ = ("data", "pos")

    def __init__(self, data, pos=0):
        self.data = memoryview(data)
        self.pos = pos

    def left(self):
        return len(self.data) - self.pos

    def _take(self, n):
        if n > len(self.data) - self.pos:
            raise ProtocolError(f"truncated: {n} bytes wanted at offset {self.pos}, {self.left()} left")
        start = self.pos
        self.pos += n
        return self.data[start:self.pos]

    def u32(self):
        return _U32.unpack(self._take(4))[0]

    def u64(self):
        return _U64.unpack(self._take(8))[0]

    def i64(self):
        return _I64.unpack(self._take(8))[0]

    def bool(self):
        v = self.u32()
        if v > 1:
            raise ProtocolError(f"bool with value {v}")
        return v == 1

    def enum(self, allowed, what="enum"):
        v = self.u32()
        if v not in allowed:
            raise ProtocolError(f"unknown {what} value {v}")
        return v

    def fixed(self, size):
        data = bytes(self._take(size))
        self._take(_pad(size))
        return data

    def opaque(self, limit, what="opaque"):
        n = self.u32()
        if n > limit:
            raise ProtocolError(f"{what} of {n} bytes (at most {limit})")
        return self.fixed(n)

    def count(self, limit, item_size, what="array"):
        """An array length, checked against ``limit`` and the bytes left (each item takes >= item_size)."""
        n = self.u32()
        if n > limit or n * item_size > self.left():
            raise ProtocolError(f"{what} of {n} items ({self.left()} bytes left, at most {limit} items)")
        return n

    def bitmap(self, limit=8):
        n = self.count(limit, 4, "bitmap")
        bits = 0
        for i in range(n):
            bits |= self.u32() << (32 * i)
        return bits

    def done(self):
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.left()} bytes of garbage after the message")
