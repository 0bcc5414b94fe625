"""The daemon's start (dsecd/daemon.py): what a start that cannot go on says."""

from __future__ import annotations

import json
import os

import pytest

from dsecd import daemon
from dsecd.config import ConfigError


def test_a_state_dir_in_use_names_the_daemon_using_it_and_what_to_do(tmp_path):
    held = daemon.lock_state_dir(str(tmp_path))
    try:
        with pytest.raises(SystemExit) as err:
            daemon.lock_state_dir(str(tmp_path))
        said = str(err.value.code)
        assert f"another daemon (pid {os.getpid()}) uses state dir {tmp_path}" in said, said
        assert "stop it" in said and "daemon.state_dir" in said, said
    finally:
        os.close(held)


def test_a_socket_path_naming_a_file_leaves_the_file_alone(tmp_path):
    """daemon.socket (--socket) naming a file that is not a socket stops
    the start, saying so; the file is kept as it was."""
    from dsecd import server

    kept = tmp_path / "dsecd.toml"
    kept.write_text("[daemon]\n")
    with pytest.raises(SystemExit) as err:
        server._remove_stale_socket(str(kept))
    said = str(err.value.code)
    assert f"{kept} exists and is not a socket" in said and "daemon.socket" in said, said
    assert kept.read_text() == "[daemon]\n"


def test_version_prints_the_version_and_exits(capsys):
    from dsecd import __version__

    with pytest.raises(SystemExit) as err:
        daemon.parse_args(["--version"])
    assert err.value.code == 0
    assert capsys.readouterr().out.strip() == f"dsecd {__version__}"


