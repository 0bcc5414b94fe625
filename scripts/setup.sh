#!/bin/bash
# Set up this host for dsecd development, tests and benchmarks: Debian 12, as
# root, from nothing (nothing installed by hand is assumed).
#
#   1. Debian packages: compilers and static libc (dsec-init is static),
#      libfuse3/libseccomp headers (csrc/), bcc for Python (eBPF), kernel
#      headers (bcc compiles bpf/*.c against them), nftables and its Python
#      bindings (egress NAT, published ports), the runtimes we benchmark
#      against (bubblewrap, crun, buildah), busybox-static (test rootfs), erofs-utils,
#      dnspython (the sandboxes' resolver) and dnsmasq-base (the tests' upstream
#      resolver; -base: the binary without a system service), python3-urllib3
#      (the registry client of `dsec image pull`), skopeo (pushes the pull
#      tests' images; the pull bench's peer), python3-zstandard (zstd
#      layers), python3-rich (pulls, Dockerfile builds, `dsec top`), docker-registry and apache2-utils
#      (the pull tests' registry on loopback and its htpasswd; the package's
#      service is not used: the tests start their own registry),
#      prometheus-client (the metrics endpoint), qemu-system-x86 for the
#      microVM backend (DSECD_SETUP_MICROVM=0: not), and OpenSSH (the SDK's
#      ssh:// transport runs `ssh`; the fleet tests run a private sshd per
#      simulated host). Debian has no openssh-server without its system
#      service, so an install made here is kept from starting it
#      (no_system_sshd below). GlusterFS (server and FUSE client): the shared
#      image store tests run their own glusterd, brick and mounts
#      (tests/integration/gluster_kit.py); the system glusterd is never used
#      (no_system_glusterd below).
#   2. Kernel headers where bcc looks for them: /lib/modules/$(uname -r)/build
#      and .../source. A kernel Debian has no headers package for gets the
#      newest Debian headers, said on stderr.
#   3. The venv .venv with the system site-packages (Debian's bcc is not on
#      PyPI), and the project installed in it, editable, with its test extras.
#
#   With DSECD_SETUP_RAY=1, also the optional extra `ray` (pyproject.toml:
#      Ray, for dsecd.ray and tests/integration/test_ray.py, which skip
#      without it). Off by default: Ray is large and only dsecd.ray needs
#      it; scripts/test.sh turns it on, so the suite runs the Ray tests.
#
#   4. The microVM guest (scripts/mkguest.sh): Debian's cloud kernel package
#      by apt-get download (never installed as the host's kernel) and the
#      generated initramfs, in /var/cache/dsecd/guest.
#
# Idempotent and quick when nothing changed: packages are checked with
# dpkg-query (apt-get update runs only when something is missing), and the pip
# install is skipped while the build inputs hash to the stamp of the last one.
# Quiet: details go to build/setup.log, whose tail is shown on failure.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$REPO/.venv
PY=$VENV/bin/python
LOG=$REPO/build/setup.log
STAMP=$VENV/.dsecd-setup-stamp
ARCH=$(dpkg --print-architecture 2>/dev/null || echo amd64)
KREL=$(uname -r)

PACKAGES=(
    build-essential pkg-config libc6-dev       # C layer
    musl-tools                                 # static dsec-init (setup.py compile_init: no CPUID probes at start)
    libfuse3-dev fuse3 libseccomp-dev          # the FUSE pager, seccomp filters
    libssl-dev                                 # libcrypto: the pager checks chunks (sha256)
    python3-venv python3-dev                   # the venv; headers for the cffi build
    python3-bpfcc "linux-headers-$ARCH"        # bcc and headers to compile bpf/*.c
    nftables python3-nftables                  # net.uplink NAT, published ports (dsecd/net/nat.py)
    busybox-static bubblewrap crun             # test rootfs; peers in bench/peers.py
    buildah                                    # the Dockerfile-build peer in bench/build.py
    erofs-utils iproute2 util-linux debootstrap
    procps                                     # /bin/kill: the unit's ExecReload= (systemctl reload)
    python3-dnspython dnsmasq-base             # the sandboxes' resolver; the tests' upstream
    python3-urllib3                            # the registry client of `dsec image pull` (dsecd/fs/registry.py)
    skopeo python3-zstandard python3-rich      # image pull: test pushes and the bench's peer, zstd layers, progress bars
    docker-registry apache2-utils              # the pull tests' local registry and its htpasswd file
    python3-prometheus-client                  # the metrics endpoint (dsecd/metrics.py)
    openssh-client openssh-server              # ssh:// transport; the fleet tests' sshd per host
    glusterfs-server glusterfs-client          # the shared-store tests' own volume (gluster_kit.py)
)
# The microVM backend: QEMU (direct kernel boot: no firmware package needed).
# DSECD_SETUP_MICROVM=0 leaves it out (the microVM tests then skip).
if [[ ${DSECD_SETUP_MICROVM:-1} != 0 ]]; then
    PACKAGES+=(qemu-system-x86)
