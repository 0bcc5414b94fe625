#!/bin/sh
# unit_namespace.sh DIR CMD [ARG...]: run CMD (as root) in a mount
# namespace set up as systemd sets one up for systemd/dsecd.service, for
# tests on hosts where systemd is not PID 1. Each run is a new namespace, as
# each start of the unit is. What it reproduces, directive by directive
# (systemd 252):
#
#   PrivateMounts=yes          a new mount namespace, a slave of the host's
#                              made shared again (MountFlags= default): host
#                              mounts show up in it, its own never leave it
#   ProtectSystem=full         /usr, /boot, /efi and /etc read-only, with
#                              their submounts
#   ProtectHome=read-only      /home, /root and /run/user read-only, same
#   PrivateTmp=yes             a /tmp and /var/tmp of its own (systemd binds
#                              a directory of the host's there, as here)
#   ProtectProc=invisible      a procfs of its own with hidepid=invisible
#   ProtectKernelLogs=yes      /proc/kmsg and /dev/kmsg covered by a
#                              device node 0:0, which nobody may open
#
# DIR, a directory under /tmp (a test daemon's socket, config and state,
# which the unit keeps in /run and /var/lib), stays visible at its path in
# the private /tmp. The private /tmp and /var/tmp are made in DIR, so
# removing DIR removes them.
#
# tests/unit/test_systemd_unit.py checks that these are the unit's
# mount-namespace directives. Not reproduced: the syscall filter of
# ProtectKernelLogs= (syslog(2)), which sandboxes' own filter denies too.
set -eu
keep=$1
shift
case $keep in
    /tmp/?*) ;;
    *) echo "unit_namespace.sh: DIR must be a directory under /tmp, not '$keep'" >&2; exit 2 ;;
esac
exec unshare --mount --propagation slave -- sh -euc '
keep=$1
shift
read_only() {      # the tree at $1, its submounts too
    [ -d "$1" ] || return 0
    mount --rbind "$1" "$1"
    for m in $(awk -v top="$1" '\''$5 == top || index($5, top "/") == 1 { print $5 }'\'' /proc/self/mountinfo); do
        mount -o remount,bind,ro "$m"
    done
}
for dir in /usr /boot /efi /etc /home /root /run/user; do
    read_only "$dir"
done
private=$(mktemp -d "$keep/private-tmp.XXXXXX")
mkdir -m 1777 "$private/tmp" "$private/var-tmp"
mkdir -p "$private/tmp/${keep#/tmp/}"
mount --bind "$keep" "$private/tmp/${keep#/tmp/}"
mount --rbind "$private/tmp" /tmp
mount --bind "$private/var-tmp" /var/tmp
mount -t proc -o hidepid=invisible proc /proc
closed=$(mktemp -u)
mknod -m 000 "$closed" c 0 0
mount --bind "$closed" /proc/kmsg
mount --bind "$closed" /dev/kmsg
rm -f "$closed"
mount --make-rshared /
exec "$@"
' unit_namespace "$keep" "$@"
