#!/bin/bash
# Build a root filesystem with the host's python3 in DEST (default
# /var/cache/dsecd/rootfs-python, or rootfs-python-pip with --pip) and print
# DEST on stdout.
#
#   mkpyrootfs.sh [--pip] [DEST]
#
# The test images are busybox-based and have no Python; the FnCall tests and
# bench/burst.py need one for the zygote. This copies the busybox rootfs of
# scripts/mkrootfs.sh, the host's python3 binary, the shared libraries ldd
# names, and the stdlib (without its test suite, tkinter and idle). --pip
# also copies Debian's pip (python3-pip: its dependencies are vendored under
# pip/_vendor) to usr/lib/python3/dist-packages, which Debian's site.py puts
# on sys.path; nothing else of dist-packages comes along. Cached like
# mkrootfs.sh: a DEST made from the same python binary (and the same pip) is
# left alone; a new tree is built beside DEST and renamed into place.
set -euo pipefail

die() { echo "mkpyrootfs: $*" >&2; exit 1; }
PIP=
if [[ ${1:-} == --pip ]]; then
    PIP=/usr/lib/python3/dist-packages/pip
    shift
fi
DEST=${1:-/var/cache/dsecd/rootfs-python${PIP:+-pip}}
FORMAT=1
MARKER=etc/dsecd-pyrootfs

PY=$(readlink -f /usr/bin/python3) || die "no /usr/bin/python3 on the host"
VER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
STDLIB=/usr/lib/python$VER
[[ -d $STDLIB ]] || die "$STDLIB missing"
DEST=$(realpath -m -- "$DEST")
[[ $DEST != / ]] || die "refusing to use / as DEST"
want="format=$FORMAT python=$(sha256sum "$PY" | cut -d' ' -f1)"
if [[ -n $PIP ]]; then
    # The dist-info's RECORD lists every file of pip with its hash.
    record=$(compgen -G "$(dirname -- "$PIP")/pip-*.dist-info/RECORD" | head -n1) \
        || die "$PIP or its dist-info missing: apt-get install python3-pip"
    [[ -f $PIP/__init__.py ]] || die "$PIP missing: apt-get install python3-pip"
    want+=" pip=$(sha256sum "$record" | cut -d' ' -f1)"
fi
if [[ -f $DEST/$MARKER && $(<"$DEST/$MARKER") == "$want" ]]; then
    echo "$DEST"; exit 0
fi
if [[ -e $DEST && ! -f $DEST/$MARKER ]]; then
    die "$DEST exists and is not a rootfs made by this script"
fi

here=$(dirname -- "$(readlink -f -- "$0")")
mkdir -p -- "$(dirname -- "$DEST")"
tmp=$(mktemp -d -- "$DEST.tmp.XXXXXX")
trap 'rm -rf -- "$tmp"' EXIT
bb=$(bash "$here/mkrootfs.sh" "$tmp/bb")
cp -a "$bb/." "$tmp/root-new/" 2>/dev/null || { mkdir -p "$tmp/root-new"; cp -a "$bb/." "$tmp/root-new/"; }
rm -rf -- "$tmp/bb"
R=$tmp/root-new
rm -f "$R/etc/dsecd-rootfs"

# usr/bin is a link to ../bin in the busybox tree: the binary lands in bin/.
install -m 0755 "$PY" "$R/bin/python$VER"
ln -sf "python$VER" "$R/bin/python3"
ln -sf "python$VER" "$R/bin/python"
# Shared libraries at the paths the dynamic linker looks them up by.
while read -r lib; do
    [[ -n $lib ]] || continue
    mkdir -p "$R$(dirname -- "$lib")"
    cp -L "$lib" "$R$lib"
done < <(ldd "$PY" | grep -o '/[^ ]*' | sort -u)
# The stdlib, and the libraries its C extension modules link against.
mkdir -p "$R/usr/lib"
tar -C /usr/lib --exclude="python$VER/test" --exclude="python$VER/idlelib" \
    --exclude="python$VER/tkinter" --exclude="python$VER/ensurepip" --exclude="python$VER/lib2to3" \
    --exclude="python$VER/dist-packages" --exclude="python$VER/site-packages" \
    -cf - "python$VER" | tar -C "$R/usr/lib" -xf -
for so in "$R/usr/lib/python$VER"/lib-dynload/*.so; do
    while read -r lib; do
        [[ -n $lib && ! -e $R$lib ]] || continue
        mkdir -p "$R$(dirname -- "$lib")"
        cp -L "$lib" "$R$lib"
    done < <(ldd "$so" 2>/dev/null | grep -o '/[^ ]*' | sort -u)
done
if [[ -n $PIP ]]; then
    # With Debian's byte-code (__pycache__): pip starts without compiling itself.
    mkdir -p "$R$(dirname -- "$PIP")"
    cp -a "$PIP" "$(dirname -- "$record")" "$R$(dirname -- "$PIP")/"
fi
echo "$want" >"$R/$MARKER"
chmod 0755 "$R"

if [[ -e $DEST ]]; then
    old=$(mktemp -d -- "$DEST.old.XXXXXX")
    mv -T -- "$DEST" "$old/rootfs"
    rm -rf -- "$old"
fi
mv -T -- "$R" "$DEST" 2>/dev/null || [[ -f $DEST/$MARKER ]] || die "could not move the rootfs to $DEST"
echo "$DEST"
