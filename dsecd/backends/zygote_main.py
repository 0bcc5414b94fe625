"""The FnCall zygote: runs INSIDE a call sandbox, under the image's own python3.

dsecd/backends/fncall.py reads this file and passes its text as `python3 -I
-c TEXT CONFIG-JSON`, so it must work with nothing but the stdlib of whatever
Python the image has (3.8+). The daemon imports kill_leftovers and
remove_owned from it, to clear what a plain call left behind the same way,
and cannot_run, to answer as it does for a program that cannot run.

Fd 0 is one end of a SOCK_SEQPACKET socketpair made by the daemon and handed
over as the exec's stdin: there is no path in the sandbox that reaches it.
Messages are JSON, one per packet.

    daemon -> zygote  {"op": "call", "id": N, "argv": [...], "env": {...},
                       "code": bool, "src": "..." (with code), "cpu_s": S}
                      + SCM_RIGHTS [stdin, stdout, stderr]
                      (a request that would not fit in a small packet is
                      {"op": "call", "id": N, "in_memfd": true}, the whole
                      request as above in a memfd passed as a fourth fd)
                      {"op": "kill", "id": N}
                      {"op": "mqueue"} + SCM_RIGHTS [dir] (first, if at all:
                      the call sandbox's message queues, to clean up)
    zygote -> daemon  {"op": "ready", "pid": P, "modules": [...], "failed": {...},
                       "own_ipc": bool, "own_net": bool}
                      {"op": "exit", "id": N, "status": wait-status, "run_ms": F}
                      {"op": "error", "id": N, "errno": E, "message": "..."}

The zygote imports the configured modules once, then keeps `spares` workers
forked ahead of need, each already in its own process group, in its own fresh dir
under /tmp (cwd, HOME, TMPDIR; made by the worker before it drops root,
removed by the zygote when it exits), under its own uid
(one per live worker, from [uid_base, uid_base + uid_count): calls cannot
signal, trace or read one another), with the rlimits set, and with
"own_ipc" in the config in an IPC namespace of its own (SysV IPC and POSIX
message queues: no call finds, or squats, a key or queue name another call
made or expects), with "own_net" in a net namespace of its own, its
loopback up (no call reaches, or takes, a port or abstract unix socket of
another); the ready message says which it could.
A call goes to an idle worker over that worker's own socketpair, so the
fork is off the call's path; the worker runs the code (or execs argv),
reports its status and exits.
A worker serves exactly one call. The zygote never runs caller code, so no
call can leave state for the next one.
"""

import array
import atexit
import errno
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import tempfile
import time
import types

