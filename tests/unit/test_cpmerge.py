"""The merge of a copied tree into an existing directory (dsec cp -r, as docker cp)."""

import asyncio
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from dsecd import cpmerge


def _tree(root, spec: dict) -> None:
    root.mkdir(exist_ok=True)
    for name, value in spec.items():
        if isinstance(value, dict):
            _tree(root / name, value)
        else:
            (root / name).write_text(value)


def _read(root) -> dict:
    return {p.name: _read(p) if p.is_dir() else p.read_text() for p in root.iterdir()}


def test_new_names_move_whole_shared_dirs_merge_files_replace(tmp_path):
    _tree(tmp_path / "dst", {"a": "old", "only-dst": "k", "d": {"x": "old-x", "keep": "k"}})
    _tree(tmp_path / "land", {"a": "new", "d": {"x": "new-x", "y": "y", "deep": {"z": "z"}}, "n": {"m": "m"}})
    replaced = asyncio.run(cpmerge.into_local(str(tmp_path / "land"), str(tmp_path / "dst")))
    assert replaced == 2
    assert _read(tmp_path / "dst") == {"a": "new", "only-dst": "k", "n": {"m": "m"},
                                       "d": {"x": "new-x", "keep": "k", "y": "y", "deep": {"z": "z"}}}
    assert not (tmp_path / "land").exists()            # what was merged into goes once merged


def test_directories_merged_into_take_the_copys_modes_and_mtimes(tmp_path):
    """As docker cp gives them: a directory that exists takes the mode and
    mtime of the copy's directory of that name; the top takes `top`, or
    keeps its own (SRC/.)."""
    _tree(tmp_path / "dst", {"d": {"keep": "k"}})
    _tree(tmp_path / "land", {"d": {"f": "new"}})
    os.chmod(tmp_path / "land" / "d", 0o750)
    os.utime(tmp_path / "land" / "d", (1_000_000, 1_000_000))
    os.chmod(tmp_path / "dst", 0o755)
    asyncio.run(cpmerge.into_local(str(tmp_path / "land"), str(tmp_path / "dst")))
    d = os.stat(tmp_path / "dst" / "d")
    assert (d.st_mode & 0o7777, d.st_mtime) == (0o750, 1_000_000)
    assert os.stat(tmp_path / "dst").st_mode & 0o7777 == 0o755
    _tree(tmp_path / "land", {"d": {}})
    asyncio.run(cpmerge.into_local(str(tmp_path / "land"), str(tmp_path / "dst"), (0o700, 2_000_000 * 10**9)))
    top = os.stat(tmp_path / "dst")
    assert (top.st_mode & 0o7777, top.st_mtime) == (0o700, 2_000_000)


def test_relative_paths_merge(tmp_path, monkeypatch):
    """`dsec cp -r SB:/etc/. out` (out relative to the working directory)
    failed at its first new name: "renameat2: Bad file descriptor"."""
    _tree(tmp_path / "dst", {"a": "old"})
    _tree(tmp_path / "land", {"a": "new", "b": "b"})
    monkeypatch.chdir(tmp_path)
    assert asyncio.run(cpmerge.into_local("land", "dst")) == 1
    assert _read(tmp_path / "dst") == {"a": "new", "b": "b"}


@pytest.mark.parametrize("land, there, error", [
    ({"d": "a file"}, {"d": {"x": "x"}}, IsADirectoryError),
    ({"d": {"x": "x"}}, {"d": "a file"}, NotADirectoryError),
])
def test_a_directory_against_a_file_moves_nothing(tmp_path, land, there, error):
    _tree(tmp_path / "dst", {"a": "old", **there})
    _tree(tmp_path / "land", {"a": "new", **land})
    with pytest.raises(error) as err:
        asyncio.run(cpmerge.into_local(str(tmp_path / "land"), str(tmp_path / "dst")))
    assert err.value.filename == str(tmp_path / "dst" / "d")
    assert (tmp_path / "dst" / "a").read_text() == "old"


def test_a_symlink_is_not_entered(tmp_path):
    """A link to a directory is a name like a file's: replaced by a file, never merged through."""
    _tree(tmp_path / "dst", {"real": {"x": "x"}})
    os.symlink("real", tmp_path / "dst" / "link")
    _tree(tmp_path / "land", {"link": "a file now"})
    assert asyncio.run(cpmerge.into_local(str(tmp_path / "land"), str(tmp_path / "dst"))) == 1
    assert (tmp_path / "dst" / "link").read_text() == "a file now" and not (tmp_path / "dst" / "link").is_symlink()
    _tree(tmp_path / "land2", {"real2": {"y": "y"}})
    os.symlink("real", tmp_path / "dst" / "real2")
    with pytest.raises(NotADirectoryError):
        asyncio.run(cpmerge.into_local(str(tmp_path / "land2"), str(tmp_path / "dst")))
    assert os.listdir(tmp_path / "dst" / "real") == ["x"]


