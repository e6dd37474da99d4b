"""Benchmark what RPCSEC_GSS costs: 64 MiB written and read back through offloadfs on nfs-ganesha (or
Linux nfsd) under sec=sys, krb5, krb5i and krb5p, side by side.

Not a test: it prints a table and asserts nothing. Run as root:
    .venv/bin/python benchmarks/nfs_krb5.py [--size MIB] [--runs N] [--server ganesha|nfsd]

One ganesha in the lab's AD realm (offloadfs/lab/addc.py nfs_kerberos_lab)
exports an xfs, or with --server nfsd the nfsd guest with rpc.svcgssd
(offloadfs/lab/nfsd/krb5.py; TCG: compare its ratios, not its MiB/s); four
mounts of it, one per flavour, take turns, each run
writing a fresh file with dd from one on tmpfs (direct I/O, so the kernel's page cache is out
of it, 1 MiB requests, fsync at the end) and reading it back the same way.
It prints the median MiB/s of each and its ratio to sys: krb5 adds a MIC per
request, krb5i checksums every byte both ways, krb5p encrypts them.
"""
import argparse
import contextlib
import os
import statistics
import subprocess
import tempfile
import time

from offloadfs.lab.addc import nfs_kerberos_lab
from offloadfs.lab.mount import offloadfs_mount
from offloadfs.lab.nfsd import ksmbd, nfsd_lab

FLAVOURS = ("sys", "krb5", "krb5i", "krb5p")
MiB = 1 << 20


def dd(*args):
    subprocess.run(["dd", "bs=1M", "status=none", *args], check=True)


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@contextlib.contextmanager
def bench_dir(server):
    """Yield (URL of a fresh directory "bench" on the export, the realm's DC)."""
    if server == "ganesha":
        with nfs_kerberos_lab() as lab:
            (lab.server.path / "bench").mkdir()
            yield f"nfs://{lab.server.host}/export/bench", lab.realm
        return
    # The kernel whose nfsd takes our krb5p (see test_mp_nfs_kerberos.py).
    with nfsd_lab(kernel=ksmbd.kernel(), sectypes=FLAVOURS) as lab:
        status, out = lab.guest.run("mkdir bench")
        if status:
            raise RuntimeError(out)
        yield f"nfs://{lab.guest.host}/export/bench", lab.realm


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=64, help="MiB written and read per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, help="runs per flavour, taking turns (default 3)")
    parser.add_argument("--server", choices=("ganesha", "nfsd"), default="ganesha", help="the NFS server")
    args = parser.parse_args()
    times = {sec: {"write": [], "read": []} for sec in FLAVOURS}
    with bench_dir(args.server) as (url, realm), tempfile.TemporaryDirectory() as tmp, \
            contextlib.ExitStack() as stack:
        os.environ["KRB5_CONFIG"] = str(realm.krb5_conf)
        os.environ["KRB5CCNAME"] = f"FILE:{realm.kinit(os.path.join(tmp, 'cc'))}"
        source = os.path.join(tmp, "data")  # made once: the runs time offloadfs, not the random generator
        dd("if=/dev/urandom", f"of={source}", f"count={args.size}")
        mounts = {sec: stack.enter_context(offloadfs_mount(url, options=[f"sec={sec}"])) for sec in FLAVOURS}
        for run in range(args.runs):
            for sec, mnt in mounts.items():
                path = mnt / f"{sec}-{run}"
                times[sec]["write"].append(timed(dd, f"if={source}", f"of={path}",
                                                 "oflag=direct", "conv=fsync"))
                times[sec]["read"].append(timed(dd, f"if={path}", "of=/dev/null", "iflag=direct"))
                path.unlink()
    rate = {sec: {way: args.size / statistics.median(t) for way, t in ways.items()} for sec, ways in times.items()}
    print(f"{args.server}: {args.size} MiB, median of {args.runs} runs, MiB/s (ratio to sys)")
    print(f"{'sec':8}{'write':>18}{'read':>18}")
    for sec in FLAVOURS:
        cells = [f"{rate[sec][way]:8.1f} ({rate[sec][way] / rate['sys'][way]:4.2f})" for way in ("write", "read")]
        print(f"{sec:8}{cells[0]:>18}{cells[1]:>18}")


if __name__ == "__main__":
    main()
