"""What the adversarial suite (test_attack_*.py) shares: the probe binary and
sandboxes that carry it.

`attack_probe.c` does one attack syscall per run and prints `ok` or the errno
name; `run_probe(sb, ...)` runs it inside a sandbox and returns its output
lines. Every attack test asserts the forbidden thing fails with the expected
errno and that an allowed neighbour succeeds (docs/hardening.md), and is
marked `@pytest.mark.attack` so `make bench-security` can count them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROBE_IN_SANDBOX = "/usr/local/bin/attack-probe"


@pytest.fixture(scope="session")
def probe_binary(tmp_path_factory) -> bytes:
    """attack_probe.c built static (it must run in any image, busybox has no libc)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build tests/integration/attack_probe.c (apt-get install gcc)")
    exe = tmp_path_factory.mktemp("probe") / "attack-probe"
    built = subprocess.run([cc, "-static", "-O1", "-o", str(exe), str(HERE / "attack_probe.c")],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"cannot build a static attack_probe (libc6-dev's libc.a?): {built.stderr[-500:]}")
    return exe.read_bytes()


def install_probe(sb, probe: bytes) -> None:
    sb.write_file(PROBE_IN_SANDBOX, probe, mode=0o755)


def run_probe(sb, *args, timeout: float = 30) -> list[str]:
    """Lines printed by one probe action inside `sb`; the last is `ok` or an errno name."""
    r = sb.exec([PROBE_IN_SANDBOX, *map(str, args)], timeout=timeout)
    assert r.exit_code == 0, f"probe {args}: exit {r.exit_code} signal {r.signal}: {r.stderr!r}"
    return r.stdout.decode().split()


def upper_dir(info: dict) -> Path:
    """A sandbox's overlay upper dir as the host sees it, from its `inspect`. A
    capped layer (`disk` in inspect) is a detached tmpfs that the sandbox's PID 1
    holds as fd 3 (docs/hardening.md section 8): reachable through that fd."""
    if info.get("disk"):
        return Path(f"/proc/{info['init_pid']}/fd/3/upper")
    return Path(info["dir"]) / "upper"


def outcome(sb, *args, **kw) -> str:
    """Just the verdict: `ok` or the errno name."""
    return run_probe(sb, *args, **kw)[-1]


def facts(lines: list[str]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.fixture(scope="module")
def admin(daemon):
    """A module-wide client of the module's daemon (the `client` fixture is per test)."""
    c = daemon.client()
    yield c
    c.close()


def make_armed(admin, probe: bytes, **create):
    """A new sandbox of the busybox image with the probe installed."""
    create.setdefault("image", "busybox")
    create.setdefault("memory", "128M")
    sb = admin.create(**create)
    install_probe(sb, probe)
    return sb


@pytest.fixture(scope="module")
def armed(admin, probe_binary):
    """One sandbox with the probe, shared by a module's attacks that leave it as they found it."""
    sb = make_armed(admin, probe_binary)
    yield sb
    try:
        sb.destroy(force=True)
    except Exception:
        pass
