"""microVM backend figures, through private daemons (`make bench-microvm`).

One VM at a time (TCG guests take a whole core while they boot; the host
has two, shared). Two daemons, one after the other:

  1. templates off: two creates that boot, then on one VM the exec round
     trip, the idle host memory of its QEMU, what the layers on pmem cost the
     guest's page cache, what the balloon's free-page reporting gives back,
     and a pause and resume;
  2. templates on: the first create (builds the template: boot, snapshot,
     store, restore), then creates that restore it, each timed to its first
     exec, the idle memory of restored VMs, and the pause and resume of one;
  3. templates on, --net default, the bridge in a bench-owned netns
     (test_net_kit.World, as bench/net.py) with a sink and a closer in
     another: creates with a NIC, TCP connects and a bulk send through the
     tap and its policy program.

`bench/microvm.py --trace-cost N` runs only what tracing a VM's exec costs
(`exec` with `trace`: the guest agent's tracer): on one restored VM, a
shell loop that runs `cat` ten times, N times untraced and N traced,
alternating; it prints trace_vm_untraced_p50_ms, trace_vm_traced_p50_ms
(the exec's round trip) and trace_vm_events (the record's events).

`bench/microvm.py --exec-output N` runs only what an exec's large output
costs (the output flow control of wire.EXEC_WINDOW): on one restored VM, N
times `dsec exec VM -- head -c 256M /dev/zero | wc -c` (a fast client:
exec_stream_256m_p50_s, exec_stream_mib_s), then one stream of ~64 MiB
(stream_kit.SlowStream) whose client reads nothing for 20 s before it reads
the rest: stalled_stream_rss_growth_mib, the daemon's peak RSS growth.

`bench/microvm.py --pmem-sharing` runs only the 10-vs-1 page cache figure.
`bench/microvm.py --own-root-cost N` runs only what a VM's own mount
namespace (vmroot.py) costs a create: two daemons, microvm.own_root on and
off, each restoring its template N times, the two alternating (so that the
host's load drifts over both alike); it prints own_root_on_create_p50_ms,
own_root_off_create_p50_ms (create -> first exec) and the _only_ figures
(the create alone); and, apart from QEMU (the create figures are noisy on
a shared host), what the namespace adds to each QEMU's start: making it
(own_root_make_p50_us: native.vm_root with a VM's entries, one layer) and
entering it (own_root_enter_p50_us: a spawn of `nsenter --mount=... true`
less one of `true`).

Progress on stderr; the last stdout line is one JSON object:

    accel                          kvm | tcg, and the probe's reason (accel_why)
    vm_boot_to_agent_s             create -> the agent answered, by a boot (median of 2)
    vm_exec_rtt_p50_ms / p99       `true`, collected, 50 times
    vm_idle_host_mib_rss / _pss    the idle booted VM's QEMU (smaps_rollup), 3 s after boot
    vm_pmem_page_cache_ratio       guest page-cache growth / data bytes read from the image (0: DAX, no copy)
    vm_pmem_page_cache_ratio_10_vs_1  host memory holding the layer's data read by 10 restored guests
                                   / by one (the QEMUs' PSS of the layer blob + guest page-cache copies;
                                   _one_guest_kib and _ten_guests_kib say both)
    vm_balloon_returned_fraction   host RSS given back after the guest freed 128 MiB it had written
    vm_pause_s, vm_resume_s        pause (state saved, QEMU ended) and resume (state loaded)
    vm_resume_first_exec_ms        an exec on a paused VM: resume included
    vm_pause_image_mib             the saved state's size
    vm_idle_unballooned_host_mib   an idle booted VM's QEMU RSS before it was ever ballooned (its first idle period)
    vm_idle_ballooned_host_mib     the same VM's QEMU RSS once the policy ballooned it (median of 3 idle periods)
    vm_idle_(un)ballooned_anon_mib the same, its anonymous memory only (the guest's RAM, QEMU's heap and TCG's
                                   cache; not the layers' page cache its DAX mappings share with the host)
    vm_idle_ballooned_guest_mib    the guest's size the policy chose (working set + headroom, >= floor)
    vm_exec_after_idle_ms          `true` on the ballooned VM: the wake's deflate included (median of 3)
    vm_exec_after_short_idle_ms    the control: `true` after 3 s idle, not ballooned (median of 3)
    vm_deflate_s                   that exec's start -> the guest has its whole RAM back (median of 3; as
                                   inspect shows it, refreshed each balloon_interval_s: 1 s here)
    vm_ballooned_pause_image_mib   a pause of the ballooned VM: its saved state (the balloon's pages are zero)
    vm_template_build_s            the first create of a shape: boot, snapshot, store, restore
    vm_template_create_p50_ms      create -> first exec answered, restoring the template (p50 of 7)
    vm_template_create_only_p50_ms the create alone (restore and the agent's HELLO)
    vm_template_ram_mib            the template's RAM (data pages of its memfd)
    vm_template_idle_mib_rss / _pss one of two idle restored VMs' QEMU: PSS splits the
                                   template's pages both map between them
    vm_template_pause_s / _resume_first_exec_ms   a restored VM's pause, and an exec on it paused
    vm_spawn_p50_ms / p99          `sb.spawn(["true"])` until it returns the pid (the agent forked and
                                   exec'd it, and the daemon attached to it), 30 times on a restored VM
    vm_net_create_p50_ms           --net default create -> first exec (restored, NIC set up; p50 of 3)
    vm_net_connect_ms              one TCP connect+close from the guest through the tap (mean of 50, in one exec)
    vm_net_send_mbit_s             a 64 MiB send from the guest to the sink (busybox dd | nc)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import build_rootfs, log, private_daemon, run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from dsecd import SyncClient  # noqa: E402
from dsecd.backends.microvm.vmroot import LAYER  # noqa: E402

IMAGE = "busybox"
LAYERS_IN_ROOT = LAYER.format("")      # where a QEMU in its own root maps the layer blobs


def smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def guest_cached(sb) -> int:
    for line in sb.exec(["cat", "/proc/meminfo"]).stdout.decode().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached: in the guest's /proc/meminfo")


def booted(c) -> dict:
    """Phase 1 (templates off): a booted VM's figures."""
    boots = []
    for i in range(2):
        t0 = time.monotonic()
        sb = c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M")
        boots.append(time.monotonic() - t0)
        log(f"boot {i + 1}: {boots[-1]:.2f} s")
        if i == 0:
            sb.destroy()
    rtts = []
    for _ in range(50):
        t0 = time.perf_counter()
        sb.exec(["true"])
        rtts.append((time.perf_counter() - t0) * 1000)
    rtts.sort()
    log(f"exec rtt p50 {rtts[25]:.2f} ms p99 {rtts[-1]:.2f} ms")
    time.sleep(3)
    pid = sb.inspect()["vm"]["qemu_pid"]
    idle = smaps(pid)
    log(f"idle QEMU: RSS {idle['Rss'] >> 20} MiB, PSS {idle['Pss'] >> 20} MiB")

    sb.exec(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"])
    # The stat reads the file's metadata (EROFS reads metadata through the
    # block device's page cache even with DAX): what follows is data only.
    size = int(sb.exec(["stat", "-c", "%s", "/bin/busybox"]).stdout)
    before = guest_cached(sb)
    sb.exec(["sh", "-c", "cat /bin/busybox > /dev/null"])
    ratio = max(0, guest_cached(sb) - before) / size
    log(f"pmem: read {size} bytes of the image, guest page cache grew by {ratio:.3f} of it")

    rss0 = smaps(pid)["Rss"]
    sb.exec(["sh", "-c", "dd if=/dev/zero of=/fill bs=1M count=128 2>/dev/null"])
    rss1 = smaps(pid)["Rss"]
    sb.exec(["rm", "/fill"])
    time.sleep(6)          # free page reporting runs every 2 s on pageblocks of 2 MiB+
    rss2 = smaps(pid)["Rss"]
    returned = (rss1 - rss2) / max(1, rss1 - rss0)
    log(f"balloon: RSS {rss0 >> 20} -> {rss1 >> 20} MiB after 128 MiB touched, {rss2 >> 20} MiB "
        f"after they were freed: {returned:.2f} returned")

    pause_s, resume_s, first_exec_ms, paused = pause_figures(sb)
    sb.destroy()
    return {
        "vm_boot_to_agent_s": round(statistics.median(boots), 3),
        "vm_exec_rtt_p50_ms": round(rtts[25], 3), "vm_exec_rtt_p99_ms": round(rtts[-1], 3),
        "vm_idle_host_mib_rss": round(idle["Rss"] / 2**20, 1), "vm_idle_host_mib_pss": round(idle["Pss"] / 2**20, 1),
        "vm_pmem_page_cache_ratio": round(ratio, 4),
        "vm_balloon_returned_fraction": round(returned, 3),
        "vm_pause_s": round(pause_s, 3), "vm_resume_s": round(resume_s, 3),
        "vm_resume_first_exec_ms": round(first_exec_ms, 1),
        "vm_pause_image_mib": round(paused.get("image_bytes", 0) / 2**20, 1),
    }


BALLOON_IDLE_S = 10.0      # phase 1's microvm.balloon_idle_s: past the idle figures above (3 and 6 s)


def _ballooned(sb, timeout: float = 120.0) -> dict:
    """Wait until the idle balloon made the VM small and the guest got there."""
    deadline = time.monotonic() + timeout
    view = None
    while time.monotonic() < deadline:
        view = sb.inspect()["vm"]["balloon"]
        if view and view["ballooned"] and view["guest_size"] <= view["target"] + (1 << 20):
            return view
        time.sleep(0.25)
    raise RuntimeError(f"sandbox {sb.id} was not ballooned within {timeout:.0f} s: {view}")


def idle_balloon(c, rounds: int = 3) -> dict:
    """The idle balloon on a booted VM: QEMU's RSS idle before and after the
    policy ballooned it, and the first exec after (the wake)."""
    sb = c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M")
    pid = sb.inspect()["vm"]["qemu_pid"]
    before, after, sizes, execs, deflates, controls = [], [], [], [], [], []
    for i in range(rounds):
        sb.exec(["true"])
        time.sleep(3)
        t0 = time.perf_counter()          # the control: an exec after 3 s idle, not ballooned
        sb.exec(["true"])
        controls.append((time.perf_counter() - t0) * 1000)
        time.sleep(3)
        before.append(smaps(pid))
        view = _ballooned(sb)
        time.sleep(1)
        after.append(smaps(pid))
        sizes.append(view["guest_size"])
        t0 = time.perf_counter()
        sb.exec(["true"])
        execs.append((time.perf_counter() - t0) * 1000)
        while sb.inspect()["vm"]["balloon"]["guest_size"] < view["ram"]:
            time.sleep(0.02)
        deflates.append(time.perf_counter() - t0)
        log(f"idle balloon {i + 1}: RSS {before[-1]['Rss'] >> 20} -> {after[-1]['Rss'] >> 20} MiB, anonymous "
            f"{before[-1]['Anonymous'] >> 20} -> {after[-1]['Anonymous'] >> 20} MiB (guest {sizes[-1] >> 20} "
            f"MiB), exec after {execs[-1]:.1f} ms (after 3 s idle, not ballooned: {controls[-1]:.1f} ms), "
            f"deflated in {deflates[-1]:.2f} s")
    _ballooned(sb)
    paused = sb.pause()
    log(f"pause of the ballooned VM: image {paused.get('image_bytes', 0) >> 20} MiB")
    sb.destroy()
    med = statistics.median
    # "Before" is the first idle period's: the later ones start from what
    # the first ballooning left (pages it returned stay untouched).
    return {"vm_idle_unballooned_host_mib": round(before[0]["Rss"] / 2**20, 1),
            "vm_idle_ballooned_host_mib": round(med(m["Rss"] for m in after) / 2**20, 1),
            "vm_idle_unballooned_anon_mib": round(before[0]["Anonymous"] / 2**20, 1),
            "vm_idle_ballooned_anon_mib": round(med(m["Anonymous"] for m in after) / 2**20, 1),
            "vm_idle_ballooned_guest_mib": round(med(sizes) / 2**20, 1),
            "vm_exec_after_idle_ms": round(med(execs), 1), "vm_deflate_s": round(med(deflates), 2),
            "vm_exec_after_short_idle_ms": round(med(controls), 1),
            "vm_ballooned_pause_image_mib": round(paused.get("image_bytes", 0) / 2**20, 1)}


def pause_figures(sb) -> tuple[float, float, float, dict]:
    t0 = time.monotonic()
    paused = sb.pause()
    pause_s = time.monotonic() - t0
    t0 = time.monotonic()
    sb.resume()
    resume_s = time.monotonic() - t0
    sb.pause()
    t0 = time.perf_counter()
    sb.exec(["true"])
    first_exec_ms = (time.perf_counter() - t0) * 1000
    log(f"pause {pause_s:.2f} s (image {paused.get('image_bytes', 0) >> 20} MiB), resume {resume_s:.2f} s, "
        f"first exec on a paused VM {first_exec_ms:.0f} ms")
    return pause_s, resume_s, first_exec_ms, paused


def layer_pss(pid: int) -> int:
    """PSS of a QEMU's mappings of layer blobs (the virtio-pmem devices'
    memory-backend-file on the store's blobs): the host's page cache of the
    layers this QEMU touched, split with every other process that maps it.
    A QEMU in its own root (microvm.own_root) maps them by their paths
    there, /layers/<i>."""
    total, in_blob = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:       # a mapping's first line
            in_blob = len(head) >= 6 and ("/store/blobs/" in head[5] or head[5].startswith(LAYERS_IN_ROOT))
        elif in_blob and head[0] == "Pss:":
            total += int(head[1]) * 1024
    return total


def pmem_sharing(c, create, n: int = 10) -> dict:
    """Host memory holding one layer's data read by one guest, then by n:
    the QEMUs' PSS of the layer blob (the host page cache DAX maps into each
    guest, counted once however many share it) plus what each guest copied
    into its own page cache (guest RAM, host memory too). With DAX the n
    guests cost what one does; with copies they would cost up to n times."""
    vms = []
    try:
        for _ in range(n):
            vms.append(create())
        pids = [sb.inspect()["vm"]["qemu_pid"] for sb in vms]
        base = sum(layer_pss(p) for p in pids)
        copies = 0
        costs = []
        for sb in vms:
            before = guest_cached(sb)
            sb.exec(["sh", "-c", "cat /bin/busybox > /dev/null"])
            copies += max(0, guest_cached(sb) - before)
            costs.append(sum(layer_pss(p) for p in pids) - base + copies)
    finally:
        for sb in vms:
            sb.destroy()
    ratio = costs[-1] / max(1, costs[0])
    log(f"pmem sharing: one guest reading the layer costs the host {costs[0] >> 10} KiB, {n} guests "
        f"{costs[-1] >> 10} KiB (ratio {ratio:.3f}; guest page-cache copies {copies >> 10} KiB in all)")
    return {"vm_pmem_page_cache_ratio_10_vs_1": round(ratio, 3),
            "vm_pmem_one_guest_kib": costs[0] >> 10, "vm_pmem_ten_guests_kib": costs[-1] >> 10}


def spawn_figures(sb) -> dict:
    """Background processes (kept by the guest agent): the start's round trip."""
    for _ in range(5):
        sb.spawn(["true"]).wait()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        proc = sb.spawn(["true"])
        times.append((time.perf_counter() - t0) * 1000)
        proc.wait()
    times.sort()
    log(f"spawn p50 {statistics.median(times):.2f} ms p99 {times[-1]:.2f} ms")
    return {"vm_spawn_p50_ms": round(statistics.median(times), 3), "vm_spawn_p99_ms": round(times[-1], 3)}


def from_templates(c, state_dir: Path) -> dict:
    """Phase 2 (templates on): the template's build, restores, their memory."""
    def create():
        return c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M")

    t0 = time.monotonic()
    sb = create()
    sb.exec(["true"])
    build_s = time.monotonic() - t0
    key = sb.inspect()["vm"]["template"]
    meta = json.loads((state_dir / "vm-templates" / key / "meta.json").read_text())
    log(f"template build (first create, to its first exec): {build_s:.2f} s; boot {meta['boot_s']} s, "
        f"RAM {meta['ram_data_bytes'] >> 20} MiB, device state {meta['state_bytes'] >> 10} KiB")
    sb.destroy()
    total, alone = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        sb = create()
        t1 = time.perf_counter()
        sb.exec(["true"])
        t2 = time.perf_counter()
        total.append((t2 - t0) * 1000)
        alone.append((t1 - t0) * 1000)
        sb.destroy()
    log(f"restores: create+first exec {sorted(round(x) for x in total)} ms, "
        f"create alone {sorted(round(x) for x in alone)} ms")
    a, b = create(), create()
    time.sleep(3)
    idle = smaps(a.inspect()["vm"]["qemu_pid"])
    log(f"idle restored QEMU (one of two): RSS {idle['Rss'] >> 20} MiB, PSS {idle['Pss'] >> 20} MiB")
    b.destroy()
    spawns = spawn_figures(a)
    pause_s, _resume_s, first_exec_ms, _ = pause_figures(a)
    a.destroy()
    sharing = pmem_sharing(c, create)
    return {
        **sharing, **spawns,
        "vm_template_build_s": round(build_s, 3),
        "vm_template_create_p50_ms": round(statistics.median(total), 1),
        "vm_template_create_only_p50_ms": round(statistics.median(alone), 1),
        "vm_template_ram_mib": round(meta["ram_data_bytes"] / 2**20, 1),
        "vm_template_idle_mib_rss": round(idle["Rss"] / 2**20, 1),
        "vm_template_idle_mib_pss": round(idle["Pss"] / 2**20, 1),
        "vm_template_pause_s": round(pause_s, 3),
        "vm_template_resume_first_exec_ms": round(first_exec_ms, 1),
    }


def networked(c, world) -> dict:
    """Phase 3: creates with a NIC, connects and a bulk send through the tap."""
    allow = [f"{world.pkg}:5001-5002/tcp"]

    def create():
        return c.create(IMAGE, backend="microvm", memory="256M", net="default", allow=allow, disk="256M")

    creates = []
    for i in range(4):
        t0 = time.perf_counter()
        sb = create()
        sb.exec(["true"])
        dt = (time.perf_counter() - t0) * 1000
        log(f"--net default create {i + 1} (to first exec): {dt:.0f} ms")
        if i:                      # the first builds the template of this shape (NIC and all)
            creates.append(dt)
        if i < 3:
            sb.destroy()
    n = 50
    loop = f"i=0; while [ $i -lt {n} ]; do nc -w 2 {world.pkg} 5002 </dev/null || exit 1; i=$((i+1)); done"
    t0 = time.perf_counter()
    r = sb.exec(["sh", "-c", loop], timeout=300)
    connect_ms = (time.perf_counter() - t0) * 1000 / n
    if r.exit_code != 0:
        raise RuntimeError(f"connects from the guest failed: {r.stderr!r}")
    log(f"TCP connect+close from the guest: {connect_ms:.1f} ms each (busybox nc, mean of {n})")
    mib = 64
    t0 = time.perf_counter()
    r = sb.exec(["sh", "-c", f"dd if=/dev/zero bs=65536 count={mib * 16} 2>/dev/null | nc {world.pkg} 5001"],
                timeout=300)
    secs = time.perf_counter() - t0
    if r.exit_code != 0:
        raise RuntimeError(f"the send from the guest failed: {r.stderr!r}")
    mbit = mib * 8 * 1.048576 / secs
    log(f"send {mib} MiB from the guest: {secs:.2f} s, {mbit:.0f} Mbit/s")
    view = sb.net_show()
    sb.destroy()
    return {"vm_net_create_p50_ms": round(statistics.median(creates), 1), "vm_net_connect_ms": round(connect_ms, 2),
            "vm_net_send_mbit_s": round(mbit, 1), "vm_net_dropped_packets": view["default"]["dropped_packets"]}


def own_root_parts(n: int = 200) -> dict:
    """What the namespace adds to a QEMU's start, without QEMU: make it, enter it."""
    import os
    import subprocess
    import tempfile

    from dsecd.backends.microvm import guestimg, vmroot

    guest = guestimg.load(Path("/var/cache/dsecd/guest"))
    with tempfile.TemporaryDirectory(prefix="dsecd-bench-vmroot-") as tmp:
        vm, blob = Path(tmp) / "vm", Path(tmp) / "blob"
        vm.mkdir()
        blob.write_bytes(b"\0" * 4096)
        roots = vmroot.VmRoots(Path(tmp) / "root", "/usr/bin/qemu-system-x86_64", kvm=False)
        make, plain, entered = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            fd = roots.make(vm, [blob], guest)
            make.append((time.perf_counter() - t0) * 1e6)
            try:
                t0 = time.perf_counter()
                subprocess.run(["/usr/bin/true"], check=True)
                t1 = time.perf_counter()
                subprocess.run(["nsenter", f"--mount=/proc/self/fd/{fd}", "--", "/usr/bin/true"], pass_fds=[fd],
                               check=True)
                t2 = time.perf_counter()
            finally:
                os.close(fd)
            plain.append((t1 - t0) * 1e6)
            entered.append((t2 - t1) * 1e6)
    out = {"own_root_make_p50_us": round(statistics.median(make)),
           "own_root_enter_p50_us": round(statistics.median(entered) - statistics.median(plain))}
    log(f"own root, {n} times: make p50 {out['own_root_make_p50_us']} us; spawn of true p50 "
        f"{statistics.median(plain):.0f} us, through nsenter {statistics.median(entered):.0f} us")
    return out


def vm_client(sock: str) -> tuple[SyncClient, dict]:
    """A connected client of a private daemon, and its microVM backend's info;
    RuntimeError when that backend is unavailable here."""
    c = SyncClient(sock)
    c.connect()
    vm = c.info()["backends"]["microvm"]
    if not vm["available"]:
        raise RuntimeError(f"backend microvm unavailable: {vm['why']}")
    return c, vm


def own_root_cost(rootfs: str, n: int) -> dict:
    """Template creates with and without the VM's own mount namespace, alternating."""
    out: dict = own_root_parts()
    with private_daemon(rootfs, IMAGE, tag="on") as on, \
            private_daemon(rootfs, IMAGE, tag="off", extra_config="[microvm]\nown_root = false\n") as off:
        clients = {}
        for name, d in (("on", on), ("off", off)):
            clients[name], vm = vm_client(d.sock)
            log(f"own_root {name}: {vm['own_mount_namespace']} ({vm['root']})")
            clients[name].create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M").destroy()   # the template
        times: dict = {name: ([], []) for name in clients}
        for _ in range(n):
            for name, c in clients.items():
                t0 = time.perf_counter()
                sb = c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M")
                t1 = time.perf_counter()
                sb.exec(["true"])
                t2 = time.perf_counter()
                sb.destroy()
                times[name][0].append((t2 - t0) * 1000)
                times[name][1].append((t1 - t0) * 1000)
        for name, c in clients.items():
            total, alone = times[name]
            log(f"own_root {name}: create+first exec {sorted(round(x) for x in total)} ms")
            out[f"own_root_{name}_create_p50_ms"] = round(statistics.median(total), 1)
            out[f"own_root_{name}_create_only_p50_ms"] = round(statistics.median(alone), 1)
            c.close()
    return out


TRACE_LOOP = ["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do cat /etc/passwd > /dev/null; done"]


def trace_cost(rootfs: str, n: int) -> dict:
    """A VM exec's round trip untraced and traced (the guest's tracer), alternating."""
    with private_daemon(rootfs, IMAGE) as d:
        c, vm = vm_client(d.sock)
        sb = c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="256M")
        try:
            times: dict = {False: [], True: []}
            events = 0
            for _ in range(n + 2):          # the first two of each warm the guest's caches
                for traced in (False, True):
                    t0 = time.perf_counter()
                    r = sb.exec(TRACE_LOOP, trace=traced)
                    times[traced].append((time.perf_counter() - t0) * 1000)
                    if traced:
                        if "error" in r.trace:
                            raise RuntimeError(f"traced exec: {r.trace['error']}")
                        events = len(r.trace["events"])
            untraced, traced_ms = times[False][2:], times[True][2:]
            log(f"accel {vm['accel']}: untraced {sorted(round(x) for x in untraced)} ms, "
                f"traced {sorted(round(x) for x in traced_ms)} ms, {events} events")
            return {"accel": vm["accel"], "trace_vm_untraced_p50_ms": round(statistics.median(untraced), 1),
                    "trace_vm_traced_p50_ms": round(statistics.median(traced_ms), 1), "trace_vm_events": events}
        finally:
            sb.destroy(force=True)
            c.close()


