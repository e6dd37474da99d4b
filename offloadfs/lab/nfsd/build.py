"""Kernel and initramfs of the nfsd guest, made from Debian packages.

The host has no NFS server of its own to offer, so Linux nfsd runs in a qemu
guest booted straight into a busybox init (init.sh). Everything comes from
Debian's archive through apt-get download (nothing is installed): the
kernel package's vmlinuz and the few modules nfsd, xfs and virtio need, and
busybox-static. What takes time (download and unpacking, ~15 s) is cached
under CACHE, one directory per package version; the initramfs itself is
assembled for each lab in a few ms, so editing init.sh costs no rebuild.
"""

import fcntl
import hashlib
import lzma
import re
import subprocess
import tempfile
from pathlib import Path

CACHE = Path("/var/cache/offloadfs-lab/nfsd-guest")
KERNEL = "linux-image-amd64"
BUSYBOX = "busybox-static"
INIT = Path(__file__).with_name("init.sh")
# crc32c_generic is named because libcrc32c asks the crypto API for "crc32c"
# when it loads, and there is no modprobe in the guest to load it on demand.
MODULES = ("crc32c_generic", "nfsd", "xfs", "virtio_pci", "virtio_blk", "virtio_net")
XZ_MAGIC = b"\xfd7zXZ\x00"


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
    decompression stub (xz under TCG costs seconds)."""
    data = vmlinuz.read_bytes()
    start = data.find(XZ_MAGIC)
    if start < 0:
        raise RuntimeError(f"{vmlinuz}: no xz payload (is the kernel compressed differently?)")
    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
    if not elf.startswith(b"\x7fELF"):
        raise RuntimeError(f"{vmlinuz}: the xz payload is not an ELF kernel")
    return elf


def module_order(kernel_dir, wanted):
    """Paths of the wanted modules and their dependencies, dependencies first.

    Read from each module's own modinfo "depends=" string, since the package
    ships no modules.dep (depmod makes it at install time).
    """
    paths = {p.stem.replace("-", "_"): p for p in kernel_dir.rglob("*.ko")}
    order = []

    def visit(name):
        if name in order:
            return
        match = re.search(rb"(?:^|\0)depends=([^\0]*)\0", paths[name].read_bytes())
        for dep in filter(None, match.group(1).decode().split(",") if match else []):
            visit(dep)
        order.append(name)

    for name in wanted:
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


def kernel_dir(kernel):
    """Cached vmlinux and modules/ (the closure of MODULES, with its load order)."""
    name, version = resolve(kernel)

    def make(out, root):
        fetch(name, version, root)
        (vmlinuz,) = (root / "boot").glob("vmlinuz-*")
        (out / "vmlinux").write_bytes(vmlinux(vmlinuz))
        (out / "modules").mkdir()
        modules = module_order(next((root / "lib/modules").glob("*/kernel")), MODULES)
        for ko in modules:
            (out / "modules" / ko.name).write_bytes(ko.read_bytes())
        (out / "modules/order").write_text("".join(f"{ko.name}\n" for ko in modules))

    digest = hashlib.sha256(repr(MODULES).encode()).hexdigest()[:8]
    return cached(f"{name}_{version}_{digest}", make)


def busybox_path():
    name, version = resolve(BUSYBOX)

    def make(out, root):
        fetch(name, version, root)
        (root / "bin/busybox").rename(out / "busybox")

    return cached(f"{name}_{version}", make) / "busybox"


def cpio_entry(name, mode, data=b"", rdev=(0, 0)):
    """One entry of a newc cpio archive (what the kernel unpacks as initramfs)."""
    fields = (0, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0)
    header = b"070701" + b"".join(b"%08x" % f for f in fields) + name.encode() + b"\0"
    pad = lambda b: b + b"\0" * (-len(b) % 4)
    return pad(header) + pad(data)


def initramfs(busybox, modules):
    """The guest's root: busybox, init.sh as /init, the modules and their load order."""
    dirs = ["bin", "dev", "proc", "sys", "export", "lib", "lib/modules"]
    parts = [cpio_entry(d, 0o040755) for d in dirs]
    # The kernel opens /dev/console for init before anything is mounted.
    parts.append(cpio_entry("dev/console", 0o020600, rdev=(5, 1)))
    parts.append(cpio_entry("bin/busybox", 0o100755, busybox.read_bytes()))
    parts.append(cpio_entry("init", 0o100755, INIT.read_bytes()))
    for ko in sorted(modules.iterdir()):
        parts.append(cpio_entry(f"lib/modules/{ko.name}", 0o100644, ko.read_bytes()))
    parts.append(cpio_entry("TRAILER!!!", 0))
    return b"".join(parts)


def guest_files(workdir, kernel=KERNEL):
    """(vmlinux, initramfs) paths to boot `kernel` (a linux-image package);
    the initramfs is written into workdir, the rest comes from the cache."""
    kernel = kernel_dir(kernel)
    image = Path(workdir, "initramfs.cpio")
    image.write_bytes(initramfs(busybox_path(), kernel / "modules"))
    return kernel / "vmlinux", image
