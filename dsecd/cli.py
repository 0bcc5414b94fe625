"""`dsec`: the command-line client, a thin shell over the SDK.

It talks to the local daemon socket, so `ssh host dsec ps` works on any host,
and `dsec rpc --stdio` bridges the raw protocol over stdin/stdout for fleet
tools. Every listing command takes --json. Exit status: the command's own for
`exec`; 124 when an exec timed out; 128+N when it died of signal N; 125 when
dsec itself failed (daemon error, bad input); 1 for a failed non-exec command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

from .client import Client, default_socket
from .errors import DsecError

EXIT_DSEC_ERROR = 125
EXIT_TIMEOUT = 124


def _kv(items: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"dsec: {what} must look like KEY=VALUE, got {item!r}")
        out[k] = v
    return out


def _print_json(obj) -> None:
    def default(o):
        if isinstance(o, (bytes, bytearray)):
            return o.decode("utf-8", "replace")
        raise TypeError(type(o).__name__)

    print(json.dumps(obj, indent=2, sort_keys=True, default=default))


def _human_bytes(n: int) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


# ---------------------------------------------------------------- commands

async def cmd_info(c: Client, a) -> int:
    info = await c.info()
    if a.json:
        _print_json(info)
        return 0
    print(f"dsecd {info['version']} (protocol {info['protocol']}), pid {info['pid']}, up {info['uptime_s']:.0f}s")
    print(f"kernel {info['kernel']}, cgroups {info['cgroup_mode']}: "
          + ", ".join(f"{k}={v}" for k, v in sorted(info["cgroup_controllers"].items())))
    print("features:")
    for name, f in sorted(info["features"].items()):
        print(f"  {name:<18} {'yes' if f['available'] else 'no ':<4} {f['detail']}")
    print("limits:")
    for k, v in sorted(info["limits"].items()):
        print(f"  {k:<26} {v}")
    print("sandboxes: " + (", ".join(f"{k} {v}" for k, v in sorted(info["sandboxes"].items())) or "none"))
    print("paths:")
    for k, v in sorted(info["paths"].items()):
        print(f"  {k:<12} {v}")
    return 0


async def cmd_image(c: Client, a) -> int:
    if a.image_cmd == "import":
        last = [0.0]

        def progress(p: dict) -> None:
            if not a.json and sys.stderr.isatty() and time.monotonic() - last[0] > 0.2:
                last[0] = time.monotonic()
                print(f"\rimporting: {p['files']} files, {_human_bytes(p['bytes'])}", end="", file=sys.stderr)

        img = await c.import_image(a.path, a.name, progress)
        if sys.stderr.isatty() and not a.json:
            print(file=sys.stderr)
        if a.json:
            _print_json(img)
        else:
            print(f"imported {img['name']}: {img['files']} files, {_human_bytes(img['bytes'])}"
                  + (f", {img['skipped']} special files skipped" if img["skipped"] else ""))
        return 0
    if a.image_cmd == "ls":
        images = await c.list_images()
        if a.json:
            _print_json(images)
        else:
            _table([[i["name"], i["kind"], str(i["files"]), _human_bytes(i["bytes"]),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(i["created"]))] for i in images],
                   ["NAME", "KIND", "FILES", "SIZE", "CREATED"])
        return 0
    if a.image_cmd == "inspect":
        _print_json(await c.inspect_image(a.name))
        return 0
    if a.image_cmd == "rm":
        await c.remove_image(a.name)
        if not a.json:
            print(f"removed image {a.name}")
        return 0
    raise SystemExit("dsec image: give a subcommand: import, ls, inspect, rm")


async def cmd_create(c: Client, a) -> int:
    sb = await c.create(image=a.image, cpu=a.cpu, memory=a.memory, pids=a.pids, env=_kv(a.env, "--env"),
                        labels=_kv(a.label, "--label"), hostname=a.hostname, cwd=a.cwd, user=a.user)
    if a.json:
        _print_json(sb.info)
    else:
        print(sb.id)
    return 0


async def _stdin_chunks():
    """Read our stdin in a thread (it may be a tty or a pipe) and yield chunks."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    while True:
        data = await loop.run_in_executor(None, os.read, fd, 1 << 16)
        if not data:
            return
        yield data


