"""nfsd in the guest serving RPCSEC_GSS: sec=krb5, krb5i and krb5p (issue #32).

The guest booted with lab.krb5=Y runs rpc.svcgssd (Debian 12's nfs-common),
the user-space half that accepts a client's context with libgssapi_krb5 and
the keytab of nfs/GUEST-ADDRESS alone (no traffic to the KDC) and passes the
kernel the context's keys; the kernel's auth_rpcgss and rpcsec_gss_krb5 do the
rest. rpc.svcgssd and its libraries travel as ksmbd-tools do
(build.userland). It maps no principal to a uid (libnfsidmap without an
idmapd.conf maps none): each acts as the export's anonymous uid, which the
lab makes root, as the realm's user is on ganesha's export. The
algorithms rpcsec_gss_krb5 allocates by name (cts(cbc(aes)); cbc, aes, hmac
and sha1 are built into Debian's kernel) are listed outright: there is no
modprobe in the guest.

The keytab and a krb5.conf come from the realm's DC (addc.py) at boot, the
rest is cached like the kernel. The guest never asks the KDC: with the DC's
address blackholed in the guest, new krb5p contexts still came up.

Boot the newest kernel apt knows (ksmbd.kernel(), 6.12) for krb5p: bookworm's
6.1 nfsd unwraps our krb5p calls (no rpcgss unwrap or seqno tracepoint
fires) and then answers GARBAGE_ARGS (nfsd_garbage_args_err); 6.12 takes
them. krb5 and krb5i work on both.
"""

from pathlib import Path

from offloadfs.lab.nfsd import build
from offloadfs.lab.nfsd.build import cpio_entry, resolve

PROGRAM = "usr/sbin/rpc.svcgssd"
PACKAGES = ("nfs-common", "libnfsidmap1", "libevent-core-2.1-7", "libtirpc3", "libgssapi-krb5-2", "libkrb5-3",
            "libk5crypto3", "libkrb5support0", "libcom-err2", "libkeyutils1", "libc6")
MODULES = ("auth_rpcgss", "rpcsec_gss_krb5", "cts", "ecb")
UP = Path(__file__).with_name("krb5-up.sh")
# RPCSEC_GSS pseudo-flavours as nfsd's export cache takes them (secinfo), and AUTH_SYS.
FLAVOURS = {"sys": 1, "krb5": 390003, "krb5i": 390004, "krb5p": 390005}


def userland():
    """Cached tree: rpc.svcgssd and the closure of the libraries it needs."""
    packages = [resolve(p) for p in PACKAGES]
    return build.userland(f"svcgssd-tree_{packages[0][1].replace(':', '-')}", packages, [PROGRAM])


def entries(keytab, krb5_conf):
    """initramfs entries of rpc.svcgssd with the service's `keytab` and the realm's `krb5_conf`."""
    parts = build.userland_entries(userland())
    parts.append(cpio_entry("etc", 0o040755))
    parts.append(cpio_entry("etc/krb5.keytab", 0o100600, Path(keytab).read_bytes()))
    parts.append(cpio_entry("etc/krb5.conf", 0o100644, Path(krb5_conf).read_bytes()))
    parts.append(cpio_entry("bin/krb5-up", 0o100755, UP.read_bytes()))
    return parts


def secinfo(flavours):
    """Pseudo-flavour numbers of `flavours` (names as in sec=), in nfsd's order of preference."""
    return ",".join(str(FLAVOURS[f]) for f in flavours)
