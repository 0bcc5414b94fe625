"""A thin synchronous shell over the asyncio client, for scripts and the CLI.

    with dsecd.SyncClient() as c:
        print(c.run("busybox", ["echo", "hi"]).stdout)     # docker run --rm
        sb = c.create(image="busybox")
        print(sb.exec(["echo", "hi"]).stdout)
        sb.destroy()

It owns a private event loop in a thread of its own and hands each call to
it, so one SyncClient can be shared by many threads: their calls run
concurrently over its one connection (queued past the daemon's per-client
limit, as the async client's are). A call interrupted while it waits (a
Ctrl-C's KeyboardInterrupt) cancels its request, as a cancelled task does
with the async client: an exec is killed, a create leaves no sandbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Iterator

from .client import (
    ABANDONED_CREATE_WAIT_S,
    Client,
    ExecResult,
    ExecStream,
    Process,
    ProcOutput,
    ProcStatus,
    RunStream,
    Sandbox,
    _destroy_on_the_way_out,
    _left_behind,
)
from .errors import DsecError, NotFound
from .fleet import Fleet, FleetHost
from .remote import SshOptions


class SyncSandbox:
    def __init__(self, owner: SyncClient, sb: Sandbox):
        self._owner = owner
        self._sb = sb
        self.id = sb.id
        self.info = sb.info
        self.host = sb.host

    def __repr__(self) -> str:
        return f"<SyncSandbox {self.id}>"

    def _run(self, coro):
        return self._owner._run(coro)

    def exec(self, argv, **kw) -> ExecResult:
        return self._run(self._sb.exec(argv, **kw))

    def exec_stream(self, argv, **kw) -> SyncExecStream:
        """Iterate it for (fd, data); then `.result` (also the value of
        `yield from` it). `signal` (and with pty=True: `write` and `resize`)
        from another thread while one iterates, or between its chunks
        (Sandbox.exec_stream)."""
        return SyncExecStream(self._owner, self._sb.exec_stream(argv, **kw))

    def spawn(self, argv, **kw) -> SyncProcess:
        """Sandbox.spawn: a background process; returns once it runs."""
        return SyncProcess(self._owner, self._run(self._sb.spawn(argv, **kw)))

    def process(self, pid: int) -> SyncProcess:
        return SyncProcess(self._owner, self._sb.process(pid))

    def processes(self) -> list[ProcStatus]:
        return self._run(self._sb.processes())

    def write_file(self, path: str, data, **kw) -> int:
        """Sandbox.write_file: bytes, or a binary file open for reading."""
        return self._run(self._sb.write_file(path, data, **kw))

    def write_at(self, path: str, offset: int, data: bytes) -> int:
        return self._run(self._sb.write_at(path, offset, data))

    def read_file(self, path: str) -> bytes:
        return self._run(self._sb.read_file(path))

    def read_file_to(self, path: str, file) -> int:
        """Sandbox.read_file_to: into a binary file open for writing, never all in memory."""
        return self._run(self._sb.read_file_to(path, file))

    def list_files(self, path: str, depth: int = 1) -> list[dict]:
        return self._run(self._sb.list_files(path, depth))

    def stat(self, path: str, follow: bool = False) -> dict:
        return self._run(self._sb.stat(path, follow))

    def exists(self, path: str) -> bool:
        return self._run(self._sb.exists(path))

    def mkdir(self, path: str, **kw) -> dict:
        return self._run(self._sb.mkdir(path, **kw))

    def remove(self, path: str, **kw) -> dict:
        return self._run(self._sb.remove(path, **kw))

    def rename(self, src: str, dst: str, **kw) -> dict:
        return self._run(self._sb.rename(src, dst, **kw))

    def set_attrs(self, path: str, **kw) -> dict:
        return self._run(self._sb.set_attrs(path, **kw))

    def upload_dir(self, local: str, remote: str, temporary: bool = False, owner: int | str | None = None,
                   dirs: bool = False) -> dict:
        return self._run(self._sb.upload_dir(local, remote, temporary, owner, dirs))

    def upload_tar(self, fileobj, remote: str, temporary: bool = False, owner: int | str | None = None,
                   dirs: bool = False) -> dict:
        return self._run(self._sb.upload_tar(fileobj, remote, temporary, owner, dirs))

    def download_dir(self, remote: str, local: str) -> dict:
        return self._run(self._sb.download_dir(remote, local))

    def watch(self, path: str, recursive: bool = False) -> SyncWatch:
        """Changes under `path` (see Sandbox.watch), as an iterator; its
        close() ends the watch, from any thread (the one iterating sees the
        iteration end)."""
        return SyncWatch(self._owner, self._sb.watch(path, recursive))

    def inspect(self) -> dict:
        self.info = self._run(self._sb.inspect())
        return self.info

    def net_show(self) -> dict:
        return self._run(self._sb.net_show())

    def net_set(self, **kw) -> dict:
        return self._run(self._sb.net_set(**kw))

    # protocol None, as in Sandbox: TCP, or the one a port such as "5353/udp"
    # names (a "tcp" passed on would contradict that one).
    def publish(self, port: int | str, host_port: int | None = None, bind: str = "",
                protocol: str | None = None) -> dict:
        return self._run(self._sb.publish(port, host_port, bind, protocol))

    def unpublish(self, port: int | str, protocol: str | None = None) -> dict:
        return self._run(self._sb.unpublish(port, protocol))

    def get_host(self, port: int | str, protocol: str | None = None) -> str:
        """"host:port" where the host reaches the sandbox's `protocol` ("tcp",
        the default, or "udp") `port` (or "5353/udp"; published if needed)."""
        return self._run(self._sb.get_host(port, protocol))

    def pause(self) -> dict:
        return self._run(self._sb.pause())

    def resume(self) -> dict:
        return self._run(self._sb.resume())

    def snapshot(self, name: str, exclude: list[str] | None = None, progress=None, key: str | None = None) -> dict:
        """Sandbox.snapshot; `progress` is called on the client's loop thread."""
        return self._run(self._sb.snapshot(name, exclude, progress, key))

    def destroy(self, force: bool = False) -> dict:
        return self._run(self._sb.destroy(force))