def test_a_bad_metrics_address_is_a_config_error(tmp_path):
    """Found with the rest of the config, before the state dir is locked
    and every sandbox re-adopted (minutes on a busy host), not after."""
    from dsecd.config import ConfigError

    conf = tmp_path / "dsecd.toml"
    conf.write_text('[metrics]\nlisten = "9464"\n')
    with pytest.raises(ConfigError, match="metrics.listen must be HOST:PORT"):
        daemon.build_config(daemon.parse_args(["--config", str(conf)]))
    conf.write_text('[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert daemon.build_config(daemon.parse_args(["--config", str(conf)])).section("metrics")["listen"]



def test_a_sandbox_outside_the_cgroup_root_stops_the_start_saying_why():
    """A sandbox.cgroup_root changed while sandboxes ran: their processes
    are in groups below the old root, which the new one cannot freeze,
    limit or kill. The start stops naming the sandbox, where it is and what
    to do, rather than with a traceback from the first cgroup call."""
    from dsecd.backends import container

    said = container.foreign_group("abc", ["/", "/dsecd-old/abc", "/dsecd-old/abc"], "dsecd-new/abc")
    assert said and "/dsecd-old/abc" in said and "sandbox.cgroup_root 'dsecd-old'" in said \
        and "'dsecd-new'" in said and "set it back to 'dsecd-old'" in said, said
    # In its group (or below it), or in no live group of its own: adoption goes on.
    assert container.foreign_group("abc", ["/", "/dsecd/abc"], "dsecd/abc") is None
    assert container.foreign_group("abc", ["/dsecd/abc/init"], "dsecd/abc") is None
    assert container.foreign_group("abc", ["/", "/dsecd-old/abc (deleted)"], "dsecd-new/abc") is None
    assert container.foreign_group("abc", ["/"], "dsecd/abc") is None


def _locks(tmp_path, *roots) -> list[int]:
    return [fd for root in roots for fd in daemon.lock_cgroup_root(root, mount=tmp_path)]


def test_cgroup_roots_that_nest_are_refused_naming_both(tmp_path):
    """A second daemon whose cgroup_root held the first's, or was held by
    it, started: at their next start each removes the other's sandboxes."""
    for first, second in (("dsecd-x", "dsecd-x/sub"), ("dsecd-x/sub/deep", "dsecd-x")):
        held = _locks(tmp_path / first.replace("/", "_"), first)
        try:
            with pytest.raises(SystemExit) as err:
                _locks(tmp_path / first.replace("/", "_"), second)
            said = str(err.value.code)
            assert f"another daemon uses sandbox.cgroup_root {first!r}" in said, said
            assert f"{second!r} ({tmp_path / first.replace('/', '_') / second})" in said, said
            assert "neither holds nor is held by another daemon's" in said, said
        finally:
            for fd in held:
                os.close(fd)


def test_cgroup_roots_side_by_side_or_freed_are_taken(tmp_path):
    held = _locks(tmp_path, "dsecd-x/a", "dsecd-x/b", "dsecd-xy", "other")
    try:
        with pytest.raises(SystemExit) as err:
            _locks(tmp_path, "dsecd-x/a")
        assert "another daemon uses sandbox.cgroup_root 'dsecd-x/a'" in str(err.value.code)
        assert "a cgroup_root of its own" in str(err.value.code)
    finally:
        for fd in held:
            os.close(fd)
    for fd in _locks(tmp_path, "dsecd-x"):          # the ones below stopped: free again
        os.close(fd)


class _NodeFailingToStart:
    def __init__(self, err: BaseException):
        self.err = err

    async def start(self):
        raise self.err


def test_a_full_disk_at_start_stops_it_saying_what_to_do():
    """Re-adoption writes the journal: on a full state dir that write
    fails. The start stops with one line naming the file, the error and
    what to do, not an uncaught exception and its traceback."""
    import asyncio
    import errno

    err = OSError(errno.ENOSPC, "write `/var/lib/dsecd/journal.log`: No space left on device")
    with pytest.raises(SystemExit) as stopped:
        asyncio.run(daemon.start_node(_NodeFailingToStart(err)))
    said = str(stopped.value.code)
    assert said.startswith("dsecd: ") and "/var/lib/dsecd/journal.log" in said, said
    assert "No space left on device" in said and "free space" in said and "sandboxes keep running" in said, said


def test_a_journaled_sandbox_the_config_cannot_take_back_stops_the_start():
    import asyncio

    from dsecd.config import ConfigError

    with pytest.raises(SystemExit) as stopped:
        asyncio.run(daemon.start_node(_NodeFailingToStart(ConfigError("sandbox.userns: abc"))))
    assert stopped.value.code == "dsecd: sandbox.userns: abc"


def _check(argv, capsys):
    with pytest.raises(SystemExit) as err:
        daemon.main(["--check-config", *argv])
    out = capsys.readouterr()
    return err.value.code, out.out, out.err


def test_check_config_names_the_bad_key_and_exits_1_touching_nothing(tmp_path, capsys):
    conf = tmp_path / "dsecd.toml"
    conf.write_text("[limits]\nmax_sandboxez = 10\n")
    state = tmp_path / "state"
    status, out, err = _check([str(conf), "--state-dir", str(state)], capsys)
    assert status == 1 and out == ""
    assert f"config {conf}: unknown config key 'limits.max_sandboxez'" in err, err
    status, out, _ = _check([str(conf), "--json"], capsys)
    said = json.loads(out)
    assert status == 1 and said["ok"] is False and said["key"] == "limits.max_sandboxez", said
    assert said["config"] == str(conf) and "max_sandboxez" in said["error"]
    conf.write_text('[daemon]\nlog_level = "loud"\n')
    status, out, _ = _check(["--json", "--config", str(conf)], capsys)
    assert status == 1 and json.loads(out)["key"] == "daemon.log_level", out
    assert not state.exists()


def test_check_config_passes_a_good_file_and_starts_nothing(tmp_path, capsys):
    conf = tmp_path / "dsecd.toml"
    state = tmp_path / "state"
    conf.write_text(f'[daemon]\nstate_dir = "{state}"\nsocket = "{tmp_path}/s.sock"\n')
    status, out, err = _check([str(conf)], capsys)
    assert status == 0 and f"config {conf} is valid" in out, (out, err)
    status, out, _ = _check([str(conf), "--json"], capsys)
    assert status == 0 and json.loads(out) == {"ok": True, "config": str(conf), "error": None, "key": None}
    assert not state.exists() and not (tmp_path / "s.sock").exists()


def test_check_config_refuses_what_a_service_would_refuse_at_start(tmp_path, capsys):
    """Settings read as the services are built (after the state dir is
    locked) are checked too, as those services check them."""
    conf = tmp_path / "dsecd.toml"
    for text, key in (('[net]\nipv4_subnet = "10.0.0.0/40"\n', "net.ipv4_subnet"),
                      ("[memory.zram]\npriority = 40000\n", "memory.zram.priority"),
                      ('[sandbox]\nexec_via = "magic"\n', "sandbox.exec_via"),
                      ('[cpu]\ndefault_qos = "gold"\n', "cpu.default_qos"),
                      ("[cpu]\nls_weight_factor = 0.5\n", "cpu.ls_weight_factor"),
                      ('[sandbox]\ndefault_ttl = "forever"\n', "sandbox.default_ttl"),
                      ("[sandbox]\nuserns_base = 4294967000\n", "sandbox.userns_base"),
                      ('[sandbox]\nwritable_layer = "disk"\n', "sandbox.writable_layer"),
                      ('[sandbox]\nseccomp = "strict"\n', "sandbox.seccomp")):
        conf.write_text(text)
        status, out, _ = _check([str(conf), "--json"], capsys)
        said = json.loads(out)
        assert status == 1 and said["key"] == key, (text, said)
        with pytest.raises(ConfigError):
            daemon.build_config(daemon.parse_args(["--config", str(conf)]))


def test_check_config_refuses_a_writable_layer_cap_and_a_chunk_size_the_start_refuses(tmp_path, capsys):
    """A tmpfs writable layer's cap and a lazy pager's chunk size under
    images.verify were checked only as Node and the image service were
    built: --check-config called such a config valid."""
    conf = tmp_path / "dsecd.toml"
    for text, key in (('[sandbox]\nwritable_layer = "tmpfs"\ndisk = "512K"\n', "sandbox.disk"),
                      ('[sandbox]\nwritable_layer = "auto"\ndisk = 0\n', "sandbox.disk"),
                      ('[sandbox]\nwritable_layer = "tmpfs"\ndisk_inodes = 8\n', "sandbox.disk_inodes"),
                      ('[images]\nmode = "lazy"\n[pager]\nchunk_size = "96K"\n', "pager.chunk_size"),
                      ('[pager]\nchunk_size = "100000"\n', "pager.chunk_size")):
        conf.write_text(text)
        status, out, _ = _check([str(conf), "--json"], capsys)
        said = json.loads(out)
        assert status == 1 and said["key"] == key, (text, said)
    # What no start uses is not refused: a dir has no cap, eager and direct no pager.
    for text in ('[sandbox]\nwritable_layer = "dir"\ndisk = 0\n',
                 '[images]\nmode = "eager"\n[pager]\nchunk_size = "96K"\n',
                 '[images]\nverify = false\n[pager]\nchunk_size = "16K"\n'):
        conf.write_text(text)
        status, out, _ = _check([str(conf), "--json"], capsys)
        assert status == 0 and json.loads(out)["ok"] is True, (text, out)


def test_check_config_names_keys_of_the_file_it_checks(tmp_path, capsys):
    """The key was looked up in the embedded defaults, not in the file:
    a rule set of the file's own was named by no key, and a bad pool by
    the subnet beside it."""
    conf = tmp_path / "dsecd.toml"
    for text, key in (('[net.rule_sets]\nfoo = ["nonsense rule"]\n', "net.rule_sets.foo"),
                      ('[net]\nipv4_pool = "bogus"\n', "net.ipv4_pool"),
                      ('[net]\nipv6_subnet = "bogus"\n', "net.ipv6_subnet"),
                      ('[net]\nipv4_pool = "192.0.2.0/24"\n', "net.ipv4_pool")):
        conf.write_text(text)
        status, out, _ = _check([str(conf), "--json"], capsys)
        said = json.loads(out)
        assert status == 1 and said["key"] == key, (text, said)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path, capsys):
    conf = tmp_path / "dsecd.toml"
    conf.write_bytes(b'[net]\nbridge = "\xff"\n')
    status, out, _ = _check([str(conf), "--json"], capsys)
    said = json.loads(out)
    assert status == 1 and said["ok"] is False and "UTF-8" in said["error"] and said["key"] is None, said
    status, _, err = _check([str(conf)], capsys)
    assert status == 1 and f"config {conf}" in err and "UTF-8" in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match="UTF-8"):
        daemon.build_config(daemon.parse_args(["--config", str(conf)]))


