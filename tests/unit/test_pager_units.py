"""dsecd.fs.pager without FUSE: config validation, argv, digests, the .stats
format and the mountinfo parser (fixture text)."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

from dsecd.fs import pager as pg

HEX = "ab" * 32


def cfg(**kw) -> pg.PagerConfig:
    base = dict(store_dir="/s/blobs/sha256", cache_dir="/c", mountpoint="/m")
    base.update(kw)
    return pg.PagerConfig(**base)


def test_argv_carries_every_setting():
    argv = cfg(chunk_size=65536, cache_max_bytes=10, readahead_chunks=3, bandwidth_bps=125,
               latency_us=1000, threads=4, readahead_threads=1, direct_io=True).argv("/bin/p", 7)
    assert argv[0] == "/bin/p" and argv[-1] == "/m"
    pairs = dict(zip(argv[1:-2:2], argv[2:-1:2], strict=False))
    assert pairs["--store"] == "/s/blobs/sha256" and pairs["--cache"] == "/c"
    assert pairs["--chunk-size"] == "65536" and pairs["--cache-max"] == "10"
    assert pairs["--readahead"] == "3" and pairs["--bandwidth"] == "125"
    assert pairs["--latency-us"] == "1000" and pairs["--ready-fd"] == "7"
    assert "--direct-io" in argv
    assert "--direct-io" not in cfg(direct_io=False).argv("/bin/p", 7)
    with_log = cfg(log_path="/l").argv("/bin/p", 7)
    assert with_log[with_log.index("--log") + 1] == "/l" and "--log" not in argv


@pytest.mark.parametrize("kw", [
    dict(chunk_size=1000), dict(chunk_size=2048), dict(chunk_size=3 << 20),
    dict(chunk_size=2 << 30), dict(store_dir="rel"), dict(mountpoint="m"),
    dict(readahead_chunks=-1), dict(readahead_chunks=2000), dict(threads=0),
    dict(bandwidth_bps=-1), dict(cache_max_bytes=-5),
])
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        cfg(**kw)


def test_blob_hex_and_path():
    assert pg.blob_hex(HEX) == HEX
    assert pg.blob_hex("sha256:" + HEX) == HEX
    for bad in ("", "sha512:" + HEX, HEX.upper(), HEX[:-1], HEX + "0", "../" + HEX[3:]):
        with pytest.raises(ValueError):
            pg.blob_hex(bad)
    assert pg.Pager(cfg()).blob_path("sha256:" + HEX) == "/m/" + HEX


def stats_doc(**blob) -> str:
    b = dict(size=10, chunks=1, cached_chunks=1, kernel_read_bytes=10, reads=1,
             fetched_bytes=10, fetches=1, chunk_hits=0, chunk_misses=1, readahead_chunks=0,
             evictions=0, errors=0)
    b.update(blob)
    return json.dumps({"version": 1, "pid": 42, "chunk_size": 1 << 20, "cache_max": 0,
                       "cache_used": 10, "readahead": 4, "bandwidth": 0, "latency_us": 0,
                       "blobs": {HEX: b}})


def test_parse_stats():
    s = pg.parse_stats(stats_doc(chunk_hits=5))
    assert s.pid == 42 and s.cache_used == 10
    assert s.blobs[HEX] == pg.BlobStats(10, 1, 1, 10, 1, 10, 1, 5, 1, 0, 0, 0)
    assert s.log_reopen is False        # a pager built before it reopened its log
    assert pg.parse_stats(stats_doc().replace('"latency_us": 0', '"latency_us": 0, "log_reopen": true')).log_reopen


def test_parse_stats_fetch_latency():
    doc = json.loads(stats_doc())
    doc["fetch_latency"] = {"bounds_ns": [10_000, 25_000, 50_000], "counts": [0, 3, 1, 2], "sum_ns": 9_000_000}
    lat = pg.parse_stats(json.dumps(doc)).fetch_latency
    assert lat == pg.LatencyHistogram((10_000, 25_000, 50_000), (0, 3, 1, 2), 9_000_000) and lat.count == 6
    assert pg.parse_stats(stats_doc()).fetch_latency is None      # a pager older than the histogram
    for bad in ({"bounds_ns": [1, 2], "counts": [0, 1], "sum_ns": 0},
                {"bounds_ns": [2, 1], "counts": [0, 1, 0], "sum_ns": 0}):
        doc["fetch_latency"] = bad
        with pytest.raises(ValueError, match="latency histogram"):
            pg.parse_stats(json.dumps(doc))


def test_parse_stats_refuses_other_versions_and_missing_counters():
    with pytest.raises(ValueError):
        pg.parse_stats(json.dumps({"version": 2}))
    doc = json.loads(stats_doc())
    del doc["blobs"][HEX]["evictions"]
    with pytest.raises(KeyError):
        pg.parse_stats(json.dumps(doc))


def test_pager_mounts_counts_stacked_pager_mounts_only(tmp_path):
    mnt = tmp_path / "pager mnt"
    mnt.mkdir()
    esc = str(mnt).replace(" ", "\\040")
    (tmp_path / "mountinfo").write_text(
        f"30 1 0:25 / / rw - ext4 /dev/vda rw\n"
        f"58 30 0:88 / {esc} ro,nosuid - fuse.dsec-pager dsec-pager ro,user_id=0\n"
        f"59 58 0:89 / {esc} ro,nosuid - fuse.dsec-pager dsec-pager ro,user_id=0\n"
        f"60 30 0:90 / {esc}2 ro - fuse.dsec-pager dsec-pager ro\n"
        f"61 30 0:91 / {tmp_path} rw - fuse.sshfs host: rw\n")
    assert pg.pager_mounts(str(mnt), str(tmp_path / "mountinfo")) == 2
    assert pg.pager_mounts(str(tmp_path), str(tmp_path / "mountinfo")) == 0


def test_start_without_binary_says_so(tmp_path):
    p = pg.Pager(cfg(mountpoint=str(tmp_path / "m"), cache_dir=str(tmp_path / "c"),
                     store_dir=str(tmp_path)), binary=str(tmp_path / "nope"))
    with pytest.raises(pg.PagerError) as exc:
        p.start()
    assert "not built" in str(exc.value) and exc.value.errno == 2


def _recorded(tmp_path, stats_pid: int | None) -> pg.Pager:
    """A Pager whose pid file names this test process and whose mountpoint
    holds a plain .stats file claiming `stats_pid` (None: no .stats)."""
    mnt = tmp_path / "m"
    mnt.mkdir()
    if stats_pid is not None:
        (mnt / ".stats").write_text(stats_doc().replace('"pid": 42', f'"pid": {stats_pid}'))
    p = pg.Pager(cfg(mountpoint=str(mnt), cache_dir=str(tmp_path / "c"), store_dir=str(tmp_path)),
                 binary=str(tmp_path / "nope"))
    (tmp_path / "m.pid").write_text(f"{os.getpid()}\n")
    assert p.config.pid_file == str(tmp_path / "m.pid")
    return p


def test_a_recorded_pid_is_adopted_through_its_root_when_its_stats_answer_with_it(tmp_path):
    p = _recorded(tmp_path, os.getpid())
    try:
        p.start()                 # adopts: nothing is spawned (the binary does not exist)
        assert p.pid == os.getpid()
        assert p.blob_path(HEX) == f"/proc/{os.getpid()}/root{tmp_path}/m/{HEX}"
    finally:
        p._forget_process()
    assert p.blob_path(HEX) == f"{tmp_path}/m/{HEX}"


@pytest.mark.parametrize("stats_pid", [None, 42])
def test_a_recorded_pid_that_is_not_the_pager_answering_is_not_adopted(tmp_path, stats_pid):
    p = _recorded(tmp_path, stats_pid)
    with pytest.raises(pg.PagerError) as exc:
        p.start()                 # not adopted: it tries to spawn one
    assert "not built" in str(exc.value)
    assert p.pid is None and p.blob_path(HEX) == f"{tmp_path}/m/{HEX}"


def test_the_pagers_log_is_rotated_past_its_cap_and_its_writer_goes_on_at_the_start(tmp_path):
    """The pager writes its log for days through an O_APPEND fd it got at
    start: past log_max_bytes the log is copied to <log>.1 and emptied, and
    the writer's next line lands at the start of the empty file."""
    path = tmp_path / "pager.log"
    p = pg.Pager(cfg(log_path=str(path), log_max_bytes=100), binary="/nonexistent")
    with open(path, "ab", buffering=0) as writer:          # as Pager.start opens the pager's stderr
        writer.write(b"a" * 100)
        assert p.rotate_log() is False and path.stat().st_size == 100      # at the cap, not past it
        writer.write(b"b\n")
        assert p.rotate_log() is True
        assert (tmp_path / "pager.log.1").read_bytes() == b"a" * 100 + b"b\n" and path.stat().st_size == 0
        writer.write(b"next\n")
    assert path.read_bytes() == b"next\n"


