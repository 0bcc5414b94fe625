"""dsecd: the per-host daemon of an elastic sandbox platform (SDK entry points)."""

__version__ = "0.1.0"

from .client import Client, ExecResult, Sandbox  # noqa: E402
from .errors import DsecError  # noqa: E402
from .sync import SyncClient, SyncSandbox  # noqa: E402

__all__ = ["Client", "Sandbox", "ExecResult", "SyncClient", "SyncSandbox", "DsecError", "__version__"]