class SyncExecStream:
    """A running exec's output, input and window size, over an ExecStream."""

    def __init__(self, owner: SyncClient, stream: ExecStream):
        self._owner = owner
        self._stream = stream
        self.exec_id = stream.exec_id

    @property
    def result(self) -> ExecResult | None:
        return self._stream.result

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        it = self._stream.__aiter__()
        try:
            while True:
                try:
                    yield self._owner._run(it.__anext__())
                except StopAsyncIteration:
                    return self._stream.result
        finally:
            self._owner._run(it.aclose())

    def write(self, data: bytes) -> None:
        self._owner._run(self._stream.write(data))

    def resize(self, rows: int, cols: int) -> None:
        self._owner._run(self._stream.resize(rows, cols))

    def signal(self, signal: int | str) -> None:
        self._owner._run(self._stream.signal(signal))


class SyncWatch:
    """Iterator over a Sandbox.watch run on the SyncClient's loop."""

    def __init__(self, owner: SyncClient, agen):
        self._owner = owner
        self._agen = agen
        self._pending: concurrent.futures.Future | None = None
        self._closed = False
        # Between close() and a __next__ on another thread: no __anext__ may
        # start once close() has looked at the one pending.
        self._lock = threading.Lock()

    def __iter__(self) -> SyncWatch:
        return self

    def __next__(self) -> dict:
        with self._lock:
            if self._closed:
                raise StopIteration
            self._pending = self._owner._submit(self._agen.__anext__())
        try:
            return self._pending.result()
        except (StopAsyncIteration, concurrent.futures.CancelledError):
            self._closed = True
            raise StopIteration from None

    def close(self) -> None:
        """Stop watching: the daemon is told to cancel the request."""
        with self._lock:
            self._closed = True
            pending = self._pending
        if pending is not None and pending.cancel():
            return                          # the waiting __next__ ends; aclosing cancels the request
        self._owner._run(self._agen.aclose())

    def __enter__(self) -> SyncWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SyncEvents(SyncWatch):
    """Iterator over a Client.events run on the SyncClient's loop; its
    close() ends it from any thread, as SyncWatch's does."""


