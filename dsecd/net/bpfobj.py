"""Compiled BPF programs as a file on disk, built by a short-lived helper.

bcc compiles a program source (bpf/net_policy.c, bpf/policy_denials.c: a
`Spec` each) with clang in-process (1-5 s) and leaves libbcc and LLVM mapped
in whatever process did it: ~140 MB more resident memory for that process's
whole life. So the daemon never imports bcc. A helper process (`python -m
dsecd.net.bpfobj [--parent PID] [--spec NAME] OUT CFLAG...`, killed if the
daemon thread that started it ends first) compiles with bcc, writes what the
kernel needs to load the programs again, and exits:

  maps   name, type, key and value size, max entries, flags (from
         BPF_OBJ_GET_INFO_BY_FD on the maps bcc made)
  progs  name, program and attach type, instructions, and where the
         instructions name a map (the imm of a BPF_LD_IMM64 with src_reg
         BPF_PSEUDO_MAP_FD holds the helper's map fd; the loader patches in its own)

The file is named after a hash of what determines its content (the source,
the -D sizes, the kernel release, bcc's version and this format), so a
restarted daemon, or another on the same host, loads it with plain bpf(2)
calls (bpfsys.py) in a few ms and compiles nothing. A file that does not
verify (torn, truncated, edited: a sha256 over its body is checked; or written
for another key) or that the kernel refuses to load is rebuilt, once.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import logging
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import pinned
from . import bpfsys

log = logging.getLogger(__name__)

MAGIC = b"dsecd-bpf-object 1\n"
MAPS = ("config", "sandboxes", "rules", "rule_hits", "sb_stats", "accepted", "taps", "vm_inbound",
        "udp_published", "udp_peers", "vm_frags")
# (function, program type, attach type): the programs attached to each sandbox's cgroup
HOOKS = (
    ("dsec_connect4", "CGROUP_SOCK_ADDR", "CGROUP_INET4_CONNECT"),
    ("dsec_connect6", "CGROUP_SOCK_ADDR", "CGROUP_INET6_CONNECT"),
    ("dsec_sendmsg4", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_SENDMSG"),
    ("dsec_sendmsg6", "CGROUP_SOCK_ADDR", "CGROUP_UDP6_SENDMSG"),
    ("dsec_egress", "CGROUP_SKB", "CGROUP_INET_EGRESS"),
    ("dsec_sockops", "SOCK_OPS", "CGROUP_SOCK_OPS"),     # marks accepted connections for dsec_egress
    ("dsec_ingress", "CGROUP_SKB", "CGROUP_INET_INGRESS"),   # marks peers of published UDP ports
)
# ... and to each microVM's tap: tc ingress is what the guest sends, egress
# what is sent to it (connections made to the VM, whose answers may go out)
TAP_PROGS = (("dsec_tap", "SCHED_CLS", "TCX_INGRESS"), ("dsec_tap_in", "SCHED_CLS", "TCX_EGRESS"))


@dataclass(frozen=True)
class Spec:
    """One program source (a file of bpf/): its maps and (function, program
    type, attach type) hooks, which the object file must hold; `name`
    prefixes the file."""

    name: str
    filename: str
    maps: tuple[str, ...]
    hooks: tuple[tuple[str, str, str], ...]

    @property
    def source(self) -> Path:
        """In the daemon's copy of its code (dsecd/pinned.py): the source its
        maps and hooks were written for, not one installed since; a helper
        runs from that copy, so it finds the same file."""
        return pinned.root() / "bpf" / self.filename


NET_POLICY = Spec("net_policy", "net_policy.c", MAPS, HOOKS + TAP_PROGS)
# Failed syscalls of policy-confined execs (dsecd/denials.py): a raw
# tracepoint, attached by name, not to a cgroup.
POLICY_DENIALS = Spec("policy_denials", "policy_denials.c", ("watched", "events", "lost"),
                      (("dsec_sys_exit", "RAW_TRACEPOINT", "NONE"),))
SPECS = {s.name: s for s in (NET_POLICY, POLICY_DENIALS)}
BUILD_TIMEOUT_S = 300
LD_IMM64, PSEUDO_MAP_FD = 0x18, 1


class ObjectError(ValueError):
    """A cached object that cannot be used (the caller rebuilds it)."""


def bcc_version() -> str:
    """bcc's version without importing it (the import maps libbcc into this process)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    except OSError:
        return "unknown"
    return text.split("=", 1)[-1].strip().strip("'\"")


