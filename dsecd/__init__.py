"""dsecd: the per-host daemon of an elastic sandbox platform (SDK entry points).

The SDK's names (`dsecd.Client`, `from dsecd import NotFound`, ...) are
imported on first use (a module __getattr__): importing the package itself
costs nothing, so the daemon and the `dsec` command, which import
`dsecd.<module>`, do not pay for the client, asyncio and the protocol's
dataclasses before they need them.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False       # typing.TYPE_CHECKING without importing typing (mypy and pyright know the name)

__version__ = "0.1.0"

# Each name the package offers and the module that defines it.
_NAMES = {
    "Client": "client", "ExecResult": "client", "Sandbox": "client",
    "BadRequest": "errors", "Busy": "errors", "Conflict": "errors", "ConnectionLost": "errors",
    "DsecError": "errors", "HostsDown": "errors", "Internal": "errors", "IOFailure": "errors",
    "LimitExceeded": "errors", "NotFound": "errors", "PermissionDenied": "errors", "Unsupported": "errors",
    "Fleet": "fleet", "FleetSandbox": "fleet",
    "SshOptions": "remote",
    "SyncClient": "sync", "SyncFleet": "sync", "SyncSandbox": "sync",
}
# The modules `import dsecd` used to load as a side effect (those above and
# what they import): `import dsecd; dsecd.errors.DsecError` keeps working.
_MODULES = frozenset({"caps", "client", "config", "errors", "fleet", "framing", "imageconfig", "localcopy",
                      "policy", "protocol", "remote", "sync", "tarsafe", "unixsock"})

__all__ = ["Client", "Sandbox", "ExecResult", "SyncClient", "SyncSandbox", "DsecError", "ConnectionLost", "HostsDown",
           "BadRequest", "NotFound", "Conflict", "Busy", "LimitExceeded", "Unsupported", "PermissionDenied",
           "IOFailure", "Internal", "SshOptions", "Fleet", "FleetSandbox", "SyncFleet", "__version__"]


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value          # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *_MODULES})


if TYPE_CHECKING:           # what type checkers and editors see: the same names, imported
    from .client import Client, ExecResult, Sandbox
    from .errors import (
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
    from .fleet import Fleet, FleetSandbox
    from .remote import SshOptions
    from .sync import SyncClient, SyncFleet, SyncSandbox
