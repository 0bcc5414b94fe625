"""A Stop's bookkeeping of the sockets requests hand it (dsecd/fs/httpstop.py),
with socketpairs standing for connections: which ones set() shuts down."""

import socket
import threading
import time

import pytest

from dsecd.fs import httpstop
from dsecd.fs.httpstop import Stop


@pytest.fixture
def pairs():
    made = []

    def make():
        a, b = socket.socketpair()
        made.extend((a, b))
        return a, b

    yield make
    for s in made:
        s.close()


def shut(sock: socket.socket, peer: socket.socket) -> bool:
    """Whether `sock` was shut down: its peer reads an end of file at once."""
    peer.settimeout(0.2)
    try:
        return peer.recv(1) == b""
    except TimeoutError:
        return False


def test_set_shuts_down_the_sockets_of_blocks_under_way_only(pairs):
    stop = Stop()
    ended, ended_peer = pairs()
    live, live_peer = pairs()
    with stop.requests():
        httpstop._hand_to_current_stops(ended)
    with stop.requests():
        httpstop._hand_to_current_stops(live)
        stop.set()
    assert shut(live, live_peer)
    assert not shut(ended, ended_peer), "a socket whose request had ended was shut down"


def test_blocks_of_two_threads_are_told_apart(pairs):
    """Both blocks start empty (equal sets): the first to end must not take
    the other's place."""
    stop = Stop()
    sock, peer = pairs()
    entered, go_on, handed = threading.Event(), threading.Event(), threading.Event()

    def other():
        with stop.requests():
            entered.set()
            go_on.wait(5)
            httpstop._hand_to_current_stops(sock)
            handed.set()
            stop.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(5)
    with stop.requests():
        pass
    go_on.set()
    handed.wait(5)
    stop.set()
    thread.join(5)
    assert shut(sock, peer)


def test_a_socket_handed_after_set_is_refused(pairs):
    stop = Stop()
    sock, _ = pairs()
    stop.set()
    with stop.requests(), pytest.raises(ConnectionAbortedError):
        httpstop._hand_to_current_stops(sock)


def test_a_block_inside_another_stops_block_answers_to_both(pairs):
    outer, inner = Stop(), Stop()
    sock, peer = pairs()
    with outer.requests(), inner.requests():
        httpstop._hand_to_current_stops(sock)
        outer.set()
        assert shut(sock, peer)
    assert not inner.is_set()


def test_no_block_no_watch(pairs):
    stop = Stop()
    sock, peer = pairs()
    httpstop._hand_to_current_stops(sock)
    stop.set()
    assert not shut(sock, peer)


def test_a_block_watches_only_the_socket_it_was_handed_last(pairs):
    """A thread makes one request at a time: an earlier socket of the block
    (a redirect's, a retried one's) may serve another thread by now."""
    stop = Stop()
    earlier, earlier_peer = pairs()
    latest, latest_peer = pairs()
    with stop.requests():
        httpstop._hand_to_current_stops(earlier)
        httpstop._hand_to_current_stops(latest)
        stop.set()
    assert shut(latest, latest_peer)
    assert not shut(earlier, earlier_peer)


def test_a_duplicate_watches_a_socket_through_its_wrapping(pairs):
    """A TLS wrap takes the plain socket's descriptor (detach): the block's
    own duplicate still reaches the connection, and goes with the block."""
    stop = Stop()
    sock, peer = pairs()
    with stop.requests():
        httpstop._hand_to_current_stops(sock, duplicate=True)
        wrapped = socket.socket(fileno=sock.detach())        # what SSLContext.wrap_socket does
        stop.set()
        assert shut(wrapped, peer)
    wrapped.close()

    other, other_peer = pairs()
    with Stop().requests():
        httpstop._hand_to_current_stops(other, duplicate=True)
    other.close()
    assert shut(other, other_peer), "the block's duplicate outlived it and held the connection open"


def test_a_stop_gives_up_a_name_lookup_under_way(monkeypatch):
    """getaddrinfo cannot be interrupted: set() stops the wait for it."""
    release = threading.Event()
    monkeypatch.setattr(httpstop.socket, "getaddrinfo", lambda *a: release.wait(10) and [])
    stop = Stop()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    try:
        with stop.requests(), pytest.raises(ConnectionAbortedError):
            httpstop._lookup("registry.lab", 443)
        assert time.monotonic() - started < 1.0
    finally:
        release.set()


def test_a_lookup_answers_through_its_thread(monkeypatch):
    monkeypatch.setattr(httpstop.socket, "getaddrinfo", lambda host, *a: [("answer", host)])
    with Stop().requests():
        assert httpstop._lookup("registry.lab", 443) == [("answer", "registry.lab")]
    monkeypatch.setattr(httpstop.socket, "getaddrinfo", lambda *a: (_ for _ in ()).throw(socket.gaierror(-2, "no")))
    with Stop().requests(), pytest.raises(socket.gaierror):
        httpstop._lookup("registry.lab", 443)