def test_the_pagers_log_is_emptied_even_when_its_copy_cannot_be_written(tmp_path):
    path = tmp_path / "pager.log"
    path.write_bytes(b"x" * 200)
    (tmp_path / "pager.log.1.tmp").mkdir()                  # the copy cannot be written there
    p = pg.Pager(cfg(log_path=str(path), log_max_bytes=100), binary="/nonexistent")
    assert p.rotate_log() is True and path.stat().st_size == 0


def test_the_pagers_log_is_capped_by_default():
    from dsecd.config import load_config

    c = load_config()
    assert c.size("pager", "log_max_bytes") > 0
    assert pg.Pager(cfg(log_path="/l", log_max_bytes=0), binary="/x").rotate_log() is False


def test_the_pagers_cache_is_capped_by_default_at_a_share_of_its_file_system(tmp_path):
    from dsecd.config import ConfigError, load_config

    default = load_config().section("pager")["cache_max_bytes"]
    st = os.statvfs(tmp_path)
    # The cache dir is made at the pager's start: its parent's file system until then.
    cap = pg.cache_cap(default, str(tmp_path / "state" / "pager-cache"))
    assert cap == int(st.f_blocks * st.f_frsize * pg.CACHE_AUTO_SHARE) and cap > 0
    assert pg.cache_cap("10G", "/nonexistent") == 10 << 30 and pg.cache_cap(0, "/x") == 0
    f = tmp_path / "c.toml"
    for text in ('"auto"', '"20G"', "0"):
        f.write_text(f"[pager]\ncache_max_bytes = {text}\n")
        load_config(str(f))
    f.write_text('[pager]\ncache_max_bytes = "lots"\n')
    with pytest.raises(ConfigError, match="pager.cache_max_bytes' must be a size .* or \"auto\""):
        load_config(str(f))


