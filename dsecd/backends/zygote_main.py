"""The FnCall zygote: runs INSIDE a call sandbox, under the image's own python3.

Not imported by the daemon: dsecd/backends/fncall.py reads this file and
passes its text as `python3 -I -S -c TEXT MODULE...`, so it must work with
nothing but the stdlib of whatever Python the image has (3.8+).

Fd 0 is one end of a SOCK_SEQPACKET socketpair made by the daemon and handed
over as the exec's stdin: there is no path in the sandbox that reaches it.
Messages are JSON, one per packet.

    daemon -> zygote  {"op": "call", "id": N, "argv": [...], "env": {...},
                       "code": bool, "uid": U, "rlimits": {...}}
                      + SCM_RIGHTS [stdin, stdout, stderr(, code memfd)]
                      {"op": "kill", "id": N}
    zygote -> daemon  {"op": "ready", "pid": P, "modules": [...], "failed": {...}}
                      {"op": "exit", "id": N, "status": wait-status, "run_ms": F}
                      {"op": "error", "id": N, "message": "..."}

Each call is a fork of the zygote (interpreter and modules already imported)
that never returns to the loop: it gets a fresh tmp dir (its cwd and TMPDIR,
removed when it exits), drops to an unprivileged uid, takes rlimits, and runs
the code (or execs argv). The zygote itself never runs caller code, so no
call can leave state for the next one.
"""

import array
import gc
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import time

RLIMITS = {"as": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE,
           "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}


def recv(sock):
    fds = array.array("i")
    msg, anc, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(8 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


def child(req, fds, tmp):
    """In the forked child: never returns."""
    status = 127
    try:
        os.setsid()
        for i in range(3):
            os.dup2(fds[i], i)
        src = None
        if req.get("code"):
            with os.fdopen(fds[3], "rb") as f:
                src = f.read()
        os.closerange(3, 1 << 16)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        uid = req["uid"]
        os.chown(tmp, uid, uid)
        os.chdir(tmp)
        for name, value in req.get("rlimits", {}).items():
            resource.setrlimit(RLIMITS[name], (value, value))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        env = dict(req["env"], TMPDIR=tmp, HOME=tmp)
        if src is None:
            os.execvpe(req["argv"][0], req["argv"], env)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = list(req["argv"]) or ["-c"]
        tempfile.tempdir = None
        gc.enable()
        status = 0
        try:
            exec(compile(src, "<call>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            code = e.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            status = 1
    except BaseException as e:   # setup failed: say why on the call's stderr
        try:
            os.write(2, (f"fncall: {type(e).__name__}: {e}\n").encode())
        except OSError:
            pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass
    os._exit(status & 0xFF)


def main():
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    failed = {}
    loaded = []
    for name in sys.argv[1:]:
        try:
            __import__(name)
            loaded.append(name)
        except BaseException as e:
            failed[name] = f"{type(e).__name__}: {e}"
    # Objects imported so far are shared by every fork; keep the GC from
    # touching (and so copying) their pages in the children.
    gc.collect()
    if hasattr(gc, "freeze"):
        gc.freeze()
    gc.disable()
    base = tempfile.mkdtemp(prefix="fncall-", dir="/tmp")
    os.chmod(base, 0o711)
    sock.send(json.dumps({"op": "ready", "pid": os.getpid(), "modules": loaded,
                          "failed": failed}).encode())
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLIN)
    running = {}        # pidfd -> (id, pid, tmp, started)
    by_id = {}          # id -> pid
    while True:
        for fd, _ev in poll.poll():
            if fd != sock.fileno():
                call_id, pid, tmp, started = running.pop(fd)
                poll.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                by_id.pop(call_id, None)
                shutil.rmtree(tmp, ignore_errors=True)
                sock.send(json.dumps({"op": "exit", "id": call_id, "status": status,
                                      "run_ms": (time.monotonic() - started) * 1000}).encode())
                continue
            msg, fds = recv(sock)
            if not msg:
                os._exit(0)      # the daemon closed its end
            req = json.loads(msg)
            if req["op"] == "kill":
                pid = by_id.get(req["id"])
                if pid:
                    for kill in (os.killpg, os.kill):    # before its setsid, the group is not its own
                        try:
                            kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
                continue
            try:
                tmp = tempfile.mkdtemp(prefix="c{}-".format(req["id"]), dir=base)
                started = time.monotonic()
                pid = os.fork()
            except OSError as e:
                for f in fds:
                    os.close(f)
                sock.send(json.dumps({"op": "error", "id": req["id"], "message": str(e)}).encode())
                continue
            if pid == 0:
                sock.close()
                child(req, fds, tmp)
            for f in fds:
                os.close(f)
            pidfd = os.pidfd_open(pid)
            running[pidfd] = (req["id"], pid, tmp, started)
            by_id[req["id"]] = pid
            poll.register(pidfd, select.POLLIN)


main()
