"""Attacks on /proc from inside a container sandbox (part 1).

Each forbidden read or write must fail (or read nothing from the kernel)
beside an allowed neighbour that must work. The sandbox runs busybox as uid 0
with Docker's default capabilities minus NET_RAW, under the seccomp profile:
the strongest tenant the daemon creates by default.

Which kernel views exist depends on the kernel's config; the host and the
sandbox share the kernel, so the lists are taken from the host's /proc.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.attack

# Kept in step with proc_masked_files / proc_masked_dirs / proc_readonly in csrc/spawn.c.
MASKED_FILES = ["kcore", "kpagecount", "kpageflags", "kpagecgroup", "kallsyms", "kmsg", "keys",
                "key-users", "timer_list", "timer_stats", "sched_debug", "latency_stats",
                "vmallocinfo", "slabinfo", "config.gz"]
MASKED_DIRS = ["acpi", "scsi", "asound"]


def _present(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(f"/proc/{n}")]


def sh(sb, script: str, timeout: float = 30):
    return sb.exec(["sh", "-c", script], timeout=timeout)


def test_kernel_views_are_dev_null(sandbox):
    """kpage*, kcore, kallsyms, ... are /dev/null binds: reads give 0 bytes."""
    files = _present(MASKED_FILES)
    assert "kpagecount" in files, "this kernel has no /proc/kpagecount: nothing to attack"
    script = "; ".join(f"echo {n} $(stat -c %t:%T /proc/{n}) $(wc -c < /proc/{n})" for n in files)
    r = sh(sandbox, script)
    assert r.exit_code == 0, r.stderr
    seen = {line.split()[0]: line.split()[1:] for line in r.stdout.decode().splitlines()}
    assert seen == {n: ["1:3", "0"] for n in files}
    # Neighbours: the sandbox's own and the harmless host-wide views still read.
    r = sh(sandbox, "wc -c < /proc/meminfo; wc -c < /proc/self/status; grep -c ^processor /proc/cpuinfo")
    sizes = [int(x) for x in r.stdout.split()]
    assert r.exit_code == 0 and all(s > 0 for s in sizes), (r.stdout, r.stderr)


def test_recursive_grep_reads_no_kernel_page_file(sandbox):
    """`grep -r` over the kernel views (what crashed a DSec host) sees empty files."""
    targets = " ".join(f"/proc/{n}" for n in _present(MASKED_FILES + MASKED_DIRS))
    r = sh(sandbox, f"grep -r -c . {targets}; echo status=$?", timeout=20)
    assert not r.timed_out
    counts = [line.rsplit(":", 1)[1] for line in r.stdout.decode().splitlines() if ":" in line]
    assert counts and set(counts) == {"0"}, r.stdout
    # Neighbour: the same grep over a real proc file finds lines.
    r = sh(sandbox, "grep -r -c . /proc/self/status")
    assert r.exit_code == 0 and int(r.stdout) > 10


def test_hardware_dirs_are_empty_and_read_only(sandbox):
    dirs = _present(MASKED_DIRS)
    if not dirs:
        pytest.skip("this kernel has none of /proc/" + ", /proc/".join(MASKED_DIRS))
    for d in dirs:
        r = sh(sandbox, f"ls -A /proc/{d} | wc -l; touch /proc/{d}/x")
        assert r.stdout.split()[0] == b"0", (d, r.stdout)
        assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (d, r.stderr)
    # Neighbour: an ordinary proc directory lists.
    r = sh(sandbox, "ls /proc/self/fd | wc -l")
    assert int(r.stdout) >= 3


@pytest.mark.parametrize("path,value", [
    ("/proc/sysrq-trigger", "b"),                   # b = reboot now
    ("/proc/sys/kernel/panic", "1"),
    ("/proc/sys/vm/drop_caches", "3"),
    ("/proc/sys/kernel/core_pattern", "|/tmp/x"),   # a host-side program run as root
])
def test_kernel_knobs_are_read_only(sandbox, path, value):
    """uid 0 in the sandbox passes procfs's uid checks: the mounts must stop it (EROFS)."""
    if not os.path.exists(path):
        pytest.skip(f"this kernel has no {path}")
    r = sh(sandbox, f"echo '{value}' > {path}")
    assert r.exit_code != 0 and b"Read-only file system" in r.stderr, (r.exit_code, r.stderr)
    # Neighbour: the same file still reads.
    r = sh(sandbox, f"test -r {path} && echo readable")
    assert r.stdout == b"readable\n"


def test_sysctls_read_the_sandboxs_own_namespace(sandbox):
    """Neighbour of the read-only /proc/sys: namespaced sysctls show the sandbox's values."""
    r = sh(sandbox, "cat /proc/sys/kernel/hostname")
    assert r.stdout.strip() == sandbox.info["hostname"].encode()


def _eperm(r) -> bool:
    # busybox mount words EPERM as "permission denied (are you root?)"
    return r.exit_code != 0 and (b"Operation not permitted" in r.stderr
                                 or b"permission denied" in r.stderr)


def test_masks_cannot_be_removed_or_bypassed(sandbox):
    """umount of a mask, a fresh procfs, a read-write remount: all EPERM."""
    for script in ("umount /proc/kpagecount", "umount -l /proc/sys",
                   "mkdir -p /mnt/p && mount -t proc proc /mnt/p",
                   "mount -o remount,rw /proc/sys", "mount --bind /proc/self /proc/kallsyms"):
        r = sh(sandbox, script)
        assert _eperm(r), (script, r.exit_code, r.stderr)
    # Another way round to the same file: the masks are in the mount namespace
    # (/proc/self/root is the sandbox's own root), and PID 1 is non-dumpable,
    # so its /proc entries are closed to the sandbox (EACCES).
    r = sh(sandbox, "stat -c %t:%T /proc/self/root/proc/kpagecount")
    assert r.stdout.strip() == b"1:3", r.stdout
    r = sh(sandbox, "ls /proc/1/root/")
    assert r.exit_code != 0 and b"Permission denied" in r.stderr, r.stderr
    # Neighbour: the mount table itself is readable and lists the masks.
    r = sh(sandbox, "grep -c kpagecount /proc/self/mountinfo")
    assert r.exit_code == 0 and int(r.stdout) == 1
