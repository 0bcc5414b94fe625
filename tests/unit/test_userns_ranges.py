"""Id ranges of sandbox user namespaces (dsecd/userns.py): allocation,
journaled re-reservation, exhaustion, and ids reported back to clients."""

import pytest

from dsecd import userns


def test_slots_are_disjoint_ranges_from_base():
    r = userns.RangeAllocator(1_000_000_000, 65536)
    a, b = r.allocate(), r.allocate()
    assert (a.uid, b.uid) == (1_000_000_000, 1_000_065_536)
    assert a.gid == a.uid and a.count == 65536
    assert r.slots == (2**32 - 1 - 1_000_000_000) // 65536
    assert b.uid + b.count - 1 <= userns.ID_MAX


def test_freed_slot_rests_before_reuse_and_exhaustion_is_an_error():
    r = userns.RangeAllocator(100_000, 65536, max_slots=2)
    a, b = r.allocate(), r.allocate()
    with pytest.raises(userns.RangesExhausted, match="all 2 "):
        r.allocate()
    r.release(a)
    assert r.allocate().slot == a.slot      # the only free one
    r.release(b)
    r.release(None)                          # a sandbox without a range: nothing to do


def test_reserve_restores_journaled_ranges():
    r = userns.RangeAllocator(100_000, 65536)
    old = userns.IdMap.from_record({"slot": 3, "uid": 100_000 + 3 * 65536,
                                    "gid": 100_000 + 3 * 65536, "count": 65536})
    assert r.reserve(old)
    assert all(r.allocate().slot != 3 for _ in range(5))
    with pytest.raises(ValueError, match="twice"):
        r.reserve(old)
    assert userns.IdMap.from_record(None) is None
    assert userns.IdMap.from_record(old.record()) == old


def test_a_range_of_an_earlier_configuration_is_never_overlapped():
    """userns_base moved by half a slot across a restart: the live sandbox
    keeps its ids, and the two slots they straddle stay out of use until it goes."""
    r = userns.RangeAllocator(100_000, 65536, max_slots=4)
    old = userns.IdMap(0, 100_000 - 32768, 100_000 - 32768, 65536)     # ids 67,232..132,767
    assert not r.reserve(old)
    with pytest.raises(ValueError, match="twice"):
        r.reserve(old)
    got = [r.allocate() for _ in range(3)]
    assert [m.slot for m in got] == [1, 2, 3]
    assert all(m.uid >= old.uid + old.count for m in got)
    with pytest.raises(userns.RangesExhausted, match="1 of them overlapped"):
        r.allocate()
    r.release(old)
    assert r.allocate().slot == 0
    r2 = userns.RangeAllocator(100_000, 65536, max_slots=4)
    assert not r2.reserve(userns.IdMap(9, 100_000 + 4 * 65536, 100_000 + 4 * 65536, 65536))  # past the slots
    assert r2.allocate().slot == 0


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        userns.RangeAllocator(2**32 - 10, 65536)
    with pytest.raises(ValueError):
        userns.RangeAllocator(0, 65536)


def test_host_ids_reported_as_sandbox_ids():
    m = userns.IdMap(0, 200_000, 300_000, 65536)
    assert m.to_sandbox(200_000) == 0 and m.to_sandbox(201_000) == 1000
    assert m.to_sandbox(300_005, gid=True) == 5
    assert m.to_sandbox(0) == userns.OVERFLOW_ID           # host root: unmapped inside
    assert m.to_sandbox(200_000 + 65536) == userns.OVERFLOW_ID


def test_file_op_translates_stat_and_list_results(monkeypatch):
    import contextlib

    switched = []
    # The fs-id switch itself needs root (integration tier); here only the translation.
    monkeypatch.setattr(userns, "as_sandbox_root",
                        lambda idmap: switched.append(idmap) or contextlib.nullcontext())
    m = userns.IdMap(0, 100_000, 100_000, 65536)
    out = userns.file_op(m, lambda: {"uid": 100_000, "gid": 101_000,
                                     "entries": [{"uid": 0, "gid": 100_007}]})
    assert switched == [m]
    assert (out["uid"], out["gid"]) == (0, 1000)
    assert out["entries"][0] == {"uid": userns.OVERFLOW_ID, "gid": 7}
    assert userns.file_op(None, lambda: {"uid": 7, "gid": 8}) == {"uid": 7, "gid": 8}


def _hold_ids(path, start, count):
    """Another process (as another daemon would) holding host ids start..start+count-1
    of the host-wide claims file; ended with .kill()."""
    import subprocess
    import sys

    code = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
            "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, int(sys.argv[3]), int(sys.argv[2])); "
            "print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(path), str(start), str(count)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    return p


def test_ids_another_daemon_holds_are_never_handed_out(tmp_path):
    """Two daemons of one host with the same userns_base: the second skips
    the ranges the first holds, and gets them once the first is gone (a
    kill -9 leaves no claim behind)."""
    path = tmp_path / "claims"
    other = _hold_ids(path, 100_000, 2 * 65536)         # slots 0 and 1 of the same base and size
    try:
        r = userns.RangeAllocator(100_000, 65536, max_slots=4, claims=userns.HostClaims(str(path)))
        a, b = r.allocate(), r.allocate()
        assert (a.slot, b.slot) == (2, 3)
        with pytest.raises(userns.RangesExhausted, match=rf"2 of them held by another daemon \(pid {other.pid}\)"):
            r.allocate()
        r.release(a)
        assert r.allocate() == a            # slots 0 and 1 are still the other daemon's
    finally:
        other.kill()
        other.wait()
    r.release(a)
    r.release(b)
    assert sorted(r.allocate().slot for _ in range(4)) == [0, 1, 2, 3]


def test_a_restart_claims_its_journaled_ranges_again(tmp_path):
    path = tmp_path / "claims"
    r = userns.RangeAllocator(100_000, 65536, max_slots=4, claims=userns.HostClaims(str(path)))
    journaled = [userns.IdMap(1, 100_000 + 65536, 100_000 + 65536, 65536),
                 userns.IdMap(0, 100_000 - 32768, 100_000 - 32768, 65536)]     # of an earlier base
    assert r.reserve(journaled[0]) and not r.reserve(journaled[1])
    import subprocess
    import sys

    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "[fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(a)) for a in sys.argv[2:]]")
    for m in journaled:
        ids = (m.uid, m.uid + m.count - 1)
        out = subprocess.run([sys.executable, "-c", probe, str(path), *map(str, ids)], capture_output=True)
        assert out.returncode != 0, f"{m} not claimed"
    r.release(journaled[1])
    out = subprocess.run([sys.executable, "-c", probe, str(path), str(journaled[1].uid)], capture_output=True)
    assert out.returncode == 0, out.stderr
