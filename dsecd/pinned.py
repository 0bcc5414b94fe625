"""The code a running daemon execs and imports late, pinned at its start.

An upgrade in place (`git pull && bash scripts/setup.sh`, then a restart a
while later) rewrites the checkout under a running daemon. The daemon runs
the Python it loaded at start, but it also takes files from disk as it
goes: dsec-init for every new container, its helpers run as `python -m
dsecd....` (the BPF compile, the tracer), the BPF sources, the pager and
the guest agent binaries, and modules it imports inside functions. Taken
from the new checkout they no longer match the old daemon (a BPF object
the new helper writes under another key than the old daemon asks for; an
init speaking another channel version).

So `pin()` copies that code at start (the `dsecd` package, its libexec
binaries, `bpf/`) into `<state_dir>/code/<digest>` (made once per version:
a restart of the same version finds it there), and everything the daemon
execs or imports later comes from that copy: `root()` instead of the
checkout, `helper_options()` for `python -m` helpers, and the package's
`__path__` pointed at it for late imports. What the installed files are
now is compared with what they were at start (`changed()`, a stat of each
file: ~1 ms) so `dsec info` can say a restart would finish an upgrade.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHECKOUT = Path(__file__).resolve().parents[1]    # holds dsecd/ and bpf/
CODE_DIRS = ("dsecd", "bpf")
SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = (".pyc", ".tmp")


def code_files(top: Path) -> list[str]:
    """Paths under `top` (relative, sorted) of the code a daemon runs."""
    out = []
    for name in CODE_DIRS:
        for dirpath, dirnames, filenames in os.walk(top / name):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            rel = Path(dirpath).relative_to(top)
            out += [str(rel / f) for f in filenames if not f.endswith(SKIP_SUFFIXES)]
    return sorted(out)


def _signature(top: Path, rel: str) -> tuple[int, int, int] | None:
    """What changes when an install rewrites or replaces a file (None: gone)."""
    try:
        st = os.stat(top / rel)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class Pinned:
    """The copy this daemon runs from, and the installed files as they were."""

    source: Path                 # the checkout the daemon was started from
    root: Path                   # the copy: <state_dir>/code/<digest>
    digest: str
    at_start: dict[str, tuple[int, int, int] | None]

    def changed(self) -> list[str]:
        """Installed files added, removed or rewritten since the start."""
        now = set(code_files(self.source))
        gone = [rel for rel in self.at_start if rel not in now]
        differ = [rel for rel in sorted(now) if rel not in self.at_start
                  or _signature(self.source, rel) != self.at_start[rel]]
        return sorted(gone + differ)

    def info(self) -> dict:
        changed = self.changed()
        return {"running_from": str(self.root), "installed": str(self.source), "digest": self.digest[:16],
                "installed_changed": changed[:20], "installed_changed_count": len(changed)}


_current: Pinned | None = None


def root() -> Path:
    """Where the daemon's code is: the pinned copy, else (not pinned: tools,
    tests, the helpers themselves, which run from the copy) the checkout
    this module was imported from."""
    return _current.root if _current is not None else CHECKOUT


def libexec(name: str) -> Path:
    """A binary of dsecd/libexec (dsec-init, dsec-pager, dsec-guest-agent)
    as this daemon's code holds it (root())."""
    return root() / "dsecd" / "libexec" / name


def current() -> Pinned | None:
    return _current


def helper_options() -> dict:
    """subprocess's `env` and `cwd` for a `python -m dsecd....` helper, so
    that it imports this daemon's code: the pinned copy first on its path,
    and as its working directory (`-m` puts that first of all: a daemon
    started by hand in a checkout would give its helpers that checkout)."""
    if _current is None:
        return {}
    env = dict(os.environ)
    rest = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(_current.root) + (os.pathsep + rest if rest else "")
    return {"env": env, "cwd": str(_current.root)}


def pin(state_dir: str | Path) -> Pinned:
    """Copy the code into `<state_dir>/code/<digest>` (unless there) and run
    from it from now on; other versions' copies there are removed (their
    sandboxes' inits keep their files open)."""
    global _current
    source = CHECKOUT
    files = code_files(source)
    at_start = {rel: _signature(source, rel) for rel in files}
    h = hashlib.sha256()
    contents = {}
    for rel in files:
        data = (source / rel).read_bytes()
        contents[rel] = data
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    digest = h.hexdigest()
    base = Path(state_dir) / "code"
    copy = base / digest[:16]
    if not copy.is_dir():
        _write_copy(base, copy, source, contents)
    for old in base.iterdir():
        if old != copy:
            shutil.rmtree(old, ignore_errors=True)
    _current = Pinned(source, copy, digest, at_start)
    _redirect_packages(source, copy)
    log.info("running from a copy of the code: %s (installed: %s)", copy, source,
             extra={"fields": {"event": "code_pinned", "path": str(copy), "digest": digest[:16]}})
    return _current


def _write_copy(base: Path, copy: Path, source: Path, contents: dict[str, bytes]) -> None:
    """Whole or not at all: written aside, then renamed into place."""
    tmp = base / f".{copy.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, data in contents.items():
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        dst.write_bytes(data)
        os.chmod(dst, os.stat(source / rel).st_mode & 0o7777)
    os.chmod(tmp, 0o755)
    os.rename(tmp, copy)


def _redirect_packages(source: Path, copy: Path) -> None:
    """Point every loaded dsecd package's __path__ at the copy: a module the
    daemon imports inside a function comes from the code it started with."""
    old, new = str(source), str(copy)
    for name, mod in list(sys.modules.items()):
        if name != "dsecd" and not name.startswith("dsecd."):
            continue
        path = getattr(mod, "__path__", None)
        if path is None:
            continue
        mod.__path__ = [new + p[len(old):] if p.startswith(old + os.sep) else p for p in path]
