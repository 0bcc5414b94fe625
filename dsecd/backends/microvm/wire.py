"""The guest agent's wire format, host side (the guest side is csrc/guest/agent.c).

A frame is  u32 length (big-endian, of what follows) | u8 type | u32 id | body;
a body is a sequence of fields, each a u64 (big-endian) or a byte string
(u32 length + bytes). The layout of each message's body is in its builder
below and in the enum comments of agent.c; keep both in step.
"""

from __future__ import annotations

import ipaddress
import struct

# host -> guest
HELLO, EXEC, STDIN, KILL = 1, 2, 3, 4
READ, WRITE, STAT, LIST, MKDIR, REMOVE, RENAME, SYNC, NET, TAR, PING = 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20
RESIZE = 21
# background processes (dsecd/engine/vmprocs.py): kept by the agent, output and end included
PROC_START, PROC_LIST, PROC_ATTACH, PROC_INPUT, PROC_KILL, PROC_FORGET = 22, 23, 24, 25, 26, 27
# an exec's output flow control: u64 OUT data bytes the host has taken of it, in all (EXEC_WINDOW)
CREDIT = 28
# a file's or directory's mode and/or mtime (file_set_attrs): path, flags (SETATTR_*), mode, mtime
# (signed ns; with SETATTR_TS signed seconds, and its nanoseconds, a u64 below 10^9, after every other field)
SETATTR = 29
SETATTR_MODE, SETATTR_MTIME, SETATTR_FOLLOW, SETATTR_TS = 1, 2, 4, 8
DISCARD_ALL = 2**64 - 1     # a CREDIT's count saying: the host drops the rest, send it without a window
# guest -> host
READY, STARTED, OUT, EXITED, OK, ERR, DATA, TAKEN = 101, 102, 103, 104, 105, 106, 107, 108
PROC_OUT, PROC_END = 109, 110      # id 0, pushed to the host attached to the process (PROC_ATTACH)

EXEC_STDIN, EXEC_TAR_GET, EXEC_TAR_PUT, EXEC_PTY, EXEC_WATCH = 1, 2, 4, 8, 16   # TAR_*, WATCH: no program
EXEC_TRACE = 32        # under the guest's ptrace recorder: its records come as OUT on fd 3 (vmtrace.py)
EXEC_WINDOW = 64       # output flow control: the window (u64 bytes) trails every other field; CREDIT moves it
EXEC_GROUPS = 128      # supplementary groups: a count (u64) and that many gids trail every other field
# The agent version (its READY text, "dsec-guest-agent N") from which it
# honours EXEC_WINDOW; an older one ignores the flag and field.
WINDOW_AGENT_VERSION = 3
# The version from which it sets EXEC_GROUPS's groups; an older one would
# ignore them: such a request is not sent (agent.py).
GROUPS_AGENT_VERSION = 4
# The version from which a write, a mkdir and a put take an owner (trailing
# uid and gid fields; the put's in its argv); an older one would make root's
# files: such a request is refused (VmFiles._owner_fields).
OWNER_AGENT_VERSION = 5
# The version from which a put removes what an earlier entry made at a name
# a later entry replaces (its r record); with an older one such an archive
# is refused (engine/vmfiles.py _put_records).
REPLACE_AGENT_VERSION = 6
# The version from which it takes SETATTR; an older one answers ENOSYS:
# such a request is refused (VmFiles._file_op).
ATTRS_AGENT_VERSION = 7
# The version from which a STAT takes STAT_FOLLOW and answers a symlink's
# target (after the device and inode numbers); an older one would ignore
# the flag: a follow is refused (engine/files.py).
STAT_AGENT_VERSION = 8
STAT_FOLLOW = 1
# The version from which mtimes before 1970 and below a second go both ways:
# a tar's (a copy out, a snapshot) in a pax record, SETATTR's signed, and a
# put told "ns" (its argv's last word) takes its records' mtimes as signed
# nanoseconds (PUT_NO_MTIME: none); an older one would take a negative one
# as a time past 2262 or as none: such a request is refused or clamped.
TIMES_AGENT_VERSION = 9
PUT_NO_MTIME = 1 << 63
# The version from which a put told "ts" takes its records' mtimes as
# signed seconds and nanoseconds (a u32, PUT_TS_NO_MTIME: none), 4 bytes
# more than "ns": any time a tar holds, as the container backend's
# os.utime takes it. Signed nanoseconds in 64 bits end in 1677 and 2262:
# a time outside them is refused to an agent of TIMES_AGENT_VERSION to 12.
WIDE_TIMES_AGENT_VERSION = 13
PUT_TS_NO_MTIME = 2**32 - 1
# The version from which a SETATTR told SETATTR_TS takes its mtime as
# signed seconds and nanoseconds, any time a time_t holds, as the container
# backend's os.utime does; an older one (from TIMES_AGENT_VERSION) takes
# signed nanoseconds in 64 bits, which end in 1677 and 2262 and would wrap
# a time past them: such a request is refused (engine/vmfiles.py
# _setattr_mtime). An older one would ignore the flag: it is not sent.
WIDE_SETATTR_AGENT_VERSION = 14
# The version from which a STAT told STAT_TS and a LIST told LIST_TS (a
# trailing flags field) answer each mtime as signed seconds and a u64 of
# nanoseconds (Reader.stat), any time a time_t holds, as a container's
# os.stat gives it. An older one answers signed nanoseconds in 64 bits,
# which end in 1677 and 2262: it wraps a time past them (2300-01-01 comes
# as 1715-06-13), and nothing in the value tells a wrapped time from a
# true one. An older agent would ignore the flags: they are not sent.
WIDE_STAT_AGENT_VERSION = 15
STAT_TS, LIST_TS = 2, 1
# From version 11 a copy out's tar gives an mtime's fraction in a pax record
# (an older agent's has whole seconds): nothing the host asks for, it passes
# the tar on either way.
TRACE_FD = 3
WRITE_APPEND, WRITE_KEEP, WRITE_PARENTS = 1, 2, 4
RENAME_OVERWRITE, RENAME_KEEP_ATTRS = 1, 2
NO_OFFSET = 2**64 - 1
HEADER = struct.Struct(">IBI")
# The largest frame the agent sends: a READ's answer of its largest chunk
# (MAX_MSG in agent.c, 64 MiB) with its fields. The guest is untrusted: a
# length header beyond it is not a frame but an attempt to make the host
# buffer up to 4 GiB, and ends the channel (AgentLink._read_loop).
MAX_GUEST_FRAME = (64 << 20) + 64


