"""`make fuzz`: the full fuzz campaign against a private dsecd (root; minutes).

    .venv/bin/python bench/fuzz.py [--inputs 100000] [--seed 7] [--mutants 3]

Starts a daemon on its own socket, state dir and cgroup subtree (the
integration tests' Daemon), fuzzes the in-process frame decoder and then the
daemon's socket with ~N generated and mutated inputs (tests/fuzz), checks
that nothing leaked, removes everything, and prints one JSON object as its
last line: fuzz_inputs, fuzz_crashes, internal_errors, hangs, leaked_objects,
... Findings (the input that triggered each) go to stderr and to
build/fuzz-findings.json. Exit status 1 if anything was found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))

import fuzz_decoder  # noqa: E402
import fuzz_harness  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, default=100_000, help="inputs sent to the daemon")
    p.add_argument("--decoder-inputs", type=int, default=100_000,
                   help="inputs fed to the in-process decoder")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--mutants", type=int, default=3)
    p.add_argument("--deadline", type=float, default=10.0, help="seconds a request may take")
    ns = p.parse_args()

    t0 = time.monotonic()
    dec = fuzz_decoder.fuzz_decoder(ns.decoder_inputs, ns.seed)
    print(f"fuzz: decoder: {dec}", file=sys.stderr)

    target = fuzz_harness.FuzzTarget(fuzz_harness.busybox_rootfs())
    leaks: dict = {}
    try:
        target.start()

        def progress(f):
            print(f"fuzz: {f.inputs} inputs, {f.sessions} sessions, {f.problems()} problems, "
                  f"{time.monotonic() - t0:.0f}s", file=sys.stderr)

        findings = fuzz_harness.campaign(target, ns.inputs, ns.seed, ns.mutants,
                                         deadline_s=ns.deadline, progress=progress)
        leaks = target.leaks()
    finally:
        target.close(keep_log=ROOT / "build" / "fuzz-daemon.log")
    detail = {"internal": findings.internal, "malformed": findings.malformed,
              "hangs": findings.hangs, "crashes": findings.crashes, "orphans": findings.orphans,
              "decoder": dec["findings"], "leaks": leaks}
    out = ROOT / "build" / "fuzz-findings.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(detail, indent=1, default=repr))
    for kind in ("internal", "malformed", "hangs", "crashes", "orphans"):
        for item in detail[kind][:20]:
            print(f"fuzz: {kind}: {json.dumps(item, default=repr)[:2000]}", file=sys.stderr)
    leaked = sum(len(v) if isinstance(v, list) else v for v in leaks.values())
    summary = {**findings.summary(), "decoder_inputs": dec["inputs"],
               "decoder_findings": len(dec["findings"]), "leaked_objects": leaked,
               "leaks": leaks, "seed": ns.seed, "duration_s": round(time.monotonic() - t0, 1),
               "findings_file": str(out)}
    print(json.dumps(summary))
    return 1 if findings.problems() or leaked or dec["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
