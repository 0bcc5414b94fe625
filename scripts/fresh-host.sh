#!/bin/bash
# Does the committed tree set up and work on a fresh Debian 12 host? A used
# machine (a developer's, CI's) already has the packages, so it cannot tell.
#
# Makes a clean Debian 12 root (debootstrap minbase, its tarball cached under
# /var/cache/dsecd/fresh-host), puts the committed tree (git archive HEAD) in
# it, binds /proc, /sys and /dev, copies in this machine's package settings
# (apt sources, CA bundle, pip configuration; pip's local wheel folders are
# bound read-only), then runs inside it, as a new user would:
#
#   bash scripts/setup.sh      installs and builds from nothing
#   dsec --help                the CLI and the native module load, and the
#                              Debian-packaged modules (bcc, nftables) are seen
#                              from the venv
#   pytest tests/unit          the unit tests pass
#
# Every mount and directory it made is removed on exit, failed or not. Logs:
# build/fresh-host/*.log (the tail of the failing one is shown). Root only.
#
#   bash scripts/fresh-host.sh        (or: make fresh-host)
set -euo pipefail

# In a mount namespace of its own with private propagation: none of its
# mounts (the root's /proc, /sys, /dev, pip's folders) can reach or unmount
# the host's, and all of them vanish with the namespace, even on kill -9.
if [[ -z ${DSECD_FRESH_HOST_NS:-} ]]; then
    [[ $(id -u) == 0 ]] || { echo "fresh-host: FAILED: must run as root (debootstrap, chroot, mounts)" >&2; exit 1; }
    DSECD_FRESH_HOST_NS=1 exec unshare --mount --propagation private bash "${BASH_SOURCE[0]}" "$@"
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=/var/cache/dsecd/fresh-host
BASE=$CACHE/bookworm-minbase.tar
LOGS=$REPO/build/fresh-host
SUITE=bookworm
T0=$SECONDS

say() { echo "fresh-host: $*"; }
die() { echo "fresh-host: FAILED: $*" >&2; exit 1; }

command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap (scripts/setup.sh does)"
git -C "$REPO" rev-parse --verify -q HEAD >/dev/null || die "$REPO is not a git checkout with a commit"

mkdir -p "$CACHE" "$LOGS"

# The Debian mirror this machine's apt uses (deb822 or one-line sources).
debian_mirror() {
    local uri
    uri=$({ grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources || true; } |
        awk '{print $2}' | grep -v -- '-security' | head -n 1)
    if [[ -z $uri ]]; then
        uri=$({ grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list || true; } |
            awk '{for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' | grep -v -- '-security' | head -n 1)
    fi
    [[ -n $uri ]] || die "no Debian mirror in /etc/apt/sources.list{,.d}: cannot debootstrap"
    echo "$uri"
}

# The minbase root as a tarball, made once: debootstrap takes minutes, an
# unpack seconds. Made under a temporary name and renamed, under a lock, so a
# cache file is always whole and two checks at once build it once.
make_base() {
    exec 8>"$CACHE/lock"
    flock 8
    if [[ -s $BASE ]]; then
        flock -u 8
        return 0
    fi
    local mirror tmp
    mirror=$(debian_mirror)
    tmp=$(mktemp -d /var/tmp/dsecd-debootstrap.XXXXXX)
    say "debootstrap --variant=minbase $SUITE (once; cached in $BASE)"
    if ! debootstrap --variant=minbase "$SUITE" "$tmp/root" "$mirror" >"$LOGS/debootstrap.log" 2>&1; then
        rm -rf --one-file-system "$tmp"
        tail -n 20 "$LOGS/debootstrap.log" >&2
        die "debootstrap from $mirror (log: $LOGS/debootstrap.log)"
    fi
    TARBALL=$(mktemp "$CACHE/base.XXXXXX")
    tar -C "$tmp/root" -cf "$TARBALL" . && mv "$TARBALL" "$BASE"
    rm -rf --one-file-system "$tmp"
    flock -u 8
}

