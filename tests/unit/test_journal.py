import json

from dsecd.journal import Journal


def test_write_load_delete(tmp_path):
    j = Journal(tmp_path / "j", fsync=True)
    j.write("abc", {"state": "running"})
    j.write("abc", {"state": "dead"})
    j.write("def", {"state": "creating"})
    assert j.load_all() == {"abc": {"state": "dead"}, "def": {"state": "creating"}}
    j.delete("abc")
    j.delete("abc")     # idempotent
    assert set(j.load_all()) == {"def"}


def test_interrupted_write_leaves_old_record_and_tmp_is_swept(tmp_path):
    j = Journal(tmp_path / "j")
    j.write("abc", {"state": "running"})
    (tmp_path / "j" / ".abc.json.tmp").write_text('{"state": "dea')   # crash before rename
    assert j.load_all() == {"abc": {"state": "running"}}
    assert not (tmp_path / "j" / ".abc.json.tmp").exists()


def test_corrupt_record_is_moved_aside(tmp_path):
    j = Journal(tmp_path / "j")
    (tmp_path / "j" / "bad.json").write_text("{not json")
    j.write("ok", {"a": 1})
    assert j.load_all() == {"ok": {"a": 1}}
    assert (tmp_path / "j" / "bad.json.corrupt").exists()
    assert json.loads((tmp_path / "j" / "ok.json").read_text()) == {"a": 1}
