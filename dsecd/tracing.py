"""`exec` with `trace`: run one command under the ptrace recorder (dsecd/trace.py).

The recorder must seize the process *before* it execs the command, so the
exec'd program is a stop-then-exec stub: the sandbox's own /bin/sh stops
itself (SIGSTOP) and, once the tracer has seized and resumed it, execs the
command - whose execve is then the first event recorded. An image without
/bin/sh cannot be traced (the exec fails with not_found, naming /bin/sh).

The recorder waits with waitpid(-1), which would reap the daemon's other
children, so it runs as a helper process (`python -m dsecd.trace --pid N
--json`), a child of the daemon reaped by pid. All functions block.
"""

from __future__ import annotations

import json
import subprocess
import sys

from . import pinned

STOP_THEN_EXEC = ["/bin/sh", "-c", 'kill -STOP $$ && exec "$@"', "dsec-trace"]


def start_failure(result: dict) -> str | None:
    """Why a traced exec's command never started, from its result and
    record: "ENOENT" (no such program: the stub shell's 127, with no
    execve recorded, as bash's PATH search makes none, or only failed
    ones), "EACCES" (126, every execve refused), else None. A command
    that ran has a successful execve in the record, whatever its status."""
    record = result.get("trace") or {}
    if "events" not in record or result.get("exit_code") not in (126, 127):
        return None
    results = [e.get("result") for e in record["events"] if e.get("kind") == "exec"]
    if any(not isinstance(r, str) for r in results):
        return None                      # one succeeded (a number): the command ran
    if result["exit_code"] == 127 and all(r == "ENOENT" for r in results):
        return "ENOENT"
    if result["exit_code"] == 126 and "EACCES" in results:
        return "EACCES"
    return None


def traced_argv(argv: list[str]) -> list[str]:
    return STOP_THEN_EXEC + list(argv)


def start_tracer(pid: int, timeout: float | None, max_bytes: int,
                 frozen_file: str | None = None) -> subprocess.Popen:
    """The helper that seizes `pid` (stopped by the stub) and records until
    it exits. `frozen_file`: the sandbox's freezer file (pause.Freezer.asked_file),
    so that the backstop counts run time only, as the exec's timeout does."""
    cmd = [sys.executable, "-m", "dsecd.trace", "--pid", str(pid), "--json", "--max-bytes", str(max_bytes)]
    if timeout is not None:
        cmd += ["--timeout", str(timeout + 5)]      # backstop: the exec's own timeout fires first
        if frozen_file is not None:
            cmd += ["--frozen-file", frozen_file]
    # pinned.helper_options: the tracer of this daemon's code, not one installed since.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            close_fds=True, **pinned.helper_options())


def collect(proc: subprocess.Popen, wait_s: float = 30.0) -> dict:
    """The record, or {"error": ...} when the helper failed (the exec's result stands)."""
    try:
        out, err = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"tracer did not finish within {wait_s}s after the command"}
    if proc.returncode != 0:
        return {"error": f"tracer exited {proc.returncode}: {err.decode(errors='replace').strip()[-500:]}"}
    try:
        return json.loads(out)
    except ValueError:
        return {"error": "tracer printed no valid JSON record"}
