"""Dockerfile builds (`dsec image build -f`): a Python-project-like image from
the local busybox image, its files and config, RUN failures naming their
line, the step cache (what a changed COPY reruns, --no-cache, gc), the
.dockerignore, ADD of an archive, the CLI, and the network RUN steps get."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import VENV_BIN
from fuse_kit import GateFuse

from dsecd import Client
from dsecd.errors import BadRequest, DsecError
from dsecd.imageconfig import DEFAULT_PATH

PROJECT_DOCKERFILE = """\
# syntax=docker/dockerfile:1
# A Python project, as far as busybox goes: sources copied in, a RUN that
# "compiles" them (a manifest and checksums), an unprivileged user.
ARG BASE=busybox
FROM ${BASE}
ARG VERSION=0.1
ENV APP_HOME=/app \\
    APP_VERSION=$VERSION
WORKDIR $APP_HOME
RUN echo 'app:x:1000:1000::/home/app:/bin/sh' >> /etc/passwd && echo 'app:x:1000:' >> /etc/group \\
 && mkdir -p /home/app && chown app:app /home/app
COPY --chown=app:app pyproject.toml ./
COPY src/ ./src/
RUN find src -name '*.py' | sort > MANIFEST \\
 && sed -n 's/^version = //p' pyproject.toml > VERSION.txt \\
 && md5sum src/app/*.py > CHECKSUMS
USER app
LABEL org.example.project="demo" maintainer="dev@example.org"
EXPOSE 8000 9000/udp
CMD python3 -m app
"""


def write_project(root, dockerfile: str = PROJECT_DOCKERFILE):
    (root / "src" / "app" / "__pycache__").mkdir(parents=True)
    (root / "src" / "app" / "__init__.py").write_text("")
    (root / "src" / "app" / "__main__.py").write_text("print('hello from app')\n")
    (root / "src" / "app" / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\0junk")
    (root / "pyproject.toml").write_text('[project]\nname = "app"\nversion = "0.2"\n')
    (root / "secrets").mkdir()
    (root / "secrets" / "key.pem").write_text("not for the image\n")
    (root / "secrets" / "public.txt").write_text("may go in\n")
    (root / "build.log").write_text("noise\n")
    (root / ".dockerignore").write_text("# what the image never sees\n**/__pycache__\n*.log\nsecrets\n"
                                        "!secrets/public.txt\n")
    (root / "Dockerfile").write_text(dockerfile)
    return root


def sh(sb, script: str, **kw) -> str:
    r = sb.exec(["sh", "-c", script], **kw)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout.decode()


def test_a_python_project_builds_with_its_files_and_config(client, tmp_path):
    ctx = write_project(tmp_path / "ctx")
    events = []
    img = client.build_dockerfile(str(ctx), "pyproj", build_args={"VERSION": "0.2"}, progress=events.append)
    cfg = img["config"]
    # The imported busybox has no PATH: the build gives it the default one, as BuildKit does.
    assert cfg["env"] == {"PATH": DEFAULT_PATH, "APP_HOME": "/app", "APP_VERSION": "0.2"}
    assert cfg["cwd"] == "/app" and cfg["user"] == "app"
    assert cfg["cmd"] == ["/bin/sh", "-c", "python3 -m app"] and cfg["entrypoint"] == []
    assert cfg["exposed_ports"] == ["8000/tcp", "9000/udp"]
    assert cfg["labels"] == {"org.example.project": "demo", "maintainer": "dev@example.org"}
    assert [s["line"] for s in img["steps"]][:3] == [5, 6, 7]
    assert [s["line"] for s in img["steps"]][-4:] == [17, 18, 19, 20]
    assert img["steps"][0]["instruction"] == "FROM busybox" and len(img["steps"]) == 12
    # One layer per filesystem step that changed something (WORKDIR, RUN, 2 COPY, RUN) on busybox's.
    assert len(img["layers"]) == 1 + 5
    kinds = {e["event"] for e in events}
    assert {"step", "step_done"} <= kinds
    assert [e["step"] for e in events if e["event"] == "step_done"] == list(range(1, 13))

    sb = client.create(image="pyproj")
    try:
        assert sh(sb, "cat /app/MANIFEST") == "src/app/__init__.py\nsrc/app/__main__.py\n"
        assert sh(sb, "cat /app/VERSION.txt") == '"0.2"\n'
        assert sh(sb, "cd /app && md5sum -c CHECKSUMS").count("OK") == 2
        assert sh(sb, "stat -c '%u:%g %a' /app/pyproject.toml") == "1000:1000 644\n"
        assert sh(sb, "grep '^app:' /etc/passwd | cut -d: -f3,6") == "1000:/home/app\n"
        # .dockerignore: the pycache and the log never reached the image.
        assert sh(sb, "find /app | sort") == ("/app\n/app/CHECKSUMS\n/app/MANIFEST\n/app/VERSION.txt\n"
                                              "/app/pyproject.toml\n/app/src\n/app/src/app\n"
                                              "/app/src/app/__init__.py\n/app/src/app/__main__.py\n")
    finally:
        sb.destroy()


@pytest.mark.parametrize("rule, words", [("no-such-set", "unknown rule set 'no-such-set'"),
                                         ("10.0.0.0/33:80", "10.0.0.0/33")])
def test_a_bad_allow_rule_fails_the_build_before_its_first_step(client, tmp_path, rule, words):
    (tmp_path / "f").write_text("x")
    events = []
    with pytest.raises(BadRequest) as e:
        client.build_dockerfile(str(tmp_path), "bad-allow", text="FROM busybox\nCOPY f /f\nRUN true\n",
                                allow=[rule], progress=events.append)
    assert "--allow" in str(e.value) and words in str(e.value), e.value
    assert not [ev for ev in events if ev.get("event") == "step"], events


