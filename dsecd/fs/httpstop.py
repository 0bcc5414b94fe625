"""A stop for a pull's HTTP requests that ends them at once, whatever they
are waiting for (fs/registry.py).

A thread blocked in a socket call (connect, the wait for an answer's
headers, a read of its body) wakes only when the socket is shut down;
closing it from another thread does not wake it. urllib3 gives no handle on
the socket of a request under way, so the pools of the registry client
make their connections with the classes here, which hand each socket, as
soon as it exists and before every request sent on it, to the Stop the
calling thread works under (`with stop.requests():`). Stop.set() then shuts
down the socket each block under way was last handed (a connect() under
way ends with ECONNRESET, a wait for an answer with an end of file), and
refuses any handed after: the request fails at once with a connection
error, which the caller sees alongside the set stop. A set() in the
instant between a socket's hand-over and its connect() blocking is seen
when connect() returns, at the latest after the connect timeout.

A name lookup (getaddrinfo) cannot be interrupted: it runs in a thread of
its own, which set() stops waiting for (the lookup ends by itself, within
the resolver's timeout). A TLS handshake runs on a socket urllib3 wraps,
and the plain socket handed before it gives up its descriptor to the
wrapper: the block holds a duplicate of it until the next hand-over, and
shutting that down ends the handshake.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading

from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.util.connection import _set_socket_options, allowed_gai_family

_current = threading.local()       # .blocks: [(Stop, its _Block)], innermost last


class _Block:
    """The socket a requests() block was handed last (a thread makes one
    request at a time), and whether the block holds its own duplicate of it,
    which it closes when it lets go. Changed under its Stop's lock."""

    __slots__ = ("sock", "owned")

    def __init__(self):
        self.sock: socket.socket | None = None
        self.owned = False

    def hold(self, sock: socket.socket, duplicate: bool) -> None:
        self.release()
        self.sock, self.owned = (sock.dup(), True) if duplicate else (sock, False)

    def release(self) -> None:
        if self.owned:
            self.sock.close()
        self.sock, self.owned = None, False


class Stop:
    """Set once, from any thread: is_set() and wait() as threading.Event's;
    set() also shuts down the sockets of every request under way in a
    `requests()` block."""

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        # id(block) -> the requests() blocks under way
        self._blocks: dict[int, _Block] = {}
        # events set() sets too: the waits of name lookups under way
        self._wakers: set[threading.Event] = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def set(self) -> None:
        # Under the lock: a block that ended (its connection back in the pool,
        # maybe in another thread's hands) has taken its socket back.
        with self._lock:
            self._event.set()
            for block in self._blocks.values():
                if block.sock is not None:
                    shut_down(block.sock)
            for event in self._wakers:
                event.set()

    @contextlib.contextmanager
    def requests(self):
        """The calling thread's requests in the block can be cut short by
        set(), and by the set() of every Stop whose block this one is in."""
        block = _Block()
        with self._lock:
            self._blocks[id(block)] = block
        stack = _current.__dict__.setdefault("blocks", [])
        stack.append((self, block))
        try:
            yield
        finally:
            stack.pop()
            with self._lock:
                del self._blocks[id(block)]
                block.release()

    def _hand(self, sock: socket.socket, block: _Block, duplicate: bool = False) -> None:
        """Watch `sock` in `block`, in place of the socket handed before: a
        thread makes one request at a time, and an earlier one's connection
        may be back in the pool, in another thread's hands (a redirect or a
        retry drains it within the block). duplicate: watch a duplicate of
        its descriptor (one about to be wrapped). Raises
        ConnectionAbortedError if set() came already (a socket not yet
        connected would ignore a shutdown)."""
        with self._lock:
            if not self._event.is_set():
                block.hold(sock, duplicate)
                return
        raise stopped()

    def _wake(self, event: threading.Event, on: bool) -> bool:
        """Have set() set `event` too (on), or no longer; False if set()
        came already."""
        with self._lock:
            if on:
                self._wakers.add(event)
            else:
                self._wakers.discard(event)
            return not self._event.is_set()


