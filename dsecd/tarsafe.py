"""The rules a tar entry must pass before it is extracted, on either side
of a directory copy: the daemon extracting a client's tar into a sandbox
(dsecd/fs/tarcopy.py), the SDK extracting a sandbox's tar on the client's
host (dsecd/client/files.py). Pure Python, no I/O: clients import it too.

An archive may make directories, regular files, symlinks, and hard links to
regular files it made before. Refused: absolute names, `..`, NUL, names past
PATH_MAX/NAME_MAX, an entry whose parent is a symlink or file of the archive
(it could redirect the write out of the tree), devices, FIFOs, sparse files,
setuid and setgid bits.

A name that comes again replaces what the archive made of it before, as
GNU tar extracts it (`tar -rf` appends a newer copy of a file to an
archive): the extractor removes the earlier entry (never following it) and
makes the later one, whose name is checked by the same rules. A directory
that comes again stays and takes the later entry's mode and mtime; one
that has entries below it cannot be replaced by a non-directory (GNU tar
fails there too: "Cannot open: File exists"), and is refused.
"""

from __future__ import annotations

import decimal
import math
import stat
import tarfile
from dataclasses import dataclass, field

KEPT_MODE = 0o1777          # permission bits and sticky; setuid/setgid are refused
NS = 10**9
MAX_TIME_T = 2**63          # seconds: a file's time is less, either side of 1970


class Refused(ValueError):
    """An entry breaks a rule: its name and why are in the message."""


class TooLarge(ValueError):
    """The archive has more entries or bytes than allowed."""


@dataclass
class Seen:
    """What the archive made so far, by name relative to the top ("" is the top)."""

    max_entries: int
    max_bytes: int
    dirs: set[str] = field(default_factory=lambda: {""})
    files: set[str] = field(default_factory=set)
    others: set[str] = field(default_factory=set)      # symlinks
    parents: set[str] = field(default_factory=set)     # directories with entries below them
    # The archive's own directory entries, the last of each name: (mode as
    # kept, mtime). A directory made only because entries go below it has none.
    dir_entries: dict[str, tuple[int, float]] = field(default_factory=dict)
    entries: int = 0
    bytes: int = 0
    # What the entry check() passed last replaces: None (a new name), "dir",
    # "file" (a file or hard link), "other" (a symlink), or "itself" (a hard
    # link naming its own entry: GNU tar leaves the file as it is).
    replaces: str | None = None


def entry_name(name: str) -> str:
    """A member's name as a relative path without "." parts; "" for the top."""
    if "\0" in name:
        raise Refused(f"entry {name!r} has a NUL byte in its name")
    if name.startswith("/"):
        raise Refused(f"entry {name!r} has an absolute name; entries must be relative to the copied directory")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"entry {name!r} has a '..' component, which would leave the copied directory")
    if len(name.encode(errors="surrogateescape")) > 4095 or any(len(p.encode(errors="surrogateescape")) > 255
                                                                  for p in parts):
        raise Refused(f"entry {name[:80]!r}...: name longer than PATH_MAX (4095) or a part past NAME_MAX (255)")
    return "/".join(parts)


def _kind(m: tarfile.TarInfo) -> str:
    if m.ischr():
        return "character device"
    if m.isblk():
        return "block device"
    if m.isfifo():
        return "FIFO"
    if m.issparse():
        return "sparse file"
    return f"entry of type {m.type!r}"


def check(m: tarfile.TarInfo, seen: Seen) -> str:
    """Check member `m` against the rules and what came before it; record it
    in `seen` and return its relative name. Raises Refused or TooLarge."""
    rel = entry_name(m.name)
    seen.replaces = None
    seen.entries += 1
    if seen.entries > seen.max_entries:
        raise TooLarge(f"the archive has more than {seen.max_entries} entries")
    if not (m.isdir() or (m.isreg() and not m.issparse()) or m.issym() or m.islnk()):
        raise Refused(f"entry {m.name!r} is a {_kind(m)}; only directories, regular files and symlinks copy")
    if m.mode & (stat.S_ISUID | stat.S_ISGID):
        raise Refused(f"entry {m.name!r} has the setuid or setgid bit (mode {m.mode:o}); clear it to copy it")
    if m.isreg():
        seen.bytes += m.size
        if seen.bytes > seen.max_bytes:
            raise TooLarge(f"the archive's files add up to more than {seen.max_bytes} bytes")
    if rel == "":
        if not m.isdir():
            raise Refused(f"entry {m.name!r} names the copied directory itself but is not a directory")
        seen.dir_entries[rel] = (m.mode & KEPT_MODE, m.mtime)
        return rel
    parent = rel.rpartition("/")[0]
    _check_parent(m.name, parent, seen)
    prior = "dir" if rel in seen.dirs else "file" if rel in seen.files else "other" if rel in seen.others else None
    if prior == "dir" and m.isdir():
        seen.replaces = prior
        seen.dir_entries[rel] = (m.mode & KEPT_MODE, m.mtime)
        return rel
    if prior == "dir" and rel in seen.parents:
        raise Refused(f"entry {m.name!r} comes again as a {_what(m)} where the archive made a directory with "
                      "entries in it: it cannot replace the directory")
    if m.issym() and ("\0" in m.linkname or len(m.linkname.encode(errors="surrogateescape")) > 4095):
        raise Refused(f"symlink {m.name!r} has a target with a NUL byte or past PATH_MAX")
    if m.islnk():
        target = entry_name(m.linkname)
        if target not in seen.files:
            raise Refused(f"hard link {m.name!r} -> {m.linkname!r}: the target is not a regular file "
                          "earlier in the archive")
        if target == rel:
            seen.replaces = "itself"
            return rel
    if prior is not None:
        (seen.dirs if prior == "dir" else seen.files if prior == "file" else seen.others).discard(rel)
        seen.dir_entries.pop(rel, None)
    if m.isdir():
        seen.dir_entries[rel] = (m.mode & KEPT_MODE, m.mtime)
    seen.replaces = prior
    (seen.dirs if m.isdir() else seen.files if m.isreg() or m.islnk() else seen.others).add(rel)
    return rel