@pytest.mark.parametrize("make", ["missing", "a file"])
def test_a_context_that_is_no_directory_fails_a_build_without_copy(client, tmp_path, make):
    """docker build says a bad context at once; a Dockerfile with no COPY
    built from a context that did not exist (a typo) as if it were one."""
    ctx = tmp_path / "ctx"
    if make == "a file":
        ctx.write_text("x")
    with pytest.raises(DsecError) as e:
        client.build_dockerfile(str(ctx), "no-ctx", text="FROM busybox\nRUN true\n")
    assert str(ctx) in e.value.message and e.value.code in ("not_found", "bad_request"), e.value


def test_dockerignore_excludes_files_and_exceptions_come_back(client, tmp_path):
    ctx = write_project(tmp_path / "ctx", "FROM busybox\nCOPY . /ctx/\n")
    client.build_dockerfile(str(ctx), "ignored")
    sb = client.create(image="ignored")
    try:
        listed = sh(sb, "cd /ctx && find . -type f | sort").split()
        assert listed == ["./.dockerignore", "./Dockerfile", "./pyproject.toml", "./secrets/public.txt",
                          "./src/app/__init__.py", "./src/app/__main__.py"]
    finally:
        sb.destroy()
    with pytest.raises(DsecError) as info:
        client.build_dockerfile(str(ctx), "ignored2", text="FROM busybox\n\nCOPY secrets/key.pem /k\n")
    assert info.value.code == "bad_request"
    assert "Dockerfile:3:" in info.value.message and ".dockerignore excludes" in info.value.message


def test_a_fifo_for_a_dockerignore_is_refused_not_waited_on(client, tmp_path):
    """Opening a FIFO for reading waits for a writer: a .dockerignore that is
    one must fail the build, not hold a worker of the daemon until someone
    opens it (a client could take every worker so)."""
    import threading

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "a").write_text("a")
    os.mkfifo(ctx / ".dockerignore")
    answer: list = []

    def build() -> None:
        try:
            client.build_dockerfile(str(ctx), "fifo-ignore", text="FROM busybox\nCOPY a /a\n")
        except DsecError as err:
            answer.append(err)

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(60)
    waited = worker.is_alive()
    if waited:                      # let the daemon's worker go before failing
        os.close(os.open(ctx / ".dockerignore", os.O_WRONLY | os.O_NONBLOCK))
        worker.join(60)
    assert not waited, "the build waited on the FIFO for a writer"
    [err] = answer
    assert err.code == "bad_request" and ".dockerignore is not a file" in err.message, err


def _tar_of(path: Path, name: str, data: bytes) -> None:
    import io

    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("kind", ["COPY f /x/f", "ADD f.tar /x/"])