def test_read_only_copied_directories_do_not_stop_a_non_root_merge(tmp_path):
    """A copy out of a sandbox keeps its directories' modes (0555): a user
    other than root must still move entries out of them."""
    base = Path(tempfile.mkdtemp(dir="/tmp")) if os.geteuid() == 0 else tmp_path   # pytest's tmp is 0700 root's
    try:
        _tree(base / "dst", {"d": {"keep": "k"}})
        _tree(base / "land", {"d": {"f": "new"}, "e": {"g": "g"}})
        for p in (base / "land" / "d", base / "land" / "e"):
            p.chmod(0o555)
        if os.geteuid() != 0:
            asyncio.run(cpmerge.into_local(str(base / "land"), str(base / "dst")))
        else:                           # root ignores modes: run it as nobody
            base.chmod(0o755)
            # The landing's parent is the user's too (dsec cp puts it inside dst): it removes the landing.
            for p in (base, *base.rglob("*")):
                os.lchown(p, 65534, 65534)
            merge = (f"import asyncio; from dsecd import cpmerge; "
                     f"asyncio.run(cpmerge.into_local({str(base / 'land')!r}, {str(base / 'dst')!r}))")
            r = subprocess.run([sys.executable, "-c", merge], user=65534, group=65534, extra_groups=[],
                               capture_output=True, cwd="/")
            assert r.returncode == 0, r.stderr
        assert _read(base / "dst") == {"d": {"keep": "k", "f": "new"}, "e": {"g": "g"}}
    finally:
        if base != tmp_path:
            shutil.rmtree(base)


def _as_a_user(base: Path, code: str) -> None:
    """Run python `code` as a user other than root (nobody, when the tests
    run as root, which ignores modes), `base` and all below it theirs."""
    if os.geteuid() != 0:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd="/")
    else:
        base.chmod(0o755)
        for p in (base, *base.rglob("*")):
            os.lchown(p, 65534, 65534)
        r = subprocess.run([sys.executable, "-c", code], user=65534, group=65534, extra_groups=[],
                           capture_output=True, cwd="/")
    assert r.returncode == 0, r.stderr


def test_a_failed_merge_out_leaves_no_landing_behind_for_a_non_root_user(tmp_path):
    """`dsec cp -r SB:/src/. dst` whose merge is refused (a directory of the
    copy against a file of dst) removes the landing it made in dst. The
    copy keeps its directories' modes: one read-only (0555) kept what it
    held, and the landing with it, in dst for a user other than root."""
    base = Path(tempfile.mkdtemp(dir="/tmp")) if os.geteuid() == 0 else tmp_path   # pytest's tmp is 0700 root's
    try:
        _tree(base / "dst", {"d": "a file"})
        _tree(base / "src", {"d": {"x": "x"}, "ro": {"f": "f", "deeper": {"g": "g"}}})
        for p in (base / "src" / "ro" / "deeper", base / "src" / "ro"):
            p.chmod(0o555)
        # The sandbox's download: the tree as it came, its modes kept.
        _as_a_user(base, f"import argparse, asyncio, shutil\n"
                         f"from dsecd import cli\n"
                         f"class Sandbox:\n"
                         f"    async def download_dir(self, src, held):\n"
                         f"        shutil.copytree({str(base / 'src')!r}, held, symlinks=True)\n"
                         f"        return {{'path': held}}\n"
                         f"try:\n"
                         f"    asyncio.run(cli._cp_merged(argparse.Namespace(json=False, owner=None), Sandbox(), "
                         f"'/src/.', {str(base / 'dst')!r}, upload=False))\n"
                         f"except NotADirectoryError:\n"
                         f"    pass\n"
                         f"else:\n"
                         f"    raise SystemExit('merged where a directory meets a file')\n")
        assert os.listdir(base / "dst") == ["d"]
    finally:
        if base != tmp_path:
            shutil.rmtree(base)


