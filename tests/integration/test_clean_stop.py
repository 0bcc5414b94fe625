"""A clean stop (SIGTERM) cancels the requests in flight and waits for
their undoing, and for their connections' closers, before it closes init's
channels and the worker pool (dsecd/server.py Server.wait_stopped): an exec
of no idempotency key is killed, with its whole process group, and the
temporary files of writes left unfinished are removed, before the daemon
exits."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest


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