def stopped() -> ConnectionAbortedError:
    return ConnectionAbortedError(errno.ECONNABORTED, "the request was stopped")


def shut_down(sock: socket.socket) -> None:
    """Shut down `sock` (a plain or a TLS socket): a thread blocked on it
    wakes, with an end of file or a connection error. The socket object
    stays open, for its owner to close."""
    try:
        # socket.socket's own shutdown, also for an SSLSocket: no TLS close_notify
        # written (it could block) and its SSL object left to the blocked thread
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass                            # already closed, or not connected yet


def _watched() -> bool:
    return bool(getattr(_current, "blocks", None))


def _hand_to_current_stops(sock: socket.socket | None, duplicate: bool = False) -> None:
    if sock is not None:
        for stop, block in getattr(_current, "blocks", ()):
            stop._hand(sock, block, duplicate)


def _lookup(host: str, port: int) -> list:
    """getaddrinfo, given up when a Stop of the thread's blocks is set: a
    lookup cannot be interrupted, so it runs in a thread of its own, left to
    end by itself (within the resolver's timeout; its answer then goes
    unused)."""
    stops = [stop for stop, _ in getattr(_current, "blocks", ())]
    done = threading.Event()
    answer: dict = {}

    def look_up() -> None:
        try:
            answer["infos"] = socket.getaddrinfo(host, port, allowed_gai_family(), socket.SOCK_STREAM)
        except OSError as e:
            answer["error"] = e
        done.set()

    try:
        if all([stop._wake(done, True) for stop in stops]):
            threading.Thread(target=look_up, name=f"lookup {host}", daemon=True).start()
            done.wait()
    finally:
        for stop in stops:
            stop._wake(done, False)
    if any(stop.is_set() for stop in stops):
        raise stopped()
    if "error" in answer:
        raise answer["error"]
    return answer["infos"]


class _Stoppable:
    """What both connection classes add to urllib3's: the socket handed to
    the thread's Stops before connect() blocks, and again before each
    request sent on it (a kept-alive connection serves later requests)."""

    wraps = False       # whether urllib3 wraps the socket after _new_conn (TLS)

    def _new_conn(self):
        if not _watched():
            return super()._new_conn()
        # urllib3's create_connection, with each socket handed over before it
        # connects: every address tried in turn, the last error raised.
        host = self._dns_host.strip("[]")
        try:
            host.encode("idna")
            infos = _lookup(host, self.port)
        except (UnicodeError, OSError) as e:
            raise NewConnectionError(self, f"Failed to establish a new connection: {e}") from None
        err: OSError | None = None
        for family, kind, proto, _name, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                _set_socket_options(sock, self.socket_options)
                if isinstance(self.timeout, (int, float)):
                    sock.settimeout(self.timeout)
                if self.source_address:
                    sock.bind(self.source_address)
                _hand_to_current_stops(sock)
                sock.connect(address)
                # A set() between the hand-over and connect() blocking shut down
                # a socket not connected yet, which does nothing: look again.
                # A TLS connection wraps the socket next, which takes its
                # descriptor: the blocks watch a duplicate through the handshake.
                _hand_to_current_stops(sock, duplicate=self.wraps)
                return sock
            except OSError as e:
                sock.close()
                err = e
        if isinstance(err, TimeoutError):
            raise ConnectTimeoutError(self, f"Connection to {self.host} timed out. (connect timeout={self.timeout})")
        raise NewConnectionError(self, f"Failed to establish a new connection: "
                                       f"{err or 'getaddrinfo returned nothing'}")

    def request(self, *args, **kw):
        _hand_to_current_stops(self.sock)
        return super().request(*args, **kw)


class StoppableHTTPConnection(_Stoppable, HTTPConnection):
    pass


class StoppableHTTPSConnection(_Stoppable, HTTPSConnection):
    wraps = True


CONNECTION_CLASSES = {"http": StoppableHTTPConnection, "https": StoppableHTTPSConnection}
