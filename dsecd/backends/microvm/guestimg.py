"""The guest kernel and initramfs every microVM boots.

The kernel is Debian's cloud kernel (linux-image-*-cloud-amd64: virtio,
no hardware drivers), fetched by `apt-get download` into the guest dir by
scripts/mkguest.sh and unpacked here with `dpkg-deb -x`; it is never
installed as the host's kernel. The initramfs is generated: the static
guest agent (csrc/guest/agent.c) as /init, the kernel modules it needs
(MODULES and what they depend on, read from each module's .modinfo, since
the package ships no modules.dep) under /modules, and /modules.order,
dependencies first, which the agent loads with finit_module.

The build is reproducible (sorted entries, mtime 0, owner root) and cached
by content: initramfs-<hash>.cpio, where the hash covers FORMAT, the agent
binary and the kernel package. `guest-<agent hash>.json` in the guest dir
names the kernel and initramfs built for one agent binary, and the daemon
reads the one of its own agent (load()): checkouts of different agents
(a CI clone beside a work tree) share the dir without booting each other's.
`guest.json` names the newest build, for people.

    python -m dsecd.backends.microvm.guestimg build [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import pinned

GUEST_DIR = Path("/var/cache/dsecd/guest")
FORMAT = 1       # bump when the initramfs layout changes: every cache entry is rebuilt
KEEP_BUILDS = 4  # agents whose guest stays built (checkouts sharing the guest dir)
# What the agent needs: the PCI transport, the agent's port, layers on
# virtio-pmem (nd_pmem makes /dev/pmemN), EROFS and overlay, the balloon,
# and the NIC for networking.
MODULES = ("virtio_pci", "virtio_console", "virtio_pmem", "nd_pmem", "erofs", "overlay", "virtio_balloon",
           "virtio_net")


class GuestImageError(Exception):
    """The guest kernel or initramfs is missing or cannot be built; the message says what to run."""


@dataclass(frozen=True)
class GuestImage:
    kernel: str            # vmlinuz path
    initramfs: str         # cpio path
    version: str           # the guest kernel's release, e.g. 6.1.0-57-cloud-amd64
    digest: str            # sha256 of what the initramfs was built from (templates key on it)

    def to_dict(self) -> dict:
        return asdict(self)


def agent_binary_path() -> Path:
    """The agent this daemon speaks to: in its copy of its code (dsecd/pinned.py)."""
    return pinned.libexec("dsec-guest-agent")


def _meta_for(guest_dir: Path, agent: bytes) -> Path:
    """Where the guest built for this agent binary is described."""
    return Path(guest_dir) / f"guest-{hashlib.sha256(agent).hexdigest()[:16]}.json"


def load(guest_dir: Path = GUEST_DIR, agent_path: Path | None = None) -> GuestImage:
    """The guest built for this install's agent binary, checked to exist;
    GuestImageError says how to build it."""
    agent_path = agent_path or agent_binary_path()
    try:
        meta = _meta_for(Path(guest_dir), agent_path.read_bytes())
    except FileNotFoundError:
        raise GuestImageError(f"{agent_path} missing: build it with scripts/setup.sh (pip install -e .)") from None
    try:
        img = GuestImage(**json.loads(meta.read_text()))
    except FileNotFoundError:
        raise GuestImageError(f"no guest built for this agent in {guest_dir} ({meta} missing): run "
                              "scripts/setup.sh, which fetches the cloud kernel with apt and builds the "
                              "initramfs") from None
    except (ValueError, TypeError) as err:
        raise GuestImageError(f"{meta} is unreadable ({err}): run scripts/setup.sh to rebuild it") from None
    for path in (img.kernel, img.initramfs):
        if not os.path.isfile(path):
            raise GuestImageError(f"{path} named by {meta} is missing: run scripts/setup.sh to rebuild it")
    return img


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kernel_package(guest_dir: Path) -> Path:
    debs = sorted(Path(guest_dir).glob("linux-image-*-cloud-amd64_*.deb"))
    if not debs:
        raise GuestImageError(f"no linux-image-*-cloud-amd64 package in {guest_dir}: run scripts/mkguest.sh "
                              "(apt-get download of Debian's cloud kernel)")
    return debs[-1]


def unpack(deb: Path, guest_dir: Path) -> Path:
    """The package's files under guest_dir/<deb name>/ (unpacked once)."""
    dest = Path(guest_dir) / deb.name.removesuffix(".deb")
    if (dest / "boot").is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=guest_dir))
    try:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, capture_output=True)
        os.rename(tmp, dest)
    except subprocess.CalledProcessError as err:
        raise GuestImageError(f"dpkg-deb -x {deb}: {err.stderr.decode(errors='replace').strip()}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def modinfo_depends(ko: Path) -> list[str]:
    """The `depends=` of a module's .modinfo ELF section (names, '-' as '_')."""
    data = ko.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise GuestImageError(f"{ko} is not a 64-bit ELF module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size

    _, stroff, _ = section(shstrndx)
    for i in range(shnum):
        name, off, size = section(i)
        if data[stroff + name:stroff + name + 9] == b".modinfo\0":
            for field in data[off:off + size].split(b"\0"):
                if field.startswith(b"depends="):
                    return [d.replace("-", "_") for d in field[8:].decode().split(",") if d]
            return []
    return []


def module_order(moddir: Path, wanted: tuple[str, ...] = MODULES) -> list[Path]:
    """The .ko files of `wanted` and their dependencies, each after what it needs."""
    by_name = {p.name.removesuffix(".ko").replace("-", "_"): p for p in moddir.rglob("*.ko")}
    builtin = set()
    builtin_file = moddir / "modules.builtin"
    if builtin_file.exists():
        builtin = {Path(line).name.removesuffix(".ko").replace("-", "_")
                   for line in builtin_file.read_text().split()}
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name in builtin:
            return
        seen.add(name)
        ko = by_name.get(name)
        if ko is None:
            raise GuestImageError(f"module {name} is neither in {moddir} nor built in")
        for dep in modinfo_depends(ko):
            visit(dep)
        order.append(ko)

    for name in wanted:
        visit(name)
    return order


def _cpio_entry(name: str, mode: int, data: bytes = b"", ino: int = 0) -> bytes:
    """One newc entry: owner root, mtime 0, so the archive is reproducible."""
    name_b = name.encode() + b"\0"
    head = b"070701" + b"".join(b"%08X" % v for v in (
        ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0))
    out = head + name_b
    out += b"\0" * (-len(out) % 4)
    out += data
    out += b"\0" * (-len(out) % 4)
    return out


def write_initramfs(out: Path, agent: bytes, modules: list[Path]) -> None:
    entries = [("dev", 0o040755, b""), ("modules", 0o040755, b""),
               ("init", 0o100755, agent),
               ("modules.order", 0o100644, "".join(f"{m.name}\n" for m in modules).encode())]
    entries += [(f"modules/{m.name}", 0o100644, m.read_bytes()) for m in modules]
    blob = b"".join(_cpio_entry(name, mode, data, ino + 1) for ino, (name, mode, data) in enumerate(entries))
    blob += _cpio_entry("TRAILER!!!", 0)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, out)


def build(guest_dir: Path = GUEST_DIR, agent_path: Path | None = None) -> GuestImage:
    """Unpack the kernel package and build the initramfs, unless both are
    there already for this agent and package; write guest.json."""
    guest_dir = Path(guest_dir)
    guest_dir.mkdir(parents=True, exist_ok=True)
    agent_path = agent_path or agent_binary_path()
    if not agent_path.is_file():
        raise GuestImageError(f"{agent_path} missing: build it with scripts/setup.sh (pip install -e .)")
    deb = kernel_package(guest_dir)
    agent = agent_path.read_bytes()
    h = hashlib.sha256(f"format={FORMAT}\nmodules={','.join(MODULES)}\n".encode())
    h.update(hashlib.sha256(agent).digest())
    h.update(_sha256_file(deb).encode())
    digest = h.hexdigest()
    initramfs = guest_dir / f"initramfs-{digest[:16]}.cpio"
    root = unpack(deb, guest_dir)
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise GuestImageError(f"{deb} holds no boot/vmlinuz-*")
    version = kernels[-1].name.removeprefix("vmlinuz-")
    if not initramfs.exists():
        write_initramfs(initramfs, agent, module_order(root / "lib" / "modules" / version))
    img = GuestImage(kernel=str(kernels[-1]), initramfs=str(initramfs), version=version, digest=digest)
    for meta in (_meta_for(guest_dir, agent), guest_dir / "guest.json"):
        if not meta.exists() or json.loads(meta.read_text()) != img.to_dict():
            tmp = meta.with_name(f".{meta.name}.tmp")
            tmp.write_text(json.dumps(img.to_dict(), indent=1) + "\n")
            os.replace(tmp, meta)
        os.utime(meta)          # the newest builds are kept (_prune)
    _prune(guest_dir)
    return img


def _prune(guest_dir: Path, keep: int = KEEP_BUILDS) -> None:
    """Drop all but the `keep` most recently built agents' descriptions, and
    every initramfs none of the kept ones names."""
    metas = sorted(guest_dir.glob("guest-*.json"), key=lambda m: m.stat().st_mtime, reverse=True)
    for old in metas[keep:]:
        old.unlink(missing_ok=True)
    named = set()
    for meta in metas[:keep]:
        try:
            named.add(Path(json.loads(meta.read_text())["initramfs"]).name)
        except (OSError, ValueError, KeyError):
            continue
    for old in guest_dir.glob("initramfs-*.cpio"):
        if old.name not in named:
            old.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsecd.backends.microvm.guestimg")
    ap.add_argument("command", choices=["build", "show"])
    ap.add_argument("--dir", default=str(GUEST_DIR))
    args = ap.parse_args(argv)
    try:
        img = build(Path(args.dir)) if args.command == "build" else load(Path(args.dir))
    except GuestImageError as err:
        print(f"guestimg: {err}", file=sys.stderr)
        return 1
    print(json.dumps(img.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