def test_check_config_refuses_a_chunk_size_the_pager_refuses(tmp_path, capsys):
    """dsec-pager takes a chunk size that is a power of two from 4K to 1G
    and exits on any other, so a lazy start cannot start its pager: such a
    size passed --check-config, under images.verify too (192K is a
    multiple of its 64K blocks)."""
    conf = tmp_path / "dsecd.toml"
    for size in ('"192K"', '"2K"', '"2G"', "0"):
        for verify in ("true", "false"):
            conf.write_text(f'[images]\nmode = "lazy"\nverify = {verify}\n[pager]\nchunk_size = {size}\n')
            status, out, _ = _check([str(conf), "--json"], capsys)
            said = json.loads(out)
            assert status == 1 and said["key"] == "pager.chunk_size", (size, verify, said)
    conf.write_text('[images]\nmode = "lazy"\nverify = false\n[pager]\nchunk_size = "4K"\n')
    status, out, _ = _check([str(conf), "--json"], capsys)
    assert status == 0, out
    # Its other settings as the pager's config takes them.
    conf.write_text('[images]\nmode = "lazy"\n[pager]\nreadahead_chunks = 5000\n')
    status, out, _ = _check([str(conf), "--json"], capsys)
    said = json.loads(out)
    assert status == 1 and said["key"] == "pager.readahead_chunks", said