class SyncRunStream:
    """Client.run_stream for scripts: `with c.run_stream(image, args) as run:`
    makes the sandbox (`run.sandbox`, a SyncSandbox) and starts the command;
    iterate it for (fd, data), then `.result`. The sandbox goes when the
    block ends (unless remove=False)."""

    def __init__(self, owner: SyncClient, run: RunStream):
        self._owner = owner
        self._stream = run
        self.image = run.image
        self.argv: list[str] | None = None
        self.sandbox: SyncSandbox | None = None
        self.stream: SyncExecStream | None = None      # its `write`, `resize`, `signal`; not to iterate besides

    @property
    def result(self) -> ExecResult | None:
        return self._stream.result

    def __enter__(self) -> SyncRunStream:
        self._owner._run(self._stream.__aenter__())
        self.argv = self._stream.argv
        self.sandbox = SyncSandbox(self._owner, self._stream.sandbox)
        self.stream = SyncExecStream(self._owner, self._stream.stream)
        return self

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        it = self._stream.__aiter__()
        try:
            while True:
                try:
                    yield self._owner._run(it.__anext__())
                except StopAsyncIteration:
                    return self._stream.result
        finally:
            self._owner._run(it.aclose())

    def __exit__(self, exc_type, exc, tb) -> None:
        self._owner._run(self._stream.__aexit__(exc_type, exc, tb))


class SyncHold:
    """Client.hold's renewing task, on the SyncClient's loop: cancel() (or
    the end of `with c.hold(...):`, or the client's close()) stops renewing,
    and the leases then run out."""

    def __init__(self, owner: SyncClient, task: asyncio.Task):
        self._owner = owner
        self._task = task

    def done(self) -> bool:
        """Whether it stopped renewing (cancelled, or a renew failed)."""
        return self._task.done()

    def exception(self) -> BaseException | None:
        """Why it stopped by itself (a renew's error), else None."""
        if not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    def cancel(self) -> None:
        """Stop renewing; returns once a renew in flight has ended."""
        if not self._task.done():
            self._owner._run(_stop_task(self._task))

    def __enter__(self) -> SyncHold:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


