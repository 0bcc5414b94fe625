"""A FUSE file system whose reads the test holds (`gate_fuse.c`): a slow or
stuck file system in a client's build context, without any package beyond
libfuse3 (the pager's own build needs it).

    fs = GateFuse(binary, mountpoint, size=8 << 20, gate_open=2, gate_offset=2 << 20)
    fs.wait_for("held 2")      # the second open's read at 2 MiB waits ...
    fs.open_gate()             # ... until this
    fs.offsets(2)              # the offsets open 2 read
    fs.close()                 # the gate opened, unmounted, the server ended
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def gate_fuse_binary(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build tests/integration/gate_fuse.c (apt-get install gcc)")
    if not Path("/dev/fuse").exists() or shutil.which("fusermount3") is None:
        pytest.skip("no /dev/fuse or fusermount3")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        pytest.skip("no libfuse3 development files (apt-get install libfuse3-dev)")
    exe = tmp_path_factory.mktemp("gate-fuse") / "gate_fuse"
    built = subprocess.run([cc, "-O1", "-o", str(exe), str(HERE / "gate_fuse.c"), *flags.stdout.split()],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"cannot build gate_fuse: {built.stderr[-500:]}")
    return exe


class GateFuse:
    """gate_fuse mounted at `mountpoint` (made if missing): one file, `big`,
    of `size` bytes; reads of open `gate_open` or later at `gate_offset` or
    past it wait for open_gate()."""

    def __init__(self, binary: Path, mountpoint: Path, size: int, gate_open: int, gate_offset: int):
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mountpoint = mountpoint
        self.gate = mountpoint.parent / f".{mountpoint.name}-gate-open"
        self.lines: list[str] = []
        self._new: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen([str(binary), str(mountpoint), str(size), str(gate_open), str(gate_offset),
                                      str(self.gate)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.wait_for("mounted", 10)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            self._new.put(line.strip())
        self._new.put("")             # the server ended

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        """The first line starting with `prefix`, seen or to come."""
        for line in list(self.lines):
            if line.startswith(prefix):
                return line
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"gate_fuse: no {prefix!r} in {timeout} s; it said {self.lines[-10:]}") \
                    from None
            if line.startswith(prefix):
                return line
            if line == "" and self.proc.poll() is not None:
                raise RuntimeError(f"gate_fuse ended: {self.proc.stderr.read()[-500:]}")

    def open_gate(self) -> None:
        self.gate.touch()

    def offsets(self, n: int) -> list[int]:
        """The offsets open `n` read at, in order."""
        return [int(line.split()[2]) for line in list(self.lines)
                if line.startswith("read ") and int(line.split()[1]) == n]

    def close(self) -> None:
        self.open_gate()                 # nothing stays held by it
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()             # ends the connection of a mount some clone still holds
            self.proc.wait(30)
        self._reader.join(30)
        # Closed now, not when the Popen is collected: a later test in this
        # process may count its open fds.
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.gate.unlink(missing_ok=True)
