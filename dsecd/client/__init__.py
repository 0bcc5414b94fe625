"""Python SDK: an asyncio client, and `SyncClient` for scripts.

    async with dsecd.Client() as c:
        r = await c.run("busybox", ["echo", "hi"])      # like docker run --rm: r.exit_code, r.stdout
        sb = await c.create(image="busybox", cpu=0.5, memory="256M")
        r = await sb.exec(["sh", "-c", "echo hi"], timeout=10)
        async for fd, data in sb.exec_stream(["make"]):   # streaming
            ...
        await sb.write_file("/work/a.py", b"print(1)")
        await sb.destroy()

One connection carries many requests at once (each has its own id); a reader
task routes every incoming frame to the request that owns its id. Errors from
the daemon are raised as dsecd.errors.DsecError subclasses.

One module per concern (each imports only those above it, but for type hints):

args.py       arguments as the daemon takes them (commands, string maps, ports), answers as callers take them
pieces.py     data to write as pieces under the frame limit (bytes, a file, a reader, an async iterable)
results.py    ExecResult, CallResult
ops.py        what the SDK knows of each request type: sent again after a loss, keyed, settled when abandoned
conn.py       one connection's state: _Conn, each request's frames (_Pending), its in-flight slots (_Budget)
wire.py       _Wire, the base of Client: connect, the reader, the silence watch, reconnects, a request's frames
refollow.py   a follow (events, watch, a process's output) taken up again after a lost connection
blocks.py     a sandbox that goes when its block ends: Client.sandbox()'s context, the destroy on the way out
execs.py      ExecStream, an exec's output streamed (stdin, pty, signals), and its collection
processes.py  background processes: Process, ProcStatus, ProcOutput, where a follow of its output is
runs.py       `docker run` in the SDK: RunStream, run_detached
files.py      _Files, the base of Sandbox: file requests, directory copies, watches
sandbox.py    Sandbox: execs, background processes, snapshots, its network and ports, pause, destroy
images.py     _Images, a base of Client: its image requests
core.py       Client: sandboxes, runs, calls, pools, jobs, leases, events

The SDK's names (and the few private ones dsecd.fleet, dsecd.sync and
the tests use) are imported here from the module that defines each, so
`dsecd.client.X` names it wherever it lives. A constant is read in the
module that defines it (RECONNECT_GAP_S and ABANDONED_CREATE_WAIT_S in
wire.py, FOLLOW_LOST_MAX in refollow.py, ...): a test that changes one
sets it there; set here, it changes nothing.
"""

from ..unixsock import DEFAULT_SOCKET, default_socket
from .args import Command, Stdin, _sandbox_info, command_argv, string_map
from .blocks import _destroy_on_the_way_out, _left_behind, _SandboxContext
from .conn import PENDING_FRAME_COST, _Budget
from .core import HOLD_RETRY_S, Client
from .execs import ExecStream
from .files import PARTLY_WRITTEN, PIPELINE, READ_AGAIN, Listing, _paths, named_as
from .ops import (
    CHANGES_NOTHING,
    FOLLOWS_ONLY,
    IDEMPOTENT,
    KEYED,
    PROGRESS_FRAMES,
    SETTLED_WHEN_ABANDONED,
    _answer_error,
    lost_after_sending,
)
from .pieces import DEFAULT_CHUNK, file_data, file_pieces
from .processes import Process, ProcOutput, ProcStatus
from .refollow import FOLLOW_ATTACHED_S, FOLLOW_LOST_MAX
from .results import CallResult, ExecResult
from .runs import RUN_LEASE_S, RunStream, run_detached
from .sandbox import Sandbox
from .wire import (
    ABANDONED_CREATE_WAIT_S,
    CONTROL_OPS,
    CONTROL_SLOTS,
    FOLLOWED_OUTPUT_BYTES,
    FRAME_BUFFERS_KEPT,
    FRAME_SLACK,
    LOCAL_PINGS,
    LOCAL_SILENCE_S,
    RECONNECT_GAP_MAX_S,
    RECONNECT_GAP_S,
    REFUSED_AGAIN_MAX_S,
    REFUSED_AGAIN_S,
    SHORT_SLOTS,
    local_silence_timeout,
)

__all__ = [
    "ABANDONED_CREATE_WAIT_S", "CHANGES_NOTHING", "CONTROL_OPS", "CONTROL_SLOTS", "DEFAULT_CHUNK",
    "DEFAULT_SOCKET", "FOLLOWED_OUTPUT_BYTES", "FOLLOWS_ONLY", "FOLLOW_ATTACHED_S", "FOLLOW_LOST_MAX",
    "FRAME_BUFFERS_KEPT", "FRAME_SLACK", "HOLD_RETRY_S", "IDEMPOTENT", "KEYED", "LOCAL_PINGS",
    "LOCAL_SILENCE_S", "PARTLY_WRITTEN", "PENDING_FRAME_COST", "PIPELINE", "PROGRESS_FRAMES", "READ_AGAIN",
    "RECONNECT_GAP_MAX_S", "RECONNECT_GAP_S", "REFUSED_AGAIN_MAX_S", "REFUSED_AGAIN_S", "RUN_LEASE_S",
    "SETTLED_WHEN_ABANDONED", "SHORT_SLOTS", "CallResult", "Client", "Command", "ExecResult", "ExecStream",
    "Listing", "ProcOutput", "ProcStatus", "Process", "RunStream", "Sandbox", "Stdin", "command_argv",
    "default_socket", "file_data", "file_pieces", "local_silence_timeout", "lost_after_sending", "named_as",
    "run_detached", "string_map",
    # Not the SDK's, but used by dsecd.fleet, dsecd.sync and the tests.
    "_Budget", "_SandboxContext", "_answer_error", "_destroy_on_the_way_out", "_left_behind", "_paths",
    "_sandbox_info",
]


def _name_the_hinted_classes() -> None:
    """A type hint naming a class of a module loaded after its own (a
    Sandbox's client, a Process's sandbox) is imported for type checkers
    only, which keeps the modules' imports acyclic. Once every module is
    loaded the names are set in theirs, so typing.get_type_hints resolves
    the SDK's hints at run time too, as it did when the SDK was one
    module."""
    from . import blocks, execs, files, processes, runs, sandbox

    for module, names in ((blocks, ("Sandbox",)), (execs, ("Sandbox",)), (files, ("Client",)),
                          (processes, ("Sandbox",)), (runs, ("Client", "Sandbox")), (sandbox, ("Client",))):
        for name in names:
            setattr(module, name, globals()[name])


_name_the_hinted_classes()
