"""Where a burst's CPU goes, from `perf record -g` of the daemon and the
bench client (perf follows every process they start: the spawn children
that become the sandboxes' inits, and the execs those fork).

Samples are grouped by who ran them (the daemon's event loop thread, its
worker threads, a spawn child before it execs dsec-init, dsec-init, the
exec, the bench client) and by the outermost syscall of their stack, or
the binary for user-space samples ("user:python3.11"). Optional: without
`perf` on the host the benches leave these figures out.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

SYSCALL = re.compile(r"\b(?:__do_sys|__x64_sys|__se_sys|ksys)_(\w+)")


class PerfRecorder:
    def __init__(self, daemon_pid: int):
        self.daemon_pid = daemon_pid
        self.proc: subprocess.Popen | None = None
        self.tmp = tempfile.mkdtemp(prefix="dsecd-perf-")
        self.data = os.path.join(self.tmp, "perf.data")
        self.threads = set()

    @staticmethod
    def available() -> bool:
        return shutil.which("perf") is not None

    def start(self) -> None:
        # The daemon's threads now: the loop and its workers; any other
        # "dsecd" thread in the samples is a spawn child.
        self.threads = {int(t) for t in os.listdir(f"/proc/{self.daemon_pid}/task")}
        self.proc = subprocess.Popen(["perf", "record", "-g", "-F", "999", "-o", self.data,
                                      "-p", f"{self.daemon_pid},{os.getpid()}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)           # perf attaches to every thread before it samples

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait()

    def who(self, comm: str, pid: int, tid: int) -> str:
        if pid == self.daemon_pid:
            return "daemon loop" if tid == pid else "daemon workers"
        if pid == os.getpid():
            return "client"
        if comm == "dsecd":
            return "spawn child (setup before dsec-init)"
        if comm == "dsec-init":
            return "dsec-init"
        return "exec (true)"

    def split(self, min_share: float = 0.5) -> dict:
        """{who: {"share": %, "top": {syscall or binary: %}}}, shares of all samples."""
        out = subprocess.run(["perf", "script", "-i", self.data, "-F", "comm,pid,tid,ip,sym,dso"],
                             capture_output=True, text=True).stdout
        counts: collections.Counter = collections.Counter()
        total = 0
        for block in out.split("\n\n"):
            lines = [ln for ln in block.split("\n") if ln.strip()]
            if not lines:
                continue
            head = lines[0].split()
            comm = head[0]
            pid, tid = (int(x) for x in head[1].split("/"))
            frames = [ln.strip() for ln in lines[1:]]
            key = None
            for frame in reversed(frames):          # outermost first
                m = SYSCALL.search(frame)
                if m:
                    key = "sys_" + m.group(1)
                    break
            if key is None:
                if any("page_fault" in f for f in frames):
                    key = "page faults"
                elif frames and "[kernel.kallsyms]" in frames[0]:
                    key = "kernel, other"
                else:
                    dso = frames[0].rsplit("(", 1)[-1].rstrip(")") if frames else "?"
                    key = "user:" + os.path.basename(dso)
            counts[(self.who(comm, pid, tid), key)] += 1
            total += 1
        result: dict = {}
        for (who, key), n in counts.items():
            entry = result.setdefault(who, {"share": 0.0, "top": {}})
            entry["share"] += 100 * n / total
            if 100 * n / total >= min_share:
                entry["top"][key] = round(100 * n / total, 1)
        for entry in result.values():
            entry["share"] = round(entry["share"], 1)
            entry["top"] = dict(sorted(entry["top"].items(), key=lambda kv: -kv[1]))
        return {"samples": total, **dict(sorted(result.items(), key=lambda kv: -kv[1]["share"]))}

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
