"""A clean stop (SIGTERM) cancels the requests in flight and waits for
their undoing, and for their connections' closers, before it closes init's
channels and the worker pool (dsecd/server.py Server.wait_stopped): an exec
of no idempotency key is killed, with its whole process group, and the
temporary files of writes left unfinished are removed, before the daemon
exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from dsecd import stopclock


def _pids_of(argv: list[str], cgroup_root: str) -> list[int]:
    """The host pids running exactly `argv` in a cgroup under `cgroup_root`
    (a test daemon's own subtree), zombies left out."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if f.read() != want:
                    continue
            with open(f"/proc/{name}/cgroup") as f:
                if f"/{cgroup_root}/" not in f.read():
                    continue
            if _alive(int(name)):
                found.append(int(name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie is dead: its parent, init, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("via", ["init", "helper"])
@pytest.mark.parametrize("how", ["collected", "streamed", "stdin"])
def test_a_clean_stop_kills_an_exec_of_no_key_before_it_exits(daemon_factory, busybox_rootfs, via, how):
    d = daemon_factory(f'exec_via = "{via}"\n')
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    argv = ["sleep", "1007"]
    ended = threading.Event()

    def foreground() -> None:
        try:
            if how == "collected":
                sb.exec(argv)
            else:
                stream = sb.exec_stream(argv, stdin=b"" if how == "stdin" else None)
                for _chunk in stream:
                    pass
        except ConnectionError:             # the daemon stops under it
            pass
        ended.set()

    threading.Thread(target=foreground, daemon=True).start()
    deadline = time.monotonic() + 10
    while not (pids := _pids_of(argv, d.cgroup_root)):
        assert time.monotonic() < deadline, "the exec did not start"
        time.sleep(0.05)
    d.stop(signal.SIGTERM)
    assert d.proc.returncode == 0, d.log.read_text()[-4000:]
    # The kill is sent before the daemon exits; its delivery and init's reap
    # take a moment more.
    deadline = time.monotonic() + 2
    while (left := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"exec {argv} still runs as {left} after the daemon stopped"
    assert ended.wait(10)
    assert "not ended" not in d.log.read_text()
    c.close()



def test_a_clean_stop_removes_the_temporaries_its_clients_left(daemon_factory, busybox_rootfs):
    """Temporary files of writes whose client is still connected at the
    stop: its connection's end removes them, one after the other through
    the worker pool, before the stop shuts that pool down."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    sb = c.create(image="busybox", memory="128M")
    sb.mkdir("/work", parents=True)
    paths = [f"/work/.dsec-{i:012x}" for i in range(40)]
    for path in paths:
        c.request("file_write", sandbox=sb.id, path=path, data=b"part", temporary=True)
    d.stop(signal.SIGTERM)
    assert d.proc.returncode == 0, d.log.read_text()[-4000:]
    log = d.log.read_text(errors="replace")
    kept = [path for path in paths
            if f"removed {path}, the temporary copy of a write its client left unfinished" not in log]
    assert not kept, f"{len(kept)} of {len(paths)} temporaries not removed at the stop: {log[-4000:]}"
    assert "cleanup of connection" not in log and "not ended" not in log, log[-4000:]
    c.close()


# A stop's budget here (daemon.stop_timeout_s): short, so that a stop that
# gives up on what hangs does so in seconds.
STOP_BUDGET_S = 4.0


def _log_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _wait_for_event(d, event: str, timeout: float) -> dict:
    """The first log line of the daemon with `event`, waited for."""
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in _log_lines(d.log.read_text(errors="replace")) if ln.get("event") == event]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"no {event} in the daemon's log after {timeout:.0f} s: {d.log.read_text()[-4000:]}")


def test_a_stop_with_a_worker_stuck_in_a_read_exits_within_its_bound(daemon_factory, busybox_rootfs,
                                                                   gate_fuse_binary, tmp_path):
    """A worker thread in a read that does not return (a build's COPY from a
    FUSE file system whose reads its server holds) held the stop for ever:
    the request's undoing waits for the worker, asyncio's last cancel waits
    for that, the interpreter's exit joins every worker. The stop now ends
    within daemon.stop_timeout_s, saying what was stuck (the call, the
    request, its sandbox), and the next start finds the state consistent:
    the sandbox made before runs on, the build's step sandbox is removed.
    One worker only: the stop's own steps, which go through workers too,
    must not queue behind the stuck one.

    The held FUSE read is an uninterruptible wait: the kernel keeps the
    exited daemon's process (and its fds) until the read returns, SIGKILL
    or not. The next daemon starts meanwhile: the exit gave its locks up."""
    from fuse_kit import GateFuse

    d = daemon_factory(f"[daemon]\nstop_timeout_s = {STOP_BUDGET_S}\nworker_threads = 1\n")
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    kept = c.create(image="busybox", memory="64M")
    context = tmp_path / "context"
    # The file's first open is the build plan's hashing, its second the COPY's.
    fs = GateFuse(gate_fuse_binary, context / "fuse", size=8 << 20, gate_open=2, gate_offset=2 << 20)
    first = d.proc
    try:
        def build() -> None:
            b = d.client()
            try:
                b.build_dockerfile(str(context), "stuck", text="FROM busybox\nCOPY fuse/big /big\n")
            except (ConnectionError, OSError):          # the daemon went under it
                pass
            finally:
                b.close()

        builder = threading.Thread(target=build, daemon=True)
        builder.start()
        fs.wait_for("held 2", 60)
        step = [s["id"] for s in c.list() if s["labels"].get("dsec.build") == "stuck"]
        assert len(step) == 1, c.list()
        c.close()
        first.send_signal(signal.SIGTERM)
        said = _wait_for_event(d, "stop_exit_anyway", STOP_BUDGET_S + 6)
        stopping = _wait_for_event(d, "stopping", 0)
        took = (_when(said) - _when(stopping))
        assert took < STOP_BUDGET_S + 0.5, f"the stop took {took:.1f} s"
        log = d.log.read_text(errors="replace")
        lines = _log_lines(log)
        stuck = [ln for ln in lines if ln.get("event") == "stop_left_worker"]
        assert len(stuck) == 1, log[-4000:]
        assert stuck[0]["doing"].startswith("image_build_dockerfile #"), stuck[0]
        assert stuck[0]["doing"].endswith(f"sandbox {step[0]}"), stuck[0]
        assert "image_build_dockerfile" in said["msg"], said
        assert not [ln for ln in lines if ln.get("event") == "stop_step_late"], log[-4000:]
        builder.join(10)

        d.start()                   # the first one's process still held by the kernel
        assert first.poll() is None
        c = d.client()
        assert [(s["id"], s["state"]) for s in c.list()] == [(kept.id, "running")]
        assert c.get(kept.id).exec(["echo", "on"]).stdout == b"on\n"
        assert "stuck" not in [i["name"] for i in c.list_images()]
        groups = {g.name for top in d.cgroup_dirs() if top.exists() for g in top.iterdir() if g.is_dir()}
        assert step[0] not in groups and kept.id in groups, groups
        restarted = d.log.read_text(errors="replace")[len(log):]
        assert f"removing sandbox {step[0]} of build stuck" in restarted, restarted[-4000:]
        c.close()
    finally:
        fs.close()                  # the read returns: the first daemon's process ends
        try:
            first.wait(30)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
    assert first.returncode == stopclock.LEFT_WORK_STATUS     # systemd: the unit failed; the log says why


def _when(line: dict) -> float:
    """A log line's time (its `ts`), in seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(line["ts"].replace("Z", "+00:00")).timestamp()
