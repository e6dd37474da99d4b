"""Test lab: throwaway backing filesystems and offloadfs mounts.

Shared by the mountpoint tests, the benchmark and the demo so that all three
build their fixtures the same way and always clean up after themselves.
"""
from dataclasses import dataclass


@dataclass
class Lab:
    """The servers a *_lab context manager started; `server` is the first."""

    servers: list

    @property
    def server(self):
        return self.servers[0]
