"""The README is executed: every line of its usage block (```sh) runs, in
order, as one shell session against a private daemon, and ends with the exit
status its comment documents ("exits N"; 0 otherwise). The Python SDK example
runs too. A README line that rots fails here.

What the session gets instead of a real host: DSEC_SOCKET names the private
daemon, the daemon's bridge lives in a test-owned netns (test_net_kit.World),
and the working directory holds the files the README says stand for the
user's own (`app.tar`, `./workspace`, `./Dockerfile`, `./a.py`). Lines that
need another host are skipped with the reason in SKIPPED.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from image_kit import docker_save, rootfs_layer
from test_net_daemon import _toml_net
from test_net_kit import bpf_skip_reason

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

# What a line prints, by a piece of its text: (needle, "out" or "err", expected).
OUTPUTS = [("echo out; echo err >&2", "out", "out\n"), ("echo out; echo err >&2", "err", "err\n"),
           ("echo data | dsec exec -i", "out", "data\n"), ("--timeout 2 -- sleep 10", "err", "timed out"),
           ("dsec events --replay --no-follow", "out", "created"), ("dsec ps ;", "out", "busybox"),
           ("-f Dockerfile ./workspace", "out", "built repo-2: "),
           ("dsec run --env K=V", "out", "V\n"),
           ("--policy grader $AG -- cat /grader/answers", "out", "print(1)"),
           ("dsec exec $AG -- cat /grader/answers", "err", "Permission denied"),
           ("dsec events $AG --replay", "out", "path=/grader/answers")]

# Lines that cannot run on one test host, by their start.
SKIPPED = {"ssh ": "needs another host running dsecd"}
NEEDS_BPF = ("--net default", "dsec net ")


def shell_lines() -> list[str]:
    """The lines of the README's ```sh blocks, in order."""
    blocks = re.findall(r"^```sh\n(.*?)^```", README, re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def python_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert len(blocks) == 1, "the README has one Python SDK example"
    return blocks[0]


def documented_status(line: str) -> int:
    """The status a line's comment documents ("... exits 3"), else 0."""
    comment = line.partition("  #")[2]
    m = re.search(r"\bexits (\d+)\b", comment)
    return int(m.group(1)) if m else 0


def skip_reason(line: str) -> str | None:
    for start, why in SKIPPED.items():
        if line.startswith(start):
            return why
    if any(s in line for s in NEEDS_BPF):
        return bpf_skip_reason()
    return None


def skipped_lines(lines: list[tuple[int, str]]) -> dict[int, str]:
    """{line number: why} of the lines not run: those skip_reason names, and
    those that use a variable a skipped line sets (`dsec port $NET` after
    `NET=$(dsec create --net default ...)`), which would run on an empty
    one and fail for that alone."""
    skipped: dict[int, str] = {}
    unset: dict[str, int] = {}          # variable -> the skipped line that sets it
    for n, line in lines:
        why = skip_reason(line)
        if why is None:
            used = [var for var in unset if re.search(rf"\${{?{var}\b", line)]
            if used:
                why = f"uses ${used[0]}, set by line {unset[used[0]]}, which is not run"
        if why is not None:
            skipped[n] = why
            for var in re.findall(r"(?:^|[;&|]\s*)([A-Za-z_]\w*)=", line):
                unset.setdefault(var, n)
    return skipped


def session_script(lines: list[tuple[int, str]], status_file: Path, out_dir: Path) -> str:
    """One bash script that runs each line in the current shell (so SB=... lasts)
    and records its status, and the status of any command in it that failed."""
    parts = ["set -o pipefail", f'exec 3>"{status_file}"', 'trap \'echo "failed $N $?" >&3\' ERR']
    for n, line in lines:
        parts.append(f"N={n}")
        parts.append(f'{{ {line}\n}} >"{out_dir}/{n}.out" 2>"{out_dir}/{n}.err" </dev/null')
        parts.append(f'echo "status {n} $?" >&3')
    return "\n".join(parts) + "\n"


@pytest.fixture
def readme_daemon(world, daemon_factory, busybox_rootfs):
    cfg = dict(world.cfg, ipv4_pool=f"10.{world.octet}.4.0/24")
    assert busybox_rootfs == "/var/cache/dsecd/rootfs-busybox", "the README names this path"
    return daemon_factory(_toml_net(cfg))


def user_files(work: Path, rootfs: str) -> None:
    """The files the README says stand for the user's own."""
    docker_save(work / "app.tar", [rootfs_layer(rootfs)], {"Env": ["APP=1"]})
    (work / "workspace").mkdir()
    (work / "workspace" / "README").write_text("the repository under test\n")
    (work / "Dockerfile").write_text("FROM busybox\nARG V=1\nCOPY README /src/\n"
                                     "RUN wc -l < /src/README > /src/lines && echo v$V > /src/version\n"
                                     'CMD ["cat", "/src/version"]\n')
    (work / "a.py").write_text("print(1)\nprint(2)\n")


def session_env(d) -> dict:
    return {**os.environ, "DSEC_SOCKET": d.socket,
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def test_every_usage_line_of_the_readme_runs_as_documented(readme_daemon, busybox_rootfs, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    user_files(work, busybox_rootfs)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    lines = list(enumerate(shell_lines(), 1))
    assert len(lines) >= 20, "the README's usage block was not found"
    skipped = skipped_lines(lines)
    to_run = [(n, line) for n, line in lines if n not in skipped]
    status_file = tmp_path / "status"
    script = tmp_path / "session.sh"
    script.write_text(session_script(to_run, status_file, out_dir))
    subprocess.run(["bash", str(script)], cwd=work, env=session_env(readme_daemon), timeout=600,
                   stdin=subprocess.DEVNULL, check=False)

    status: dict[int, int] = {}
    failed: dict[int, list[int]] = {}
    for record in status_file.read_text().splitlines():
        kind, n, code = record.split()
        if kind == "status":
            status[int(n)] = int(code)
        else:
            failed.setdefault(int(n), []).append(int(code))
    problems = []
    for n, line in to_run:
        want = documented_status(line)
        got, inner = status.get(n), failed.get(n, [])
        # A documented failure is the line's last command, and its only one.
        if got != want or inner != ([want] if want else []):
            err = (out_dir / f"{n}.err").read_text(errors="replace")[-600:]
            problems.append(f"line {n}: {line}\n  exit {got} (documented {want}), failed commands' "
                            f"statuses {inner}\n  stderr: {err}")
    assert not problems, "README lines that do not work as written:\n" + "\n".join(problems)
    # What the lines say they do, they did.
    for n, line in to_run:
        for needle, stream, expected in OUTPUTS:
            if needle in line:
                got = (out_dir / f"{n}.{stream}").read_text(errors="replace")
                assert expected in got, f"line {n}: {line}\n  {stream} lacks {expected!r}: {got[-400:]!r}"
    assert (work / "out.txt").read_text().split()[0] == "2"
    assert (work / "trace.txt").stat().st_size > 0
    for n, why in skipped.items():
        warnings.warn(f"README line {n} not run: {why}", stacklevel=1)


def test_the_readme_python_example_runs(readme_daemon, busybox_rootfs, tmp_path):
    c = readme_daemon.client()
    c.import_image(busybox_rootfs, "busybox")
    c.close()
    program = ("import asyncio\nimport dsecd\n\n\nasync def main():\n"
               + textwrap.indent(python_example(), "    ") + "\n\nasyncio.run(main())\n")
    r = subprocess.run([sys.executable, "-c", program], env=session_env(readme_daemon),
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert b"done" in r.stdout


def test_the_readme_names_nothing_outside_the_repo():
    assert "../shared" not in README
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which is not in the repo"


def test_a_line_that_uses_what_a_skipped_line_sets_is_skipped_too(monkeypatch):
    """Where BPF is missing, the --net default create is not run: the lines
    naming its sandbox ($NET) are not run either, rather than fail on an
    empty id."""
    monkeypatch.setattr(sys.modules[__name__], "bpf_skip_reason", lambda: "no BPF here")
    lines = list(enumerate(shell_lines(), 1))
    skipped = skipped_lines(lines)
    uses_net = [n for n, line in lines if "$NET" in line]
    assert uses_net and all(n in skipped for n in uses_net), [lines[n - 1] for n in uses_net if n not in skipped]
    assert not any("$SB" in lines[n - 1][1] for n in skipped), "lines of a sandbox made without BPF still run"


@pytest.mark.parametrize("line,want", [("dsec exec $SB -- sh -c 'exit 3'     # streams both, exits 3", 3),
                                       ("dsec exec $SB --timeout 2 -- sleep 10   # says so, exits 124", 124),
                                       ("dsec ps   # lists", 0), ("echo 'exits 5'", 0)])
def test_documented_status_is_read_from_the_comment(line, want):
    assert documented_status(line) == want
