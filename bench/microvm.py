"""microVM backend figures, through a private daemon (`make bench-microvm`).

One VM at a time (TCG guests take a whole core while they boot; the host
has two, shared): two creates for the boot time, then on one VM the exec
round trip, the idle host memory of its QEMU, what the layers on pmem cost
the guest's page cache, what the balloon's free-page reporting gives back,
and a pause and resume. Progress on stderr; the last stdout line is one JSON
object:

    accel                        kvm | tcg, and the probe's reason (accel_why)
    vm_boot_to_agent_s           create -> the agent answered (median of 2)
    vm_exec_rtt_p50_ms / p99     `true`, collected, 50 times
    vm_idle_host_mib_rss / _pss  the idle VM's QEMU (smaps_rollup), 3 s after boot
    vm_pmem_page_cache_ratio     guest page-cache growth / data bytes read from the image (0: DAX, no copy)
    vm_balloon_returned_fraction host RSS given back after the guest freed 128 MiB it had written
    vm_pause_s, vm_resume_s      pause (state saved, QEMU ended) and resume (state loaded)
    vm_resume_first_exec_ms      an exec on a paused VM: resume included
    vm_pause_image_mib           the saved state's size
    vm_template_create_p50_ms    null: templates are not built yet
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import build_rootfs, log, private_daemon, run  # noqa: E402

from dsecd import SyncClient  # noqa: E402

IMAGE = "busybox"


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


def main() -> int:
    rootfs = build_rootfs()
    with private_daemon(rootfs, IMAGE) as d:
        c = SyncClient(d.sock)
        c.connect()
        vm = c.info()["backends"]["microvm"]
        if not vm["available"]:
            log(f"backend microvm unavailable: {vm['why']}")
            print(json.dumps({"accel": None, "accel_why": vm["why"]}))
            return 1
        log(f"accel {vm['accel']}: {vm['why']}")
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
        sb.destroy()
        c.close()
    print(json.dumps({
        "accel": vm["accel"], "accel_why": vm["why"],
        "vm_boot_to_agent_s": round(statistics.median(boots), 3),
        "vm_exec_rtt_p50_ms": round(rtts[25], 3), "vm_exec_rtt_p99_ms": round(rtts[-1], 3),
        "vm_idle_host_mib_rss": round(idle["Rss"] / 2**20, 1), "vm_idle_host_mib_pss": round(idle["Pss"] / 2**20, 1),
        "vm_pmem_page_cache_ratio": round(ratio, 4),
        "vm_balloon_returned_fraction": round(returned, 3),
        "vm_pause_s": round(pause_s, 3), "vm_resume_s": round(resume_s, 3),
        "vm_resume_first_exec_ms": round(first_exec_ms, 1),
        "vm_pause_image_mib": round(paused.get("image_bytes", 0) / 2**20, 1),
        "vm_template_create_p50_ms": None,
    }))
    return 0


if __name__ == "__main__":
    run(main)
