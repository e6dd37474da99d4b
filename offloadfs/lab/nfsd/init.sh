#!/bin/busybox sh
# PID 1 of the nfsd guest. Brings up eth0 and the xfs disk, loads nfsd and
# starts it (nfsd-up.sh). Settings come from the kernel command line as lab.NAME=VALUE.
# Prints OFFLOADFS-NFSD-READY on the console, or OFFLOADFS-NFSD-FAILED and
# powers off. Then runs the host's commands from ttyS1 (NfsdGuest.run).

/bin/busybox --install -s /bin
export PATH=/bin

fail() {
    dmesg | tail -n 40
    echo "OFFLOADFS-NFSD-FAILED: $*"
    poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

for arg in $(cat /proc/cmdline); do
    case $arg in
        lab.*=*) name=${arg%%=*}; eval "${name#lab.}=\${arg#*=}" ;;
    esac
done
# For nfsd-up and ksmbd-up, here and in the host's commands.
export addr threads hostname smb_user smb_password sec sec_root anon

# Modules in dependency order, as the host's build resolved it.
for ko in $(cat /lib/modules/order); do
    insmod /lib/modules/$ko || fail "insmod $ko"
done
# Where nfsd was built for inter-server copy: it then mounts the source server
# with the NFS client, whose client ID is made from the host name.
if [ "$inter_copy" = Y ]; then
    echo Y > /sys/module/nfsd/parameters/inter_copy_offload_enable || fail "inter_copy_offload_enable"
fi
hostname "$hostname"

ip link set lo up
ip addr add "$addr" dev eth0 || fail "address $addr"
ip link set eth0 up || fail "eth0 up"

# virtio-blk may register its disk after insmod returns.
i=0
while [ ! -b /dev/vda ]; do
    i=$((i + 1))
    [ $i -gt 100 ] && fail "no /dev/vda"
    sleep 0.1
done
mount -t xfs /dev/vda /export || fail "mount /export"

# Client tracking (the legacy kind, no nfsdcld) must work, or nfsd refuses
# to end its grace period early.
mkdir -p /var/lib/nfs/v4recovery
mount -t nfsd nfsd /proc/fs/nfsd || fail "mount nfsd"
cd /proc/fs/nfsd
echo "-2 -3 +4 -4.0 +4.1 +4.2" > versions || fail "versions"
echo "$max_block_size" > max_block_size || fail "max_block_size"
echo "$lease" > nfsv4leasetime || fail "lease time"
echo "$grace" > nfsv4gracetime || fail "grace time"

# RPCSEC_GSS (krb5.py): its daemon up before nfsd takes a request.
if [ "$krb5" = Y ]; then
    krb5-up || fail "krb5-up"
fi
nfsd-up || fail "nfsd-up"
# Nothing to reclaim in a fresh guest: serve OPENs at once.
echo Y > v4_end_grace || fail "v4_end_grace"
# The laundromat ends it a moment later.
i=0
while [ "$(cat v4_end_grace)" != Y ]; do
    i=$((i + 1))
    [ $i -gt 100 ] && fail "grace period did not end"
    sleep 0.1
done

if [ "$ksmbd" = Y ]; then
    ksmbd-up || fail "ksmbd-up"
fi

# The host's commands, a line each: TOKEN COMMAND. Raw mode: no echo, no
# line editing, no newline translation; clocal: no hangup when the host's
# socket closes.
stty -F /dev/ttyS1 raw -echo clocal || fail "stty ttyS1"
mkdir -p /tmp

echo "OFFLOADFS-NFSD-READY uptime $(cut -d" " -f1 /proc/uptime) s, versions $(cat versions)"
cd /export
while :; do
    while read -r token command; do
        echo "OFFLOADFS-BEGIN $token"
        sh -c "$command" </dev/null 2>&1
        echo "OFFLOADFS-END $token $?"
    done </dev/ttyS1 >/dev/ttyS1
done
