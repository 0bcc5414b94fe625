"""What `dsec` prints for people (dsecd/clitext.py)."""

from __future__ import annotations

import pytest

from dsecd.clitext import event_fields

SHOWN = ("seq", "time", "event", "sandbox")


def test_event_fields_print_maps_as_json_and_missing_values_as_a_dash():
    ev = {"seq": 3, "time": 1.0, "event": "created", "sandbox": "abc", "image": "busybox",
          "labels": {"job": "42", "a": "b c"}, "job": None, "memory": 268435456}
    assert event_fields(ev, SHOWN) == 'image=busybox labels={"a":"b c","job":"42"} job=- memory=256.0M'


def test_event_fields_print_labels_in_their_own_letters():
    ev = {"event": "created", "sandbox": "abc", "labels": {"job": "ü名", "note": "a\nb"}}
    assert event_fields(ev, SHOWN) == 'labels={"job":"ü名","note":"a\\nb"}'


def test_image_inspect_prints_its_command_in_its_own_letters(capsys):
    from dsecd.cli import _print_image_details
    img = {"name": "app", "manifest": "sha256:" + "0" * 64, "layers": [], "bytes": 0,
           "config": {"entrypoint": ["python3"], "cmd": ["-c", "print('héllo 名')"]}}
    _print_image_details(img)
    assert """cmd:           ["-c", "print('héllo 名')"]""" in capsys.readouterr().out


def test_event_fields_print_sizes_in_bytes_as_a_human_reads_them():
    ev = {"event": "paused", "sandbox": "abc", "freed_bytes": 3 << 20, "memory": -1, "kills": 2}
    assert event_fields(ev, SHOWN) == "freed_bytes=3.0M memory=-1 kills=2"


def test_event_fields_leave_out_what_the_line_shows_already():
    ev = {"seq": 1, "time": 2.0, "event": "destroyed", "sandbox": "abc", "host": "h1", "reason": "request"}
    assert event_fields(ev, (*SHOWN, "host")) == "reason=request"
    assert event_fields({"event": "x", "sandbox": "abc", "labels": {}}, SHOWN) == "labels={}"


def test_net_set_counts_the_rules_it_lists():
    from dsecd.cli import net_set_summary
    view = {"rules": ["10.1.2.0/24:443/tcp"],
            "terms": ["10.1.2.0/24:443/tcp", "pypi", "*.pythonhosted.org:443/tcp"]}
    assert net_set_summary("abc", view) == "abc: 3 rule(s): 10.1.2.0/24:443/tcp pypi *.pythonhosted.org:443/tcp"
    assert net_set_summary("abc", {"rules": [], "terms": []}) == "abc: 0 rule(s): (none)"
    # net.essentials stay in force whatever the terms: said, not hidden behind "(none)".
    view = {"terms": [], "essentials": ["10.9.0.0/16:443/tcp"]}
    assert net_set_summary("abc", view) == \
        "abc: 0 rule(s): (none); in force besides: 10.9.0.0/16:443/tcp (net.essentials)"


def test_logs_json_is_one_object_per_chunk():
    import json

    from dsecd.cli import output_chunk_json
    from dsecd.client import ProcOutput
    assert json.loads(output_chunk_json(ProcOutput(2, b"err\xff\n", 5.0))) == \
        {"fd": 2, "data": "err\ufffd\n", "time": 5.0, "dropped": 0, "lost_before": None}
    assert json.loads(output_chunk_json(ProcOutput(0, b"", 0.0, 4096)))["dropped"] == 4096
    assert json.loads(output_chunk_json(ProcOutput(0, b"", 0.0, 0, 7.5)))["lost_before"] == 7.5


def test_an_argv_value_is_shell_words_or_a_json_array():
    from dsecd.clitext import UsageError, argv_value

    assert argv_value(None, "--cmd") is None
    assert argv_value("python3 -m 'my app'", "--cmd") == ["python3", "-m", "my app"]
    assert argv_value(' ["sh", "-c", "echo a b"]', "--entrypoint") == ["sh", "-c", "echo a b"]
    for bad, says in (('["a", 1]', "JSON array of strings"), ("[nope", "not a JSON array"),
                      ("'open", "quote it"), ("  ", "is empty")):
        with pytest.raises(UsageError, match=says):
            argv_value(bad, "--cmd")


