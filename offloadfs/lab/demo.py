"""Demo: `cp` of 1 GiB through offloadfs with and without offload.

On a btrfs backing filesystem an offloaded copy is a clone, so it costs
almost nothing; with `-o offload=off` the daemon streams every byte. Both
mounts share one backing directory so the same file is copied twice.
"""

import json
import os
import subprocess
import time

from offloadfs.lab.loopfs import loop_filesystem
from offloadfs.lab.mount import offloadfs_mount, status

SIZE = 1 << 30
CHUNK = 1 << 20


def write_file(path, size):
    """Write `size` bytes of non-repeating data so nothing looks sparse: every chunk differs."""
    block = os.urandom(min(size, CHUNK))
    with open(path, "wb") as f:
        for i, offset in enumerate(range(0, size, CHUNK)):
            f.write((i.to_bytes(8, "little") + block[8:])[:size - offset])
        os.fsync(f.fileno())


def timed_cp(src, dst):
    """Seconds `cp src dst` took."""
    start = time.monotonic()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    return time.monotonic() - start


def main():
    with loop_filesystem("btrfs") as backing:
        print(f"backing: btrfs loop filesystem at {backing}")
        with offloadfs_mount(backing) as mnt:
            print(f"writing 1 GiB through {mnt} ...")
            write_file(mnt / "big", SIZE)
            offload = timed_cp(mnt / "big", mnt / "copy-offload")
            counters_on = status(mnt)["counters"]
        with offloadfs_mount(backing, options=["offload=off"]) as mnt:
            streamed = timed_cp(mnt / "big", mnt / "copy-stream")
            counters_off = status(mnt)["counters"]
    print(f"cp 1 GiB, offload on:  {offload:7.3f} s")
    print(f"cp 1 GiB, offload=off: {streamed:7.3f} s")
    print(f"offload=off took {streamed / max(offload, 1e-6):.0f}x as long")
    print("counters, offload on: ", json.dumps(counters_on))
    print("counters, offload=off:", json.dumps(counters_off))


if __name__ == "__main__":
    main()
