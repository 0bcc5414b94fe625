"""Drive a real dsecd with hostile sessions and check every answer.

A session: connect, hello (or a bad first frame), up to N frames sent
pipelined, then read until every well-formed request has its final frame or
the deadline passes, then end the session one of several ways (close, drop
without reading, a header that declares an oversized frame, a frame cut
short, half a header). Checked for every frame the daemon sends: a msgpack
map with an `id` and exactly one of result/error/stream, an error's `code`
in dsecd.errors.ERROR_CODES and never `internal`; every well-formed request
answered (exec, exec_input and events may legitimately wait: they are cancelled by the
close); the daemon process alive after each session. Afterwards nothing
may be left: no sandboxes beyond what the harness keeps, no cgroups below
the daemon's subtree, no host mounts under its directories, no fd growth.

Generation is hypothesis (fuzz_frames); on top, each generated frame yields
`mutants` cheap seeded mutations (bytes flipped, cut or inserted; a value
swapped for garbage; a key dropped), so a 100k-input run takes minutes, not
an hour. Everything is seeded: the same seed replays the same inputs.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import fuzz_frames as ff
import msgpack

from dsecd import protocol
from dsecd.errors import ERROR_CODES

ROOT = Path(__file__).resolve().parents[2]
LONG_OPS = {"exec", "exec_input", "events"}   # may wait (for input, for events): cancelled by the close


def _integration_conftest():
    """The Daemon class of tests/integration/conftest.py, loaded under its own name."""
    spec = importlib.util.spec_from_file_location(
        "dsecd_integration_conftest", ROOT / "tests" / "integration" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Findings:
    inputs: int = 0
    sessions: int = 0
    answers: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    internal: list[dict] = field(default_factory=list)
    malformed: list[dict] = field(default_factory=list)
    hangs: list[dict] = field(default_factory=list)
    crashes: list[dict] = field(default_factory=list)
    orphans: list[dict] = field(default_factory=list)   # sandboxes nobody asked to keep
    restarts: int = 0

    def problems(self) -> int:
        return len(self.internal) + len(self.malformed) + len(self.hangs) + len(self.crashes)

    def summary(self) -> dict:
        return {"fuzz_inputs": self.inputs, "sessions": self.sessions, "answers": self.answers,
                "codes": dict(sorted(self.codes.items())), "internal_errors": len(self.internal),
                "malformed_answers": len(self.malformed), "hangs": len(self.hangs),
                "fuzz_crashes": len(self.crashes), "orphan_sandboxes": len(self.orphans),
                "daemon_restarts": self.restarts}


def _short(obj, limit: int = 600) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


class FuzzTarget:
    """A private daemon with the busybox image and one long-lived sandbox to aim at."""

    def __init__(self, rootfs: str, extra_config: str = ""):
        conftest = _integration_conftest()
        self._kill_and_remove_cgroups = conftest._kill_and_remove_cgroups
        self.tmp = Path(tempfile.mkdtemp(prefix="dsecd-fuzz-"))
        self.daemon = conftest.Daemon(self.tmp, extra_config)
        self.rootfs = rootfs
        self.max_frame = 16 << 20
        tiny = self.tmp / "import-tiny"
        (tiny / "bin").mkdir(parents=True)
        (tiny / "bin" / "hello").write_text("hi\n")
        (self.tmp / "import-file").write_text("not a dir\n")
        os.symlink(tiny, self.tmp / "import-link")
        ff.IMPORT_PATHS[:] = [str(tiny), str(self.tmp / "import-file"), str(self.tmp / "import-link"),
                              str(self.tmp / "nonexistent"), str(tiny) + "/../import-tiny",
                              "relative/path", ""]
        self.ctx = ff.Context()
        self.target: str | None = None
        self.baseline: dict = {}
        self._ctl = None
        self.stuck: set[str] = set()     # sandboxes a destroy cannot remove any more

    # -- lifecycle

    def start(self) -> None:
        self.daemon.start()
        c = self.daemon.client()
        try:
            c.import_image(self.rootfs, "busybox")
        finally:
            c.close()
        self.ensure_target()
        # After the first sandbox: its image layer stays mounted while the daemon runs.
        self.daemon.settle()       # its background start-up work opens fds it keeps
        self.baseline = self.snapshot()

    def restart(self) -> None:
        self._drop_control()
        self.daemon.stop()
        self.daemon.start()
        self.ensure_target()

    def alive(self) -> bool:
        return self.daemon.proc is not None and self.daemon.proc.poll() is None

    def close(self, keep_log: Path | None = None) -> None:
        self._drop_control()
        if keep_log is not None and self.daemon.log.exists():
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            keep_log.write_bytes(self.daemon.log.read_bytes())
        self.daemon.cleanup()   # destroy_all, stop, remove cgroups and the temp dir

    # -- the sandbox to aim at, and cleanup after each session

    def control(self, op: str, **args) -> dict:
        """One request on the harness's own (well-behaved) connection."""
        if self._ctl is None:
            self._ctl = self.daemon.client()
        return self._ctl.request(op, **args)

    def _drop_control(self) -> None:
        if self._ctl is not None:
            try:
                self._ctl.close()
            except Exception:   # noqa: BLE001 - the daemon may be gone
                pass
            self._ctl = None

    def ensure_target(self) -> None:
        # A fuzzed `drain` refuses every create after it, the harness's too:
        # undone here, as a fuzzed pause is below.
        self.control("undrain")
        live = {s["id"]: s for s in self.control("list")["sandboxes"]}
        if live.get(self.target, {}).get("state") == "paused":   # a fuzzed `pause` or `job_pause`
            self.control("resume", sandbox=self.target)
            return
        if self.target in live and live[self.target]["state"] != "running":
            self.control("destroy", sandbox=self.target, force=True)
        if self.target not in live or live[self.target]["state"] != "running":
            sb = self.control("create", image="busybox", memory="64M", pids=64,
                              labels={"fuzz": "target"})
            self.target = sb["id"]
            self.ctx.sandboxes[:] = [self.target]

    def sweep(self, findings: Findings, created: set[str], session: list) -> None:
        """Destroy what the session made; note sandboxes nobody made on purpose."""
        for sb in self.control("list")["sandboxes"]:
            if sb["id"] == self.target or sb["id"] in self.stuck:
                continue
            if sb["id"] not in created:
                findings.orphans.append({"sandbox": sb["id"], "state": sb["state"],
                                         "session": _short(session, 3000)})
            try:
                self.control("destroy", sandbox=sb["id"], force=True)
            except Exception as err:   # noqa: BLE001 - reported once, the run goes on
                self.stuck.add(sb["id"])
                findings.orphans.append({"sandbox": sb["id"], "destroy_failed": str(err)})
        names = set()
        for img in self.control("image_list")["images"]:
            names.add(img["name"])
            if img["name"] != "busybox":
                try:
                    self.control("image_rm", name=img["name"])
                except Exception:   # noqa: BLE001 - in use: the next sweep gets it
                    pass
        if "busybox" not in names:   # a fuzzed image_rm took it (allowed while unused)
            self.control("list")      # (connects the control client)
            self._ctl.import_image(self.rootfs, "busybox")
        self.ensure_target()

    # -- leak check

    def snapshot(self) -> dict:
        pid = self.daemon.proc.pid
        cgroups = []
        for top in self.daemon.cgroup_dirs():
            if top.exists():
                # Dot-named groups (".fncall") hold the daemon's own warm pools,
                # made on first use and kept while it runs: not a sandbox's.
                cgroups += [str(p) for p in top.rglob("*") if p.is_dir()
                            and not p.relative_to(top).parts[0].startswith(".")]
        mounts = [line.split()[4] for line in open("/proc/self/mountinfo")
                  if str(self.tmp) in line]
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": len(os.listdir(f"/proc/{pid}/task")),
                "cgroups": sorted(cgroups), "mounts": sorted(mounts),
                "children": [c for c in _children(pid) if not _in_pool(c, self.daemon.cgroup_root)]}

    def leaks(self) -> dict:
        """Objects left after the target is destroyed, against the baseline."""
        if self.target:
            self.control("destroy", sandbox=self.target, force=True)
            self.target = None
        left = [s["id"] for s in self.control("list")["sandboxes"]]
        images = [i["name"] for i in self.control("image_list")["images"] if i["name"] != "busybox"]
        self.daemon.settle()       # its background start-up work opens fds it keeps
        now = self.snapshot()
        base = self.baseline
        return {
            "sandboxes": left,
            "images": images,
            "cgroups": sorted(set(now["cgroups"]) - set(base["cgroups"])),
            "mounts": sorted(set(now["mounts"]) - set(base["mounts"])),
            "child_processes": sorted(set(now["children"]) - set(base["children"])),
            # a few fds come and go (executor threads, the log); dozens do not
            "fd_growth": max(0, now["fds"] - base["fds"] - 16),
        }


