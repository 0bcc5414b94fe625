"""A client newer than its daemon (an upgrade installed, the daemon not
restarted yet, or another host's older dsecd): the daemon refuses a request
or field it does not know with a bare "unknown op" or "unknown fields", and
the client's error says why and what to do (client.ops._answer_error). The
answers here are as older daemons send them (protocol.parse_request's
BadRequest, with `ops` or `allowed` in its detail)."""

from __future__ import annotations

import asyncio

import pytest
from standin_kit import serving

from dsecd import Client, protocol
from dsecd.client import _answer_error
from dsecd.errors import BadRequest, NotFound


def _unknown_op(op: str) -> dict:
    return {"code": "bad_request", "message": f"unknown op {op!r}", "detail": {"id": 9, "ops": ["create", "exec"]}}


def test_a_request_the_daemon_does_not_know_says_the_daemon_is_older():
    err = _answer_error(_unknown_op("image_flatten"), "image_flatten", {"name": "busybox"})
    assert isinstance(err, BadRequest)
    assert str(err).startswith("bad_request: unknown op 'image_flatten': the daemon runs an older dsecd")
    assert "the request 'image_flatten'" in err.message and "systemctl restart dsecd" in err.message
    assert err.detail["ops"] == ["create", "exec"] and err.detail["older_daemon"] is True


def test_a_field_the_daemon_does_not_know_is_named():
    error = {"code": "bad_request", "message": "file_tar_put: unknown fields: dirs",
             "detail": {"allowed": ["path", "sandbox", "temporary"]}}
    err = _answer_error(error, "file_tar_put", {"sandbox": "3f2a", "path": "/w", "dirs": True})
    assert "the field(s) dirs of 'file_tar_put'" in err.message and err.detail["older_daemon"] is True


def test_other_refusals_are_left_as_the_daemon_said_them():
    # A field this client does not know either (its own bug), a bad value, another code.
    typo = {"code": "bad_request", "message": "exec: unknown fields: argvv", "detail": {"allowed": ["argv"]}}
    value = {"code": "bad_request", "message": "exec: field 'argv' must be list[str]", "detail": {}}
    gone = {"code": "not_found", "message": "no sandbox '3f2a'", "detail": {}}
    assert _answer_error(typo, "exec", {"argvv": ["ls"]}).message == "exec: unknown fields: argvv"
    assert _answer_error(value, "exec", {"argv": 1}).message == "exec: field 'argv' must be list[str]"
    assert isinstance(_answer_error(gone, "exec", {}), NotFound)
    # An op this client does not know: not the daemon's age.
    assert "older dsecd" not in _answer_error(_unknown_op("nope"), "nope", {}).message


def test_the_sdk_says_it_of_an_older_daemons_answer(tmp_path):
    """Through Client: a stand-in daemon refuses image_flatten as a daemon
    older than it refuses any request it does not know."""
    path = str(tmp_path / "older.sock")

    async def answer(frame, writer):
        writer.write(protocol.encode_frame({"id": frame["id"], "error": _unknown_op(frame["op"])}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), path)
        async with server:
            async with Client(path) as c:
                with pytest.raises(BadRequest) as e:
                    await c.flatten_image("busybox")
        return e.value

    err = asyncio.run(go())
    assert "the daemon runs an older dsecd than this client" in str(err) and err.detail["older_daemon"]