def test_a_source_changed_after_hashing_never_reaches_the_build_cache(client, tmp_path, kind):
    """A COPY's key hashes its sources when the build is planned; the copy
    reads them steps later. A source changed in between (by the client, or
    by anyone who builds the same Dockerfile to poison its cache) fails
    the step: the cache must not hold other bytes under the key, which the
    next build of the original files would take."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()

    def write(data: bytes) -> None:
        (ctx / "f").write_bytes(data)
        _tar_of(ctx / "f.tar", "f", data)

    write(b"good\n")
    dockerfile = f"FROM busybox\nRUN sleep 3\n{kind}\n"

    def swap(ev: dict) -> None:
        if ev.get("event") == "step" and ev.get("step") == 2:      # the RUN starts: the plan is made
            write(b"evil\n")

    with pytest.raises(DsecError) as err:
        client.build_dockerfile(str(ctx), f"poison-{kind[:3]}", text=dockerfile, progress=swap)
    assert "changed in the build context during the build, after it was hashed" in err.value.message, err.value
    write(b"good\n")
    client.build_dockerfile(str(ctx), f"victim-{kind[:3]}", text=dockerfile)
    sb = client.create(image=f"victim-{kind[:3]}")
    try:
        assert sh(sb, "cat /x/f") == "good\n"
    finally:
        sb.destroy()


def test_an_archive_that_fails_to_extract_is_hashed_again_by_the_next_build(client):
    """The digest cache trusts a file's size and times, which a write
    through a shared mapping of a tmpfs file leaves as they were once its
    pages are dirty. An ADD reads its archive to the end, checking it
    against the step's key, only when the extraction gets there: one that
    fails first (the archive halfway through such a rewrite) must forget
    the archive's digest all the same, or the next build keys the archive
    by its old bytes and takes their layer from the cache."""
    import mmap
    import tempfile

    ctx = Path(tempfile.mkdtemp(prefix="dsecd-test-shm-", dir="/dev/shm"))
    try:
        tars = {}
        for key, name, data in (("old", "f", b"old\n"), ("torn", "../f", b"old\n"), ("new", "f", b"new\n")):
            _tar_of(ctx / "t.tar", name, data)
            tars[key] = (ctx / "t.tar").read_bytes()
        assert len({len(t) for t in tars.values()}) == 1
        (ctx / "f.tar").write_bytes(tars["old"])
        fd = os.open(ctx / "f.tar", os.O_RDWR)
        try:
            m = mmap.mmap(fd, len(tars["old"]))
            for off in range(0, len(m), mmap.PAGESIZE):       # each page dirty: later writes move no time
                m[off] = m[off]
            st = os.stat(ctx / "f.tar")
            client.build_dockerfile(str(ctx), "archive-old", text="FROM busybox\nADD f.tar /x/\n")
            m[:] = tars["torn"]
            with pytest.raises(DsecError) as err:
                client.build_dockerfile(str(ctx), "archive-torn", text="FROM busybox\nADD f.tar /y/\n")
            assert "'..' component" in err.value.message, err.value
            m[:] = tars["new"]
            after = os.stat(ctx / "f.tar")
            assert (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (st.st_size, st.st_mtime_ns,
                                                                             st.st_ctime_ns)
            client.build_dockerfile(str(ctx), "archive-new", text="FROM busybox\nADD f.tar /x/\n")
            m.close()
        finally:
            os.close(fd)
        sb = client.create(image="archive-new")
        try:
            assert sh(sb, "cat /x/f") == "new\n"
        finally:
            sb.destroy()
    finally:
        shutil.rmtree(ctx)


def test_a_rebuild_does_not_read_unchanged_context_files_again(client, tmp_path):
    """The service keeps the digests of context files across builds, by
    the file (device, inode, size, times): each build attaches its context
    at a path of its own, and an unchanged file is not read to be hashed
    again (its COPY, cached, reads nothing either)."""
    import ctypes
    import struct

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "data").write_bytes(os.urandom(1 << 16))
    dockerfile = "FROM busybox\nCOPY data /data\n"
    client.build_dockerfile(str(ctx), "reread-1", text=dockerfile)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(ctx / "data"), 0x01) >= 0    # IN_ACCESS
    try:
        second = client.build_dockerfile(str(ctx), "reread-2", text=dockerfile)
        try:
            events = os.read(fd, 4096)
        except BlockingIOError:
            events = b""
    finally:
        os.close(fd)
    assert all(step["cached"] for step in second["steps"]), second["steps"]
    assert events == b"", f"read {len(events) // struct.calcsize('iIII')} times"


def test_a_failing_run_names_its_line_and_exit_code(client, tmp_path):
    dockerfile = "FROM busybox\nENV A=1\n# a comment\nRUN echo about to fail; \\\n    exit 7\nRUN true\n"
    with pytest.raises(DsecError) as info:
        client.build_dockerfile(str(tmp_path), "failing", text=dockerfile)
    err = info.value
    assert err.code == "io" and err.message.startswith("Dockerfile:4: RUN failed with exit code 7")
    assert err.detail["line"] == 4 and err.detail["exit_code"] == 7
    assert "about to fail" in err.detail["output_tail"]
    assert "failing" not in [i["name"] for i in client.list_images()]
    assert client.list() == []                    # the step's sandbox is gone


def test_a_run_killed_by_the_build_memory_limit_says_so(daemon_factory, busybox_rootfs, tmp_path):
    """A RUN the OOM killer ends names the limit it hit, not only signal 9."""
    d = daemon_factory('[build]\nmemory = "48M"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        dockerfile = "FROM busybox\nRUN x=$(head -c 100000000 /dev/zero | tr '\\0' a); echo ${#x}\n"
        with pytest.raises(DsecError) as info:
            c.build_dockerfile(str(tmp_path), "oom", text=dockerfile)
        err = info.value
        assert err.code == "io" and err.detail["line"] == 2 and err.detail["signal"] == 9, err
        assert err.detail["killed_by"] == "oom"
        assert "memory limit ([build] memory = 48 MiB" in err.message, err.message
    finally:
        c.close()


def test_a_copy_source_larger_than_a_layer_is_refused_before_it_is_hashed(daemon_factory, busybox_rootfs,
                                                                          tmp_path):
    """A sparse file of any size costs its maker nothing (`truncate -s 1T`)
    but hashing it reads every byte: a source larger than a step's layer
    may hold (images.max_layer_bytes) is refused, naming it and the bound."""
    d = daemon_factory('[images]\nmax_layer_bytes = "1M"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        with open(tmp_path / "big", "wb") as f:
            f.truncate(1 << 40)
        with pytest.raises(DsecError) as info:
            c.build_dockerfile(str(tmp_path), "big", text="FROM busybox\nCOPY big /\n")
        err = info.value
        assert err.code == "limit" and err.detail["line"] == 2 and err.detail["path"] == "big", err
        assert "big is 1099511627776 bytes" in err.message and "images.max_layer_bytes (1048576 bytes" \
            in err.message, err.message
        (tmp_path / "big").unlink()
        (tmp_path / "small").write_bytes(b"x" * 4096)
        assert c.build_dockerfile(str(tmp_path), "small", text="FROM busybox\nCOPY small /\n")["name"] == "small"
    finally:
        c.close()


def test_a_copy_whose_files_add_up_past_a_layer_is_refused_before_it_is_hashed(daemon_factory, busybox_rootfs,
                                                                             tmp_path):
    """images.max_layer_bytes bounds a step's layer, not each of its files:
    many files each under it add up to a layer over it, refused before any
    is read, naming the step, the bound and the key."""
    d = daemon_factory('[images]\nmax_layer_bytes = "1M"\n')
    c = d.client()
    try:
        c.import_image(busybox_rootfs, "busybox")
        (tmp_path / "src").mkdir()
        for i in range(3):
            (tmp_path / "src" / f"part{i}").write_bytes(b"p" * (512 << 10))
        with pytest.raises(DsecError) as info:
            c.build_dockerfile(str(tmp_path), "parts", text="FROM busybox\nCOPY src /parts/\n")
        err = info.value
        assert err.code == "limit" and err.detail["line"] == 2, err
        assert (err.detail["size"], err.detail["max_bytes"]) == (3 * (512 << 10), 1 << 20), err
        assert err.message.startswith("Dockerfile:2: COPY src /parts/: its 3 files add up to 1572864 bytes"), \
            err.message
        assert "images.max_layer_bytes (1048576 bytes)" in err.message, err.message
        (tmp_path / "src" / "part2").unlink()
        assert c.build_dockerfile(str(tmp_path), "parts", text="FROM busybox\nCOPY src /parts/\n")["name"] \
            == "parts"
    finally:
        c.close()


@pytest.mark.parametrize("dockerfile,line,code,words", [
    ("FROM busybox\nRUN true\nONBUILD RUN true\n", 3, "unsupported", "ONBUILD is not supported"),
    ("FROM busybox\nHEALTHCHECK CMD true\n", 2, "unsupported", "HEALTHCHECK is not supported"),
    ("FROM busybox\nRUN true\nFROOM busybox\n", 3, "bad_request", "unknown instruction 'FROOM'"),
    ("FROM no-such-image\n", 1, "not_found", "no image named 'no-such-image'"),
    ("FROM busybox\nCOPY missing.txt /x\n", 2, "bad_request", "COPY missing.txt: no such file"),
    ("FROM busybox\nCOPY ../outside /x\n", 2, "bad_request", "outside the build context"),
    ("FROM busybox\nUSER ghost\nRUN true\n", 3, "bad_request", "no user 'ghost'"),
    ("FROM busybox\nCOPY a.txt /tmp/\n", 2, "bad_request", "mount of the build sandbox"),
    ("FROM busybox\nADD https://example.org/x.tgz /x\n", 2, "unsupported", "remote sources"),
    ("FROM busybox\nENV A=${B:?must be set}\n", 2, "bad_request", "B: must be set"),
])
def test_errors_name_the_dockerfile_line(client, tmp_path, dockerfile, line, code, words):
    (tmp_path / "a.txt").write_text("a\n")
    with pytest.raises(DsecError) as info:
        client.build_dockerfile(str(tmp_path), "bad", text=dockerfile)
    assert info.value.code == code, info.value
    assert info.value.message.startswith(f"Dockerfile:{line}: "), info.value.message
    assert words in info.value.message
    assert info.value.detail["line"] == line


TEN_STEPS = """\
FROM busybox
ENV STAGE=build
WORKDIR /srv
COPY deps.txt ./
RUN cat deps.txt | wc -l > deps.count
COPY lib/ ./lib/
RUN ls lib > lib.list
COPY app.txt ./
RUN md5sum app.txt > app.sum
CMD ["cat", "/srv/app.sum"]
"""


def ten_step_context(root):
    root.mkdir()
    (root / "deps.txt").write_text("a\nb\n")
    (root / "lib").mkdir()
    (root / "lib" / "util.txt").write_text("util\n")
    (root / "app.txt").write_text("version 1\n")
    (root / "Dockerfile").write_text(TEN_STEPS)
    return root


def cached_flags(img) -> list[bool]:
    return [s["cached"] for s in img["steps"]]


def test_a_changed_copy_near_the_end_reruns_only_the_steps_after_it(client, tmp_path):
    ctx = ten_step_context(tmp_path / "ctx")
    first = client.build_dockerfile(str(ctx), "ten")
    assert cached_flags(first) == [True] + [False] * 9
    again = client.build_dockerfile(str(ctx), "ten")
    assert cached_flags(again) == [True] * 10 and again["manifest"] == first["manifest"]
    assert again["replaced"] is None

    (ctx / "app.txt").write_text("version 2\n")            # read by the COPY of step 8 only
    changed = client.build_dockerfile(str(ctx), "ten")
    assert cached_flags(changed) == [True] * 7 + [False] * 3
    assert changed["layers"][:-2] == first["layers"][:-2]  # what came before is the same layers
    assert changed["replaced"] == first["manifest"]
    sb = client.create(image="ten")
    try:
        assert sh(sb, "cat app.txt; cat deps.count lib.list", cwd="/srv") == "version 2\n2\nutil.txt\n"
    finally:
        sb.destroy()

    (ctx / "app.txt").chmod(0o600)                          # a mode is content too
    moded = client.build_dockerfile(str(ctx), "ten")
    assert cached_flags(moded) == [True] * 7 + [False] * 3
    uncached = client.build_dockerfile(str(ctx), "ten", no_cache=True)
    assert cached_flags(uncached) == [True] + [False] * 9
    # Layers are reproducible: running every step again made the same image.
    assert uncached["manifest"] == moded["manifest"] and uncached["replaced"] is None


def test_gc_drops_the_cache_of_removed_images_only(client, tmp_path):
    ctx = ten_step_context(tmp_path / "ctx")
    client.build_dockerfile(str(ctx), "kept")
    (ctx / "app.txt").write_text("other\n")
    client.build_dockerfile(str(ctx), "dropped")
    client.request("image_rm", name="dropped")
    gc = client.request("image_gc")
    assert gc["cache_removed"] >= 3 and gc["removed"]        # the changed tail's entries and blobs
    (ctx / "app.txt").write_text("version 1\n")
    assert cached_flags(client.build_dockerfile(str(ctx), "kept")) == [True] * 10
    (ctx / "app.txt").write_text("other\n")
    assert cached_flags(client.build_dockerfile(str(ctx), "dropped")) == [True] * 7 + [False] * 3


def test_a_name_made_from_the_image_it_replaces_names_that_image_as_its_parent(daemon, client, tmp_path):
    """FROM the name being built, a tag promoting a child to its parent's
    name, and a snapshot taking back the name its sandbox was made from:
    each is made, as docker does, and its parent is the image the name
    stood for then, which inspect says was moved on (no loop)."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM busybox\nRUN echo one > /one\n")
    first = client.build_dockerfile(str(ctx), "loop-app")
    (ctx / "Again").write_text("FROM loop-app\nRUN echo two > /two\n")
    r = daemon.cli("image", "build", "-f", str(ctx / "Again"), str(ctx), "--name", "loop-app")
    assert r.returncode == 0, r.stderr
    again = client.inspect_image("loop-app")
    assert (again["parent"], again["parent_manifest"]) == ("loop-app", first["manifest"])
    assert (again["ancestors"], again["ancestors_end"]) == (["loop-app"], "replaced")
    r = daemon.cli("image", "inspect", "loop-app")
    assert "ancestors:     loop-app (the name was moved to another image since)" in r.stdout.decode()

    child = client.build_dockerfile(str(ctx), "loop-child", dockerfile=str(ctx / "Again"))
    assert (child["parent"], child["parent_manifest"]) == ("loop-app", again["manifest"])
    r = daemon.cli("image", "tag", "loop-child", "loop-app")
    assert r.returncode == 0, r.stderr
    promoted = client.inspect_image("loop-app")
    assert promoted["manifest"] == child["manifest"] and promoted["ancestors"] == ["loop-app"]

    with client.sandbox(image="loop-app") as sb:
        client.request("image_rm", name="loop-child")
        client.request("image_rm", name="loop-app")
        snap = sb.snapshot("loop-app")
        assert (snap["parent"], snap["parent_manifest"]) == ("loop-app", child["manifest"])
    assert client.inspect_image("loop-app")["ancestors_end"] == "replaced"


