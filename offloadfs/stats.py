"""Counters since mount and the copies in flight: what `offloadfs status` shows.

The JSON produced by ``Stats.snapshot`` is a documented interface (README,
"Status"): add keys, never rename or remove them.  Under allow_other any user
may read it: a copy's paths (names inside other users' private directories)
are shown to the user whose copy it is, to the mount's owner and to root;
the counters, which name nothing, to all.
"""
import itertools
import os
import time
from dataclasses import dataclass, field

from .backends.base import CALLER

METHODS = ("clone", "server_copy", "inter_server_copy", "stream")
OFFLOADS = METHODS[:-1]  # the methods whose bytes the daemon never reads nor writes


@dataclass(slots=True)
class Copy:
    """One copy request in flight, made for ``uid``; ``method`` is the method moving its bytes now."""
    id: int
    uid: int
    source: str
    destination: str
    bytes_total: int
    method: str = "stream"
    bytes_done: int = 0
    started: float = 0.0
    by_method: dict = field(default_factory=dict)  # method -> bytes it moved
    recognised: bool = False  # found in written data (recognise.py), not asked for by a copy request


class Stats:
    def __init__(self, mountpoint, sources):
        self.mountpoint = mountpoint
        self.sources = sources
        self.owner = os.getuid()  # the daemon runs as whoever mounted (fuse/mount.py: user_id=)
        self.since = time.time()
        self.copies = dict.fromkeys(METHODS, 0)
        self.copy_bytes = dict.fromkeys(METHODS, 0)
        self.copy_requests = 0
        self.copy_errors = 0
        # Copies whose method gave way mid-copy to one expected to be faster for the rest.
        self.switched_to_stream = 0
        self.switched_to_offload = 0
        self.fuse_read_bytes = 0
        self.fuse_write_bytes = 0
        # What the filesystem asked its backends about names: what the directory cache saves.
        self.listings = 0
        self.lookups = 0
        self.lookups_absent = 0  # lookups the server answered "no such file"
        self.listings_ahead = 0  # of the listings: fetched ahead of a walk
        self.dir_reads = 0  # READDIR(PLUS) requests: what the kernel did not answer from its own cache
        # Copies recognised in plain writes (recognise.py): bytes found, committed as offloads by
        # method, and held then written after all (source changed, copy failed).
        self.recognised_bytes = 0
        self.recognised_committed = dict.fromkeys(OFFLOADS, 0)
        self.recognised_written = 0
        # Of the bytes committed: read back and compared, as the source's attributes prove nothing
        # (recognise.Recogniser._commit_run); and written without an offload, where reading back
        # was expected to cost as much as writing.
        self.recognised_verified = 0
        self.recognised_unchecked = 0
        # Bytes a plain copy would have sent across the client's link (from a local source: through
        # the daemon) that did not go: see moved, read_back and written_over.
        self.kept_off_network = 0
        self.in_flight = {}
        self._ids = itertools.count(1)

    def start_copy(self, source, destination, total, recognised=False):
        """A copy for the user the request acts for (CALLER: the opener of the destination, or the
        writer whose ``recognised`` copy is committed)."""
        self.copy_requests += 1
        copy = Copy(next(self._ids), CALLER.get().uid, source, destination, total, started=time.time(),
                    recognised=recognised)
        self.in_flight[copy.id] = copy
        return copy

    def moved(self, copy, method, nbytes, first):
        """``nbytes`` more of ``copy`` moved by ``method``; ``first`` counts the copy once per method."""
        copy.method = method
        copy.bytes_done += nbytes
        copy.by_method[method] = copy.by_method.get(method, 0) + nbytes
        self.copy_bytes[method] += nbytes
        if first:
            self.copies[method] += 1
        if method in OFFLOADS:
            # Streamed, a copy request's bytes would be read down and written up: both are spared.
            # A recognised copy's bytes came down already, as the program read them: only the write.
            self.kept_off_network += nbytes if copy.recognised else 2 * nbytes

    def read_back(self, nbytes):
        """A recognised copy's bytes read back to compare (its source proves nothing): traffic the
        offload cost, which a plain write would not have."""
        self.recognised_verified += nbytes
        self.kept_off_network -= nbytes

    def written_over(self, nbytes):
        """Bytes of a recognised copy found to differ when read back, and written after all: the
        write its offload spared was not spared."""
        self.kept_off_network -= nbytes

    def switched(self, copy, method):
        """``copy`` goes on by ``method``, from the byte where the one before it stopped."""
        copy.method = method
        if method == "stream":
            self.switched_to_stream += 1
        else:
            self.switched_to_offload += 1

    def end_copy(self, copy, failed):
        del self.in_flight[copy.id]
        if failed:
            self.copy_errors += 1

    def snapshot(self, backends=(), uid=0):
        """``backends``: their counters() join the mount's, added up over sources of one kind.  For
        ``uid``: but for root and the mount's owner, only that user's copies in flight."""
        now = time.time()
        everyone = uid in (0, self.owner)
        return {
            "pid": os.getpid(),
            "mountpoint": self.mountpoint,
            "sources": self.sources,
            "since": self.since,
            "copies_in_flight": [
                {"id": c.id, "uid": c.uid, "method": c.method, "source": c.source, "destination": c.destination,
                 "bytes_done": c.bytes_done, "bytes_total": c.bytes_total, "started": c.started,
                 **progress(c.bytes_done, c.bytes_total, c.started, now)}
                for c in self.in_flight.values() if everyone or c.uid == uid],
            "counters": {
                "copies": dict(self.copies),
                "copy_bytes": dict(self.copy_bytes),
                "copy_requests": self.copy_requests,
                "copy_errors": self.copy_errors,
                "switched_to_stream": self.switched_to_stream,
                "switched_to_offload": self.switched_to_offload,
                "fuse_read_bytes": self.fuse_read_bytes,
                "fuse_write_bytes": self.fuse_write_bytes,
                "listings": self.listings,
                "lookups": self.lookups,
                "lookups_absent": self.lookups_absent,
                "listings_ahead": self.listings_ahead,
                "dir_reads": self.dir_reads,
                "bytes_kept_off_network": self.kept_off_network,
                **added_up(b.counters() for b in backends),
                "recognised_bytes": self.recognised_bytes,
                "recognised_committed": dict(self.recognised_committed),
                "recognised_written": self.recognised_written,
                "recognised_verified": self.recognised_verified,
                "recognised_unchecked": self.recognised_unchecked,
            },
        }


def added_up(counters):
    """The sum of several {name: count or {key: count}}."""
    total = {}
    for c in counters:
        for name, value in c.items():
            if isinstance(value, dict):
                into = total.setdefault(name, {})
                for key, n in value.items():
                    into[key] = into.get(key, 0) + n
            else:
                total[name] = total.get(name, 0) + value
    return total


def progress(done, total, started, now):
    """Rate over the copy's whole life so far, and the time left at that rate (None before a byte moved)."""
    elapsed = now - started
    rate = done / elapsed if elapsed > 0 else 0.0
    return {"bytes_per_second": rate, "seconds_left": (total - done) / rate if rate else None}

