"""What each copy method has cost on each route, and what it will cost: t = fixed + bytes / rate.

Offloads have a fixed price (an inter-server COPY sets up a whole NFS mount
between the servers: ~0.1 s) and then move bytes fast; our own streaming
starts at once but pays for every byte twice on the client's link.  Which
is cheaper depends on the size and the route, so the planner asks this
model, fed by the copies it timed, rather than a constant.

Streaming is also learned from the reads and writes the daemon carries for
its users anyway: a stream is a read of the source and a write of the
destination side by side, so no copy has to lose to teach the model what
streaming costs.  Servers get busy and links change: a sample weighs half
as much every HALF_LIFE seconds, and a method whose samples have all faded
counts as unmeasured again, so it is tried afresh.
"""
import time
from collections import defaultdict, deque
from typing import NamedTuple

SAMPLES = 32  # the newest samples per route, method and size class
HALF_LIFE = 30.0  # seconds after which a sample weighs half as much as a new one
FORGOTTEN = 1 / 16  # samples weighing less than this together: as good as none (4 half-lives)
# A method's first run on a route pays for setting it up (an NFS open state, an inter-server COPY's
# mount of the source server, a first CLONE of a file): one sample alone is no verdict, and it
# stands for the method's cost only until a second comes (see _setup).
TRUSTED = 2
# A read, write or copy this large tells a rate; smaller ones tell the fixed cost.  Kept apart, so
# that many small requests cannot push the few large ones out.
RATE_MIN = 256 << 10
BURST_MAX = 64 << 20  # requests that overlap in time are one sample, up to this many bytes


class CostModel:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._samples = defaultdict(lambda: deque(maxlen=SAMPLES))  # (key, what, large) -> [(bytes, s, when)]
        self._bursts = {}  # (backend, "read" or "write") -> [start, end, bytes] of the requests still merging
        # (route, method) -> the sample of its first run since it was last unknown.  A method the
        # model puts behind streaming is not run again, so a setup counted in its mean would keep
        # it there: on nfsd, a first CLONE of 5.9 ms and one of 1.7 kept cp of 1 KiB streaming.
        self._setup = {}
        self._summaries = {}  # key -> Summary of its samples, dropped when they change

    def record(self, route, method, nbytes, seconds):
        key, sample = (route, method), (nbytes, seconds, self.clock())
        if not self.known(route, method):
            self._setup[key] = sample
        self._add(key, sample)

    def _add(self, key, sample):
        """``sample``: (bytes, seconds, when)."""
        self._samples[(*key, sample[0] >= RATE_MIN)].append(sample)
        self._summaries.pop(key, None)

    def carried(self, backend, op, start, nbytes):
        """A read or write (``op``) of ``nbytes`` from/to ``backend`` that began at ``start``.

        Requests in flight side by side (the kernel reads ahead, the backends split) share
        the time: overlapping ones are merged into one sample, or each would look slower
        than the link is."""
        end = self.clock()
        self._summaries.pop((backend, op), None)
        burst = self._bursts.get((backend, op))
        if burst is not None and start <= burst[1] and burst[2] < BURST_MAX:
            burst[0], burst[1], burst[2] = min(burst[0], start), max(burst[1], end), burst[2] + nbytes
            return
        if burst is not None:
            self._add((backend, op), (burst[2], burst[1] - burst[0], burst[1]))
        self._bursts[backend, op] = [start, end, nbytes]

    def rated(self, route, method):
        """Whether a rate of ``method`` on ``route`` was measured: a sample of RATE_MIN or more among
        those that count (small ones tell a fixed cost, and two of them a slope that means nothing)."""
        return self.known(route, method) and any(n >= RATE_MIN for n, _, _ in self._current((route, method)))

    def known(self, route, method):
        return self._weight((route, method)) >= FORGOTTEN

    def trusted(self, route, method):
        """Enough samples, not all faded, to judge ``method`` on ``route`` by."""
        return self.known(route, method) and sum(
            len(self._samples.get((route, method, large), ())) for large in (False, True)) >= TRUSTED

    def predict(self, route, method, nbytes):
        """Seconds for ``nbytes`` by ``method`` on ``route``, or None while too little is known.
        Streaming on a route never streamed is a read from its source and a write to its
        destination, as the traffic the daemon carried has cost (below RATE_MIN, only where
        small requests were among it)."""
        line = self._line((route, method), nbytes)
        if line is None and method == "stream":
            src, dst = route
            sides = (src, "read"), (dst, "write")
            if nbytes < RATE_MIN and not all(self._samples.get((*key, False)) for key in sides):
                # Large requests tell a rate, not what a stream costs before its first byte: from
                # them alone, a 1 KiB stream looked free, and on nfsd cp of 1 KiB tried an untried
                # COPY twice before it streamed once and went back to cloning.
                return None
            read, write = self._line(sides[0], None), self._line(sides[1], None)
            if read is not None and write is not None:
                # Reader and writer run side by side: the slower sets the pace.
                line = (read[0] + write[0], max(read[1], write[1]))
        return None if line is None else line[0] + line[1] * nbytes

    def _summary(self, key):
        summary = self._summaries.get(key)
        if summary is None:
            summary = self._summaries[key] = _summarise(self._current(key))
        return summary

    def _current(self, key):
        """The samples under ``key`` that count: (bytes, seconds, when)."""
        samples = [s for large in (False, True) for s in self._samples.get((*key, large), ())]
        setup = self._setup.get(key)
        if setup and any(s is not setup and s[2] >= setup[2] and setup[0] / 2 <= s[0] <= setup[0] * 2
                         for s in samples):
            samples = [s for s in samples if s is not setup]  # a later run of its size tells more
        burst = self._bursts.get(key)  # a backend's requests still merging: as they stand now
        if burst is not None:
            samples.append((burst[2], burst[1] - burst[0], burst[1]))
        return samples

    def _weight(self, key):
        summary = self._summary(key)
        return summary.total * 0.5 ** ((self.clock() - summary.newest) / HALF_LIFE)

    def _line(self, key, nbytes):
        """(fixed, per_byte) from the samples under ``key``; with one size seen only, the mean
        for ``nbytes`` near it, or a rate from a large one (its fixed cost counted as rate)."""
        if self._weight(key) < FORGOTTEN:
            return None
        summary = self._summary(key)
        if summary.size is None:
            return summary.fit
        if nbytes is not None and summary.size / 2 <= nbytes <= summary.size * 2:
            return summary.mean_t, 0.0
        return (0.0, summary.mean_t / summary.size) if summary.size >= RATE_MIN else None


