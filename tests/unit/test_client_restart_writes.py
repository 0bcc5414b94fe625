"""An atomic write_file whose connection is lost under it (a daemon
restart), against a stand-in daemon on a unix socket: what its error says
of the caller's path."""

from __future__ import annotations

import asyncio

import pytest
from standin_kit import serving

from dsecd import ConnectionLost, protocol
from dsecd.client import Client, Sandbox


async def _stream(*pieces: bytes):
    for piece in pieces:
        yield piece


@pytest.mark.parametrize("cut", ["piece", "rename"])
def test_a_write_cut_by_a_lost_connection_names_the_path_and_what_became_of_it(tmp_path, cut):
    """A later piece lost in flight failed as a bare `file_write ...: the
    request may have been carried out`, naming neither the caller's path
    nor that it is as it was (the temporary file goes with the connection,
    and is removed again); only the rename may have replaced it."""
    sock_path = str(tmp_path / "d.sock")
    seen: list[str] = []

    async def answer(f: dict, writer) -> bool:
        seen.append(f["op"])
        op = f["op"]
        if (cut == "piece" and op == "file_write" and f["args"].get("offset")) or \
                (cut == "rename" and op == "file_rename"):
            writer.transport.abort()            # the daemon goes under it
            return True
        if op == "file_remove":
            error = {"code": "not_found", "message": f"remove {f['args']['path']}: No such file", "detail": {}}
            writer.write(protocol.encode_frame({"id": f["id"], "error": error}))
        else:
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"size": 4}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                sb = Sandbox(c, "sb1", {})
                c.server = {"limits": {"max_file_chunk_bytes": 4}}
                with pytest.raises(ConnectionLost) as e:
                    # A stream: read once, it cannot be written again.
                    await asyncio.wait_for(sb.write_file("/tmp/out", _stream(b"abcd", b"efgh")
                                                         if cut == "piece" else _stream(b"abc")), 30)
                return str(e.value)

    said = asyncio.run(go())
    assert "file_remove" in seen
    assert "sb1:/tmp/out" in said, said
    if cut == "piece":
        assert "is as it was" in said and "write it again" in said and "carried out" not in said, said
    else:
        assert "may have replaced" in said and "is as it was" not in said, said


def test_a_directory_copy_in_cut_by_a_lost_connection_says_what_to_look_for(tmp_path):
    """upload_tar (and upload_dir) failed as a bare `file_tar_put ...: the
    request may have been carried out`. A copy lands beside the new
    directory and is renamed into place at its end, and what a cut copy
    made is removed: the directory is whole if it is there, else nothing
    of the copy is left."""
    sock_path = str(tmp_path / "d.sock")

    async def answer(f: dict, writer) -> bool:
        if f["op"] == "file_tar_put":
            writer.transport.abort()            # the daemon goes under it
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                with pytest.raises(ConnectionLost) as e:
                    await asyncio.wait_for(Sandbox(c, "sb1", {}).upload_tar(b"\0" * 1024, "/work/up"), 30)
                return e.value

    err = asyncio.run(go())
    said = str(err)
    assert err.sent and err.op == "file_tar_put" and "sb1:/work/up" in said, said
    assert "exists, the copy ended first and it is whole" in said and "nothing of the copy is left" in said
    assert "copy it again" in said and "carried out" not in said, said


@pytest.mark.parametrize("atomic,cut", [(True, "piece"), (True, "rename"), (False, "piece")],
                         ids=["atomic-piece", "atomic-rename", "in_place-piece"])
def test_bytes_whose_write_a_lost_connection_cut_are_written_again(tmp_path, atomic, cut):
    """Bytes in memory are written again whole on the next connection (a
    daemon restart): the write ends as one that was never cut, whatever
    the first did (its temporary file goes, a rename of the same bytes
    changes nothing more, a write in place starts again from the start)."""
    sock_path = str(tmp_path / "d.sock")
    conns: dict[int, list[dict]] = {}

    async def answer(f: dict, writer) -> bool:
        got = conns.setdefault(id(writer), [])
        got.append(f)
        op = f["op"]
        if len(conns) == 1 and ((cut == "piece" and op == "file_write" and f["args"].get("offset")) or
                                (cut == "rename" and op == "file_rename")):
            writer.transport.abort()            # the daemon goes under it
            return True
        if op == "file_remove":
            error = {"code": "not_found", "message": f"remove {f['args']['path']}: No such file", "detail": {}}
            writer.write(protocol.encode_frame({"id": f["id"], "error": error}))
        else:
            writer.write(protocol.encode_frame({"id": f["id"], "result": {"size": 8}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                c.server = {"limits": {"max_file_chunk_bytes": 4}}
                return await asyncio.wait_for(Sandbox(c, "sb1", {}).write_file("/tmp/out", b"abcdefgh",
                                                                                  atomic=atomic), 30)

    assert asyncio.run(go()) == 8
    assert len(conns) == 2
    again = [f for f in list(conns.values())[1] if f["op"] in ("file_write", "file_rename")]
    # (The next daemon's hello gives no chunk limit: the bytes go in one piece.)
    writes = sorted((f["args"].get("offset", 0), f["args"]["data"]) for f in again if f["op"] == "file_write")
    assert writes[0][0] == 0 and b"".join(data for _, data in writes) == b"abcdefgh", again
    assert again[-1]["op"] == ("file_rename" if atomic else "file_write")


def test_a_temporary_directory_copy_cut_by_a_lost_connection_is_said_to_be_gone(tmp_path):
    """A temporary put (dsec cp -r's landing in a merge) is removed by the
    daemon when its client's connection ends, ended or not: the error said
    that the directory, if there, was whole."""
    sock_path = str(tmp_path / "d.sock")

    async def answer(f: dict, writer) -> bool:
        if f["op"] == "file_tar_put":
            assert f["args"].get("temporary") is True
            writer.transport.abort()            # the daemon goes under it
            return True
        writer.write(protocol.encode_frame({"id": f["id"], "result": {}}))
        return False

    async def go():
        server = await asyncio.start_unix_server(serving(answer), sock_path)
        async with server:
            async with Client(sock_path) as c:
                c.server = {"capabilities": ["files.temporary"]}
                with pytest.raises(ConnectionLost) as e:
                    await asyncio.wait_for(Sandbox(c, "sb1", {}).upload_tar(b"\0" * 1024, "/work/up",
                                                                            temporary=True), 30)
                return e.value

    err = asyncio.run(go())
    said = str(err)
    assert err.sent and "sb1:/work/up" in said, said
    assert "whole" not in said and "nothing of the copy is left" in said and "copy it again" in said, said
