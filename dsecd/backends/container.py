"""Container backend: namespaces + cgroups + overlay, one dsec-init per sandbox.

The sandbox's PID 1 (the static `dsec-init`) is cloned by the C helper into
new mount, pid, uts, ipc, net and cgroup namespaces; the overlay root is
mounted inside the sandbox's own mount namespace, so the host's mount table
never holds sandbox mounts and they vanish with the sandbox. Commands are
forked by that init, asked over its exec channel (`start_by_init`,
dsecd/initlink.py), or run through the C exec helper, which joins the cgroups
and namespaces of the init (setns on its pidfd) and execs as a direct child
of the daemon (`spawn`: traced execs, sandboxes whose init has no channel).

Every method here blocks (clone, mount, rmdir), except `start_by_init` and
`open_pty`: the node calls them from worker threads, never on the event loop.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import cgroup, execio, fds, initlink, native, sysfs, userns
from ..caps import CAP_NUMBERS, cap_mask
from ..config import ConfigError
from ..errors import LimitExceeded
from ..fs import upper as upperfs
from ..imageconfig import DEFAULT_PATH
from ..steps import Steps

log = logging.getLogger(__name__)

PTMX_RDEV = os.makedev(5, 2)     # a devpts instance's ptmx, as /dev/ptmx
# What an exec as a uid other than 0 keeps of sandbox.capabilities (exec_caps).
NON_ROOT_CAPS = cap_mask(["NET_BIND_SERVICE"])

@dataclass
class Handle:
    """A live container: what the node needs to exec in it and destroy it."""

    init_pid: int
    init_start: int          # /proc/<pid>/stat starttime, to tell a reused pid apart
    pidfd: int
    rootfd: int              # O_PATH fd of the sandbox root, for file access
    group: cgroup.Group
    dir: Path | None         # its own dir in the state dir (writable layer "dir"); None: it has none
    is_child: bool           # we cloned it (must reap it) vs adopted after a restart
    sched_idle: bool = False  # execs run SCHED_IDLE (a BE sandbox, dsecd/cpu/qos.py)
    core_sched: bool = False  # execs share PID 1's core-scheduling cookie
    userns: bool = False     # PID 1 runs in a user namespace of its own: execs join it
    upperfd: int = -1        # mount fd of its capped upper tmpfs (dsecd/fs/upper.py); -1 = dir
    init_link: initlink.InitLink | None = None   # the channel to its init (dsecd/initlink.py); None: none
    # Whether its init may start new processes for this daemon: background
    # processes always, execs and copies where sandbox.exec_via = init. False
    # for an adopted init that lacks sandbox.capabilities as they are now;
    # its channel still serves the background processes it runs.
    init_starts: bool = False
    # Whether its init is this daemon's dsec-init build (an adopted one may be
    # an older build, which refuses requests newer than it: supplementary
    # groups go to the helper then).
    init_current: bool = True

    def upper_view(self) -> Callable[[Path], tuple[Path, Callable[[], None] | None]]:
        """On the loop: what puts the writable layer's upper dir at a host
        path under `views` (pack_diff), run in a worker (blocking: it may
        mount), returning that path and what undoes the view (None: nothing
        to undo). A capped upper tmpfs is reached through a copy of its fd
        taken now: a destroy meanwhile (it takes no sandbox lock) closes
        the handle's, and a number reused by another sandbox's would pack
        that sandbox's files."""
        if self.upperfd < 0:
            sbdir = self.dir

            def plain(views: Path) -> tuple[Path, Callable[[], None] | None]:
                if sbdir is None:       # its upper tmpfs fd is closed: destroyed meanwhile
                    raise FileNotFoundError(errno.ENOENT, "the sandbox's writable layer is gone "
                                                          "(destroyed meanwhile)")
                return sbdir / "upper", None
            return plain
        own = os.dup(self.upperfd)
        return lambda views: fds.call_closing(own, upperfs.attach, own, views)


def proc_start_time(pid: int) -> int | None:
    data = sysfs.read_small(f"/proc/{pid}/stat")       # once per create: no buffered file
    if data is None:
        return None
    # Field 22; the comm field (2) may contain spaces and parentheses.
    return int(data[data.rindex(b")") + 2:].split()[19])


