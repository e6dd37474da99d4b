"""What each copy method has cost on each route, and what it will cost: t = fixed + bytes / rate.

Offloads have a fixed price (an inter-server COPY sets up a whole NFS mount
between the servers: ~0.1 s) and then move bytes fast; our own streaming
starts at once but pays for every byte twice on the client's link.  Which
is cheaper depends on the size and the route, so the planner asks this
model, fed by the copies it timed, rather than a constant.
"""
from collections import defaultdict, deque

SAMPLES = 32  # the newest copies per route and method; servers and links change


class CostModel:
    def __init__(self):
        self._samples = defaultdict(lambda: deque(maxlen=SAMPLES))  # (route, method) -> [(bytes, s)]

    def record(self, route, method, nbytes, seconds):
        self._samples[route, method].append((nbytes, seconds))

    def known(self, route, method):
        return bool(self._samples[route, method])

    def predict(self, route, method, nbytes):
        """Seconds for ``nbytes`` by ``method`` on ``route``, or None while too little is known."""
        samples = self._samples[route, method]
        if not samples:
            return None
        sizes = {n for n, _ in samples}
        if len(sizes) == 1:
            (size,) = sizes
            if not size / 2 <= nbytes <= size * 2:
                return None  # one size seen: no way yet to tell fixed cost from rate
            return sum(t for _, t in samples) / len(samples)
        fixed, per_byte = _fit(samples)
        return fixed + per_byte * nbytes


def _fit(samples):
    """Least squares t = fixed + per_byte * n, neither below zero."""
    count = len(samples)
    mean_n = sum(n for n, _ in samples) / count
    mean_t = sum(t for _, t in samples) / count
    var = sum((n - mean_n) ** 2 for n, _ in samples)
    per_byte = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in samples) / var)
    fixed = mean_t - per_byte * mean_n
    if fixed < 0:
        fixed, per_byte = 0.0, mean_t / mean_n
    return fixed, per_byte
