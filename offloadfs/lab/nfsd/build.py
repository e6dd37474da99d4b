"""Kernel and initramfs of the nfsd guest, made from Debian packages.

The host has no NFS server of its own to offer, so Linux nfsd runs in a qemu
guest booted straight into a busybox init (init.sh). Everything comes from
Debian's archive through apt-get download (nothing is installed): the
kernel package's vmlinuz and the few modules nfsd, xfs and virtio need, and
busybox-static. What takes time (download and unpacking, ~15 s) is cached
under CACHE, one directory per package version; the initramfs itself is
assembled for each lab in a few ms, so editing init.sh costs no rebuild.

Inter-server copy (ssc) needs an nfsd that Debian does not ship: one built
with CONFIG_NFSD_V4_2_INTER_SSC, compiled here from the kernel's own source
package against its headers (~70 s on two cores, cached like the rest; it
needs gcc and make), plus the NFS client modules that nfsd mounts the source
server with.
"""

import fcntl
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

CACHE = Path("/var/cache/offloadfs-lab/nfsd-guest")
KERNEL = "linux-image-amd64"
BUSYBOX = "busybox-static"
INIT = Path(__file__).with_name("init.sh")
NFSD_UP = Path(__file__).with_name("nfsd-up.sh")
# crc32c_generic is named because libcrc32c asks the crypto API for "crc32c"
# when it loads, and there is no modprobe in the guest to load it on demand.
MODULES = ("crc32c_generic", "nfsd", "xfs", "virtio_pci", "virtio_blk", "virtio_net")
# An inter-server COPY makes the destination's nfsd mount the source server
# with the kernel's NFS client (vers=4.2, by address): no modprobe in the guest
# to load it on demand.
SSC_MODULES = ("nfsv4",)
SSC_DEFINE = "CONFIG_NFSD_V4_2_INTER_SSC"
XZ_MAGIC = b"\xfd7zXZ\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def run(*cmd, cwd=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def resolve(package):
    """(name, version) apt would download for package; a meta package such as
    linux-image-amd64 resolves to the kernel package it depends on.

    Needs apt's package lists (apt-get update).
    """
    show = run("apt-cache", "show", "--no-all-versions", package)
    fields = dict(re.findall(r"^(Package|Version|Depends): (.*)$", show, re.M))
    if package.startswith("linux-image-"):
        depends = [d.split()[0] for d in fields.get("Depends", "").split(", ")]
        target = next((d for d in depends if d.startswith("linux-image-")), None)
        if target:
            return resolve(target)
    return fields["Package"], fields["Version"]


def fetch(name, version, dest):
    """Download name=version with apt-get and unpack it under dest."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        # Download as root into a private directory rather than as _apt.
        run("apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", f"{name}={version}", cwd=tmp)
        (deb,) = Path(tmp).glob("*.deb")
        run("dpkg-deb", "-x", str(deb), str(dest))


def vmlinux(vmlinuz):
    """The ELF kernel inside a bzImage: PVH boots it without the slow
    decompression stub (xz or zstd under TCG costs seconds)."""
    data = vmlinuz.read_bytes()
    if (start := data.find(XZ_MAGIC)) >= 0:
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
    elif (start := data.find(ZSTD_MAGIC)) >= 0:
        # zstd complains of the size the kernel appends to the frame, after writing the frame out.
        elf = subprocess.run(["zstd", "-dcq"], input=data[start:], capture_output=True).stdout
    else:
        raise RuntimeError(f"{vmlinuz}: no xz or zstd payload (is the kernel compressed differently?)")
    if not elf.startswith(b"\x7fELF"):
        raise RuntimeError(f"{vmlinuz}: the compressed payload is not an ELF kernel")
    return elf


def module_bytes(path):
    """A module's ELF: 6.1's are plain .ko, later kernels' .ko.xz."""
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".xz") else data


def module_order(kernel_dir, wanted):
    """Paths of the wanted modules and their dependencies, dependencies first; a wanted
    name that is no module is built into this kernel.

    Read from each module's own modinfo "depends=" string, since the package
    ships no modules.dep (depmod makes it at install time).
    """
    paths = {p.name.split(".")[0].replace("-", "_"): p for p in kernel_dir.rglob("*.ko*")}
    order = []

    def visit(name):
        if name in order:
            return
        match = re.search(rb"(?:^|\0)depends=([^\0]*)\0", module_bytes(paths[name]))
        for dep in filter(None, match.group(1).decode().split(",") if match else []):
            visit(dep)
        order.append(name)

    for name in wanted:
        if name in paths:
            visit(name)
    return [paths[name] for name in order]


