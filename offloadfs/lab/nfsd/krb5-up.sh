#!/bin/busybox sh
# Starts rpc.svcgssd (krb5.py) before nfsd serves: it accepts clients'
# RPCSEC_GSS contexts with /etc/krb5.keytab alone (-n: any key there, so
# nfs/ADDRESS whatever the guest's host name). It maps no principal to a
# uid (there is no idmapd.conf): each acts as the export's anonymous uid.

set -e
# /var/tmp: libkrb5's replay cache.
mkdir -p /tmp /var/tmp
/usr/sbin/rpc.svcgssd -f -n -v > /tmp/svcgssd.log 2>&1 &
pid=$!
# Serve no client before it holds the kernel's upcall channel open.
i=0
while ! ls -l /proc/$pid/fd 2>/dev/null | grep -q auth.rpcsec.init; do
    i=$((i + 1))
    [ $i -gt 100 ] && { cat /tmp/svcgssd.log; exit 1; }
    sleep 0.1
done