def cache_key(cflags: list[str], spec: Spec = NET_POLICY) -> str:
    h = hashlib.sha256(MAGIC)
    for part in (spec.source.read_bytes(), " ".join(cflags).encode(), os.uname().release.encode(),
                 bcc_version().encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def object_path(cache_dir: Path, key: str, spec: Spec = NET_POLICY) -> Path:
    return Path(cache_dir) / f"{spec.name}-{key[:24]}.obj"


# ------------------------------------------------------------------ file format


def encode(key: str, maps: list[dict], progs: list[dict]) -> bytes:
    body = json.dumps({"key": key, "maps": maps, "progs": progs}, separators=(",", ":")).encode()
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode(data: bytes, key: str, spec: Spec = NET_POLICY) -> dict:
    if not data.startswith(MAGIC):
        raise ObjectError("not a dsecd BPF object (bad magic)")
    digest, _, body = data[len(MAGIC):].partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise ObjectError("checksum mismatch (torn or corrupt)")
    try:
        obj = json.loads(body)
        if obj["key"] != key:
            raise ObjectError(f"stale: built for key {obj['key'][:24]}, want {key[:24]}")
        for p in obj["progs"]:
            p["insns"] = base64.b64decode(p["insns"])
        names = {m["name"] for m in obj["maps"]}
        if names != set(spec.maps) or {p["name"] for p in obj["progs"]} != {h[0] for h in spec.hooks}:
            raise ObjectError("maps or programs missing")
        for p in obj["progs"]:
            for idx, name in p["relocs"]:
                if name not in names or not 0 <= idx < len(p["insns"]) // 8:
                    raise ObjectError(f"bad map reference in {p['name']}")
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, ObjectError):
            raise
        raise ObjectError(f"unreadable: {err}") from err
    return obj


# ------------------------------------------------------------------ the helper (imports bcc)