class Summary(NamedTuple):
    """What a key's samples say, weighed as of the newest.  All samples fade alike, so their
    weights relative to each other, and the line they give, stay as they are until a sample comes
    or goes; only their total weight falls.  Worked out again for each copy, choosing took 0.1 ms
    a copy (4 % of a clone of 1 MiB on a local btrfs)."""
    newest: float  # when the newest sample was taken
    total: float  # their weight together then
    size: int | None  # the one size among them, or None for several
    mean_t: float  # their weighted mean time
    fit: tuple | None  # (fixed, per_byte) where there are several sizes


def _summarise(samples):
    if not samples:
        return Summary(0.0, 0.0, None, 0.0, None)
    newest = max(when for _, _, when in samples)
    weighted = [(n, t, 0.5 ** ((newest - when) / HALF_LIFE)) for n, t, when in samples]
    total = sum(w for _, _, w in weighted)
    mean_t = sum(t * w for _, t, w in weighted) / total
    sizes = {n for n, _, _ in weighted}
    if len(sizes) == 1:
        return Summary(newest, total, sizes.pop(), mean_t, None)
    return Summary(newest, total, None, mean_t, _fit(weighted, total))


def _fit(samples, total):
    """Weighted least squares t = fixed + per_byte * n, neither below zero."""
    mean_n = sum(n * w for n, _, w in samples) / total
    mean_t = sum(t * w for _, t, w in samples) / total
    var = sum(w * (n - mean_n) ** 2 for n, _, w in samples)
    per_byte = max(0.0, sum(w * (n - mean_n) * (t - mean_t) for n, t, w in samples) / var)
    fixed = mean_t - per_byte * mean_n
    if fixed < 0:
        fixed, per_byte = 0.0, mean_t / mean_n
    return fixed, per_byte
