"""The merge of a copied tree into an existing directory (dsec cp -r, as docker cp)."""

import asyncio
import os
import shutil
import subprocess
import sys
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
    assert _read(tmp_path / "land") == {"d": {}}       # what was merged into stays for the caller to remove


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
            for p in base.rglob("*"):
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
