#!/bin/sh
# unit_namespace.sh CMD [ARG...]: run CMD (as root) in a mount namespace set
# up as systemd sets one up for systemd/dsecd.service, for tests on hosts
# where systemd is not PID 1. Each run is a new namespace, as each start of
# the unit is. What it reproduces, directive by directive (systemd 252):
#
#   PrivateMounts=yes          a new mount namespace, a slave of the host's:
#                              host mounts show up in it, its own mounts do
#                              not leave it
#   ProtectSystem=full         /usr, /boot, /efi and /etc read-only
#   ProtectHome=read-only      /home, /root and /run/user read-only
#   ProtectProc=invisible      a procfs of its own with hidepid=invisible
#   ProtectKernelLogs=yes      /proc/kmsg and /dev/kmsg covered by a node
#                              nobody may open
#
# tests/unit/test_systemd_unit.py checks that these are the unit's
# mount-namespace directives. Not reproduced: the syscall filter of
# ProtectKernelLogs= (syslog(2)), which sandboxes' own filter denies too.
set -eu
exec unshare --mount --propagation slave -- sh -euc '
read_only() {
    [ -d "$1" ] || return 0
    mount --bind "$1" "$1"
    mount -o remount,bind,ro "$1"
}
for dir in /usr /boot /efi /etc /home /root /run/user; do
    read_only "$dir"
done
mount -t proc -o hidepid=invisible proc /proc
closed=$(mktemp)
chmod 000 "$closed"
mount --bind "$closed" /proc/kmsg
mount --bind "$closed" /dev/kmsg
rm -f "$closed"
exec "$@"
' unit_namespace "$@"