def test_add_extracts_a_local_archive_and_copy_keeps_symlinks(client, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "data.txt").write_text("in the archive\n")
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    ctx = tmp_path / "ctx"
    (ctx / "tree").mkdir(parents=True)
    with tarfile.open(ctx / "pkg.tar.gz", "w:gz") as tf:
        tf.add(src / "pkg", arcname="pkg")
    (ctx / "tree" / "file.txt").write_text("file\n")
    (ctx / "tree" / "link").symlink_to("file.txt")
    dockerfile = textwrap.dedent("""\
        FROM busybox
        ADD pkg.tar.gz /opt/
        ADD --chown=nobody tree/file.txt /opt/plain.txt
        COPY tree /opt/tree
        RUN /opt/pkg/run.sh > /opt/ran
        COPY --chown=nobody tree/file.txt /opt/new/deep/
        COPY --chmod=750 tree/file.txt /srv/m1/m2/
        USER nobody
        WORKDIR /work/nb/sub
        """)
    client.build_dockerfile(str(ctx), "added", text=dockerfile)
    sb = client.create(image="added")
    try:
        assert sh(sb, "cat /opt/pkg/data.txt /opt/ran") == "in the archive\nrun\n"
        assert sh(sb, "stat -c '%U %a' /opt/plain.txt /opt/pkg/run.sh") == "nobody 644\nroot 755\n"
        assert sh(sb, "readlink /opt/tree/link; cat /opt/tree/link") == "file.txt\nfile\n"
        # Directories made for COPY --chown and WORKDIR belong to that user (as BuildKit makes them).
        assert sh(sb, "stat -c %U /opt /opt/new /opt/new/deep /opt/new/deep/file.txt /work /work/nb "
                      "/work/nb/sub") == "root\nnobody\nnobody\nnobody\nroot\nnobody\nnobody\n"
        # --chmod gives its mode to every directory the COPY makes (BuildKit's fsutil MkdirAll).
        assert sh(sb, "stat -c %a /srv /srv/m1 /srv/m1/m2 /srv/m1/m2/file.txt", user=0) == "750\n750\n750\n750\n"
    finally:
        sb.destroy()