def test_a_failed_copy_out_leaves_no_temporary_directory_for_a_non_root_user(tmp_path):
    """A copy out of a sandbox (localcopy.unpack) that fails at its rename
    into place removes the directory it extracted into, whose directories
    have the archive's modes by then: one read-only (0555) kept it, and
    what it held, beside the destination for a user other than root."""
    base = Path(tempfile.mkdtemp(dir="/tmp")) if os.geteuid() == 0 else tmp_path   # pytest's tmp is 0700 root's
    try:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, mode in (("ro", 0o555), ("ro/deeper", 0o555)):
                info = tarfile.TarInfo(name)
                info.type, info.mode = tarfile.DIRTYPE, mode
                tf.addfile(info)
            info = tarfile.TarInfo("ro/deeper/f")
            info.size = 1
            tf.addfile(info, io.BytesIO(b"f"))
        (base / "copy.tar").write_bytes(buf.getvalue())
        _as_a_user(base, f"import errno, os\n"
                         f"from dsecd import localcopy\n"
                         f"from dsecd.fs import libc\n"
                         f"def refused(*_args):\n"
                         f"    raise OSError(errno.EXDEV, 'refused by the test')\n"
                         f"libc.rename_noreplace = refused\n"
                         f"try:\n"
                         f"    localcopy.unpack(open({str(base / 'copy.tar')!r}, 'rb'), {str(base / 'copy')!r})\n"
                         f"except OSError as err:\n"
                         f"    assert err.errno == errno.EXDEV, err\n"
                         f"else:\n"
                         f"    raise SystemExit('renamed into place')\n")
        assert os.listdir(base) == ["copy.tar"]
    finally:
        if base != tmp_path:
            shutil.rmtree(base)


class _FakeSandbox:
    """A sandbox's file requests over a local directory, in the order they come."""

    def __init__(self, top, attrs_unsupported: bool = False):
        self.top = str(top)
        self.calls: list[tuple] = []
        self.attrs_unsupported = attrs_unsupported

    def _local(self, path: str) -> str:
        return self.top + path

    async def list_files(self, path: str):

        with os.scandir(self._local(path)) as it:
            entries = [{"name": e.name, "type": "dir" if e.is_dir(follow_symlinks=False) else "file"} for e in it]
        return _Listing(entries)

    async def rename(self, src: str, dst: str, overwrite: bool = False):
        self.calls.append(("rename", src, dst))
        os.rename(self._local(src), self._local(dst))

    async def remove(self, path: str, recursive: bool = False):
        self.calls.append(("remove", path))
        shutil.rmtree(self._local(path))

    async def set_attrs(self, path: str, mode=None, mtime=None, follow=False):
        from dsecd.errors import Unsupported

        if self.attrs_unsupported:
            raise Unsupported("this microVM's guest agent (version 6) cannot set a file's mode or mtime")
        self.calls.append(("set_attrs", path, mode, mtime))
        os.chmod(self._local(path), mode)
        os.utime(self._local(path), (mtime, mtime))


class _Listing(list):
    truncated = False


def test_a_copy_out_does_not_replace_an_empty_directory_made_while_it_ran(tmp_path, monkeypatch):
    """localcopy.unpack checks that its destination is free, extracts beside
    it, then moves the whole into place: a plain rename there replaced an
    empty directory made at the destination meanwhile."""
    from dsecd import localcopy

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("f")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"f"))
    buf.seek(0)
    dst = tmp_path / "copy"
    real = os.path.lexists

    def made_meanwhile(path):
        if str(path) == str(dst):
            dst.mkdir(exist_ok=True)        # someone makes it just after the check
            return False
        return real(path)

    monkeypatch.setattr(localcopy.os.path, "lexists", made_meanwhile)
    with pytest.raises(localcopy.LocalCopyError, match="exists"):
        localcopy.unpack(buf, str(dst))
    assert os.listdir(dst) == [] and sorted(os.listdir(tmp_path)) == ["copy"]