def test_a_pager_log_that_cannot_be_rotated_is_left_and_says_so(tmp_path, caplog):
    """Pager.start rotates the log first: a log path that is no regular file
    (a directory, a FIFO: nothing a copy and truncation could cap) is left
    as it is, and one that cannot be looked at (a symlink loop) is left and
    logged, never an error that stops the pager's start."""
    odd = tmp_path / "pager.log"
    odd.mkdir()
    assert pg.Pager(cfg(log_path=str(odd), log_max_bytes=1), binary="/x").rotate_log() is False
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert pg.Pager(cfg(log_path=str(fifo), log_max_bytes=1), binary="/x").rotate_log() is False
    assert odd.is_dir() and fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["fifo.log", "pager.log"]
    link = tmp_path / "loop.log"
    link.symlink_to(link)
    assert pg.Pager(cfg(log_path=str(link), log_max_bytes=1), binary="/x").rotate_log() is False
    assert f"pager log {link}" in caplog.text and "not rotated" in caplog.text


def test_two_rotations_of_the_pagers_log_at_once_take_turns(tmp_path, monkeypatch, caplog):
    """A pager's start and the periodic check may rotate at once, on two
    threads: they shared one temp copy, so one's rename failed and the
    other could copy the log just emptied over the kept one."""
    import threading

    path = tmp_path / "pager.log"
    path.write_bytes(b"line\n" * 100)
    p = pg.Pager(cfg(log_path=str(path), log_max_bytes=100), binary="/nonexistent")
    copy, active, overlapped, waited = pg.shutil.copyfile, [0], [], []
    count = threading.Lock()
    second = threading.Event()

    def watched_copy(src, dst):
        with count:
            active[0] += 1
            if active[0] > 1:
                overlapped.append(dst)
                second.set()
        try:
            if not waited:          # the first copy waits for a second beside it, which comes unless they take turns
                waited.append(dst)
                second.wait(1)
            return copy(src, dst)
        finally:
            with count:
                active[0] -= 1

    monkeypatch.setattr(pg.shutil, "copyfile", watched_copy)
    results = []
    threads = [threading.Thread(target=lambda: results.append(p.rotate_log())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlapped == [] and sorted(results) == [False, True]
    assert (tmp_path / "pager.log.1").read_bytes() == b"line\n" * 100 and path.stat().st_size == 0
    assert "cannot keep a copy" not in caplog.text


class _DyingPager(pg.Pager):
    """A pager whose process 'dies' at every wait, and whose restart only counts."""

    def _wait_exit(self, timeout):
        return True

    def restart(self):
        self.generation += 1


def test_supervision_goes_on_when_the_daemons_follow_up_of_a_restart_fails(tmp_path):
    cfg = pg.PagerConfig(store_dir=str(tmp_path / "s"), cache_dir=str(tmp_path / "c"),
                      mountpoint=str(tmp_path / "m"), max_restarts=100)
    pager = _DyingPager(cfg, binary="/nonexistent")
    stop = threading.Event()
    seen = []

    def on_restart(generation):
        seen.append(generation)
        if len(seen) >= 3:
            stop.set()
        raise RuntimeError("dictionary changed size during iteration")

    pager.supervise(stop, on_restart, poll_s=0)
    assert seen == [1, 2, 3]


FAKE_PAGER = """
import os, sys, time
# Stands for dsec-pager: says a line on its stderr, then "ready" on --ready-fd.
print("fake pager says hello", file=sys.stderr, flush=True)
os.write(int(sys.argv[sys.argv.index("--ready-fd") + 1]), b"ready\\n")
time.sleep(600)
"""


def _fake_pager(tmp_path, log_path: str) -> pg.Pager:
    binary = tmp_path / "fake-pager"
    binary.write_text(f"#!{sys.executable}\n{FAKE_PAGER}")
    binary.chmod(0o755)
    return pg.Pager(cfg(mountpoint=str(tmp_path / "m"), cache_dir=str(tmp_path / "c"), store_dir=str(tmp_path),
                        log_path=log_path, log_max_bytes=1 << 20), binary=str(binary))


def test_a_pager_log_that_is_a_fifo_does_not_hang_the_pagers_start(tmp_path, caplog, capfd):
    """A FIFO at the log's path (nobody reading it) blocked the open of the
    pager's stderr, and so the daemon's start, for good. The log must be a
    regular file: anything else is said, left as it is, and the pager's
    lines go to the daemon's own stderr."""
    import threading

    fifo = tmp_path / "pager.log"
    os.mkfifo(fifo)
    p = _fake_pager(tmp_path, str(fifo))
    errors = []

    def start():
        try:
            p.start()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t = threading.Thread(target=start)
    t.start()
    t.join(30)                      # a hang guard, not a measure: the start takes milliseconds
    hung = t.is_alive()
    if hung:                        # let the blocked open through, to end the thread
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        t.join()
    try:
        assert not hung, "the pager's start hung opening a FIFO as its log"
        assert errors == [] and p.alive()
        assert fifo.is_fifo()
        assert f"pager log {fifo} is a FIFO, not a regular file" in caplog.text
        assert "fake pager says hello" in capfd.readouterr().err
    finally:
        p.stop()


def test_a_pager_log_that_is_a_regular_file_takes_the_pagers_lines(tmp_path, caplog):
    log = tmp_path / "pager.log"
    p = _fake_pager(tmp_path, str(log))
    try:
        p.start()
        assert log.read_text() == "fake pager says hello\n" and "not a regular file" not in caplog.text
    finally:
        p.stop()


def test_a_log_rotation_never_signals_the_pid_of_a_pager_reaped_under_it(tmp_path, monkeypatch, caplog):
    """The supervising thread reaps a dead pager without the log's lock, so
    a rotation on the daemon's periodic check could find it alive, and then
    signal its pid once reaped: by then maybe another process's. The pager
    is signalled through a pidfd held for its life, which names it alone
    and fails with ESRCH once it has exited."""
    import dataclasses
    import signal

    log = tmp_path / "pager.log"
    p = _fake_pager(tmp_path, str(log))
    p.start()
    pid = p.pid
    real_stats = pg.parse_stats(stats_doc())
    kills = []
    real_kill = os.kill

    def stats_as_the_pager_dies():
        # The pager has just answered that it reopens its log; it dies, and
        # the supervising thread reaps it, before the rotation signals it.
        real_kill(pid, signal.SIGKILL)
        assert p._wait_exit(None)
        return dataclasses.replace(real_stats, pid=pid, log_reopen=True)

    def recorded_kill(to, sig):
        kills.append((to, sig))
        return real_kill(to, sig)

    try:
        log.write_bytes(b"x" * (p.config.log_max_bytes + 1))
        monkeypatch.setattr(p, "stats", stats_as_the_pager_dies)
        monkeypatch.setattr(pg.os, "kill", recorded_kill)
        assert p.rotate_log() is True
        assert kills == [], f"signalled reaped pid {pid}"
        assert f"tell pager pid {pid} to reopen it" in caplog.text
    finally:
        monkeypatch.undo()
        p.stop()
