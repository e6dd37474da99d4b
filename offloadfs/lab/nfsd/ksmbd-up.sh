#!/bin/busybox sh
# Starts ksmbd (ksmbd.py) serving /export as share "xfs" to $smb_user with
# $smb_password, both from the kernel command line (init.sh), and a tmpfs
# as share "tmpfs": no reflink there, so copies are copychunk. As in the
# Samba lab, files are made as root whoever logs in (force user).
# Leases and durable handles on (both off by default; durable handles can
# only be set for all shares); signing and encryption as the client asks.

set -e
# No file leases, so no NFS delegations: the tests' view of the export reads over NFS, and a
# delegation it held would make ksmbd's renames and unlinks fail (ksmbd does not wait for a
# delegation's recall: EACCES). ksmbd's own oplocks and leases are not file leases.
echo 0 > /proc/sys/fs/leases-enable
echo "root:x:0:0:root:/:/bin/sh
$smb_user:x:1000:1000::/:/bin/sh" > /etc/passwd
echo "root:x:0:
$smb_user:x:1000:" > /etc/group
cat > /etc/ksmbd/ksmbd.conf <<CONF
[global]
	netbios name = $hostname
	server signing = auto
	smb2 leases = yes
	durable handles = yes
[xfs]
	path = /export
	writeable = yes
	force user = root
	force group = root
	hide dot files = no
[tmpfs]
	path = /srv/tmpfs
	writeable = yes
	force user = root
	force group = root
CONF
mkdir -p /srv/tmpfs
mount -t tmpfs -o size=256m tmpfs /srv/tmpfs
ksmbd.adduser -a "$smb_user" -p "$smb_password" >/dev/null
ksmbd.mountd
# ksmbd.mountd forks; the kernel listens once it has passed the config.
i=0
while ! grep -q ":01BD " /proc/net/tcp /proc/net/tcp6 2>/dev/null; do
    i=$((i + 1))
    [ $i -gt 100 ] && exit 1
    sleep 0.1
done