def _in_pool(pid: int, cgroup_root: str) -> bool:
    """Whether pid lives in one of the daemon's dot-named pool cgroups."""
    try:
        text = open(f"/proc/{pid}/cgroup").read()
    except OSError:
        return False
    return f"/{cgroup_root}/." in text


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(p) for p in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return out


# ---------------------------------------------------------------- mutations


def mutate(inp: ff.Input, rng: random.Random, pool: list) -> ff.Input:
    """A cheap variant of a generated frame (header kept consistent)."""
    payload = inp.data[protocol.HEADER.size:]
    how = rng.random()
    if how < 0.35 and payload:
        b = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            i = rng.randrange(len(b)) if b else 0
            if op < 0.5 and b:
                b[i] = rng.randrange(256)
            elif op < 0.75:
                b[i:i] = bytes([rng.choice([0xc1, 0xdd, 0xdf, 0xcf, 0xff, 0x00, 0x7f, 0x80])])
            elif b:
                del b[i:i + rng.randint(1, 8)]
        return ff.Input("raw", protocol.HEADER.pack(len(b)) + bytes(b), frame=bytes(b))
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:   # noqa: BLE001 - not decodable: flip a byte of the payload instead
        if not payload:
            return inp
        b = payload[:-1] + bytes([rng.randrange(256)])
        return ff.Input("raw", protocol.HEADER.pack(len(b)) + b, frame=b)
    if not isinstance(obj, dict) or not isinstance(obj.get("args"), dict) or not obj["args"]:
        return inp
    args = dict(obj["args"])
    key = rng.choice(sorted(args, key=str))
    if how < 0.6 and pool:
        args[key] = rng.choice(pool)
    elif how < 0.75:
        del args[key]
    elif how < 0.9:
        other = rng.choice(sorted(args, key=str))
        args[key], args[other] = args[other], args[key]
    else:
        args[key] = [args[key]] * rng.randint(0, 3)
    obj["args"] = args
    try:
        data = ff._encode(obj)
    except Exception:   # noqa: BLE001
        return inp
    rid = obj.get("id")
    good = isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= protocol.MAX_ID
    return ff.Input("request", data, rid if good else None, obj.get("op") if
                    isinstance(obj.get("op"), str) else None, obj)


