"""The BPF side: bpf/net_policy.c compiled once per process with bcc, its maps, attaches.

Compiling takes seconds (clang), so `Engine.shared()` compiles once per
process and every Network shares the programs and maps; a sandbox then costs
map updates and six BPF_PROG_ATTACH calls. Never call into this module from
the event loop.

Attaches use no flags (not BPF_F_ALLOW_MULTI): a second attach of the same
type to the same cgroup *replaces* the program atomically. A restarted daemon
relies on that: the old daemon's programs (and their maps, which they keep
alive) go on enforcing the old policy while the daemon is down, and readopt
replaces them with the new daemon's programs once their maps hold the
rebuilt policy.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

from ..errors import LimitExceeded
from .rules import FAM_V4, MAX_ENTRIES, Entry

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "net_policy.c"

# (function, program type, attach type) from bcc.BPFProgType / BPFAttachType.
HOOKS = (
    ("dsec_connect4", "CGROUP_SOCK_ADDR", "CGROUP_INET4_CONNECT"),
    ("dsec_connect6", "CGROUP_SOCK_ADDR", "CGROUP_INET6_CONNECT"),
    ("dsec_sendmsg4", "CGROUP_SOCK_ADDR", "CGROUP_UDP4_SENDMSG"),
    ("dsec_sendmsg6", "CGROUP_SOCK_ADDR", "CGROUP_UDP6_SENDMSG"),
    ("dsec_egress", "CGROUP_SKB", "CGROUP_INET_EGRESS"),
    ("dsec_sockops", "SOCK_OPS", "CGROUP_SOCK_OPS"),     # marks accepted connections for dsec_egress
)


class BpfError(OSError):
    pass


def _bcc():
    try:
        import bcc
    except ImportError as err:
        raise BpfError(errno.ENOSYS, f"import bcc: {err} (install python3-bpfcc)") from err
    return bcc


class _Slots:
    """A free list of map indices [0, n)."""

    def __init__(self, n: int, what: str):
        self.n, self.what = n, what
        self.free = list(range(n - 1, -1, -1))
        self.used: set[int] = set()

    def take(self, count: int = 1) -> list[int]:
        if count > len(self.free):
            raise LimitExceeded(f"out of BPF {self.what}: need {count}, {len(self.free)} free of {self.n}",
                                {"what": self.what, "free": len(self.free), "size": self.n})
        out = [self.free.pop() for _ in range(count)]
        self.used.update(out)
        return out

    def give(self, idxs) -> None:
        for i in idxs:
            if i in self.used:
                self.used.discard(i)
                self.free.append(i)


class Engine:
    """Compiled programs + maps, shared by every Network of this process."""

    _shared: dict[tuple, Engine] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, max_sandboxes: int, max_prefixes: int, max_counters: int) -> Engine:
        key = (max_sandboxes, max_prefixes, max_counters)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(*key)
            return cls._shared[key]

    def __init__(self, max_sandboxes: int, max_prefixes: int, max_counters: int):
        bcc = _bcc()
        self.bcc = bcc
        self.max_prefixes = max_prefixes
        cflags = [f"-DMAX_SANDBOXES={max_sandboxes}", f"-DMAX_PREFIXES={max_prefixes}",
                  f"-DMAX_COUNTERS={max_counters}", "-Wno-unused-value"]
        try:
            self.bpf = bcc.BPF(src_file=str(SOURCE).encode(), cflags=cflags)
            self.fns = {}
            for name, ptype, atype in HOOKS:
                self.fns[name] = (self.bpf.load_func(name.encode(), getattr(bcc.BPFProgType, ptype),
                                                     attach_type=getattr(bcc.BPFAttachType, atype)),
                                  getattr(bcc.BPFAttachType, atype))
        except Exception as err:      # bcc raises bare Exception with the verifier log on stderr
            raise BpfError(errno.EINVAL, f"compile/load `{SOURCE}`: {err}") from err
        self.config = self.bpf[b"config"]
        self.sandboxes = self.bpf[b"sandboxes"]
        self.rules = self.bpf[b"rules"]
        self.rule_hits = self.bpf[b"rule_hits"]
        self.sb_stats = self.bpf[b"sb_stats"]
        self.lock = threading.RLock()
        self.counters = _Slots(max_counters, "rule counters (net.max_counters)")
        self.slots = _Slots(max_sandboxes, "sandbox slots (limits.max_sandboxes)")
        self.prefixes_used = 0
        self.next_policy = 1
        self.level: int | None = None

    # ------------------------------------------------------------ config

    def set_level(self, level: int) -> None:
        """Depth of sandbox cgroup dirs below the v2 root (the programs ask for that ancestor)."""
        with self.lock:
            if self.level is not None and self.level != level:
                raise ValueError(f"sandbox cgroup level {level} differs from {self.level} already in use")
            self.level = level
            self.config[self.config.Key(0)] = self.config.Leaf(level)

    # ------------------------------------------------------------ attach

    def attach(self, cgroup_dir: str) -> None:
        fd = _open_dir(cgroup_dir)
        try:
            for name, (fn, atype) in self.fns.items():
                try:
                    self.bcc.BPF.attach_func(fn, fd, atype)
                except Exception as err:
                    raise BpfError(errno.EINVAL, f"attach {name} to `{cgroup_dir}`: {err}") from err
        finally:
            os.close(fd)

    def detach(self, cgroup_dir: str) -> None:
        """Detach ours; a gone cgroup (its programs went with it) is fine."""
        try:
            fd = _open_dir(cgroup_dir)
        except BpfError as err:
            if err.errno == errno.ENOENT:
                return
            raise
        try:
            for _name, (fn, atype) in self.fns.items():
                try:
                    self.bcc.BPF.detach_func(fn, fd, atype)
                except Exception as err:     # ENOENT: not attached (anymore)
                    log.debug("detach from %s: %s", cgroup_dir, err)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ maps

    def register(self, cgroup_id: int, policy: int, slot: int) -> None:
        """Point the sandbox at `policy`: one map update, the atomic flip of an update."""
        v = self.sandboxes.Leaf(policy, slot)
        self.sandboxes[self.sandboxes.Key(cgroup_id)] = v

    def unregister(self, cgroup_id: int) -> None:
        try:
            del self.sandboxes[self.sandboxes.Key(cgroup_id)]
        except KeyError:
            pass

    def new_policy_id(self) -> int:
        with self.lock:
            pid = self.next_policy
            self.next_policy = pid + 1 if pid < 0xFFFFFFFF else 1
            return pid

    def _key(self, policy: int, fam: int, addr: int, plen: int):
        k = self.rules.Key()
        k.prefixlen = 32 + 8 + plen
        k.policy = policy
        k.family = fam
        raw = addr.to_bytes(4 if fam == FAM_V4 else 16, "big")
        for i, b in enumerate(raw):
            k.addr[i] = b
        return k

    def _leaf(self, entries: list[Entry], counter_of: dict):
        v = self.rules.Leaf()
        v.n = len(entries)
        for i, e in enumerate(entries[:MAX_ENTRIES]):
            v.e[i].port_lo, v.e[i].port_hi, v.e[i].protos = e.port_lo, e.port_hi, e.protos
            v.e[i].counter = counter_of[e.rule]
        return v

    def _reserve(self, n: int) -> None:
        with self.lock:
            if self.prefixes_used + n > self.max_prefixes:
                raise LimitExceeded(f"BPF rule trie full: {self.prefixes_used} of {self.max_prefixes} prefixes "
                                    f"used, need {n} more (net.max_prefixes)")
            self.prefixes_used += n

    def write_policy(self, policy: int, prefixes: dict[tuple[int, int, int], list[Entry]],
                     counter_of: dict) -> None:
        """Write every prefix of a policy under id `policy`; all or nothing."""
        self._reserve(len(prefixes))
        done = []
        try:
            for pkey, entries in prefixes.items():
                self.rules[self._key(policy, *pkey)] = self._leaf(entries, counter_of)
                done.append(pkey)
        except BaseException:
            self.delete_policy(policy, done)
            with self.lock:
                self.prefixes_used -= len(prefixes) - len(done)
            raise

    def write_prefix(self, policy: int, pkey: tuple[int, int, int], entries: list[Entry],
                     counter_of: dict, new: bool) -> None:
        """Add or replace one prefix of a live policy: a single, atomic map update."""
        if new:
            self._reserve(1)
        try:
            self.rules[self._key(policy, *pkey)] = self._leaf(entries, counter_of)
        except BaseException:
            if new:
                with self.lock:
                    self.prefixes_used -= 1
            raise

    def delete_policy(self, policy: int, pkeys) -> None:
        n = 0
        for pkey in pkeys:
            n += 1
            try:
                del self.rules[self._key(policy, *pkey)]
            except KeyError:
                pass
        with self.lock:
            self.prefixes_used -= n

    def reset_counters(self, idxs: list[int]) -> None:
        for i in idxs:
            self.rule_hits[self.rule_hits.Key(i)] = self.rule_hits.Leaf()

    def reset_stats(self, slot: int) -> None:
        self.sb_stats[self.sb_stats.Key(slot)] = self.sb_stats.Leaf()

    def hits(self, idx: int) -> int:
        return int(sum(self.rule_hits[self.rule_hits.Key(idx)]))

    def stats(self, slot: int) -> dict[str, int]:
        per_cpu = self.sb_stats[self.sb_stats.Key(slot)]
        out = {"denied_connect": 0, "denied_sendmsg": 0, "dropped_packets": 0}
        for s in per_cpu:
            for k in out:
                out[k] += getattr(s, k)
        return out


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise BpfError(err.errno, f"open cgroup `{path}`: {os.strerror(err.errno)}") from err
