"""The SDK's argument habits, without a daemon: commands as argv or shell
strings, env and labels checked with the key and type that is wrong, and
every Client and Sandbox method taken by SyncClient and SyncSandbox too."""

from __future__ import annotations

import collections
import os

import pytest

from dsecd.client import command_argv, string_map


def test_a_string_runs_through_the_shell_and_a_list_as_it_is():
    assert command_argv("echo hi | wc -c") == ["/bin/sh", "-c", "echo hi | wc -c"]
    assert command_argv(["echo", "hi"]) == ["echo", "hi"]
    assert command_argv(("ls", "-l")) == ["ls", "-l"]
    assert command_argv(["ls", b"caf\xe9"]) == ["ls", b"caf\xe9"]       # a file name that is not UTF-8


def test_a_commands_environment_may_hold_bytes_but_labels_may_not():
    assert string_map({b"K": b"\xe9", "A": "1"}, "env", raw=True) == {b"K": b"\xe9", "A": "1"}
    with pytest.raises(TypeError, match="labels keys must be str, got bytes"):
        string_map({b"K": "v"}, "labels")


@pytest.mark.parametrize("bad,words", [(None, "NoneType"), (["echo", 1], "holding int"), (b"ls", "bytes")])
def test_other_commands_are_a_type_error(bad, words):
    with pytest.raises(TypeError, match="list of strings or a shell string") as info:
        command_argv(bad)
    assert words in str(info.value)


def test_env_values_must_be_strings_and_the_message_names_the_key():
    assert string_map({"A": "1"}, "env") == {"A": "1"} and string_map(None, "env") == {}
    with pytest.raises(TypeError, match=r"env\['A'\] must be a str, got int 1; convert it, e.g. str\(1\)"):
        string_map({"A": 1}, "env")
    with pytest.raises(TypeError, match="labels keys must be str, got int"):
        string_map({1: "x"}, "labels")
    with pytest.raises(TypeError, match="env must be a dict of str to str, got list"):
        string_map(["A=1"], "env")


# Public members of Client and Sandbox that SyncClient and SyncSandbox leave
# out on purpose, each with why. Anything else public must have a counterpart.
SYNC_LEAVES_OUT = {
    ("Client", "frames"): "raw protocol frames of one request; the sync methods wrap every streamed op "
                          "(events, watch, exec_stream, run_stream, progress callbacks), request() the rest",
    ("Client", "frames_with_id"): "raw frames under a caller's request id, ordered by an asyncio.Event: "
                                  "plumbing of the async client's own streams",
    ("Client", "new_id"): "a request id, only of use to frames_with_id",
    ("Client", "last_frame_at"): "a time of the client's own event loop, for dsecd.Fleet's heartbeat",
    ("Client", "abort_now"): "must run on the loop's thread and returns the internal connection for "
                             "abort's second half; SyncClient.abort does both",
    ("Sandbox", "read_chunks"): "an async iterator of a file's chunks; sync code streams a file with "
                                "read_file_to",
}


def _public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def _sync_pairs():
    from dsecd.client import Client, Sandbox
    from dsecd.sync import SyncClient, SyncSandbox

    return [(Client, SyncClient), (Sandbox, SyncSandbox)]


@pytest.mark.parametrize("async_cls,sync_cls", _sync_pairs(), ids=["Client", "Sandbox"])
def test_every_public_method_and_property_has_a_sync_counterpart(async_cls, sync_cls):
    """Methods and properties of the class (instance attributes such as
    Sandbox.id are set by the sync wrappers' __init__, so an instance is looked at)."""
    from dsecd.client import Client, Sandbox

    if sync_cls.__name__ == "SyncClient":
        sync_obj = sync_cls("/nonexistent/dsecd.sock")
        sync_obj.close()
    else:
        sync_obj = sync_cls(None, Sandbox(Client("/nonexistent/dsecd.sock"), "sb-1", {}))
    wanted = {n for n in _public(async_cls) if (async_cls.__name__, n) not in SYNC_LEAVES_OUT}
    assert sorted(n for n in wanted if not hasattr(sync_obj, n)) == []
    # The allowlist names only what exists and is really left out.
    for cls_name, n in SYNC_LEAVES_OUT:
        if cls_name == async_cls.__name__:
            assert n in _public(async_cls) and not hasattr(sync_obj, n), n


