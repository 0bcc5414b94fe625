"""Pause/resume with reclaim, auto-resume, jobs, TTLs, leases and events through the daemon."""

import asyncio
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import dsecd
from dsecd.errors import BadRequest, DsecError, NotFound
from dsecd.mem.zram import active_swaps


@pytest.fixture
def mem(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()


def _background(sb, cmd):
    t = threading.Thread(target=lambda: sb.exec(["sh", "-c", cmd]), daemon=True)
    t.start()
    return t


def test_pause_frees_memory_and_exec_resumes(mem):
    d, c = mem
    sb = c.create(image="busybox", memory="256M")
    sb.exec(["sh", "-c", "head -c 30000000 /dev/urandom > /tmp/data"])      # 30 MB in tmpfs + cache
    r = sb.pause()
    assert r["state"] == "paused" and r["frozen_s"] >= 0
    assert sb.inspect()["state"] == "paused"
    assert sb.pause()["already"] is True                                   # idempotent
    # An exec on a paused sandbox resumes it first.
    assert sb.exec(["sh", "-c", "wc -c < /tmp/data"]).stdout.strip() == b"30000000"
    assert sb.inspect()["state"] == "running"
    assert sb.resume()["already"] is True
    sb.destroy()


def test_top_shows_what_a_paused_sandbox_still_holds(mem):
    d, c = mem
    sb = c.create(image="busybox", memory="256M")
    sb.exec(["sh", "-c", "head -c 30000000 /dev/urandom > /tmp/data"])      # tmpfs: stays charged
    sb.pause()
    row = next(r for r in c.top()["sandboxes"] if r["id"] == sb.id)
    assert row["state"] == "paused" and row["memory"] is not None and row["memory"] >= 30_000_000, row
    sb.destroy()


def test_explicit_resume_and_destroy_while_paused(mem):
    d, c = mem
    sb = c.create(image="busybox")
    sb.pause()
    r = sb.resume()
    assert r["state"] == "running"
    sb.pause()
    sb.destroy()                           # a paused sandbox is thawed, then killed
    with pytest.raises(NotFound):
        sb.inspect()


def test_auto_resume_off_refuses(daemon_factory, busybox_rootfs):
    d = daemon_factory("[memory]\nauto_resume = false\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox")
    sb.pause()
    with pytest.raises(Exception) as e:
        sb.exec(["true"])
    assert e.value.code == "conflict" and e.value.message == (
        f"sandbox {sb.id} is paused; resume it (dsec resume {sb.id}) before an exec: memory.auto_resume is off")
    with pytest.raises(Exception) as e:
        sb.stat("/etc")
    assert "before a file stat:" in e.value.message, e.value     # no op names ("proc_kill", "file stat")
    sb.resume()
    assert sb.exec(["true"]).exit_code == 0
    sb.destroy()
    c.close()


def test_job_pause_resume_rm(mem):
    d, c = mem
    sbs = [c.create(image="busybox", labels={"job": "run-17"}) for _ in range(4)]
    other = c.create(image="busybox", labels={"job": "other"})
    r = c.job_pause("run-17")
    assert sorted(r["paused"]) == sorted(s.id for s in sbs) and not r["failed"]
    assert other.inspect()["state"] == "running"
    assert all(s.inspect()["state"] == "paused" for s in sbs)
    r = c.job_resume("run-17")
    assert sorted(r["resumed"]) == sorted(s.id for s in sbs)
    assert all(s.exec(["true"]).exit_code == 0 for s in sbs)
    r = c.job_rm("run-17")
    assert sorted(r["destroyed"]) == sorted(s.id for s in sbs)
    with pytest.raises(NotFound):
        c.job_pause("run-17")
    other.destroy()


def test_ttl_idle_ttl_and_lease_expire(mem):
    d, c = mem
    ttl = c.create(image="busybox", ttl="2s")
    idle = c.create(image="busybox", idle_ttl=2)
    leased = c.create(image="busybox", lease=2)
    kept = c.create(image="busybox", idle_ttl=3)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kept.exec(["true"])                 # activity keeps the idle clock at zero
        c.renew([leased.id])
        time.sleep(0.5)
    ids = {s["id"] for s in c.list()}
    assert ttl.id not in ids and idle.id not in ids
    assert leased.id in ids and kept.id in ids
    kept.destroy()
    time.sleep(3.5)                         # no more renewals: the lease runs out
    assert leased.id not in {s["id"] for s in c.list()}
    # A request naming one says it was destroyed, and why.
    for sb, why in ((ttl, "its ttl ran out"), (idle, "it was idle past its idle_ttl"),
                    (leased, "its lease was not renewed"), (kept, "by a destroy request")):
        with pytest.raises(NotFound, match=f"no sandbox '{sb.id}': it was destroyed [0-9]+ s ago, {why}"):
            sb.exec(["true"])


class _SlowTar:
    """A tar of `files` files of 100 KB whose every read waits `delay` s
    first: an upload that outlasts an idle TTL."""

    def __init__(self, files: int, delay: float):
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(files):
                info = tarfile.TarInfo(f"f{i}")
                info.size = 100_000
                tar.addfile(info, io.BytesIO(b"x" * info.size))
        self.data, self.pos, self.delay, self.reads = buf.getvalue(), 0, delay, 0

    def read(self, n: int) -> bytes:
        time.sleep(self.delay)
        self.reads += 1
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def test_a_copy_longer_than_the_idle_ttl_keeps_the_sandbox(mem):
    d, c = mem
    sb = c.create(image="busybox", idle_ttl=2)
    tar = _SlowTar(files=100, delay=2.0)         # 10 MB: 3 reads of a 4 MiB chunk, 2 s each
    assert sb.upload_tar(tar, "/work/up")["count"] >= 100
    assert tar.reads >= 2                        # it did outlast the idle TTL
    assert sb.exec(["sh", "-c", "ls /work/up | wc -l"]).stdout.strip() == b"100"
    sb.destroy()


def test_a_copy_into_a_sandbox_destroyed_meanwhile_says_so(mem):
    d, c = mem
    sb = c.create(image="busybox")
    tar = _SlowTar(files=100, delay=0)

    def read(n: int) -> bytes:
        if tar.reads == 1:                      # the first chunk is in: it goes
            other = d.client()
            other.get(sb.id).destroy(force=True)
            other.close()
        return _SlowTar.read(tar, n)

    tar.read = read
    with pytest.raises(DsecError) as e:
        sb.upload_tar(tar, "/work/up")
    # Not a memory limit (the copier's kill was the destroy's), nor `internal`.
    assert e.value.code in ("conflict", "not_found"), e.value
    assert "destroyed" in e.value.message or "no sandbox" in e.value.message, e.value


def test_a_dead_sandbox_goes_when_its_lease_runs_out(mem):
    d, c = mem
    sb = c.create(image="busybox", lease=2)
    os.kill(sb.inspect()["init_pid"], signal.SIGKILL)      # it dies; its client is gone too
    deadline = time.monotonic() + 10
    while sb.id in {s["id"] for s in c.list()}:
        assert time.monotonic() < deadline, c.list()
        time.sleep(0.2)


def test_a_signal_to_a_process_of_a_paused_sandbox_is_acted_on(mem):
    d, c = mem
    sb = c.create(image="busybox")
    proc = sb.spawn(["sh", "-c", "trap 'exit 3' TERM; while true; do sleep 0.1; done"])
    time.sleep(0.5)                             # its trap is set
    sb.pause()
    assert proc.kill("TERM")["sent"]
    ended: list = []
    t = threading.Thread(target=lambda: ended.append(proc.wait()), daemon=True)
    t.start()
    t.join(10)                  # its signals go through the sandbox's init: frozen, it relayed nothing
    try:
        assert ended and ended[0].exit_code == 3
        assert sb.inspect()["state"] == "running"
    finally:
        sb.destroy(force=True)


def test_paused_time_does_not_count_as_idle(mem):
    d, c = mem
    sb = c.create(image="busybox", idle_ttl=2)
    sb.pause()
    time.sleep(3)
    assert sb.inspect()["state"] == "paused"
    sb.resume()
    sb.destroy()


@pytest.mark.parametrize("stream", [False, True])
def test_paused_time_does_not_count_toward_an_execs_timeout(mem, stream):
    """A pause freezes the command, and does not kill it: it ends as it
    would have after the resume, and its timeout still fires on run time.
    stream: an exec with stdin (output streamed), else one collected whole."""
    d, c = mem
    sb = c.create(image="busybox")

    def paused_meanwhile(argv, timeout, pause_s):
        out = {}
        t = threading.Thread(target=lambda: out.update(r=sb.exec(argv, timeout=timeout, stdin=b"" if stream else None)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.3)
        sb.pause()
        time.sleep(pause_s)
        sb.resume()
        t.join(30)
        return out["r"], time.monotonic() - t0

    r, _ = paused_meanwhile(["sh", "-c", "sleep 1; echo done"], 2, 3)
    assert (r.exit_code, r.timed_out, r.stdout) == (0, False, b"done\n"), r
    r, took = paused_meanwhile(["sleep", "100"], 1.5, 2)
    assert r.timed_out and r.signal == signal.SIGKILL, r
    assert took >= 1.5 + 2, took


def test_a_traced_exec_is_not_ended_by_its_tracer_while_paused(mem):
    """The tracer (dsecd/trace.py) ends its tracees at the exec's timeout
    + 5 s as a backstop: paused time must not count there either."""
    d, c = mem
    sb = c.create(image="busybox")
    try:
        out = {}
        t = threading.Thread(target=lambda: out.update(
            r=sb.exec(["sh", "-c", "sleep 1; echo done"], timeout=2, trace=True)))
        t.start()
        time.sleep(0.3)
        sb.pause()
        time.sleep(2 + 5 + 1.5)         # past the backstop in wall time
        sb.resume()
        t.join(30)
        r = out["r"]
        assert (r.exit_code, r.timed_out, r.stdout) == (0, False, b"done\n"), r
        assert not r.trace.get("timed_out") and "error" not in r.trace, r.trace
    finally:
        sb.destroy(force=True)


def test_bad_durations(mem):
    d, c = mem
    for bad in ("soon", -1, "0s"):
        with pytest.raises(BadRequest):
            c.create(image="busybox", ttl=bad)


def _events_of(d, make) -> list[dict]:
    """The events of the sandbox `make()` returns, as a follower that
    connected before it and stopped at its `destroyed` saw them."""
    import asyncio

    import dsecd

    async def watch(out: list, ready: threading.Event):
        async with dsecd.Client(d.socket) as ac:
            ready.set()
            async for ev in ac.events():
                out.append(ev)
                if ev["event"] == "destroyed":
                    return

    seen: list = []
    ready = threading.Event()
    t = threading.Thread(target=lambda: asyncio.run(watch(seen, ready)), daemon=True)
    t.start()
    ready.wait(10)
    time.sleep(0.2)
    sb_id = make()
    t.join(10)
    return [e for e in seen if e["sandbox"] == sb_id]


def _first_event(d, sb_id: str, kind: str, timeout: float) -> dict:
    """The first event of `kind` of sandbox `sb_id`, the recent ones replayed
    first, waited for up to `timeout` s."""
    import asyncio

    import dsecd

    async def first():
        async with dsecd.Client(d.socket) as ac:
            async for ev in ac.events(sandbox=sb_id, replay=True):
                if ev["event"] == kind:
                    return ev

    return asyncio.run(asyncio.wait_for(first(), timeout))


def test_events_stream(mem):
    d, c = mem

    def lifecycle():
        sb = c.create(image="busybox")
        sb.pause()
        sb.resume()
        sb.destroy()
        return sb.id

    assert [e["event"] for e in _events_of(d, lifecycle)] == ["created", "paused", "resumed", "destroyed"]


def test_a_job_pause_event_has_no_duration_it_did_not_measure(mem):
    """A job pause answers before its reclaim: its event says freed 0 and
    no duration (null, as a job resume's), not a pause of 0 ms."""
    d, c = mem
    sb = c.create(image="busybox", labels={"job": "run-23"})
    c.job_pause("run-23")
    c.job_resume("run-23")
    evs = {e["event"]: e for e in c.events(sb.id, replay=True, follow=False)}
    assert evs["paused"]["freed_bytes"] == 0 and evs["paused"]["duration_ms"] is None, evs["paused"]
    assert evs["resumed"]["duration_ms"] is None, evs["resumed"]
    sb.destroy()


def test_a_job_pause_says_what_its_reclaim_freed_in_an_event_of_its_own(mem):
    """The reclaim behind a job pause's answer ends with a `reclaimed` event:
    the bytes the job's `paused` event could not say yet."""
    d, c = mem
    sb = c.create(image="busybox", labels={"job": "run-24"})
    sb.exec(["sh", "-c", "head -c 20000000 /dev/urandom > /tmp/data"])     # 20 MB in tmpfs + cache
    c.job_pause("run-24")
    ev = _first_event(d, sb.id, "reclaimed", 30)
    assert ev["freed_bytes"] >= 0 and ev["duration_ms"] >= 0, ev
    c.job_resume("run-24")
    sb.destroy()


def test_an_expired_sandbox_says_why_before_it_is_destroyed(mem):
    d, c = mem
    mine = _events_of(d, lambda: c.create(image="busybox", ttl=1).id)
    assert [e["event"] for e in mine] == ["created", "expired", "destroyed"], mine
    assert mine[1]["reason"] == "ttl"


def test_paused_sandbox_survives_a_daemon_restart(mem):
    import signal

    d, c = mem
    sb = c.create(image="busybox")
    sb.pause()
    c.close()
    d.stop(signal.SIGTERM)
    d.start()
    c2 = d.client()
    s2 = c2.get(sb.id)
    assert s2.info["state"] == "paused"
    assert s2.exec(["echo", "back"]).stdout == b"back\n"
    s2.destroy()
    c2.close()


def test_oom_kill_is_an_event(mem):
    d, c = mem
    sb = c.create(image="busybox", memory="32M")
    r = sb.exec(["sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo done"], timeout=60)
    assert r.exit_code != 0 or r.signal
    ev = _first_event(d, sb.id, "oom", 10)
    assert ev["kills"] >= 1
    sb.destroy()


def test_a_job_resume_after_a_cancelled_job_pause_leaves_the_job_running(mem):
    """A trainer's timeout around a job pause, then a job resume: once the
    cancel has returned, the pause it cancelled (which, begun, runs to its
    end) is over, so the resume that follows thaws the job instead of
    coming before the pause's freeze and leaving every sandbox frozen."""
    d, c = mem
    sbs = [c.create(image="busybox", memory="64M", cpu=0.25, labels={"job": "cut"}) for _ in range(40)]
    freezes = [Path(sb.inspect()["cgroups"]["unified"]) / "cgroup.freeze" for sb in sbs]

    async def go() -> list[tuple[int, int]]:
        seen = []
        async with dsecd.Client(d.socket) as ac:
            for _ in range(4):
                pausing = asyncio.ensure_future(ac.job_pause("cut"))
                await asyncio.sleep(0)          # sent
                pausing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pausing
                await ac.job_resume("cut")
                states = [s["state"] for s in await ac.list(labels={"job": "cut"})]
                seen.append((states.count("paused"), sum(f.read_text().strip() == "1" for f in freezes)))
        return seen

    try:
        assert asyncio.run(go()) == [(0, 0)] * 4
    finally:
        c.job_rm("cut", force=True)


def test_job_pause_is_journaled_for_a_restarted_daemon(mem):
    import signal

    d, c = mem
    sbs = [c.create(image="busybox", labels={"job": "run-18"}) for _ in range(3)]
    assert sorted(c.job_pause("run-18")["paused"]) == sorted(s.id for s in sbs)
    c.close()
    d.stop(signal.SIGTERM)            # right after the answer: the journal is written behind it
    d.start()
    c2 = d.client()
    assert all(c2.get(s.id).info["state"] == "paused" for s in sbs)
    assert sorted(c2.job_resume("run-18")["resumed"]) == sorted(s.id for s in sbs)
    c2.job_rm("run-18", force=True)
    c2.close()


def _swapfile_config(tmp_path, size: str) -> str:
    """The daemon config of a swap file of `size` in tmp_path (skipped where
    its file system cannot hold swap)."""
    from dsecd.mem import swapfile as sf

    fstype, _ = sf.fs_type(tmp_path)
    if fstype in sf.NO_SWAP_FS:
        pytest.skip(f"{tmp_path} is on {fstype}, which cannot hold swap")
    return f'[memory.swapfile]\nenabled = true\npath = "{tmp_path / "swapfile"}"\nsize = "{size}"\n'


def test_daemon_swapfile_in_info_and_gone_after_shutdown(daemon_factory, tmp_path):
    import signal

    path = str(tmp_path / "swapfile")
    d = daemon_factory(_swapfile_config(tmp_path, "64M"))
    try:
        c = d.client()
        info = c.info()["memory"]["swapfile"]
        assert info["on"] and info["path"] == path and info["size"] >= 63 << 20 and "error" not in info
        # The features list counts the daemon's own swap too (it was probed before it was on).
        assert c.info()["features"]["swap"]["available"] is True
        c.close()
        d.stop(signal.SIGTERM)        # drained: swapoff and delete
        assert path not in active_swaps()
        assert not (tmp_path / "swapfile").exists()
    finally:
        _swap_off(path)


def test_swap_left_on_for_paused_sandboxes_goes_once_its_backend_is_disabled(daemon_factory, busybox_rootfs,
                                                                              tmp_path):
    """A daemon stopped with a sandbox paused leaves its swap file and zram
    device on for it. The next one, started with both backends disabled,
    still takes them down at a stop with nothing paused: else they stayed on
    (the file on disk, the device in RAM) till the host rebooted."""
    import signal

    from dsecd.mem import zram

    path = str(tmp_path / "swapfile")
    d = daemon_factory(_swapfile_config(tmp_path, "64M") + '[memory.zram]\nenabled = true\nsize = "64M"\n')
    dev = None
    try:
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        dev = c.info()["memory"]["zram"]["device"]
        assert dev and path in active_swaps() and dev in active_swaps(), c.info()["memory"]
        sb = c.create(image="busybox")
        sb.pause()
        c.close()
        d.stop(signal.SIGTERM)
        assert {path, dev} <= active_swaps()        # left on: the paused sandbox holds pages in them
        d.config.write_text(d.config.read_text().replace("enabled = true", "enabled = false"))
        d.start()
        c = d.client()
        info = c.info()["memory"]
        assert not info["swapfile"]["enabled"] and info["swapfile"]["on"], info
        assert not info["zram"]["enabled"] and info["zram"]["on"] and info["zram"]["device"] == dev, info
        c.get(sb.id).destroy(force=True)
        c.close()
        d.stop(signal.SIGTERM)
        assert path not in active_swaps() and dev not in active_swaps()
        assert not (tmp_path / "swapfile").exists()
        assert not Path("/sys/block", Path(dev).name).exists()
        assert not (d.state / "zram.json").exists()
    finally:
        _swap_off(path)
        if dev is not None and Path("/sys/block", Path(dev).name).exists():
            z = zram.ZramSwap(zram.ZramConfig())
            if z.adopt(int(Path(dev).name.removeprefix("zram"))):
                z.teardown()


def test_a_restart_leaves_swap_on_for_running_sandboxes_past_their_limit(daemon_factory, busybox_rootfs,
                                                                          tmp_path):
    """A running sandbox may hold more than its memory limit, the rest in
    swap (sandbox.swap_per_memory). A daemon stop that swapped off then
    charged those pages back to its memcg, whose limit they do not fit: the
    OOM killer took its init and the sandbox died of a daemon restart. Swap
    stays on while any sandbox lives; the next daemon adopts it."""
    import signal

    path = str(tmp_path / "swapfile")
    d = daemon_factory(_swapfile_config(tmp_path, "256M"))
    try:
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="32M")
        mem = Path(sb.inspect()["cgroups"]["memory"])
        if not (mem / "memory.memsw.usage_in_bytes").exists():
            pytest.skip("no v1 swap accounting to see the sandbox's swap by")
        # 48 MiB of files on its tmpfs /tmp: 16 MiB or more of it can only be in swap.
        r = sb.exec(["sh", "-c", "dd if=/dev/urandom of=/tmp/f bs=1M count=48 2>/dev/null && md5sum /tmp/f"],
                    timeout=120)
        assert r.exit_code == 0, r
        swapped = int((mem / "memory.memsw.usage_in_bytes").read_text()) - int(
            (mem / "memory.usage_in_bytes").read_text())
        assert swapped >= 16 << 20, swapped
        c.close()
        d.stop(signal.SIGTERM)
        assert path in active_swaps()
        d.start()
        c = d.client()
        sb = c.get(sb.id)
        assert sb.inspect()["state"] == "running", d.cli("events", "--replay", "--no-follow").stdout
        assert sb.exec(["md5sum", "/tmp/f"]).stdout == r.stdout
        sb.destroy(force=True)
        c.close()
        d.stop(signal.SIGTERM)        # none left: swapoff and delete
        assert path not in active_swaps() and not (tmp_path / "swapfile").exists()
    finally:
        _swap_off(path)


HOLD_PAST_THE_LIMIT = """
import os, sys, time
b = bytearray(96 << 20)
for o in range(0, len(b), 1 << 20):          # a MiB at a time: reclaim moves the rest to swap meanwhile
    b[o:o + (1 << 20)] = os.urandom(1 << 20)
    time.sleep(0.01)
print("held", flush=True)
time.sleep(1000)
"""


def test_a_resume_prefetches_no_more_than_the_memory_limit_holds(daemon_factory, tmp_path):
    """A sandbox may hold more than its memory limit, the rest in swap
    (sandbox.swap_per_memory). Its pause records all of it; the resume's
    populate faulted all of it back in, past the limit, and the memcg's OOM
    killer took the process the resume was for. The prefetch stops short of
    the limit; what it leaves comes back on demand."""
    from test_fncall import import_py

    path = str(tmp_path / "swapfile")
    d = daemon_factory(_swapfile_config(tmp_path, "512M"))
    try:
        c = d.client()
        import_py(c)
        sb = c.create(image="py", memory="64M")
        mem = Path(sb.inspect()["cgroups"]["memory"])
        if not (mem / "memory.memsw.usage_in_bytes").exists():
            pytest.skip("no v1 swap accounting to see the sandbox's swap by")
        p = sb.spawn(["python3", "-c", HOLD_PAST_THE_LIMIT])
        deadline = time.monotonic() + 120
        while b"held" not in b"".join(chunk.data for chunk in sb.process(p.pid).output(follow=False)):
            assert sb.process(p.pid).status().state == "running", sb.process(p.pid).status()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        swapped = int((mem / "memory.memsw.usage_in_bytes").read_text()) - int(
            (mem / "memory.usage_in_bytes").read_text())
        assert swapped >= 16 << 20, swapped
        sb.pause()
        r = sb.resume()
        assert r["prefetched_bytes"] <= 64 << 20, r
        assert sb.process(p.pid).status().state == "running", sb.process(p.pid).status()
        oom = dict(line.split() for line in (mem / "memory.oom_control").read_text().splitlines())
        assert oom.get("oom_kill", "0") == "0", oom
        sb.destroy(force=True)
        c.close()
    finally:
        d.stop()
        _swap_off(path)


def _swap_off(path: str) -> None:
    """Swap off `path` where a test's daemon left it on (a test that failed)."""
    if path in active_swaps():
        from dsecd import native

        native.swapoff(path)


def _frozen(sb) -> bool:
    """Whether the sandbox's v2 freezer holds it (the freezer dsecd uses where
    a v2 tree exists, hybrid hosts too), read on the host: no request that
    would resume it."""
    events = Path(sb.inspect()["cgroups"]["unified"], "cgroup.events").read_text()
    return "frozen 1" in events.splitlines()


@contextlib.contextmanager
def _snapshot_under_way(sb, name: str):
    """A snapshot of `sb` running in a thread (its future), once it froze
    the sandbox: a 200 MB file to pack holds it frozen for a while."""
    import concurrent.futures

    sb.exec(["sh", "-c", "mkdir -p /work && head -c 200000000 /dev/urandom > /work/big"], timeout=120)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        snap = pool.submit(sb.snapshot, name)
        deadline = time.monotonic() + 30
        while not _frozen(sb):                  # the snapshot froze it
            assert time.monotonic() < deadline and not snap.done(), snap
            time.sleep(0.01)
        yield snap


def test_job_pause_during_a_snapshot_leaves_the_job_frozen(mem):
    d, c = mem
    sb = c.create(image="busybox", memory="1G", labels={"job": "run-19"})
    if "unified" not in sb.inspect()["cgroups"]:
        pytest.skip("no v2 freezer on this host")
    with _snapshot_under_way(sb, "job-paused-mid-snapshot") as snap:
        assert c.job_pause("run-19")["paused"] == [sb.id]
        assert snap.result(120)["name"] == "job-paused-mid-snapshot"
    # The snapshot's end must not thaw what the job pause froze meanwhile.
    assert sb.inspect()["state"] == "paused" and _frozen(sb)
    assert c.job_resume("run-19")["resumed"] == [sb.id]
    assert not _frozen(sb) and sb.exec(["true"]).exit_code == 0
    sb.destroy()


def test_a_snapshots_freeze_does_not_count_toward_an_execs_timeout(mem):
    """A snapshot freezes a running sandbox while it packs: as under a
    pause, its execs stand still and their timeouts count run time only."""
    d, c = mem
    sb = c.create(image="busybox", memory="1G")
    if "unified" not in sb.inspect()["cgroups"]:
        pytest.skip("no v2 freezer on this host")
    sb.exec(["sh", "-c", "mkdir -p /work && head -c 200000000 /dev/urandom > /work/more"], timeout=120)
    with _snapshot_under_way(sb, "frozen-under-an-exec") as snap:   # 400 MB to pack: frozen a while
        t0 = time.monotonic()
        r = sb.exec(["echo", "done"], timeout=0.5)   # waits for the thaw
        frozen_s = time.monotonic() - t0
        snap.result(120)
    assert frozen_s > 0.7, frozen_s             # the freeze outlasted the timeout
    assert (r.exit_code, r.timed_out, r.stdout) == (0, False, b"done\n"), (r, frozen_s)
    sb.destroy()


def test_a_snapshot_keeps_its_sandbox_from_its_idle_ttl(mem):
    """A snapshot is busy as a directory copy out is: the sandbox is not
    expired while its layer is packed, and its idle clock starts again at
    the end."""
    d, c = mem
    sb = c.create(image="busybox", memory="2G", idle_ttl=0.5)
    sb.exec(["sh", "-c", "mkdir -p /work && head -c 700000000 /dev/urandom > /work/big"], timeout=120)
    t0 = time.monotonic()
    assert sb.snapshot("packed-past-the-idle-ttl")["name"] == "packed-past-the-idle-ttl"
    ended, took = time.time(), time.monotonic() - t0
    assert took > 1.5, took                     # past the idle TTL at a reaper's pass (1 s apart)
    time.sleep(2)                               # now it is idle
    expired = [e for e in c.events(sb.id, replay=True, follow=False) if e["event"] == "expired"]
    assert len(expired) == 1 and expired[0]["time"] >= ended, (expired, ended)


def test_destroy_during_a_snapshot_is_no_internal_error(mem):
    d, c = mem
    sb = c.create(image="busybox", memory="1G")
    with _snapshot_under_way(sb, "destroyed-mid-snapshot") as snap:
        sb.destroy(force=True)
        try:
            result = snap.result(120)
        except Exception as err:                # failed as the sandbox went: it says so, no image
            assert err.code in ("conflict", "not_found", "io"), err
            assert "destroyed-mid-snapshot" not in {i["name"] for i in c.list_images()}
        else:                                   # packed before it went: the image is there
            assert result["name"] == "destroyed-mid-snapshot"
            assert "destroyed-mid-snapshot" in {i["name"] for i in c.list_images()}


def test_snapshot_of_a_paused_sandbox_leaves_it_paused(mem):
    d, c = mem
    sb = c.create(image="busybox")
    sb.exec(["sh", "-c", "mkdir -p /work && echo kept > /work/f"])
    sb.pause()
    assert sb.snapshot("from-paused")["name"] == "from-paused"
    assert sb.inspect()["state"] == "paused"
    if "unified" in sb.inspect()["cgroups"]:
        assert _frozen(sb)
    again = c.create(image="from-paused")
    assert again.exec(["cat", "/work/f"]).stdout == b"kept\n"
    again.destroy()
    sb.destroy()



def test_a_resume_the_journal_missed_is_taken_for_done_at_restart(mem):
    import signal

    d, c = mem
    sb = c.create(image="busybox")
    group = Path(sb.inspect()["cgroups"].get("unified", "/nonexistent"))
    if not (group / "cgroup.freeze").exists():
        pytest.skip("no v2 freezer on this host")
    sb.pause()
    c.close()
    d.stop(signal.SIGKILL)
    # What a daemon killed between a resume's thaw and its journal write
    # leaves: a sandbox thawed and running, journaled as paused.
    (group / "cgroup.freeze").write_text("0")
    d.start()
    c2 = d.client()
    s2 = c2.get(sb.id)
    assert s2.info["state"] == "running"         # as it is: a pause then pauses it again
    r = s2.pause()
    assert r["state"] == "paused" and not r.get("already") and _frozen(s2)
    s2.destroy()
    c2.close()


def test_a_daemon_stopped_during_a_snapshot_thaws_its_sandbox(mem):
    """A stop (SIGTERM) cancels a snapshot under way: the sandbox it froze
    is thawed and its layer's view unmounted before the daemon exits, as
    a cancel does; it is not left frozen until the next daemon's start."""
    d, c = mem
    sb = c.create(image="busybox", memory="1G")
    if "unified" not in sb.inspect()["cgroups"]:
        pytest.skip("no v2 freezer on this host")
    events = Path(sb.inspect()["cgroups"]["unified"], "cgroup.events")
    # Many files: packing them holds the sandbox frozen for seconds.
    sb.exec(["sh", "-c", "mkdir -p /work/m && cd /work/m && seq 1 40000 | xargs touch"], timeout=120)
    with _snapshot_under_way(sb, "stopped-mid-snapshot") as snap:
        time.sleep(1)                           # packing
        d.stop(signal.SIGTERM)
        with contextlib.suppress(Exception):
            snap.result(60)
    assert d.proc.returncode == 0, d.log.read_text()[-3000:]
    assert "frozen 0" in events.read_text().splitlines()
    views = Path(d.state, "upper-views")
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if str(views) in line]
    assert "internal error in snapshot" not in d.log.read_text()


