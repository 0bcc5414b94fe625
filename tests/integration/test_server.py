"""The daemon under bad input: raw frames on the socket, idle and vanishing clients."""

import socket
import struct
import threading
import time

import msgpack
import pytest

from dsecd import protocol


def raw(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.socket)
    return s


def send(s, obj):
    s.sendall(protocol.encode_frame(obj))


def recv(s) -> dict:
    hdr = b""
    while len(hdr) < 4:
        chunk = s.recv(4 - len(hdr))
        if not chunk:
            raise ConnectionError("closed")
        hdr += chunk
    (n,) = struct.unpack(">I", hdr)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return msgpack.unpackb(body, raw=False)


def hello(s):
    send(s, {"id": 0, "op": "hello", "args": {"protocol": 1, "client": "test"}})
    r = recv(s)
    assert r["result"]["protocol"] == 1
    return r


def test_first_request_must_be_hello(daemon):
    s = raw(daemon)
    send(s, {"id": 1, "op": "ping", "args": {}})
    r = recv(s)
    assert r["error"]["code"] == "bad_request" and "hello" in r["error"]["message"]
    assert s.recv(1) == b""   # dropped


def test_wrong_protocol_version_is_unsupported(daemon):
    s = raw(daemon)
    send(s, {"id": 1, "op": "hello", "args": {"protocol": 99}})
    assert recv(s)["error"]["code"] == "unsupported"


def test_a_half_closed_client_gets_its_answers_a_gone_one_loses_its_exec(daemon, client):
    sb = client.create(image="busybox")
    s = raw(daemon)
    hello(s)
    send(s, {"id": 1, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sh", "-c", "sleep 0.5; echo done"], "stream": False}})
    s.shutdown(socket.SHUT_WR)                     # no more requests; still reading
    r = recv(s)
    assert r.get("id") == 1 and r.get("result", {}).get("stdout") == b"done\n", r
    s.close()
    s = raw(daemon)
    hello(s)
    send(s, {"id": 1, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sleep", "100"]}})
    time.sleep(0.3)
    s.close()                                      # gone: its exec goes too
    deadline = time.monotonic() + 10
    while client.get(sb.id).info["execs_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get(sb.id).info["execs_running"] == 0
    sb.destroy()


@pytest.mark.attack
def test_malformed_frames_get_errors_and_connection_keeps_serving(daemon):
    s = raw(daemon)
    hello(s)
    body = b"\xc1\xc1"
    s.sendall(struct.pack(">I", len(body)) + body)
    assert recv(s)["error"]["code"] == "bad_request"
    send(s, {"id": 2, "op": "frobnicate", "args": {}})
    r = recv(s)
    assert r["id"] == 2 and r["error"]["code"] == "bad_request"
    send(s, {"id": 3, "op": "create", "args": {"image": 5}})
    assert recv(s)["error"]["code"] == "bad_request"
    send(s, {"id": 4, "op": "ping", "args": {}})
    assert "result" in recv(s)


@pytest.mark.attack
def test_oversized_frame_is_refused_and_dropped(daemon):
    s = raw(daemon)
    hello(s)
    s.sendall(struct.pack(">I", 1 << 30))
    r = recv(s)
    assert r["error"]["code"] == "limit"
    assert s.recv(1) == b""


def test_concurrent_requests_on_one_connection(daemon, client):
    sb = client.create(image="busybox")
    s = raw(daemon)
    hello(s)
    send(s, {"id": 10, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sleep", "0.5"], "stream": False}})
    send(s, {"id": 11, "op": "ping", "args": {}})
    first = recv(s)
    assert first["id"] == 11        # the ping did not wait for the exec
    assert recv(s)["id"] == 10
    send(s, {"id": 12, "op": "ping", "args": {}})
    send(s, {"id": 12, "op": "ping", "args": {}})
    ids = [recv(s) for _ in range(2)]
    assert any("error" in r for r in ids) or all("result" in r for r in ids)
    sb.destroy()


@pytest.mark.attack
def test_client_vanishing_mid_stream_kills_its_exec(daemon, client):
    sb = client.create(image="busybox")
    s = raw(daemon)
    hello(s)
    send(s, {"id": 1, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sh", "-c", "while true; do echo x; done"]}})
    assert recv(s)["stream"]["fd"] == 1
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = client.get(sb.id).info
        if info["execs_running"] == 0:
            break
        time.sleep(0.05)
    assert info["execs_running"] == 0
    # The exec stops counting once its process group is sent SIGKILL; a
    # process running on the other CPU dies a moment later.
    deadline = time.monotonic() + 10
    while True:
        r = sb.exec(["ps", "-o", "pid,stat,args"])
        if b"while true" not in r.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert b"while true" not in r.stdout, r.stdout
    sb.destroy()


@pytest.mark.attack
def test_one_thousand_idle_connections(daemon, client):
    socks = []
    try:
        for _ in range(1000):
            s = raw(daemon)
            socks.append(s)
        # Hello on a sample of them, and the daemon still serves everybody.
        for s in socks[::100]:
            hello(s)
        assert client.info()["version"]
    finally:
        for s in socks:
            s.close()
    assert client.request("ping")["time"] > 0


def test_exec_input_for_unknown_exec(client):
    with pytest.raises(Exception) as e:
        client.request("exec_input", exec_id=424242, data=b"x")
    assert e.value.code == "not_found"


def test_cancel_a_running_exec(daemon, client):
    sb = client.create(image="busybox")
    s = raw(daemon)
    hello(s)
    send(s, {"id": 5, "op": "exec", "args": {"sandbox": sb.id, "argv": ["sleep", "60"], "stream": False}})
    time.sleep(0.3)
    send(s, {"id": 6, "op": "cancel", "args": {"target": 5}})
    frames = {r["id"]: r for r in (recv(s), recv(s))}
    assert frames[6]["result"] == {"cancelled": 5}
    assert frames[5]["error"]["code"] == "conflict"
    sb.destroy()


@pytest.mark.attack
def test_daemon_serves_others_while_one_client_hammers(daemon, client):
    stop = threading.Event()

    def hammer():
        s = raw(daemon)
        hello(s)
        i = 100
        while not stop.is_set():
            send(s, {"id": i, "op": "nope", "args": {}})
            recv(s)
            i += 1
        s.close()

    t = threading.Thread(target=hammer)
    t.start()
    try:
        for _ in range(20):
            assert client.request("ping")
    finally:
        stop.set()
        t.join()