IDLE_MS = 20
RECHECK_MS = 10        # how soon a uid held back for what its call left behind is looked at again
# A uid whose call's leftovers could not all be removed (remove_owned says
# why: mostly another call's doing) is tried again this often, this many
# times, before it is given up for good.
CLEANUP_RETRY_MS = 1000
CLEANUP_TRIES = 60
FORK_RETRY_MS = 100    # how soon a spare that could not be forked is tried again
REAPER_WAIT_S = 0.5    # how long the reaper may take to answer before it is replaced
WORKER_NICE = 19       # a worker's weight is 1/68 of the zygote's (nice 0)
RLIMITS = {"as": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE,
           "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE, "nproc": resource.RLIMIT_NPROC}


def recv(sock):
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(8 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def send(sock, msg, fds=()):
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([json.dumps(msg).encode()], anc)


def only_fd_3(sock):
    """In a child of the zygote: `sock` as fd 3, every fd above it closed
    (no other worker's link or pidfd: a spare sees the zygote's end of its
    link as EOF only when no other process holds it)."""
    fd = sock.detach()
    if fd != 3:
        os.dup2(fd, 3)
    os.closerange(4, 1 << 16)
    return socket.socket(fileno=3)


def worker(link, tmp, uid, rlimits, isolation=None):
    """A pre-forked worker: set up what does not depend on the call, wait for
    it, run it, report, exit. Never returns. isolation: (unshare_fn's
    function, CLONE_NEW* flags), the namespaces of its own it runs in (None:
    the call sandbox's)."""
    status = 127
    try:
        # The zygote's SIGCHLD wakeup (without pidfds) is not the call's.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # Its own process group (a kill reaches all it forked), not its own
        # session: setsid also makes a scheduler autogroup per worker, work
        # with no use inside the call sandbox's cpu cgroup.
        os.setpgid(0, 0)
        # Made here, not in the zygote: the zygote's loop is the one serial
        # part of every call, this process runs beside it.
        os.mkdir(tmp, 0o700)
        os.chown(tmp, uid, uid)
        link = only_fd_3(link)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.chdir(tmp)
        for name, value in rlimits.items():
            resource.setrlimit(RLIMITS[name], (value, value))
        # Below the zygote, which shares the call sandbox's CPU with every
        # call: busy calls would otherwise leave it too little to fork
        # workers and relay kills in time. Nice only weighs tasks within the
        # cgroup, whose share of the host stays; calls keep equal weights.
        os.nice(WORKER_NICE)
        # Its own SysV IPC and message queues (and network), made while it
        # still holds the zygote's CAP_SYS_ADMIN (the uid change drops it):
        # gone with the call's last process, out of every other call's reach
        # meanwhile.
        if isolation is not None:
            isolate(*isolation)
        # Its own uid: no other call can signal, trace or read it, or its dir.
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        msg, fds = recv(link)
        if not msg:
            os._exit(0)
        req = json.loads(msg)
        for i in range(3):
            os.dup2(fds[i], i)
        if req.get("in_memfd"):
            with os.fdopen(fds[3], "rb") as f:
                req = json.loads(f.read())
        src = req.get("src")
        for fd in fds:
            if fd > 3:
                try:
                    os.close(fd)
                except OSError:
                    pass
        cpu = req.get("cpu_s")
        if cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        env = dict(req["env"], TMPDIR=tmp, HOME=tmp)
        if src is None:
            link.close()
            prog = req["argv"][0]
            try:
                os.execvpe(prog, req["argv"], env)
            except OSError as e:
                status, message = cannot_run(prog, e.errno, env.get("PATH", os.defpath))
                os.write(2, os.fsencode(message))     # prog may hold a file name's bytes
                os._exit(status)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(req["argv"]) or ["-c"]
        # sys.path as `python3 -c` starts with it (the zygote runs -I, which
        # leaves out both): the cwd first, then PYTHONPATH's dirs.
        sys.path[0:0] = ["", *(d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d)]
        tempfile.tempdir = None
        gc.enable()
        try:
            # A __main__ of its own, as `python3 -c` runs in: what the call
            # defines pickles by reference, and the zygote's module stays out
            # of its sight (this function keeps that module's globals alive).
            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(src, "<call>", "exec"), main.__dict__)
            status = 0
        except BaseException as e:
            status = ended_by(e)
        status = at_exit(status)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                pass
        # Report before the (slower) exit: the output pipes close with it.
        for fd in (1, 2):
            try:
                os.close(fd)
            except OSError:         # the call closed it itself
                pass
        try:
            link.send(json.dumps({"done": status & 0xFF}).encode())
        except OSError:
            pass
        # The send woke the zygote on this CPU (a sync wake-up): let it relay
        # the report before this process tears its address space down, which
        # takes longer than the relay (docs/burst.md, 'One call through the
        # zygote').
        os.sched_yield()
    except BaseException as e:   # setup failed: say why on the call's stderr
        try:
            os.write(2, f"fncall: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    os._exit(status & 0xFF)


CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def unshare_fn():
    """unshare(flags) (os.unshare, Python 3.12+; else libc's, through
    ctypes), or None where this Python has neither."""
    if hasattr(os, "unshare"):
        return os.unshare
    try:
        import ctypes
        fn = ctypes.CDLL(None, use_errno=True).unshare
    except (ImportError, OSError, AttributeError):
        return None

    def unshare(flags):
        if fn(flags) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare: {os.strerror(err)}")
    return unshare


def isolate(unshare, flags):
    """Move this process into new namespaces of `flags` (CLONE_NEWIPC,
    CLONE_NEWNET); a new net namespace gets its loopback up, as a
    sandbox's has (servers of a call listen on localhost)."""
    unshare(flags)
    if flags & CLONE_NEWNET:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifr = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16s16x", b"lo"))
            up = struct.unpack_from("H", ifr, 16)[0] | IFF_UP
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", up))


def isolation_works(isolation):
    """Whether a child of this process can isolate() itself so (the
    zygote's capabilities and seccomp filter allow it), tried once."""
    pid = os.fork()
    if pid == 0:
        try:
            isolate(*isolation)
            os._exit(0)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return status == 0


def cannot_run(prog, err, path):
    """(exit status, stderr line) of a call whose command could not be
    exec'ed with errno `err`, searched in `path`, as sh says it: 127 and
    "not found" when no PATH dir has it, else 126 and the reason. The
    daemon's plain calls end the same way (engine/calls.py)."""
    if err == errno.ENOENT:
        where = "" if "/" in prog else f" (PATH {path})"
        return 127, f"fncall: {prog}: not found{where}\n"
    return 126, f"fncall: {prog}: {os.strerror(err)}\n"


def ended_by(e):
    """The exit status of a call its exception ended, said as the
    interpreter says it: a SystemExit's code (its text on stderr), else
    sys.excepthook's traceback, from the call's own code on (not this
    file's frame), and 1."""
    if isinstance(e, SystemExit):
        code = e.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    tb = e.__traceback__.tb_next if e.__traceback__ else None     # a SyntaxError has no frame of the call
    e.with_traceback(tb)         # the default hook prints the exception's own, not its argument
    try:
        sys.excepthook(type(e), e, tb)
    except BaseException:
        sys.__excepthook__(type(e), e, tb)
    return 1


def at_exit(status):
    """What the interpreter does once `python3 -c` ran its code: wait for
    the call's non-daemon threads, then run its atexit functions (their
    errors are printed, not raised). A SystemExit meanwhile sets the status."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException as e:
            status = ended_by(e)
    atexit._run_exitfuncs()
    return status


def init_children(init_pid=1, fd=-1):
    """The pids of the children of the sandbox's init (`init_pid` as this
    process sees it: 1 inside the sandbox); through `fd`, that file kept
    open (read again from its start: no open and close per call)."""
    try:
        if fd < 0:
            with open(f"/proc/{init_pid}/task/{init_pid}/children", "rb") as f:
                return f.read().split()
        return read_from_start(fd).split()
    except OSError:
        return []


def in_host_user_namespace():
    """Whether this process sees the host's ids (a call sandbox made without
    a user namespace, or a Zygote object made outside one): kill(-1) as a
    call's uid would then reach the host's processes of that uid."""
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


def reaper(sock):
    """The zygote's child that kills, when asked over `sock`, every process
    of a uid (never returns). As that uid (its real and effective uid; its
    saved uid stays 0, to come back), kill(-1, SIGKILL) reaches every
    process of the uid in the call sandbox at once but this one and init,
    whatever its process group, session or parent, and the kernel fails a
    fork whose parent has the signal pending: nothing of the uid outruns it,
    where a walk of init's children can miss a process forked after it
    looked. Not done by the zygote itself: for that instant a process of the
    uid may signal the process doing it (its real uid is theirs); it can
    stop or kill this one (the zygote then gives up on the uid for a while),
    never the zygote. Every signal it can block is blocked, and nothing of
    the zygote's code runs here (any error ends it). Answers b"1" when the
    kill was made."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while True:
            msg = sock.recv(32)
            if not msg:
                break
            done = b"0"
            try:
                os.setresuid(int(msg), int(msg), 0)
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:          # nothing of the uid runs
                    pass
                done = b"1"
            except (OSError, ValueError):
                pass
            os.setresuid(0, 0, 0)
            sock.send(done)
    finally:
        os._exit(0)