# ---------------------------------------------------------------- one session


class _Conn:
    def __init__(self, path: str, timeout: float):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.decoder = protocol.FrameDecoder(64 << 20)
        self.closed = False

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
            return True
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.closed = True
            return False

    def recv(self, deadline: float) -> list[dict] | None:
        """Frames that arrived, [] on timeout, None once the daemon closed."""
        self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return []
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed = True
            return None
        return self.decoder.feed(data)

    def close(self) -> None:
        self.sock.close()


def _check_frame(frame, findings: Findings, sent: dict[int, ff.Input]) -> tuple[object, bool]:
    """(id, final?) of one answer; records what is wrong with it."""
    if not isinstance(frame, dict) or "id" not in frame or \
            len({"result", "error", "stream"} & set(frame)) != 1 or \
            set(frame) - {"id", "result", "error", "stream"}:
        findings.malformed.append({"answer": _short(frame)})
        return None, True
    findings.answers += 1
    rid = frame["id"]
    if "error" in frame:
        err = frame["error"]
        code = err.get("code") if isinstance(err, dict) else None
        findings.codes[str(code)] = findings.codes.get(str(code), 0) + 1
        if code not in ERROR_CODES or not isinstance(err.get("message"), str) or \
                not isinstance(err.get("detail", {}), dict):
            findings.malformed.append({"answer": _short(frame)})
        elif code == "internal":
            culprit = sent.get(rid) if isinstance(rid, int) else None
            findings.internal.append({"message": err.get("message"),
                                      "request": _short(culprit.frame if culprit else None)})
        return rid, True
    if "result" in frame:
        findings.codes["result"] = findings.codes.get("result", 0) + 1
    return rid, "result" in frame


def _decoded(inp: ff.Input):
    try:
        return protocol.decode_payload(inp.data[protocol.HEADER.size:])
    except Exception:   # noqa: BLE001 - not a map: nothing the daemon would act on
        return None


def run_session(target: FuzzTarget, first: ff.Input, rest: list[ff.Input], ending: str,
                findings: Findings, deadline_s: float = 5.0) -> None:
    # Never let a (mutated) frame make the daemon copy a real host tree.
    rest = [i for i in rest if ff.host_safe(_decoded(i))]
    for inp in [first, *rest]:   # a wrong header would desynchronise the stream: our bug
        assert protocol.HEADER.unpack_from(inp.data)[0] == len(inp.data) - protocol.HEADER.size
    if not ff.host_safe(_decoded(first)):
        return
    findings.sessions += 1
    findings.inputs += 1 + len(rest) + (ending != "close")
    created: set[str] = set()
    conn = _Conn(target.daemon.socket, deadline_s)
    try:
        _session(conn, target, first, rest, ending, findings, deadline_s, created)
    finally:
        conn.close()
    if not target.alive():
        findings.crashes.append({"exit": target.daemon.proc.returncode, "first": _short(first.frame),
                                 "inputs": [_short(i.frame, 300) for i in rest], "ending": ending,
                                 "log": target.daemon.log.read_text()[-3000:]})
        findings.restarts += 1
        target.restart()
        return
    if created or any(i.op in ("create", "destroy", "destroy_all", "image_import", "image_rm")
                      for i in rest):
        time.sleep(0.05)   # let cancelled creates unwind before looking for orphans
        target.sweep(findings, created, [i.frame for i in rest])


