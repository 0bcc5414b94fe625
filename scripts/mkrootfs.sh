#!/bin/bash
# Build a minimal busybox root filesystem in DEST (default
# /var/cache/dsecd/rootfs-busybox) and print DEST on stdout.
#
# It is the smallest image the benchmarks and integration tests can import:
# one static busybox (no libc needed inside), its applets as symlinks, root and
# nobody in etc/passwd and etc/group, and the empty mount points a sandbox
# needs. The result is cached: a DEST that already holds the rootfs of the
# same busybox binary is left alone, so a second call costs a few ms.
#
# The tree is built next to DEST and renamed into place, so a DEST that exists
# is always complete, and two concurrent calls both end with a valid DEST.
set -euo pipefail

DEST=${1:-/var/cache/dsecd/rootfs-busybox}
BUSYBOX=/bin/busybox        # from Debian's busybox-static
FORMAT=1                    # bump when the layout below changes
MARKER=etc/dsecd-rootfs     # says which busybox the tree was made from

die() { echo "mkrootfs: $*" >&2; exit 1; }

[[ -x $BUSYBOX ]] || die "$BUSYBOX missing: apt-get install busybox-static (or run scripts/setup.sh)"
# A dynamic busybox (Debian's "busybox" package) would need a libc inside the
# rootfs; ldd answers "not a dynamic executable" (exit 1) for a static one.
if ldd "$BUSYBOX" >/dev/null 2>&1; then
    die "$BUSYBOX is dynamically linked: apt-get install busybox-static"
fi

DEST=$(realpath -m -- "$DEST")
[[ $DEST != / ]] || die "refusing to use / as DEST"
want="format=$FORMAT busybox=$(sha256sum "$BUSYBOX" | cut -d' ' -f1)"

is_current() { [[ -f $1/$MARKER && $(<"$1/$MARKER") == "$want" ]]; }
is_ours() { [[ -f $1/$MARKER ]]; }
is_empty_dir() { [[ -d $1 && -z $(ls -A -- "$1") ]]; }

if is_current "$DEST"; then
    echo "$DEST"
    exit 0
fi
if [[ -e $DEST ]] && ! is_ours "$DEST" && ! is_empty_dir "$DEST"; then
    die "$DEST exists and is not a rootfs made by this script; remove it or pick another DEST"
fi

mkdir -p -- "$(dirname -- "$DEST")"
tmp=$(mktemp -d -- "$DEST.tmp.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT
chmod 0755 "$tmp"

# Layout: everything lives in bin/, and the other usual directories point to
# it, so both /bin/sh and /usr/bin/env resolve. Links are relative so the tree
# also reads right from the host side.
mkdir -p "$tmp"/{bin,etc,usr,proc,dev,sys,work}
install -d -m 1777 "$tmp/tmp"
install -d -m 0700 "$tmp/root"
ln -s bin "$tmp/sbin"
ln -s ../bin "$tmp/usr/bin"
ln -s ../bin "$tmp/usr/sbin"

install -m 0755 "$BUSYBOX" "$tmp/bin/busybox"
while read -r applet; do
    [[ $applet == busybox || $applet == */* ]] && continue
    ln -s busybox "$tmp/bin/$applet"
done < <("$BUSYBOX" --list)

cat >"$tmp/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$tmp/etc/group" <<'EOF'
root:x:0:
nobody:x:65534:
EOF
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$tmp/etc/hosts"
chmod 0644 "$tmp"/etc/{passwd,group,hosts}
echo "$want" >"$tmp/$MARKER"

# Swap into place. rename(2) replaces an empty directory, and a stale tree of
# ours is moved aside first; if another run won the race, its tree is as good.
if [[ -e $DEST ]] && ! is_empty_dir "$DEST"; then
    old=$(mktemp -d -- "$DEST.old.XXXXXX")
    mv -T -- "$DEST" "$old/rootfs"
    rm -rf -- "$old"
fi
if ! mv -T -- "$tmp" "$DEST" 2>/dev/null; then
    is_current "$DEST" || die "could not move the new rootfs to $DEST"
fi
echo "$DEST"
