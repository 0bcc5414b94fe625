"""The bpf(2) calls the daemon needs, through ctypes: maps, program loads, cgroup attaches.

The daemon loads the policy programs from a cached object (dsecd/net/bpfobj.py)
with these, so it never imports bcc: bcc pulls libbcc and LLVM into the process
(~140 MB resident once a program is compiled, for the process's whole life).

Every call takes its attribute struct packed with `struct` into a ctypes buffer;
one call costs ~2 us of Python. Errors are OSError naming the call and the map
or program it was for.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import struct

_SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}

MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, PROG_ATTACH, PROG_DETACH = 5, 8, 9
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 14, 15, 16
RAW_TRACEPOINT_OPEN = 17
MAP_LOOKUP_BATCH, MAP_UPDATE_BATCH, MAP_DELETE_BATCH = 24, 26, 27
_NO_BATCH = (errno.EINVAL, errno.ENOTSUP, 524)     # 524: ENOTSUPP, a map type without the op

PROG_TYPES = {"SCHED_CLS": 3, "CGROUP_SKB": 8, "SOCK_OPS": 13, "RAW_TRACEPOINT": 17, "CGROUP_SOCK_ADDR": 18}
ATTACH_TYPES = {"NONE": 0, "CGROUP_INET_INGRESS": 0, "CGROUP_INET_EGRESS": 1, "CGROUP_SOCK_OPS": 3, "CGROUP_INET4_CONNECT": 10,
                "CGROUP_INET6_CONNECT": 11, "CGROUP_UDP4_SENDMSG": 14, "CGROUP_UDP6_SENDMSG": 15,
                "TCX_INGRESS": 46, "TCX_EGRESS": 47}    # TCX: Linux 6.6+ (Debian 12's headers predate it)
F_BEFORE = 1 << 3          # TCX attach: first in the device's chain
MAP_TYPE_RINGBUF = 27
PERCPU_TYPES = {5, 6, 10}          # PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NR = _SYS_BPF.get(platform.machine())


class BpfError(OSError):
    pass


def _addr(buf) -> int:
    return ctypes.addressof(buf) if buf is not None else 0


def bpf(cmd: int, attr: ctypes.Array, what: str) -> int:
    if _NR is None:
        raise BpfError(errno.ENOSYS, f"{what}: no bpf(2) syscall number known for {platform.machine()}")
    rc = _syscall(_NR, ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr)))
    if rc < 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"{what}: {os.strerror(e)}")
    return rc


def _attr(data: bytes, size: int = 128) -> ctypes.Array:
    buf = ctypes.create_string_buffer(size)
    ctypes.memmove(buf, data, len(data))
    return buf


def possible_cpus() -> int:
    """Per-CPU map values hold one slot per *possible* CPU (not online)."""
    with open("/sys/devices/system/cpu/possible") as f:
        n = 0
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            n = max(n, int(hi or lo) + 1)
    return n


class Map:
    """A BPF map by fd: raw bytes in, raw bytes out."""

    def __init__(self, fd: int, name: str, map_type: int, key_size: int, value_size: int, max_entries: int):
        self.fd, self.name, self.type = fd, name, map_type
        self.key_size, self.value_size, self.max_entries = key_size, value_size, max_entries
        # What a lookup returns: per-CPU maps give one 8-byte-aligned value per possible CPU.
        self.percpu = map_type in PERCPU_TYPES
        self.slot = (value_size + 7) & ~7
        self.ncpu = possible_cpus() if self.percpu else 1
        self.out_size = self.slot * self.ncpu if self.percpu else value_size
        self._batch = True
        self._lookup_batch = self._delete_batch = True

    @classmethod
    def create(cls, name: str, map_type: int, key_size: int, value_size: int, max_entries: int,
               flags: int) -> Map:
        data = struct.pack("=IIIIIII16s", map_type, key_size, value_size, max_entries, flags, 0, 0,
                           name.encode()[:15])
        fd = bpf(MAP_CREATE, _attr(data), f"create BPF map `{name}`")
        return cls(fd, name, map_type, key_size, value_size, max_entries)

    @classmethod
    def by_id(cls, map_id: int) -> Map:
        """An existing map (another program's), by its id."""
        fd = bpf(MAP_GET_FD_BY_ID, _attr(struct.pack("=III", map_id, 0, 0), 16), f"get BPF map {map_id}")
        try:
            info = map_info(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, info["name"], info["type"], info["key_size"], info["value_size"], info["max_entries"])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def keys(self):
        """Every key, one BPF_MAP_GET_NEXT_KEY each. A key deleted meanwhile
        makes the walk start over from the first (the kernel's rule), so a
        map being changed may yield a key twice."""
        key, out = None, ctypes.create_string_buffer(self.key_size)
        while True:
            try:
                self._elem(MAP_GET_NEXT_KEY, key, out, 0, "walk")
            except OSError as err:
                if err.errno == errno.ENOENT:
                    return
                raise
            key = out.raw
            yield key

    def all_keys(self, chunk: int = 4096) -> bytes:
        """Every key, end to end (key_size bytes each), read `chunk` at a time
        with BPF_MAP_LOOKUP_BATCH: a hash map of 65536 entries in 17 calls,
        not 65536 of keys(). The batch walks the buckets in order, so a key
        deleted meanwhile does not start it over; one added or deleted
        meanwhile may be in it or not. Falls back to keys() for a map type
        without the op, or a bucket that holds more than `chunk` keys."""
        if self._lookup_batch:
            try:
                return self._batch_keys(chunk)
            except OSError as err:
                if err.errno not in (*_NO_BATCH, errno.ENOSPC):
                    raise
                if err.errno != errno.ENOSPC:
                    self._lookup_batch = False
        return b"".join(self.keys())

    def _batch_keys(self, chunk: int) -> bytes:
        tokens = [ctypes.create_string_buffer(max(8, self.key_size)) for _ in range(2)]   # a hash map's is a u32
        keys = ctypes.create_string_buffer(chunk * self.key_size)
        vals = ctypes.create_string_buffer(chunk * self.out_size)
        out: list[bytes] = []
        first = True
        while True:
            data = struct.pack("=QQQQIIQQ", 0 if first else ctypes.addressof(tokens[0]),
                               ctypes.addressof(tokens[1]), ctypes.addressof(keys), ctypes.addressof(vals),
                               chunk, self.fd, 0, 0)
            attr = _attr(data, 64)
            try:
                bpf(MAP_LOOKUP_BATCH, attr, f"batch look up in map `{self.name}`")
                done = False
            except OSError as err:
                if err.errno != errno.ENOENT:        # ENOENT: the walk is at its end
                    raise
                done = True
            n = struct.unpack_from("=I", attr.raw, 32)[0]     # the kernel writes back `count`
            out.append(keys.raw[:n * self.key_size])
            if done:
                return b"".join(out)
            ctypes.memmove(tokens[0], tokens[1], len(tokens[1]))
            first = False

    def delete_many(self, keys: list[bytes]) -> int:
        """Delete `keys`, BPF_MAP_DELETE_BATCH where the map type has it (a
        key already gone is skipped); how many were there."""
        n, i = 0, 0
        while i < len(keys) and self._delete_batch:
            rest = keys[i:]
            buf = ctypes.create_string_buffer(b"".join(rest), len(rest) * self.key_size)
            data = struct.pack("=QQQQIIQQ", 0, 0, ctypes.addressof(buf), 0, len(rest), self.fd, 0, 0)
            attr = _attr(data, 64)
            try:
                bpf(MAP_DELETE_BATCH, attr, f"batch delete from map `{self.name}`")
                return n + len(rest)
            except OSError as err:
                done = struct.unpack_from("=I", attr.raw, 32)[0]
                n, i = n + done, i + done
                if err.errno == errno.ENOENT:        # keys[i] went meanwhile (an LRU evicts)
                    i += 1
                elif err.errno in _NO_BATCH:
                    self._delete_batch = False
                else:
                    raise
        return n + sum(self.delete(k) for k in keys[i:])

    def _elem(self, cmd: int, key: bytes | None, value, flags: int, what: str) -> int:
        kbuf = ctypes.create_string_buffer(key, len(key)) if key is not None else None
        data = struct.pack("=IIQQQ", self.fd, 0, _addr(kbuf), _addr(value), flags)
        return bpf(cmd, _attr(data, 32), f"{what} map `{self.name}`")

    def update(self, key: bytes, value: bytes, flags: int = 0) -> None:
        vbuf = ctypes.create_string_buffer(value, len(value))
        self._elem(MAP_UPDATE_ELEM, key, vbuf, flags, "update")

    def delete(self, key: bytes) -> bool:
        """False if the key was not there."""
        return self._present(MAP_DELETE_ELEM, key, None, "delete from")

    def lookup(self, key: bytes) -> bytes | None:
        out = ctypes.create_string_buffer(self.out_size)
        return out.raw if self._present(MAP_LOOKUP_ELEM, key, out, "look up in") else None

    def _present(self, cmd: int, key: bytes, out, what: str) -> bool:
        """_elem where a missing key (ENOENT) is an answer, not an error."""
        try:
            self._elem(cmd, key, out, 0, what)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def percpu_values(self, key: bytes) -> list[bytes]:
        raw = self.lookup(key) or b""
        return [raw[i * self.slot:i * self.slot + self.value_size] for i in range(len(raw) // self.slot)]

    def update_many(self, items: list[tuple[bytes, bytes]]) -> None:
        """Several elements: one BPF_MAP_UPDATE_BATCH where the map type has it
        (hash, array), else one update each (lpm_trie has no batch ops: EINVAL
        or ENOTSUPP, remembered). Not atomic either way; callers order their
        writes so that a partial one is harmless (see policy.Engine)."""
        if not items:
            return
        if len(items) > 1 and self._batch:
            n = len(items)
            keys = ctypes.create_string_buffer(b"".join(k for k, _ in items), n * self.key_size)
            vals = ctypes.create_string_buffer(b"".join(v for _, v in items), n * len(items[0][1]))
            data = struct.pack("=QQQQIIQQ", 0, 0, ctypes.addressof(keys), ctypes.addressof(vals), n,
                               self.fd, 0, 0)
            attr = _attr(data, 64)
            try:
                bpf(MAP_UPDATE_BATCH, attr, f"batch update map `{self.name}`")
                return
            except OSError as err:
                done = struct.unpack_from("=I", attr.raw, 32)[0]      # the kernel writes back `count`
                if err.errno not in _NO_BATCH:
                    raise
                items = items[done:]
                self._batch = False
        for k, v in items:
            self.update(k, v)


def map_info(fd: int) -> dict:
    """type, key_size, value_size, max_entries, map_flags, name of a map fd."""
    info = ctypes.create_string_buffer(88)
    data = struct.pack("=IIQ", fd, len(info), ctypes.addressof(info))
    bpf(OBJ_GET_INFO_BY_FD, _attr(data, 16), f"get info of BPF map fd {fd}")
    t, _id, ks, vs, me, fl, name = struct.unpack_from("=IIIIII16s", info.raw)
    return {"type": t, "key_size": ks, "value_size": vs, "max_entries": me, "flags": fl,
            "name": name.split(b"\0", 1)[0].decode()}


def map_info_by_id(map_id: int) -> dict:
    fd = bpf(MAP_GET_FD_BY_ID, _attr(struct.pack("=III", map_id, 0, 0), 16), f"get BPF map {map_id}")
    try:
        return map_info(fd)
    finally:
        os.close(fd)


def prog_load(name: str, prog_type: int, attach_type: int, insns: bytes, license: str = "GPL") -> int:
    """Load instructions (map fds already in them); on a verifier rejection the
    error carries the end of the verifier's log."""
    ibuf = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    for log_level in (0, 1):
        logbuf = ctypes.create_string_buffer(1 << 20) if log_level else None
        data = struct.pack("=IIQQIIQII16sII", prog_type, len(insns) // 8, ctypes.addressof(ibuf),
                           ctypes.addressof(lic), log_level, len(logbuf) if logbuf else 0, _addr(logbuf),
                           0, 0, name.encode()[:15], 0, attach_type)
        try:
            return bpf(PROG_LOAD, _attr(data), f"load BPF program `{name}`")
        except OSError as err:
            if log_level or err.errno != errno.EACCES and err.errno != errno.EINVAL:
                tail = logbuf.value.decode(errors="replace")[-2000:] if logbuf else ""
                raise BpfError(err.errno, f"{err.strerror}{'; verifier: ' + tail if tail else ''}") from err
    raise AssertionError("unreachable")


def prog_attach(cgroup_fd: int, prog_fd: int, attach_type: int, what: str) -> None:
    data = struct.pack("=IIII", cgroup_fd, prog_fd, attach_type, 0)
    bpf(PROG_ATTACH, _attr(data, 32), what)


def prog_detach(cgroup_fd: int, prog_fd: int, attach_type: int, what: str) -> None:
    data = struct.pack("=IIII", cgroup_fd, prog_fd, attach_type, 0)
    bpf(PROG_DETACH, _attr(data, 32), what)


def raw_tracepoint_open(name: str, prog_fd: int) -> int:
    """Attach a RAW_TRACEPOINT program to the tracepoint `name` (sys_exit, ...);
    the returned fd holds the attachment: closing it detaches."""
    tp = ctypes.create_string_buffer(name.encode())
    data = struct.pack("=QI", ctypes.addressof(tp), prog_fd)
    return bpf(RAW_TRACEPOINT_OPEN, _attr(data, 16), f"attach BPF program to raw tracepoint `{name}`")


class RingBuffer:
    """The consumer side of a BPF_MAP_TYPE_RINGBUF map (the kernel's ABI: a
    consumer page this side writes, then a producer page and the data area, mapped
    twice in a row so that a record never wraps). `drain` returns the records
    the kernel has committed since the last call; the map's fd is readable
    (epoll) while some are there."""

    _BUSY, _DISCARD, _HDR = 1 << 31, 1 << 30, 8

    def __init__(self, m: Map):
        import mmap

        self.map = m
        page = mmap.PAGESIZE
        self.size = m.max_entries
        self.mask = self.size - 1
        self.consumer = mmap.mmap(m.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self.producer = mmap.mmap(m.fd, page + 2 * self.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self.data_off = page

    def drain(self, limit: int = 4096) -> list[bytes]:
        out = []
        cons = struct.unpack_from("=Q", self.consumer, 0)[0]
        prod = struct.unpack_from("=Q", self.producer, 0)[0]
        while cons < prod and len(out) < limit:
            at = self.data_off + (cons & self.mask)
            hdr = struct.unpack_from("=I", self.producer, at)[0]
            if hdr & self._BUSY:                # reserved, not committed yet
                break
            length = hdr & ~(self._BUSY | self._DISCARD)
            if not hdr & self._DISCARD:
                out.append(bytes(self.producer[at + self._HDR:at + self._HDR + length]))
            cons += (length + self._HDR + 7) & ~7
        # x86-64 keeps stores in order: the kernel sees the records read before the position moves.
        struct.pack_into("=Q", self.consumer, 0, cons)
        return out

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


# ------------------------------------------------------------ TCX (programs on a network device, Linux 6.6+)
#
# Attached with BPF_PROG_ATTACH (not a BPF link): the attachment belongs to
# the device and outlives this process, as the cgroup attaches do, so the
# programs of a daemon that stopped go on enforcing until the next one
# replaces them (or the device goes).


def tcx_attach(ifindex: int, prog_fd: int, attach_type: int, flags: int, what: str) -> None:
    # union { target_fd; target_ifindex }, attach_bpf_fd, attach_type, attach_flags,
    # replace_bpf_fd, union { relative_fd; relative_id }, expected_revision
    data = struct.pack("=IIIIIIQ", ifindex, prog_fd, attach_type, flags, 0, 0, 0)
    bpf(PROG_ATTACH, _attr(data, 32), what)


def tcx_detach(ifindex: int, prog_fd: int, attach_type: int, what: str) -> None:
    data = struct.pack("=IIIIIIQ", ifindex, prog_fd, attach_type, 0, 0, 0, 0)
    bpf(PROG_DETACH, _attr(data, 32), what)


def tcx_query(ifindex: int, attach_type: int, what: str) -> list[int]:
    """The ids of the programs attached to a device's hook, in order."""
    return prog_query(ifindex, attach_type, what)


def prog_query(target: int, attach_type: int, what: str) -> list[int]:
    """The ids of the programs attached to a cgroup (target: an fd of its
    dir) or a device's TCX hook (target: its ifindex), in order."""
    ids = (ctypes.c_uint32 * 64)()
    # target_fd / target_ifindex, attach_type, query_flags, attach_flags, prog_ids, count
    data = struct.pack("=IIIIQI", target, attach_type, 0, 0, ctypes.addressof(ids), 64)
    attr = _attr(data, 64)
    bpf(PROG_QUERY, attr, what)
    count = struct.unpack_from("=I", attr.raw, 24)[0]
    return list(ids[:count])


def prog_id(fd: int) -> int:
    info = ctypes.create_string_buffer(256)
    data = struct.pack("=IIQ", fd, len(info), ctypes.addressof(info))
    bpf(OBJ_GET_INFO_BY_FD, _attr(data, 16), f"get info of BPF program fd {fd}")
    return struct.unpack_from("=II", info.raw)[1]          # struct bpf_prog_info: type, id, ...


def prog_map_ids(fd: int) -> list[int]:
    """The ids of the maps a program uses."""
    # struct bpf_prog_info: nr_map_ids at 52, map_ids (a pointer the kernel fills) at 56
    ids = (ctypes.c_uint32 * 64)()
    info = ctypes.create_string_buffer(256)
    struct.pack_into("=IQ", info, 52, 64, ctypes.addressof(ids))
    data = struct.pack("=IIQ", fd, len(info), ctypes.addressof(info))
    bpf(OBJ_GET_INFO_BY_FD, _attr(data, 16), f"get info of BPF program fd {fd}")
    count = struct.unpack_from("=I", info.raw, 52)[0]
    return list(ids[:min(count, 64)])


def prog_fd_by_id(prog: int) -> int:
    return bpf(PROG_GET_FD_BY_ID, _attr(struct.pack("=III", prog, 0, 0), 16), f"get BPF program {prog}")


@contextlib.contextmanager
def prog_by_id(prog: int):
    """An fd of another process's program `prog` for the block, closed after
    it; None if the program is gone (its last holder went meanwhile)."""
    try:
        fd = prog_fd_by_id(prog)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)