def cached(key, make):
    """CACHE/key, filled by make(directory) unless an earlier run did."""
    target = CACHE / key
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        # One builder at a time; whoever waited finds the work done.
        with open(CACHE / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                with tempfile.TemporaryDirectory(prefix="build-", dir=CACHE) as tmp:
                    out = Path(tmp, "out")
                    out.mkdir()
                    make(out, Path(tmp, "root"))
                    out.rename(target)
    return target


def kernel_dir(kernel, ssc=False, extra=()):
    """Cached vmlinux and modules/ (the closure of MODULES and `extra`, with its load order);
    with ssc, also the NFS client and an nfsd that can copy between servers."""
    name, version = resolve(kernel)
    wanted = MODULES + (SSC_MODULES if ssc else ()) + tuple(extra)
    nfsd = ssc_nfsd(name, version) if ssc else None  # outside make: cached()'s lock is not re-entrant

    def make(out, root):
        fetch(name, version, root)
        (vmlinuz,) = (root / "boot").glob("vmlinuz-*")
        (out / "vmlinux").write_bytes(vmlinux(vmlinuz))
        (out / "modules").mkdir()
        modules = module_order(next((root / "lib/modules").glob("*/kernel")), wanted)
        files = [ko.name.removesuffix(".xz") for ko in modules]
        for file, ko in zip(files, modules):
            (out / "modules" / file).write_bytes(nfsd.read_bytes() if nfsd and file == "nfsd.ko" else module_bytes(ko))
        (out / "modules/order").write_text("".join(f"{file}\n" for file in files))

    digest = hashlib.sha256((repr(wanted) + (" ssc" if ssc else "")).encode()).hexdigest()[:8]
    return cached(f"{name}_{version}_{digest}", make)


def depends(package, version):
    """Names of the packages package=version depends on."""
    show = run("apt-cache", "show", f"{package}={version}")
    line = re.search(r"^Depends: (.*)$", show, re.M)
    return [d.split()[0] for d in line.group(1).split(", ")] if line else []


def ssc_nfsd(name, version):
    """nfsd.ko for linux-image `name`=`version`, built with CONFIG_NFSD_V4_2_INTER_SSC (cached).

    Built as an external module from fs/nfsd of the same version's
    linux-source, against linux-headers (its Module.symvers carries the
    kernel's symbol versions, so the module loads) with the option defined
    on the compiler's command line: nothing outside nfsd depends on it. The
    headers package includes its common half by absolute path, so that line
    is pointed at the unpacked copy.
    """
    release = name.removeprefix("linux-image-")
    headers = f"linux-headers-{release}"
    needed = depends(headers, version)
    kbuild = next(d for d in needed if d.startswith("linux-kbuild-"))
    source = "linux-source-" + kbuild.removeprefix("linux-kbuild-")
    # linux-compiler-gcc-12-x86: the compiler the kernel was built with, which kbuild calls by name.
    compiler = next((m.group(1) for d in needed if (m := re.match(r"linux-compiler-(gcc-\d+)", d))), "gcc")
    missing = [tool for tool in (compiler, "make", "strip") if not shutil.which(tool)]
    if missing:
        raise RuntimeError(f"building nfsd for inter-server copy needs {', '.join(missing)} "
                           f"(apt-get install {compiler} make binutils)")

    def make(out, root):
        for package in [headers, source] + [d for d in needed if d.startswith(("linux-headers-", "linux-kbuild-"))]:
            fetch(package, version, root)
        tree = root / "usr/src" / headers
        makefile = tree / "Makefile"
        makefile.write_text(makefile.read_text().replace("include /usr/src/", f"include {root}/usr/src/"))
        build = root / "build"
        unpack_nfsd(next((root / "usr/src").glob(f"{source}.tar.*")), build)
        run("make", "-C", str(tree), f"M={build}/fs/nfsd", f"KCFLAGS=-D{SSC_DEFINE}",
            f"-j{os.cpu_count() or 1}", "modules")
        # Debug info is 90% of the module, and the guest holds its initramfs in RAM.
        run("strip", "--strip-debug", "-o", str(out / "nfsd.ko"), str(build / "fs/nfsd/nfsd.ko"))

    return cached(f"nfsd-ssc_{release}_{version}", make) / "nfsd.ko"


def unpack_nfsd(tarball, dest):
    """fs/nfsd and the one header it takes from fs/ out of the kernel source tarball, under dest/fs.

    Read as a stream: the tarball is ~140 MB of xz, and only 54 of its files are needed.
    """
    with tarfile.open(tarball, "r|*") as tar:
        for member in tar:
            path = member.name.split("/", 1)[-1]
            wanted = path.startswith("fs/nfsd/") or path == "fs/internal.h"
            if member.isfile() and wanted and ".." not in path.split("/"):
                target = dest / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())