def test_a_socket_path_no_client_can_connect_to_is_a_config_error(tmp_path, capsys):
    """A unix socket's address holds 108 bytes: the daemon bound a longer
    daemon.socket (through a shorter staging name) and renamed it into
    place, and then no client could connect to it; and a directory too
    long for the staging name stopped the start only after its sandboxes
    were re-adopted."""
    import socket

    from dsecd import unixsock

    conf = tmp_path / "dsecd.toml"
    for path in ("/run/" + "a" * 110 + ".sock", "/" + "d" * 95 + "/dsecd.sock"):
        conf.write_text(f'[daemon]\nsocket = "{path}"\n')
        status, out, _ = _check([str(conf), "--json"], capsys)
        said = json.loads(out)
        assert status == 1 and said["key"] == "daemon.socket" and "bytes" in said["error"], said
        with pytest.raises(ConfigError, match="daemon.socket"):
            daemon.build_config(daemon.parse_args(["--config", str(conf)]))
    # The longest it takes is served and reached.
    import shutil
    import tempfile

    short = tempfile.mkdtemp(dir="/tmp")
    try:
        longest = os.path.join(short, "x" * (unixsock.ADDRESS_MAX - len(short) - 1))
        assert len(longest.encode()) == unixsock.ADDRESS_MAX and unixsock.address_problem(longest) is None
        server = unixsock.bind_private(longest, os.getegid())
        try:
            server.listen()
            client = socket.socket(socket.AF_UNIX)
            client.connect(longest)
            client.close()
        finally:
            server.close()
    finally:
        shutil.rmtree(short)


def test_check_config_and_config_naming_two_files_is_a_usage_error(tmp_path, capsys):
    status, _, err = _check([str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.toml")], capsys)
    assert status == 2 and "two files" in err


def test_json_without_check_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as err:
        daemon.parse_args(["--json"])
    assert err.value.code == 2 and "--json goes with --check-config" in capsys.readouterr().err
