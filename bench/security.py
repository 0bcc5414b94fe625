"""`make bench-security`: the hardening report (docs/hardening.md), in a few minutes.

    .venv/bin/python bench/security.py [--cycles 3] [--daemon-inputs 25000]
                                       [--decoder-inputs 75000] [--skip-attacks]

Three parts, each against daemons it starts itself (own socket, state dir,
cgroup subtree), then a leak count:

1. The adversarial suite: `pytest -m attack tests/integration` (escapes,
   control plane, exhaustion, hostile clients; each test one attack beside
   its allowed neighbour), counted from its junit XML.
2. A fuzz run through bench/fuzz.py: generated and mutated frames against a
   private daemon plus the in-process decoder (>= 100k inputs together).
3. SIGKILL of the daemon in the middle of a create burst, `--cycles` times,
   with the stress clients of bench/stress.py: after each restart every
   sandbox a client was told about must be re-adopted and answer, a create in
   flight at the kill, retried with its key, gives exactly one sandbox, and
   destroying them all leaves nothing (journal, dirs, cgroups, mounts, fds).
4. After the last daemon is stopped: mounts, cgroups, network namespaces and
   processes left by the run.

Progress goes to stderr; the last stdout line is one JSON object with
attacks_tried, attacks_blocked, fuzz_inputs, fuzz_crashes,
daemon_restarts_survived, leaked_objects (and details). Exit status 1 if an
attack got through, the fuzzer found anything, a restart lost state, or
something leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import harness
import stress

from dsecd.errors import DsecError

REPO = harness.REPO
BUILD = REPO / "build"
PYTHON = str(harness.BIN / "python")
CONFIG = "[cpu]\noversubscription = 0\nmemory_oversubscription = 0\n[images]\nlayer_grace_s = 0.0\n"


# ---------------------------------------------------------------- 1. attacks

def run_attacks(timeout_s: float) -> dict:
    """The attack-marked tests in a pytest of their own; results from junit XML."""
    BUILD.mkdir(exist_ok=True)
    xml = BUILD / "security-attacks.xml"
    xml.unlink(missing_ok=True)
    argv = [PYTHON, "-m", "pytest", "-q", "-m", "attack", "-p", "no:cacheprovider",
            f"--junitxml={xml}", "tests/integration"]
    harness.log(f"attacks: {' '.join(argv[2:])}")
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout_s)
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no junit XML (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-2000:]}")
    out = count_junit(xml)
    out["attacks_duration_s"] = round(time.monotonic() - t0, 1)
    if out["attacks_failed"]:
        harness.log("attacks NOT blocked (or broken):\n" + proc.stdout[-4000:])
    return out


def count_junit(xml: Path) -> dict:
    """tried = ran (not skipped); blocked = passed. A failing attack test means
    either the attack worked or its allowed neighbour broke: both are listed."""
    tried, blocked, skipped, failed = 0, 0, [], []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("skipped") is not None:
            skipped.append(name)
            continue
        tried += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        else:
            blocked += 1
    return {"attacks_tried": tried, "attacks_blocked": blocked, "attacks_failed": failed,
            "attacks_skipped": skipped}


# ---------------------------------------------------------------- 2. fuzz

def start_fuzz(daemon_inputs: int, decoder_inputs: int, seed: int) -> subprocess.Popen:
    """bench/fuzz.py in the background (its own daemon; output to build/)."""
    BUILD.mkdir(exist_ok=True)
    argv = [PYTHON, str(REPO / "bench" / "fuzz.py"), "--inputs", str(daemon_inputs),
            "--decoder-inputs", str(decoder_inputs), "--seed", str(seed)]
    harness.log(f"fuzz: {' '.join(argv[1:])}")
    return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, text=True,
                            stdout=open(BUILD / "security-fuzz.out", "w"),
                            stderr=open(BUILD / "security-fuzz.err", "w"))


def stop_fuzz(proc: subprocess.Popen) -> None:
    """SIGINT: fuzz.py's finally stops and removes its daemon (SIGTERM would not)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def finish_fuzz(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_fuzz(proc)
        raise RuntimeError(f"bench/fuzz.py did not finish in {timeout_s:g} s") from None
    lines = (BUILD / "security-fuzz.out").read_text().strip().splitlines()
    err = (BUILD / "security-fuzz.err").read_text()
    if not lines:
        raise RuntimeError(f"bench/fuzz.py printed nothing (exit {proc.returncode}):\n{err[-3000:]}")
    r = json.loads(lines[-1])
    if proc.returncode:
        harness.log("fuzz findings:\n" + "\n".join(err.splitlines()[-30:]))
    return {"fuzz_inputs": r["fuzz_inputs"] + r["decoder_inputs"], "fuzz_daemon_inputs": r["fuzz_inputs"],
            "fuzz_decoder_inputs": r["decoder_inputs"], "fuzz_crashes": r["fuzz_crashes"],
            "fuzz_internal_errors": r["internal_errors"], "fuzz_hangs": r["hangs"],
            "fuzz_malformed_answers": r["malformed_answers"], "fuzz_decoder_findings": r["decoder_findings"],
            "fuzz_leaked_objects": r["leaked_objects"], "fuzz_findings_file": r.get("findings_file")}