EXEC_OUTPUT_BYTES = 256 << 20
STALLED_BLOCKS, STALL_S = 96, 20.0


def _peak_rss_growth(pid: int, block) -> int:
    """The daemon's peak RSS over block() above its RSS before (VmHWM reset first)."""
    def status(field: str) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) << 10
        raise RuntimeError(f"no {field} in /proc/{pid}/status")
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    start = status("VmRSS")
    block()
    return status("VmHWM") - start


def exec_output(rootfs: str, n: int) -> dict:
    """A large output through a VM exec's flow control: fast and stalled clients."""
    import subprocess

    from stream_kit import SlowStream

    cap = f'[limits]\nmax_exec_output_bytes = "{2 * EXEC_OUTPUT_BYTES >> 20}M"\n'
    with private_daemon(rootfs, IMAGE, extra_config=cap) as d:
        c, vm = vm_client(d.sock)
        sb = c.create(IMAGE, backend="microvm", memory="256M", net="none", disk="64M")
        try:
            dsec = str(Path(sys.executable).parent / "dsec")
            cmd = f"{dsec} --socket {d.sock} exec {sb.id} -- head -c {EXEC_OUTPUT_BYTES} /dev/zero | wc -c"
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout
                times.append(time.perf_counter() - t0)
                if int(out) != EXEC_OUTPUT_BYTES:
                    raise RuntimeError(f"`{cmd}` counted {out.strip()} bytes, not {EXEC_OUTPUT_BYTES}")
            sb.exec(["sh", "-c", "seq -w 1 100000 > /tmp/f"])
            loop = f'i=0; while [ $i -lt {STALLED_BLOCKS} ]; do echo "block $i"; cat /tmp/f; i=$((i+1)); done'
            got = []

            def stalled() -> None:
                stream = SlowStream(d.sock, sb.id, ["sh", "-c", loop], pty=False)
                try:
                    stream.read_at_least(1 << 20)
                    time.sleep(STALL_S)
                    stream.read_to_end()
                    got.append(len(stream.data))
                finally:
                    stream.close()
            growth = _peak_rss_growth(d.proc.pid, stalled)
            p50 = statistics.median(times)
            log(f"accel {vm['accel']}: 256 MiB streamed in {sorted(round(t, 2) for t in times)} s; "
                f"a stalled stream of {got[0]} bytes grew the daemon by {growth >> 20} MiB")
            return {"accel": vm["accel"], "exec_stream_256m_p50_s": round(p50, 2),
                    "exec_stream_mib_s": round(EXEC_OUTPUT_BYTES / (1 << 20) / p50, 1),
                    "stalled_stream_bytes": got[0], "stalled_stream_rss_growth_mib": round(growth / (1 << 20), 1)}
        finally:
            sb.destroy(force=True)
            c.close()