fi

export DEBIAN_FRONTEND=noninteractive PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

T0=$SECONDS
mkdir -p "$(dirname "$LOG")"
# One set-up at a time (a developer's `make test` beside CI, say).
exec 9>"$(dirname "$LOG")/setup.lock"
flock 9
: >"$LOG"

say() { echo "setup: $*"; }
warn() { echo "setup: $*" >&2; }

# Any command that fails outside run() says where, instead of a silent exit.
on_error() {
    ((BASH_SUBSHELL == 0)) || return 0       # said once, by the shell that ends
    warn "FAILED (exit $1) at scripts/setup.sh line $2: $3"
    warn "details may be in $LOG; fix the cause and run scripts/setup.sh again"
}
set -E
trap 'on_error $? $LINENO "$BASH_COMMAND"' ERR

# A command whose failure is worth a warning, not a stop.
soft() {
    echo "+ $*" >>"$LOG"
    "$@" >>"$LOG" 2>&1 </dev/null || warn "'$*' failed (details in $LOG); continuing"
}

# Run a command with its output in the log; on failure show the log's tail.
run() {
    echo "+ $*" >>"$LOG"
    if ! "$@" >>"$LOG" 2>&1 </dev/null; then
        warn "FAILED: $*"
        warn "---- last lines of $LOG ----"
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

require_root() {
    if [[ $(id -u) != 0 ]]; then
        warn "must run as root (installs packages, links kernel headers)"
        exit 1
    fi
}

# Names in PACKAGES that dpkg does not list as installed ("ii"). dpkg-query
# exits 1 when it has never heard of a name, as on a fresh host: that is an
# answer (the name is missing), not a failure.
missing_packages() {
    local installed p
    installed=$({ dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null || true; } |
        awk '$2 == "ii" {print $1}')
    for p in "${PACKAGES[@]}"; do
        grep -qxF -- "$p" <<<"$installed" || echo "$p"
    done
}

install_packages() {
    local missing=() list updated=
    # Not `mapfile < <(...)`: a failure inside a process substitution is lost.
    list=$(missing_packages)
    [[ -z $list ]] || mapfile -t missing <<<"$list"
    if ((${#missing[@]})); then
        say "apt: updating the package lists"
        run apt-get update
        updated=1
    fi
    # A Debian kernel has a headers package of its own: prefer it to the link
    # below. Asked only while the headers are missing (the lists are fresh then
    # on a new machine).
    if [[ ! -d /lib/modules/$KREL/build ]] && apt-cache show "linux-headers-$KREL" >/dev/null 2>&1; then
        missing+=("linux-headers-$KREL")
    fi
    ((${#missing[@]})) || return 0
    [[ -n $updated ]] || run apt-get update
    say "apt: installing ${missing[*]}"
    local sshd_new= glusterd_new=
    printf '%s\n' "${missing[@]}" | grep -qx openssh-server && sshd_new=1
    printf '%s\n' "${missing[@]}" | grep -qx glusterfs-server && glusterd_new=1
    [[ -z $sshd_new$glusterd_new ]] || hold_service_starts
    run apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=120 "${missing[@]}"
    [[ -z $sshd_new ]] || no_system_sshd
    [[ -z $glusterd_new ]] || no_system_glusterd
    release_service_starts
}

# openssh-server's install starts sshd and enables it at boot (systemd, or
# sysvinit links; in a chroot invoke-rc.d would start it in the host's
# network). The tests start their own sshd, by hand, in their own network
# namespaces; a host must not get a listening system sshd from a test set-up.
# invoke-rc.d and deb-systemd-invoke start nothing while /usr/sbin/policy-rc.d
# exits 101: one is put there for the install unless the host has its own
# (an operator's policy is left as it is), and removed after it.
POLICY_RC_D=/usr/sbin/policy-rc.d
POLICY_MARK="# scripts/setup.sh of dsecd: no service starts during its apt-get install"
hold_service_starts() {
    [[ -e $POLICY_RC_D ]] && return 0
    printf '#!/bin/sh\n%s\nexit 101\n' "$POLICY_MARK" >"$POLICY_RC_D"
    chmod 755 "$POLICY_RC_D"
    trap release_service_starts EXIT
}

release_service_starts() {
    if [[ -f $POLICY_RC_D ]] && grep -qxF "$POLICY_MARK" "$POLICY_RC_D"; then
        rm -f "$POLICY_RC_D"
    fi
}

# Only after this script installed openssh-server (an sshd the host had
# before is the host's business): the unit is disabled (no start at boot)
# and /etc/ssh/sshd_not_to_be_run, which Debian's ssh.service and init script
# honour, keeps anything else from starting it. Remove that file to run a
# system sshd here.
no_system_sshd() {
    release_service_starts
    echo "installed by dsecd's scripts/setup.sh, whose fleet tests run their own sshd" \
        >/etc/ssh/sshd_not_to_be_run
    if command -v systemctl >/dev/null; then
        soft systemctl disable ssh.service ssh.socket
    elif command -v deb-systemd-helper >/dev/null; then
        soft deb-systemd-helper disable ssh.service
    fi
    if command -v update-rc.d >/dev/null && [[ -e /etc/init.d/ssh ]]; then
        soft update-rc.d ssh disable
    fi
    # A host whose own policy-rc.d let the install start sshd: that sshd was
    # not running before (openssh-server was not installed), so stop it.
    local pid
    pid=$(cat /run/sshd.pid 2>/dev/null || true)
    if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
        warn "the install started the system sshd (pid $pid; this host's $POLICY_RC_D allowed it): stopping it"
        kill "$pid" || true
    fi
    say "openssh-server installed, its system service disabled (/etc/ssh/sshd_not_to_be_run)"
}

# Debian's glusterfs-server (bookworm, 10.3) neither enables nor starts
# glusterd on a fresh install (its postinst enables the unit only if it was
# enabled before, and restarts it only on upgrade, if running); the
# policy-rc.d above covers a package that would. Only after this script
# installed it: the unit is disabled all the same, and a glusterd that runs
# now, which was not installed before, is one the install started: stopped by
# the pid in its pidfile. The tests start their own glusterd with private
# state (gluster_kit.py) and never use /var/lib/glusterd.
no_system_glusterd() {
    if command -v systemctl >/dev/null; then
        soft systemctl disable glusterd.service glustereventsd.service
    fi
    local pidfile pid
    for pidfile in /run/glusterd.pid /var/run/glusterd.pid; do
        pid=$(cat "$pidfile" 2>/dev/null || true)
        if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
            warn "the install started the system glusterd (pid $pid; this host's $POLICY_RC_D allowed it): stopping it"
            kill "$pid" || true
            break
        fi
    done
    say "glusterfs-server installed, its system service disabled (the tests run their own glusterd)"
}

# bcc compiles against /lib/modules/$KREL/build (generated headers, .config) and
# .../source (the rest) when both exist, and runs clang from .../source. Debian
# splits its headers the same way: linux-headers-<ver>-$ARCH (build) and
# linux-headers-<ver>-common (source), so link to the newest such pair.
link_kernel_headers() {
    local mod=/lib/modules/$KREL
    [[ -d $mod/build ]] && return 0
    # bcc unpacks the running kernel's own headers from here (CONFIG_IKHEADERS)
    # when /lib/modules has none: better than another version's.
    [[ -f /sys/kernel/kheaders.tar.xz ]] && return 0
    local build common
    build=$({ ls -d /usr/src/linux-headers-*-"$ARCH" 2>/dev/null || true; } | sort -V | tail -n 1)
    if [[ -z $build ]]; then
        warn "FAILED: no kernel headers for $KREL in /lib/modules/$KREL/build, and none in" \
            "/usr/src/linux-headers-*-$ARCH to link there; bcc needs them to compile bpf/*.c." \
            "Install them (apt-get install linux-headers-$ARCH) and run this again."
        exit 1
    fi
    common=${build%-"$ARCH"}-common
    [[ -d $common ]] || common=$build
    mkdir -p "$mod"
    local name target
    for name in build source; do
        target=$build
        [[ $name == source ]] && target=$common
        # Replace only a dangling link (headers package upgraded), never a tree.
        [[ -L $mod/$name ]] && rm -f "$mod/$name"
        [[ -e $mod/$name ]] || ln -s "$target" "$mod/$name"
    done
    warn "no Debian headers for kernel $KREL: linked $mod/build -> $build," \
        "$mod/source -> $common (bcc compiles against these; struct layouts may differ)"
}

venv_ok() {
    [[ -x $PY ]] && grep -qx 'include-system-site-packages = true' "$VENV/pyvenv.cfg" &&
        grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg" && "$PY" -c '' 2>/dev/null
}

make_venv() {
    venv_ok && return 0
    say "venv: creating $VENV"
    run /usr/bin/python3 -m venv --clear --system-site-packages "$VENV"
}

# Hash of what the install builds from: metadata and the C sources. Python
# sources need no reinstall (editable install).
build_inputs_hash() {
    (
        cd "$REPO"
        "$PY" -c 'import sys; print(sys.version)'
        local inputs=() p
        for p in pyproject.toml setup.py setup.cfg csrc dsecd/_native_build.py; do
            [[ -e $p ]] && inputs+=("$p")
        done
        find "${inputs[@]}" -type f | LC_ALL=C sort | xargs -r sha256sum
    ) | sha256sum | cut -d' ' -f1
}

# What an up-to-date install can import; a `git clean` of the build outputs
# fails here and triggers a reinstall.
import_check() {
    local code='import bcc, dsecd'
    [[ -f $REPO/dsecd/_native_build.py ]] && code+=', dsecd._native'
    echo "$code"
}

install_ok() {
    [[ -f $REPO/csrc/init.c && ! -x $REPO/dsecd/libexec/dsec-init ]] && return 1
    [[ -d $REPO/csrc/pager && ! -x $REPO/dsecd/libexec/dsec-pager ]] && return 1
    [[ -f $REPO/csrc/guest/agent.c && ! -x $REPO/dsecd/libexec/dsec-guest-agent ]] && return 1
    (cd / && "$PY" -c "$(import_check)") >/dev/null 2>&1
}

install_project() {
    local want
    want=$(build_inputs_hash)
    if [[ -f $STAMP && $(<"$STAMP") == "$want" ]] && install_ok; then
        return 0
    fi
    say "pip: installing dsecd[test] (editable)"
    rm -f "$STAMP"
    # No build isolation: the build uses the venv's setuptools/wheel/cffi
    # (the same cffi as at run time) instead of fetching them for every build.
    run "$PY" -m pip install 'setuptools>=64' wheel 'cffi>=1.15'
    run "$PY" -m pip install --no-build-isolation -e "$REPO[test]"
    echo "$want" >"$STAMP"
}

# The `ray` extra's requirements, as pyproject.toml lists them, when Ray
# does not import yet.
install_ray() {
    (cd / && "$PY" -c 'import ray') >/dev/null 2>&1 && return 0
    local reqs
    reqs=$("$PY" -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["ray"])' \
        "$REPO/pyproject.toml")
    say "pip: installing the ray extra ($reqs)"
    # shellcheck disable=SC2086  # one word per requirement
    run "$PY" -m pip install $reqs
}

check_imports() {
    if ! (cd / && "$PY" -c 'import bcc') >>"$LOG" 2>&1; then
        warn "FAILED: 'import bcc' in $VENV (python3-bpfcc, --system-site-packages)"
        tail -n 20 "$LOG" >&2
        exit 1
    fi
    if ! install_ok; then
        warn "FAILED: the installed project does not import ($(import_check)):"
        (cd / && "$PY" -c "$(import_check)") >&2 || true
        exit 1
    fi
}

require_root
install_packages
link_kernel_headers
make_venv
install_project
if [[ ${DSECD_SETUP_RAY:-0} != 0 ]]; then
    install_ray
fi
check_imports
# The busybox rootfs the integration tests and benchmarks import (cached).
run bash "$REPO/scripts/mkrootfs.sh"
# The microVM guest: the cloud kernel by apt-get download, the initramfs built
# (both cached in /var/cache/dsecd/guest, or in $DSECD_GUEST_DIR: a checkout
# whose guest agent differs from the one daemons of other checkouts on this
# host boot builds its guest there; its tests and benchmarks then use it).
if [[ ${DSECD_SETUP_MICROVM:-1} != 0 ]]; then
    run bash "$REPO/scripts/mkguest.sh" "${DSECD_GUEST_DIR:-/var/cache/dsecd/guest}"
fi
say "ok ($((SECONDS - T0))s)"
