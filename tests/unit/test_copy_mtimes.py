"""A copy out of a sandbox keeps mtimes to the nanosecond, as GNU tar does
with a pax `mtime` record (a decimal with a fraction): the container
backend's tar of a tree (dsecd/fs/tarcopy.py TreeTar, run against a plain
directory as the root), the SDK's unpack of one (dsecd/localcopy.py) and
the tar `dsec cp SB:/dir -` writes (dsecd/cptar.py). An entry of whole
seconds gets no pax header: each costs 1 KiB of the stream. A copy in
takes such a record to the nanosecond too: the container backend's
unpack (tarcopy.put_tree) and the records a microVM's agent is sent
(dsecd/engine/vmfiles.py _put_records)."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import tarfile

import pytest

from dsecd import cptar, localcopy, tarsafe
from dsecd.backends.microvm import wire
from dsecd.engine.vmfiles import _put_records
from dsecd.fs import tarcopy

NS = 10**9
FRACTION = 981173106_123456789           # 2001-02-03 04:05:06.123456789 UTC
WHOLE = 981173106 * NS
BEFORE_1970 = -100 * NS - 250_000_000    # -100.25 s
SHOWN = "2001-02-03 04:05:06.123456789"  # as tar --full-time lists FRACTION in UTC


def _tree(root) -> str:
    """top/{d/f, d/link -> f, whole, old}: top, d, f and link at FRACTION."""
    top = os.path.join(root, "top")
    os.makedirs(os.path.join(top, "d"))
    for name, ns in (("d/f", FRACTION), ("whole", WHOLE), ("old", BEFORE_1970)):
        with open(os.path.join(top, name), "wb") as f:
            f.write(b"data")
        os.utime(os.path.join(top, name), ns=(ns, ns))
    os.symlink("f", os.path.join(top, "d", "link"))
    os.utime(os.path.join(top, "d", "link"), ns=(FRACTION, FRACTION), follow_symlinks=False)
    for d in ("d", ""):
        os.utime(os.path.join(top, d), ns=(FRACTION, FRACTION))
    return top


def _tree_tar(root) -> bytes:
    top = _tree(root)
    tar = tarcopy.TreeTar(os.open("/", os.O_RDONLY | os.O_DIRECTORY), top, 1 << 20, 100, 1 << 20)
    try:
        out = b""
        while data := tar.read():
            out += data
    finally:
        tar.close()
    return out


def _pax_headers(data: bytes) -> int:
    """How many pax extended headers (typeflag 'x') the tar holds."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tf:
        members = list(tf)
        blocks = tf.offset // tarfile.BLOCKSIZE
    # Each member's own header and data blocks, the rest are pax headers and their records.
    own = sum(1 + (m.size + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE for m in members)
    return (blocks - own) // 2


def _listed(data: bytes, tmp_path) -> str:
    path = tmp_path / "out.tar"
    path.write_bytes(data)
    r = subprocess.run(["tar", "--full-time", "-tvf", str(path)], capture_output=True, text=True,
                       env={**os.environ, "TZ": "UTC"}, check=True)
    assert not r.stderr, r.stderr
    return r.stdout


def test_a_tree_tar_keeps_the_nanoseconds_in_pax_records_only_where_there_is_a_fraction(tmp_path):
    data = _tree_tar(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tf:
        got = {m.name: tarsafe.mtime_ns(m) for m in tf}
    assert got == {".": FRACTION, "d": FRACTION, "d/f": FRACTION, "d/link": FRACTION, "old": BEFORE_1970,
                   "whole": WHOLE}, got
    # top, d, d/f, d/link, old (before 1970: a record, as before); none for whole.
    assert _pax_headers(data) == 5
    listing = _listed(data, tmp_path)
    for name in ("./", "d/", "d/f", "d/link -> f"):
        assert f"{SHOWN} {name}\n" in listing, listing


def test_the_sdks_unpack_sets_the_nanoseconds_on_files_directories_and_symlinks(tmp_path):
    data = _tree_tar(tmp_path / "src")
    localcopy.unpack(io.BytesIO(data), str(tmp_path / "copy"))
    got = {rel: os.lstat(tmp_path / "copy" / rel).st_mtime_ns for rel in ("", "d", "d/f", "d/link", "whole", "old")}
    assert got == {"": FRACTION, "d": FRACTION, "d/f": FRACTION, "d/link": FRACTION, "whole": WHOLE,
                   "old": BEFORE_1970}, got


def test_the_sdks_unpack_sets_the_nanoseconds_of_a_gnu_tar_pax_archive(tmp_path):
    top = _tree(tmp_path / "src")
    data = subprocess.run(["tar", "--format=posix", "-cf", "-", "-C", top, "."], capture_output=True,
                          check=True).stdout
    localcopy.unpack(io.BytesIO(data), str(tmp_path / "copy"))
    got = {rel: os.lstat(tmp_path / "copy" / rel).st_mtime_ns for rel in ("", "d", "d/f", "d/link", "whole")}
    assert got == {"": FRACTION, "d": FRACTION, "d/f": FRACTION, "d/link": FRACTION, "whole": WHOLE}, got


def test_the_tar_dsec_cp_writes_to_stdout_keeps_the_nanoseconds(tmp_path):
    data = _tree_tar(tmp_path / "src")
    out = tmp_path / "renamed.tar"
    with open(out, "wb") as f:
        cptar._retar(io.BytesIO(data), "top", f.fileno())
    with tarfile.open(out) as tf:
        got = {m.name: tarsafe.mtime_ns(m) for m in tf}
    assert got == {"top": FRACTION, "top/d": FRACTION, "top/d/f": FRACTION, "top/d/link": FRACTION,
                   "top/old": BEFORE_1970, "top/whole": WHOLE}, got
    assert _pax_headers(out.read_bytes()) == 5
    listing = _listed(out.read_bytes(), tmp_path)
    for name in ("top/", "top/d/", "top/d/f", "top/d/link -> f"):
        assert f"{SHOWN} {name}\n" in listing, listing


@pytest.mark.parametrize("record, ns", [("981173106.123456789", FRACTION), ("981173106", WHOLE),
                                        ("-100.25", BEFORE_1970), ("981173106.1234567891", FRACTION),
                                        ("-0.000000001", -1)])
def test_a_pax_mtime_record_is_read_to_the_nanosecond(record, ns):
    m = tarfile.TarInfo("f")
    m.pax_headers = {"mtime": record}
    m.mtime = float(record)         # as tarfile's reader sets it
    assert tarsafe.mtime_ns(m) == ns


def test_a_pax_mtime_record_that_is_no_number_falls_back_to_the_header():
    m = tarfile.TarInfo("f")
    m.pax_headers = {"mtime": "soon"}
    m.mtime = 0                     # tarfile's reader takes such a record as 0
    assert tarsafe.mtime_ns(m) == 0


def _gnu_tar(root) -> bytes:
    """_tree's tree as GNU tar's posix format archives it (pax mtime records)."""
    return subprocess.run(["tar", "--format=posix", "-cf", "-", "-C", _tree(root), "."], capture_output=True,
                          check=True).stdout


def test_a_containers_copy_in_sets_the_nanoseconds_of_a_pax_archive(tmp_path):
    """tarfile reads the record as a float: 04:05:06.123456789 became
    .123456835 before the unpack read the record itself."""
    data = _gnu_tar(tmp_path / "src")
    (tmp_path / "root").mkdir()
    fd = os.open(tmp_path / "root", os.O_RDONLY | os.O_DIRECTORY)
    try:
        tarcopy.put_tree(fd, "/copy", io.BytesIO(data), 100, 1 << 20)
    finally:
        os.close(fd)
    copy = tmp_path / "root" / "copy"
    got = {rel: os.lstat(copy / rel).st_mtime_ns for rel in ("", "d", "d/f", "d/link", "whole")}
    assert got == {"": FRACTION, "d": FRACTION, "d/f": FRACTION, "d/link": FRACTION, "whole": WHOLE}, got


def _stamps(stream: bytes) -> dict[str, int]:
    """The mtime (ns, signed) of each record of a microVM put that has one:
    kind, name, mode, stamp, size, then a file's data."""
    stamps, at = {}, 0
    while at < len(stream):
        kind = stream[at:at + 1]
        (n,) = struct.unpack_from(">I", stream, at + 1)
        name = stream[at + 5:at + 5 + n].decode()
        _mode, stamp, size = struct.unpack_from(">IQQ", stream, at + 5 + n)
        at += 5 + n + 20 + (size if kind in (b"f", b"s", b"h") else 0)
        if kind in (b"f", b"s", b"D") and stamp != wire.PUT_NO_MTIME:
            stamps[name] = stamp - 2**64 if stamp >= 2**63 else stamp
    return stamps


def test_a_microvm_copy_in_sends_the_nanoseconds_of_a_pax_archive(tmp_path):
    sent = bytearray()
    _put_records(io.BytesIO(_gnu_tar(tmp_path / "src")), lambda data, eof: sent.extend(data), 100, 1 << 20,
                 agent_version=wire.TIMES_AGENT_VERSION)
    got = _stamps(bytes(sent))
    assert {rel: got.get(rel) for rel in ("", "d", "d/f", "d/link", "whole", "old")} == {
        "": FRACTION, "d": FRACTION, "d/f": FRACTION, "d/link": FRACTION, "whole": WHOLE,
        "old": BEFORE_1970}, got



def _wide_stamps(stream: bytes) -> dict[str, tuple[int, int] | None]:
    """Each record's mtime in a put to an agent told "ts": (signed seconds,
    nanoseconds), None for none; kind, name, mode, seconds, nanoseconds,
    size, then a file's data."""
    stamps, at = {}, 0
    while at < len(stream):
        kind = stream[at:at + 1]
        (n,) = struct.unpack_from(">I", stream, at + 1)
        name = stream[at + 5:at + 5 + n].decode()
        _mode, sec, nsec, size = struct.unpack_from(">IqIQ", stream, at + 5 + n)
        at += 5 + n + 24 + (size if kind in (b"f", b"s", b"h") else 0)
        if kind in (b"f", b"s", b"D"):
            stamps[name] = None if nsec == wire.PUT_TS_NO_MTIME else (sec, nsec)
    return stamps


FAR = "10413792000.123456789"           # 2300-01-01 00:00:00.123456789 UTC: past 2262, 2**63 ns
LONG_AGO = "-11676096000.25"            # 1600-01-01 00:00:00.25 UTC: before 1677, -2**63 ns


def _tar_of_times(*records: tuple[str, str]) -> bytes:
    """Directory `d` at the first pax mtime record, then a file of each (name, record)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        d = tarfile.TarInfo("d")
        d.type, d.mode, d.pax_headers = tarfile.DIRTYPE, 0o755, {"mtime": records[0][1]}
        tf.addfile(d)
        for name, record in records:
            f = tarfile.TarInfo(f"d/{name}")
            f.size, f.mode, f.pax_headers = 4, 0o644, {"mtime": record}
            tf.addfile(f, io.BytesIO(b"data"))
    return out.getvalue()


def test_a_microvm_copy_in_sends_times_64_bit_nanoseconds_do_not_hold_whole():
    """Past 2262 and before 1677 the nanoseconds pass 2**63: sent as such,
    they wrapped (2300 became 1715). An agent told "ts" takes seconds and
    nanoseconds apart, as the container backend's os.utime does."""
    sent = bytearray()
    _put_records(io.BytesIO(_tar_of_times(("far", FAR), ("long-ago", LONG_AGO), ("fraction", "981173106.5"))),
                 lambda data, eof: sent.extend(data), 100, 1 << 20, agent_version=wire.WIDE_TIMES_AGENT_VERSION)
    assert _wide_stamps(bytes(sent)) == {
        "d/far": (10413792000, 123456789), "d/long-ago": (-11676096001, 750_000_000),
        "d/fraction": (981173106, 500_000_000), "d": (10413792000, 123456789), "": None}


@pytest.mark.parametrize("record", [FAR, LONG_AGO])
@pytest.mark.parametrize("where", ["d/f", "d"])
def test_a_time_64_bit_nanoseconds_do_not_hold_is_refused_to_an_agent_that_takes_only_them(record, where):
    """Agents of versions 9 to 12 take signed nanoseconds in 64 bits: such
    a time is refused, naming the entry (a directory's at its entry, not
    after the tree, when its mode and mtime go)."""
    tar = _tar_of_times(("f", record)) if where == "d" else _tar_of_times(("ok", "981173106.5"), ("f", record))
    with pytest.raises(tarsafe.Refused, match=rf"entry '{where}': .*1677-09-21 to 2262-04-11.*version 13 sets any"):
        _put_records(io.BytesIO(tar), lambda data, eof: None, 100, 1 << 20,
                     agent_version=wire.WIDE_TIMES_AGENT_VERSION - 1)


def test_an_agent_of_whole_seconds_gets_a_time_past_2262_in_seconds():
    sent = bytearray()
    _put_records(io.BytesIO(_tar_of_times(("far", FAR))), lambda data, eof: sent.extend(data), 100, 1 << 20,
                 agent_version=wire.TIMES_AGENT_VERSION - 1)
    name = b"d/far"
    at = sent.index(b"f" + struct.pack(">I", len(name)) + name) + 5 + len(name)
    assert struct.unpack_from(">IQ", sent, at)[1] == 10413792000


def _tar_at(record: str) -> bytes:
    """One file `f` whose pax mtime record is `record`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        f = tarfile.TarInfo("f")
        f.size, f.mode, f.pax_headers = 4, 0o644, {"mtime": record}
        tf.addfile(f, io.BytesIO(b"data"))
    return out.getvalue()


def test_a_copy_in_of_an_mtime_no_file_can_have_is_refused_naming_it(tmp_path):
    """tarfile reads a pax record of 1e300 as a float whose nanoseconds
    overflow: it was an OverflowError (the client told `internal`), now
    the entry is refused; a far time a time_t holds is still taken."""
    with pytest.raises(tarsafe.Refused) as e:
        tarsafe.mtime_ns(tarfile.open(fileobj=io.BytesIO(_tar_at("1e300"))).next())
    assert "'f'" in e.value.args[0] and "mtime" in e.value.args[0]
    (tmp_path / "root").mkdir()
    fd = os.open(tmp_path / "root", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(tarcopy.PathError, match="mtime"):
            tarcopy.put_tree(fd, "/copy", io.BytesIO(_tar_at("1e300")), 100, 1 << 20)
    finally:
        os.close(fd)
    far = tarfile.open(fileobj=io.BytesIO(_tar_at("32503680000.5"))).next()       # the year 3000
    assert tarsafe.mtime_ns(far) == 32503680000 * NS + NS // 2
