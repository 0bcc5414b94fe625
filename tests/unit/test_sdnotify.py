"""systemd's notify protocol (dsecd/sdnotify.py), against a test-owned
AF_UNIX datagram socket standing in for $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import secrets
import socket

from dsecd.sdnotify import Notifier, watchdog_interval


def _fields(datagram: bytes) -> dict:
    return dict(line.split("=", 1) for line in datagram.decode().splitlines())


def test_ready_status_watchdog_stopping_reach_the_socket(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind(path)
        srv.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": path})
        assert n.enabled
        assert n.ready("0 sandboxes")
        assert _fields(srv.recv(4096)) == {"READY": "1", "STATUS": "0 sandboxes", "MAINPID": str(os.getpid())}
        n.status("3 running")
        assert _fields(srv.recv(4096)) == {"STATUS": "3 running"}
        n.watchdog()
        assert _fields(srv.recv(4096)) == {"WATCHDOG": "1"}
        n.stopping("bye")
        assert _fields(srv.recv(4096)) == {"STOPPING": "1", "STATUS": "bye"}
        n.close()


def test_an_abstract_socket_name_starts_with_at():
    name = f"dsecd-test-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as srv:
        srv.bind("\0" + name)
        srv.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.watchdog()
        assert srv.recv(64) == b"WATCHDOG=1"


def test_without_notify_socket_nothing_is_sent():
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and not n.watchdog()


def test_a_send_that_fails_is_given_up_once(tmp_path, caplog):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert not n.ready("x")
    assert not n.watchdog()                     # not retried
    assert sum("NOTIFY_SOCKET" in r.getMessage() for r in caplog.records) == 1


def test_the_watchdog_pings_at_half_its_timeout_for_this_process_only():
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None and watchdog_interval({"WATCHDOG_USEC": "x"}) is None
