"""The compiled BPF object cache (dsecd/net/bpfobj.py): compiled once by a helper
process, loaded by later processes without bcc; a corrupt or stale object is rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_net_kit import bpf_skip_reason

from dsecd.net import bpfobj

pytestmark = pytest.mark.skipif(bpf_skip_reason() is not None, reason=bpf_skip_reason() or "")

# Small maps: another cache key than the daemon's default sizes, and quick to allocate.
LOAD = """
import json, sys
from dsecd.net.policy import Engine
e = Engine(64, 1024, 1024, cache_dir=sys.argv[1])
e.set_level(2)
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
print(json.dumps({"stats": e.load_stats, "bcc_imported": "bcc" in sys.modules, "rss_mib": rss}))
"""


def load(cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD, str(cache)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def first_compile(tmp_path_factory) -> tuple[Path, dict]:
    """(cache dir, what the load said) of a load into an empty cache: a
    compile (a clang run of 7-15 s here) the module's tests start from."""
    cache = tmp_path_factory.mktemp("bpf-first") / "bpf"
    return cache, load(cache)


def test_compiled_once_then_loaded_from_cache_without_bcc(first_compile):
    cache, a = first_compile
    assert a["stats"]["object"] == "compiled" and a["stats"]["rebuilt_because"] == "none cached"
    b = load(cache)
    assert b["stats"]["object"] == "cached" and "compile_ms" not in b["stats"]
    assert b["stats"]["path"] == a["stats"]["path"] and Path(b["stats"]["path"]).is_file()
    # bcc (libbcc + LLVM) never enters the loading process, compiled or cached.
    assert not a["bcc_imported"] and not b["bcc_imported"]
    assert b["rss_mib"] < 100, b


def test_corrupt_object_is_rebuilt_and_stale_one_refused(first_compile, tmp_path):
    # A copy of the first compile's cache, this test's to break.
    cache = tmp_path / "bpf"
    shutil.copytree(first_compile[0], cache)
    path = cache / Path(first_compile[1]["stats"]["path"]).relative_to(first_compile[0])
    assert path.is_file()
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF                                   # a flipped byte in the body
    path.write_bytes(bytes(data))
    r = load(cache)
    assert r["stats"]["object"] == "compiled" and "checksum" in r["stats"]["rebuilt_because"]
    assert load(cache)["stats"]["object"] == "cached"
    # An object written for another key (other source, kernel, bcc) is never loaded.
    good = path.read_bytes()
    body = json.loads(good.split(b"\n", 2)[2])
    body["key"] = "0" * 64
    stale = bpfobj.encode(body["key"], body["maps"], body["progs"])
    with pytest.raises(bpfobj.ObjectError, match="stale"):
        bpfobj.decode(stale, json.loads(good.split(b"\n", 2)[2])["key"])
    path.write_bytes(stale)
    r = load(cache)
    assert r["stats"]["object"] == "compiled" and "stale" in r["stats"]["rebuilt_because"]
    with pytest.raises(bpfobj.ObjectError, match="magic"):
        bpfobj.decode(b"garbage", "k")


def _helpers_writing_into(cache: Path) -> list[int]:
    """Pids of compile helpers whose output goes under `cache` (this test's own dir)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsecd.net.bpfobj" in argv and any(a.startswith(str(cache).encode()) for a in argv):
            pids.append(int(pid))
    return pids


def test_the_compile_helper_dies_with_the_process_that_started_it(tmp_path):
    cache = tmp_path / "bpf"
    loader = subprocess.Popen([sys.executable, "-c", LOAD, str(cache)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (helpers := _helpers_writing_into(cache)):
            assert loader.poll() is None and time.monotonic() < deadline, "no compile helper was seen"
            time.sleep(0.02)
    finally:
        loader.kill()
        loader.wait()
    deadline = time.monotonic() + 10
    while _helpers_writing_into(cache) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _helpers_writing_into(cache)
    for pid in left:                       # (the test's own helper: never leave it running)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"compile helper(s) {helpers} outlived the process that started them"
