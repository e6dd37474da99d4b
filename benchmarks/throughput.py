"""Benchmark sequential write and read through offloadfs against smbclient put/get on the Samba lab.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/throughput.py [--quick]

One lab smbd serves an xfs share, once behind smbdemo's 1 Gbit link and once on the bare veth (standing in
for a faster network). Each round writes a file of random bytes from the local disk's page cache (`dd
bs=1M` into the mount; `smbclient -c put`) and reads it back (`dd bs=1M` to /dev/null after dropping the
kernel's caches; `smbclient -c get` to /dev/null), the two tools taking turns, and the one that goes
first changing each round. smbclient's times include its connect and logon, measured alone (`-c exit`)
and taken off. Neither write asks the server to make the data durable: dd's time ends when its close()
returns, once the server has acknowledged every byte, as `put`'s does. (Until 2026-12-06 dd ran with
`conv=fsync`, whose FLUSH made smbd write the file to disk within the time: 0.4-1.6 s of 4.5 s for 512
MiB at 1 Gbit.) Every file written is checked on the server; each round writes bytes of its own. Goal
(issue #8): offloadfs >= 98 % of smbclient on the 1 Gbit link, >= 90 % on the bare one.
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from local import drop_caches
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount
from peers import install_peers

KIND = "xfs"
MiB = 1 << 20
FULL = {"mib": 512, "rounds": 3}
QUICK = {"mib": 128, "rounds": 1}
GOALS = {RATE: 0.98, None: 0.90}


def timed(*argv):
    start = time.monotonic()
    subprocess.run(list(map(str, argv)), check=True, capture_output=True)
    return time.monotonic() - start


def cache(path):
    """Read ``path`` into the page cache, so that neither writer waits for the disk."""
    with open(path, "rb") as f:
        while f.read(MiB):
            pass


def smbclient(server, authfile, command):
    return timed("smbclient", server.unc(KIND), "-A", authfile, "-m", "SMB3", "-c", command)


def rounds(server, mnt, tmp, authfile, size):
    """{(tool, way): [MiB/s per round]}; each round writes a file of its own (the same bytes again would
    be recognised as a copy of the file read the round before)."""
    share = server.shares[KIND].path
    mib = size["mib"]
    out = {}
    logon = statistics.median(smbclient(server, authfile, "exit") for _ in range(3))
    for r in range(size["rounds"]):
        for tool in ("offloadfs", "smbclient")[::1 if r % 2 == 0 else -1]:
            name = f"{tool}-{r}"
            local = Path(tmp, f"data-{r}")
            cache(local)
            if tool == "offloadfs":
                seconds = timed("dd", f"if={local}", f"of={mnt / name}", "bs=1M", "status=none")
            else:
                seconds = smbclient(server, authfile, f"put {local} {name}") - logon
            out.setdefault((tool, "write"), []).append(mib / seconds)
            if (share / name).read_bytes() != local.read_bytes():
                raise RuntimeError(f"{tool} wrote {name} wrong")
            drop_caches()
            if tool == "offloadfs":
                seconds = timed("dd", f"if={mnt / name}", "of=/dev/null", "bs=1M", "status=none")
            else:
                seconds = smbclient(server, authfile, f"get {name} /dev/null") - logon
            out.setdefault((tool, "read"), []).append(mib / seconds)
            (share / name).unlink()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB, one round")
    size = QUICK if parser.parse_args().quick else FULL
    install_peers(("smbclient",))
    rows = []
    with tempfile.TemporaryDirectory(prefix="offloadfs-throughput-") as tmp:
        for r in range(size["rounds"]):
            Path(tmp, f"data-{r}").write_bytes(os.urandom(size["mib"] * MiB))
        for rate in (RATE, None):
            with contextlib.ExitStack() as stack:
                server = stack.enter_context(samba_lab((KIND,), rate=rate)).server
                authfile = Path(tmp, "auth")
                authfile.write_text(f"username = {server.username}\npassword = {server.password}\n")
                authfile.chmod(0o600)
                mnt = stack.enter_context(share_mount(server, KIND))
                rows.append((rate, rounds(server, mnt, tmp, authfile, size)))
    print(f"sequential I/O of {size['mib']} MiB (dd bs=1M; smbclient put/get), Samba {KIND} share, "
          f"median MiB/s of {size['rounds']} round(s)")
    print(f"  {'link':10}{'way':7}{'offloadfs':>11}{'smbclient':>11}{'ratio':>8}{'goal':>7}")
    for rate, results in rows:
        for way in ("write", "read"):
            ours, theirs = (statistics.median(results[(tool, way)]) for tool in ("offloadfs", "smbclient"))
            goal = GOALS[rate]
            mark = "" if ours / theirs >= goal else "  missed"
            print(f"  {rate or 'bare veth':10}{way:7}{ours:11.1f}{theirs:11.1f}{ours / theirs:8.2f}{goal:7.2f}{mark}")


if __name__ == "__main__":
    main()