# ---------------------------------------------------------------- 3. kill -9 mid create burst

async def _burst(c: stress.StressClient, stop: asyncio.Event) -> None:
    """Creates (each with its idempotency key) until the client has its share."""
    while not stop.is_set() and len(c.mine) < c.per_client:
        try:
            await c.op_create()
        except DsecError as err:
            if err.code not in stress.RETRYABLE:
                c.tally.fail(f"client {c.n} create: {err.code}: {err.message}")
            await asyncio.sleep(0.05)


async def kill_cycles(d: harness.BenchDaemon, cycles: int, clients: int, per_client: int,
                      kill_after_s: float) -> dict:
    tally = stress.Tally()
    cgroup_dirs = [Path(m) / d.cgroup_root for m in harness.cgroup_mounts()]
    fds0 = stress._fd_count(d.proc.pid)
    loop = asyncio.get_running_loop()
    survived, creates = 0, 0

    def kill9_and_restart() -> None:
        d.proc.kill()
        d.proc.wait()
        d.start()

    for cycle in range(cycles):
        before = len(tally.failures)
        cs = [stress.StressClient(cycle * 1000 + i, d.sock, "busybox", tally, random.Random(i), per_client)
              for i in range(clients)]
        for c in cs:
            await c.connect()
        stop = asyncio.Event()
        tasks = [asyncio.ensure_future(_burst(c, stop)) for c in cs]
        await asyncio.sleep(kill_after_s)
        in_flight = sum(1 for c in cs if c.pending_key)
        await loop.run_in_executor(None, kill9_and_restart)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        restart = await stress._check_after_restart(cs, tally)     # re-adoption, keyed retries, orphans
        creates += sum(len(c.mine) for c in cs)
        for c in cs:
            await c.close()
        await stress._check_no_leaks(d.sock, Path(d.state), cgroup_dirs, d.proc.pid, fds0, tally)
        ok = len(tally.failures) == before
        survived += ok
        harness.log(f"kill -9 cycle {cycle + 1}/{cycles}: {in_flight} creates in flight at the kill, "
                    f"{restart['readopted']} sandboxes re-adopted, {'ok' if ok else tally.failures[before:]}")
    return {"daemon_restarts_survived": survived, "restart_cycles": cycles, "restart_sandboxes": creates,
            "restart_failures": tally.failures[:10]}


# ---------------------------------------------------------------- 4. leaks

def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except FileNotFoundError:
        return set()


def _cgroups_below(cgroup_root: str) -> list[str]:
    """Sandbox groups left in the run's subtree (dot-named ones are the daemon's own)."""
    left = []
    for mnt in harness.cgroup_mounts():
        top = Path(mnt) / cgroup_root
        if top.is_dir():
            left += [str(Path(p) / n) for p, dirs, _f in os.walk(top) for n in dirs if not n.startswith(".")]
    return left


def _processes_of(tmp: Path, cgroup_root: str) -> tuple[list[int], list[int]]:
    """(live, zombies): processes still in the run's cgroups or running on its
    temp dir. Zombies hold nothing but a pid: they are sandbox inits orphaned
    by the kill -9 (re-parented to the host's PID 1, which reaps them on its
    own schedule), reported apart."""
    live, zombies = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            groups = Path(f"/proc/{entry}/cgroup").read_text()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if str(tmp) in cmdline or f"/{cgroup_root}/" in groups or groups.rstrip().endswith(f"/{cgroup_root}"):
            (zombies if stat[stat.rindex(")") + 2] == "Z" else live).append(int(entry))
    return live, zombies


