"""Test lab: throwaway backing filesystems and offloadfs mounts.

Shared by the mountpoint tests, the benchmark and the demo so that all three
build their fixtures the same way and always clean up after themselves.
"""
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Lab:
    """The servers a *_lab context manager started; `server` is the first."""

    servers: list

    @property
    def server(self):
        return self.servers[0]


def freeze(pid):
    """SIGSTOP a server (it hangs, its sockets stay open), and wait until every thread has stopped:
    the signal takes effect asynchronously, and a busy server still answers meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
        if all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop")
