#!/bin/bash
# Fetch the microVM guest kernel and build its initramfs into GUEST_DIR
# (default /var/cache/dsecd/guest); print the description of the build (its
# guest-<agent hash>.json, also copied to guest.json).
#
# The kernel is Debian's cloud kernel, fetched with `apt-get download` (the
# package file only: it is never installed as this host's kernel) and
# unpacked with dpkg-deb by dsecd/backends/microvm/guestimg.py, which also
# builds the initramfs (the guest agent and the kernel modules it loads),
# reproducibly and cached by content hash. Nothing comes from outside apt.
#
# Quick when cached: a package already in GUEST_DIR is used as it is (no apt
# query), and an initramfs of the same inputs is not rebuilt. Delete the
# package file to fetch the current one again.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GUEST_DIR=${1:-/var/cache/dsecd/guest}
PY=${PY:-$REPO/.venv/bin/python}
META=linux-image-cloud-amd64     # Debian's metapackage: it depends on the current cloud kernel

die() { echo "mkguest: $*" >&2; exit 1; }

mkdir -p "$GUEST_DIR"
if ! compgen -G "$GUEST_DIR/linux-image-*-cloud-amd64_*.deb" >/dev/null; then
    pkg=$(apt-cache depends "$META" 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
    [[ -n $pkg ]] || die "apt knows no $META (run apt-get update; Debian's main archive has it)"
    tmp=$(mktemp -d "$GUEST_DIR/.download-XXXXXX")
    # apt's sandbox user cannot write root's temp dir: let it.
    chmod 755 "$tmp"
    (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1) || { rm -rf "$tmp"; die "apt-get download $pkg failed"; }
    mv "$tmp"/*.deb "$GUEST_DIR"/
    rm -rf "$tmp"
fi
"$PY" -m dsecd.backends.microvm.guestimg build --dir "$GUEST_DIR"
