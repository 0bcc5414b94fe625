"""dsecd: the per-host daemon of an elastic sandbox platform (SDK entry points)."""

__version__ = "0.1.0"

from .client import Client, ExecResult, Sandbox  # noqa: E402
from .errors import (  # noqa: E402
    BadRequest,
    Busy,
    Conflict,
    ConnectionLost,
    DsecError,
    HostsDown,
    Internal,
    IOFailure,
    LimitExceeded,
    NotFound,
    PermissionDenied,
    Unsupported,
)
from .fleet import Fleet, FleetSandbox  # noqa: E402
from .remote import SshOptions  # noqa: E402
from .sync import SyncClient, SyncFleet, SyncSandbox  # noqa: E402

__all__ = ["Client", "Sandbox", "ExecResult", "SyncClient", "SyncSandbox", "DsecError", "ConnectionLost", "HostsDown",
           "BadRequest", "NotFound", "Conflict", "Busy", "LimitExceeded", "Unsupported", "PermissionDenied",
           "IOFailure", "Internal", "SshOptions", "Fleet", "FleetSandbox", "SyncFleet", "__version__"]
