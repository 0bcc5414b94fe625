"""The records of copies' temporary names (dsecd/fs/copytemps.py), against a
plain directory as a sandbox's root: what a restart removes, and what not."""

from __future__ import annotations

import os

from dsecd.fs.copytemps import CopyTemps, remove_if_same


def _root(tmp_path):
    root = tmp_path / "root"
    (root / "work").mkdir(parents=True)
    return root, os.open(root, os.O_RDONLY | os.O_DIRECTORY)


def test_the_recorded_inode_goes_and_a_file_that_took_its_name_stays(tmp_path):
    root, fd = _root(tmp_path)
    temps = CopyTemps(tmp_path / "state" / "copy-temps")
    try:
        (root / "work/.dsec-put-1").mkdir()
        (root / "work/.dsec-put-1/f").write_text("part")
        (root / "work/.dsec-2").write_text("part")
        for name in (".dsec-put-1", ".dsec-2"):
            temps.add("sb1", f"/work/{name}", os.lstat(root / "work" / name))
        os.rename(root / "work/.dsec-2", root / "work/kept")      # the sandbox moved it: it is its file now
        (root / "work/.dsec-2").write_text("the user's")         # and a new one took the name
        recs = temps.load()
        assert sorted(r["path"] for _, r in recs) == ["/work/.dsec-2", "/work/.dsec-put-1"]
        assert [remove_if_same(fd, r["path"], r["dev"], r["ino"]) for _, r in sorted(recs, key=lambda x: x[1]["path"])] \
            == [False, True]
        assert sorted(os.listdir(root / "work")) == [".dsec-2", "kept"]
        assert remove_if_same(fd, "/work/gone/.dsec-3", 1, 1) is False
        for path, _ in recs:
            temps.drop(path)
        assert temps.load() == []
    finally:
        os.close(fd)


def test_a_half_written_or_unreadable_record_is_not_acted_on(tmp_path):
    temps = CopyTemps(tmp_path)
    (tmp_path / "sb.1.part").write_text("{")
    (tmp_path / "sb.2.json").write_text("{not json")
    # Damaged into other JSON: a start that loads it failed on it.
    (tmp_path / "sb.3.json").write_text('["sandbox", "path", "dev", "ino"]')
    (tmp_path / "sb.4.json").write_text("5")
    (tmp_path / "sb.5.json").write_text('{"sandbox": "sb", "path": 7, "dev": 1, "ino": 2}')
    assert temps.load() == [(tmp_path / f"sb.{n}.json", None) for n in (2, 3, 4, 5)]
    assert not (tmp_path / "sb.1.part").exists()
    assert CopyTemps(tmp_path / "missing").load() == []


def test_a_destroyed_sandboxs_records_go_with_it(tmp_path):
    """A temporary file's record lasted until its writer's connection
    closed, though its sandbox (and the file) were destroyed: an SDK
    connection open for days kept the record, its file in the state dir
    and its close hook. They go at the sandbox's destroyed event."""
    from types import SimpleNamespace

    from dsecd.engine.events import EventBus
    from dsecd.engine.files import FileService

    temps = CopyTemps(tmp_path / "copy-temps")
    st = os.lstat(tmp_path)
    events = EventBus(named=lambda sb_id: sb_id)
    svc = FileService(registry=None, workers=SimpleNamespace(behind=lambda fn, *args: fn(*args)),
                      ensure_running=None, max_chunk=1 << 20, copy_by_init=None, temps=temps, events=events)
    forgotten = []
    for sb_id in ("sb1", "sb2"):
        rec = temps.record(sb_id, "/work/.dsec-1", st)
        svc._temp_records[(sb_id, "/work/.dsec-1")] = (rec, lambda sb_id=sb_id: forgotten.append(sb_id))
    events.publish("paused", "sb1")
    assert len(temps.load()) == 2 and forgotten == []
    events.publish("destroyed", "sb1")
    assert forgotten == ["sb1"] and list(svc._temp_records) == [("sb2", "/work/.dsec-1")]
    assert [r["sandbox"] for _, r in temps.load()] == ["sb2"]
