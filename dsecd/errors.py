"""The closed set of protocol error codes, and the exceptions that carry them.

Every failure a client can see is one of these codes; handlers raise a
`DsecError` subclass and the server turns it into an `error` frame. Anything
else that escapes a handler is a bug: the server logs the traceback and sends
`internal` with a one-line message, never the traceback itself.

The set is documented in docs/protocol.md and checked by tests/unit/test_protocol_doc.py.
"""

from __future__ import annotations

ERROR_CODES: dict[str, str] = {
    "bad_request": "the request is malformed: unknown op or field, wrong type, bad value",
    "not_found": "the named sandbox, image, path or request does not exist",
    "conflict": "the object is in a state that does not accept this request",
    "busy": "the host is at capacity or the resource is in use; retry later or elsewhere",
    "limit": "a configured limit was hit (frame size, streams, output, connections)",
    "unsupported": "this host's kernel or configuration lacks the needed feature",
    "permission": "the caller may not do this",
    "io": "a host or in-sandbox file operation failed (errno in detail)",
    "internal": "a bug in dsecd; the daemon log has the traceback",
}


class DsecError(Exception):
    """An error with a protocol code, a human message and optional detail."""

    code = "internal"

    def __init__(self, message: str, detail: dict | None = None, code: str | None = None):
        super().__init__(message)
        if code is not None:
            if code not in ERROR_CODES:
                raise ValueError(f"unknown error code {code!r}")
            self.code = code
        self.message = message
        self.detail = detail or {}

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message, "detail": self.detail}

    @classmethod
    def from_wire(cls, err: dict) -> DsecError:
        code = err.get("code", "internal")
        klass = _BY_CODE.get(code, DsecError)
        exc = klass(str(err.get("message", "")), err.get("detail") or {})
        exc.code = code if code in ERROR_CODES else "internal"
        return exc

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadRequest(DsecError):
    code = "bad_request"


class NotFound(DsecError):
    code = "not_found"


class Conflict(DsecError):
    code = "conflict"


class Busy(DsecError):
    code = "busy"


class LimitExceeded(DsecError):
    code = "limit"


class Unsupported(DsecError):
    code = "unsupported"


class PermissionDenied(DsecError):
    code = "permission"


class IOFailure(DsecError):
    code = "io"


class Internal(DsecError):
    code = "internal"


class ConnectionLost(ConnectionError):
    """The connection to a daemon ended under a request: the client's own
    failure, not one of the daemon's codes (it never crosses the wire).

    `sent` says whether the request had left the client: if it had, the
    daemon may have carried it out (a create may exist, an exec may have
    run). A create with its idempotency `key` (the caller's, or the one the
    SDK made, which the message names) is safe to send again: the daemon
    answers it with the sandbox the key made, if any. `target` is the
    daemon's socket path or ssh:// address, `op` the request's op."""

    def __init__(self, message: str, *, target: str = "", op: str = "", sent: bool = False):
        super().__init__(message)
        self.target = target
        self.op = op
        self.sent = sent


class HostsDown(ConnectionError):
    """A fleet request that needed hosts which are down (dsecd.Fleet): what
    it looked for may be on one of them, so neither an answer nor
    not_found can be given; retry once they are back (Fleet.status()).
    The client's own failure, as ConnectionLost is. `detail`: `down`
    (host -> why it is down), and what was sought (`sandbox`)."""

    def __init__(self, message: str, detail: dict | None = None):
        super().__init__(message)
        self.detail = detail or {}


_BY_CODE = {
    k.code: k
    for k in (BadRequest, NotFound, Conflict, Busy, LimitExceeded, Unsupported,
              PermissionDenied, IOFailure, Internal)
}


_ERRNO_CODES = {
    "ENOENT": NotFound,
    "ENOTDIR": NotFound,
    "EISDIR": BadRequest,
    "ELOOP": BadRequest,
    "ENAMETOOLONG": BadRequest,
    "EXDEV": BadRequest,
    "EACCES": PermissionDenied,
    "EPERM": PermissionDenied,
    "EROFS": PermissionDenied,
    "EEXIST": Conflict,
    "ENOTEMPTY": Conflict,
    "EBUSY": Busy,
}


def io_error(verb: str, obj: str, err: OSError) -> DsecError:
    """The protocol error for an OSError met while doing `verb` on `obj`.

    The errno name always goes into `detail["errno"]` so scripts can branch on
    it; the code is the closest protocol code (ENOENT -> not_found, ...).
    """
    import errno as _errno
    import os

    num = err.errno or _errno.EIO
    name = _errno.errorcode.get(num, "EIO")
    klass = _ERRNO_CODES.get(name, IOFailure)
    # An OSError raised by our own code carries a sentence saying what to do; keep it.
    text = err.strerror if err.strerror and err.strerror != os.strerror(num) else os.strerror(num)
    return klass(f"{verb} {obj}: {text}", {"errno": name, "path": obj})


