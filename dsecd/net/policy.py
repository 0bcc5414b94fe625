"""The BPF side: bpf/net_policy.c's programs and maps in this process, and their attaches.

The programs come from a compiled object cached on disk (bpfobj.py): compiled
by bcc in a helper process the first time, and loaded with plain bpf(2) calls
(bpfsys.py) by every daemon start after that; this process never imports bcc.
`Engine.shared()` loads once per process and every Network shares the programs
and maps; a sandbox then costs map updates and seven BPF_PROG_ATTACH calls.
`prepare()` runs that load in a background thread at daemon start, so a create
waits for it only while it is not done. Never call into this module from the
event loop, except for the map updates of a small policy change (update_now).

Attaches use no flags (not BPF_F_ALLOW_MULTI): a second attach of the same
type to the same cgroup *replaces* the program atomically. A restarted daemon
relies on that: the old daemon's programs (and their maps, which they keep
alive) go on enforcing the old policy while the daemon is down, and readopt
replaces them with the new daemon's programs once their maps hold the
rebuilt policy.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
import threading
import time
from pathlib import Path

from ..errors import LimitExceeded
from . import bpfobj, bpfsys
from .bpfsys import BpfError
from .rules import FAM_V4, MAX_ENTRIES, Entry

log = logging.getLogger(__name__)


__all__ = ["BpfError", "Engine"]

# The maps of connections made *to* a sandbox (a container's accepted TCP
# sockets, a microVM's inbound flows), whose answers pass the allowlist. A
# restarted daemon starts with them empty: it copies in those of the daemon
# before it (Engine.carry_marks), or their connections would stall.
MARK_MAPS = ("accepted", "vm_inbound")

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_SB_VAL = struct.Struct("=II")
_RULE_KEY = struct.Struct("=IIB16s")            # struct lpm_key (padded to the map's key size)
_RULE_HEAD = struct.Struct("=II")               # struct rule_val: n, pad
_ENTRY = struct.Struct("=HHB3xI")               # struct entry
_SB_STAT = struct.Struct("=QQQ")                # struct sb_stat
_TAP_VAL = struct.Struct("=Q4s6s2x16s16s4x")   # struct tap_val (addresses in network byte order)
_UDP_PORT = struct.Struct("=Q2s6x")             # struct udp_port: sandbox key, port (network byte order)
_UDP_GEN = struct.Struct("=I")                  # a `udp_published` value, and a `udp_peers` one: a publication
_FLOW = struct.Struct("=Q16s2s2sB3x")           # struct vm_flow: key, peer, peer port, its port, family


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
    """Loaded programs + maps, shared by every Network of this process."""

    _shared: dict[tuple, Engine] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls, max_sandboxes: int, max_prefixes: int, max_counters: int,
               cache_dir: Path | str | None = None) -> Engine:
        key = (max_sandboxes, max_prefixes, max_counters)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(*key, cache_dir=cache_dir)
            return cls._shared[key]

    @classmethod
    def loaded_stats(cls) -> dict | None:
        """How this process got its programs ({"object": "cached"|"compiled", ...}), if it has."""
        for eng in list(cls._shared.values()):      # no lock: it is held for the whole load
            return dict(eng.load_stats)
        return None

    @classmethod
    def prepare(cls, max_sandboxes: int, max_prefixes: int, max_counters: int,
                cache_dir: Path | str) -> threading.Thread:
        """shared() in a background thread (daemon start). A failure is logged
        here and raised again by the shared() of whoever needs the engine."""
        def run() -> None:
            try:
                cls.shared(max_sandboxes, max_prefixes, max_counters, cache_dir)
            except Exception as err:
                log.warning("loading the BPF programs at start failed (retried on the first "
                            "--net default create): %s", err)

        t = threading.Thread(target=run, name="dsecd-bpf-load", daemon=True)
        t.start()
        return t

    def __init__(self, max_sandboxes: int, max_prefixes: int, max_counters: int,
                 cache_dir: Path | str | None = None):
        self.max_prefixes = max_prefixes
        cflags = [f"-DMAX_SANDBOXES={max_sandboxes}", f"-DMAX_PREFIXES={max_prefixes}",
                  f"-DMAX_COUNTERS={max_counters}", "-Wno-unused-value"]
        cache = Path(cache_dir) if cache_dir else Path("/var/cache/dsecd/bpf")
        t0 = time.perf_counter()
        try:
            self.loaded, self.load_stats = bpfobj.load(cache, cflags)
        except OSError as err:
            raise BpfError(err.errno or errno.EINVAL, f"load the BPF programs of `{bpfobj.NET_POLICY.source}`: {err}") from err
        self.load_stats["ready_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        log.info("BPF programs ready in %.1f ms (object %s)", self.load_stats["ready_ms"],
                 self.load_stats["object"])
        m = self.loaded.maps
        self.marks = {name: m[name] for name in MARK_MAPS}
        self.config, self.sandboxes, self.rules = m["config"], m["sandboxes"], m["rules"]
        self.rule_hits, self.sb_stats, self.taps = m["rule_hits"], m["sb_stats"], m["taps"]
        self.udp_published, self.udp_peers = m["udp_published"], m["udp_peers"]
        tap_names = {p[0] for p in bpfobj.TAP_PROGS}
        # name -> (prog fd, attach type): what every sandbox cgroup gets
        self.fns = {n: v for n, v in self.loaded.progs.items() if n not in tap_names}
        # name -> (prog fd, attach type, prog id): what every microVM's tap gets
        self.tap_progs = {n: (*self.loaded.progs[n], bpfsys.prog_id(self.loaded.progs[n][0])) for n in tap_names}
        self._key_pad = b"\0" * (self.rules.key_size - _RULE_KEY.size)
        self._val_pad = self.rules.value_size - _RULE_HEAD.size - MAX_ENTRIES * _ENTRY.size
        if self._val_pad < 0 or self.rules.key_size < _RULE_KEY.size:
            raise BpfError(errno.EINVAL, f"BPF map `rules` has key/value sizes {self.rules.key_size}/"
                                         f"{self.rules.value_size}; this dsecd expects "
                                         f"{_RULE_KEY.size}+/{self.rules.value_size - self._val_pad}")
        self._zero_hits = bytes(self.rule_hits.out_size)
        self._zero_stats = bytes(self.sb_stats.out_size)
        self.lock = threading.RLock()
        self.counters = _Slots(max_counters, "rule counters (net.max_counters)")
        self.slots = _Slots(max_sandboxes, "sandbox slots (limits.max_sandboxes)")
        self.prefixes_used = 0
        self.next_policy = 1
        self.level: int | None = None
        # Counts the UDP publications of these maps: the next one's number
        # is this count's next value mod 2**32 - 1, plus 1 (publish_udp).
        self._udp_gens = itertools.count()

    # ------------------------------------------------------------ config

    def set_level(self, level: int) -> None:
        """Depth of sandbox cgroup dirs below the v2 root (the programs ask for that ancestor)."""
        with self.lock:
            if self.level is not None and self.level != level:
                raise ValueError(f"sandbox cgroup level {level} differs from {self.level} already in use")
            self.level = level
            self.config.update(_U32.pack(0), _U32.pack(level))

    # ------------------------------------------------------------ attach

    def attach(self, cgroup_dir: str) -> None:
        fd = _open_dir(cgroup_dir)
        try:
            for name, (prog, atype) in self.fns.items():
                bpfsys.prog_attach(fd, prog, atype, f"attach {name} to `{cgroup_dir}`")
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
            for name, (prog, atype) in self.fns.items():
                try:
                    bpfsys.prog_detach(fd, prog, atype, f"detach {name} from `{cgroup_dir}`")
                except OSError as err:     # ENOENT: not attached (anymore)
                    log.debug("%s", err)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ a previous daemon's marks

    def previous_marks(self, cgroup_dir: str) -> set[int]:
        """The ids of the mark maps (MARK_MAPS) of a previous daemon's
        dsec_sockops still attached to `cgroup_dir` (a re-adopted sandbox's)."""
        fd = _open_dir(cgroup_dir)
        try:
            atype = bpfsys.ATTACH_TYPES["CGROUP_SOCK_OPS"]
            progs = bpfsys.prog_query(fd, atype, f"list the programs on `{cgroup_dir}`")
        finally:
            os.close(fd)
        return self._mark_maps_of(progs)

    def _mark_maps_of(self, prog_ids: list[int]) -> set[int]:
        """The mark maps used by the programs `prog_ids` that are not this
        process's (found on a cgroup or tap of ours: a previous daemon's)."""
        ours = {bpfsys.prog_id(fd) for fd, _ in self.loaded.progs.values()}
        found = set()
        for prog in set(prog_ids) - ours:
            with bpfsys.prog_by_id(prog) as fd:
                for map_id in bpfsys.prog_map_ids(fd) if fd is not None else ():
                    try:
                        info = bpfsys.map_info_by_id(map_id)
                    except OSError as err:
                        log.debug("%s", err)
                        continue
                    if info["name"] in self.marks:
                        found.add(map_id)
        return found

    def hold_marks(self, map_ids: set[int]) -> dict[int, bpfsys.Map]:
        """The previous daemon's mark maps `map_ids`, open: its programs are
        all that keep them alive, and the last replace frees them. Those
        already gone are left out; the caller closes the rest."""
        held = {}
        for map_id in map_ids:
            try:
                held[map_id] = bpfsys.Map.by_id(map_id)
            except OSError as err:            # its last program went meanwhile
                log.debug("%s", err)
        return held

    def carry_marks(self, maps) -> int:
        """Copy into this daemon's mark maps the entries of a previous
        daemon's (`hold_marks`), each into the map of its name when its
        type and sizes are the same; returns how many were copied. Safe to
        repeat: a second pass brings what was marked meanwhile."""
        copied = 0
        for old in maps:
            ours = self.marks.get(old.name)
            if ours is None or (old.type, old.key_size, old.value_size) != \
                    (ours.type, ours.key_size, ours.value_size):
                log.warning("BPF map %s of the previous daemon does not match this one's; "
                            "its connections' answers are no longer let out", old.name)
                continue
            # A walk restarts when its key is deleted under it (the LRU
            # evicting): bounded, so a busy map cannot keep it going.
            keys = itertools.islice(old.keys(), 2 * old.max_entries)
            items = [(k, v) for k in keys if (v := old.lookup(k)) is not None]
            ours.update_many(items)
            copied += len(items)
        return copied

    def attach_tap(self, ifindex: int, ifname: str) -> None:
        """dsec_tap first on the tap's TCX ingress (what its guest sends) and
        dsec_tap_in on its egress (what is sent to it); then any other program
        there goes: a previous daemon's, whose maps decided until now (a
        re-adopted VM's tap), its inbound flows copied over first."""
        for name, (prog, at, prog_id) in self.tap_progs.items():
            bpfsys.tcx_attach(ifindex, prog, at, bpfsys.F_BEFORE, f"attach {name} to tap {ifname}")
            others = [p for p in bpfsys.tcx_query(ifindex, at, f"list the programs on tap {ifname}")
                      if p != prog_id]
            if others:
                self._carry_tap_marks(others, ifname)
            for other in others:
                with bpfsys.prog_by_id(other) as fd:
                    if fd is not None:
                        bpfsys.tcx_detach(ifindex, fd, at, f"detach BPF program {other} from tap {ifname}")

    def _carry_tap_marks(self, prog_ids: list[int], ifname: str) -> None:
        """A re-adopted VM's inbound flows, from the old programs still on its
        tap (they keep their maps alive until detached, so one pass). A
        failure costs those connections their answers, not the VM."""
        held = {}
        try:
            held = self.hold_marks(self._mark_maps_of(prog_ids))
            self.carry_marks(held.values())
        except OSError as err:
            log.error("copy the previous daemon's inbound flows of tap %s: %s", ifname, err)
        finally:
            for m in held.values():
                m.close()

    def register_tap(self, ifindex: int, key: int, ipv4: bytes, mac: bytes, ipv6: bytes = b"") -> None:
        """What dsec_tap checks a tap's frames with: the VM's `sandboxes` key,
        its addresses and MAC. Before the guest can send (its QEMU is started
        after). `ipv6` empty: no IPv6 lease, and no IPv6 frame of the VM
        passes; else its link-local address goes along (the one its kernel
        makes from the MAC), the source of its neighbor discovery."""
        ll6 = link_local(mac) if ipv6 else b""
        self.taps.update(_U32.pack(ifindex), _TAP_VAL.pack(key, ipv4, mac, ipv6, ll6))

    def unregister_tap(self, ifindex: int) -> None:
        self.taps.delete(_U32.pack(ifindex))

    # ------------------------------------------------------------ published UDP ports

    def publish_udp(self, key: int, port: int) -> None:
        """Let the sandbox `key` (a cgroup id, or a microVM's vm_key) answer
        whoever sends a datagram to its UDP `port` from now on (a TCP
        connection made to it needs no such entry: its socket is marked).
        LimitExceeded when `udp_published`, every sandbox's, is full.

        Each publication gets a number no other publication of these maps
        had (2**32 - 1 of them before one comes again), which marks the
        peers that write to it: a mark left by a datagram that raced an
        earlier unpublish of the port has an earlier publication's number,
        and answers nothing under this one (bpf/net_policy.c,
        answers_udp_peer)."""
        with self.lock:
            gen = next(self._udp_gens) % 0xFFFFFFFF + 1
        try:
            self.udp_published.update(_UDP_PORT.pack(key, port.to_bytes(2, "big")), _UDP_GEN.pack(gen))
        except BpfError as err:
            if err.errno != errno.E2BIG:          # what a full hash map answers a new key
                raise
            size = self.udp_published.max_entries
            raise LimitExceeded(f"BPF map udp_published is full: {size} UDP ports are published (every "
                                "sandbox's together); unpublish one first",
                                {"limit": "udp_published", "size": size}) from None

    def unpublish_udp(self, key: int, port: int) -> int:
        """Its UDP `port` no longer marks the peers that write to it, and
        the peers it marked may no longer be answered; how many there were."""
        self.udp_published.delete(_UDP_PORT.pack(key, port.to_bytes(2, "big")))
        raw_port = port.to_bytes(2, "big")
        # Every sandbox's peers, read in batches: a full map in 17 calls and
        # ~18 ms, where a key a call took ~0.23 s (this runs under the
        # Network's lock). Only keys that begin with the sandbox's are unpacked.
        keys, size, own = self.udp_peers.all_keys(), self.udp_peers.key_size, _U64.pack(key)
        theirs = []
        at = keys.find(own)
        while at >= 0:
            if at % size == 0 and _FLOW.unpack_from(keys, at)[3] == raw_port:
                theirs.append(keys[at:at + size])
            at = keys.find(own, at + 1)
        return self.udp_peers.delete_many(theirs)

    # ------------------------------------------------------------ maps

    def register(self, cgroup_id: int, policy: int, slot: int) -> None:
        """Point the sandbox at `policy`: one map update, the atomic flip of an update."""
        self.sandboxes.update(_U64.pack(cgroup_id), _SB_VAL.pack(policy, slot))

    def unregister(self, cgroup_id: int) -> None:
        self.sandboxes.delete(_U64.pack(cgroup_id))

    def new_policy_id(self) -> int:
        with self.lock:
            pid = self.next_policy
            self.next_policy = pid + 1 if pid < 0xFFFFFFFF else 1
            return pid

    def _key(self, policy: int, fam: int, addr: int, plen: int) -> bytes:
        raw = addr.to_bytes(4 if fam == FAM_V4 else 16, "big")
        return _RULE_KEY.pack(32 + 8 + plen, policy, fam, raw) + self._key_pad

    def _leaf(self, entries: list[Entry], counter_of: dict) -> bytes:
        parts = [_RULE_HEAD.pack(len(entries), 0)]
        for e in entries[:MAX_ENTRIES]:
            parts.append(_ENTRY.pack(e.port_lo, e.port_hi, e.protos, counter_of[e.rule]))
        used = sum(len(p) for p in parts)
        parts.append(bytes(self.rules.value_size - used))
        return b"".join(parts)

    def _reserve(self, n: int) -> None:
        with self.lock:
            if self.prefixes_used + n > self.max_prefixes:
                raise LimitExceeded(f"BPF rule trie full: {self.prefixes_used} of {self.max_prefixes} prefixes "
                                    f"used, need {n} more (net.max_prefixes)")
            self.prefixes_used += n

    def write_policy(self, policy: int, prefixes: dict[tuple[int, int, int], list[Entry]],
                     counter_of: dict) -> None:
        """Write every prefix of a policy under id `policy`; all or nothing.
        Nothing reads the new id until register() flips a sandbox to it."""
        self._reserve(len(prefixes))
        done = []
        try:
            for pkey, entries in prefixes.items():
                self.rules.update(self._key(policy, *pkey), self._leaf(entries, counter_of))
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
            self.rules.update(self._key(policy, *pkey), self._leaf(entries, counter_of))
        except BaseException:
            if new:
                with self.lock:
                    self.prefixes_used -= 1
            raise

    def delete_policy(self, policy: int, pkeys) -> None:
        n = 0
        for pkey in pkeys:
            n += 1
            self.rules.delete(self._key(policy, *pkey))
        with self.lock:
            self.prefixes_used -= n

    def reset_counters(self, idxs: list[int]) -> None:
        """Zero fresh counters: one batch update (arrays have it)."""
        self.rule_hits.update_many([(_U32.pack(i), self._zero_hits) for i in idxs])

    def reset_stats(self, slot: int) -> None:
        self.sb_stats.update(_U32.pack(slot), self._zero_stats)

    def hits(self, idx: int) -> int:
        return sum(_U64.unpack(v)[0] for v in self.rule_hits.percpu_values(_U32.pack(idx)))

    def stats(self, slot: int) -> dict[str, int]:
        out = {"denied_connect": 0, "denied_sendmsg": 0, "dropped_packets": 0}
        for v in self.sb_stats.percpu_values(_U32.pack(slot)):
            c, s, d = _SB_STAT.unpack(v)
            out["denied_connect"] += c
            out["denied_sendmsg"] += s
            out["dropped_packets"] += d
        return out


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise BpfError(err.errno, f"open cgroup `{path}`: {os.strerror(err.errno)}") from err


def link_local(mac: bytes) -> bytes:
    """fe80::/64 with the MAC's modified EUI-64 interface id (RFC 4291,
    appendix A): the link-local address Linux gives a NIC with this MAC
    (addr_gen_mode 0), and the one the guest agent adds."""
    if len(mac) != 6:
        raise ValueError(f"a MAC has 6 bytes, not {len(mac)}: {mac.hex()}")
    return b"\xfe\x80" + bytes(6) + bytes([mac[0] ^ 2]) + mac[1:3] + b"\xff\xfe" + mac[3:6]