def test_directories_merged_into_take_their_entries_mode_and_mtime_once_the_landing_is_gone(tmp_path):
    """GNU tar sets an existing directory's mode and mtime from the
    archive's entry for it, after what goes into it: the landing's removal
    (from the top) comes first, or it would change the top's mtime."""
    _tree(tmp_path / "dst", {"d": {"old": "o"}, "bare": {}, ".land": {"d": {"new": "n"}, "bare": {"f": "f"},
                                                                      "fresh": {"x": "x"}}})
    os.chmod(tmp_path / "dst" / "bare", 0o711)
    sb = _FakeSandbox(tmp_path)
    dirs = [["", 0o750, 1_000_000], ["d", 0o1777, 2_000_000], ["fresh", 0o700, 3_000_000]]
    asyncio.run(cpmerge.into_sandbox(sb, "/dst/.land", "/dst", dirs))
    removed = sb.calls.index(("remove", "/dst/.land"))
    sets = sorted(c for c in sb.calls if c[0] == "set_attrs")
    assert sets == [("set_attrs", "/dst", 0o750, 1_000_000), ("set_attrs", "/dst/d", 0o1777, 2_000_000)]
    assert all(sb.calls.index(c) > removed for c in sets)
    st = {n: os.stat(tmp_path / "dst" / n) for n in ("", "d", "bare")}
    assert [(oct(st[n].st_mode & 0o7777), st[n].st_mtime) for n in ("", "d")] == [("0o750", 1_000_000),
                                                                                 ("0o1777", 2_000_000)]
    assert st["bare"].st_mode & 0o7777 == 0o711          # no entry for it: its own
    assert not (tmp_path / "dst" / ".land").exists() and _read(tmp_path / "dst" / "d") == {"old": "o", "new": "n"}


def test_a_sandbox_that_cannot_set_them_merges_all_the_same_and_says_so():
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as top:
        _tree(Path(top) / "dst", {"d": {}, ".land": {"d": {"new": "n"}}})
        sb = _FakeSandbox(top, attrs_unsupported=True)
        asyncio.run(cpmerge.into_sandbox(sb, "/dst/.land", "/dst", [["d", 0o700, 1]], notes.append))
        assert _read(Path(top) / "dst") == {"d": {"new": "n"}}
    assert notes == ["the existing directories keep their modes and mtimes: this microVM's guest agent "
                     "(version 6) cannot set a file's mode or mtime"]


def test_a_put_with_too_many_directories_to_list_merges_and_says_they_keep_theirs():
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as top:
        _tree(Path(top) / "dst", {"d": {}, ".land": {"d": {"new": "n"}}})
        sb = _FakeSandbox(top)
        asyncio.run(cpmerge.into_sandbox(sb, "/dst/.land", "/dst", None, notes.append))
        assert _read(Path(top) / "dst") == {"d": {"new": "n"}}
        assert not [c for c in sb.calls if c[0] == "set_attrs"]
    assert notes == ["the tar names more directories than one result lists: the existing directories keep "
                     "their modes and mtimes"]


def test_a_merge_cancelled_during_its_moves_says_what_had_moved_in(tmp_path):
    """^C while the names move into the destination: those moved stay (the
    caller removes the landing with the rest), and the note says which, and
    how many more were under way, as a failed move's error does."""

    class _Stuck(_FakeSandbox):
        async def rename(self, src: str, dst: str, overwrite: bool = False):
            if src.endswith("f39"):
                await asyncio.Event().wait()        # never answered: the second batch hangs
            await super().rename(src, dst, overwrite)

    _tree(tmp_path / "dst", {".land": {f"f{n:02}": "x" for n in range(40)}})
    notes: list[str] = []

    async def go() -> None:
        merge = asyncio.ensure_future(cpmerge.into_sandbox(_Stuck(tmp_path), "/dst/.land", "/dst", [],
                                                           notes.append))
        while len(os.listdir(tmp_path / "dst")) < 1 + 39:       # all but the stuck one moved in
            await asyncio.sleep(0.01)
        merge.cancel()
        with pytest.raises(asyncio.CancelledError):
            await merge

    asyncio.run(go())
    assert len(notes) == 1 and notes[0].startswith("cancelled while merging into /dst: 32 of 40 names had "
                                                   "moved in (/dst/f00, /dst/f01, "), notes
    assert "up to 8 more whose moves were under way" in notes[0], notes


def test_a_connection_lost_under_the_moves_stays_the_error_it_was(tmp_path):
    """A lost connection is the client's own failure, which the CLI tells
    as such (`unreachable`): the merge does not make it another error.
    (The daemon removes the landing, a temporary put's, once the
    connection is gone.)"""
    from dsecd.errors import ConnectionLost

    class _Cut(_FakeSandbox):
        async def rename(self, src: str, dst: str, overwrite: bool = False):
            raise ConnectionLost("connection to dsecd lost", op="file_rename", sent=True)

    _tree(tmp_path / "dst", {".land": {"a": "a"}})
    with pytest.raises(ConnectionLost) as info:
        asyncio.run(cpmerge.into_sandbox(_Cut(tmp_path), "/dst/.land", "/dst", []))
    assert info.value.op == "file_rename"
