"""`dsec rpc --stdio`: the daemon's socket on stdin and stdout, byte for byte.

It is what `ssh host dsec rpc --stdio` and the SDK's ssh:// transport run
on the host, once per connection, so its start is part of every remote
connect: it imports the standard library only (cliboot.py runs it before
the package dsecd/cli/, whose imports, the client and the protocol's
types, took ~0.15 s and would relay nothing). It ends as every dsec
command does: a usage error exits 2, a daemon it cannot reach 1 (as does
stdout or stdin failing otherwise), a ^C 130, a reader of its stdout that
went away 141, the daemon's close 0.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import threading

from . import sigint
from .cliargs import EXIT_BROKEN_PIPE, EXIT_USAGE
from .clitext import UsageError
from .unixsock import default_socket


def run(a) -> None:
    """`dsec rpc` with the parsed command line `a`: exits with its status."""
    try:
        with sigint.raised():
            status = relay(socket_path(a))
    except UsageError as err:
        print(err, file=sys.stderr)
        status = EXIT_USAGE
    except ConnectionError as err:
        print(f"dsec: {err}", file=sys.stderr)
        status = 1
    except OSError as err:          # stdout or stdin failing otherwise (a full disk behind stdout)
        print(f"dsec rpc: {err.strerror or err}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        print("dsec rpc: interrupted (SIGINT)", file=sys.stderr)
        status = 130
    sys.exit(status)


def socket_path(a) -> str:
    """The socket `a` relays to; a usage error for what the relay cannot do."""
    if not a.stdio:
        raise UsageError("dsec rpc: only --stdio is supported")
    if a.host:
        raise UsageError("dsec rpc: relays to this host's daemon; drop --host (run it on the host, "
                         "as `ssh HOST dsec rpc --stdio`)")
    return a.socket or default_socket()


def relay(path: str) -> int:
    """Bridge stdin/stdout to the daemon socket at `path` (frames pass
    through); the exit status.

    The end of stdin (the client closed its sending side, or a read error)
    shuts down only the socket's sending side: the daemon answers every
    request already sent (a pipelined exec and destroy both run), and the
    bridge exits when the daemon has answered and closed. A client that is
    gone altogether is another matter: once stdout has no reader (the ssh
    session ended), the bridge closes the socket at once, so that the
    daemon cancels that client's requests and kills its execs instead of
    running them for nobody until the next answer fails to arrive."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as err:
        sock.close()
        # Read on the client's side, in the ssh:// connection's error.
        raise ConnectionError(f"rpc: cannot connect to dsecd at {path}: {err.strerror}; is the daemon running "
                              "on this host? (a client names another socket here with --socket or "
                              "DSEC_REMOTE_SOCKET)") from err

    def upstream() -> None:
        try:
            # fd 0, not sys.stdin: started with it closed, Python's stdin is None.
            while data := os.read(0, 1 << 16):
                sock.sendall(data)
        except OSError:
            pass                 # a broken or closed stdin ends the input like its end does
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    out = 1                          # not sys.stdout: None where fd 1 was closed
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(out, 0)          # POLLERR/POLLHUP only: nobody reads our stdout any more
    while True:
        events = dict(poller.poll())
        if events.get(out, 0) & (select.POLLERR | select.POLLHUP | select.POLLNVAL):   # NVAL: closed
            sock.close()             # the daemon sees the hang-up and cancels what runs for us
            return EXIT_BROKEN_PIPE
        if not events.get(sock.fileno()):
            continue
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            # The daemon closed with bytes of ours unread (killed mid-request):
            # its end all the same, which the client says as such.
            data = b""
        if not data:
            return 0
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(out, view):]
        except BrokenPipeError:      # stdout's reader went between the poll and the write
            sock.close()
            return EXIT_BROKEN_PIPE
