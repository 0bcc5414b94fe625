"""Which accelerator microVMs use: KVM only where a real guest boots with it.

A one-instruction guest (features.probe_kvm's ioctl probe) runs on hosts
where no real kernel does: under PVM, QEMU's `-cpu host` aborts on an MSR the
host refuses, and other nested setups fail later in the boot. So KVM counts
only once the guest kernel and initramfs the sandboxes use boot under it to
the agent's first console line ("dsec-agent: booted"); otherwise microVMs
run under TCG, QEMU's emulator (slower, but everywhere).

The boot probe costs a few seconds, so its answer is cached in the guest
dir, keyed by the host's boot id, the QEMU binary and the guest build: a
reboot, a QEMU upgrade or a new guest probes again.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from .guestimg import GuestImage

MARKER = b"dsec-agent: booted"
BOOT_TIMEOUT_S = 30.0


def _cache_key(qemu: str, guest: GuestImage) -> str:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    st = os.stat(qemu)
    return hashlib.sha256(f"{boot_id}|{qemu}|{st.st_size}|{st.st_mtime_ns}|{guest.digest}".encode()).hexdigest()


def boot_probe(qemu: str, guest: GuestImage, cache_dir: Path, timeout: float = BOOT_TIMEOUT_S) -> tuple[bool, str]:
    """(True, detail) if the guest boots under KVM to the agent's marker; else (False, why)."""
    cache = Path(cache_dir) / "kvm-boot-probe.json"
    key = _cache_key(qemu, guest)
    try:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["ok"], saved["detail"] + " (cached for this boot)"
    except (OSError, ValueError, KeyError):
        pass
    ok, detail = _boot(qemu, guest, timeout)
    try:
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "ok": ok, "detail": detail}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return ok, detail


def _boot(qemu: str, guest: GuestImage, timeout: float) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="dsecd-kvm-probe-") as tmp:
        serial = Path(tmp) / "serial.log"
        argv = [qemu, "-nodefaults", "-nographic", "-no-user-config", "-no-reboot", "-machine", "q35",
                "-accel", "kvm", "-cpu", "host", "-m", "128M", "-kernel", guest.kernel, "-initrd", guest.initramfs,
                "-append", "console=ttyS0 panic=-1 quiet dsec.layers=0", "-serial", f"file:{serial}"]
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
        except OSError as err:
            return False, f"cannot run {qemu}: {err}"
        try:
            while time.monotonic() - t0 < timeout:
                if serial.exists() and MARKER in serial.read_bytes():
                    return True, f"a guest kernel booted under KVM to the agent in {time.monotonic() - t0:.1f}s"
                if proc.poll() is not None:
                    out = (proc.stdout.read() if proc.stdout else b"").decode(errors="replace").strip()
                    last = out.splitlines()[-1] if out else f"exit {proc.returncode}"
                    return False, f"QEMU with -accel kvm -cpu host exited before the guest booted: {last}"
                time.sleep(0.05)
            return False, f"no guest boot under KVM within {timeout:.0f}s"
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
