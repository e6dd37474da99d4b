"""Demo: `cp` of 1 GiB on a Samba share through offloadfs, with and without offload.

A real smbd runs in its own network namespace behind a 1 Gbit link (tc tbf
both ways), serving a share on a btrfs loop filesystem. With offload, cp
becomes a server-side copy (duplicate extents on btrfs, copychunk on xfs and
ext4) and next to nothing crosses the link; with `-o offload=off` the daemon
reads every byte over the link and writes it back. The file is written on the
server side, straight into the share's directory, so making it costs no wire
time; the bytes shown are those that crossed the client's end of the link.

Run as root: python -m offloadfs.lab.smbdemo [--kind btrfs|xfs|ext4] [--size-mib N]
"""

import argparse
import contextlib
import hashlib
import tempfile
from pathlib import Path

from offloadfs.lab.demo import timed_cp, write_file
from offloadfs.lab.mount import offloadfs_mount, status
from offloadfs.lab.samba import samba_lab

MiB = 1 << 20
RATE = "1gbit"


@contextlib.contextmanager
def share_mount(server, kind, options=()):
    """Mount share `kind` of a lab server through offloadfs; yield the mountpoint.

    The password goes in a credentials file only root can read, as it must
    (never in the URL or the options, which show in ps and /proc/mounts).
    """
    with tempfile.TemporaryDirectory(prefix="offloadfs-cred-") as tmp:
        cred = server.write_credentials(Path(tmp, "credentials"))
        url = f"smb://{server.username}@{server.host}/{kind}"
        with offloadfs_mount(url, options=[f"credentials={cred}", *options]) as mnt:
            yield mnt


def timed_wire_cp(server, mnt, src, dst):
    """(seconds, bytes across the client's link, copy methods used) of `cp src dst`."""
    before = server.net.counters()
    seconds = timed_cp(mnt / src, mnt / dst)
    after = server.net.counters()
    methods = [m for m, n in status(mnt)["counters"]["copy_bytes"].items() if n]
    return seconds, after.rx - before.rx + after.tx - before.tx, methods


def amount(n):
    """Bytes in the largest unit that keeps them readable."""
    for unit, name in ((1 << 30, "GiB"), (MiB, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("btrfs", "xfs", "ext4"), default="btrfs")
    parser.add_argument("--size-mib", type=int, default=1024)
    args = parser.parse_args()
    size = args.size_mib * MiB
    with samba_lab((args.kind,), rate=RATE) as lab:
        server = lab.server
        share = server.shares[args.kind].path
        print(f"Samba in a network namespace behind a {RATE} link: share {server.unc(args.kind)} "
              f"on {args.kind}")
        print(f"writing {args.size_mib} MiB into the share on the server side ...")
        write_file(share / "big", size)
        with share_mount(server, args.kind) as mnt:
            on = timed_wire_cp(server, mnt, "big", "copy-offload")
        with share_mount(server, args.kind, ["offload=off"]) as mnt:
            off = timed_wire_cp(server, mnt, "big", "copy-stream")
        same = sha256(share / "big") == sha256(share / "copy-offload") == sha256(share / "copy-stream")
    for label, (seconds, wire, methods) in (("offload on: ", on), ("offload=off:", off)):
        print(f"cp {args.size_mib} MiB, {label} {seconds:8.3f} s, {amount(wire):>10} on the client's link"
              f"  ({', '.join(methods)})")
    print(f"offload=off took {off[0] / max(on[0], 1e-6):.0f}x as long")
    print(f"both copies identical to the original: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