ROOT=
TARBALL=
MOUNTS=()
cleanup() {
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount -R -l "${MOUNTS[i]}" 2>/dev/null || true
    done
    [[ -n $ROOT && -d $ROOT ]] && rm -rf --one-file-system "$ROOT"
    [[ -n $TARBALL ]] && rm -f "$TARBALL"
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bind_ro() {        # bind_ro DIR: the host's DIR, read-only, at the same path in the root
    mkdir -p "$ROOT$1"
    mount --bind "$1" "$ROOT$1" && MOUNTS+=("$ROOT$1")
    mount -o remount,bind,ro "$ROOT$1"
}

copy_in() {        # copy_in PATH: a host file or directory to the same path in the root
    mkdir -p "$ROOT$(dirname "$1")"
    cp -a "$1" "$ROOT$(dirname "$1")/"
}

# pip's settings of this machine (config files, and the local folders and
# files they name: find-links, file:// indexes, constraints) belong to a fresh
# machine of its kind; the project's own packages do not.
pip_settings() {
    local f
    for f in /etc/pip.conf /etc/xdg/pip /root/.config/pip /root/.pip; do
        [[ -e $f ]] && copy_in "$f"
    done
    local paths
    paths=$({ python3 -m pip config list 2>/dev/null || true; env | grep '^PIP_' || true; } |
        grep -o "\(file://\)\?/[^ '\"]*" | sed 's|^file://||' | sort -u)
    local p
    for p in $paths; do
        p=${p%/simple}; p=${p%/}
        if [[ -d $p ]]; then
            [[ -e $ROOT$p ]] || bind_ro "$p"
        elif [[ -f $p && ! -e $ROOT$p ]]; then
            copy_in "$p"
        fi
    done
}

# Package trust: apt sources and keys, the CA bundle, and the machine's own CAs
# (Debian's ca-certificates rebuilds the bundle from these when installed).
package_settings() {
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d /etc/apt/apt.conf.d /etc/ssl/certs/ca-certificates.crt \
        /usr/local/share/ca-certificates; do
        [[ -e $f ]] && copy_in "$f"
    done
    rm -f "$ROOT"/etc/apt/sources.list.d/*.disabled* 2>/dev/null || true
}

run_in_root() {    # run_in_root NAME COMMAND: run COMMAND in /src of the root, log to NAME.log
    local name=$1 cmd=$2 rc=0
    local env=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8)
    local v
    while IFS= read -r v; do env+=("$v"); done < <(env | grep -E '^(PIP_[A-Z_]*|SSL_CERT_(FILE|DIR)|REQUESTS_CA_BUNDLE)=' || true)
    local t=$SECONDS
    chroot "$ROOT" /usr/bin/env -i "${env[@]}" bash -c "cd /src && $cmd" >"$LOGS/$name.log" 2>&1 </dev/null || rc=$?
    if ((rc != 0)); then
        tail -n 25 "$LOGS/$name.log" >&2
        die "$name in the fresh root exited $rc: $cmd (log: $LOGS/$name.log)"
    fi
    say "$name ok ($((SECONDS - t))s)"
}

make_base
ROOT=$(mktemp -d /var/tmp/dsecd-fresh-host.XXXXXX)
tar -C "$ROOT" -xf "$BASE"
mkdir -p "$ROOT/src"
git -C "$REPO" archive HEAD | tar -x -C "$ROOT/src"
package_settings
pip_settings
mount -t proc proc "$ROOT/proc" && MOUNTS+=("$ROOT/proc")
mount --rbind /sys "$ROOT/sys" && MOUNTS+=("$ROOT/sys")
mount --rbind /dev "$ROOT/dev" && MOUNTS+=("$ROOT/dev")

say "root $ROOT ready ($((SECONDS - T0))s); running setup, the CLI and the unit tests in it"
run_in_root setup 'bash scripts/setup.sh'
# bcc (the BPF compile helper) and nftables (net.uplink) come from apt, not pip:
# the venv must see them (setup.sh makes it with the system site-packages).
run_in_root cli '.venv/bin/dsec --help >/dev/null && .venv/bin/python -c "import dsecd, dsecd.native, bcc, nftables"'
run_in_root unit '.venv/bin/pytest -q -p no:cacheprovider tests/unit'
say "$(tail -n 1 "$LOGS/unit.log")"
say "ok: setup, the CLI and the unit tests pass on a fresh Debian 12 root ($((SECONDS - T0))s)"
