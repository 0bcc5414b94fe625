"""dsecd: the per-host daemon of an elastic sandbox platform (SDK entry points)."""

__version__ = "0.1.0"

from .client import Client, ExecResult, Sandbox  # noqa: E402
from .errors import ConnectionLost, DsecError, HostsDown  # noqa: E402
from .fleet import Fleet, FleetSandbox  # noqa: E402
from .remote import SshOptions  # noqa: E402
from .sync import SyncClient, SyncFleet, SyncSandbox  # noqa: E402

__all__ = ["Client", "Sandbox", "ExecResult", "SyncClient", "SyncSandbox", "DsecError", "ConnectionLost", "HostsDown",
           "SshOptions", "Fleet", "FleetSandbox", "SyncFleet", "__version__"]
