"""FnCall backend: per-image call sandboxes, each with a pre-imported zygote.

A call sandbox is an ordinary container sandbox (dsecd/backends/container.py:
user, mount, pid, uts, ipc, net and cgroup namespaces, an overlay of the image, the
container's dsec-init as PID 1, cgroup limits from [fncall]) that belongs to
the daemon, not to a client: it lives under `<cgroup_root>/.fncall/<id>` and
`<state_dir>/fncall/sandboxes/<id>`, is never journaled, and is destroyed at
shutdown (a daemon killed with -9 leaves it behind; the next start removes it).

Inside it, if the image has python3, runs the zygote (dsecd/backends/
zygote_main.py), started by the exec helper with one end of a SOCK_SEQPACKET
socketpair as its stdin; the daemon keeps the other end. Each call is one
packet (the code in it, or in a memfd when large) plus SCM_RIGHTS fds: stdin
(the daemon's /dev/null, or a memfd holding the caller's stdin) and
stdout/stderr pipes; the zygote hands it to a pre-forked worker and reports
its wait status. Output flows straight from the worker to the daemon's pipes,
under the same cap as an exec; `Collector` (dsecd/execio.py) collects it with
loop callbacks alone (no task or thread per call: tasks were most of a call's daemon CPU). A zygote that dies, speaks garbage or does not answer a kill in time
is dropped with its whole call sandbox; the next call makes new ones.

Images without python3 (or with [fncall] zygote = false) take plain argv
calls only: each is an exec in the call sandbox under a uid of its own (from
fncall.uid_base: an id of the call sandbox's user namespace, or a host id
where sandboxes run without one), in an IPC namespace of its own where the
call sandbox has a user namespace (own_ipc), in a fresh dir under /tmp created and removed by the
daemon through the sandbox root; forked by the call sandbox's init when
sandbox.exec_via is "init" (else, or when its channel cannot take one, by
the daemon's helper).
"""

from __future__ import annotations

import array
import asyncio
import collections
import ctypes
import json
import logging
import os
import select
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import cgroup, native, userns
from .. import seccomp as seccomp_profiles
from ..caps import cap_mask
from ..fs import files as sbfiles
from ..fs import upper as upperfs
from .container import ContainerBackend, Handle
from .zygote_main import init_children, kill_leftovers, remove_ipc, remove_owned, remove_tree

log = logging.getLogger(__name__)

ZYGOTE_SOURCE = (Path(__file__).with_name("zygote_main.py")).read_text()


class ZygoteDied(Exception):
    """The zygote went away (crash, kill, garbage on its socket) mid-call."""


