"""What an exec and a function call return: ExecResult, CallResult."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExecResult:
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    cancelled: bool
    duration_ms: float
    trace: dict | None = None        # with exec(trace=True): the ptrace record
    policy: str | None = None        # the task policy it ran under (a name, "inline"; None: none)
    denials: int | None = None       # its policy denials, when counted (dsec info: policy.denials)
    killed_by: str | None = None     # SIGKILLed, not at its timeout: "oom" (memory limit), "destroy", None: unknown
    destroyed_by: str | None = None  # with killed_by "destroy", why: "ttl", "idle_ttl", "lease", "request", ...
    # A streamed exec taken up again after a lost connection: bytes of its
    # output the daemon no longer had for it (not in stdout, stderr, or given to a callback).
    lost_output: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_result(cls, r: dict, stdout: bytes = b"", stderr: bytes = b"") -> ExecResult:
        return cls(exit_code=r.get("exit_code"), signal=r.get("signal"),
                   stdout=r.get("stdout", stdout), stderr=r.get("stderr", stderr),
                   truncated=r.get("truncated", False), timed_out=r.get("timed_out", False),
                   cancelled=r.get("cancelled", False), duration_ms=r.get("duration_ms", 0.0),
                   trace=r.get("trace"), policy=r.get("policy"), denials=r.get("denials"),
                   killed_by=r.get("killed_by"), destroyed_by=r.get("destroyed_by"))


@dataclass
class CallResult(ExecResult):
    """A FnCall: an exec's result plus where it ran and how long it took."""

    path: str = ""           # "zygote" (forked from the pre-imported interpreter) or "exec"
    run_ms: float = 0.0      # the call's process lifetime
    total_ms: float = 0.0    # the whole request in the daemon

    @classmethod
    def from_call(cls, r: dict) -> CallResult:
        base = ExecResult.from_result(r)
        return cls(**vars(base), path=r.get("path", ""), run_ms=r.get("run_ms", 0.0),
                   total_ms=r.get("total_ms", 0.0))