def busybox_path():
    name, version = resolve(BUSYBOX)

    def make(out, root):
        fetch(name, version, root)
        (root / "bin/busybox").rename(out / "busybox")

    return cached(f"{name}_{version}", make) / "busybox"


LIBDIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")
LOADER = "ld-linux-x86-64.so.2"


def needed(binary):
    """Sonames `binary` asks the loader for."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run("readelf", "-d", str(binary)))


def userland(key, packages, files):
    """CACHE/key: a tree holding `files` (paths inside the Debian packages `packages`, each
    (name, version)) at the same paths, and in lib/x86_64-linux-gnu the closure of the shared
    libraries they need, found by following DT_NEEDED through the packages, with the loader.

    Dynamic user-space programs travel into the guest this way; a library a program loads
    with dlopen (a plugin) has no DT_NEEDED entry, so it is named among `files`.
    """

    def make(out, root):
        for name, version in packages:
            fetch(name, version, root)

        def locate(soname):
            found = [p for d in LIBDIRS if (p := root / d / soname).exists()]
            if not found:
                raise RuntimeError(f"{soname}: in none of {[name for name, _ in packages]}")
            return found[0]

        found = {LOADER: locate(LOADER)}
        wanted = [root / file for file in files] + [found[LOADER]]
        while wanted:
            for soname in needed(wanted.pop()):
                if soname not in found:
                    found[soname] = locate(soname)
                    wanted.append(found[soname])
        for file in files:
            (out / file).parent.mkdir(parents=True, exist_ok=True)
            (out / file).write_bytes((root / file).read_bytes())
        (out / LIBDIRS[0]).mkdir(parents=True, exist_ok=True)
        for soname, path in found.items():
            (out / LIBDIRS[0] / soname).write_bytes(path.read_bytes())

    return cached(key, make)


def userland_entries(tree):
    """initramfs entries of a userland() tree: its directories and files, and the loader
    where the programs name it (/lib64)."""
    parts = [cpio_entry("lib64", 0o040755),
             cpio_entry(f"lib64/{LOADER}", 0o120777, f"/{LIBDIRS[0]}/{LOADER}".encode())]
    for path in sorted(tree.rglob("*")):  # a directory before what it holds
        name = str(path.relative_to(tree))
        parts.append(cpio_entry(name, 0o040755) if path.is_dir() else cpio_entry(name, 0o100755, path.read_bytes()))
    return parts


def cpio_entry(name, mode, data=b"", rdev=(0, 0)):
    """One entry of a newc cpio archive (what the kernel unpacks as initramfs)."""
    fields = (0, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0)
    header = b"070701" + b"".join(b"%08x" % f for f in fields) + name.encode() + b"\0"
    pad = lambda b: b + b"\0" * (-len(b) % 4)
    return pad(header) + pad(data)


def initramfs(busybox, modules, extra=()):
    """The guest's root: busybox, init.sh as /init, nfsd-up.sh as /bin/nfsd-up, the modules and
    their load order, and the `extra` cpio entries."""
    dirs = ["bin", "dev", "proc", "sys", "export", "lib", "lib/modules"]
    parts = [cpio_entry(d, 0o040755) for d in dirs]
    # The kernel opens /dev/console for init before anything is mounted.
    parts.append(cpio_entry("dev/console", 0o020600, rdev=(5, 1)))
    parts.append(cpio_entry("bin/busybox", 0o100755, busybox.read_bytes()))
    parts.append(cpio_entry("init", 0o100755, INIT.read_bytes()))
    parts.append(cpio_entry("bin/nfsd-up", 0o100755, NFSD_UP.read_bytes()))
    for ko in sorted(modules.iterdir()):
        parts.append(cpio_entry(f"lib/modules/{ko.name}", 0o100644, ko.read_bytes()))
    parts.extend(extra)
    parts.append(cpio_entry("TRAILER!!!", 0))
    return b"".join(parts)


def guest_files(workdir, kernel=KERNEL, ssc=False, ksmbd=False, realm=None):
    """(vmlinux, initramfs) paths to boot `kernel` (a linux-image package),
    with ssc able to copy between servers, with ksmbd able to serve SMB too,
    with `realm` (an addc.DomainController holding the guests' nfs/ keys) able
    to serve RPCSEC_GSS; the initramfs is written into workdir, the rest comes
    from the cache."""
    from offloadfs.lab.nfsd import krb5, ksmbd as smb  # they build on this module

    kernel = kernel_dir(kernel, ssc, (smb.MODULES if ksmbd else ()) + (krb5.MODULES if realm else ()))
    extra = (smb.entries() if ksmbd else []) + (krb5.entries(realm.nfs_keytab, realm.krb5_conf) if realm else [])
    image = Path(workdir, "initramfs.cpio")
    image.write_bytes(initramfs(busybox_path(), kernel / "modules", extra))
    return kernel / "vmlinux", image
