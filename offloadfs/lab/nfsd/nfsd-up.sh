#!/bin/busybox sh
# Fills the export caches mountd would fill (there is no mountd: v4 needs
# none) and starts nfsd's threads: at boot (init.sh), and again after a test
# stopped nfsd (echo 0 > /proc/fs/nfsd/threads), which flushes the caches:
# without their entries every request would be answered DELAY for good.
# Takes $addr, $threads, $sec, $sec_root and $anon from init.sh's environment: $sec and
# $sec_root, where set, list the flavours /export and the pseudo root take (pseudo-flavour
# numbers, comma-separated; krb5.py), else nfsd's default, AUTH_SYS; $anon, where set, is
# the exports' anonymous uid and gid.

set -e
# Caches as in fs/nfsd/export.c and net/sunrpc/svcauth_unix.c, entries that
# never expire: every address of the /24 belongs to the "lab" domain (so the
# host and the other guests are clients), which sees / as the v4 pseudo root
# (fsid 0) and /export as a read-write export (fsid 1) without root squash.
# Export flags: 0x1 read-only, 0x2 insecure, 0x400 no_subtree_check, 0x2000 fsid,
# 0x10000 v4root (shows only the way to exports).
forever=2147483647
anon=${anon:-65534}
prefix=${addr%.*}
for i in $(seq 1 254); do
    echo "nfsd $prefix.$i $forever lab" > /proc/net/rpc/auth.unix.ip/channel
done
# secinfo: the number of flavours, then each with its flags (the export's own: only
# ro/squash/insecure may differ).
secinfo() {
    [ -n "$2" ] || return 0
    set -- "$1" $(echo "$2" | tr , " ")
    flags=$1
    shift
    echo -n " secinfo $#"
    for flavour; do echo -n " $flavour $flags"; done
}
echo "lab / $forever $((0x12403)) $anon $anon 0$(secinfo $((0x12403)) "$sec_root")" > /proc/net/rpc/nfsd.export/channel
echo "lab /export $forever $((0x2402)) $anon $anon 1$(secinfo $((0x2402)) "$sec")" > /proc/net/rpc/nfsd.export/channel
# Keys: client, fsid type 1 (a 4-byte fsid number, little-endian, hex), expiry, path.
printf 'lab 1 \\x00000000 %s /\n' $forever > /proc/net/rpc/nfsd.fh/channel
printf 'lab 1 \\x01000000 %s /export\n' $forever > /proc/net/rpc/nfsd.fh/channel

echo "$threads" > /proc/fs/nfsd/threads