async def cmd_exec(c: Client, a) -> int:
    if not a.argv:
        raise SystemExit("dsec exec: give a command after the sandbox id, e.g. dsec exec SB -- ls /")
    sb = await c.get(a.sandbox)
    stream = sb.exec_stream(a.argv, timeout=a.timeout, env=_kv(a.env, "--env"), cwd=a.cwd, user=a.user,
                            stdin=_stdin_chunks() if a.interactive else None)
    outs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
    async for fd, data in stream:
        outs[fd].write(data)
        outs[fd].flush()
    r = stream.result
    if a.json:
        _print_json({"exit_code": r.exit_code, "signal": r.signal, "timed_out": r.timed_out,
                     "truncated": r.truncated, "duration_ms": r.duration_ms})
    if r.truncated:
        print("dsec: output truncated at the daemon's limits.max_exec_output_bytes; "
              "the command's pipes were closed", file=sys.stderr)
    if r.timed_out:
        print(f"dsec: timed out after {a.timeout}s; the command's process group was killed", file=sys.stderr)
        return EXIT_TIMEOUT
    if r.signal:
        return 128 + r.signal
    return r.exit_code or 0


def _split_remote(spec: str) -> tuple[str | None, str]:
    """'SB:/path' -> (SB, /path); a local path -> (None, path). ./x:y stays local."""
    head, sep, tail = spec.partition(":")
    if sep and head and "/" not in head and tail.startswith("/"):
        return head, tail
    return None, spec


async def cmd_cp(c: Client, a) -> int:
    src_sb, src = _split_remote(a.src)
    dst_sb, dst = _split_remote(a.dst)
    if (src_sb is None) == (dst_sb is None):
        raise SystemExit("dsec cp: exactly one side must be SANDBOX:/absolute/path")
    if src_sb is None:
        if src == "-":
            data = sys.stdin.buffer.read()
            mode = 0o644
        else:
            with open(src, "rb") as f:
                data = f.read()
            mode = os.stat(src).st_mode & 0o7777
        sb = await c.get(dst_sb)
        if dst.endswith("/"):
            dst += os.path.basename(src)
        await sb.write_file(dst, data, mode=mode)
        return 0
    sb = await c.get(src_sb)
    data = await sb.read_file(src)
    if dst == "-":
        sys.stdout.buffer.write(data)
        return 0
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    tmp = f"{dst}.dsec-tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)
    return 0


async def cmd_ps(c: Client, a) -> int:
    sbs = await c.list(_kv(a.label, "--label"))
    if a.json:
        _print_json(sbs)
        return 0
    rows = []
    for s in sorted(sbs, key=lambda s: s["created"]):
        lim = s["limits"]
        rows.append([s["id"], s["image"], s["state"], f"{lim['cpu']:g}", _human_bytes(lim["memory"]),
                     str(s["execs_running"]), time.strftime("%H:%M:%S", time.localtime(s["created"])),
                     ",".join(f"{k}={v}" for k, v in sorted(s["labels"].items()))])
    _table(rows, ["ID", "IMAGE", "STATE", "CPU", "MEMORY", "EXECS", "CREATED", "LABELS"])
    return 0


async def cmd_inspect(c: Client, a) -> int:
    _print_json(await c.request("inspect", sandbox=a.sandbox))
    return 0


async def cmd_rm(c: Client, a) -> int:
    if a.all:
        if a.sandboxes:
            raise SystemExit("dsec rm: give sandbox ids or --all, not both")
        r = await c.destroy_all(force=a.force, labels=_kv(a.label, "--label"))
        if a.json:
            _print_json(r)
        else:
            print(f"removed {len(r['destroyed'])} sandbox(es)")
            for sb_id, err in r["failed"].items():
                print(f"dsec: rm {sb_id}: {err}", file=sys.stderr)
        return 1 if r["failed"] else 0
    if not a.sandboxes:
        raise SystemExit("dsec rm: give sandbox ids, or --all")
    status = 0
    for sb_id in a.sandboxes:
        try:
            r = await c.request("destroy", sandbox=sb_id, force=a.force)
            if not a.json:
                print(r["id"])
        except DsecError as err:
            print(f"dsec: rm {sb_id}: {err}", file=sys.stderr)
            status = 1
    return status