async def _stop_task(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it; as RunStream does with its hold, a renew's error is not raised."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, DsecError, ConnectionError):
        await task


class SyncProcess:
    """A background process (client.Process), for scripts."""

    def __init__(self, owner: SyncClient, proc: Process):
        self._owner = owner
        self._proc = proc
        self.pid = proc.pid
        self.sb = SyncSandbox(owner, proc.sb)

    def __repr__(self) -> str:
        return f"<SyncProcess {self.pid}>"

    def status(self) -> ProcStatus:
        return self._owner._run(self._proc.status())

    def wait(self) -> ProcStatus:
        return self._owner._run(self._proc.wait())

    def output(self, follow: bool = True, since: float | None = None) -> Iterator[ProcOutput]:
        it = self._proc.output(follow, since).__aiter__()
        try:
            while True:
                try:
                    yield self._owner._run(it.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._owner._run(it.aclose())

    def write(self, data: bytes) -> None:
        self._owner._run(self._proc.write(data))

    def close_stdin(self) -> None:
        self._owner._run(self._proc.close_stdin())

    def kill(self, signal: int | str = "KILL") -> dict:
        return self._owner._run(self._proc.kill(signal))


# A call interrupted while it waits (KeyboardInterrupt): how long the calling
# thread waits for its request to be cancelled on the loop (the cancel sent;
# a create's sandbox, if the daemon made it, destroyed) before it raises. As
# long as the client waits for such a destroy, and a little more: a program
# that exits on the interrupt would otherwise end the loop's thread (a
# daemon thread) with the destroy still under way, leaving the sandbox.
CANCEL_WAIT_S = ABANDONED_CREATE_WAIT_S + 2.0


class _Call:
    """One call handed to the loop: its task once it runs, and `ended` once it has."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.cancelled = False
        self.ended = threading.Event()

    def cancel(self) -> None:
        """On the loop: cancel the call's task, or, if it has not started, keep it from starting."""
        if self.task is not None:
            self.task.cancel()
        else:
            self.cancelled = True
            self.ended.set()


class _Subscribed:
    """An async iterator already waiting for its first item on the loop, so
    that the events a SyncFleet's events() gives start when it is called,
    not at the first next() (Fleet.events() is subscribed when called, and
    any async iterator handed here is made to be)."""

    def __init__(self, agen):
        self._agen = agen
        self._first: asyncio.Future | None = asyncio.ensure_future(agen.__anext__())

    @classmethod
    async def start(cls, agen) -> _Subscribed:
        it = cls(agen)
        await asyncio.sleep(0)               # its first step runs now: subscribed
        return it

    def __anext__(self):
        first, self._first = self._first, None
        return first if first is not None else self._agen.__anext__()

    async def aclose(self) -> None:
        if self._first is not None:
            self._first.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await self._first
        await self._agen.aclose()


# How long close() lets the calls other threads still wait for end on their
# own (failed by the closed connection) before it cancels them, and then
# waits for those cancels.
CLOSE_WAIT_S = 2.0


async def _end_the_rest(grace: float) -> None:
    """On a SyncClient's loop as close() stops it, once nothing more is
    handed to it: the calls other threads still wait for (a stream's next
    chunk, a request) end first, by the closed connection's error or, past
    `grace`, cancelled; then the loop stops. Stopped under them, they would
    never end, and their threads would wait forever."""
    me = asyncio.current_task()
    rest = {t for t in asyncio.all_tasks() if t is not me}
    if rest:
        _, pending = await asyncio.wait(rest, timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=grace)
    # A task that ended just before this one looked hands its result to
    # the waiting thread by a callback the loop runs next: it runs before
    # the loop stops.
    await asyncio.sleep(0)
    asyncio.get_running_loop().stop()


async def _now(fn, *args):
    """fn(*args) called on the loop (what touches the loop's state, or starts tasks there)."""
    return fn(*args)


async def _awaited(awaitable, call: _Call | None = None):
    """A coroutine for any awaitable (an async generator's __anext__ is not one)."""
    if call is None:
        return await awaitable
    if call.cancelled:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise asyncio.CancelledError
    call.task = asyncio.current_task()
    try:
        return await awaitable
    finally:
        call.ended.set()


class _LoopThread:
    """A private event loop in a thread of its own; `_run` hands it a
    coroutine from any thread and waits for the result."""

    _what = "SyncClient"

    def __init__(self) -> None:
        self._pid = os.getpid()          # a forked child has no thread to run the loop
        self._loop = asyncio.new_event_loop()
        # Set by _stop_loop, under _handing, once nothing more may be handed
        # to the loop: a call handed to it after it stopped would wait forever.
        self._stopping = False
        self._handing = threading.Lock()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dsecd-sync-loop", daemon=True)
        self._thread.start()

    def _run(self, awaitable):
        """Run `awaitable` on the loop and wait for it, from any thread."""
        if threading.current_thread() is self._thread:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            # A callback (on_stdout, progress, on_event) runs on the loop: a
            # blocking call from there would wait for the loop it blocks.
            raise RuntimeError(f"a {self._what} cannot be called from its own callbacks; use the "
                               "async API there, or collect and call after the request")
        self._check_process(awaitable)
        call = _Call()
        future = None
        try:
            # Handed inside the try: an interrupt that lands just after the
            # hand-off, before the wait, must cancel the call too.
            future = self._hand(_awaited(awaitable, call), awaitable)
            return future.result()
        except concurrent.futures.CancelledError:
            if not self._stopping:
                raise
            # Still under way when close() stopped the loop: cancelled there.
            raise ConnectionError(f"this {self._what} was closed while the call waited") from None
        except BaseException as err:
            if future is None and isinstance(err, ConnectionError):
                raise           # _hand's own: this client is closed, nothing was handed
            # Interrupted (KeyboardInterrupt, SystemExit from a signal handler)
            # while the request runs on the loop: cancel it there, or it would
            # go on unseen (an exec running, a create making a sandbox nobody
            # holds), and give the cancel a moment to reach the daemon.
            if future is None or not future.done():
                with contextlib.suppress(RuntimeError):        # the loop was closed meanwhile
                    self._loop.call_soon_threadsafe(call.cancel)
                    call.ended.wait(CANCEL_WAIT_S)
            raise

    def _check_process(self, awaitable) -> None:
        """RuntimeError in a process forked from the one that made this
        client: its loop's thread is not there, and a call would wait forever."""
        if os.getpid() != self._pid:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise RuntimeError(f"this {self._named()} was made in process {self._pid}; a process forked "
                               "from it (a multiprocessing Pool, say) cannot use it: make one in the child "
                               "(in the Pool's initializer, say)")

    def _submit(self, awaitable) -> concurrent.futures.Future:
        """Start `awaitable` on the loop; its future (streams: events, watch)."""
        self._check_process(awaitable)
        return self._hand(_awaited(awaitable), awaitable)

    def _hand(self, coro, awaitable) -> concurrent.futures.Future:
        """Run `coro` (the caller's `awaitable`, wrapped) on the loop,
        unless close() has stopped it or is stopping it."""
        with self._handing:
            if not self._stopping and not self._loop.is_closed():
                return asyncio.run_coroutine_threadsafe(coro, self._loop)
        coro.close()
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        # close() stopped its loop's thread for good: no connect() brings it back.
        raise ConnectionError(f"this {self._what} is closed: make a new {self._what} to talk to the "
                              "daemon again")

    def _named(self) -> str:
        return self._what

    def _stop_loop(self, last) -> None:
        """Run `last` (a coroutine: the close), then stop the loop's thread."""
        if self._loop.is_closed() or os.getpid() != self._pid:      # a forked child's copy: the parent's to close
            last.close()
            return
        try:
            self._run(last)
        finally:
            with self._handing:
                self._stopping = True
            asyncio.run_coroutine_threadsafe(_end_the_rest(CLOSE_WAIT_S), self._loop)
            self._thread.join()
            self._loop.close()


class _Client(Client):
    """The Client under a SyncClient: one never connected says what a
    SyncClient's user does about it (Client's own advice is `async with`)."""

    async def _connection(self, op: str, deadline: float | None = None, sent: bool = False,
                          key: str | None = None):
        if self._conn is None:
            raise ConnectionError(f"{op}: not connected to dsecd at {self.target}: call connect() first "
                                  "(or use `with`)")
        return await super()._connection(op, deadline, sent, key)


class SyncClient(_LoopThread):
    def __init__(self, target: str | None = None, name: str = "dsecd-sync", connect_timeout: float = 30.0,
                 *, ssh: SshOptions | None = None, reconnect: bool | None = None,
                 reconnect_timeout: float | None = None, silence_timeout: float | str | None = None):
        """target: a socket path or ssh://[user@]host[:port], as Client's;
        connect_timeout, reconnect_timeout and silence_timeout as Client's."""
        self._client = _Client(target, name, connect_timeout, ssh=ssh, reconnect=reconnect,
                               reconnect_timeout=reconnect_timeout, silence_timeout=silence_timeout)
        self._holds: set[asyncio.Task] = set()       # hold()'s tasks still renewing (touched on the loop only)
        super().__init__()

    @property
    def target(self) -> str:
        return self._client.target

    def _named(self) -> str:
        return f"{self._what} of {self.target}"

    def __enter__(self) -> SyncClient:
        try:
            self.connect()
        except BaseException:
            self.close()            # no __exit__ follows: the loop's thread must not outlive it
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._client.connected

    @property
    def reconnect_timeout(self) -> float:
        """How long requests wait for a daemon that went to answer again (Client's)."""
        return self._client.reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, seconds: float | None) -> None:
        self._client.reconnect_timeout = seconds

    def connect(self) -> None:
        self._run(self._client.connect())

    def close(self) -> None:
        """Close the connection and stop the loop's thread; safe to call more than once.
        Leases held by hold() are no longer renewed."""
        self._stop_loop(self._close())

    async def _close(self) -> None:
        for task in list(self._holds):
            await _stop_task(task)
        await self._client.close()

    def abort(self, reason: str) -> None:
        """Client.abort: end the connection now (requests in flight fail with
        ConnectionLost); the next request (with reconnect, the default) or
        a later connect() connects again."""
        self._run(self._client.abort(reason))

    def sandbox(self, image: str, **create_args) -> _SyncSandboxContext:
        """`with client.sandbox(image=...) as sb:` creates a sandbox and destroys it on the way out."""
        return _SyncSandboxContext(self, image, create_args)

    @property
    def server(self) -> dict:
        return self._client.server

    def request(self, op: str, **args) -> dict:
        return self._run(self._client.request(op, **args))

    def info(self) -> dict:
        return self._run(self._client.info())

    def create(self, image: str, **kw) -> SyncSandbox:
        return SyncSandbox(self, self._run(self._client.create(image, **kw)))

    def run(self, image: str, args: list[str] | None = None, **kw) -> ExecResult:
        """Client.run: `docker run --rm`; the image's command (args replace
        its Cmd) in a sandbox removed afterwards; returns its ExecResult.
        on_stdout / on_stderr run on the client's loop thread: print from
        them, make no SyncClient calls."""
        return self._run(self._client.run(image, args, **kw))

    def run_detached(self, image: str, args: list[str] | None = None, **kw) -> SyncProcess:
        """Client.run_detached: `docker run -d`; the image's command started
        in the background in a sandbox of its own (`.sb`), which stays."""
        return SyncProcess(self, self._run(self._client.run_detached(image, args, **kw)))

    def call(self, image: str, **kw):
        """Client.call: a stateless function call; returns a CallResult."""
        return self._run(self._client.call(image, **kw))

    def pool_set(self, image: str, min: int, max: int, **kw) -> dict:
        return self._run(self._client.pool_set(image, min, max, **kw))

    def pool_list(self) -> list[dict]:
        return self._run(self._client.pool_list())

    def drain(self, reason: str = "") -> dict:
        return self._run(self._client.drain(reason))

    def undrain(self) -> dict:
        return self._run(self._client.undrain())

    def net_sets(self) -> list[dict]:
        return self._run(self._client.net_sets())

    def policy_list(self) -> dict:
        """Client.policy_list: the daemon's named task policies and its Landlock ABI."""
        return self._run(self._client.policy_list())

    def get(self, sandbox_id: str) -> SyncSandbox:
        return SyncSandbox(self, self._run(self._client.get(sandbox_id)))

    def list(self, labels: dict | None = None) -> list[dict]:
        return self._run(self._client.list(labels))

    def destroy_all(self, force: bool = False, labels: dict | None = None) -> dict:
        return self._run(self._client.destroy_all(force, labels))

    def top(self, labels: dict | None = None) -> dict:
        return self._run(self._client.top(labels))

    def import_image(self, path: str, name: str, progress=None) -> dict:
        return self._run(self._client.import_image(path, name, progress))

    def build_image(self, source: str, name: str, parent: str | None = None, progress=None, **config) -> dict:
        return self._run(self._client.build_image(source, name, parent, progress, **config))

    def pull_image(self, ref: str, progress=None, platform: str | None = None) -> dict:
        return self._run(self._client.pull_image(ref, progress, platform))
    def build_dockerfile(self, context: str, name: str, dockerfile: str | None = None, **kw) -> dict:
        """Client.build_dockerfile; `progress` is called on the client's loop thread."""
        return self._run(self._client.build_dockerfile(context, name, dockerfile, **kw))

    def job_pause(self, job: str) -> dict:
        return self._run(self._client.job_pause(job))

    def job_resume(self, job: str) -> dict:
        return self._run(self._client.job_resume(job))

    def job_rm(self, job: str, force: bool = False) -> dict:
        return self._run(self._client.job_rm(job, force))

    def renew(self, sandbox_ids: list[str], lease: float | str | None = None) -> dict:
        return self._run(self._client.renew(sandbox_ids, lease))

    def hold(self, sandbox_ids: list[str], lease: float | str | None, every: float | str | None = None) -> SyncHold:
        """Client.hold, renewing on the client's loop; a SyncHold instead of a
        Task: `with c.hold(ids, lease):`, or its cancel(), stops renewing."""
        return SyncHold(self, self._run(self._hold(sandbox_ids, lease, every)))

    async def _hold(self, sandbox_ids: list[str], lease: float | str | None,
                    every: float | str | None) -> asyncio.Task:
        task = self._client.hold(sandbox_ids, lease, every)
        self._holds.add(task)
        task.add_done_callback(self._holds.discard)
        return task

    def events(self, sandbox: str | None = None, replay: bool = False, follow: bool = True) -> SyncEvents:
        """Client.events as an iterator; its close() ends it from any thread
        (the one iterating sees the iteration end)."""
        return SyncEvents(self, self._client.events(sandbox, replay, follow))

    def run_stream(self, image: str, args: list[str] | None = None, **kw) -> SyncRunStream:
        """Client.run_stream: `with c.run_stream(image, args) as run:`, then
        `for fd, data in run:`; `run.sandbox` is a SyncSandbox."""
        return SyncRunStream(self, self._client.run_stream(image, args, **kw))

    def list_images(self) -> list[dict]:
        return self._run(self._client.list_images())

    def image_listing(self) -> dict:
        return self._run(self._client.image_listing())

    def tag_image(self, source: str, name: str) -> dict:
        return self._run(self._client.tag_image(source, name))

    def flatten_image(self, name: str, as_name: str | None = None, progress=None) -> dict:
        """Client.flatten_image; `progress` is called on the client's loop thread."""
        return self._run(self._client.flatten_image(name, as_name, progress))

    def inspect_image(self, name: str) -> dict:
        return self._run(self._client.inspect_image(name))

    def remove_image(self, name: str) -> dict:
        return self._run(self._client.remove_image(name))

    def image_gc(self) -> dict:
        return self._run(self._client.image_gc())

    def image_du(self) -> dict:
        return self._run(self._client.image_du())


class _SyncSandboxContext:
    def __init__(self, client: SyncClient | SyncFleet, image: str, create_args: dict):
        self.client = client
        self.image = image
        self.create_args = create_args
        self.sandbox: SyncSandbox | None = None

    def __enter__(self) -> SyncSandbox:
        self.sandbox = self.client.create(self.image, **self.create_args)
        return self.sandbox

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.sandbox is not None:
            try:
                # Shielded on the loop: a ^C that ends the wait (a second
                # one, after the block's) leaves the destroy going, its
                # client's close waiting for it and a failure logged.
                self.sandbox._run(_destroy_on_the_way_out(self.sandbox._sb))
            except NotFound:
                pass                        # destroyed inside the block already
            except (DsecError, ConnectionError) as err:
                if exc_type is None:
                    raise
                _left_behind(self.sandbox, err)     # the block's own error is the one raised


class SyncFleet(_LoopThread):
    """dsecd.Fleet for scripts: the same methods, blocking; sandboxes are
    SyncSandbox (requests straight to their host), events() an iterator
    (SyncEvents), and each_host's `fn` gets each host's async Client and
    returns an awaitable (`lambda c: c.image_du()`), run on the fleet's
    loop. on_event runs on the fleet's own thread: it may not call the
    SyncFleet (queue the event, or iterate events() instead)."""

    _what = "SyncFleet"

    def __init__(self, hosts: list[str], **fleet_args):
        self._fleet = Fleet(hosts, **fleet_args)
        super().__init__()

    def __enter__(self) -> SyncFleet:
        try:
            self.start()
        except BaseException:
            self.close()            # no __exit__ follows: the loop's thread must not outlive it
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self._run(self._fleet.start())

    def close(self) -> None:
        self._stop_loop(self._fleet.close())

    def status(self) -> list[dict]:
        return self._fleet.status()

    def up_hosts(self) -> list[FleetHost]:
        """The hosts up now (what the fleet knows of each; make requests through the SyncFleet)."""
        return self._run(_now(self._fleet.up_hosts))

    def add_host(self, host: str) -> FleetHost:
        """Fleet.add_host: joins in the background (`host_added` now, `host_up` once it answered)."""
        return self._run(_now(self._fleet.add_host, host))

    def events(self) -> SyncEvents:
        """Fleet.events as an iterator, from now on; its close() ends it from
        any thread (the one iterating sees the iteration end), as does the
        fleet's close()."""
        return SyncEvents(self, self._run(_Subscribed.start(self._fleet.events())))

    def each_host(self, fn) -> dict[str, object]:
        """Fleet.each_host: `fn(client)` on every up host at once, where
        `client` is the host's async Client and `fn` returns an awaitable;
        host -> its result or the exception it raised."""
        return self._run(self._fleet.each_host(fn))

    def create(self, image: str, **kw) -> SyncSandbox:
        return SyncSandbox(self, self._run(self._fleet.create(image, **kw)))

    def sandbox(self, image: str, **create_args) -> _SyncSandboxContext:
        """`with fleet.sandbox(image=...) as sb:` creates a sandbox on the best
        host (create's arguments) and destroys it on the way out (Fleet.sandbox)."""
        return _SyncSandboxContext(self, image, create_args)

    def get(self, sandbox_id: str) -> SyncSandbox:
        return SyncSandbox(self, self._run(self._fleet.get(sandbox_id)))

    def list(self, labels: dict | None = None, errors: dict[str, BaseException] | None = None) -> list[dict]:
        """Fleet.list: `errors`, if given, gets each up host that failed to answer."""
        return self._run(self._fleet.list(labels, errors))

    def top(self, labels: dict | None = None) -> dict:
        return self._run(self._fleet.top(labels))

    def info(self) -> dict:
        return self._run(self._fleet.info())

    def job_pause(self, job: str) -> dict:
        return self._run(self._fleet.job_pause(job))

    def job_resume(self, job: str) -> dict:
        return self._run(self._fleet.job_resume(job))

    def job_rm(self, job: str, force: bool = False) -> dict:
        return self._run(self._fleet.job_rm(job, force))

    def destroy_all(self, force: bool = False, labels: dict | None = None) -> dict:
        return self._run(self._fleet.destroy_all(force, labels))

    def list_images(self, errors: dict[str, BaseException] | None = None) -> list[dict]:
        return self._run(self._fleet.list_images(errors))

    def call(self, image: str, **kw):
        return self._run(self._fleet.call(image, **kw))