USERS_DOCKERFILE = """\
FROM busybox
RUN echo 'app:x:1001:100::/home/app:/bin/sh' >> /etc/passwd && echo 'users:x:100:' >> /etc/group \\
 && echo 'extra:x:2000:app' >> /etc/group && mkdir -m 1777 /out
USER app
RUN id -u > /out/app && id -g >> /out/app && grep ^Groups: /proc/self/status > /out/app-groups
USER 1234:4321
RUN id -g > /out/numeric && touch /out/numeric-file
USER app:extra
RUN id -g > /out/named-group && grep ^Groups: /proc/self/status > /out/named-groups
USER root
COPY --chown=1001 a.txt /newp/deep/a.txt
USER 1001
WORKDIR /wd
"""


def test_build_steps_run_and_write_with_the_ids_docker_gives(client, tmp_path):
    """RUN as USER takes the gid a create would (the user's /etc/passwd gid,
    or the one named) and its supplementary groups (those /etc/group lists
    it in, with a user named alone: BuildKit's too); COPY --chown and WORKDIR take BuildKit's owner rules
    (a numeric uid alone is the gid too), for the directories they make as
    well."""
    (tmp_path / "a.txt").write_text("a\n")
    client.build_dockerfile(str(tmp_path), "ids", text=USERS_DOCKERFILE)
    sb = client.create(image="ids")
    try:
        assert sh(sb, "cat /out/app /out/numeric /out/named-group") == "1001\n100\n4321\n2000\n"
        assert [line.split() for line in sh(sb, "cat /out/app-groups /out/named-groups").splitlines()] == \
            [["Groups:", "100", "2000"], ["Groups:"]]
        assert sh(sb, "stat -c %u:%g /out/numeric-file /newp /newp/deep /newp/deep/a.txt /wd") == \
            "1234:4321\n1001:1001\n1001:1001\n1001:1001\n1001:1001\n"
    finally:
        sb.destroy()


def test_a_glob_that_matches_nothing_copies_nothing_and_says_so(client, tmp_path):
    """As BuildKit: `COPY package.json yarn.lock* ./` is how a Dockerfile copies
    a file that may be missing. A COPY whose globs all match nothing makes
    nothing, its destination neither (BuildKit returns before it)."""
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "..data").write_text("a name, not a way up\n")
    events = []
    client.build_dockerfile(str(tmp_path), "globs", text="FROM busybox\nCOPY a.txt opt*.txt /globbed/\n"
                            "COPY none*.txt /not-made/\nCOPY ..data /\n", progress=events.append)
    sb = client.create(image="globs")
    try:
        assert sh(sb, "ls /globbed; cat /..data; test -e /not-made || echo none") == \
            "a.txt\na name, not a way up\nnone\n"
    finally:
        sb.destroy()
    warnings = [e["message"] for e in events if e.get("event") == "warning"]
    assert any("line 3: COPY none*.txt: no file of the build context matches it" in w for w in warnings), warnings


