"""ksmbd, Linux's in-kernel SMB server, in the nfsd guest (issue #32).

The same guest, booted with lab.ksmbd=Y and a newer kernel (kernel()),
serves its /export over SMB too: ksmbd.ko and the crypto modules it asks for by name (there is no modprobe
in the guest to load them on demand), and ksmbd-tools' ksmbd.mountd, the
user space half that reads the config and the users' passwords. ksmbd-tools
is a dynamic binary: it travels with the shared libraries it needs, found
by following DT_NEEDED through Debian's packages of them, and the loader.
All of it comes from apt-get download and is cached like the kernel.

nfsd keeps serving the same disk: the tests look at what ksmbd stored
through NFS, a path that does not go through ksmbd.
"""

from pathlib import Path

from offloadfs.lab.nfsd import build
from offloadfs.lab.nfsd.build import cpio_entry, depends, resolve, run

TOOLS = "ksmbd-tools"
# The packages whose files ksmbd.tools loads: glib, libnl and their own needs, and the C library.
LIBRARY_PACKAGES = ("libglib2.0-0", "libnl-3-200", "libnl-genl-3-200", "libpcre2-8-0", "libc6")
# ksmbd.ko, the NLS table it converts names with, and the algorithms it allocates by name
# (signing: cmac(aes), hmac(sha256); encryption: ccm(aes), gcm(aes); NTLM: md4, md5; pre-auth:
# sha512). Those built in (aes, hmac, md5, sha256) are not modules.
MODULES = ("ksmbd", "nls_utf8", "cmac", "ccm", "gcm", "ctr", "ghash_generic", "md4", "sha512_generic", "ecb")
PROGRAM = "usr/libexec/ksmbd.tools"
SBIN = ("ksmbd.mountd", "ksmbd.adduser", "ksmbd.control", "ksmbd.addshare")
UP = Path(__file__).with_name("ksmbd-up.sh")


def newest(package):
    """(package, the newest version apt knows): with bookworm's ksmbd-tools 3.4.7, ksmbd 6.1.192
    answers every tree connect BAD_NETWORK_NAME; bookworm-backports' 3.5.2 works."""
    return package, run("apt-cache", "madison", package).split("|")[1].strip()


def kernel():
    """The linux-image package ksmbd's guest boots: the newest apt knows (bookworm-backports').
    bookworm's 6.1.192 oopses on the first CREATE that is granted no oplock (a NULL pointer
    dereference in opinfo_put, called from smb2_open), a directory's at mount time."""
    meta, version = newest("linux-image-amd64")
    return next(d for d in depends(meta, version) if d.startswith("linux-image-"))


def userland():
    """Cached tree: ksmbd.tools and the closure of the libraries it needs (build.userland)."""
    packages = [newest(TOOLS)] + [resolve(p) for p in LIBRARY_PACKAGES]
    key = "_".join(f"{n}-{v}" for n, v in packages[:2])
    return build.userland(f"ksmbd-tree_{key}", packages, [PROGRAM])


def entries():
    """initramfs entries of ksmbd's user space: ksmbd.tools under each name it answers to, its
    libraries where the loader looks, the loader where the binary names it, and ksmbd-up."""
    parts = build.userland_entries(userland())
    parts += [cpio_entry(d, 0o040755) for d in ("etc", "etc/ksmbd", "run")]
    parts += [cpio_entry(f"bin/{name}", 0o120777, f"/{PROGRAM}".encode()) for name in SBIN]
    parts.append(cpio_entry("bin/ksmbd-up", 0o100755, UP.read_bytes()))
    return parts
