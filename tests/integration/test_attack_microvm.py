"""Adversarial suite, microVMs: root inside the guest attacks the host.

A guest runs its own kernel, as root: inside the VM everything is allowed,
and the attacks here are on what lies outside it: QEMU's sockets, the
daemon, the host's files and the layers' blobs (escapes); the agent's
channel, which root in the guest can take over (control plane); another
VM (cross-sandbox); the host's memory, CPU and disk (exhaustion). Each
asserts the outcome on the host side and that the daemon and a bystander
VM go on answering.

Under TCG a VM takes seconds to start and the host's cores are shared: one
module-wide bystander VM that no test harms, a fresh victim per test that
may end its VM (restored from the template the bystander's create made),
and no timings in the asserts. What a guest may do to its own channel
before the host ends it is in docs/hardening.md (section 4); what the
guest cannot reach of QEMU's sockets is also in test_microvm_life.py, a
guest that panics or hangs there too.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
from pathlib import Path

import pytest
from attack_kit import PROBE_IN_SANDBOX, facts, install_probe
from conftest import skip_unless_microvm
from test_microvm_life import _events, _gone, _wait_dead

from dsecd.backends.microvm import wire
from dsecd.config import load_config
from dsecd.errors import DsecError

# Its VMs start from the run's templates (conftest.VM_TEMPLATES): none of its tests is about how one is built.
pytestmark = [pytest.mark.attack, pytest.mark.shared_vm_templates]

# virtio device ids (the virtio spec, 5.x): what a guest of this backend has,
# and the two that would share host files (9p, virtio-fs).
VIRTIO_EXPECTED = {1: "net", 3: "console", 5: "balloon", 27: "pmem"}
VIRTIO_SHARES = {9: "9p transport", 26: "virtio-fs"}
ONE_WRITE = 32 << 10        # one virtio-serial write (attack_probe fd_inject): frames in it arrive whole


def _vm(c, probe: bytes, **kw):
    sb = c.create("busybox", backend="microvm", memory="256M", net="none", disk="64M", **kw)
    install_probe(sb, probe)
    return sb


@pytest.fixture(scope="module")
def vmc(daemon):
    c = daemon.client()
    skip_unless_microvm(c)
    yield c
    c.close()


@pytest.fixture(scope="module")
def bystander(vmc, probe_binary):
    """A VM no test harms: it must answer after every attack."""
    sb = _vm(vmc, probe_binary)
    yield sb
    sb.destroy(force=True)


@pytest.fixture
def victim(vmc, probe_binary, bystander):
    """A VM of its own for an attack that may end it (made after the
    bystander, so restored from the template the bystander's create built)."""
    sb = _vm(vmc, probe_binary)
    yield sb
    try:
        sb.destroy(force=True)
    except DsecError:
        pass


def _others_fine(vmc, bystander) -> None:
    assert vmc.request("ping")
    assert bystander.exec(["echo", "fine"], timeout=120).stdout == b"fine\n"


def _status(daemon, field: str) -> int:
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in the daemon's /proc status")


class PeakRss:
    """The daemon's peak RSS over a block, above its RSS at the start: the
    kernel's high-water mark (VmHWM), reset at the start (clear_refs 5). A
    buffer freed by the end would be missed by a reading of VmRSS after."""

    def __init__(self, daemon):
        self.daemon = daemon

    def __enter__(self) -> PeakRss:
        Path(f"/proc/{self.daemon.proc.pid}/clear_refs").write_text("5")
        self.start = _status(self.daemon, "VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.grown = _status(self.daemon, "VmHWM") - self.start


def _inject(sb, payload: bytes, repeat: int, timeout: float = 300):
    """Root in the guest takes the agent's channel (PID 1's fd of the
    virtio-serial port, pidfd_getfd) and writes `payload` to the host
    `repeat` times. Returns the probe's lines, or None when the VM ended
    under it (the exec's answer went with the channel)."""
    assert len(payload) <= ONE_WRITE
    sb.write_file("/payload", payload)
    try:
        r = sb.exec(["sh", "-c", f"{PROBE_IN_SANDBOX} fd_inject 1 vport {repeat} </payload >/out 2>&1; "
                     "cat /out"], timeout=timeout)
    except DsecError as err:
        _ended_with_its_vm(err)
        return None
    return r.stdout.decode().split()


def _ended_with_its_vm(err: DsecError) -> None:
    """An exec cut short by its VM's end says so: a conflict, "exiting"
    (not an internal error, not a hang)."""
    assert err.code == "conflict" and "exiting" in str(err), f"{err.code}: {err}"


# ------------------------------------------------------------ escapes, host reach

def _verdict(sb, *args) -> str:
    """The probe's verdict: `ok` or the errno name."""
    r = sb.exec([PROBE_IN_SANDBOX, *map(str, args)])
    assert r.exit_code == 0, r.stderr
    return r.stdout.decode().split()[-1]


def test_the_guest_sees_its_own_kernel_and_no_host_share(bystander, daemon):
    """No 9p or virtio-fs device, no way to mount one, no host path; what
    /proc shows is the guest kernel's. Neighbour: the guest's own files and
    its own sysfs (root mounts it)."""
    sb = bystander
    host_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    r = sb.exec(["sh", "-c", "mkdir -p /tmp/sys && mount -t sysfs sysfs /tmp/sys && "
                 "cat /tmp/sys/bus/virtio/devices/*/device; umount /tmp/sys"])
    assert r.exit_code == 0, r.stderr
    ids = {int(x, 16) for x in r.stdout.decode().split()}
    assert ids and ids <= set(VIRTIO_EXPECTED), f"unexpected virtio devices {ids - set(VIRTIO_EXPECTED)}"
    assert not ids & set(VIRTIO_SHARES)
    fs = sb.exec(["cat", "/proc/filesystems"]).stdout.decode()
    assert "9p" not in fs and "virtiofs" not in fs, fs
    for kind, src in (("9p", "hostshare"), ("virtiofs", "hostshare")):
        r = sb.exec(["sh", "-c", f"mkdir -p /tmp/m && mount -t {kind} {src} /tmp/m"])
        assert r.exit_code != 0, f"mount -t {kind} succeeded in the guest"
    # The host's paths: the daemon's socket and state dir, a file made now.
    marker = daemon.state / f"host-only-{os.getpid()}"
    marker.write_text("host")
    try:
        for path in (daemon.socket, str(daemon.state), str(marker)):
            assert _verdict(sb, "stat", path) == "ENOENT", path
    finally:
        marker.unlink()
    unix = sb.exec(["cat", "/proc/net/unix"]).stdout.decode()
    assert daemon.socket not in unix
    assert sb.exec(["cat", "/proc/sys/kernel/random/boot_id"]).stdout.decode().strip() != host_boot_id
    assert _verdict(sb, "stat", "/bin/sh") == "ok"


def _blob(daemon, digest: str) -> Path:
    hexd = digest.split(":", 1)[1]
    found = [p for p in daemon.state.rglob(f"*{hexd}*") if p.is_file()]
    assert found, f"no blob of layer {digest} under {daemon.state}"
    return found[0]


def test_a_layer_written_through_its_pmem_device_stays_unchanged_on_the_host(victim, vmc, bystander, daemon):
    """The layers are the store's blobs, mapped read-only into QEMU
    (memory-backend-file readonly=on): root in the guest may write to
    /dev/pmem0, but no byte reaches the blob the bystander and every other
    sandbox of the image read."""
    digest = victim.inspect()["layers"][0]
    blob = _blob(daemon, digest)
    before = hashlib.sha256(blob.read_bytes()).hexdigest()
    # A write to the device, then its flush: the stores go to memory QEMU
    # mapped read-only, and the writer never finishes (it blocks in the
    # guest's kernel, state D). Run detached; wait for either end.
    victim.exec(["sh", "-c", "setsid dd if=/dev/urandom of=/dev/pmem0 bs=4096 count=64 conv=notrunc,fsync "
                 "</dev/null >/tmp/dd.out 2>&1 & echo $! > /tmp/dd.pid"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = victim.exec(["sh", "-c", "cat /tmp/dd.out; s=$(cat /proc/$(cat /tmp/dd.pid)/stat 2>/dev/null); "
                             "echo state=${s#*) }"]).stdout.decode()
        if "records out" in state or "state=D" in state:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the write to /dev/pmem0 neither ended nor blocked: {state}")
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == before, f"the blob changed ({state})"
    assert victim.exec(["echo", "alive"]).stdout == b"alive\n"
    assert f"sha256:{before}" == digest or before in blob.name
    # Its neighbours read the layer as before (the bystander's pages are the blob's).
    assert bystander.exec(["sh", "-c", "ls /bin/sh && md5sum /bin/busybox"]).exit_code == 0
    _others_fine(vmc, bystander)


# ------------------------------------------------------------ control plane

def test_root_in_the_guest_cannot_kill_its_agent(bystander, vmc):
    """PID 1 of its own kernel: SIGKILL from inside is not delivered to it
    (the guest would panic and end its own VM, which is allowed too)."""
    r = bystander.exec(["sh", "-c", "kill -KILL 1; kill -TERM 1; kill -STOP 1; echo sent"])
    assert r.stdout == b"sent\n"
    assert bystander.exec(["echo", "agent fine"]).stdout == b"agent fine\n"
    _others_fine(vmc, bystander)


def _unasked_frames() -> bytes:
    """Well-formed frames of every answer type (and one unknown) for ids no
    request or exec of the host has: what the host must drop."""
    frames = b""
    for i, kind in enumerate((wire.OK, wire.ERR, wire.DATA, wire.OUT, wire.EXITED, wire.READY, wire.STARTED,
                              wire.TAKEN, 250)):
        frames += wire.frame(kind, 0x7FFF0000 + i, wire.u64(1), wire.bstr(b"x" * 1000))
    return frames * (ONE_WRITE // len(frames))


def test_a_flood_of_unasked_answers_is_dropped_and_the_vm_goes_on(bystander, vmc, daemon):
    """Root in the guest takes its agent's channel and floods the host with
    answers to requests never sent and output of execs that do not exist:
    the host drops them, its memory stays bounded, the VM keeps serving."""
    payload = _unasked_frames()
    repeat = 2048                             # 64 MiB of frames
    with PeakRss(daemon) as rss:
        lines = _inject(bystander, payload, repeat)
    assert lines is not None, "the VM ended under well-formed frames"
    assert lines[-1] == "ok" and int(facts(lines)["written"]) == len(payload) * repeat, lines
    assert rss.grown < len(payload) * repeat // 4, f"the daemon's peak RSS grew by {rss.grown} bytes"
    assert bystander.inspect()["state"] == "running"
    assert bystander.exec(["echo", "still serving"]).stdout == b"still serving\n"
    assert bystander.read_file("/payload") == payload
    _others_fine(vmc, bystander)


BROKEN = {
    # A header announcing 4 GiB, then bytes: the host must not wait for (and
    # buffer) the body. Before the length check, the daemon kept every byte.
    "huge_length": struct.pack(">IBI", 0xFFFFFFF0, wire.OUT, 1),
    "short_length": struct.pack(">IBI", 3, wire.OK, 1),
    # An exec's OUT (the probe's own exec has a low id) whose byte string runs past the frame.
    "cut_field": wire.HEADER.pack(5 + 8 + 4, wire.OUT, 1) + wire.u64(1) + struct.pack(">I", 4096),
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_bytes_that_are_no_frame_end_that_vm_only(victim, vmc, bystander, daemon, how):
    """The host ends a VM whose channel carries bytes that are no frame
    (its agent is unreachable: it serves nothing any more): QEMU killed,
    reported dead (reason agent_protocol, a detail saying what), cleaned
    up, the daemon's memory bounded, the bystander untouched."""
    info = victim.inspect()
    pid, cgroups = info["vm"]["qemu_pid"], list(info["cgroups"].values())
    payload = BROKEN[how].ljust(ONE_WRITE, b"\0")
    repeat = 4096                             # 128 MiB after the bad header
    with PeakRss(daemon) as rss:
        _inject(victim, payload, repeat)
        _wait_dead(vmc, victim.id)
    assert rss.grown < len(payload) * repeat // 4, f"the daemon's peak RSS grew by {rss.grown} bytes"
    died = [e for e in _events(daemon, victim.id) if e["event"] == "died"]
    assert died and died[0]["reason"] == "agent_protocol", died
    assert "frame" in died[0]["detail"] or "cut short" in died[0]["detail"], died
    _gone(daemon, victim.id, pid, cgroups)
    _others_fine(vmc, bystander)


def _output_for(exec_id: int, size: int) -> bytes:
    """OUT frames of `size` bytes for exec `exec_id`, one write's worth. The
    host's exec ids start at a random point (root in the guest learns one by
    reading its agent's memory or channel); the test reads it from the
    daemon's debug log instead."""
    frame = wire.frame(wire.OUT, exec_id, wire.u64(1), wire.bstr(b"w" * size))
    frames = frame * (ONE_WRITE // len(frame))
    assert len(frames) <= ONE_WRITE
    return frames


def _exec_id(daemon, sb_id: str, argv0: str, timeout: float = 10) -> int:
    """The id the daemon's link gave the last exec of `argv0` in microVM `sb_id` (its debug log)."""
    pattern = re.compile(rf"microVM {sb_id}: exec id (\d+): {re.escape(argv0)}\b")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.findall(daemon.log.read_text(errors="replace"))
        if found:
            return int(found[-1])
        time.sleep(0.1)
    raise AssertionError(f"no exec id of {argv0!r} in microVM {sb_id} in the daemon's log")


def test_output_past_an_execs_window_ends_that_vm_only(victim, vmc, bystander, daemon):
    """A guest that ignores its window: the agent stops sending an exec's
    output a window ahead of what the daemon took (an exec whose client
    reads nothing stalls there); root in the guest writes more output for
    it on the taken channel. The host counts what each exec was sent against
    its window and ends the VM as a protocol break (reason agent_protocol),
    with the daemon's memory bounded: before, every byte queued in it."""
    from stream_kit import SlowStream

    info = victim.inspect()
    pid, cgroups = info["vm"]["qemu_pid"], list(info["cgroups"].values())
    stalled = SlowStream(daemon.socket, victim.id, ["cat", "/dev/zero"])    # a terminal: no output cap
    try:
        stalled.read_at_least(1)
        payload = _output_for(_exec_id(daemon, victim.id, "cat"), 100)
        repeat = 4096                         # 27 kB of output a write, 110 MB in all: past any window
        with PeakRss(daemon) as rss:
            _inject(victim, payload, repeat)
            _wait_dead(vmc, victim.id)
    finally:
        stalled.close()
    assert rss.grown < len(payload) * repeat // 4, f"the daemon's peak RSS grew by {rss.grown} bytes"
    died = [e for e in _events(daemon, victim.id) if e["event"] == "died"]
    assert died and died[0]["reason"] == "agent_protocol", died
    assert "window" in died[0]["detail"], died
    _gone(daemon, victim.id, pid, cgroups)
    _others_fine(vmc, bystander)


def test_a_never_ending_output_stream_is_capped(bystander, vmc, daemon):
    """Through the real agent: an exec whose output never ends is cut at
    the daemon's output cap, and the daemon's memory does not follow it."""
    with PeakRss(daemon) as rss:
        r = bystander.exec(["cat", "/dev/zero"], timeout=300)
    assert r.truncated and r.signal == 13        # SIGPIPE, as a container's: its pipes were closed
    cap = len(r.stdout) + len(r.stderr)
    assert cap > 0
    # The answer holds the output (the daemon's copy, its frame): a few times the cap, not more.
    assert rss.grown < 8 * cap, f"the daemon's peak RSS grew by {rss.grown} bytes for {cap} bytes of output"
    _others_fine(vmc, bystander)


# ------------------------------------------------------------ cross-sandbox

def test_one_vm_sees_nothing_of_anothers_disk_or_memory(victim, bystander, vmc):
    """The writable layer is a tmpfs in each guest's own RAM and the
    layers are read-only pmem: a marker written by one VM (its upper,
    /dev/shm, /tmp) is found nowhere in another, which has only its own
    layers' devices."""
    marker = f"cross-{os.getpid()}-{time.monotonic_ns()}"
    bystander.exec(["sh", "-c", f"echo {marker} > /etc/mark; echo {marker} > /dev/shm/mark; "
                    f"echo {marker} > /tmp/mark"])
    layers = len(victim.inspect()["layers"])
    devs = victim.exec(["sh", "-c", "ls /dev | grep -E '^(pmem|vd|sd|nvme|nbd)'"]).stdout.decode().split()
    assert sorted(devs) == sorted(f"pmem{i}" for i in range(layers)), devs
    # Its pmem devices (their blocks) and every file of its own (the root
    # overlay, /tmp, /dev/shm: -xdev keeps find off /proc, /sys and /dev's nodes).
    found = victim.exec(["sh", "-c", f"grep -l {marker} /dev/pmem*; for d in / /tmp /dev/shm; do "
                         f"find $d -xdev -type f -exec grep -l {marker} {{}} +; done; true"], timeout=300)
    assert found.stdout.decode().split() == [], found.stdout
    assert victim.exec(["sh", "-c", "cat /etc/mark /dev/shm/mark /tmp/mark"]).exit_code != 0
    # Neighbour: its own marker, where it wrote it.
    assert bystander.exec(["cat", "/etc/mark"]).stdout.decode().strip() == marker
    _others_fine(vmc, bystander)


# ------------------------------------------------------------ exhaustion

def _qemu_cgroup_memory(info: dict) -> tuple[int, int, int]:
    """QEMU's memory cgroup: its limit, its peak use and its OOM kills
    (cgroup v2 or v1, whichever the host has)."""
    group = Path(info["cgroups"].get("memory") or info["cgroups"]["unified"])
    if (group / "memory.max").exists():
        limit = int((group / "memory.max").read_text())
        peak = int((group / "memory.peak").read_text()) if (group / "memory.peak").exists() else 0
        kills = dict(line.split() for line in (group / "memory.events").read_text().splitlines())["oom_kill"]
        return limit, peak, int(kills)
    limit = int((group / "memory.limit_in_bytes").read_text())
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return limit, peak, int(oom.get("oom_kill", 0))


FLOODS = {
    # Processes until its kernel refuses (threads-max, memory): no host pid is used.
    "forkbomb": f"{PROBE_IN_SANDBOX} forkbomb 1000000",
    # More memory than the guest has: its own OOM killer ends the hog.
    "memory": f"{PROBE_IN_SANDBOX} alloc 1024",
    # The writable layer: a tmpfs of --disk bytes in the guest.
    "disk": "dd if=/dev/zero of=/fill bs=1M count=1024; ls -l /fill",
}


def _qemu_limit(daemon, info: dict) -> int:
    """What QEMU's memory cgroup must be capped at: the guest's RAM plus the
    daemon's microvm.memory_overhead."""
    return info["vm"]["guest_memory"] + load_config(str(daemon.config)).size("microvm", "memory_overhead")


@pytest.mark.parametrize("flood", sorted(FLOODS))
def test_a_flood_stays_inside_its_vm(victim, vmc, bystander, daemon, flood):
    """Each flood ends inside the guest (its kernel's refusal or OOM kill),
    or at worst ends that VM, reported dead; QEMU stays under its cgroup's
    memory limit (guest RAM + microvm.memory_overhead); the daemon and the
    bystander answer throughout."""
    info = victim.inspect()
    limit, _, kills0 = _qemu_cgroup_memory(info)
    assert limit == _qemu_limit(daemon, info)
    try:
        r = victim.exec(["sh", "-c", FLOODS[flood]], timeout=300)
    except DsecError as err:            # the VM ended: it must be reported so, and nothing else harmed
        _ended_with_its_vm(err)
        _wait_dead(vmc, victim.id)
        _others_fine(vmc, bystander)
        pytest.fail(f"flood {flood} ended its VM ({err}); the guest's kernel should have stopped it")
    out = r.stdout.decode()
    if flood == "forkbomb":
        assert out.split()[-1] in ("EAGAIN", "ENOMEM"), out
    elif flood == "memory":
        assert r.signal == 9 or out.split()[-1] == "ENOMEM", (r.signal, out)
    elif flood == "disk":
        size = int(out.split()[4])
        assert 0 < size <= info["limits"]["disk"], out
        assert b"No space left" in r.stderr, r.stderr
    limit_after, peak, kills = _qemu_cgroup_memory(victim.inspect())
    assert limit_after == limit and (peak == 0 or peak <= limit)
    assert kills == kills0, "the host's OOM killer acted on QEMU"
    assert victim.exec(["echo", "alive"], timeout=120).stdout == b"alive\n"
    _others_fine(vmc, bystander)


def test_filling_tmp_ends_at_worst_its_own_vm(victim, vmc, bystander, daemon):
    """The guest's /tmp is a tmpfs of microvm.tmp_size, as large as this
    guest's RAM: filling it runs the guest out of memory. Its OOM killer
    ends the writer (its pages stay: they are files), or finds nothing to
    kill and the guest panics. Either ends inside: the exec is killed, or
    says its VM is exiting, then the VM is reported dead and cleaned up;
    the host's OOM killer never acts (QEMU stays under its limit)."""
    info = victim.inspect()
    pid, cgroups = info["vm"]["qemu_pid"], list(info["cgroups"].values())
    limit, _, kills0 = _qemu_cgroup_memory(info)
    assert limit == _qemu_limit(daemon, info)
    try:
        r = victim.exec(["sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=4096"], timeout=300)
        assert r.signal == 9 or b"No space left" in r.stderr, r
        assert _qemu_cgroup_memory(victim.inspect())[2] == kills0, "the host's OOM killer acted on QEMU"
        victim.exec(["echo", "alive"], timeout=120)
    except DsecError as err:
        _ended_with_its_vm(err)
        _wait_dead(vmc, victim.id)
        died = [e for e in _events(daemon, victim.id) if e["event"] == "died"]
        assert died and died[0]["reason"] == "exited", died
        assert not [e for e in _events(daemon, victim.id) if e["event"] == "oom"]
        _gone(daemon, victim.id, pid, cgroups)
    _others_fine(vmc, bystander)


def test_a_cpu_spinner_leaves_the_other_vm_answering(victim, vmc, bystander):
    """Round trips to the bystander and the daemon go on while a guest
    spins every vCPU it has (no timing asserted: each answers)."""
    victim.exec(["sh", "-c", "setsid sh -c 'while :; do :; done' </dev/null >/dev/null 2>&1 &"])
    for _ in range(5):
        _others_fine(vmc, bystander)
        assert victim.exec(["true"], timeout=120).exit_code == 0