def _sandbox_pids(cgroups: list[str]) -> set[int]:
    return set().union(*(harness.read_pids(Path(g) / "cgroup.procs") for g in cgroups)) if cgroups else set()


def count_leaks(d: harness.BenchDaemon, netns0: set[str]) -> dict:
    """After every sandbox was destroyed: what the run left behind. Sandbox
    cgroups and their processes are counted with the daemon still up
    (stopping the bench daemon kills and removes its whole subtree); mounts,
    namespaces and processes of the run once it has exited."""
    deadline = time.monotonic() + 10
    while (cgroups := _cgroups_below(d.cgroup_root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = _sandbox_pids(cgroups)
    d.stop()
    deadline = time.monotonic() + 5
    while True:
        live, zombies = _processes_of(d.tmp, d.cgroup_root)
        if not (live or zombies) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # dsecd never names a sandbox's netns: one can only outlive the sandbox
    # through a process (counted in pids) or an nsfs bind mount (in mounts, if
    # under the run's dir; or a /run/netns entry naming the run). New
    # /run/netns entries of other tests on the shared host are listed apart.
    mounts = harness.mounts_under(d.tmp)
    new_netns = sorted(_netns_names() - netns0)
    ours = [n for n in new_netns if d.cgroup_root in n or d.tmp.name in n]
    leaks = {"mounts": mounts, "cgroups": cgroups, "netns": ours, "pids": sorted(pids | set(live))}
    return {"leaked_objects": sum(len(v) for v in leaks.values()), "leaks": leaks,
            "zombies_awaiting_host_reaper": len(zombies), "netns_of_others": len(new_netns) - len(ours)}


# ---------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=3, help="kill -9 mid create burst, restart, check")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--per-client", type=int, default=3, help="sandboxes each burst client creates")
    p.add_argument("--kill-after", type=float, default=0.6, help="seconds into the burst")
    p.add_argument("--daemon-inputs", type=int, default=25_000, help="fuzz inputs sent to a daemon")
    p.add_argument("--decoder-inputs", type=int, default=75_000, help="fuzz inputs to the decoder")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--skip-attacks", action="store_true")
    p.add_argument("--skip-fuzz", action="store_true")
    p.add_argument("--serial", action="store_true",
                   help="fuzz after the attack suite, not beside it (slower; less load on each)")
    ns = p.parse_args()
    if os.geteuid() != 0:
        harness.log("must run as root (namespaces, cgroups, mounts)")
        return 1
    t0 = time.monotonic()
    report: dict = {}
    fuzz = None
    try:
        if not ns.skip_fuzz and not ns.serial:
            fuzz = start_fuzz(ns.daemon_inputs, ns.decoder_inputs, ns.seed)
        if not ns.skip_attacks:
            report.update(run_attacks(timeout_s=900))
            harness.log(f"attacks: {report['attacks_blocked']}/{report['attacks_tried']} blocked")
        if not ns.skip_fuzz:
            fuzz = fuzz or start_fuzz(ns.daemon_inputs, ns.decoder_inputs, ns.seed)
            report.update(finish_fuzz(fuzz, timeout_s=1200))
            harness.log(f"fuzz: {report['fuzz_inputs']} inputs, {report['fuzz_crashes']} crashes")
    finally:
        if fuzz is not None:
            stop_fuzz(fuzz)
    netns0 = _netns_names()
    import uvloop

    with harness.private_daemon(harness.build_rootfs(), "busybox", extra_config=CONFIG) as d:
        report.update(uvloop.run(kill_cycles(d, ns.cycles, ns.clients, ns.per_client, ns.kill_after)))
        report.update(count_leaks(d, netns0))
    report["duration_s"] = round(time.monotonic() - t0, 1)
    bad = (report.get("attacks_failed") or report.get("fuzz_crashes") or report.get("fuzz_internal_errors")
           or report.get("fuzz_hangs") or report.get("fuzz_malformed_answers") or report.get("fuzz_leaked_objects")
           or report.get("fuzz_decoder_findings") or report["daemon_restarts_survived"] < ns.cycles
           or report["leaked_objects"])
    harness.log(f"done in {report['duration_s']} s: {'FAILED' if bad else 'ok'}")
    print(json.dumps(report), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    harness.run(main)