class FrameError(ValueError):
    """Bytes from the guest that are no frame of this format."""


def check_length(length: int, kind: int, msg_id: int) -> int:
    """The body's size of a frame whose header says `length`, or FrameError."""
    if not 5 <= length <= MAX_GUEST_FRAME:
        raise FrameError(f"frame length {length} (type {kind}, id {msg_id}) outside 5..{MAX_GUEST_FRAME}")
    return length - 5


def u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def s64(v: int) -> bytes:
    """A signed field: two's complement in a u64 (struct.error if v does not fit)."""
    return struct.pack(">q", v)


def mtime_ns(seconds: float) -> int:
    """An mtime in seconds as nanoseconds, as the container backend's
    os.utime gets them (fs/files.py set_attrs): int(seconds * 1e9)."""
    return int(seconds * 1e9)


def bstr(v: bytes | str) -> bytes:
    if isinstance(v, str):
        v = v.encode(errors="surrogateescape")     # a name that is not UTF-8: its bytes (see str())
    return struct.pack(">I", len(v)) + v


def frame(kind: int, msg_id: int, *fields: bytes) -> bytes:
    body = b"".join(fields)
    return HEADER.pack(len(body) + 5, kind, msg_id) + body


def exec_request(msg_id: int, argv: list[str], env: list[str], cwd: str, uid: int, gid: int,
                 stdin: bool, flags: int = 0, window: tuple[int, int] | None = None,
                 trace: tuple[int, int] | None = None, output_window: int = 0,
                 groups: tuple[int, ...] = ()) -> bytes:
    """window: (rows, cols) of a pty exec's terminal (flags gets EXEC_PTY);
    trace: (bytes per string, argv entries) the guest tracer reads of each
    recorded call (flags gets EXEC_TRACE); output_window: bytes of output
    the agent may send past what CREDIT says the host took (flags gets
    EXEC_WINDOW; 0: none, for an agent older than WINDOW_AGENT_VERSION);
    groups: supplementary gids (flags gets EXEC_GROUPS)."""
    tail: tuple[bytes, ...] = ()
    if window is not None:
        flags |= EXEC_PTY
        tail += (u64(window[0]), u64(window[1]))
    if trace is not None:
        flags |= EXEC_TRACE
        tail += (u64(trace[0]), u64(trace[1]))
    if output_window:
        flags |= EXEC_WINDOW
        tail += (u64(output_window),)
    if groups:
        flags |= EXEC_GROUPS
        tail += groups_fields(groups)
    return frame(EXEC, msg_id, u64(uid), u64(gid), u64(flags | (EXEC_STDIN if stdin else 0)), bstr(cwd),
                 u64(len(argv)), *map(bstr, argv), u64(len(env)), *map(bstr, env), *tail)


