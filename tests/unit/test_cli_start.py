"""`dsec`'s start, through its console script as pip writes it: a ^C at
any moment of a command, from the first line of its entry point on, is
said in one line and exits 130, never a traceback, however early it comes
(while dsec is still importing its client, parsing its arguments, or
connecting); --help and a usage error import neither the client nor
asyncio."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _console_script(tmp_path: Path) -> tuple[Path, str]:
    """The `dsec` console script as pip writes it from pyproject.toml, and
    the module it imports first."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["dsec"]
    module, func = target.split(":")
    script = tmp_path / "dsec"
    script.write_text(f"#!{sys.executable}\n"
                      "# -*- coding: utf-8 -*-\n"
                      "import re\n"
                      "import sys\n"
                      f"from {module} import {func}\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({func}())\n")
    script.chmod(0o755)
    return script, module


def _imported(line: str) -> str | None:
    """The module a line of -X importtime's output says was imported."""
    return line.rsplit("|", 1)[1].strip() if line.startswith("import time:") else None


@pytest.mark.parametrize("json_output", [False, True])
def test_a_sigint_early_in_a_command_is_said_in_one_line_and_exits_130(tmp_path, json_output):
    script, entry = _console_script(tmp_path)
    # A daemon's socket that never answers: the command waits for its hello
    # as long as the test lets it.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "dsecd.sock"))
    listener.listen(8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), DSEC_SOCKET=str(tmp_path / "dsecd.sock"),
               # Each import said on stderr as it ends: the moment dsec's entry module
               # has run is the one the delays count from.
               PYTHONPROFILEIMPORTTIME="1")
    try:
        for delay_ms in (0, 20, 50, 100, 150):
            p = subprocess.Popen([str(script), *(["--json"] if json_output else []), "ps"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
            lines: queue.Queue[str | None] = queue.Queue()

            def read(p=p, lines=lines):
                for line in p.stderr:
                    lines.put(line)
                lines.put(None)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            said: list[str] = []
            try:
                while True:
                    line = lines.get(timeout=60)
                    assert line is not None, f"dsec ended before importing {entry}: {''.join(said)}"
                    said.append(line)
                    if _imported(line) == entry:
                        break
                time.sleep(delay_ms / 1000)
                p.send_signal(signal.SIGINT)
                p.wait(timeout=60)
                out = p.stdout.read()       # a few lines at most: they fit the pipe
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()
            reader.join(timeout=60)
            while (line := lines.get(timeout=60)) is not None:
                said.append(line)
            own = [line.rstrip("\n") for line in said if _imported(line) is None]
            assert (p.returncode, own) == (130, ["dsec ps: interrupted (SIGINT)"]), (delay_ms, "".join(said))
            if json_output:
                assert '"code": "interrupted"' in out and '"signal": "SIGINT"' in out, (delay_ms, out)
            else:
                assert out == "", (delay_ms, out)
    finally:
        listener.close()


@pytest.mark.parametrize("args,status", [(["--help"], 0), (["--version"], 0), (["--json", "--version"], 0),
                                         (["version"], 2), (["ps", "--help"], 0),
                                         (["exec", "--help"], 0), (["fleet", "--help"], 0),
                                         (["top", "--sort", "nosuch"], 2)])
def test_help_and_usage_errors_import_neither_the_client_nor_asyncio(tmp_path, args, status):
    script, _ = _console_script(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), PYTHONPROFILEIMPORTTIME="1")
    r = subprocess.run([str(script), *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == status, r.stderr
    imported = {_imported(line) for line in r.stderr.splitlines()} - {None}
    assert "dsecd.cliargs" in imported
    assert not imported & {"asyncio", "dsecd.client", "dsecd.protocol", "dsecd.cli", "dsecd.fleet"}, \
        sorted(m for m in imported if m.startswith("dsecd") or m.startswith("asyncio"))