def test_context_symlinks_lead_from_the_contexts_root_and_keep_dockerignore(client, tmp_path):
    """A source's symlinks are followed inside the context (an absolute
    target from the context's root, as BuildKit does), never to the host's
    files, and never to a file .dockerignore excludes."""
    ctx = tmp_path / "ctx"
    (ctx / "etc").mkdir(parents=True)
    (ctx / "etc" / "hostname").write_text("the context's hostname\n")
    (ctx / "conf").symlink_to("/etc")                 # the host's /etc/hostname exists too
    (ctx / "secrets").mkdir()
    (ctx / "secrets" / "key.pem").write_text("KEY\n")
    (ctx / "key").symlink_to("secrets/key.pem")
    (ctx / ".dockerignore").write_text("secrets\n")
    client.build_dockerfile(str(ctx), "ctx-links", text="FROM busybox\nCOPY conf/hostname /copied\n")
    sb = client.create(image="ctx-links")
    try:
        assert sh(sb, "cat /copied") == "the context's hostname\n"
    finally:
        sb.destroy()
    with pytest.raises(DsecError) as info:
        client.build_dockerfile(str(ctx), "ctx-secret", text="FROM busybox\nCOPY key /key\n")
    assert info.value.code == "bad_request"
    assert "key leads to secrets/key.pem, which .dockerignore excludes" in info.value.message


def test_copy_onto_a_merged_usr_goes_through_the_images_links(client, tmp_path):
    """`COPY rootfs /` onto an image whose /bin and /lib are links into /usr
    (Debian 12, Ubuntu): the files land where the links point, the links stay,
    and every command of /usr/bin is still there."""
    base = tmp_path / "base"
    (base / "usr" / "bin").mkdir(parents=True)
    (base / "usr" / "lib").mkdir()
    (base / "usr" / "lib" / "kept.txt").write_text("kept\n")
    shutil.copy2("/bin/busybox", base / "usr" / "bin" / "busybox")
    for cmd in ("sh", "cat", "readlink", "stat", "ls"):
        (base / "usr" / "bin" / cmd).symlink_to("busybox")
    (base / "bin").symlink_to("usr/bin")
    (base / "lib").symlink_to("/usr/lib")           # absolute: resolved inside the image
    client.build_image(str(base), "merged-usr")
    ctx = tmp_path / "ctx"
    (ctx / "rootfs" / "bin").mkdir(parents=True)
    (ctx / "rootfs" / "lib").mkdir()
    (ctx / "rootfs" / "bin" / "hello").write_text("#!/bin/sh\necho hello from bin\n")
    (ctx / "rootfs" / "bin" / "hello").chmod(0o755)
    (ctx / "rootfs" / "lib" / "added.txt").write_text("added\n")
    (ctx / "rootfs" / "lib").chmod(0o700)
    (ctx / "tarred" / "bin").mkdir(parents=True)
    (ctx / "tarred" / "bin" / "from-tar").write_text("#!/bin/sh\necho hello from tar\n")
    (ctx / "tarred" / "bin" / "from-tar").chmod(0o755)
    with tarfile.open(ctx / "r.tar", "w") as tf:
        tf.add(ctx / "tarred" / "bin", arcname="bin")
    client.build_dockerfile(str(ctx), "merged-usr-app",
                            text="FROM merged-usr\nCOPY rootfs /\nADD r.tar /\nRUN hello > /ran && from-tar >> /ran\n")
    sb = client.create(image="merged-usr-app")
    try:
        assert sh(sb, "readlink /bin; readlink /lib") == "usr/bin\n/usr/lib\n"
        assert sh(sb, "cat /ran /usr/lib/kept.txt /usr/lib/added.txt") == \
            "hello from bin\nhello from tar\nkept\nadded\n"
        assert sh(sb, "ls /usr/bin") == "busybox\ncat\nfrom-tar\nhello\nls\nreadlink\nsh\nstat\n"
        # The directories the links name keep their own mode (rootfs/lib is 0700).
        assert sh(sb, "stat -c %a /usr/lib") == "755\n"
    finally:
        sb.destroy()


def test_a_cancelled_build_leaves_no_sandbox_and_no_name(daemon, client, tmp_path):
    async def cancel_mid_run() -> None:
        async with Client(daemon.socket) as c:
            running = asyncio.Event()

            def progress(event):
                if event["event"] == "output":
                    running.set()

            build = asyncio.ensure_future(c.build_dockerfile(
                str(tmp_path), "cancelled", text="FROM busybox\nRUN echo started; sleep 60\n", progress=progress))
            await asyncio.wait_for(running.wait(), 30)
            build.cancel()
            with pytest.raises(asyncio.CancelledError):
                await build

    asyncio.run(cancel_mid_run())
    deadline = time.monotonic() + 20
    while client.list() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.list() == []
    assert "cancelled" not in [i["name"] for i in client.list_images()]


def test_a_cancelled_build_stops_its_copy_within_a_chunk(daemon, client, tmp_path, gate_fuse_binary):
    """A build cancelled while its COPY reads a large file stops reading it
    at its next chunk (1 MiB), instead of copying the rest for nobody (into
    a sandbox being destroyed, through a root fd being closed), and its
    answer says it was cancelled. The file is on a FUSE mount whose reads
    from 2 MiB on are held until the cancel is through; its first open is
    the hashing's, its second the copy's."""
    size, gate = 64 << 20, 2 << 20
    fs = GateFuse(gate_fuse_binary, tmp_path / "fuse", size=size, gate_open=2, gate_offset=gate)
    try:
        async def cancel_mid_copy() -> None:
            async with Client(daemon.socket) as c:
                rid = c.new_id()
                args = {"context": str(tmp_path), "dockerfile": "FROM busybox\nCOPY fuse/big /big\n",
                        "name": "cancelled-copy", "dockerfile_name": "Dockerfile", "build_args": {},
                        "no_cache": False}

                async def build() -> None:
                    async for _ in c.frames_with_id(rid, "image_build_dockerfile", args):
                        pass

                task = asyncio.ensure_future(build())
                await asyncio.get_running_loop().run_in_executor(None, fs.wait_for, "held 2")
                assert await c.request("cancel", target=rid) == {"cancelled": rid}
                fs.open_gate()
                with pytest.raises(DsecError) as info:
                    await task
                assert (info.value.code, info.value.message) == ("conflict", "request cancelled")

        asyncio.run(cancel_mid_copy())
        fs.wait_for("release 2")            # the copy's read of the file is over, however it ended
        copied = fs.offsets(2)
        # At once, it stops at gate + 1 MiB; the bound leaves room for a slow event loop.
        assert copied and max(copied) < gate + (8 << 20), f"read on to {max(copied)} of {size} after the cancel"
        assert client.list() == []
        assert "cancelled-copy" not in [i["name"] for i in client.list_images()]
    finally:
        fs.close()