def cmd_rpc(a) -> int:
    """Bridge stdin/stdout to the daemon socket byte for byte (frames pass through)."""
    if not a.stdio:
        raise SystemExit("dsec rpc: only --stdio is supported")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(a.socket)
    except OSError as err:
        raise SystemExit(f"dsec rpc: connect {a.socket}: {err.strerror}") from err

    def upstream() -> None:
        fd = sys.stdin.fileno()
        while data := os.read(fd, 1 << 16):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    out = sys.stdout.fileno()
    while data := sock.recv(1 << 16):
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
    return 0


# ---------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsec", description="Drive the local dsecd daemon.")
    p.add_argument("--socket", default=default_socket(), help="daemon socket (env DSEC_SOCKET)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="cmd", required=True)

    sub.add_parser("info", help="version, kernel features, limits, paths")

    img = sub.add_parser("image", help="manage images").add_subparsers(dest="image_cmd", required=True)
    imp = img.add_parser("import", help="import a root directory as an image")
    imp.add_argument("path")
    imp.add_argument("--name", required=True)
    img.add_parser("ls", help="list images")
    for name in ("inspect", "rm"):
        x = img.add_parser(name)
        x.add_argument("name")

    cr = sub.add_parser("create", help="create a sandbox; prints its id")
    cr.add_argument("--image", required=True)
    cr.add_argument("--cpu", type=float)
    cr.add_argument("--memory", help="e.g. 256M, 2G")
    cr.add_argument("--pids", type=int)
    cr.add_argument("--env", action="append", metavar="K=V")
    cr.add_argument("--label", action="append", metavar="K=V")
    cr.add_argument("--hostname")
    cr.add_argument("--cwd", default="/")
    cr.add_argument("--user", type=int, default=0, help="uid inside the sandbox")

    ex = sub.add_parser("exec", help="run a command in a sandbox")
    ex.add_argument("-i", "--interactive", action="store_true", help="pass stdin to the command")
    ex.add_argument("--timeout", type=float, help="seconds; the process group is killed after it")
    ex.add_argument("--env", action="append", metavar="K=V")
    ex.add_argument("--cwd")
    ex.add_argument("--user", type=int)
    ex.add_argument("sandbox")
    ex.add_argument("argv", nargs=argparse.REMAINDER)

    cp = sub.add_parser("cp", help="copy a file: LOCAL SB:/path or SB:/path LOCAL ('-' = stdin/stdout)")
    cp.add_argument("src")
    cp.add_argument("dst")

    ps = sub.add_parser("ps", help="list sandboxes")
    ps.add_argument("--label", action="append", metavar="K=V")

    ins = sub.add_parser("inspect", help="one sandbox as JSON")
    ins.add_argument("sandbox")

    rm = sub.add_parser("rm", help="destroy sandboxes")
    rm.add_argument("sandboxes", nargs="*")
    rm.add_argument("--all", action="store_true")
    rm.add_argument("--force", "-f", action="store_true", help="kill running execs")
    rm.add_argument("--label", action="append", metavar="K=V", help="with --all: only these")

    rpc = sub.add_parser("rpc", help="bridge the protocol over stdin/stdout (for ssh)")
    rpc.add_argument("--stdio", action="store_true")
    return p


COMMANDS = {"info": cmd_info, "image": cmd_image, "create": cmd_create, "exec": cmd_exec, "cp": cmd_cp,
            "ps": cmd_ps, "inspect": cmd_inspect, "rm": cmd_rm}


async def _run(a) -> int:
    async with Client(a.socket, name=f"dsec {a.cmd}") as c:
        return await COMMANDS[a.cmd](c, a)


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.cmd == "exec" and a.argv and a.argv[0] == "--":
        a.argv = a.argv[1:]
    if a.cmd == "rpc":
        sys.exit(cmd_rpc(a))
    fail = EXIT_DSEC_ERROR if a.cmd == "exec" else 1
    try:
        sys.exit(asyncio.run(_run(a)))
    except DsecError as err:
        if a.json:
            _print_json({"error": err.to_wire()})
        print(f"dsec {a.cmd}: {err.code}: {err.message}", file=sys.stderr)
        sys.exit(fail)
    except ConnectionError as err:
        print(f"dsec: {err}", file=sys.stderr)
        sys.exit(fail)
    except OSError as err:
        print(f"dsec {a.cmd}: {err.strerror or err}: {err.filename or ''}", file=sys.stderr)
        sys.exit(fail)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()