def build(out: Path, cflags: list[str], spec: Spec = NET_POLICY) -> None:
    """Compile with bcc and write the object; runs in the helper process."""
    import bcc

    key = cache_key(cflags, spec)
    b = bcc.BPF(src_file=str(spec.source).encode(), cflags=cflags)
    fd_to_name, maps = {}, []
    for name in spec.maps:
        fd = b[name.encode()].map_fd
        fd_to_name[fd] = name
        info = bpfsys.map_info(fd)
        maps.append({"name": name, "type": info["type"], "key_size": info["key_size"],
                     "value_size": info["value_size"], "max_entries": info["max_entries"],
                     "flags": info["flags"]})
    progs = []
    for name, ptype, atype in spec.hooks:
        insns = bytes(b.dump_func(name.encode()))
        relocs = []
        for i in range(0, len(insns), 8):
            op, regs, _off, imm = struct.unpack_from("<BBhi", insns, i)
            if op == LD_IMM64 and regs >> 4 == PSEUDO_MAP_FD:
                if imm not in fd_to_name:
                    raise RuntimeError(f"{name}: instruction {i // 8} names map fd {imm}, not one of {spec.maps}")
                relocs.append([i // 8, fd_to_name[imm]])
        progs.append({"name": name, "prog_type": ptype, "attach_type": atype, "relocs": relocs,
                      "insns": base64.b64encode(insns).decode()})
    write_atomic(out, encode(key, maps, progs))


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file + fsync + rename: a reader sees the old file or the whole new one
    (two daemons building the same key at once both write whole files)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def run_helper(out: Path, cflags: list[str], spec: Spec = NET_POLICY) -> float:
    """Build `out` in a helper process; its wall time in ms."""
    t0 = time.perf_counter()
    try:
        # pinned.helper_options: the helper computes the key with this
        # daemon's code; one installed since would write the object under another.
        proc = subprocess.run([sys.executable, "-m", "dsecd.net.bpfobj", "--parent", str(os.getpid()),
                               "--spec", spec.name, str(out), *cflags], **pinned.helper_options(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise bpfsys.BpfError(110, f"compile `{spec.source}` with bcc: no result after {BUILD_TIMEOUT_S} s") from err
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-3000:]
        raise bpfsys.BpfError(22, f"compile `{spec.source}` with bcc (helper exited {proc.returncode}; "
                                  f"is python3-bpfcc installed?): {tail}")
    return (time.perf_counter() - t0) * 1e3


# ------------------------------------------------------------------ the daemon side (no bcc)


class Loaded:
    """Maps and programs of one object, loaded into the kernel by this process."""

    def __init__(self, obj: dict):
        self.maps: dict[str, bpfsys.Map] = {}
        self.progs: dict[str, tuple[int, int]] = {}      # name -> (prog fd, attach type)
        try:
            for m in obj["maps"]:
                self.maps[m["name"]] = bpfsys.Map.create(m["name"], m["type"], m["key_size"], m["value_size"],
                                                         m["max_entries"], m["flags"])
            for p in obj["progs"]:
                insns = bytearray(p["insns"])
                for idx, name in p["relocs"]:
                    struct.pack_into("<i", insns, idx * 8 + 4, self.maps[name].fd)
                atype = bpfsys.ATTACH_TYPES[p["attach_type"]]
                fd = bpfsys.prog_load(p["name"], bpfsys.PROG_TYPES[p["prog_type"]], atype, bytes(insns))
                self.progs[p["name"]] = (fd, atype)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        for fd, _ in self.progs.values():
            os.close(fd)
        self.maps, self.progs = {}, {}


def load(cache_dir: Path, cflags: list[str], spec: Spec = NET_POLICY) -> tuple[Loaded, dict]:
    """The programs and maps, from the cached object (built first if missing,
    stale or corrupt); and what it took: {"object": "cached"|"compiled", ...}."""
    key = cache_key(cflags, spec)
    path = object_path(cache_dir, key, spec)
    stats: dict = {"object": "cached", "path": str(path)}
    for attempt in (0, 1):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            why = "none cached"
        except OSError as err:
            why = f"unreadable: {err}"
        else:
            try:
                t0 = time.perf_counter()
                loaded = Loaded(decode(data, key, spec))
                stats["load_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                return loaded, stats
            except ObjectError as err:
                why = str(err)
            except OSError as err:
                if attempt:
                    raise
                why = f"the kernel refused it: {err}"
        if attempt:
            raise bpfsys.BpfError(22, f"BPF object `{path}` built by the helper does not load: {why}")
        log.info("BPF object %s: %s; compiling %s with bcc in a helper process", path, why, spec.source.name)
        path.unlink(missing_ok=True)
        stats.update(object="compiled", compile_ms=round(run_helper(path, cflags, spec), 1), rebuilt_because=why)
        log.info("BPF object %s compiled in %.0f ms", path, stats["compile_ms"])
    raise AssertionError("unreachable")


def _die_with(parent: int) -> None:
    """SIGKILL this helper when the thread that started it ends: a daemon
    killed mid-compile leaves no clang running for minutes. A parent gone
    before the prctl is seen as a changed ppid."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(f"dsecd.net.bpfobj: the daemon {parent} that asked for this object is gone")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--parent"]:
        _die_with(int(args[1]))
        args = args[2:]
    chosen = NET_POLICY
    if args[:1] == ["--spec"]:
        chosen, args = SPECS[args[1]], args[2:]
    build(Path(args[0]), args[1:], chosen)