def check_adopted_group(sb_id: str, init_pid: int, rel: str) -> None:
    """ConfigError when `init_pid` is in a live group of this sandbox made
    under another sandbox.cgroup_root than `rel`'s (the root was changed
    while sandboxes ran): this daemon could neither freeze, limit nor kill
    it through its groups."""
    try:
        with open(f"/proc/{init_pid}/cgroup") as f:
            paths = [line.split(":", 2)[2] for line in f.read().splitlines() if line.count(":") >= 2]
    except (FileNotFoundError, ProcessLookupError):
        return                  # gone meanwhile: adopt() finds it dead
    why = foreign_group(sb_id, paths, rel)
    if why:
        raise ConfigError(f"sandbox {sb_id}: its init (pid {init_pid}) {why}")


def foreign_group(sb_id: str, paths: list[str], rel: str) -> str | None:
    """What is wrong with a sandbox whose init is in the cgroups `paths`
    (of /proc/PID/cgroup) when its group should be `rel`: None when it is
    there (or below), or in no live group of this sandbox at all (a
    removed group: "... (deleted)"), which adoption deals with as before."""
    want = "/" + rel.strip("/")
    if any(p == want or p.startswith(want + "/") for p in paths):
        return None
    where = next((p for p in paths if p.endswith(f"/{sb_id}")), None)
    if where is None:
        return None
    root, made = rel.strip("/").rpartition("/")[0], where.removesuffix(f"/{sb_id}").strip("/")
    return (f"is in cgroup {where}, made under sandbox.cgroup_root {made!r}, not this config's {root!r}: the "
            f"root was changed while sandboxes ran; set it back to {made!r}, and destroy the sandboxes before "
            "changing it")


