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

# A command the shell cannot find ends the stub with 127 and no word (the
# shell's own "not found" would read as the command's stderr) before any
# execve of it: what not_found_in says is a missing program. /dev/null is
# opened before the stop, so the record's first event stays the command's
# execve, and closed for the command.
STOP_THEN_EXEC = ["/bin/sh", "-c",
                  'exec 3>/dev/null; kill -STOP $$ && { command -v -- "$1" >&3 || exit 127; exec "$@" 3>&-; }',
                  "dsec-trace"]
NOT_FOUND_STATUS = 127


def not_found_in(result: dict) -> bool:
    """Whether a traced exec's result (with its `trace`) is the stub's for a
    program that does not exist: 127 and no exec event recorded (a command
    that ran and exited 127 has its execve in the record)."""
    record = result.get("trace") or {}
    return (result.get("exit_code") == NOT_FOUND_STATUS and "events" in record
            and not any(e.get("kind") == "exec" for e in record["events"]))


def traced_argv(argv: list[str]) -> list[str]:
    return STOP_THEN_EXEC + list(argv)


def start_tracer(pid: int, timeout: float | None, max_bytes: int) -> subprocess.Popen:
    """The helper that seizes `pid` (stopped by the stub) and records until it exits."""
    cmd = [sys.executable, "-m", "dsecd.trace", "--pid", str(pid), "--json", "--max-bytes", str(max_bytes)]
    if timeout is not None:
        cmd += ["--timeout", str(timeout + 5)]      # backstop: the exec's own timeout fires first
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            close_fds=True)


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