def main() -> int:
    rootfs = build_rootfs()
    if len(sys.argv) == 3 and sys.argv[1] == "--exec-output":
        print(json.dumps(exec_output(rootfs, int(sys.argv[2]))))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--trace-cost":
        print(json.dumps(trace_cost(rootfs, int(sys.argv[2]))))
        return 0
    if len(sys.argv) == 2 and sys.argv[1] == "--pmem-sharing":
        with private_daemon(rootfs, IMAGE) as d:
            c = SyncClient(d.sock)
            c.connect()
            print(json.dumps(pmem_sharing(c, lambda: c.create(IMAGE, backend="microvm", memory="256M",
                                                              net="none", disk="256M"))))
            c.close()
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--own-root-cost":
        print(json.dumps(own_root_cost(rootfs, int(sys.argv[2]))))
        return 0
    out: dict = {}
    with private_daemon(rootfs, IMAGE, extra_config=f"[microvm]\ntemplates = false\nballoon_idle_s = "
                        f"{BALLOON_IDLE_S}\nballoon_interval_s = 1.0\n") as d:
        c = SyncClient(d.sock)
        c.connect()
        vm = c.info()["backends"]["microvm"]
        if not vm["available"]:
            log(f"backend microvm unavailable: {vm['why']}")
            print(json.dumps({"accel": None, "accel_why": vm["why"]}))
            return 1
        log(f"accel {vm['accel']}: {vm['why']}")
        out.update({"accel": vm["accel"], "accel_why": vm["why"]})
        out.update(booted(c))
        out.update(idle_balloon(c))
        c.close()
    with private_daemon(rootfs, IMAGE) as d:
        c = SyncClient(d.sock)
        c.connect()
        out.update(from_templates(c, Path(d.state)))
        c.close()
    from net import daemon_config, start_sink
    from test_net_kit import World, bpf_skip_reason

    why = bpf_skip_reason()
    if why:
        log(f"no network figures: {why}")
    else:
        world = World(network=False)
        sink = None
        try:
            sink = start_sink(world)
            with private_daemon(rootfs, IMAGE, extra_config=daemon_config(world, 0)) as d:
                c = SyncClient(d.sock)
                c.connect()
                out.update(networked(c, world))
                c.close()
        finally:
            if sink is not None:
                sink.kill()
                sink.wait()
            world.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    run(main)