# ---------------------------------------------------------------- exec failures
# A NativeError (dsecd/native.py) is an OSError with the `step` of csrc/ that
# failed; these read it by attribute so that this module stays free of the C
# extension (clients import it too).

def exec_error(err: OSError, prog: str, cwd: str) -> DsecError:
    """The protocol error for an exec of `prog` in `cwd` that could not start."""
    import errno

    step = getattr(err, "step", None) or ""
    if err.errno == errno.ENOENT and "exec" in step:
        # execve's ENOENT is also that of a script's #! interpreter, or a
        # program's dynamic loader, that is missing.
        also = "; if it exists, its #! interpreter or its dynamic loader does not" if "/" in prog else ""
        return NotFound(f"exec {prog!r}: no such file or command in the sandbox{also}", {"argv0": prog})
    if err.errno == errno.ENOENT and "chdir" in step:
        return NotFound(f"exec: working directory {cwd!r} does not exist in the sandbox", {"cwd": cwd})
    if err.errno == errno.ENOTDIR and "chdir" in step:
        return NotFound(f"exec: working directory {cwd!r} is not a directory in the sandbox (it, or a path "
                        "above it, is a file)", {"cwd": cwd})
    if err.errno == errno.EACCES and "chdir" in step:
        return DsecError(f"exec: working directory {cwd!r}: permission denied in the sandbox", {"step": step,
                         "cwd": cwd}, code="permission")
    if err.errno == errno.EACCES and "exec" in step:
        return DsecError(f"exec {prog!r}: permission denied", {"step": step, "argv0": prog}, code="permission")
    if err.errno == errno.ENOEXEC and "exec" in step:
        # A file that is no program (no ELF, no #! line) cannot be executed,
        # as EACCES: 126 from dsec exec, as a shell says it.
        return DsecError(f"exec {prog!r}: {err}", {"step": step, "argv0": prog, "errno": "ENOEXEC"},
                         code="permission")
    if err.errno == errno.EACCES:       # a step of the daemon's own (a cgroup join, a setns): no argv0, no 126
        return DsecError(f"exec {prog!r}: permission denied at {step or 'its start'}", {"step": step or None},
                         code="permission")
    if err.errno in (errno.ESRCH, errno.EINVAL) and "setns" in step:
        return Conflict("sandbox is exiting; cannot enter it", {"step": step})
    return DsecError(f"exec {prog!r}: {err}", {"errno": errno.errorcode.get(err.errno or 0),
                                               "step": step or None}, code="io")


def started_by_step(err: OSError) -> bool:
    """Whether `err` came from a step of csrc/ (a NativeError), not from the daemon's watch."""
    return hasattr(err, "step")


def init_refused_request(err: OSError) -> bool:
    """Whether a sandbox's init refused the request itself (EINVAL at step
    init_request). This daemon sends init only well-formed requests: one
    refused is of a kind init does not know (a terminal, a background
    process, a file copy): the init of a sandbox an older dsecd made."""
    import errno

    return getattr(err, "step", None) == "init_request" and err.errno == errno.EINVAL


def run_error(err: OSError, sandbox_id: str, prog: str, cwd: str, needs: list[str] | None = None) -> DsecError:
    """A run that failed after it was handed to its watch: an exec init could
    not start (NativeError of its step), whose channel broke (the exec was
    killed), or that did not end after a kill (TimeoutError). needs: what
    the request asked of init that an older init may not know (a sandbox
    made before an upgrade runs the init it was made with), said when init
    refuses it; None: not known here."""
    import errno

    if init_refused_request(err):
        asked = ", ".join(needs) if needs else ("a pty exec, a background process, a task policy or "
                                                "supplementary groups")
        way_round = (" (or give the user as UID:GID, `-u 1000:1000`, which sets no supplementary groups)"
                     if needs and any("supplementary groups" in n for n in needs) else "")
        return Conflict(f"cannot start {prog!r} in sandbox {sandbox_id}: its init is older than this dsecd (the "
                        f"sandbox was made before an upgrade) and does not know the request ({asked}); "
                        f"recreate the sandbox to use them{way_round}", {"sandbox": sandbox_id})
    if started_by_step(err):
        return exec_error(err, prog, cwd)
    if err.errno == errno.ESRCH:          # its init exited first: destroyed or died meanwhile
        return Conflict(f"sandbox {sandbox_id} is exiting; cannot start {prog!r}", {"sandbox": sandbox_id})
    return DsecError(f"exec {prog!r} in sandbox {sandbox_id}: {err}",
                     {"errno": errno.errorcode.get(err.errno or 0)}, code="io")


def image_error(err: Exception) -> DsecError:
    """The protocol error of an image store failure (dsecd/fs/images.py ImageError carries its code)."""
    return DsecError(str(err), getattr(err, "detail", None), code=getattr(err, "code", "internal"))