@dataclass
class Zygote:
    """The daemon's side of one zygote: its socket, its process, its calls."""

    sock: socket.socket
    pid: int                # host pid (a child of the daemon: CLONE_PARENT)
    pidfd: int
    info: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)   # call id -> Future of the exit message
    calls: int = 0
    alive: bool = True
    ready: asyncio.Future | None = None
    # The socket is non-blocking, and the zygote's queue holds only
    # net.unix.max_dgram_qlen packets (10 by default): a burst of calls fills
    # it while the zygote forks. Kills wait in `unsent`, calls in `waiters`.
    unsent: collections.deque = field(default_factory=collections.deque)
    waiters: list = field(default_factory=list)
    writing: bool = False

    def send(self, msg: dict) -> None:
        """A message without fds (a kill): sent now, or once there is room."""
        if not self.alive:
            return
        data = json.dumps(msg).encode()
        if not self.unsent:
            try:
                self.send_raw(data)
                return
            except BlockingIOError:
                pass
        self.unsent.append(data)
        self._want_room()

    async def send_call(self, data: bytes, fds: list[int]) -> None:
        """A call's packet and its fds; waits while the zygote's queue is full
        (the fds stay the caller's until this returns)."""
        while True:
            try:
                self.send_raw(data, fds)
                return
            except BlockingIOError:
                if not self.alive:
                    raise ZygoteDied(f"zygote {self.pid} is gone") from None
                fut = asyncio.get_running_loop().create_future()
                self.waiters.append(fut)
                self._want_room()
                await fut

    def send_raw(self, data: bytes, fds: list[int] = ()) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.sock.sendmsg([data], anc)

    def _want_room(self) -> None:
        if not self.writing:
            asyncio.get_running_loop().add_writer(self.sock.fileno(), self._on_room)
            self.writing = True

    def _on_room(self) -> None:
        while self.unsent:
            try:
                self.send_raw(self.unsent[0])
            except BlockingIOError:
                return
            except OSError as err:
                self.fail(f"send to zygote {self.pid}: {err}")
                return
            self.unsent.popleft()
        self._stop_writing()
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _stop_writing(self) -> None:
        if self.writing:
            self.writing = False
            asyncio.get_running_loop().remove_writer(self.sock.fileno())

    def on_readable(self) -> None:
        try:
            while True:
                msg = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
                if not msg:
                    raise ConnectionError("zygote closed its socket")
                self._dispatch(json.loads(msg))
        except BlockingIOError:
            return
        except (OSError, ValueError, KeyError, TypeError) as err:
            self.fail(f"zygote {self.pid}: {err}")

    def _dispatch(self, msg: dict) -> None:
        op = msg["op"]
        if op == "ready":
            self.info = msg
            if self.ready and not self.ready.done():
                self.ready.set_result(msg)
            return
        fut = self.pending.pop(msg["id"], None)
        if fut is None or fut.done():
            return
        if op == "exit":
            fut.set_result(msg)
        else:
            fut.set_exception(OSError(msg.get("errno") or 0, msg.get("message", "zygote error")))

    def fail(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        log.warning("fncall %s; the zygote is replaced", why)
        err = ZygoteDied(why)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()
        if self.ready and not self.ready.done():
            self.ready.set_exception(err)
        self._stop_writing()
        self.unsent.clear()
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)


CLONE_NEWIPC = 0x08000000
SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 430, 431, 432     # the same on every architecture
FSOPEN_CLOEXEC = FSMOUNT_CLOEXEC = 1
FSCONFIG_CMD_CREATE = 6
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, nstype: int) -> None:
    if _libc.setns(fd, nstype) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _kill_own_children(h: Handle, host_uid: int) -> int:
    """SIGKILL and reap this daemon's children that run as `host_uid` in the
    call sandbox's pid namespace (with sandbox.userns = false, other call
    sandboxes' calls have the same host uids). How many did not end within
    a second (looked for again)."""
    try:
        ns = os.stat(f"/proc/{h.init_pid}/ns/pid").st_ino
    except OSError:
        return 0
    left = 0
    for tid in os.listdir("/proc/self/task"):
        for pid in init_children(int(tid)):
            try:
                pidfd = os.pidfd_open(int(pid))
            except OSError:
                continue
            try:      # the pidfd held across the checks, the kill and the reap: the pid cannot be another's
                with open(f"/proc/{int(pid)}/status") as f:
                    uids = next((line.split()[1:] for line in f if line.startswith("Uid:")), [])
                if str(host_uid) not in uids or os.stat(f"/proc/{int(pid)}/ns/pid").st_ino != ns:
                    continue
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                if select.select([pidfd], [], [], 1.0)[0]:
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
                else:
                    left += 1
            except OSError:
                continue
            finally:
                os.close(pidfd)
    return left


@dataclass
class CallBox:
    """One image's call sandbox."""

    id: str
    image: str
    layers: list[str]
    handle: Handle
    zygote: Zygote | None = None
    zygote_error: str | None = None     # why it has no zygote and takes argv calls only
    start_failed: str | None = None     # why its zygote did not start (it is being dropped)
    calls: int = 0
    running: int = 0
    oom_kills: int = 0      # its OOM kill count, as last read (at the end of a SIGKILLed call)
    claims: int = 0         # calls that took it and have not ended (it is not dropped as idle meanwhile)
    last_used: float = field(default_factory=time.monotonic)    # when its last call ended
    created: float = field(default_factory=time.time)
    free_uids: list = field(default_factory=list)    # plain calls: one uid per running call
    env: dict = field(default_factory=dict)     # the image's environment, under each call's
    idmap: userns.IdMap | None = None           # its user namespace's range; None: host ids
    mq_fd: int = -1         # its POSIX message queues' directory (FnCallBackend.mqueue_dir); -1: none
    # Plain calls' clean-ups under way (CallService._give_back): they use its
    # handle's fds, its mq_fd and its uid range in workers, so the box is
    # destroyed only after them; `dropping` tells them to stop.
    cleanups: set = field(default_factory=set)
    dropping: bool = False

    def host_ids(self, uid: int) -> tuple[int, int]:
        """A call's uid (and gid of the same number) as the host sees them."""
        if self.idmap is None:
            return uid, uid
        return self.idmap.uid + uid, self.idmap.gid + uid


