"""Denials of task policies as the kernel answers them: EACCES and EPERM
returned by the syscalls Landlock mediates, in sandboxes the daemon
watches, read from a BPF ring buffer (bpf/policy_denials.c).

Why not Landlock's own reports. Landlock (ABI >= 7) logs each denial to the
audit subsystem, with its domain and blockers, but only while audit is
enabled (security/landlock/audit.c returns early otherwise), and enabling
audit is a host-wide switch that also turns on syscall auditing for every
new task; this host runs no auditd and has it off. The per-domain denial
counter Landlock keeps appears only in the audit record of the domain's
end. fentry/LSM BPF programs on Landlock's functions would see each denial
exactly, but this kernel refuses those program types (EPERM at load). What
is left, and used here: a raw tracepoint on sys_exit.

What it counts, honestly: every EACCES or EPERM that open, openat,
openat2, creat, execve(at), truncate, ftruncate, mkdir(at), mknod(at),
rmdir, unlink(at), rename(at,at2), link(at), symlink(at), connect, bind,
sendto, sendmsg, kill, tkill, tgkill, rt_(tg)sigqueueinfo and
pidfd_send_signal return to a process of a watched sandbox. Landlock
denies with exactly those errnos on exactly those calls, but so may file
modes, capabilities or the seccomp filter (rare for root in a sandbox that
holds DAC_OVERRIDE; the seccomp filter answers EPERM to calls no policy
concerns, such as mount, which are not in the list). A burst that fills the
ring buffer is counted as `lost`. Cost: enabling the tracepoint sends every
syscall of the host through the kernel's syscall-work slow path while a
sandbox is watched (bench/policy.py measures it); the program itself
returns after one compare for a syscall that did not fail so.

Attribution: each record carries the cgroup (the sandbox) and the session
id of the process in its own pid namespace; each exec leads its own
session, so that names the exec, whose policy the daemon knows
(dsecd/engine/denials.py).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import platform
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from . import btf
from .net import bpfobj, bpfsys

log = logging.getLogger(__name__)

# struct denial of bpf/policy_denials.c
_RECORD = struct.Struct("=QQIiII6Q16s256s128s128s")
PIDTYPE_SID = 3                   # enum pid_type: PID, TGID, PGID, SID (stable since Linux 4.19)
RINGBUF_PAGES = 64                # 256 KiB: ~430 records before the daemon must have read
_OFFSETS_WANTED = {"task_struct": ("signal",), "signal_struct": ("pids",), "pid": ("level", "numbers"),
                   "upid": ("nr",)}
AT_FDCWD = -100

# x86-64 numbers of the syscalls the program reports, and what their arguments are.
SYSCALLS = {2: "open", 59: "execve", 76: "truncate", 77: "ftruncate", 83: "mkdir", 84: "rmdir", 85: "creat",
            87: "unlink", 133: "mknod", 257: "openat", 258: "mkdirat", 259: "mknodat", 263: "unlinkat",
            322: "execveat", 437: "openat2", 82: "rename", 86: "link", 88: "symlink", 264: "renameat",
            265: "linkat", 316: "renameat2", 266: "symlinkat", 42: "connect", 49: "bind", 44: "sendto",
            46: "sendmsg", 62: "kill", 200: "tkill", 234: "tgkill", 129: "rt_sigqueueinfo",
            297: "rt_tgsigqueueinfo", 424: "pidfd_send_signal"}
_DIRFD_ARG = {"openat": 0, "mkdirat": 0, "mknodat": 0, "unlinkat": 0, "execveat": 0, "openat2": 0,
              "renameat": 0, "linkat": 0, "renameat2": 0, "symlinkat": 1}
# syscall -> (index of the target's pid or fd, index of the signal)
_SIGNAL_ARGS = {"kill": (0, 1), "tkill": (0, 1), "tgkill": (1, 2), "rt_sigqueueinfo": (0, 1),
                "rt_tgsigqueueinfo": (1, 2), "pidfd_send_signal": (0, 1)}

# What a reported syscall acts on, for the counts by kind: a file (Landlock's
# file system rights), a socket (its TCP port rules and abstract-socket scope)
# or a signal (its signal scope).
SOCKET_CALLS = frozenset({"connect", "bind", "sendto", "sendmsg"})
KINDS = ("file", "socket", "signal")


def kind_of(syscall: str) -> str:
    """file, socket or signal for a syscall the program reports; other for
    a number SYSCALLS does not know (a program newer than this table)."""
    if syscall in SOCKET_CALLS:
        return "socket"
    if syscall in _SIGNAL_ARGS:
        return "signal"
    return "file" if syscall in SYSCALLS.values() else "other"


@dataclass(frozen=True)
class Denial:
    """One failed syscall of a watched sandbox, decoded."""

    cgroup: int           # the sandbox's cgroup v2 id
    pid: int              # host pid (tgid) of the process
    session: int          # its session leader's pid in the sandbox: its exec
    comm: str
    syscall: str
    errno: str            # EACCES or EPERM
    detail: dict          # path / path2 / dirfd, or address, or target and signal

    @property
    def kind(self) -> str:
        return kind_of(self.syscall)

    def public(self) -> dict:
        return {"syscall": self.syscall, "errno": self.errno, "comm": self.comm, **self.detail}


def decode(raw: bytes) -> Denial | None:
    if len(raw) < _RECORD.size:
        return None
    (cg, pid_tgid, session, ret, nr, _pad, *rest) = _RECORD.unpack_from(raw)
    args, (comm, path, path2, addr) = rest[:6], rest[6:]
    name = SYSCALLS.get(nr, f"syscall {nr}")
    detail: dict = {}
    if path[:1] != b"\0":
        detail["path"] = _text(path)
    if path2[:1] != b"\0":
        detail["path2"] = _text(path2)
    if name in _DIRFD_ARG and "path" in detail and not detail["path"].startswith("/"):
        dirfd = _s32(args[_DIRFD_ARG[name]])
        if dirfd != AT_FDCWD:
            detail["dirfd"] = dirfd
    if name in SOCKET_CALLS:
        detail.update(_address(addr))
    if name == "ftruncate":
        detail["fd"] = _s32(args[0])
    if name in _SIGNAL_ARGS:
        who, sig = _SIGNAL_ARGS[name]
        detail["target_fd" if name == "pidfd_send_signal" else "target"] = _s32(args[who])
        detail["signal"] = _s32(args[sig])
    return Denial(cg, pid_tgid >> 32, session, _text(comm), name, errno.errorcode.get(-ret, str(ret)), detail)


def _text(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _address(addr: bytes) -> dict:
    family = int.from_bytes(addr[:2], "little")
    if family == socket.AF_INET:
        return {"address": f"{socket.inet_ntop(socket.AF_INET, addr[4:8])}:{int.from_bytes(addr[2:4], 'big')}"}
    if family == socket.AF_INET6:
        return {"address": f"[{socket.inet_ntop(socket.AF_INET6, addr[8:24])}]:{int.from_bytes(addr[2:4], 'big')}"}
    if family == socket.AF_UNIX:
        sun = addr[2:]
        if sun[:1] == b"\0":          # abstract: the name is what follows the NUL, up to the length given
            return {"address": "unix:@" + sun[1:].rstrip(b"\0").decode(errors="replace")}
        return {"address": "unix:" + _text(sun)}
    return {"address": f"family {family}"} if family else {}


class Monitor:
    """The loaded program, its maps and, while some sandbox is watched, its
    attachment to sys_exit. Blocking calls (load) run in a worker; watch,
    unwatch and drain are cheap (one bpf(2) call or a few memory reads)."""

    def __init__(self, cache_dir: Path, max_sandboxes: int):
        self.cache_dir = Path(cache_dir)
        self.max_sandboxes = max_sandboxes
        self.loaded: bpfobj.Loaded | None = None
        self.ring: bpfsys.RingBuffer | None = None
        self.link = -1                 # the raw tracepoint's attachment, while attached
        self.watched: set[int] = set()
        self.load_stats: dict = {}

    def load(self) -> None:
        """Struct offsets from BTF (cached next to the object), then the
        program, compiled by a helper the first time per kernel and bcc."""
        if platform.machine() != "x86_64":
            raise OSError(errno.ENOTSUP, f"the denial monitor reads x86-64 syscall numbers and registers; "
                                         f"this host is {platform.machine()}")
        offs = self._offsets()
        sid_pid = offs["signal_struct"]["pids"] + PIDTYPE_SID * 8
        cflags = [f"-DOFF_TASK_SIGNAL={offs['task_struct']['signal']}", f"-DOFF_SIGNAL_SID_PID={sid_pid}",
                  f"-DOFF_PID_LEVEL={offs['pid']['level']}", f"-DOFF_PID_NUMBERS={offs['pid']['numbers']}",
                  f"-DSIZEOF_UPID={offs['upid'][btf.SIZE]}", f"-DOFF_UPID_NR={offs['upid']['nr']}",
                  f"-DRINGBUF_PAGES={RINGBUF_PAGES}", f"-DMAX_SANDBOXES={self.max_sandboxes}",
                  "-Wno-unused-value"]
        loaded, self.load_stats = bpfobj.load(self.cache_dir, cflags, bpfobj.POLICY_DENIALS)
        try:
            ring = bpfsys.RingBuffer(loaded.maps["events"])
        except BaseException:
            loaded.close()
            raise
        self.loaded, self.ring = loaded, ring

    def _offsets(self) -> dict:
        """btf.offsets of what the program reads, cached per kernel build."""
        uname = os.uname()
        key = f"{uname.release} {uname.version} {btf.VMLINUX.stat().st_size if btf.VMLINUX.exists() else 0}"
        path = self.cache_dir / "policy_denials-offsets.json"
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return cached["offsets"]
        except (OSError, ValueError, KeyError, AttributeError):
            pass
        offs = btf.offsets(_OFFSETS_WANTED)
        try:
            bpfobj.write_atomic(path, json.dumps({"key": key, "offsets": offs}).encode())
        except OSError as err:
            log.info("cannot cache BTF offsets in %s: %s", path, err)
        return offs

    @property
    def fd(self) -> int:
        """The ring buffer's fd: readable while records wait."""
        assert self.loaded is not None
        return self.loaded.maps["events"].fd

    def watch(self, cgroup_id: int) -> None:
        """Report this cgroup's denials; the first one attaches the program."""
        assert self.loaded is not None
        self.loaded.maps["watched"].update(cgroup_id.to_bytes(8, "little"), (1).to_bytes(4, "little"))
        self.watched.add(cgroup_id)
        if self.link < 0:
            prog_fd, _ = self.loaded.progs["dsec_sys_exit"]
            self.link = bpfsys.raw_tracepoint_open("sys_exit", prog_fd)
            log.info("policy denial monitor attached to sys_exit")

    def unwatch(self, cgroup_id: int) -> None:
        """No more reports of this cgroup; the last one detaches the program,
        so a host without watched sandboxes pays nothing."""
        if self.loaded is None or cgroup_id not in self.watched:
            return
        self.watched.discard(cgroup_id)
        self.loaded.maps["watched"].delete(cgroup_id.to_bytes(8, "little"))
        if not self.watched and self.link >= 0:
            os.close(self.link)
            self.link = -1
            log.info("policy denial monitor detached from sys_exit (no sandbox watched)")

    def drain(self) -> list[Denial]:
        if self.ring is None:
            return []
        return [d for d in map(decode, self.ring.drain()) if d is not None]

    def lost(self) -> int:
        if self.loaded is None:
            return 0
        raw = self.loaded.maps["lost"].lookup(b"\0\0\0\0")
        return int.from_bytes(raw[:8], "little") if raw else 0

    def close(self) -> None:
        if self.link >= 0:
            os.close(self.link)
            self.link = -1
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None
        self.watched.clear()
