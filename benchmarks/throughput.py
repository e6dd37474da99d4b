"""Benchmark sequential write and read through offloadfs against smbclient put/get, rclone mount and
smbnetfs on the Samba lab.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/throughput.py [--quick] [--out DIR]

One lab smbd serves an xfs share, once behind smbdemo's 1 Gbit link and once on the bare veth (standing in
for a faster network). Each round each tool, in turns (the first changing each round), writes a file of
random bytes from the local disk's page cache (`dd bs=1M` into a mount; `smbclient -c put`) and reads two
files it wrote and never read before (`dd bs=1M` to /dev/null; `smbclient -c get` to /dev/null), each after
the kernel's caches were dropped: one with its copy on the server dropped too (on this one machine), one
read into the server's page cache again. Cold, the server's own read (xfs on a loop file on the VM's disk)
shares the two CPUs with the client, and what the client spends its CPU on slows the server; warm, the
client and the link are what is measured, as with a server of its own.

smbclient runs three times: signing, as offloadfs always does, as it runs by default, unsigned on this lab
(its server does not require signing), and sealed, beside offloadfs mounted with `seal`; offloadfs's ratio to each is printed, and smbclient's times include
its connect and logon, measured alone (`-c exit`) and taken off. offloadfs runs twice too: as mounted by
default, and with `detect_copies=off`, which does not remember what it serves (otherwise each byte read is
cut and hashed, in case it is written back). No write asks the server to make the data durable: dd's time
ends when its close() returns, once the server has acknowledged every byte, as `put`'s does. (Until
2026-12-06 dd ran with `conv=fsync`, whose FLUSH made smbd write the file to disk within the time: 0.4-1.6
s of 4.5 s for 512 MiB at 1 Gbit.) Every file written is checked on the server; each round writes bytes of
its own. Goal (issue #8): offloadfs >= 98 % of smbclient on the 1 Gbit link, >= 90 % on the bare one.
The results go to OUT/throughput.json and a plot of them to OUT/throughput.png (report.py).
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import report
from local import drop_caches
from offloadfs.lab.samba import samba_lab
from offloadfs.lab.smbdemo import RATE, share_mount
from peers import install_peers, rclone_mount, smbnetfs_mount

KIND = "xfs"
MiB = 1 << 20
FULL = {"mib": 512, "rounds": 3}
QUICK = {"mib": 128, "rounds": 1}
GOALS = {RATE: 0.98, None: 0.90}
READS = ("read, cold", "read, warm")  # the server's copy of the file dropped from its cache, or read into it
# offloadfs signs every request and checks every reply's signature (a reply that is not the server's is
# never taken); smbclient signs only where asked (`--client-protection=sign`) or where the server requires it.
SMBCLIENT = {"smbclient, signed": ("--client-protection=sign",), "smbclient": (),
             "smbclient, sealed": ("--client-protection=encrypt",)}
TABLE = ("offloadfs", "offloadfs, detect_copies=off", "offloadfs, seal", *SMBCLIENT, "rclone mount", "smbnetfs")
# Sealed (SMB3 encryption, AES-128-GCM here, keyed as the session is: NTLM in this lab, Kerberos on a
# domain's share): what it costs offloadfs, and offloadfs against smbclient sealed too.
SEALED = ("offloadfs, seal", "smbclient, sealed")


def timed(*argv):
    start = time.monotonic()
    subprocess.run(list(map(str, argv)), check=True, capture_output=True)
    return time.monotonic() - start


def cache(path):
    """Read ``path`` into the page cache, so that neither writer waits for the disk."""
    with open(path, "rb") as f:
        while f.read(MiB):
            pass


def smbclient(server, authfile, command, *options):
    return timed("smbclient", server.unc(KIND), "-A", authfile, "-m", "SMB3", *options, "-c", command)


def rounds(server, mounts, tmp, authfile, size, steps):
    """{(tool, way): [MiB/s per round]}; ``mounts``: tool -> the directory showing the share.  Each file
    read is read once: offloadfs remembers what it served (copy recognition), and a second read of the
    same file costs it less."""
    share = server.shares[KIND].path
    mib = size["mib"]
    tools = [*mounts, *SMBCLIENT]
    out = {}
    logon = {tool: statistics.median(smbclient(server, authfile, "exit", *SMBCLIENT[tool]) for _ in range(3))
             for tool in SMBCLIENT}
    for r in range(size["rounds"]):
        for tool in tools[r % len(tools):] + tools[:r % len(tools)]:
            name = f"tool{tools.index(tool)}-{r}"
            local = Path(tmp, f"data-{r}")
            cache(local)
            if tool in SMBCLIENT:
                seconds = smbclient(server, authfile, f"put {local} {name}", *SMBCLIENT[tool]) - logon[tool]
            else:
                seconds = timed("dd", f"if={local}", f"of={mounts[tool] / name}", "bs=1M", "status=none")
            out.setdefault((tool, "write"), []).append(mib / seconds)
            if (share / name).read_bytes() != local.read_bytes():
                raise RuntimeError(f"{tool} wrote {name} wrong")
            for way, read in zip(READS, (name, f"{name}.warm")):
                if way == "read, warm":  # written through the tool, which may not see files made behind it
                    if tool in SMBCLIENT:
                        smbclient(server, authfile, f"put {local} {read}", *SMBCLIENT[tool])
                    else:
                        timed("dd", f"if={local}", f"of={mounts[tool] / read}", "bs=1M", "status=none")
                drop_caches()
                if way == "read, warm":
                    cache(share / read)
                if tool in SMBCLIENT:
                    seconds = smbclient(server, authfile, f"get {read} /dev/null", *SMBCLIENT[tool]) - logon[tool]
                else:
                    seconds = timed("dd", f"if={mounts[tool] / read}", "of=/dev/null", "bs=1M", "status=none")
                out.setdefault((tool, way), []).append(mib / seconds)
                (share / read).unlink()
            steps.done(tool)
    return out


def save(out, rows, size):
    """OUT/throughput.json and OUT/throughput.png: median MiB/s of each tool and way, a plot a link."""
    ways = ("write", *READS)
    median = [(rate or "bare veth", {tool: {way: statistics.median(results[(tool, way)]) for way in ways}
                                     for tool in TABLE}) for rate, results in rows]
    fig, axes = report.figure(f"sequential I/O of {size['mib']} MiB on a Samba {KIND} share", len(median))
    for ax, (link, tools) in zip(axes, median):
        report.draw_bars(ax, f"{link} link", {way: {tool: tools[tool][way] for tool in TABLE} for way in ways},
                         f"MiB/s (median of {size['rounds']})")
    report.save(out, "throughput", {"share": KIND, "size": size, "mib_s": dict(median)}, fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB, one round")
    report.add_out_argument(parser)
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    install_peers()
    rows = []
    with (tempfile.TemporaryDirectory(prefix="offloadfs-throughput-") as tmp,
          report.progress("rounds of each tool, each link", total=2 * size["rounds"] * (len(TABLE))) as steps):
        for r in range(size["rounds"]):
            Path(tmp, f"data-{r}").write_bytes(os.urandom(size["mib"] * MiB))
        for rate in (RATE, None):
            with contextlib.ExitStack() as stack:
                server = stack.enter_context(samba_lab((KIND,), rate=rate)).server
                authfile = Path(tmp, "auth")
                authfile.write_text(f"username = {server.username}\npassword = {server.password}\n")
                authfile.chmod(0o600)
                workdir = Path(tmp, f"peers-{rate}")
                workdir.mkdir()
                mounts = {"offloadfs": stack.enter_context(share_mount(server, KIND)),
                          "offloadfs, detect_copies=off":
                              stack.enter_context(share_mount(server, KIND, ["detect_copies=off"])),
                          "offloadfs, seal": stack.enter_context(share_mount(server, KIND, ["seal"])),
                          "rclone mount": stack.enter_context(rclone_mount(server, KIND, workdir))[0],
                          "smbnetfs": stack.enter_context(smbnetfs_mount(server, KIND, workdir))[0]}
                rows.append((rate, rounds(server, mounts, tmp, authfile, size, steps)))
    ways = ("write", *READS)
    print(f"sequential I/O of {size['mib']} MiB (dd bs=1M; smbclient put/get), Samba {KIND} share, "
          f"median MiB/s of {size['rounds']} round(s)")
    for rate, results in rows:
        print(f"  {(rate or 'bare veth') + ' link':34}" + "".join(f"{way:>12}" for way in ways))
        for tool in TABLE:
            print(f"    {tool:32}" + "".join(f"{statistics.median(results[(tool, way)]):12.1f}" for way in ways))
        for ours, base in [("offloadfs", base) for base in SMBCLIENT if base not in SEALED] + [SEALED,
                                                                                         (SEALED[0], "offloadfs")]:
            ratios = [statistics.median(results[(ours, way)]) / statistics.median(results[(base, way)])
                      for way in ways]
            missed = [way for way, ratio in zip(ways, ratios) if ratio < GOALS[rate]]
            goal = (f"   goal {GOALS[rate]:.2f}" + (f", missed: {', '.join(missed)}" if missed else "")
                    if ours == "offloadfs" else "")
            print(f"    {ours + ' / ' + base:32}" + "".join(f"{ratio:12.2f}" for ratio in ratios) + goal)
    save(args.out, rows, size)


if __name__ == "__main__":
    main()