@pytest.mark.parametrize("async_cls,sync_cls", _sync_pairs(), ids=["Client", "Sandbox"])
def test_sync_methods_take_every_argument_of_the_async_ones_and_block(async_cls, sync_cls):
    import inspect

    for n in sorted(_public(async_cls)):
        if isinstance(inspect.getattr_static(async_cls, n), property) or not hasattr(sync_cls, n):
            continue
        sync_fn = getattr(sync_cls, n)
        assert not inspect.iscoroutinefunction(sync_fn) and not inspect.isasyncgenfunction(sync_fn), n
        params = inspect.signature(sync_fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [p for p in inspect.signature(getattr(async_cls, n)).parameters
                   if p not in params and not takes_any]
        assert missing == [], f"{sync_cls.__name__}.{n} does not take {missing}"


# ------------------------------------------------------------ file data and atomic writes

class _FakeClient:
    """Answers a Sandbox's file requests from `answer(op, args)`, recording them."""

    def __init__(self, answer):
        self.server = {"limits": {"max_file_chunk_bytes": 1 << 20}}
        self.key_execs = False          # a local socket's client: no keys made for execs
        self.requests: list[tuple[str, dict]] = []
        self.answer = answer

    async def request(self, op: str, **args) -> dict:
        self.requests.append((op, args))
        return self.answer(op, args)


def _sandbox(answer=lambda op, args: {"size": len(args.get("data", b""))}):
    from dsecd.client import Sandbox

    return Sandbox(_FakeClient(answer), "sb-1", {})


@pytest.mark.parametrize("method", ["write_file", "write_at"])
def test_file_data_given_as_str_says_to_encode_it(method):
    import asyncio

    sb = _sandbox()
    call = sb.write_file("/work/a", "text") if method == "write_file" else sb.write_at("/work/a", 0, "text")
    with pytest.raises(TypeError, match=rf"^{method}: data must be bytes \(got str\): encode it, "
                                        r"e\.g\. data\.encode\(\)$"):
        asyncio.run(call)
    assert sb.client.requests == []            # refused before anything is sent
    with pytest.raises(TypeError, match=r"write_file: data must be bytes \(got int\): convert it"):
        asyncio.run(sb.write_file("/work/a", 3, atomic=False))
    for ok in (b"x", bytearray(b"x"), memoryview(b"x")):
        assert asyncio.run(sb.write_file("/work/a", ok)) == 1


def test_atomic_write_errors_name_the_callers_path_not_the_temporary_file():
    import asyncio

    from dsecd.errors import LimitExceeded, NotFound

    def answer(op, args):
        if op == "file_write":
            raise NotFound(f"open sb-1:{args['path']}: No such file or directory",
                           {"errno": "ENOENT", "path": f"sb-1:{args['path']}"})
        return {}

    sb = _sandbox(answer)
    with pytest.raises(NotFound) as info:
        asyncio.run(sb.write_file("/x/y/z", b"x", parents=False))
    tmp = sb.client.requests[0][1]["path"]
    assert tmp.startswith("/x/y/.dsec-")
    err = info.value
    assert err.code == "not_found" and err.message == "open sb-1:/x/y/z: No such file or directory"
    assert err.detail == {"errno": "ENOENT", "path": "sb-1:/x/y/z"}
    assert ".dsec-" not in str(err)
    assert [op for op, _ in sb.client.requests] == ["file_write", "file_remove"]

    def full(op, args):                 # a rename that fails; a detail without the path
        if op == "file_rename":
            raise LimitExceeded(f"rename sb-1:{args['src']} -> {args['dst']}: quota", {"errno": "EDQUOT"})
        return {"size": 1}

    sb = _sandbox(full)
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(sb.write_file("/work/f", b"x"))
    assert info.value.message == "write sb-1:/work/f: quota"         # the rename under it said as the write
    assert info.value.detail == {"errno": "EDQUOT", "path": "/work/f"} and info.value.code == "limit"


def test_read_file_reads_a_file_replaced_meanwhile_again_from_the_start():
    """Its chunks name the file the first came from; a conflict saying it
    was replaced starts the read over, READ_AGAIN times at most."""
    import asyncio

    from dsecd.client import READ_AGAIN
    from dsecd.errors import Conflict

    chunk = 1 << 20
    versions = [b"a" * (3 * chunk), b"b" * (2 * chunk + 5)]
    state = {"now": 0, "replace_after": 1}

    def answer(op, args):
        assert op == "file_read"
        if args["offset"] > 0 and state["replace_after"]:          # replaced after the first chunk
            state["replace_after"] -= 1
            state["now"] = 1
        ident = f"1:{state['now']}"
        if args.get("same_as", ident) != ident:
            raise Conflict("read sb-1:/f: the file was replaced", {"path": "/f", "replaced": True})
        data = versions[state["now"]]
        return {"data": data[args["offset"]:args["offset"] + args["length"]], "size": len(data), "file": ident}

    sb = _sandbox(answer)
    sb.client._tails = False
    assert asyncio.run(sb.read_file("/f")) == versions[1]
    asked = [(a["offset"] // chunk, a.get("same_as")) for _, a in sb.client.requests]
    assert asked[:2] == [(0, None), (1, "1:0")] and asked.count((0, None)) == 2     # refused, then again
    assert (1, "1:1") in asked

    def always_replaced(op, args):
        if "same_as" in args:
            raise Conflict("read sb-1:/f: the file was replaced", {"path": "/f", "replaced": True})
        return {"data": b"x" * chunk, "size": 2 * chunk, "file": "1:1"}

    sb = _sandbox(always_replaced)
    sb.client._tails = False
    with pytest.raises(Conflict, match="replaced"):
        asyncio.run(sb.read_file("/f"))
    assert sum(1 for _, a in sb.client.requests if a["offset"] == 0) == READ_AGAIN + 1


# ------------------------------------------------------------ streamed file copies

def _written(requests) -> bytes:
    """The file a sandbox's file_write requests made (offsets honoured)."""
    out = bytearray()
    for op, args in requests:
        if op == "file_write":
            start = args.get("offset", 0)
            if "offset" not in args:
                del out[:]
            out[start:start + len(args["data"])] = bytes(args["data"])
    return bytes(out)


@pytest.mark.parametrize("kind", ["file", "async iterable", "pipe-like file"])
def test_write_file_streams_a_file_or_an_iterable_in_chunks(kind, tmp_path):
    """A file or an async iterable goes in pieces of at most one chunk, read
    as they are sent, and lands whole under the caller's name."""
    import asyncio
    import io

    chunk = 1 << 20
    data = os.urandom(2 * chunk + 12345)
    src = tmp_path / "src"
    src.write_bytes(data)

    async def dribble():            # odd sizes: regrouped into whole chunks
        for start in range(0, len(data), 300_001):
            yield data[start:start + 300_001]

    source = {"file": lambda: open(src, "rb"), "async iterable": dribble,
              "pipe-like file": lambda: io.BufferedReader(io.BytesIO(data), buffer_size=4096)}[kind]()
    sb = _sandbox()
    assert asyncio.run(sb.write_file("/work/big", source)) == len(data)
    writes = [args for op, args in sb.client.requests if op == "file_write"]
    assert [len(w["data"]) for w in writes] == [chunk, chunk, 12345]
    assert _written(sb.client.requests) == data
    assert sb.client.requests[-1][0] == "file_rename" and sb.client.requests[-1][1]["dst"] == "/work/big"
    if hasattr(source, "close"):
        source.close()


def test_write_file_reads_an_asyncio_stream_reader_by_size():
    """An asyncio subprocess's stdout (a StreamReader: a coroutine `read`,
    and async iteration by lines, which fails on 64 KiB without a newline
    and loses what it had read) is read with `await read(n)`, whatever its
    bytes; so is any reader whose read is a coroutine."""
    import asyncio

    async def go():
        zeros = bytes(300_000)                      # no newline anywhere
        reader = asyncio.StreamReader()
        reader.feed_data(b"line one\n" + zeros)
        reader.feed_eof()
        sb = _sandbox()
        assert await sb.write_file("/work/out", reader) == 9 + len(zeros)
        assert _written(sb.client.requests) == b"line one\n" + zeros

        class OnlyAsyncRead:
            def __init__(self):
                self.left = [b"ab", b"cd", b""]

            async def read(self, n=-1):
                return self.left.pop(0)

        sb = _sandbox()
        assert await sb.write_file("/work/out", OnlyAsyncRead()) == 4
        assert _written(sb.client.requests) == b"abcd"

    asyncio.run(go())


def test_write_file_of_an_empty_or_exact_source_sends_no_empty_tail():
    import asyncio
    import io

    sb = _sandbox()
    assert asyncio.run(sb.write_file("/work/empty", io.BytesIO(b""))) == 0
    assert [len(a["data"]) for op, a in sb.client.requests if op == "file_write"] == [0]
    sb = _sandbox()
    assert asyncio.run(sb.write_file("/work/one", io.BytesIO(b"x" * (1 << 20)))) == 1 << 20
    assert [len(a["data"]) for op, a in sb.client.requests if op == "file_write"] == [1 << 20]


def test_a_source_that_fails_midway_leaves_no_file_and_says_why():
    """A local file that cannot be read to its end (an I/O error, a
    truncated pipe): the write stops, its temporary file is removed and
    nothing is renamed over the target."""
    import asyncio

    async def failing():
        yield b"x" * (1 << 20)
        yield b"y" * (1 << 20)
        raise OSError(5, "Input/output error")

    sb = _sandbox()
    with pytest.raises(OSError, match="Input/output error"):
        asyncio.run(sb.write_file("/work/big", failing()))
    ops = [op for op, _ in sb.client.requests]
    assert "file_rename" not in ops and ops[-1] == "file_remove"
    assert sb.client.requests[-1][1]["path"].startswith("/work/.dsec-")


def test_read_file_to_streams_and_starts_again_in_a_seekable_file():
    """read_file_to writes as chunks come (never more than the pipeline read
    ahead); a file replaced meanwhile is written again from where the
    caller's file was, truncated; into a pipe that cannot be, Conflict."""
    import asyncio
    import io

    from dsecd.client import PIPELINE
    from dsecd.errors import Conflict

    chunk = 1 << 20
    versions = [b"a" * (5 * chunk), b"b" * (2 * chunk + 7)]       # shorter than what came first
    state = {"now": 0, "replace_at": 3 * chunk}

    def answer(op, args):
        if args["offset"] == state["replace_at"]:
            state["now"], state["replace_at"] = 1, None
        ident = f"1:{state['now']}"
        if args.get("same_as", ident) != ident:
            raise Conflict("read sb-1:/f: the file was replaced", {"path": "/f", "replaced": True})
        data = versions[state["now"]]
        return {"data": data[args["offset"]:args["offset"] + args["length"]], "size": len(data), "file": ident}

    class Recorder(io.BytesIO):
        """Notes how many chunks were asked for beyond those written."""

        def __init__(self, sb):
            super().__init__(b"head")
            self.seek(4)
            self.sb, self.most_ahead = sb, 0

        def write(self, data):
            offsets = [a["offset"] for _, a in self.sb.client.requests]
            asked = len(offsets) - max(i for i, o in enumerate(offsets) if o == 0)     # this attempt's
            written = (self.tell() - 4) // chunk + 1
            self.most_ahead = max(self.most_ahead, asked - written)
            return super().write(data)

    sb = _sandbox(answer)
    sb.client._tails = False
    out = Recorder(sb)
    assert asyncio.run(sb.read_file_to("/f", out)) == len(versions[1])
    assert out.getvalue() == b"head" + versions[1]
    assert 0 < out.most_ahead <= PIPELINE

    class Pipe(io.BytesIO):
        def seekable(self):
            return False

    state.update(now=0, replace_at=3 * chunk)
    sb = _sandbox(answer)
    sb.client._tails = False
    with pytest.raises(Conflict, match="replaced"):
        asyncio.run(sb.read_file_to("/f", Pipe()))


def test_a_dockerfile_that_cannot_be_read_says_which_and_why(tmp_path, monkeypatch):
    """build_dockerfile reads the Dockerfile on the client's side: a missing,
    binary or directory one is an error that names it, not a bare strerror
    or a codec's message."""
    import asyncio

    from dsecd import Client
    from dsecd.errors import BadRequest, NotFound

    def build(dockerfile=None):
        return asyncio.run(Client(str(tmp_path / "none.sock")).build_dockerfile(str(tmp_path), "x", dockerfile))

    with pytest.raises(NotFound, match=rf"read the Dockerfile {tmp_path}/Dockerfile: No such file.*-f"):
        build()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFound, match=rf"Dockerfile Df: No such file.*relative -f is read from the current directory, {tmp_path}"):
        build("Df")
    (tmp_path / "bin.df").write_bytes(b"\xd2\x00FROM busybox\n")
    with pytest.raises(BadRequest, match=r"the Dockerfile bin.df is not UTF-8 text \(byte 0"):
        build("bin.df")
    with pytest.raises(BadRequest, match=r"read the Dockerfile \.: Is a directory"):
        build(".")


def test_an_atomic_write_that_failed_part_way_says_it_left_nothing():
    # The daemon says of the file it wrote (the temporary one) that it is
    # "partly written"; the atomic write removed it, so the caller's file
    # is as it was: the error must not send them to clean up.
    import asyncio

    from dsecd.errors import LimitExceeded

    def full(op, args):
        if op == "file_write" and args.get("offset"):
            raise LimitExceeded(f"write sb-1:{args['path']}: no space left in the sandbox; the file is partly "
                                "written. Remove files in the sandbox", {"errno": "ENOSPC"})
        return {"size": len(args.get("data", b"")), "removed": 1}

    sb = _sandbox(full)
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(sb.write_file("/work/big", b"x" * (3 << 20)))
    assert "partly written" not in info.value.message, info.value.message
    assert "/work/big is as it was (the part written was removed)" in info.value.message, info.value.message
    assert [op for op, _ in sb.client.requests][-1] == "file_remove"

    def gone(op, args):                 # the removal fails too: the part stays, and the error says so
        if op == "file_remove":
            raise ConnectionError("lost")
        return full(op, args)

    sb = _sandbox(gone)
    with pytest.raises(LimitExceeded) as info:
        asyncio.run(sb.write_file("/work/big", b"x" * (3 << 20)))
    assert "partly written" in info.value.message


def test_an_exec_stream_runs_its_command_once():
    """Iterating an ExecStream sends its exec; a second iteration (a loop
    over it again, or a second task reading it) would send it again under
    the same request id and run the command twice. It is refused instead."""
    import asyncio

    from dsecd.client import Sandbox

    class Execs(_FakeClient):
        def new_id(self) -> int:
            return 7

        async def frames_with_id(self, rid, op, args, sent=None):
            self.requests.append((op, args))
            sent.set()
            yield {"fd": 1, "data": b"hi\n"}
            yield {"__result__": {"exit_code": 0}}

    stream = Sandbox(Execs(None), "sb-1", {}).exec_stream(["echo", "hi"])

    async def twice():
        first = [chunk async for chunk in stream]
        with pytest.raises(RuntimeError, match=r"^exec_stream \['echo', 'hi'\] in sb-1 runs once"):
            async for _ in stream:
                pass
        return first

    assert asyncio.run(twice()) == [(1, b"hi\n")]
    assert [op for op, _ in stream.sb.client.requests] == ["exec"]
    assert stream.result.exit_code == 0


def test_download_dir_into_a_missing_directory_names_it(tmp_path):
    """The local parent of download_dir's target does not exist: the error
    names that directory, not a temporary file the caller never gave, and
    nothing is asked of the daemon."""
    import asyncio

    sb = _sandbox()
    local = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError) as info:
        asyncio.run(sb.download_dir("/work/d", str(local)))
    assert info.value.filename == str(local.parent), info.value
    assert str(info.value).startswith(f"[Errno 2] download_dir to {local}: no directory to make it in"), info.value
    assert sb.client.requests == []


@pytest.mark.parametrize("bad,raised", [(ValueError("the source broke"), ValueError),
                                        (ConnectionResetError("its socket was reset"), ConnectionResetError),
                                        ("text", TypeError)])
def test_an_exec_whose_stdin_iterator_fails_ends_at_once(bad, raised):
    """An async iterator given as stdin raises (or gives a str) part way:
    the command would wait for the rest of its input forever, and so would
    the caller. The exec is cancelled (killed) and the iterator's error
    raised at once."""
    import asyncio
    import time

    from dsecd.client import Sandbox
    from dsecd.errors import Conflict

    class Execs(_FakeClient):
        def __init__(self):
            super().__init__(lambda op, args: {})
            self.cancelled = asyncio.Event()

        def new_id(self) -> int:
            return 7

        async def request(self, op, **args):
            self.requests.append((op, args))
            if op == "cancel":
                self.cancelled.set()
                await asyncio.sleep(0.5)            # the exec's end comes first
            return {}

        async def frames_with_id(self, rid, op, args, sent=None):
            sent.set()
            await self.cancelled.wait()             # the command reads stdin till its end
            raise Conflict("request cancelled")
            yield

    async def stdin():
        yield b"one\n"
        if isinstance(bad, Exception):
            raise bad
        yield bad

    async def go():
        client = Execs()
        t = time.monotonic()
        with pytest.raises(raised) as info:
            await asyncio.wait_for(Sandbox(client, "sb-1", {}).exec(["cat"], stdin=stdin()), 5)
        return time.monotonic() - t, info.value, client.requests

    took, err, requests = asyncio.run(go())
    assert took < 2, took
    assert ("cancel", {"target": 7}) in requests
    assert err is bad or raised is TypeError
    if raised is TypeError:
        assert str(err) == "exec stdin: the async iterator gave a str; give bytes: encode it", err


def test_write_at_takes_data_of_any_size():
    """write_at with more than a chunk of data (limits.max_file_chunk_bytes)
    was refused by the daemon with advice (append=true) the SDK does not
    take; it goes in chunks at their offsets instead, as write_file's do."""
    import asyncio

    sizes = {}

    def answer(op, args):
        assert len(args["data"]) <= 1 << 20
        sizes["end"] = max(sizes.get("end", 0), args["offset"] + len(args["data"]))
        return {"size": sizes["end"]}

    sb = _sandbox(answer)
    data = bytes(range(256)) * (10 << 10)           # 2.5 MiB
    assert asyncio.run(sb.write_at("/work/f", 10, data)) == 10 + len(data)
    sent = [(args["offset"], bytes(args["data"])) for op, args in sb.client.requests]
    assert [op for op, _ in sb.client.requests] == ["file_write"] * 3
    assert [o for o, _ in sent] == [10, 10 + (1 << 20), 10 + (2 << 20)]
    assert b"".join(d for _, d in sent) == data
    assert asyncio.run(sb.write_at("/work/f", 0, b"")) == sizes["end"]      # nothing: one request still


def test_call_stdin_of_the_wrong_type_fails_at_once_as_execs_does():
    """exec(stdin="text") is a TypeError saying to encode it; call's was a
    daemon's bad_request about a field's type."""
    import asyncio

    from dsecd.client import Client

    c = Client("/nonexistent/dsecd.sock")
    with pytest.raises(TypeError, match=r"^call stdin must be bytes, got str: encode it$"):
        asyncio.run(c.call("busybox", ["cat"], stdin="text"))
    with pytest.raises(TypeError, match=r"^call stdin must be bytes, got list$"):
        asyncio.run(c.call("busybox", ["cat"], stdin=[b"a"]))


def test_a_sandboxs_cwd_and_env_that_are_not_utf8_come_back_as_str():
    """The daemon sends a name or path that is not UTF-8 as bytes; a
    sandbox's info has them as os.fsdecode's str, as create took them."""
    from dsecd.client import _sandbox_info

    info = _sandbox_info({"cwd": b"/d-\xe9", "env": {b"K\xe9": b"v\xe9", "A": "1"}})
    assert info == {"cwd": os.fsdecode(b"/d-\xe9"), "env": {os.fsdecode(b"K\xe9"): os.fsdecode(b"v\xe9"), "A": "1"}}


def test_the_cli_prints_json_of_an_answer_with_a_key_that_is_not_utf8(capsys):
    """`dsec inspect` prints the daemon's answer as it came: a bytes key (an
    environment variable's name) beside str keys failed json.dumps."""
    import json

    from dsecd.clitext import print_json

    print_json({"env": {b"K\xe9": "v", b"K\xff": "w", "PATH": "/bin"}, "id": "x"})
    assert json.loads(capsys.readouterr().out) == {"env": {"K\\xe9": "v", "K\\xff": "w", "PATH": "/bin"}, "id": "x"}


def _admits(hint, value) -> bool:
    """Whether `value` is of the annotation `hint` (unions, None, classes,
    and Sequence, list, Iterable or AsyncIterable of an item type)."""
    import collections.abc
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_admits(h, value) for h in typing.get_args(hint))
    if hint is None or hint is type(None):
        return value is None
    if origin is None:
        return isinstance(value, hint)
    if origin in (list, tuple, collections.abc.Sequence):
        return isinstance(value, origin) and all(_admits(typing.get_args(hint)[0], v) for v in value)
    return isinstance(value, origin)