class ContainerBackend:
    name = "container"

    def __init__(self, layout: cgroup.Layout, sandbox_cfg: dict, state_dir: Path, sizes: dict,
                 upper_mode: str = "dir", execs_by_init: bool = False):
        self.layout = layout
        self.cfg = sandbox_cfg
        self.root = Path(state_dir) / "sandboxes"
        # A sandbox whose writable layer is a tmpfs of its own needs nothing on
        # the host's disk: its overlay is mounted on this one empty dir, in the
        # sandbox's own mount namespace (each sees its own; the host none).
        # Two dirs per sandbox made and removed on the state dir's filesystem
        # were ~4% of a burst's CPU (on ext4 a new inode is searched for past
        # every inode freed in the last 5 minutes).
        self.mountpoint = self.root / ".mnt"
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.root_ns_fd = self._make_root_ns()
        self.cgroup_root = sandbox_cfg["cgroup_root"]
        self.sizes = sizes
        self.caps = cap_mask(sandbox_cfg["capabilities"])
        self.init_path = native.init_binary_path()
        self.seccomp = self._prepare_seccomp(sandbox_cfg["seccomp"])
        self.upper_mode = upper_mode      # "tmpfs" | "dir" (dsecd/fs/upper.py pick_mode)
        # Init forks execs (dsecd/initlink.py): it keeps permitted what it hands
        # on, and SETUID/SETGID/SETPCAP to change ids and drop the rest.
        self.execs_by_init = execs_by_init
        self.init_caps = self.caps | cap_mask(["SETUID", "SETGID", "SETPCAP"])
        # What init also keeps where the sandbox has a user namespace of its
        # own (over that namespace only): set by a backend whose execs need
        # more (FnCallBackend: SYS_ADMIN, for each plain call's IPC namespace).
        self.userns_init_caps = 0
        if execs_by_init and self.caps & cap_mask(["SYS_PTRACE"]):
            log.warning("sandbox.capabilities has SYS_PTRACE: a sandbox process can then take the fds of its "
                        "init, the exec channel among them (docs/hardening.md section 9)")

    def _make_root_ns(self) -> int:
        """The mount namespace every sandbox's is copied from (csrc/spawn.c
        dsec_root_ns): an empty, read-only tmpfs, so a sandbox's namespace
        holds nothing of the host's and its init chroots into the overlay
        instead of pivot_root, whose walk over every thread on the host grew
        with the live sandboxes. Where it cannot be made, sandboxes get a copy
        of the daemon's namespace and pivot_root, as before."""
        try:
            return fds.park(native.root_ns(str(self.mountpoint)))
        except OSError as err:
            log.warning("no root mount namespace (%s): sandboxes pivot_root out of a copy of the daemon's", err)
            return -1

    @staticmethod
    def _prepare_seccomp(name: str) -> int:
        """Build the profile once, here, before any spawn child installs it."""
        if not name:
            log.warning("sandbox.seccomp is empty: sandboxes run WITHOUT a seccomp filter")
            return -1
        from .. import seccomp

        try:
            number = seccomp.profile_number(name)
        except ValueError as err:
            raise ConfigError(f"sandbox.seccomp: {err}") from err
        n = seccomp.prepare(name)
        log.info("seccomp profile %r: %d BPF instructions, installed in every sandbox process", name, n)
        return number

    def group_for(self, sb_id: str) -> cgroup.Group:
        return cgroup.Group(self.layout, f"{self.cgroup_root}/{sb_id}")

    # ------------------------------------------------------------ create

    def create(self, sb_id: str, lowerdirs: list[str], limits: cgroup.Limits, hostname: str,
               cpu_plan=None, idmap: userns.IdMap | None = None, netns_fd: int = -1,
               disk: upperfs.Cap | None = None, proc_options: str = "", root_readonly: bool = False) -> Handle:
        """netns_fd >= 0: PID 1 joins that network namespace (the netns pool's) instead of a new one.
        disk: the writable layer's cap (a tmpfs of its own); None: a dir in the state dir.
        proc_options: mount data of its /proc (native.ContainerSpec.proc_options);
        root_readonly: its merged root read-only (the ContainerSpec field)."""
        group = self.group_for(sb_id)
        with Steps(f"create sandbox {sb_id}") as steps:
            upperfd = -1
            if disk:
                sbdir, rootfs = None, self.mountpoint
                upperfd = upperfs.create_tmpfs(disk)
                steps.undo("close upper tmpfs", lambda: os.close(upperfd))
            else:
                # A dir of its own: the mount point, and overlay upper/work (what
                # pack_diff reads later).
                sbdir = self.root / sb_id
                os.makedirs(sbdir, exist_ok=True)
                for sub in ("upper", "work", "rootfs"):
                    try:
                        os.mkdir(sbdir / sub)
                    except FileExistsError:
                        pass
                steps.undo("remove sandbox dir", lambda: shutil.rmtree(sbdir, ignore_errors=True))
                rootfs = sbdir / "rootfs"
            # Own cgroups, outside the daemon's, so sandboxes outlive a daemon
            # restart; their limits and QoS (weight, cpu.idle: dsecd/cpu/qos.py)
            # written before the init joins.
            if cpu_plan is not None:
                cpu_plan.make_group(group, limits)
            else:
                group.make(limits)
            steps.undo("remove cgroups", lambda: group.remove(self.cfg["destroy_timeout_s"]))
            sched_idle = bool(cpu_plan and cpu_plan.sched_idle)
            core_sched = bool(cpu_plan and cpu_plan.core_sched == "on")
            # Upper and work share a directory: the sandbox's own, or the root
            # of its capped tmpfs (named through our fd; the child has a copy).
            top = Path(f"/proc/self/fd/{upperfd}") if upperfd >= 0 else sbdir
            ours, theirs = initlink.pair() if self.execs_by_init else (None, None)
            if ours is not None:
                steps.undo("close exec channel", ours.close)
            try:
                with _IdmappedLayers(idmap, lowerdirs, top / "upper", top / "work") as layers:
                    spec = native.ContainerSpec(
                        rootfs=str(rootfs), lowerdirs=layers.lowerdirs, upperdir=layers.upperdir,
                        workdir=layers.workdir, hostname=hostname, init_path=self.init_path,
                        cgroup_procs=group.procs_files(), tmp_size_bytes=self.sizes["tmp"],
                        shm_size_bytes=self.sizes["shm"], sched_idle=sched_idle, core_sched=core_sched,
                        seccomp_profile=self.seccomp, userns_fd=layers.userns_fd,
                        userns_uid=idmap.uid if idmap else 0, userns_gid=idmap.gid if idmap else 0,
                        netns_fd=netns_fd, upper_fd=upperfd,
                        ctl_fd=theirs.fileno() if theirs else -1, ctl_peer_fd=ours.fileno() if ours else -1,
                        init_caps=self.init_caps | (self.userns_init_caps if idmap is not None else 0),
                        oom_reset=_OOM_RESET, root_ns_fd=self.root_ns_fd, park_fds=layers.clone_fds,
                        proc_options=proc_options, root_readonly=root_readonly)
                    pid = native.spawn_container(spec)
            except native.TooManyLayers as err:
                raise LimitExceeded(
                    f"create sandbox {sb_id}: its image has {err.layers} layers, more than a container's overlay "
                    f"mounts here (about {err.fit}: its mount options, a path per layer, fit in one page); use an "
                    "image of fewer layers: `dsec image flatten IMAGE` makes it a single layer (a chain "
                    "of snapshots gains one per snapshot)",
                    {"layers": err.layers, "max_layers": err.fit}) from err
            finally:
                if theirs is not None:
                    theirs.close()      # init holds its copy now (or there is no init)
            steps.undo("kill init", lambda: _kill_and_reap(pid))
            handle = self._open_handle(pid, group, sbdir, is_child=True, own_userns=idmap is not None)
            handle.sched_idle, handle.core_sched = sched_idle, core_sched
            _protect_init_from_oom(pid)
            if ours is not None:    # long-lived: parked high like the handle's other fds (dsecd/fds.py)
                handle.init_link = initlink.parked(ours)
                handle.init_starts = True
            steps.commit()
        handle.upperfd = fds.park(upperfd)
        return handle

    def _open_handle(self, pid: int, group: cgroup.Group, sbdir: Path | None, is_child: bool,
                     own_userns: bool | None = None) -> Handle:
        """own_userns: whether PID 1 has a user namespace of its own, when the
        caller knows (create); None: looked up (adopt)."""
        start = proc_start_time(pid)
        if start is None:
            raise ProcessLookupError(errno.ESRCH, f"sandbox init {pid} exited during setup")
        pidfd = fds.park(native.pidfd_open(pid))
        try:
            # The pidfd pins the process; re-check it is the same one we meant
            # (our unreaped child's pid cannot have been reused).
            if not is_child and proc_start_time(pid) != start:
                raise ProcessLookupError(errno.ESRCH, f"pid {pid} was reused")
            if own_userns is None:
                own_userns = _own_userns(pid)
            rootfd = fds.park(os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        except BaseException:
            os.close(pidfd)
            raise
        return Handle(pid, start, pidfd, rootfd, group, sbdir, is_child, userns=own_userns)

    # ------------------------------------------------------------ adopt

    def adopt(self, sb_id: str, init_pid: int, init_start: int, upper_tmpfs: bool = False) -> Handle | None:
        """Re-attach to a live sandbox after a daemon restart; None if it died.
        upper_tmpfs: its writable layer is a capped tmpfs, whose fd its init holds."""
        if not init_pid or proc_start_time(init_pid) != init_start:
            return None
        check_adopted_group(sb_id, init_pid, self.group_for(sb_id).rel)
        try:
            h = self._open_handle(init_pid, self.group_for(sb_id), None if upper_tmpfs else self.root / sb_id,
                                  is_child=False)
        except (ProcessLookupError, FileNotFoundError):
            return None
        try:
            # Taken back whatever this daemon's exec_via: the background
            # processes init runs report their ends on it.
            h.init_link = initlink.take_back(h.pidfd)
            h.init_starts = h.init_link is not None and self._init_holds_caps(init_pid)
            h.init_current = _same_file(f"/proc/{init_pid}/exe", self.init_path)
        except BaseException:
            close_handle(h)
            raise
        if upper_tmpfs:
            try:
                h.upperfd = fds.park(upperfs.take_back(h.pidfd))
            except OSError as err:
                close_handle(h)
                log.error("sandbox %s: cannot take back its writable layer from init %d: %s",
                          sb_id, init_pid, err)
                return None
        return h

    def _init_holds_caps(self, init_pid: int) -> bool:
        """Whether an adopted sandbox's init can hand on this daemon's
        capabilities (sandbox.capabilities may have changed since it was made)."""
        held = cap_set(init_pid, "CapPrm")
        if held is None:
            return False
        if self.init_caps & ~held:
            log.info("sandbox init %d lacks capabilities %#x of sandbox.capabilities: its execs use "
                     "the helper", init_pid, self.init_caps & ~held)
            return False
        return True

    def kill_leftover_execs(self, h: Handle, background: set[int]) -> list[int]:
        """After a daemon died (killed, crashed; a clean stop kills its execs
        itself): kill the execs its helper started that still run in this
        sandbox, each with its process group. Their clients went with that
        daemon, so nothing would ever read, time out or cancel them, and no
        later daemon counts them. The execs init started are init's to end
        (InitLink.prune: it knows them by id). `background`: the sandbox
        pids of the journaled background processes, which are kept.
        Blocking (reads /proc); the sandbox pids of the execs killed."""
        init_ids = _proc_ids(h.init_pid)
        if init_ids is None:
            return []                     # init is gone: the kernel kills the rest
        level = len(init_ids.nspid) - 1   # the sandbox's pid namespace in NSpid
        killed = []
        for pid in sorted(h.group.pids() - {h.init_pid}):
            ids = _proc_ids(pid)
            if ids is None or ids.session != pid or len(ids.nspid) <= level:
                # Not a session leader: a child of an exec (its group goes
                # with it), or one left by an exec that ended (`cmd &`).
                continue
            in_sandbox = ids.nspid[level]
            if in_sandbox in background:
                continue
            # The helper's execs had the daemon, outside the sandbox's pid
            # namespace, as parent, and now have its reaper (ppid 0 if that
            # is outside ours too). A session leader whose parent is in the
            # sandbox, init included, is an exec of init's (pruned by init)
            # or a process an exec detached on purpose (setsid, a service's
            # start script), which must live on.
            if ids.ppid != 0:
                parent = _proc_ids(ids.ppid)
                if parent is None or len(parent.nspid) > level:
                    continue              # in the sandbox (or gone as we look: left alone)
            if _kill_group_of(pid, ids.start):
                killed.append(in_sandbox)
        return killed

    # ------------------------------------------------------------ exec

    def exec_env(self, sandbox_env: dict, exec_env: dict) -> list[str]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": "sandbox"}
        env.update(sandbox_env)
        env.update(exec_env)
        return [f"{k}={v}" for k, v in env.items()]

    def start_by_init(self, loop, h: Handle, argv: list[str], env: list[str], cwd: str, uid: int,
                      fds: tuple[int, int, int], ctty: bool = False,
                      hold: tuple[int, int, int] | None = None, gid: int | None = None,
                      policy: bytes | None = None, cap_keep: int | None = None,
                      background: bool = False, groups: tuple[int, ...] = (),
                      own_ipc: bool = False) -> initlink.InitExec | None:
        """Send the exec to the sandbox's init (on the event loop, does not
        block); None if it has no channel or the channel cannot take it: then
        `spawn` it. The same ids and capabilities as `spawn` gives. ctty:
        fds[0] is a pty slave, the exec's controlling terminal. hold: the
        daemon's ends of its pipes, for init to hold (a background process).
        gid: its group (None: the uid's number). policy: a task policy's plan
        (dsecd/policy.py), applied before execve; cap_keep: the capabilities it
        keeps if not the sandbox's (a subset). background: a background
        process, which only init starts (whatever sandbox.exec_via says).
        groups: its supplementary gids (none by default). own_ipc: an IPC
        namespace of its own, unshared before its ids change (a sandbox with
        a user namespace of its own, whose init holds SYS_ADMIN over it:
        userns_init_caps)."""
        if h.init_link is None or not h.init_starts or not (self.execs_by_init or background):
            return None
        if (groups or own_ipc) and not h.init_current and not background:
            return None          # an older init refuses the flag; the helper does it
        caps = self.exec_caps(uid, cap_keep)
        return h.init_link.spawn(loop, argv, env, cwd, uid, caps, fds, ctty, hold,
                                 uid if gid is None else gid, policy, groups, own_ipc)

    def exec_caps(self, uid: int, cap_keep: int | None) -> int:
        """The capabilities an exec keeps (raised as ambient ones, so that they
        survive its execve): a task policy's set when it names one; else
        sandbox.capabilities for root, and for any other uid only
        NET_BIND_SERVICE. Docker gives a non-root user none (and opens the
        low ports with a sysctl instead): `--user 1000` is then what a
        scaffold expects it to be, a user that root's files and other users'
        processes keep out."""
        if cap_keep is not None:
            return cap_keep & self.caps
        return self.caps if uid == 0 else self.caps & NON_ROOT_CAPS

    def open_pty(self, h: Handle, idmap: userns.IdMap | None, uid: int, gid: int) -> tuple[int, int]:
        """A new pty (master, slave) from the sandbox's own devpts instance
        (the newinstance mount at its /dev/pts, made at its start), for a
        terminal exec as uid:gid (in-sandbox ids): the terminal is then one
        the sandbox sees (ttyname() finds it under its /dev/pts, `tty` names
        it), counts against its instance, not the host's, and is the exec
        user's, as a login's is. The multiplexer is opened through the
        sandbox root following no symlink or magic link, as the sandbox's
        root, and must be a devpts ptmx, or it is refused: sandboxes cannot
        mount (their seccomp filter), so this is a second line, for what the
        daemon writes the client's keystrokes into."""
        path = "dev/pts/ptmx"
        with userns.as_sandbox_root(idmap):
            master = native.openat2(h.rootfd, path, os.O_RDWR | os.O_NOCTTY,
                                    resolve=native.RESOLVE_IN_ROOT | native.RESOLVE_NO_SYMLINKS
                                    | native.RESOLVE_NO_MAGICLINKS)
        slave = -1
        try:
            st = os.fstat(master)
            if (native.fs_magic(master, f"/{path}") != native.DEVPTS_SUPER_MAGIC
                    or not stat.S_ISCHR(st.st_mode) or st.st_rdev != PTMX_RDEV):
                raise OSError(errno.ENOTTY, f"/{path} is not a devpts pty multiplexer")
            slave = execio.open_pty_peer(master)
            if idmap is not None:
                uid, gid = idmap.uid + uid, idmap.gid + gid
            os.fchown(slave, uid, gid)
        except BaseException:
            fds.close_quietly(slave)
            os.close(master)
            raise
        return master, slave

    def copy_by_init(self, loop, h: Handle, src: int, dst: int) -> initlink.InitExec | None:
        """Have the sandbox's init copy src into dst from a child in the
        sandbox's cgroups (on the event loop, does not block); None if it has
        no channel or the channel cannot take it."""
        if h.init_link is None or not (self.execs_by_init and h.init_starts):
            return None
        return h.init_link.copy(loop, src, dst)

    def spawn(self, h: Handle, argv: list[str], env: list[str], cwd: str, uid: int,
              fds: tuple[int, int, int], ctty: bool = False, gid: int | None = None,
              policy: bytes | None = None, cap_keep: int | None = None, groups: tuple[int, ...] = (),
              extra_caps: int = 0, own_ipc: bool = False) -> int:
        """Start argv through the daemon's exec helper; its host pid. gid: None
        is the uid's number; groups: its supplementary gids; extra_caps:
        capabilities it holds beyond sandbox.capabilities (the call
        sandbox's zygote: FnCallBackend.spawn_zygote); own_ipc: an IPC
        namespace of its own, owned by the sandbox's user namespace (it
        needs one: h.userns)."""
        caps = self.exec_caps(uid, cap_keep) | extra_caps
        spec = native.ExecSpec(pidfd=h.pidfd, cgroup_procs=h.group.procs_files(), argv=argv, env=env,
                               cwd=cwd, uid=uid, gid=uid if gid is None else gid, stdin_fd=fds[0], stdout_fd=fds[1],
                               stderr_fd=fds[2], cap_keep=caps, sched_idle=h.sched_idle,
                               core_sched=h.core_sched, seccomp_profile=self.seccomp, userns=h.userns,
                               oom_reset=_OOM_RESET, ctty=ctty, policy=policy, groups=groups,
                               own_ipc=own_ipc)
        return native.spawn_exec(spec)

    # ------------------------------------------------------------ destroy

    def stop(self, sb_id: str, h: Handle | None) -> None:
        """Kill every process and remove the cgroups; safe to repeat.

        This is the part of destroy a client waits for. What is left - the
        fds that pin the overlay (closing the last one unmounts it, ~1 ms) and
        the sandbox's directory - is `release`, which the node runs after
        answering. A daemon that dies in between leaves a directory without a
        journal record, which the next start removes as an orphan.
        """
        timeout = self.cfg["destroy_timeout_s"]
        group = h.group if h else self.group_for(sb_id)
        if h:
            pidns = _pidns(h.init_pid)
            # SIGKILL to a pid namespace's init kills every process in it.
            try:
                native.pidfd_send_signal(h.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_exit(h, timeout, pidns)
            # The sandbox's mount namespace is gone with its init: our fd is
            # the last reference to the upper tmpfs. Free its memory now,
            # before the memory cgroup it is charged to is removed.
            _close_fd(h, "upperfd")
        else:
            group.kill_all()      # no handle (orphan, half-made): kill by cgroup membership
        group.remove(timeout)     # kills stragglers itself if the groups are still busy

    def release(self, sb_id: str, h: Handle | None) -> None:
        if h:
            close_handle(h)
        if h is None or h.dir is not None:      # a capped sandbox never had a dir of its own
            shutil.rmtree(self.root / sb_id, ignore_errors=True)

    def destroy(self, sb_id: str, h: Handle | None) -> None:
        self.stop(sb_id, h)
        self.release(sb_id, h)

    def orphans(self, known: set[str]) -> set[str]:
        """Sandbox ids that have dirs or cgroups but no journal record."""
        on_disk = {e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith(".")}
        # Dot-names are the daemon's own helpers' groups (e.g. .pager), not sandboxes.
        in_cgroups = {n for n in cgroup.list_children(self.layout, self.cgroup_root) if not n.startswith(".")}
        return (on_disk | in_cgroups) - known


class _IdmappedLayers:
    """The overlay's layers as the spawn sees them. Without an id map: an
    O_PATH fd of each layer, named /proc/self/fd/N (a store path is ~100
    bytes, and the overlay's options must fit in one page: 40 layers would
    not). With one: a user namespace for the sandbox, and detached
    idmapped clones of every layer mount and of the directory holding upper and
    work (they must share a mount), named /proc/self/fd/N, which the spawn child (a copy
    of our fd table) resolves to the same clones. The overlay keeps its own
    references to them; the child attaches the clones in the sandbox's mount
    namespace (`clone_fds`, ContainerSpec.park_fds), so closing every fd once
    the spawn returned unmounts nothing (an unmount waits for an expedited RCU
    grace period)."""

    def __init__(self, idmap: userns.IdMap | None, lowerdirs: list[str], upperdir: Path, workdir: Path):
        if upperdir.parent != workdir.parent:
            raise ValueError(f"overlay upper {upperdir} and work {workdir} must share a directory")
        self.idmap, self.fds = idmap, []
        self.lowerdirs, self.userns_fd = lowerdirs, -1
        self.upperdir, self.workdir = str(upperdir), str(workdir)

    def __enter__(self) -> _IdmappedLayers:
        if self.idmap is None:
            try:
                self.lowerdirs = [self._open(d) for d in self.lowerdirs]
            except BaseException:
                self.__exit__()
                raise
            return self
        try:
            self.userns_fd = userns.create_namespace(self.idmap)
            self.fds.append(self.userns_fd)
            self.lowerdirs = [self._clone(d) for d in self.lowerdirs]
            top = self._clone(os.path.dirname(self.upperdir))
            self.upperdir = f"{top}/{os.path.basename(self.upperdir)}"
            self.workdir = f"{top}/{os.path.basename(self.workdir)}"
        except BaseException:
            self.__exit__()
            raise
        return self

    def _open(self, path: str) -> str:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    def _clone(self, path: str) -> str:
        fd = native.mount_idmapped(path, self.userns_fd)
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    @property
    def clone_fds(self) -> tuple[int, ...]:
        """The detached idmapped clones (none without an id map: its fds name the layers' own mounts)."""
        if self.idmap is None:
            return ()
        return tuple(fd for fd in self.fds if fd != self.userns_fd)

    def __exit__(self, *exc) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _same_file(a: str, b: str) -> bool:
    """Whether two paths are one file (a /proc/PID/exe: the binary the
    process runs, even if replaced on disk since; then not the file now there)."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _own_userns(pid: int) -> bool:
    """True if the process is in another user namespace than the daemon (a
    sandbox made with userns = true; also right for one adopted after a restart)."""
    return os.stat(f"/proc/{pid}/ns/user").st_ino != os.stat("/proc/self/ns/user").st_ino


def close_handle(h: Handle) -> None:
    if h.init_link is not None:
        h.init_link.close(None)       # from any thread; the sandbox is going or the daemon stops
    for name in ("rootfd", "pidfd", "upperfd"):
        _close_fd(h, name)


def _close_fd(h: Handle, name: str) -> None:
    # -1 before the close: once closed, the number may be reused (by another
    # sandbox's parked fd), and a reader must not find it here then.
    fd = getattr(h, name)
    setattr(h, name, -1)
    fds.close_quietly(fd)


def _pidns(pid: int) -> int | None:
    """The inode of the pid namespace of process `pid` (None: gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _wait_exit(h: Handle, timeout: float, pidns: int | None = None) -> None:
    """Wait for a killed init to exit, then reap it if it is our child.

    An init only finishes exiting once every other process of its pid
    namespace has been reaped; execs are reaped elsewhere (by the event loop
    for the helper's, by init for its own), so this must never block the
    loop, and never forever. What a helper's exec cloned with CLONE_PARENT
    is our child too, and nobody else's to reap: those of namespace `pidns`
    are reaped here while init waits for them (execio.reap_strays).
    """
    import select
    import time

    poller = select.poll()
    poller.register(h.pidfd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while not poller.poll(50):
        if pidns is not None:
            execio.reap_strays(pidns)
        if time.monotonic() > deadline:
            log.error("sandbox init %d did not exit %.0fs after SIGKILL", h.init_pid, timeout)
            return
    if h.is_child:
        try:
            os.waitpid(h.init_pid, 0)
        except ChildProcessError:
            pass


@dataclass(frozen=True)
class _ProcIds:
    ppid: int
    session: int
    start: int
    nspid: tuple[int, ...]      # its pid in each pid namespace, the host's first


def _proc_ids(pid: int) -> _ProcIds | None:
    """Parent, session, start time and namespaced pids of host pid `pid`; None if it is gone."""
    stat_data = sysfs.read_small(f"/proc/{pid}/stat")
    status = sysfs.read_small(f"/proc/{pid}/status")
    if stat_data is None or status is None:
        return None
    # After the comm field (which may hold spaces and parentheses): state,
    # ppid, pgrp, session, ... starttime is the 20th.
    fields = stat_data[stat_data.rindex(b")") + 2:].split()
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith(b"NSpid:")), [])
    return _ProcIds(int(fields[1]), int(fields[3]), int(fields[19]), tuple(int(n) for n in nspid))


def _kill_group_of(pid: int, start: int) -> bool:
    """SIGKILL the process group `pid` leads, if `pid` is still the process
    that started at `start` (the start time read after pidfd_open says the
    pidfd names that very process, and a signal through it reaches no
    other); whether it was."""
    try:
        pidfd = native.pidfd_open(pid)
    except OSError:
        return False
    try:
        if proc_start_time(pid) != start:
            return False
        try:
            native.pidfd_kill_group(pidfd, signal.SIGKILL)
        except OSError as err:
            if err.errno == errno.ESRCH:
                return False
            execio.kill_group(pid)        # a kernel before 6.9: no group signal through a pidfd
        return True
    finally:
        os.close(pidfd)


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def cap_set(pid: int | str, name: str) -> int | None:
    """A capability set of a process ("CapEff", "CapPrm", ...) from its
    status file; None if it is gone."""
    data = sysfs.read_small(f"/proc/{pid}/status") or b""
    prefix = name.encode() + b":"
    for line in data.splitlines():
        if line.startswith(prefix):
            return int(line.split()[1], 16)
    return None


def has_effective_cap(cap: int) -> bool:
    return bool((cap_set("self", "CapEff") or 0) & (1 << cap))


# Lowering oom_score_adj needs CAP_SYS_RESOURCE, which some hosts (and this
# project's CI machines) withhold even from root; then init keeps the default
# score, and with its tiny RSS the OOM killer still picks the workload first.
_CAN_LOWER_OOM_SCORE = has_effective_cap(CAP_NUMBERS["SYS_RESOURCE"])
if not _CAN_LOWER_OOM_SCORE:
    log.info("no CAP_SYS_RESOURCE: sandbox inits keep oom_score_adj 0")


def _own_oom_score_adj() -> int:
    data = sysfs.read_small("/proc/self/oom_score_adj")
    return int(data) if data else 0


# Sandbox processes start from the daemon's oom_score_adj and its floor. A
# negative one (systemd runs the daemon at -900) is the daemon's protection,
# not theirs: the spawn children set it back to 0 (csrc/exec_steps.h). A
# positive one (a container runtime's) is left: lowering it needs the cap.
_DAEMON_OOM_SCORE = _own_oom_score_adj()
_OOM_RESET = _DAEMON_OOM_SCORE < 0
if _OOM_RESET and not _CAN_LOWER_OOM_SCORE:
    log.warning("oom_score_adj of dsecd is %d but it lacks CAP_SYS_RESOURCE: sandbox processes start at 0 "
                "but keep dsecd's floor, and may lower their score down to it", _DAEMON_OOM_SCORE)


def _protect_init_from_oom(pid: int) -> None:
    """The memory limit's OOM killer should pick the workload, not PID 1 (which
    would end the whole sandbox).

    Through the legacy oom_adj (-17 is oom_score_adj -1000): a write to
    oom_score_adj by a holder of CAP_SYS_RESOURCE also sets the floor
    (oom_score_adj_min) to -1000, which every process init forks would
    inherit and could lower itself back to after resetting its score
    (csrc/exec_steps.h oom_score_reset), escaping the OOM killer."""
    if not _CAN_LOWER_OOM_SCORE:
        return
    try:
        sysfs.write(f"/proc/{pid}/oom_adj", "-17")
    except OSError as err:
        log.warning("set oom_adj of sandbox init %d: %s", pid, err.strerror)

