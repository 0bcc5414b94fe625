"""Background processes of microVM sandboxes: what ProcessService
(dsecd/engine/procs.py) hands over for a sandbox of backend "microvm", so
that `proc_*` answer as for a container.

The guest agent (csrc/guest/agent.c, "background processes") starts each
one and keeps it: its output in a ring of limits.proc_output_bytes, each
chunk with its offset in all the process wrote and the time it was read,
and its exit status. The agent outlives the host's channel to it, which a
pause (QEMU ends; a resume starts a new one) or a daemon restart closes. The
daemon mirrors each ring in its own (procs.Ring) from the agent's pushes
(wire.PROC_OUT, PROC_END), which come once it attached to the process at the
offset it already has (wire.PROC_ATTACH). On each new channel (a resume, a
re-adoption after a restart) it asks for the agent's table (wire.PROC_LIST)
and attaches again at the offset it has: after a pause nothing is missed,
after a restart the new daemon's rings fill from what the agent kept. Only
bytes the agent's ring dropped (more output than it holds while no daemon
read) are lost, and counted in `dropped`.

Processes the agent does not know (the VM was replaced: cannot happen while
its record lives) are recorded as exited, status unknown; ones the agent
knows and the journal does not (the daemon stopped between the start and its
journal write) are taken up. They die with the VM (`destroy`), and are
frozen with it by `pause`; a `proc_input` or `proc_kill` to a paused VM
resumes it first (its agent is not running), as an exec does, and an input
cut by a pause or a restart goes on at the next channel (by offset: nothing
reaches the process twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import struct
import time

from ..backends.microvm import wire
from ..backends.microvm.agent import AgentError, AgentGone, AgentLink
from ..errors import BadRequest, Conflict, exec_error, io_error
from ..fs import users
from .microvms import check_groups_sent
from .sandboxes import Sandbox

log = logging.getLogger(__name__)


class VmProcs:
    """The microVM half of ProcessService `svc` (its tables, records and
    ends are shared): start, attach, input, kill, eviction."""

    def __init__(self, svc):
        self.svc = svc
        # Sandbox id -> the task attaching the daemon to the agent's
        # processes on its current channel; views wait for it, so a
        # proc_logs right after a restart or resume sees what the agent kept.
        self.attaching: dict[str, asyncio.Task] = {}
        # Sandbox id -> a future done at its next new channel or its end
        # (what an input cut by a pause waits for: _relinked).
        self.changes: dict[str, asyncio.Future] = {}
        # Requests sent without waiting for the answer (_send_quietly): held
        # here until done, as the loop keeps only a weak reference to a task.
        self._quiet: set[asyncio.Task] = set()

    # ------------------------------------------------------------ channel

    def _send_quietly(self, sb: Sandbox, link: AgentLink, kind: int, *fields: bytes) -> None:
        """A request whose answer nobody waits for (a pause does); a closed
        channel or an error answer is ignored."""
        async def send() -> None:
            with contextlib.suppress(AgentError, AgentGone):
                await link.request(kind, *fields)

        task = self._counted_task(sb, send())
        self._quiet.add(task)
        task.add_done_callback(self._sent)

    def _counted_task(self, sb: Sandbox, coro) -> asyncio.Task:
        """A task of agent requests, counted from now to its end as requests
        a pause waits for (MicroVMService.request_running): a request cut
        on its way by the end of QEMU would leave the agent half a frame,
        and it would take the resumed VM's HELLO for the rest of it."""
        counted = self.request_running(sb)
        counted.__enter__()
        task = self.svc.workers.loop.create_task(coro)
        task.add_done_callback(lambda _t: counted.__exit__(None, None, None))
        return task

    def _sent(self, task: asyncio.Task) -> None:
        self._quiet.discard(task)
        if not task.cancelled():
            task.exception()            # taken: nobody awaits it

    def _link(self, sb: Sandbox) -> AgentLink:
        """The channel for a start, input or kill: through the microVM service,
        so a ballooned VM gets its RAM back for the process, as for an exec."""
        return self.svc.vms.agent(sb)

    def linked(self, sb: Sandbox) -> None:
        """A new channel to the sandbox's agent (a resume, a re-adoption
        after a restart): attach to its processes again."""
        h = sb.handle
        if h is None or h.agent is None or h.agent.closed:
            return
        old = self.attaching.get(sb.id)
        if old is not None and not old.done():
            old.cancel()
        task = self._counted_task(sb, self._attach_all(sb, h.agent))
        self.attaching[sb.id] = task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._changed(sb.id)

    def _changed(self, sb_id: str) -> None:
        change = self.changes.pop(sb_id, None)
        if change is not None and not change.done():
            change.set_result(None)

    async def settled(self, sb: Sandbox) -> None:
        """Wait for the attach of the current channel, if one runs."""
        task = self.attaching.get(sb.id)
        if task is not None and not task.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(task)

    def _listen(self, sb: Sandbox, link: AgentLink) -> None:
        link.on_proc = lambda kind, r: self._on_push(sb, link, kind, r)

    async def _attach_all(self, sb: Sandbox, link: AgentLink) -> None:
        svc = self.svc
        self._listen(sb, link)
        try:
            guest = _parse_list(await link.request(wire.PROC_LIST))
        except (AgentError, AgentGone) as err:
            log.warning("sandbox %s: cannot list the background processes of its VM's agent: %s", sb.id, err)
            return
        table = svc.tables.setdefault(sb.id, {})
        for pid, g in guest.items():
            if pid not in table and svc.registry.listed(sb):
                # Started just before the daemon stopped, not journaled: taken up.
                rec = {"pid": pid, "argv": g["argv"], "started": g["started"], "state": "running",
                       "policy": None, "vm": True}
                table[pid] = svc.new_proc(rec)
        for pid, proc in list(table.items()):
            g = guest.get(pid)
            if g is None:
                if proc.running:
                    svc._lost(sb, proc, "the VM's agent does not know it")
                continue
            proc.vm_stdin = g["stdin_open"]
            if not proc.stdin_lock.locked():      # else an input under way sends its own offset again
                proc.vm_in = g["in_received"]
            if proc.running or proc.ring.written < g["written"]:
                try:
                    await link.request(wire.PROC_ATTACH, wire.u64(pid), wire.u64(proc.ring.written))
                except (AgentError, AgentGone) as err:
                    log.warning("sandbox %s: cannot attach to background process %d: %s", sb.id, pid, err)
        svc._save(sb)

    def _on_push(self, sb: Sandbox, link: AgentLink, kind: int, r: wire.Reader) -> None:
        """An agent's push, on the loop (never raises)."""
        if sb.handle is None or sb.handle.agent is not link:
            return                  # a channel of before (a pause's old QEMU)
        try:
            pid = r.u64()
            proc = self.svc.tables.get(sb.id, {}).get(pid)
            if proc is None or not proc.vm:
                return
            if kind == wire.PROC_OUT:
                offset, fd, at_ns = r.u64(), r.u64(), r.u64()
                proc.ring.put(offset, fd, r.bytes(), at_ns / 1e9)
                proc.wake()
            elif proc.running:
                status, ended_ns = r.u64(), r.u64()
                proc.vm_stdin = False
                self.svc._ended(sb, proc, status, ended_ns / 1e9 if ended_ns else None)
        except (ValueError, IndexError, struct.error) as err:
            log.warning("sandbox %s: a bad background process frame from the agent: %s", sb.id, err)
        except Exception:      # a fault here must not end the agent's channel
            log.exception("sandbox %s: background process frame from the agent", sb.id)

    # ------------------------------------------------------------ verbs

    async def start(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds) -> tuple[int, dict]:
        """Start it in the guest: (pid, its record). A pause waits for the
        start's answer (it could not be sent again: it may have run)."""
        with self.svc.vms.request_running(sb):
            return await self._start(sb, req, env, cwd, ids)

    async def _start(self, sb: Sandbox, req, env: list[str], cwd: str, ids: users.ProcessIds) -> tuple[int, dict]:
        await self.settled(sb)
        link = self._link(sb)
        check_groups_sent(sb, link, ids)
        self._listen(sb, link)
        argv = list(req.argv)
        flags = (wire.EXEC_STDIN if req.stdin else 0) | (wire.EXEC_GROUPS if ids.groups else 0)
        # Counted itself: a cancel of this request ends the counts around
        # it while the start may still be on its way.
        start = self._counted_task(sb, link.request(
            wire.PROC_START, wire.u64(self.svc.limits.output_bytes), wire.u64(ids.uid), wire.u64(ids.gid),
            wire.u64(flags), wire.bstr(cwd), wire.u64(len(argv)),
            *map(wire.bstr, argv), wire.u64(len(env)), *map(wire.bstr, env),
            *(wire.groups_fields(ids.groups) if ids.groups else ())))
        try:
            r = await asyncio.shield(start)
        except asyncio.CancelledError:
            # The request went while the agent started it: it is killed, as
            # a container's is (its exited record stays in the agent's table).
            start.add_done_callback(lambda fut: self._kill_orphan(sb, link, fut))
            raise
        except AgentError as err:
            if err.errno == errno.ENOSYS and err.step == "unknown request type":
                raise Conflict(f"cannot start {argv[0]!r} in sandbox {sb.id}: its VM's guest agent is older than "
                               "this dsecd and keeps no background processes; recreate the sandbox to use them",
                               {"sandbox": sb.id}) from err
            if err.step.startswith("malformed"):
                raise BadRequest(f"proc_start: {err.strerror}") from err
            raise exec_error(err, argv[0], cwd) from err
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting; cannot start {argv[0]!r}: {err}",
                           {"sandbox": sb.id}) from err
        pid = r.u64()
        rec = {"pid": pid, "argv": argv, "started": time.time(), "state": "running", "policy": None, "vm": True,
               "stdin": bool(req.stdin)}
        return pid, rec

    def _kill_orphan(self, sb: Sandbox, link: AgentLink, fut: asyncio.Future) -> None:
        """A process start whose request was abandoned: the process it started
        (the answer's pid), which nobody will ever name, is killed."""
        if fut.cancelled() or fut.exception() is not None or link.closed:
            return
        self._send_quietly(sb, link, wire.PROC_KILL, wire.u64(fut.result().u64()), wire.u64(signal.SIGKILL))

    def request_running(self, sb: Sandbox):
        """Count agent requests a pause must wait for (MicroVMService.request_running)."""
        return self.svc.vms.request_running(sb)

    async def attach(self, sb: Sandbox, proc) -> None:
        """Follow a process just started, from its first byte. A pause waits
        for it (a request cut on its way would leave the agent half a frame)."""
        try:
            with self.request_running(sb):
                await self._link(sb).request(wire.PROC_ATTACH, wire.u64(proc.pid), wire.u64(0))
        except (AgentError, AgentGone, Conflict) as err:
            # Its channel went (a pause, the VM's end): the next channel attaches.
            log.info("sandbox %s: attach to background process %d: %s", sb.id, proc.pid, err)

    async def kill(self, sb: Sandbox, proc, signum: int) -> bool:
        await self.svc.ensure_running(sb, "signalling a process")
        try:
            with self.svc.vms.request_running(sb):       # a pause waits for the signal to be sent
                await self.settled(sb)
                r = await self._link(sb).request(wire.PROC_KILL, wire.u64(proc.pid), wire.u64(signum))
        except AgentGone as err:
            raise Conflict(f"sandbox {sb.id} is exiting: {err}", {"sandbox": sb.id}) from err
        except AgentError as err:
            if err.errno == errno.ESRCH:
                return False
            raise io_error("signal", f"process {proc.pid} in sandbox {sb.id}", err) from err
        return bool(r.u64())

    async def input(self, sb: Sandbox, proc, data: bytes, eof: bool) -> None:
        """Waits until the process's pipe took all of it (the agent answers
        then): a process that does not read holds the request here, across
        a pause or a daemon restart too. The request names the offset of its
        data in all the input (proc.vm_in: what the agent took before), so
        when the channel goes before the answer it is sent again on the next
        one and the agent skips what it already took."""
        await self.svc.ensure_running(sb, "writing to a process's stdin")
        await self.settled(sb)
        offset, data = proc.vm_in, bytes(data)
        while True:
            link = self._link(sb)
            try:
                await link.request(wire.PROC_INPUT, wire.u64(proc.pid), wire.u64(offset), wire.u64(1 if eof else 0),
                                   wire.bstr(data))
                break
            except AgentGone:
                await self._relinked(sb, proc, link)       # paused meanwhile: on at its resume
            except AgentError as err:
                if err.errno in (errno.EPIPE, errno.ESRCH):
                    proc.vm_stdin = False
                    raise BrokenPipeError(errno.EPIPE, "its stdin is closed") from err
                raise io_error("write to the stdin of", f"process {proc.pid} in sandbox {sb.id}", err) from err
        proc.vm_in = offset + len(data)
        if eof:
            proc.vm_stdin = False

    async def _relinked(self, sb: Sandbox, proc, old: AgentLink) -> None:
        """Wait for a channel other than `old` (a resume, a reconnect), its
        processes attached; BrokenPipeError if the process or sandbox ends first."""
        while True:
            h = sb.handle
            if not self.svc.registry.listed(sb) or not proc.running or sb.state == "dead":
                raise BrokenPipeError(errno.EPIPE, "the process ended with its VM")
            if h is not None and h.agent is not None and h.agent is not old and not h.agent.closed:
                await self.settled(sb)
                return
            change = self.changes.setdefault(sb.id, self.svc.workers.loop.create_future())
            await asyncio.shield(change)

    def forget_in_guest(self, sb: Sandbox, proc) -> None:
        """An evicted record: the agent frees its ring too (in the background;
        a VM without a channel frees it at its end)."""
        h = sb.handle
        if h is None or h.agent is None or h.agent.closed:
            return
        self._send_quietly(sb, h.agent, wire.PROC_FORGET, wire.u64(proc.pid))

    def gone(self, sb_id: str) -> None:
        """The sandbox is destroyed or its VM died: inputs waiting for a channel give up."""
        task = self.attaching.pop(sb_id, None)
        if task is not None and not task.done():
            task.cancel()
        self._changed(sb_id)


def _parse_list(r: wire.Reader) -> dict[int, dict]:
    """The agent's PROC_LIST answer: pid -> what it knows of the process."""
    out = {}
    for _ in range(r.u64()):
        pid, exited, status, written, dropped, kept = (r.u64() for _ in range(6))
        stdin_open, in_received, started_ns, ended_ns = r.u64(), r.u64(), r.u64(), r.u64()
        argv = [a.decode(errors="surrogateescape") for a in r.bytes().split(b"\0")[:-1]]
        out[pid] = {"exited": bool(exited), "status": status, "written": written, "dropped": dropped,
                    "kept": kept, "stdin_open": bool(stdin_open), "in_received": in_received, "started": started_ns / 1e9,
                    "ended": ended_ns / 1e9 if exited else None, "argv": argv}
    return out