def kill_leftovers(uid, init_pid=1, fd=-1, skip=()):
    """SIGKILL the processes running as `uid` that were left to the sandbox's
    init: a call's process has ended, so anything of its uid that outlived
    it (a child that left its process group or session) was reparented
    there. Returns how many it found: their own children reach init only
    once they are gone, so the caller looks again before the uid is used
    again. init_pid, fd: as init_children's; skip: pids not to look at."""
    pids = init_children(init_pid, fd)
    found = 0
    for pid in pids:
        if int(pid) in skip:
            continue
        pidfd = _pidfd(int(pid))            # held across the check and the kill: the pid cannot be another's
        try:
            with open(f"/proc/{int(pid)}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:", "Threads:")))
        except (OSError, ValueError):
            _close(pidfd)
            continue
        if str(uid) in fields.get("Uid", "").split():
            _kill(int(pid), pidfd)
            # A zombie with one thread is dead, waiting for init to reap it.
            # One with more is a main thread that exited while the others run.
            zombie = fields.get("State", "").split()[:1] == ["Z"]
            if not zombie or int((fields.get("Threads") or "1").split()[0]) > 1:
                found += 1
        _close(pidfd)
    return found


# Directories the cleanup walk holds open at once: the depth it looks into
# another uid's tree, and the depth at which it moves part of a tree it
# removes up to the top to go on there. A call can make a tree of any
# depth; recursion or an fd per level would fail on it (RecursionError,
# EMFILE).
MAX_OPEN_DIRS = 64
# Parts of a deep tree one cleanup moves up and removes (~64 levels each):
# past it the cleanup stops, unfinished, to be tried again later. A call
# still running can deepen a tree as fast as it is removed (mkdir d; cd d
# in a directory another call left writable): the zygote's one loop must
# not go on with it for ever.
MAX_MOVED = 256
# A freed uid's call dir that was not empty is moved into TRASH (a root-only
# dir of the zygote's /tmp no call can enter), and removed from there at most
# SWEEP_STEPS entries per turn of the zygote's loop (Zygote.sweep): a call
# that left a million files would otherwise stop the loop, and every call it
# serves and every kill it relays, for seconds.
TRASH = ".dsec-trash"
SWEEP_STEPS = 256
LIST_STEPS = 64         # entries of a directory listed per step of a sweep (about an unlink's time)


def remove_owned(top, uid):
    """Remove what `uid` owns in the directory open at `top` (the call
    sandbox's /dev/shm or message queues): what a call made there (POSIX
    shared memory, named semaphores) must not reach the next call its uid
    goes to. An entry it owns goes whole; a directory of another uid is
    looked through (a call may put files in one another call left
    writable), to MAX_OPEN_DIRS levels. Nothing is followed: a symlink
    goes, not its target. Fd-relative throughout, with nothing newer than
    Python 3.8 (the image's own python3 runs this).

    False when the uid may still own something here: an entry that could
    not be removed, a directory of another uid deeper than the walk looks,
    a tree past MAX_MOVED parts, or an entry swapped for another's meanwhile.
    The caller holds the uid back and tries again later (such a state is
    another call's doing, and ends with that call)."""
    moved = []              # parts of deep trees moved up to `top`, removed in turn
    ok = True
    # An open file description of its own (not os.dup's, which shares the
    # read offset): the daemon walks one box's directory for several uids at
    # once, and a listing from another's offset would see nothing.
    try:
        mine = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=top)
    except OSError:
        return False
    stack = [(mine, None)]        # (directory fd, its entries still to look at)
    try:
        while stack:
            fd, todo = stack[-1]
            if todo is None:
                todo = _entries(fd, uid)
                if todo is None:
                    return False
                stack[-1] = (fd, todo)
            if not todo:
                os.close(stack.pop()[0])
                continue
            name, owned, is_dir = todo.pop()
            if owned:
                ok = _remove_tree(fd, name, is_dir, top, moved, uid) and ok
            elif is_dir and len(stack) < MAX_OPEN_DIRS:
                sub = _open_dir(fd, name)
                if sub >= 0:
                    stack.append((sub, None))
            elif is_dir:
                ok = False          # not looked into: the uid may own something below
        return _remove_moved(top, moved) and ok
    finally:
        for fd, _ in stack:
            os.close(fd)


def remove_tree(dirfd, name):
    """Remove `name` in the directory open at `dirfd`, whole, at any depth
    (past MAX_OPEN_DIRS levels parts of it are moved up into `dirfd` and
    removed in turn, up to MAX_MOVED of them), nothing followed. True when
    all of it is gone: shutil.rmtree recurses (before Python 3.12) and
    stops at ~1,000 levels."""
    return _to_the_end(remove_tree_steps(dirfd, name))


