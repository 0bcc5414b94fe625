#!/bin/bash
# The main job on a fresh Debian 12 host (root): install what is missing,
# build, start dsecd on its embedded defaults (socket /run/dsecd/dsecd.sock,
# state /var/lib/dsecd) unless one is already running, and drive a real
# workload through it (scripts/demo.py). The daemon keeps running afterwards,
# like the service it is; `dsec` and `dsecd` are linked into /usr/local/bin.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
bash scripts/setup.sh

for tool in dsec dsecd; do
    ln -sfn "$REPO/.venv/bin/$tool" "/usr/local/bin/$tool"
done
# Where systemd/dsecd.service's Documentation= points.
install -D -m 0644 README.md /usr/local/share/doc/dsecd/README.md

ROOTFS=$(bash scripts/mkrootfs.sh)
SOCK=/run/dsecd/dsecd.sock
LOG=/var/log/dsecd.log

if dsec --socket "$SOCK" info >/dev/null 2>&1; then
    echo "demo: using the dsecd already listening on $SOCK"
else
    echo "demo: starting dsecd (log: $LOG)"
    setsid dsecd >>"$LOG" 2>&1 </dev/null &
    for _ in $(seq 200); do
        dsec --socket "$SOCK" info >/dev/null 2>&1 && break
        sleep 0.05
    done
    dsec --socket "$SOCK" info >/dev/null || { tail -20 "$LOG"; exit 1; }
    echo "demo: dsecd running, pid $!"
fi

exec "$REPO/.venv/bin/python" scripts/demo.py --socket "$SOCK" --rootfs "$ROOTFS"
