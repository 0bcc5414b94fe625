"""A microVM's life beyond its requests: daemon restarts, job pause and
resume.

One or two VMs at a time (TCG); no timings asserted, only bounds generous
enough for a loaded 2-core host.
"""

from __future__ import annotations

import os
import signal
import time

import pytest


def _available(c) -> None:
    info = c.info()["backends"]["microvm"]
    if not info["available"]:
        c.close()
        pytest.skip(f"backend microvm unavailable here: {info['why']}")


@pytest.fixture
def vmd(daemon_factory, busybox_rootfs):
    d = daemon_factory()
    c = d.client()
    _available(c)
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()


def _vm(c, **kw):
    args = {"backend": "microvm", "memory": "256M", "net": "none", "disk": "64M", **kw}
    return c.create("busybox", **args)


def test_a_restarted_daemon_readopts_running_and_paused_vms(vmd):
    d, c = vmd
    a, b = _vm(c), _vm(c)
    a.write_file("/tmp/a", b"still here")
    b.write_file("/tmp/b", b"saved in the pause")
    b.pause()
    qemu = a.inspect()["vm"]["qemu_pid"]
    c.close()
    d.stop(signal.SIGTERM)
    assert os.path.exists(f"/proc/{qemu}"), "a daemon stop must leave VMs running"
    d.start()
    c2 = d.client()
    try:
        a2, b2 = c2.get(a.id), c2.get(b.id)
        assert (a2.inspect()["state"], b2.inspect()["state"]) == ("running", "paused")
        assert a2.inspect()["vm"]["qemu_pid"] == qemu
        assert a2.read_file("/tmp/a") == b"still here"
        assert a2.exec(["hostname"]).stdout == f"sb-{a.id}\n".encode()
        assert b2.resume()["state"] == "running"
        assert b2.read_file("/tmp/b") == b"saved in the pause"
        a2.destroy()
        b2.destroy()
    finally:
        c2.close()


def test_job_pause_and_resume_cover_vms(vmd):
    d, c = vmd
    sbs = [_vm(c, labels={"job": "vmjob"}) for _ in range(2)]
    for i, sb in enumerate(sbs):
        sb.write_file("/tmp/n", str(i).encode())
    out = c.job_pause("vmjob")
    assert sorted(out["paused"]) == sorted(s.id for s in sbs)
    # The state is saved behind the answer (each QEMU then ends); wait for one.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (d.state / "vms" / sbs[0].id / "paused.ram").exists():
        time.sleep(0.2)
    out = c.job_resume("vmjob")
    assert sorted(out["resumed"]) == sorted(s.id for s in sbs)
    for i, sb in enumerate(sbs):
        assert sb.read_file("/tmp/n") == str(i).encode()
        assert sb.exec(["echo", "up"]).stdout == b"up\n"
    # A resume right after the pause finds the vCPUs only stopped, or the state saved: either works.
    c.job_pause("vmjob")
    c.job_resume("vmjob")
    assert all(sb.exec(["true"]).exit_code == 0 for sb in sbs)
    for sb in sbs:
        sb.destroy()
