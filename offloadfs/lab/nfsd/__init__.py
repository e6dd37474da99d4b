"""Linux nfsd servers in qemu guests, for the NFS backend tests.

Linux nfsd is the server that implements COPY, CLONE and async copies (see
the field notes), and this host has no kernel NFS server, so each server is a
qemu guest (TCG: no KVM here) booting Debian's kernel into the init of
init.sh, serving an xfs disk image as /export over NFSv4.1/4.2.

Guests sit on a bridge inside one lab namespace (net.py), which is joined to
this host by the namespace's veth: the client side keeps the namespace's
byte counters and optional tbf shaping, guests on the same bridge reach each
other (inter-server copy), and destroying the namespace kills any qemu left.
Addresses: the bridge takes the namespace's server address (.2), guests .3
onwards.

With ssc=True the guests run an nfsd built for inter-server copy (build.py)
with inter_copy_offload_enable on, so one guest's nfsd can pull a file from
another's with COPY_NOTIFY + COPY.

Each guest runs shell commands from the host (NfsdGuest.run), read from its
second serial port, which qemu serves as a unix socket: a program inside the
guest writes the export as a local program, whose opens break nfsd's
delegations (they are kernel leases), where another NFS client's would be
recalled by nfsd itself. A command that stops nfsd (echo 0 >
/proc/fs/nfsd/threads, which also empties its export caches) starts it again
with nfsd-up (nfsd-up.sh).
"""

import contextlib
import ipaddress
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute

from offloadfs.lab.ganesha import EXPORT, PORT, nfs_null
from offloadfs.lab.loopfs import DEFAULT_SIZE, MKFS
from offloadfs.lab.loopfs import run as run_checked
from offloadfs.lab.net import server_namespace
from offloadfs.lab.nfsd.build import KERNEL, guest_files
from offloadfs.lab.nfsd.krb5 import FLAVOURS, secinfo
from offloadfs.lab.samba import PASSWORD, USER

BRIDGE = "labbr0"
# A guest boots in 6-9 s under TCG, two at once in ~20 s on two busy cores;
# leave room for a much busier host.
BOOT_TIMEOUT = 180
STOP_TIMEOUT = 5
READY = "OFFLOADFS-NFSD-READY"
FAILED = "OFFLOADFS-NFSD-FAILED"
# Frame of a command's answer on the second serial port (init.sh): BEGIN token, the output,
# END token exit-status.
BEGIN, END = b"OFFLOADFS-BEGIN ", b"OFFLOADFS-END "
# A guest's open for writing waits for nfsd's recall of a delegation, which
# the kernel gives up on after lease-break-time (45 s).
COMMAND_TIMEOUT = 120
SETTINGS = {
    "max_block_size": 1 << 20,
    # The smallest nfsd accepts for both: expired leases show up fast.
    "lease": 10,
    "grace": 10,
    "threads": 8,
}