def groups_fields(groups: tuple[int, ...]) -> tuple[bytes, ...]:
    """An EXEC_GROUPS tail: the count, then the gids."""
    return (u64(len(groups)), *map(u64, groups))


def net_fields(mac: bytes, ipv4: ipaddress.IPv4Interface, gateway: ipaddress.IPv4Address, mtu: int,
               ipv6: ipaddress.IPv6Interface | None = None, gateway6: ipaddress.IPv6Address | None = None) -> list[bytes]:
    """A NET body: the guest's MAC, IPv4 address (as an integer), prefix
    length, the gateway (its default route) and the MTU; with an IPv6 lease
    then its IPv6 address (16 bytes), prefix length and gateway (16 bytes).
    No IPv6 fields: the agent keeps IPv6 off in the guest. They trail, so an
    agent built before them reads the first five only and keeps it off too."""
    fields = [bstr(mac), u64(int(ipv4.ip)), u64(ipv4.network.prefixlen), u64(int(gateway)), u64(mtu)]
    if ipv6 is not None:
        if gateway6 is None:
            raise ValueError(f"IPv6 address {ipv6} without a gateway")
        fields += [bstr(ipv6.ip.packed), u64(ipv6.network.prefixlen), bstr(gateway6.packed)]
    return fields


def agent_version(ready_text: str) -> int:
    """The version in a READY's text ("dsec-guest-agent N"); 0 if it names none."""
    name, _, number = ready_text.rpartition(" ")
    return int(number) if name == "dsec-guest-agent" and number.isdigit() else 0


class Reader:
    """Fields of a received body, in order."""

    def __init__(self, body: bytes | memoryview):
        self.body = memoryview(body)
        self.at = 0

    def u64(self) -> int:
        v, = struct.unpack_from(">Q", self.body, self.at)
        self.at += 8
        return v

    def bytes(self) -> bytes:
        n, = struct.unpack_from(">I", self.body, self.at)
        self.at += 4
        v = bytes(self.body[self.at:self.at + n])
        if len(v) != n:
            raise ValueError("guest agent frame cut short")
        self.at += n
        return v

    def str(self) -> str:
        return self.bytes().decode(errors="surrogateescape")

    def more(self) -> bool:
        return self.at < len(self.body)

    def stat(self, ts: bool = False) -> dict:
        """A file's stat fields (put_stat in agent.c); `ts`: of a request
        told STAT_TS or LIST_TS, whose mtime is seconds and nanoseconds."""
        kind, size, mode, uid, gid = self.str(), self.u64(), self.u64(), self.u64(), self.u64()
        mtime = ts_seconds(self.u64(), self.u64()) if ts else mtime_seconds(self.u64())
        return {"type": kind, "size": size, "mode": mode, "uid": uid, "gid": gid, "mtime": mtime}


def _signed(field: int) -> int:
    return field - (1 << 64) if field >= 1 << 63 else field


def mtime_seconds(field: int) -> float:
    """The mtime an agent older than WIDE_STAT_AGENT_VERSION (or one not
    told STAT_TS) sends: a u64 of nanoseconds, its tv_sec * 10^9 + tv_nsec
    in two's complement (before 1970 negative; past 2262 or before 1677
    wrapped), as seconds_of gives it."""
    return seconds_of(*divmod(_signed(field), 1_000_000_000))


def ts_seconds(sec_field: int, nsec: int) -> float:
    """The mtime a STAT_TS or LIST_TS answer sends: tv_sec in two's
    complement and tv_nsec, as seconds_of gives it. A tv_nsec of 10^9 or
    more is no stat's (the guest is not trusted): ValueError."""
    if nsec >= 1_000_000_000:
        raise ValueError(f"guest agent's stat answer gives an mtime of {nsec} nanoseconds past its second, "
                         "which no file has: the guest is broken or hostile")
    return seconds_of(_signed(sec_field), nsec)


def seconds_of(sec: int, nsec: int) -> float:
    """A time as the float os.stat's st_mtime is for a container's file:
    seconds plus nanoseconds * 1e-9 (CPython's fill_time), which is not
    always the same float as ns / 1e9."""
    return sec + nsec * 1e-9