def _session(conn, target, first, rest, ending, findings, deadline_s, created) -> None:
    if not conn.send(first.data):
        return
    hello_ok = first.op == "hello" and first.rid == 0
    deadline = time.monotonic() + deadline_s
    answered = False
    while not answered and time.monotonic() < deadline:
        frames = conn.recv(deadline)
        if frames is None:
            return          # refused the handshake and closed: fine if it said why
        for fr in frames:
            _check_frame(fr, findings, {0: first})
            answered = True
            hello_ok = hello_ok and "result" in fr
    if not answered:
        findings.hangs.append({"op": "hello", "request": _short(first.frame)})
        return
    if not hello_ok:
        return
    sent: dict[int, ff.Input] = {}
    expected: dict[int, int] = {}
    data = b"".join(i.data for i in rest)
    for inp in rest:
        if inp.rid is not None:
            sent[inp.rid] = inp
            expected[inp.rid] = expected.get(inp.rid, 0) + 1
    if ending == "drop":
        conn.send(data)
        return
    if not conn.send(data):
        return
    deadline = time.monotonic() + deadline_s
    last: list = []
    while any(expected.values()) and time.monotonic() < deadline and not conn.closed:
        frames = conn.recv(deadline)
        if frames is None:
            break
        last = (last + frames)[-3:]
        for fr in frames:
            rid, final = _check_frame(fr, findings, sent)
            if final and rid in expected and expected[rid] > 0:
                expected[rid] -= 1
            res = fr.get("result") if isinstance(fr, dict) else None
            if isinstance(res, dict) and rid in sent and sent[rid].op == "create" and "id" in res:
                created.add(res["id"])
    for rid, n in expected.items():
        same = [i for i in rest if i.rid == rid]   # an id may be reused: all are suspects
        if n and not any(i.op in LONG_OPS for i in same):
            findings.hangs.append({"ops": [i.op for i in same],
                                   "requests": [_short(i.frame, 400) for i in same],
                                   "closed_by_daemon": conn.closed, "last_answers": _short(last)})
    if ending == "oversize":
        if conn.send(protocol.HEADER.pack(target.max_frame + 1)):
            _expect_error(conn, findings, "limit", deadline_s)
    elif ending == "truncated":
        conn.send(protocol.HEADER.pack(1000) + b"\x81\xa2id")
    elif ending == "partial_header":
        conn.send(b"\x00\x00")


def _expect_error(conn, findings: Findings, code: str, deadline_s: float) -> None:
    """After an oversized header: an error `code` with id null, then the close.
    Answers to earlier frames may still arrive first (checked as usual)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        frames = conn.recv(deadline)
        if frames is None:
            break
        for fr in frames:
            _check_frame(fr, findings, {})
            if isinstance(fr, dict) and fr.get("id") is None and "error" in fr and \
                    isinstance(fr["error"], dict) and fr["error"].get("code") == code:
                return
    findings.malformed.append({"expected": f"a `{code}` error before the close",
                               "closed": conn.closed})


def busybox_rootfs() -> str:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "mkrootfs.sh")], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- a campaign


def campaign(target: FuzzTarget, n_inputs: int, seed: int, mutants: int = 3,
             max_per_session: int = 16, deadline_s: float = 5.0,
             progress=None) -> Findings:
    """At least n_inputs inputs (generated + mutated), reproducible by `seed`."""
    findings = Findings()
    rng = random.Random(seed)
    pool: list = []

    def one(data) -> int:
        before = findings.inputs
        first, rest, ending = data.draw(ff.sessions(target.ctx, max_per_session))
        for inp in rest:
            args = inp.frame.get("args") if isinstance(inp.frame, dict) else None
            if isinstance(args, dict):
                for v in args.values():
                    if len(pool) < 2000:
                        pool.append(v)
                    else:
                        pool[rng.randrange(len(pool))] = v
        mixed = []
        for inp in rest:
            mixed.append(inp)
            mixed += [mutate(inp, rng, pool) for _ in range(mutants)]
        run_session(target, first, mixed, ending, findings, deadline_s)
        if progress and findings.sessions % 200 == 0:
            progress(findings)
        return findings.inputs - before

    ff.run_passes(one, n_inputs, 1 + (max_per_session / 2) * (1 + mutants), seed)
    return findings