class FnCallBackend:
    name = "fncall"

    def __init__(self, layout: cgroup.Layout, sandbox_cfg: dict, fn_cfg: dict, state_dir: Path,
                 sizes: dict, disk: upperfs.Cap | None = None, execs_by_init: bool = False):
        self.cfg = fn_cfg
        self.disk = disk        # writable-layer cap of call sandboxes (None: uncapped dir)
        # execs_by_init: a call sandbox's init forks its plain calls, as
        # sandbox inits fork execs (dsecd/initlink.py); the zygote is started
        # by the helper either way.
        # Call sandboxes run under the "fncall" seccomp profile in place of
        # "default": the same, but unshare may make an IPC or a net
        # namespace, which the zygote alone there can (spawn_zygote).
        seccomp = "fncall" if sandbox_cfg["seccomp"] == "default" else sandbox_cfg["seccomp"]
        self.containers = ContainerBackend(layout, {**sandbox_cfg, "seccomp": seccomp,
                                                    "cgroup_root": f"{sandbox_cfg['cgroup_root']}/.fncall"},
                                           Path(state_dir) / "fncall", sizes,
                                           "tmpfs" if disk else "dir", execs_by_init)
        # A call sandbox's init (with a user namespace of its own) keeps
        # SYS_ADMIN over that namespace, never in effect in init itself: the
        # child it forks for a plain call unshares an IPC namespace with it
        # before dropping to the call's uid (start_plain_by_init), where the
        # seccomp filter lets that unshare through (own_ipc).
        if self.containers.seccomp in (-1, seccomp_profiles.PROFILES["fncall"]):
            self.containers.userns_init_caps = cap_mask(["SYS_ADMIN"])

    def leftovers(self) -> list[str]:
        """Call sandboxes of an earlier daemon (none are ever re-adopted)."""
        return sorted(self.containers.orphans(set()))

    def create_box(self, box_id: str, lowerdirs: list[str], limits: cgroup.Limits, plan,
                   idmap: userns.IdMap | None = None) -> Handle:
        """A call sandbox, in a user namespace of `idmap`'s range (None: host ids).

        Its /proc hides every process from the other uids (hidepid=invisible):
        a call sees its own processes only, not another call's argv,
        environment or pids, nor the zygote's or init's. Root's group of the
        call sandbox (gid=, as the host sees it) sees them all: the zygote,
        which holds no CAP_SYS_PTRACE, reads the status of what a call left
        behind (zygote_main.kill_leftovers); no call holds that group.

        Its root is read-only: whatever the image leaves writable to a call
        (a world-writable dir or file anywhere, a dir owned by an id in the
        calls' range) would keep what one call wrote for the calls after it,
        under other uids, and finding those places means a walk of the whole
        image at every start (~40-110 us an entry on a loaded two-core host:
        seconds for a Debian image). Calls write in their private dirs under
        /tmp and in /dev/shm, tmpfs mounts of their own (seal_shared_dirs)."""
        root_gid = idmap.gid if idmap is not None else 0
        h = self.containers.create(box_id, lowerdirs, limits, "fncall", plan, idmap=idmap, disk=self.disk,
                                   proc_options=f"hidepid=invisible,gid={root_gid}", root_readonly=True)
        try:
            self.seal_shared_dirs(h)
        except BaseException:
            self.containers.destroy(box_id, h)
            raise
        return h

    # The two writable places of a call sandbox (tmpfs mounts; its root is
    # read-only). /tmp is root-only (0711): a call (as its fncall uid)
    # writes in its own private dir there. /dev/shm is sticky and
    # world-writable but not listable (01733): glibc makes POSIX shared
    # memory and named semaphores (multiprocessing's locks and queues) there
    # and nowhere else; a call cannot list, remove or rename another's
    # entries, and what it leaves is removed before its uid is handed out
    # again (zygote_main.remove_owned), so no call leaves a file for the next.
    SHARED_DIR_MODES = {"/tmp": 0o711, "/dev/shm": 0o1733}

    def seal_shared_dirs(self, h: Handle) -> None:
        for path, mode in self.SHARED_DIR_MODES.items():
            try:
                fd = sbfiles._open(h.rootfd, path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)

    def destroy_box(self, box_id: str, h: Handle | None) -> None:
        self.containers.destroy(box_id, h)

    def own_ipc(self, h: Handle) -> bool:
        """Whether the zygote of call sandbox `h` can give each call an IPC
        (or net) namespace of its own: where the sandbox has a user namespace
        of its own (CAP_SYS_ADMIN in the host's would be the host's), under
        the "fncall" seccomp profile or none (any other forbids unshare)."""
        return h.userns and self.containers.seccomp in (-1, seccomp_profiles.PROFILES["fncall"])

    def spawn_zygote(self, h: Handle, conf: dict, image_env: dict) -> tuple[socket.socket, int]:
        """Start python3 + the zygote source in the call sandbox, under the
        image's environment (its PATH finds python3); (our socket end, host pid).
        With conf["own_ipc"] (own_ipc) it holds CAP_SYS_ADMIN over the call
        sandbox's user namespace, to unshare an IPC namespace in each worker,
        and with conf["own_net"] a net namespace too, and CAP_NET_ADMIN to
        bring its loopback up (the call sandbox's own net namespace belongs
        to the host's user namespace: the zygote can change nothing there);
        a worker loses them, with every other capability, when it drops to
        its call's uid, before the call runs. The zygote runs no call's code,
        and its seccomp filter (every worker's too) still denies mounts,
        setns and every other namespace."""
        extra = cap_mask(["SYS_ADMIN"]) if conf.get("own_ipc") else 0
        if conf.get("own_net"):
            extra |= cap_mask(["SYS_ADMIN", "NET_ADMIN"])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            argv = [self.cfg["python"], "-I", "-c", ZYGOTE_SOURCE, json.dumps(conf)]
            # LD_BIND_NOW: the dynamic linker resolves every symbol once, in the
            # zygote; lazily, each worker resolved (and wrote into the GOT, a
            # copy-on-write fault) every libc function it called first: setsid,
            # setuid, setrlimit... Workers get the call's environment instead.
            env = self.containers.exec_env({**image_env, "HOSTNAME": "fncall", "LD_BIND_NOW": "1"}, {})
            pid = self.containers.spawn(h, argv, env, "/", 0, (theirs.fileno(), null, null), extra_caps=extra)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(null)
        return ours, pid

    # A plain call keeps no capability (cap_keep 0), not even the
    # NET_BIND_SERVICE a non-root exec keeps: a call serves no port. Where
    # the call sandbox has a user namespace of its own (own_ipc), it runs in
    # an IPC namespace of its own, as a zygote's call does: unshared by its
    # process before it drops to the call's uid, by init or by the helper.
    # What it makes there (SysV objects, message queues) goes with its last
    # process, and no other call reaches it or takes its keys and names.

    def start_plain_by_init(self, loop, h: Handle, argv: list[str], env: list[str], cwd: str, uid: int,
                            fds: tuple[int, int, int]):
        """A plain call sent to the call sandbox's init (on the loop); None
        when it has no channel or the channel cannot take it: spawn_plain."""
        return self.containers.start_by_init(loop, h, argv, env, cwd, uid, fds, cap_keep=0,
                                             own_ipc=self.own_ipc(h))

    def spawn_plain(self, h: Handle, argv: list[str], env: list[str], cwd: str, uid: int,
                    fds: tuple[int, int, int]) -> int:
        return self.containers.spawn(h, argv, env, cwd, uid, fds, cap_keep=0, own_ipc=self.own_ipc(h))

    # Private dirs for plain argv calls, made and removed through the sandbox
    # root with RESOLVE_IN_ROOT walks (dsecd/fs/files.py): a sandbox that turns
    # /tmp into a symlink cannot make the daemon write or delete outside it.

    def make_private_dir(self, h: Handle, name: str, host_ids: tuple[int, int]) -> str:
        """/tmp/NAME, owned by the call's ids as the host sees them (CallBox.host_ids)."""
        tmpfd = sbfiles._open(h.rootfd, "/tmp", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.mkdir(name, 0o700, dir_fd=tmpfd)
            os.chown(name, *host_ids, dir_fd=tmpfd, follow_symlinks=False)
        finally:
            os.close(tmpfd)
        return f"/tmp/{name}"

    @staticmethod
    def kill_leftovers(h: Handle, host_uid: int, own_range: bool = True) -> int:
        """SIGKILL everything of a plain call's uid (as the host sees it) by
        that uid in the call sandbox's pid namespace, where the uid is of the
        call sandbox's own id range (`own_range`: a user namespace):
        native.kill_uid_in, which nothing outruns, where a walk of init's
        children can miss a process forked after it looked, and which reaches
        no process of that uid outside the call sandbox (another daemon's
        sandboxes may have the same host ids). Then look for what is
        left to the call sandbox's init (the zygote's own check, with init's
        host pid) and to this daemon: forked by the helper, a plain call is
        the daemon's child, and clone(CLONE_PARENT) by it gives its child the
        same parent (reaped here). How many still ran."""
        if own_range:
            native.kill_uid_in(h.pidfd, host_uid)
        return kill_leftovers(host_uid, h.init_pid) + _kill_own_children(h, host_uid)

    @staticmethod
    def remove_shm_files(h: Handle, host_uid: int) -> bool:
        """What a plain call left in the call sandbox's /dev/shm (the
        zygote's own cleanup, through the sandbox root; the call's uid as the
        host sees it). False when it could not all be removed: the uid must
        not be handed out again."""
        try:
            fd = sbfiles._open(h.rootfd, "/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return True             # no /dev/shm: nothing could be left there
        except OSError:
            return False
        try:
            return remove_owned(fd, host_uid)
        except Exception:
            return False
        finally:
            os.close(fd)

    @staticmethod
    def remove_ipc(h: Handle, host_uid: int) -> bool:
        """What a plain call left in the call sandbox's SysV IPC (the
        zygote's own cleanup, the call's uid as the host sees it): this
        thread joins the sandbox's IPC namespace for it (setns changes the
        calling thread only; /proc/sysvipc shows the opener's namespace) and
        comes back. False when something is left: the uid must not be handed
        out again."""
        back = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(h.pidfd, CLONE_NEWIPC)
            try:
                return remove_ipc(host_uid, drop=False)
            finally:
                _setns(back, CLONE_NEWIPC)
        finally:
            os.close(back)

    @staticmethod
    def mqueue_dir(h: Handle) -> int:
        """An fd of the directory of the call sandbox's POSIX message queues:
        an mqueue fs of its IPC namespace, mounted nowhere (this thread joins
        the namespace to make it, and comes back), from which what a call
        leaves is removed as from /dev/shm. -1 when it cannot be made."""
        back = os.open("/proc/thread-self/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(h.pidfd, CLONE_NEWIPC)
            try:
                fs = _libc.syscall(SYS_FSOPEN, b"mqueue", FSOPEN_CLOEXEC)
                if fs < 0:
                    return -1
                try:
                    if _libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0) < 0:
                        return -1
                    mnt = _libc.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, 0)
                finally:
                    os.close(fs)
            finally:
                _setns(back, CLONE_NEWIPC)
        finally:
            os.close(back)
        if mnt < 0:
            return -1
        try:
            return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=mnt)
        finally:
            os.close(mnt)

    @staticmethod
    def remove_mqueues(mq_fd: int, host_uid: int) -> bool:
        """What a plain call left in the call sandbox's message queues (the
        zygote's own cleanup). False when it could not all be removed."""
        if mq_fd < 0:
            return True
        try:
            return remove_owned(mq_fd, host_uid)
        except Exception:
            return False

    def remove_private_dir(self, h: Handle, name: str) -> bool:
        """/tmp/NAME of a plain call, whole at any depth (zygote_main.remove_tree);
        False when some of it stays (its uid must not be handed out again)."""
        try:
            tmpfd = sbfiles._open(h.rootfd, "/tmp", os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        try:
            return remove_tree(tmpfd, name)
        finally:
            os.close(tmpfd)