@dataclass
class NfsdGuest:
    """A qemu guest serving `export` at host:port; `image` is its xfs disk, `commands` the socket
    of its command port (run), `channel` the connection to it once run made one."""

    name: str
    host: str
    port: int
    export: str
    image: Path
    console: Path
    commands: Path
    process: subprocess.Popen
    channel: socket.socket = field(default=None, repr=False)

    def run(self, command, timeout=COMMAND_TIMEOUT):
        """(exit status, stdout and stderr) of one line of busybox sh run in the guest's /export.

        Commands run one at a time, in the order sent. TimeoutError where no answer came in
        `timeout` seconds (the guest's shell may still be running it: a later command waits)."""
        if "\n" in command:
            raise ValueError(f"one line only: {command!r}")
        if self.channel is None:
            self.channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.channel.connect(str(self.commands))
        token = uuid.uuid4().hex.encode()
        self.channel.sendall(token + b" " + command.encode() + b"\n")
        deadline = time.monotonic() + timeout
        received = b""
        # Anything before this command's BEGIN is the answer to one that timed out.
        while (end := answer_end(received, token)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self.process.poll() is not None:
                why = f"qemu exited ({self.process.returncode})" if self.process.poll() is not None else "timeout"
                raise TimeoutError(f"nfsd guest {self.name} did not answer {command!r} in {timeout} s ({why}); "
                                   f"received: {received[-2000:]!r}")
            self.channel.settimeout(left)
            with contextlib.suppress(TimeoutError):
                received += self.channel.recv(65536)
        begin = received.index(BEGIN + token + b"\n") + len(BEGIN) + len(token) + 1
        status = received[end:].split(b"\n", 1)[0].rsplit(b" ", 1)[1]
        return int(status), received[begin:end].decode(errors="replace")

    def stop(self):
        """End qemu (the guest does not get to shut down: its disk is throwaway)."""
        if self.channel is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def answer_end(received, token):
    """Where the END line of the answer to `token` starts in `received`, once all of it is there."""
    begin = received.find(BEGIN + token + b"\n")
    end = received.find(END + token + b" ", begin) if begin >= 0 else -1
    return end if end >= 0 and b"\n" in received[end:] else None


@dataclass
class NfsdLab:
    """A namespace (net.Namespace) with guests on its bridge; `guest` is the first; `realm` the
    Kerberos realm's DC (addc.DomainController) of a lab serving RPCSEC_GSS."""

    net: object
    guests: list
    realm: object = None

    @property
    def guest(self):
        return self.guests[0]


def make_bridge(ns, taps):
    """Move the namespace's address from its veth to a bridge holding the
    veth and one persistent tap per guest (qemu attaches to it by name)."""
    with IPRoute(netns=ns.name) as ipr:
        ipr.link("add", ifname=BRIDGE, kind="bridge")
        bridge = ipr.link_lookup(ifname=BRIDGE)[0]
        veth = ipr.link_lookup(ifname="lab0")[0]
        ipr.addr("del", index=veth, address=ns.server_addr, prefixlen=24)
        ipr.link("set", index=veth, master=bridge)
        ipr.addr("add", index=bridge, address=ns.server_addr, prefixlen=24)
        ipr.link("set", index=bridge, state="up")
        for tap in taps:
            ipr.link("add", ifname=tap, kind="tuntap", mode="tap")
            ipr.link("set", index=ipr.link_lookup(ifname=tap)[0], master=bridge, state="up")


def qemu_command(kernel, initramfs, addr, tap, image, console, commands, settings):
    """qemu's argv; settings (with SETTINGS) reach init.sh as lab.NAME=VALUE."""
    octets = ipaddress.ip_address(addr).packed
    settings = {"addr": f"{addr}/24", **SETTINGS, **settings}
    append = " ".join(
        ["console=ttyS0", "quiet", "panic=-1"] + [f"lab.{key}={value}" for key, value in settings.items()]
    )
    return [
        "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-no-reboot",
        "-machine", "pc", "-accel", "tcg", "-m", "512M", "-display", "none",
        "-kernel", str(kernel), "-initrd", str(initramfs), "-append", append,
        "-serial", f"file:{console}",
        # ttyS1, where init.sh takes commands: a socket the host connects to when it has one.
        "-chardev", f"socket,id=commands,path={commands},server=on,wait=off", "-serial", "chardev:commands",
        # The image is throwaway: skipping host flushes makes COMMIT cheap.
        "-drive", f"file={image},if=virtio,format=raw,cache=unsafe",
        "-netdev", f"tap,id=net0,ifname={tap},script=no,downscript=no",
        # Each guest needs its own MAC on the shared bridge.
        "-device", "virtio-net-pci,netdev=net0,mac=52:54:00:%02x:%02x:%02x" % tuple(octets[1:]),
    ]


def wait_ready(guest):
    """Return once the guest says READY and answers a NULL call from here."""
    deadline = time.monotonic() + BOOT_TIMEOUT
    while time.monotonic() < deadline:
        text = guest.console.read_text(errors="replace") if guest.console.exists() else ""
        if FAILED in text or guest.process.poll() is not None:
            break
        if READY in text and nfs_null(guest.host, guest.port, timeout=1):
            return
        time.sleep(0.1)
    guest.stop()
    console = guest.console.read_text(errors="replace")[-6000:] if guest.console.exists() else ""
    raise RuntimeError(f"nfsd guest {guest.name} at {guest.host} did not come up; end of its console:\n{console}")


@contextlib.contextmanager
def nfsd_lab(guests=1, rate=None, size=DEFAULT_SIZE, kernel=KERNEL, ssc=False, ksmbd=False, sectypes=None):
    """Yield an NfsdLab of `guests` booted nfsd guests in one namespace.

    Each exports a fresh sparse xfs image of `size` bytes (reflink on) as
    /export, read-write, no root squash. rate shapes the namespace's link
    (tbf; one rate or a (down, up) pair, as for net.server_namespace).
    kernel is the Debian linux-image package to boot. ssc: guests can copy
    between each other (the first run builds nfsd, ~1.5 min). ksmbd: guests
    serve /export over SMB too, as share "xfs", and a tmpfs as share
    "tmpfs" (ksmbd-up.sh), to the Samba lab's user and password. sectypes:
    the flavours the exports take (names as in sec=; default AUTH_SYS alone);
    with a krb5 flavour among them a Samba AD DC (addc.py) at the bridge's
    address is the realm's KDC, holding each guest's nfs/ADDRESS, and the
    guests run rpc.svcgssd with those keys (krb5.py). Every qemu, the DC,
    the images, taps, bridge and namespace are gone on exit.
    """
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offloadfs-nfsd-", dir="/var/tmp")))
        ns = stack.enter_context(server_namespace(rate))
        taps = [f"labtap{i}" for i in range(guests)]
        make_bridge(ns, taps)
        subnet = ipaddress.ip_network(f"{ns.server_addr}/24", strict=False)
        addrs = [str(subnet[3 + i]) for i in range(guests)]
        realm = None
        if any(sec.startswith("krb5") for sec in sectypes or ()):
            from offloadfs.lab.addc import domain_controller  # only Kerberos labs need Samba's DC

            realm = stack.enter_context(domain_controller({}, ns, nfs_hosts=addrs))
        vmlinux, initramfs = guest_files(workdir, kernel, ssc, ksmbd, realm)
        started = []
        for i, (tap, addr) in enumerate(zip(taps, addrs)):
            name = f"nfsd{i}"
            image, console, commands = (workdir / f"{name}.{suffix}" for suffix in ("img", "console", "sock"))
            with open(image, "wb") as f:
                f.truncate(size)
            run_checked(*MKFS["xfs"], str(image))
            with open(workdir / f"{name}.out", "wb") as out:
                settings = {"hostname": name, "inter_copy": "Y" if ssc else "N"}
                if ksmbd:
                    settings.update(ksmbd="Y", smb_user=USER, smb_password=PASSWORD)
                if sectypes:
                    # The pseudo root takes every flavour, as exportfs makes it: the way to any export.
                    settings.update(sec=secinfo(sectypes), sec_root=secinfo(FLAVOURS))
                if realm:
                    # Principals act as the anonymous uid (krb5-up.sh): root, as the realm's user is on ganesha's.
                    settings.update(krb5="Y", anon=0)
                command = qemu_command(vmlinux, initramfs, addr, tap, image, console, commands, settings)
                process = ns.popen(*command, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
            guest = NfsdGuest(name, addr, PORT, EXPORT, image, console, commands, process)
            stack.callback(guest.stop)
            started.append(guest)
        # The guests boot in parallel; wait for all.
        for guest in started:
            wait_ready(guest)
        yield NfsdLab(ns, started, realm)
