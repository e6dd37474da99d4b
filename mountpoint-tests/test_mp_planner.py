"""The planner on real servers: an offload that turns slow mid-copy hands the rest to streaming.

Two Linux nfsd guests that copy between each other (inter-server COPY: guest
B's nfsd pulls the file from guest A).  The mount has read from A and written
to B before, so it knows what streaming between them costs.  Once the copy
is under way, the guests' own link (A to B, which only the offload uses) is
throttled with tc: the offload stalls while streaming is as fast as before,
and the copy must end by streaming, byte-exact, with status saying so.
"""

import contextlib
import os
import shutil
import subprocess
import threading
import time

import pytest
from mpkit import MiB, sha256, write_file

from offloadfs.cli import read_status
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.nfsd import nfsd_lab

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="nfsd labs need root (namespaces, taps)"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
    pytest.mark.skipif(shutil.which("tc") is None, reason="tc (iproute2) is not installed"),
]

SIZE = 96 * MiB
WARM = 16 * MiB  # ordinary traffic before the copy: what streaming costs on each side
BOUND = 180  # seconds: a copy still running then is stuck on the stalled offload
NO_CACHE = ["attr_timeout=0", "entry_timeout=0"]


@pytest.fixture(scope="module")
def lab():
    with contextlib.ExitStack() as stack:
        try:
            lab = stack.enter_context(nfsd_lab(guests=2, ssc=True))
        except RuntimeError as e:  # no apt, no compiler, the nfsd build failed, a guest did not boot
            pytest.skip(f"no nfsd guests with inter-server copy: {e}")
        yield lab


def throttle(lab, tap, source):
    """Slow what ``source`` sends out of ``tap`` (to the guest behind it) to a crawl; the rest passes."""
    for args in (["qdisc", "add", "dev", tap, "root", "handle", "1:", "htb", "default", "10"],
                 ["class", "add", "dev", tap, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
                 ["class", "add", "dev", tap, "parent", "1:", "classid", "1:20", "htb", "rate", "1mbit"],
                 ["filter", "add", "dev", tap, "protocol", "ip", "parent", "1:", "prio", "1", "u32",
                  "match", "ip", "src", f"{source}/32", "flowid", "1:20"]):
        subprocess.run(lab.net.command("tc", *args), check=True, capture_output=True)


def test_an_inter_server_copy_throttled_mid_copy_is_finished_by_streaming(lab):
    a, b = lab.guests
    urls = {"a": f"nfs://{a.host}{a.export}", "b": f"nfs://{b.host}{b.export}"}
    with offloadfs_mount(urls["a"], options=NO_CACHE) as view, offloadfs_mount(urls) as mnt:
        digest = write_file(view / "src", SIZE)
        write_file(view / "warm", WARM)
        with open(mnt / "a" / "warm", "rb") as f:  # reads from A
            while f.read(MiB):
                pass
        write_file(mnt / "b" / "warm", WARM)  # writes to B
        cp = subprocess.Popen(["cp", mnt / "a" / "src", mnt / "b" / "dst"], stderr=subprocess.PIPE, text=True)
        methods = []

        def watch():
            while cp.poll() is None:
                for copy in read_status(mnt)["copies_in_flight"]:
                    if not methods or methods[-1] != copy["method"]:
                        methods.append(copy["method"])
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            deadline = time.monotonic() + BOUND
            while "inter_server_copy" not in methods:
                assert time.monotonic() < deadline and cp.poll() is None, f"no inter-server copy seen: {methods}"
                time.sleep(0.05)
            throttle(lab, "labtap1", a.host)  # A to B only: our reads from A and writes to B pass
            try:
                cp.wait(BOUND)
            except subprocess.TimeoutExpired:
                cp.kill()
                raise AssertionError(f"cp still running {BOUND} s on: stuck on the stalled offload") from None
        finally:
            watcher.join()
            subprocess.run(lab.net.command("tc", "qdisc", "del", "dev", "labtap1", "root"))
        print(f"methods seen in status: {methods}; cp: {cp.stderr.read()}")
        assert cp.returncode == 0
        counters = read_status(mnt)["counters"]
        print(counters)
        assert methods[-1] == "stream" and "inter_server_copy" in methods, methods
        assert counters["switched_to_stream"] == 1, counters
        assert counters["copy_bytes"]["stream"] > 0, counters
        assert counters["copy_errors"] == 0, counters
        assert sha256(mnt / "b" / "dst") == digest
    with offloadfs_mount(urls["b"], options=NO_CACHE) as b_view:  # B's file itself, no cache of ours
        assert sha256(b_view / "dst") == digest