def mtime_ns(m: tarfile.TarInfo) -> int:
    """A member's mtime in nanoseconds, exactly: its pax `mtime` record's
    decimal (GNU tar, bsdtar and the daemon's copies out write one with a
    fraction; tarfile reads it as a float, which at today's times is off by
    up to a few hundred nanoseconds), digits past the nanosecond dropped
    (toward the past, as GNU tar takes them). A record that is no number is
    the header's as tarfile read it. A time no time_t holds (no file can
    have it: tarfile reads a record of 1e300 as such a float) is Refused,
    naming the entry; one past 2262 a time_t holds is kept, for os.utime,
    which takes such a count of nanoseconds, and the file system to clamp."""
    record = m.pax_headers.get("mtime")
    if record is not None:
        try:
            value = decimal.Decimal(record)
            # Bounded before the conversion: "1e999999999" would make an int of a billion digits.
            if value.is_finite() and abs(value) < MAX_TIME_T:
                with decimal.localcontext() as ctx:
                    ctx.prec = 40           # a time_t's 19 digits and 9 of the fraction, whole
                    return int((value * NS).to_integral_value(decimal.ROUND_FLOOR))
        except decimal.InvalidOperation:
            pass
    if not math.isfinite(m.mtime):
        return 0
    if abs(m.mtime) >= MAX_TIME_T:
        raise Refused(f"entry {m.name!r}: mtime {m.mtime:g} s is a time no file can have (a time_t holds "
                      f"less than 2^63 s either side of 1970); give it a real one")
    return round(m.mtime * NS)


def set_mtime_ns(info: tarfile.TarInfo, ns: int) -> None:
    """Give a member to be written the mtime `ns`: whole seconds in its
    header (toward zero, as int(st_mtime)), and where there is a fraction a
    pax `mtime` record of the exact decimal, as GNU tar's posix format
    writes it. An mtime of whole seconds gets no record: a pax header costs
    1 KiB of the stream (tarfile writes one for a time before 1970 all the
    same, which ustar's field cannot hold)."""
    sec = -(-ns // NS) if ns < 0 else ns // NS
    info.mtime = sec
    if ns % NS:
        frac = f"{abs(ns) % NS:09d}".rstrip("0")
        info.pax_headers["mtime"] = f"{'-' if ns < 0 else ''}{abs(ns) // NS}.{frac}"
    else:
        info.pax_headers.pop("mtime", None)


def _what(m: tarfile.TarInfo) -> str:
    return "hard link" if m.islnk() else "symlink" if m.issym() else "file"


class Member(tarfile.TarInfo):
    """The TarInfo class of a stream read that check_end checks
    (tarfile.open(..., tarinfo=Member)): it notes on the archive a block
    that comes where a header should and is none, which tarfile's reader
    takes for the archive's end without a word, as it does an input that
    runs out at a header."""

    @classmethod
    def fromtarfile(cls, tf):
        try:
            return super().fromtarfile(tf)
        except tarfile.InvalidHeaderError as err:
            tf.invalid_header = err
            raise


def check_end(tf: tarfile.TarFile) -> None:
    """Once `tf`, read in order (`r|`, or `r:` iterated) and opened with
    tarinfo=Member, gave its last member: raise ReadError unless the archive ended with its
    end-of-archive block. tarfile ends a stream quietly where the input
    runs out at or in an entry's header, or where a block is no header (a
    damaged or spliced stream), so such an archive would pass for a whole
    one with fewer entries."""
    if tf.tarinfo is not Member:
        raise TypeError("check_end: open the archive with tarinfo=tarsafe.Member")
    bad = getattr(tf, "invalid_header", None)
    if bad is not None:
        raise tarfile.ReadError(f"a block where an entry's header should begin is none ({bad}): the archive "
                                "is damaged")
    if tf.fileobj.tell() != tf.offset + tarfile.BLOCKSIZE:
        raise tarfile.ReadError("it ends without its end-of-archive block: the archive was cut short")


def _check_parent(name: str, parent: str, seen: Seen) -> None:
    """Every directory above an entry is one the archive made (or will make
    implicitly), never a symlink or file of it."""
    path = ""
    for part in parent.split("/") if parent else ():
        path = f"{path}/{part}" if path else part
        if path in seen.others or path in seen.files:
            raise Refused(f"entry {name!r} is below {path!r}, which the archive made a symlink or file: "
                          "writing through it could leave the copied directory")
        seen.dirs.add(path)
        seen.parents.add(path)