async def _chunks():
    yield b"x"


@pytest.mark.parametrize("method,param", [("Sandbox.exec", "argv"), ("Sandbox.exec_stream", "argv"),
                                          ("Sandbox.spawn", "argv"), ("Client.call", "argv")])
def test_the_hints_of_a_command_take_what_the_call_takes(method, param):
    """A type checker held a trainer's valid call against a hint narrower
    than the call: an argv with bytes (a name that is not UTF-8), a tuple."""
    import typing

    from dsecd import client

    cls, name = method.split(".")
    hint = typing.get_type_hints(getattr(getattr(client, cls), name))[param]
    for argv in ("echo hi", ["echo", "hi"], ["ls", b"caf\xe9"], ("ls", "-l")):
        command_argv(argv)                          # the call takes it...
        assert _admits(hint, argv), argv             # ...and so does its hint


@pytest.mark.parametrize("method", ["exec", "exec_stream"])
def test_the_hints_of_an_execs_stdin_take_what_the_call_takes(method):
    import typing

    from dsecd.client import Sandbox

    hint = typing.get_type_hints(getattr(Sandbox, method))["stdin"]
    chunks = _chunks()
    try:
        for stdin in (b"x", bytearray(b"x"), memoryview(b"x"), chunks, None):
            assert _admits(hint, stdin), stdin
    finally:
        chunks.aclose().close()


@pytest.mark.parametrize("argv", [collections.deque(["ls", "-l"]), collections.UserList(["ls", "-l"])])
def test_a_command_its_hint_admits_the_call_takes(argv):
    """The hint (Command) says any sequence of str or bytes; command_argv took
    only a list or a tuple: a checked call failed when it ran."""
    import typing

    from dsecd import client

    hint = typing.get_type_hints(client.Sandbox.exec)["argv"]
    assert _admits(hint, argv)
    assert command_argv(argv) == ["ls", "-l"]