def _child_named(parent: int, name: str, timeout: float = 120) -> int:
    """The pid of a child of process `parent` whose command is `name`, as
    soon as there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
            except FileNotFoundError:
                continue
            for pid in children:
                try:
                    if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                        return int(pid)
                except (FileNotFoundError, ProcessLookupError):
                    pass        # a child that exited between the listing and the read (ESRCH at the read)
        time.sleep(0.001)
    raise TimeoutError(f"no {name} under process {parent} in {timeout} s")


def test_a_build_cancelled_while_its_layer_is_packed_answers_after_the_pack(daemon, client, tmp_path):
    """mkfs.erofs, packing a step's layer, cannot be stopped half-way: a
    build cancelled meanwhile waits for it, as a snapshot does, before the
    view it reads is removed, the step's sandbox destroyed and the cancel
    answered. Here the pack is held (SIGSTOP) while the cancel comes."""
    (tmp_path / "big").write_bytes(os.urandom(128 << 20))

    async def cancel_mid_pack() -> None:
        async with Client(daemon.socket) as c:
            rid = c.new_id()
            args = {"context": str(tmp_path), "dockerfile": "FROM busybox\nCOPY big /big\n",
                    "name": "cancelled-pack", "dockerfile_name": "Dockerfile", "build_args": {}, "no_cache": False}

            async def build() -> None:
                async for _ in c.frames_with_id(rid, "image_build_dockerfile", args):
                    pass

            task = asyncio.ensure_future(build())
            mkfs = await asyncio.get_running_loop().run_in_executor(None, _child_named, daemon.proc.pid,
                                                                    "mkfs.erofs")
            os.kill(mkfs, signal.SIGSTOP)
            try:
                assert await c.request("cancel", target=rid) == {"cancelled": rid}
                # The answer, if it comes while the pack is held (it must not).
                answered, _ = await asyncio.wait({task}, timeout=5)
            finally:
                os.kill(mkfs, signal.SIGCONT)
            assert not answered, "the cancel was answered while the step's layer was still being packed"
            with pytest.raises(DsecError) as info:
                await task
            assert info.value.message == "request cancelled"
            assert not Path(f"/proc/{mkfs}").exists(), "the pack ended before the answer"

    asyncio.run(cancel_mid_pack())
    assert client.list() == []
    assert "cancelled-pack" not in [i["name"] for i in client.list_images()]


def test_a_build_sandbox_of_a_killed_daemon_goes_at_its_restart(daemon_factory, busybox_rootfs, tmp_path):
    """A daemon killed mid-RUN leaves its build's sandbox running; the
    build is gone with the daemon, so the next one removes the sandbox
    instead of re-adopting it for the build's TTL (over an hour)."""
    d = daemon_factory()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    kept = c.create(image="busybox")
    with pytest.raises(DsecError, match="dsec.build"):
        c.create(image="busybox", labels={"dsec.build": "mine"})
    c.close()
    (tmp_path / "Dockerfile").write_text("FROM busybox\nRUN sleep 60\n")
    build = subprocess.Popen([str(VENV_BIN / "dsec"), "--socket", d.socket, "image", "build", "-f",
                              str(tmp_path / "Dockerfile"), str(tmp_path), "--name", "killed"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        c = d.client()
        deadline = time.monotonic() + 30
        while not any("dsec.build" in s["labels"] for s in c.list()) and time.monotonic() < deadline:
            time.sleep(0.1)
        c.close()
        d.stop(signal.SIGKILL)
    finally:
        build.wait(30)
    d.start()
    c = d.client()
    assert [s["id"] for s in c.list()] == [kept.id]
    assert "killed" not in [i["name"] for i in c.list_images()]
    c.close()


def test_a_daemon_that_cannot_see_its_clients_pid_reads_paths_as_it_sees_them(daemon_factory, busybox_rootfs):
    """A daemon in a pid namespace of its own gets pid 0 for its clients: it
    cannot enter their mount namespace, and reads their paths in its own."""
    d = daemon_factory(start=False)
    d.wrapper = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]
    d.start()
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    assert "busybox" in [i["name"] for i in c.list_images()]
    c.close()
    # unshare --fork ignores SIGTERM while it waits: stop the daemon itself.
    daemon_pid = int(Path(f"/proc/{d.proc.pid}/task/{d.proc.pid}/children").read_text().split()[0])
    os.kill(daemon_pid, signal.SIGTERM)
    d.proc.wait(15)


def test_a_cancelled_image_build_publishes_nothing(daemon, client, tmp_path):
    """image_build cancelled once its layer is being made: the layer's work
    runs on in a worker, but the image is never published, and the
    client's path is detached when it is done."""
    src = tmp_path / "tree"
    for i in range(400):                        # enough for mkfs.erofs to take a while
        d = src / f"d{i % 20}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}").write_bytes(os.urandom(64 << 10))

    async def cancel_mid_build() -> None:
        async with Client(daemon.socket) as c:
            started = asyncio.Event()
            build = asyncio.ensure_future(c.import_image(str(src), "cancelled-import",
                                                         progress=lambda p: started.set()))
            await asyncio.wait_for(started.wait(), 30)
            build.cancel()
            with pytest.raises(asyncio.CancelledError):
                await build

    asyncio.run(cancel_mid_build())
    attached = daemon.state / "client-paths"
    deadline = time.monotonic() + 60
    while attached.exists() and list(attached.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(attached.iterdir()), "the build's worker is done and detached the client's path"
    assert "cancelled-import" not in [i["name"] for i in client.list_images()]


def test_the_cli_prints_the_result_and_fails_with_the_line(daemon, tmp_path):
    ctx = ten_step_context(tmp_path / "ctx")
    r = daemon.cli("image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "--name", "cli-ten")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().startswith("built cli-ten: ")          # not a terminal: the result alone
    r = daemon.cli("image", "build", "-f", str(ctx / "Dockerfile"), str(ctx), "--name", "cli-ten", "--json")
    assert r.returncode == 0 and all(s["cached"] for s in json.loads(r.stdout)["steps"])
    before = json.loads(r.stdout)["manifest"]
    (ctx / "Changed").write_text((ctx / "Dockerfile").read_text() + "ENV CHANGED=1\n")
    r = daemon.cli("image", "build", "-f", str(ctx / "Changed"), str(ctx), "--name", "cli-ten")
    assert r.returncode == 0, r.stderr         # the name moved: said, as an import's is
    assert f"; replaced manifest {before[:19]} under that name" in r.stdout.decode()
    (ctx / "Bad").write_text("FROM busybox\nRUN echo broken >&2; false\n")
    r = daemon.cli("image", "build", "-f", str(ctx / "Bad"), str(ctx), "--name", "cli-bad")
    assert r.returncode == 1
    assert "Bad:2: RUN failed with exit code 1" in r.stderr.decode() and "broken" in r.stderr.decode()
    r = daemon.cli("image", "build", str(ctx), "--name", "x", "--build-arg", "A=1")
    assert r.returncode == 2 and b"goes with -f" in r.stderr


def test_sources_are_read_as_the_client_sees_them(daemon, client, tmp_path):
    """A client with mounts of its own (in a container; or beside a daemon
    that systemd gave a /tmp of its own) names paths only it sees: the
    daemon reads them in the client's mount namespace. Here the client's
    files are on a tmpfs mounted in its namespace alone, with a shared
    submount that the daemon's clone of it must not take down."""
    private = tmp_path / "private"
    private.mkdir()
    dsec = f"{VENV_BIN / 'dsec'} --socket {daemon.socket}"
    script = f"""
        set -e
        mount -t tmpfs only-the-client {private}
        mkdir -p {private}/ctx/data {private}/root
        mount --make-rshared {private}
        mount -t tmpfs a-submount {private}/ctx/data
        echo kept > {private}/ctx/data/keep
        printf 'FROM busybox\\nCOPY hello.txt data /c/\\n' > {private}/ctx/Dockerfile
        echo from-the-client > {private}/ctx/hello.txt
        echo rootfs-file > {private}/root/only-here
        {dsec} image build -f {private}/ctx/Dockerfile {private}/ctx --name client-view
        {dsec} image build {private}/root --from busybox --name client-root
        # The daemon's detach of its clone left the client's own mounts alone.
        test "$(cat {private}/ctx/data/keep)" = kept
        touch {private}/ctx/data/still-writable
    """
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert not os.listdir(private), "the daemon's own view of that path stayed empty"
    sb = client.create(image="client-view", memory="64M")
    assert sb.exec(["cat", "/c/hello.txt", "/c/keep"]).stdout == b"from-the-client\nkept\n"
    sb.destroy()
    sb = client.create(image="client-root", memory="64M")
    assert sb.exec(["cat", "/only-here"]).stdout == b"rootfs-file\n"
    sb.destroy()
    for name in ("client-view", "client-root"):
        client.request("image_rm", name=name)
    r = daemon.cli("image", "build", str(private / "gone"), "--name", "never")
    assert r.returncode != 0 and b"(looked up as the client sees it)" in r.stderr, r.stderr
    r = daemon.cli("--json", "image", "build", str(private / "gone"), "--name", "never")
    error = json.loads(r.stdout)["error"]
    assert (error["code"], error["detail"]) == ("not_found", {"errno": "ENOENT", "source": str(private / "gone")})
    assert not list((daemon.state / "client-paths").iterdir()), "every attached path is gone again"


@pytest.fixture
def net_daemon(world, daemon_factory, busybox_rootfs):
    from test_net_daemon import _toml_net
    from test_net_kit import bpf_skip_reason

    if bpf_skip_reason():
        pytest.skip(bpf_skip_reason())
    d = daemon_factory(_toml_net(dict(world.cfg, ipv4_pool=f"10.{world.octet}.5.0/24")))
    c = d.client()
    c.import_image(busybox_rootfs, "busybox")
    yield d, c
    c.close()


def test_run_gets_only_the_network_the_build_allows(world, net_daemon, tmp_path):
    d, c = net_daemon
    fetch = f"FROM busybox\nRUN echo ping | nc -w 3 {world.pkg} 80 > /got\n"
    with pytest.raises(DsecError) as info:                   # no --allow: --net none
        c.build_dockerfile(str(tmp_path), "offline", text=fetch)
    assert info.value.detail["line"] == 2
    img = c.build_dockerfile(str(tmp_path), "online", text=fetch, allow=["pypi"])
    sb = c.create(image="online")
    try:
        assert "srv80:ping" in sh(sb, "cat /got")
        # The resolver's /etc/resolv.conf of the RUN sandbox is not part of the image.
        assert sb.exec(["test", "-e", "/etc/resolv.conf"]).exit_code != 0
    finally:
        sb.destroy()
    assert len(img["layers"]) == 2