def test_info_says_how_networking_is():
    from dsecd.cli import net_info_lines
    up = {"available": True, "detail": "bridge dsec0, 10.88.0.0/16, eBPF allowlists loaded",
          "pool": {"size": 8, "ready": 6, "taken": 3, "misses": 1, "failed": 0},
          "dns": {"address": "10.88.0.1:53", "upstreams": ["192.0.2.53:53"], "queries": 4},
          "nat": {"table": "inet dsecd", "uplink": "eth0", "published": 2, "ports": 2},
          "starting": ["filling the netns pool"]}
    assert net_info_lines(up) == [
        "net: available: bridge dsec0, 10.88.0.0/16, eBPF allowlists loaded",
        "  starting   filling the netns pool",
        "  pool       6 ready of 8, 3 taken, 1 misses, 0 failed",
        "  resolver   10.88.0.1:53 -> 192.0.2.53:53",
        "  nat        table inet dsecd, uplink eth0, 2 port(s) published"]
    no_dns = {**up, "dns": {"error": "net.dns_upstreams: 'x' is not an address[:port]"},
              "nat": {"uplink": "", "detail": "net.uplink is off: no egress NAT"}}
    assert net_info_lines(no_dns)[3:] == ["  resolver   net.dns_upstreams: 'x' is not an address[:port]",
                                          "  nat        net.uplink is off: no egress NAT"]
    # Why --net default is refused is the first thing said.
    assert net_info_lines({"available": False, "detail": "no cgroup v2 hierarchy"}) == \
        ["net: unavailable: no cgroup v2 hierarchy"]
    assert net_info_lines({"available": None, "detail": "not started yet (on the first --net default create)"}) \
        == ["net: not started yet (on the first --net default create)"]


def test_a_resume_says_how_long_it_took_thaw_or_restore_included():
    """A microVM's resume is its restore (`thaw_s`), with nothing to
    prefetch: the line said "prefetched 0B in 0 ms" after half a second."""
    from dsecd.cli import _pause_summary

    vm = {"id": "v", "state": "running", "prefetch_s": 0.0, "thaw_s": 0.48, "prefetched_bytes": 0}
    assert _pause_summary(vm) == ": resumed in 480 ms, prefetched 0B"
    ctr = {"id": "c", "state": "running", "prefetch_s": 0.002, "thaw_s": 0.0004, "prefetched_bytes": 5 << 19}
    assert _pause_summary(ctr) == ": resumed in 2 ms, prefetched 2.5M"


def test_ps_dates_a_sandbox_made_before_today(capsys):
    """CREATED is a time of day for today's sandboxes; an older one's
    says its date too, not a time that reads as today's."""
    import argparse
    import asyncio
    import time

    from dsecd.cli import cmd_ps

    now = time.time()
    before = now - 3 * 86400

    def sb(sb_id, created):
        return {"id": sb_id, "image": "busybox", "state": "running", "limits": {"cpu": 1.0, "memory": 1 << 29},
                "execs_running": 0, "procs_running": 0, "created": created, "labels": {}, "net": None}

    class Listing:
        async def list(self, labels):
            return [sb("aaaaaaaaaaaa", before), sb("bbbbbbbbbbbb", now)]

    asyncio.run(cmd_ps(Listing(), argparse.Namespace(label=None, json=False)))
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(before)) in rows["aaaaaaaaaaaa"]
    assert time.strftime("%H:%M:%S", time.localtime(now)) in rows["bbbbbbbbbbbb"]


def test_image_rm_says_which_sandboxes_keep_the_layers():
    """A gc right after `dsec image rm` frees nothing of an image sandboxes run on."""
    from dsecd.clitext import image_removed

    assert image_removed({"name": "app", "sandboxes": []}, "app") == \
        "removed image name app (its layers go at the next `dsec image gc`)"
    ids = [f"{n:012x}" for n in range(7)]
    said = image_removed({"name": "docker.io/library/app:latest", "sandboxes": ids}, "app")
    assert said.startswith("removed image name docker.io/library/app:latest; 7 sandbox(es) on it run on")
    assert f"({', '.join(ids[:5])}, ...)" in said and "after they end" in said