def remove_tree_steps(dirfd, name, moved=None):
    """remove_tree one step at a time: a generator that yields after each
    entry it removes or directory it opens, and returns remove_tree's
    answer (the zygote's sweep spreads a large tree over its loop's turns).
    `moved`: the names of parts of it moved up into `dirfd` by an earlier
    try, removed too; those this try leaves are in it at the end."""
    moved = [] if moved is None else moved
    ok = True
    try:
        is_dir = stat.S_ISDIR(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        is_dir = None
    except OSError:
        return False
    if is_dir is not None:
        ok = yield from _remove_tree_steps(dirfd, name, is_dir, dirfd, moved)
    done = yield from _remove_moved_steps(dirfd, moved)
    return done and ok


def _to_the_end(steps):
    """Run a generator of steps to its end; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def _remove_moved(top, moved):
    return _to_the_end(_remove_moved_steps(top, moved))


def _remove_moved_steps(top, moved):
    """Remove the parts _remove_tree moved up into `top` (and those their
    removal moves), at most MAX_MOVED in all; False if some stay, their
    names left in `moved`."""
    ok, done, failed = True, 0, []
    while moved:
        if done >= MAX_MOVED:
            ok = False
            break
        part = moved.pop()
        if not (yield from _remove_tree_steps(top, part, True, top, moved)):
            failed.append(part)
            ok = False
        done += 1
    moved.extend(failed)
    return ok


def _entries(fd, uid=None):
    """[(name, owned by uid, a directory)] of the directory open at fd; None
    if unreadable. Without `uid`, owned is False (no stat per entry)."""
    try:
        with os.scandir(fd) as entries:
            return [(e.name, uid is not None and _owner(e) == uid, e.is_dir(follow_symlinks=False))
                    for e in entries]
    except OSError:
        return None


def _entries_steps(fd):
    """_entries(fd) (no owner), a step per LIST_STEPS entries listed: a flat
    dir of a million entries is one listing of seconds."""
    out = []
    try:
        with os.scandir(fd) as entries:
            for e in entries:
                out.append((e.name, False, e.is_dir(follow_symlinks=False)))
                if len(out) % LIST_STEPS == 0:
                    yield
    except OSError:
        return None
    return out


def _remove_tree(parent, name, is_dir, top, moved, owner=None):
    """Remove `name` in `parent`, a directory with all it holds, whoever
    owns what is inside. Past MAX_OPEN_DIRS levels a directory is renamed
    into `top` and its name added to `moved`, for the caller to remove
    next. With `owner`, a directory opened under `name` that is not that
    uid's (another call renamed one in its place since it was listed) is
    left alone. False when something could not be removed."""
    return _to_the_end(_remove_tree_steps(parent, name, is_dir, top, moved, owner))


def _remove_tree_steps(parent, name, is_dir, top, moved, owner=None):
    """_remove_tree a step at a time (remove_tree_steps)."""
    if not is_dir:
        return _unlink(parent, name, False)
    first = _open_dir(parent, name)
    if first >= 0 and owner is not None and os.fstat(first).st_uid != owner:
        os.close(first)
        return False
    ok = True
    stack = [(parent, name, first, None)]    # (parent fd, name, fd, entries left)
    try:
        while stack:
            pfd, dname, fd, todo = stack[-1]
            yield
            if fd < 0:
                stack.pop()
                ok = _unlink(pfd, dname, True) and ok
                continue
            if todo is None:
                todo = yield from _entries_steps(fd)
                if todo is None:
                    todo, ok = [], False
                stack[-1] = (pfd, dname, fd, todo)
            if not todo:
                stack.pop()
                os.close(fd)
                ok = _unlink(pfd, dname, True) and ok
                continue
            sub, _, sub_is_dir = todo.pop()
            if not sub_is_dir:
                ok = _unlink(fd, sub, False) and ok
            elif len(stack) < MAX_OPEN_DIRS:
                stack.append((fd, sub, _open_dir(fd, sub), None))
            else:
                up = f".dsec-rm-{os.getpid()}-{len(moved)}-{time.monotonic_ns()}"
                try:
                    os.rename(sub, up, src_dir_fd=fd, dst_dir_fd=top)
                    moved.append(up)
                except OSError:
                    ok = False
        return ok
    finally:
        for _, _, fd, _ in stack:
            if fd >= 0:
                os.close(fd)


def _unlink(dirfd, name, is_dir):
    """Remove one entry; True when it is gone."""
    try:
        if is_dir:
            os.rmdir(name, dir_fd=dirfd)
        else:
            os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


SYSV_IPC = ("shm", "sem", "msg")
SHM_DEST = 0o1000       # a removed segment some process still has attached


def ipc_owned(uid, fds=None):
    """(kind, id) of the SysV IPC objects of the sandbox's IPC namespace that
    `uid` owns or created ("shm", "sem", "msg"; /proc/sysvipc shows the ids
    as the reader's user namespace sees them). A removed segment still
    attached elsewhere is left out: it goes at its last detach and no new
    process can find it by its key. `fds`: kind -> /proc/sysvipc/KIND kept
    open, read again from its start (the zygote reads them after every
    call: an open and close each took most of the time)."""
    found = []
    for kind in SYSV_IPC:
        try:
            fd = fds.get(kind, -1) if fds else -1
            if fd >= 0:
                text = read_from_start(fd)
            else:
                with open(f"/proc/sysvipc/{kind}", "rb") as f:
                    text = f.read()
        except OSError:
            continue
        lines = text.split(b"\n")
        if len(lines) < 3:          # the header alone (and the last newline): none of this kind
            continue
        head = lines[0].split()
        uid_at, cuid_at, perms_at = head.index(b"uid"), head.index(b"cuid"), head.index(b"perms")
        mine = str(uid).encode()
        for row in (line.split() for line in lines[1:] if line):
            if mine in (row[uid_at], row[cuid_at]) and not int(row[perms_at], 8) & SHM_DEST:
                found.append((kind, int(row[1])))
    return found


def read_from_start(fd):
    """All of a /proc file kept open, read again from its start. Up to an
    empty read: a seq_file answers a read with at most what fits its own
    buffer (about a page), whatever was asked for, so a short read is not
    the end (a call's objects past the first page would go unseen)."""
    data = b""
    while True:
        chunk = os.pread(fd, 65536, len(data))
        if not chunk:
            return data
        data += chunk


def remove_ipc(uid, drop=True, fds=None):
    """Remove the SysV IPC objects `uid` owns or created: they outlive the
    call that made them, and a later call could read or write them (a later
    call of that uid would own them). IPC_RMID takes the owner's or the
    creator's euid, or CAP_SYS_ADMIN over the namespace, which the zygote
    lacks: with `drop` a child drops to `uid` to do it; without, the caller
    (the daemon, in the namespace) does. True when none is left. `fds`:
    as ipc_owned's."""
    objs = ipc_owned(uid, fds)
    if not objs:
        return True
    if not drop:
        _rmid(objs)
        return not ipc_owned(uid, fds)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            _rmid(objs)
            code = 0
        finally:
            os._exit(code)
    os.waitpid(pid, 0)
    return not ipc_owned(uid, fds)


def _rmid(objs):
    # Imported here: only a call that left something pays for it.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for kind, ident in objs:
        if kind == "sem":
            libc.semctl(ident, 0, 0)                    # IPC_RMID
        else:
            getattr(libc, kind + "ctl")(ident, 0, None)


def _open_dir(dirfd, name):
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return -1


def _owner(entry):
    try:
        return entry.stat(follow_symlinks=False).st_uid
    except OSError:
        return None


def _pidfd(pid):
    try:
        return os.pidfd_open(pid)           # Python 3.9+
    except (AttributeError, OSError):
        return -1


def _kill(pid, pidfd):
    try:
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _close(fd):
    if fd >= 0:
        os.close(fd)


class Zygote:
    def __init__(self, sock, base, spares, uid_base, uid_count, rlimits, isolation=None):
        self.sock = sock
        # The namespaces of its own each worker runs in (worker()). With an
        # IPC namespace nothing of a call is in the call sandbox's, to clean
        # up after it.
        self.isolation = isolation
        self.own_ipc = isolation is not None and bool(isolation[1] & CLONE_NEWIPC)
        self.base = base
        self.spares = spares
        self.uids = list(range(uid_base + uid_count - 1, uid_base - 1, -1))   # free uids, lowest last
        self.rlimits = rlimits
        self.poll = select.poll()
        self.poll.register(sock.fileno(), select.POLLIN)
        self.idle = []          # workers waiting for a call
        self.by_fd = {}         # pidfd or link fd -> worker
        self.by_id = {}         # call id -> worker
        self.held = []          # uids whose calls left processes behind, until those are gone
        self.lost = set()       # uids whose calls left what could not be removed: never handed out again
        self.unclean = {}       # uid -> (when to try its cleanup again, tries so far)
        self.dirs = {}          # uid -> its call's dir (in `base`) that was not empty, to remove
        self.trash_fd = -1      # TRASH in `base`, made when first needed
        self.trashed = 0        # dirs moved there so far (their names there)
        # What is in TRASH to remove: [remove_tree_steps, its name there,
        # tries so far, not before (monotonic), parts of it moved up into
        # TRASH], oldest first.
        self.sweeping = []
        self.busy_at = time.monotonic()     # when the loop last had an event
        self.fork_again_at = 0.0            # no spare forked before (after one failed)
        self.recheck_at = 0.0               # held uids looked at again from then on
        self.forked = 0
        self.fork_failed = False    # the last spare could not be forked
        # Kept open: read after every call (kill_leftovers). Workers close it.
        self.children_fd = os.open("/proc/1/task/1/children", os.O_RDONLY | os.O_CLOEXEC)
        me = os.getpid()
        self.me = {me}
        self.own_children_fd = os.open(f"/proc/{me}/task/{me}/children", os.O_RDONLY | os.O_CLOEXEC)
        # Kept open: looked through whenever a uid is freed (free_uid).
        try:
            self.shm_fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            self.shm_fd = -1
        self.mq_fd = -1         # the daemon's first message says where message queues are
        # Kept open: read whenever a uid is freed (ipc_owned).
        self.ipc_fds = {}
        for kind in SYSV_IPC:
            try:
                self.ipc_fds[kind] = os.open(f"/proc/sysvipc/{kind}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass
        # A worker's end is seen on its pidfd. Without one (Python 3.8 has
        # no os.pidfd_open, kernels before 5.3 no pidfd_open; or the open
        # failed), on SIGCHLD: its handler's wakeup fd is polled like a pidfd.
        self.unwatched = {}     # pid -> worker without a pidfd
        self.sigchld_fd = -1
        self.reaper = None      # (pid, socket) of the reaper (kill_uid), forked when first needed
        # Without a user namespace of its own the call sandbox's uids are the
        # host's: no kill by uid there (kill_uid), only the walk.
        self.kill_by_uid = not in_host_user_namespace()

    def _wake_on_sigchld(self):
        """The read end of a pipe that SIGCHLD writes a byte to, in the poll.
        A byte is written now too: a worker that ended before the handler
        was there (its SIGCHLD ignored) is looked for once all the same."""
        r, w = os.pipe()
        for fd in (r, w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(w)
        self.poll.register(r, select.POLLIN)
        os.write(w, b"\0")
        return r

    def fork_worker(self):
        """A new worker (OSError when none can be forked)."""
        return self.fork_workers(1)[0]

    def fork_workers(self, n):
        """Up to `n` new workers, forked back to back (at least one, else
        OSError). Spares do not walk a call's path ahead of it: that took
        more CPU from the call running beside it (two cores) than it saved
        the next one (docs/burst.md, 'One call through the zygote').

        Every fork write-protects this process's memory again, and each
        page it writes after one is then copied: between forks only the
        fork itself runs, and what lists the workers runs once after the
        last (docs/burst.md, "Spares forked in a batch")."""
        made = []
        error = None
        for _ in range(min(n, len(self.uids))):
            try:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            except OSError as e:
                # Out of fds or memory: the batch is the workers paired so
                # far, and this one's uid is not taken.
                error = e
                break
            uid = self.uids.pop()
            self.forked += 1
            tmp = f"{self.base}/w{uid}-{self.forked}"    # unique: the counter never repeats
            made.append([uid, tmp, ours, theirs, 0])
        if not made:
            raise error or OSError(11, "every fncall uid is in use")
        fork = os.fork
        for m in made:
            try:
                m[4] = fork()
            except OSError as e:
                # No pid (a call holds the sandbox's pids limit) or memory.
                error = e
                break
            if m[4] == 0:
                self.sock.close()
                for other in made:
                    other[2].close()
                    if other is not m:
                        other[3].close()
                worker(m[3], m[1], m[0], self.rlimits, self.isolation)
        workers = []
        for uid, tmp, ours, theirs, pid in made:
            if not pid:             # never forked: its uid was never used
                self.uids.append(uid)
                ours.close()
                theirs.close()
                continue
            workers.append(self._listed(uid, tmp, ours, theirs, pid))
        if not workers:
            raise error
        return workers

    def _listed(self, uid, tmp, ours, theirs, pid):
        """The zygote's record of a worker just forked, watched for its end."""
        # The worker makes its process group too, but maybe only after a kill
        # of its call (killpg on a group not made yet: ESRCH, the kill lost).
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        theirs.close()
        w = {"pid": pid, "pidfd": _pidfd(pid), "link": ours, "uid": uid, "tmp": tmp,
             "id": None, "started": 0.0, "reported": False}
        if w["pidfd"] >= 0:
            self.by_fd[w["pidfd"]] = w
            self.poll.register(w["pidfd"], select.POLLIN)
        else:
            # Seen on SIGCHLD (its wakeup installed now, for the first worker
            # without a pidfd); one that ended already left its byte in the
            # wakeup pipe, which the loop reads once this worker is listed.
            if self.sigchld_fd < 0:
                self.sigchld_fd = self._wake_on_sigchld()
            self.unwatched[pid] = w
        self.by_fd[ours.fileno()] = w
        self.poll.register(ours.fileno(), select.POLLIN)
        return w

    def on_sigchld(self):
        """Without pidfds: the workers that ended, each looked at with
        waitid(WNOWAIT), which leaves its zombie for worker_gone to reap."""
        try:
            while os.read(self.sigchld_fd, 512):
                pass
        except OSError:
            pass
        for w in list(self.unwatched.values()):
            try:
                ended = os.waitid(os.P_PID, w["pid"], os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                ended = True
            if ended is not None:
                self.worker_gone(w)

    def report(self, w, status):
        if w["id"] is not None and not w["reported"]:
            w["reported"] = True
            self.by_id.pop(w["id"], None)
            send(self.sock, {"op": "exit", "id": w["id"], "status": status,
                             "run_ms": (time.monotonic() - w["started"]) * 1000})

    def on_worker(self, fd, w):
        if fd == w["link"].fileno():
            try:
                msg = w["link"].recv(256)
            except OSError:
                msg = b""
            self.poll.unregister(fd)
            # The call's own code holds this link (a code call runs in the
            # worker): what comes on it may be anything. Garbage is ignored
            # (the worker's wait status is reported when it is reaped); a
            # report ends the call there, so the group is killed with it,
            # or a call that reported early would run on past its timeout.
            try:
                status = (int(json.loads(msg)["done"]) & 0xFF) << 8
            except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError):
                return
            self.report(w, status)
            self.kill_worker(w)
            return
        self.worker_gone(w)         # its pidfd: the worker ended

    @staticmethod
    def kill_worker(w):
        """SIGKILL a worker's process group, and the worker itself: a call
        may move it into another group (setpgid to the zygote's), out of
        the group's kill. Its pid is ours until it is reaped (worker_gone,
        which kills what else of its uid runs)."""
        for kill, target in ((os.killpg, w["pid"]), (os.kill, w["pid"])):
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass

    def worker_gone(self, w):
        """A worker ended (its zombie not reaped yet): reap it, free its uid and dir."""
        self.unwatched.pop(w["pid"], None)
        # What the call started in its process group dies with it; killed
        # before the reap, while the worker's zombie keeps its pid (the group's id).
        try:
            os.killpg(w["pid"], signal.SIGKILL)
        except OSError:
            pass
        try:
            _, status = os.waitpid(w["pid"], 0)
        except ChildProcessError:
            status = signal.SIGKILL         # reaped by someone else: its status is lost
        self.report(w, status)
        for f in (w["pidfd"], w["link"].fileno()):
            self.by_fd.pop(f, None)
            try:
                self.poll.unregister(f)
            except (KeyError, ValueError):
                pass
        _close(w["pidfd"])
        w["link"].close()
        if w in self.idle:
            self.idle.remove(w)
        try:
            os.rmdir(w["tmp"])          # the usual case: the call left nothing
        except FileNotFoundError:
            pass
        except OSError:
            # Removed with the rest of what the call left (free_uid), once
            # what it left running is killed: one could write on meanwhile.
            self.dirs[w["uid"]] = os.path.basename(w["tmp"])
        # What the call left running outside its group must not meet the next
        # call its uid goes to (it could signal, trace or read it): killed
        # as the uid (kill_uid), then looked for among init's and this
        # zygote's children, which reaps those of them that are ours.
        if not self.kill_uid(w["uid"]) or self.kill_leftovers(w["uid"]):
            self.held.append(w["uid"])
        else:
            self.free_uid(w["uid"])

    def kill_uid(self, uid):
        """Every process of `uid` killed by the reaper (reaper()); False if
        that could not be done: the reaper could not be forked, or did not
        answer (killed or stopped by a process of the uid in its instant as
        it). A reaper that failed is ended and another forked next time.
        True at once where the sandbox has no user namespace (kill_by_uid)."""
        if not self.kill_by_uid:
            return True
        for _ in range(2):
            if self.reaper is None and not self._start_reaper():
                return False
            pid, sock = self.reaper
            try:
                sock.send(b"%d" % uid)
                if sock.recv(8) == b"1":
                    return True
            except OSError:                 # it went, or did not answer in time
                pass
            self._end_reaper()
        return False

    def _start_reaper(self):
        """Fork the reaper; False if it could not be forked."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return False
        if pid == 0:
            signal.set_wakeup_fd(-1)
            reaper(only_fd_3(theirs))
        theirs.close()
        ours.settimeout(REAPER_WAIT_S)
        self.reaper = (pid, ours)
        self.me.add(pid)            # not one of a call's leftovers
        return True

    def _end_reaper(self):
        """Kill and reap the reaper (gone, stopped, or failing)."""
        pid, sock = self.reaper
        self.reaper = None
        self.me.discard(pid)
        sock.close()
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass

    def kill_leftovers(self, uid):
        """kill_leftovers of `uid` among init's children, and among this
        zygote's own that are no worker: clone(CLONE_PARENT) by a call's
        process makes the zygote its child's parent. Those of them that are
        dead are reaped. How many still ran."""
        found = kill_leftovers(uid, fd=self.children_fd, skip=self.me)      # init's children: this one too
        workers = {w["pid"] for w in self.by_fd.values()}
        found += kill_leftovers(uid, fd=self.own_children_fd, skip=workers)
        for pid in init_children(fd=self.own_children_fd):
            if int(pid) not in workers:
                try:
                    os.waitpid(int(pid), os.WNOHANG)
                except ChildProcessError:
                    pass
        return found

    def free_uid(self, uid):
        """A uid back to the free list, once nothing of its call runs: what
        the call left (its dir, /dev/shm, SysV IPC, message queues) goes
        first (nothing of it runs to make more). A uid whose leftovers could
        not all be removed waits (unclean) and is tried again every
        CLEANUP_RETRY_MS; after CLEANUP_TRIES it is never handed out again:
        the next call of it would own what is left."""
        if uid in self.lost:
            return
        try:
            clean = self.remove_left(uid)
        except OSError:
            # No pid for the child that removes its SysV IPC objects (a call
            # holds the sandbox's pids limit): tried again with the held uids.
            self.held.append(uid)
            return
        if clean:
            self.unclean.pop(uid, None)
            self.uids.append(uid)
            return
        tries = self.unclean.get(uid, (0.0, 0))[1] + 1
        if tries >= CLEANUP_TRIES:
            self.unclean.pop(uid, None)
            self.lost.add(uid)
        else:
            self.unclean[uid] = (time.monotonic() + CLEANUP_RETRY_MS / 1000, tries)

    def remove_left(self, uid):
        """What `uid`'s call left removed, every part tried whatever another
        part did: its dir, /dev/shm, message queues, SysV IPC. True when
        nothing of it is left. OSError when the child that removes the IPC
        objects could not be forked."""
        ok = True
        name = self.dirs.get(uid)
        if name is not None:
            if self.to_trash(name):
                del self.dirs[uid]
            else:
                ok = False
        for fd in (self.shm_fd, -1 if self.own_ipc else self.mq_fd):
            if fd >= 0:
                try:
                    ok = remove_owned(fd, uid) and ok
                except Exception:
                    ok = False
        if self.own_ipc:
            return ok
        try:
            return remove_ipc(uid, fds=self.ipc_fds) and ok
        except OSError:
            raise
        except Exception:
            return False

    def to_trash(self, name):
        """Move the call dir `name` (in base) into TRASH, where no call can
        reach it (the uid it belonged to may be handed out at once), for
        sweep() to remove; removed here, whole, if it cannot be moved.
        True when it is out of every call's reach."""
        base = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                trash = self._trash(base)
                there = f"{name}.{self.trashed}"
                os.rename(name, there, src_dir_fd=base, dst_dir_fd=trash)
            except FileNotFoundError:
                return True
            except OSError:
                return remove_tree(base, name)
            self.trashed += 1
            moved = []
            self.sweeping.append([remove_tree_steps(trash, there, moved), there, 0, 0.0, moved])
            return True
        finally:
            os.close(base)

    def _trash(self, base):
        """The fd of TRASH in base, made (root's alone, 0700) when first
        needed and kept open. OSError if it is not a dir of root's alone
        (then nothing is moved there)."""
        if self.trash_fd < 0:
            try:
                os.mkdir(TRASH, 0o700, dir_fd=base)
            except FileExistsError:
                pass
            fd = os.open(TRASH, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base)
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                os.close(fd)
                raise OSError(errno.EPERM, f"{TRASH} is not root's alone")
            self.trash_fd = fd
        return self.trash_fd

    def sweep(self, steps=SWEEP_STEPS):
        """Remove up to `steps` entries of what is in TRASH. A dir not all
        gone (a call still running wrote into a part of it it held open)
        is tried again every CLEANUP_RETRY_MS, CLEANUP_TRIES times; then it
        stays until the call sandbox goes (no call can reach it)."""
        now = time.monotonic()
        i = 0
        while i < len(self.sweeping) and steps > 0:
            entry = self.sweeping[i]
            if entry[3] > now:
                i += 1
                continue
            try:
                next(entry[0])
                steps -= 1
            except StopIteration as end:
                del self.sweeping[i]
                if not end.value and entry[2] + 1 < CLEANUP_TRIES:
                    moved = entry[4]        # with the parts of it moved up that stay
                    self.sweeping.append([remove_tree_steps(self.trash_fd, entry[1], moved), entry[1], entry[2] + 1,
                                          now + CLEANUP_RETRY_MS / 1000, moved])

    def sweep_wait_ms(self):
        """Milliseconds until there is something to sweep (0: now; None: nothing in TRASH)."""
        if not self.sweeping:
            return None
        left = min(e[3] for e in self.sweeping) - time.monotonic()
        return 0 if left <= 0 else int(left * 1000) + 1

    def retry_unclean(self):
        """free_uid again for the unclean uids whose time has come."""
        now = time.monotonic()
        for uid, (at, _) in list(self.unclean.items()):
            if at <= now:
                self.free_uid(uid)

    def unclean_wait_ms(self):
        """Milliseconds until the next unclean uid is tried again (None: none waits)."""
        if not self.unclean:
            return None
        return max(0, int((min(at for at, _ in self.unclean.values()) - time.monotonic()) * 1000) + 1)

    def recheck_held(self):
        """Free the held uids whose leftovers are gone (their children, if
        any, were reparented to init meanwhile and are killed now)."""
        held, self.held = self.held, []
        for uid in held:
            if not self.kill_uid(uid) or self.kill_leftovers(uid):
                self.held.append(uid)
            else:
                self.free_uid(uid)          # which may hold it again

    def on_request(self):
        msg, fds = recv(self.sock)
        if not msg:
            os._exit(0)      # the daemon closed its end
        req = json.loads(msg)
        if req["op"] == "mqueue":      # the directory of the call sandbox's message queues
            self.mq_fd = fds[0] if fds else -1
            for f in fds[1:]:
                os.close(f)
            return
        if req["op"] == "kill":
            w = self.by_id.get(req["id"])
            if w:
                self.kill_worker(w)
            return
        try:
            w = self.idle.pop() if self.idle else self.fork_worker()
            w["id"], w["started"] = req["id"], time.monotonic()
            self.by_id[req["id"]] = w
            # The packet as it came: the worker parses it anyway.
            w["link"].sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as e:
            send(self.sock, {"op": "error", "id": req["id"], "errno": e.errno, "message": e.strerror or str(e)})
        finally:
            for f in fds:
                os.close(f)

    def spares_wanted(self) -> tuple[bool, bool]:
        """(low: fewer than half the spares are idle, want: a spare is
        missing and a uid is free for it)."""
        return len(self.idle) < max(1, self.spares // 2), bool(len(self.idle) < self.spares and self.uids)

    def run(self):
        # Spares are forked when the zygote had nothing to do for IDLE_MS, or
        # at once (all that are missing) when fewer than half are left: a
        # fork blocks this loop for a few ms (page tables), which would delay
        # every call waiting on it.
        # The paces (IDLE_MS, FORK_RETRY_MS, RECHECK_MS) are kept by the
        # clock, not only by the poll's timeout: while the trash is swept
        # the loop polls without waiting.
        while True:
            now = time.monotonic()
            if self.sweeping:
                self.sweep()
            if self.held and now >= self.recheck_at:
                self.recheck_held()
                self.recheck_at = now + RECHECK_MS / 1000
            if self.unclean:
                self.retry_unclean()
            low, want = self.spares_wanted()
            wait = 0 if (want and low) else (IDLE_MS if want else None)
            if want and self.fork_failed:
                wait = FORK_RETRY_MS
            if self.held:
                wait = RECHECK_MS if wait is None else min(wait, RECHECK_MS)
            for later in (self.unclean_wait_ms(), self.sweep_wait_ms()):
                if later is not None:
                    wait = later if wait is None else min(wait, later)
            events = self.poll.poll(wait)
            for fd, _ev in events:
                if fd == self.sock.fileno():
                    self.on_request()
                elif fd == self.sigchld_fd:
                    self.on_sigchld()
                elif fd in self.by_fd:
                    self.on_worker(fd, self.by_fd[fd])
            now = time.monotonic()
            if events:
                self.busy_at = now
            # Low after this turn's calls: refilled now, calls handled or
            # not. Under load every poll has calls, and spares forked only in
            # a quiet turn were never forked again: each call got a worker
            # of its own, and the loop's pages were copied at every one.
            low, want = self.spares_wanted()
            if want and now >= self.fork_again_at and (low or (not events and now - self.busy_at >= IDLE_MS / 1000)):
                try:
                    # Once low, all that are missing, back to back: each
                    # fork write-protects this process's memory again, and
                    # the pages the loop then writes are copied, once per
                    # batch instead of once per call (docs/burst.md,
                    # "Spares forked in a batch").
                    self.idle.extend(self.fork_workers(self.spares - len(self.idle) if low else 1))
                    self.fork_failed = False
                except OSError:
                    # Tried again after FORK_RETRY_MS; a call meanwhile
                    # gets a worker forked for it, or an error.
                    self.fork_failed = True
                    self.fork_again_at = time.monotonic() + FORK_RETRY_MS / 1000


def main():
    conf = json.loads(sys.argv[1])
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    failed = {}
    loaded = []
    for name in conf["modules"]:
        try:
            __import__(name)
            loaded.append(name)
        except BaseException as e:
            failed[name] = f"{type(e).__name__}: {e}"
    flags = (CLONE_NEWIPC if conf.get("own_ipc") else 0) | (CLONE_NEWNET if conf.get("own_net") else 0)
    unshare = unshare_fn() if flags else None       # ctypes imported here, if at all
    # Objects imported so far are shared by every fork; keep the GC from
    # touching (and so copying) their pages in the workers.
    gc.collect()
    if hasattr(gc, "freeze"):
        gc.freeze()
    gc.disable()
    # What a worker can do, tried once: a net namespace that cannot be had
    # leaves the IPC one.
    isolation = None
    for want in (flags, flags & CLONE_NEWIPC) if unshare is not None else ():
        if want and isolation_works((unshare, want)):
            isolation = (unshare, want)
            break
    flags = isolation[1] if isolation else 0
    base = tempfile.mkdtemp(prefix="fncall-", dir="/tmp")
    os.chmod(base, 0o711)
    z = Zygote(sock, base, conf["spares"], conf["uid_base"], conf["uid_count"], conf["rlimits"], isolation)
    send(sock, {"op": "ready", "pid": os.getpid(), "modules": loaded, "failed": failed,
                "own_ipc": bool(flags & CLONE_NEWIPC), "own_net": bool(flags & CLONE_NEWNET)})
    z.run()


if __name__ == "__main__":      # run as `python3 -c TEXT`; the daemon imports a few functions
    main()