def test_an_exec_sent_while_a_pause_reclaims_waits_for_it_then_resumes(daemon_factory, busybox_rootfs, tmp_path):
    """A pause holds the sandbox frozen for its whole reclaim (seconds, into
    swap) while its state still says running: an exec sent then joined the
    frozen cgroup and stood there (its timeout counts run time only) until
    something else resumed the sandbox. It waits for the pause's end and
    resumes it, as an exec to a paused sandbox does."""
    import concurrent.futures

    path = str(tmp_path / "swapfile")
    d = daemon_factory(_swapfile_config(tmp_path, "512M"))
    try:
        c = d.client()
        c.import_image(busybox_rootfs, "busybox")
        sb = c.create(image="busybox", memory="1G")
        if "unified" not in sb.inspect()["cgroups"]:
            pytest.skip("no v2 freezer on this host")
        # ~135 MB of anonymous memory for the pause to write to the swap file.
        p = sb.spawn("X=$(head -c 100000000 /dev/urandom | base64); echo held; sleep 1000; true")
        deadline = time.monotonic() + 120
        while b"held" not in b"".join(chunk.data for chunk in sb.process(p.pid).output(follow=False)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        try:
            for _ in range(5):
                pausing = pool.submit(sb.pause)
                while not _frozen(sb) and not pausing.done():
                    time.sleep(0.005)
                if pausing.done() or sb.inspect()["state"] != "running":
                    pausing.result()
                    sb.resume()
                    continue
                # Frozen, still "running": the reclaim is under way.
                execing = pool.submit(sb.exec, ["echo", "hi"], timeout=5)
                try:
                    r = execing.result(30)
                except concurrent.futures.TimeoutError:
                    sb.resume()                 # lets it end
                    raise AssertionError("an exec sent during a pause stood frozen after it") from None
                assert (r.exit_code, r.stdout) == (0, b"hi\n"), r
                pausing.result(60)
                assert sb.inspect()["state"] == "running" and not _frozen(sb)
                break
            else:
                pytest.skip("each pause's reclaim ended before an exec could be sent into it")
        finally:
            pool.shutdown(wait=False)
        sb.destroy(force=True)
        c.close()
    finally:
        d.stop()
        _swap_off(path)
