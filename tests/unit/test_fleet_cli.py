"""dsec fleet's own handling of commands (dsecd/fleet_cli.py), with a
stand-in Fleet: which host's client each command goes to, with which ids."""

from __future__ import annotations

import argparse
import asyncio
import json
from types import SimpleNamespace

import pytest

from dsecd import cli, fleet_cli
from dsecd.errors import Conflict, NotFound


class Host:
    def __init__(self, name: str):
        self.target = f"ssh://{name}"


class StandInFleet:
    """get() finds each sandbox on the host `where` names."""

    def __init__(self, where: dict[str, Host]):
        self.where = where

    async def get(self, sb_id: str):
        host = self.where.get(sb_id)
        if host is None:
            raise NotFound(f"no sandbox {sb_id!r} on any host that is up")
        return SimpleNamespace(id=sb_id, client=host)


def each_sandbox(cmd: str, words: list[str], where: dict[str, Host], fails: dict | None = None,
                 as_json: bool = False):
    """fleet_cli._each_sandbox of `dsec fleet cmd WORDS...`: the status, and
    the (host, sandboxes) each host's command was run with."""
    seen = []

    async def command(client, a):
        seen.append((client.target, list(a.sandboxes)))
        if fails and client.target in fails:
            raise fails[client.target]
        return 0

    a = argparse.Namespace(cmd=cmd, sandboxes=list(words), json=as_json, all=False)
    ids = [w.partition(":")[0] for w in words]
    status = asyncio.run(fleet_cli._each_sandbox(StandInFleet(where), a, {cmd: command}, ids))
    return status, seen, a


def test_each_host_gets_its_own_sandboxes():
    h1, h2, h3 = Host("h1"), Host("h2"), Host("h3")
    where = {"sb1": h1, "sb2": h2, "sb3": h3, "sb4": h1}
    for cmd in ("pause", "resume", "rm"):
        status, seen, a = each_sandbox(cmd, ["sb1", "sb2", "sb3", "sb4"], where)
        assert status == 0
        assert sorted(seen) == [("ssh://h1", ["sb1", "sb4"]), ("ssh://h2", ["sb2"]), ("ssh://h3", ["sb3"])]
        assert a.sandboxes == ["sb1", "sb2", "sb3", "sb4"]          # the caller's arguments are left as given


def test_paths_go_to_their_sandboxs_host():
    h1, h2 = Host("h1"), Host("h2")
    status, seen, _ = each_sandbox("rm", ["sb1:/tmp/a", "sb2:/tmp/b", "sb1:/tmp/c"], {"sb1": h1, "sb2": h2})
    assert status == 0
    assert sorted(seen) == [("ssh://h1", ["sb1:/tmp/a", "sb1:/tmp/c"]), ("ssh://h2", ["sb2:/tmp/b"])]


def test_a_failing_host_or_an_unknown_sandbox_fails_the_status_but_not_the_others(capsys):
    h1, h2 = Host("h1"), Host("h2")
    status, seen, _ = each_sandbox("pause", ["sb1", "nosuch", "sb2"], {"sb1": h1, "sb2": h2},
                                   fails={"ssh://h1": Conflict("sandbox sb1 is dead")})
    assert status == 1
    assert sorted(seen) == [("ssh://h1", ["sb1"]), ("ssh://h2", ["sb2"])]
    err = capsys.readouterr().err
    assert "nosuch: not_found" in err and "h1: conflict: sandbox sb1 is dead" in err


def test_a_host_lost_under_rm_says_so_in_the_json_naming_its_sandboxes(capsys):
    """--json: a host whose connection went while its part of `dsec fleet
    rm` ran printed nothing on stdout for its sandboxes, only a line on
    stderr; a script reading the JSON could not tell they were not removed."""
    from dsecd import ConnectionLost

    h1, h2 = Host("h1"), Host("h2")
    lost = ConnectionLost("destroy on ssh://h1: connection lost", target="ssh://h1", op="destroy", sent=True)
    status, _, _ = each_sandbox("rm", ["sb1", "sb2", "sb3"], {"sb1": h1, "sb2": h2, "sb3": h1},
                                fails={"ssh://h1": lost}, as_json=True)
    assert status == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "unreachable" and error["detail"]["host"] == "ssh://h1", error
    assert error["detail"]["sandboxes"] == ["sb1", "sb3"] and error["detail"]["sent"] is True, error


def test_every_host_down_is_unreachable_with_each_hosts_reason_in_the_json(tmp_path, capsys):
    """No daemon at either socket: the error object says why for each host."""
    hosts = [str(tmp_path / "h1.sock"), str(tmp_path / "h2.sock")]
    with pytest.raises(SystemExit) as e:
        cli.main(["fleet", "--hosts", ",".join(hosts), "--json", "ps"])
    out = capsys.readouterr()
    error = json.loads(out.out)["error"]
    assert e.value.code == 1 and error["code"] == "unreachable"
    assert set(error["detail"]["down"]) == set(hosts)
    assert all("is the daemon running?" in why for why in error["detail"]["down"].values())
    assert "h1.sock: cannot connect" in error["message"] and "h2.sock: cannot connect" in error["message"]


class ListingClient:
    """A host that lists one sandbox, one image, one pool, and builds; or fails every request."""

    def __init__(self, target: str, fails: bool = False):
        self.target = target
        self.fails = fails

    async def _answer(self, value):
        if self.fails:
            raise ConnectionError("timed out")
        return value

    async def list(self, labels=None):
        return await self._answer([{"id": f"sb-{self.target}", "state": "running", "labels": {}}])

    async def list_images(self):
        return await self._answer([{"name": "busybox"}])

    async def info(self):
        return await self._answer({"version": "0.1.0", "kernel": "6.1", "sandboxes": {}})

    async def pool_list(self):
        return await self._answer([])

    async def build_image(self, *args, **config):
        return await self._answer({"name": "img", "layers": [], "bytes": 0})


def fleet_of_three():
    """h1 answers, h2 is up but fails to answer, h3 is down."""
    from dsecd import Fleet

    f = Fleet(["/nonexistent/h1", "/nonexistent/h2", "/nonexistent/h3"])
    for name, host in zip(("h1", "h2", "h3"), f.hosts.values(), strict=True):
        host.client = ListingClient(host.target, fails=name == "h2")
        host.up = name != "h3"
        host.reason = "heartbeat failed"
    return f


@pytest.mark.parametrize("words", [["ps"], ["image", "ls"], ["pool", "ls"], ["top"]])
def test_a_merged_listing_missing_a_host_fails_the_status(words, capsys):
    """ps, image ls, pool ls, top: a host down or failing to answer means a
    partial answer, --json too: status 1, and the failing host said on stderr."""
    a = cli.parse_args(["fleet", "--hosts", "x", "--json", *words])
    fleet = fleet_of_three()
    if words == ["top"]:
        async def top(labels=None):
            return {"hosts": {}, "sandboxes": [], "down": {}, "errors": {"/nonexistent/h2": "timed out"}}
        fleet.top = top
    status = asyncio.run(fleet_cli.FLEET_COMMANDS[words[0]](fleet, a))
    out = capsys.readouterr()
    assert status == 1
    assert "h2: timed out" in out.err, out.err
    json.loads(out.out)
    if words != ["top"]:
        # The rows h1 gave (none in pool ls), then one per missing host with its error.
        rows = json.loads(out.out)
        assert [r["host"] for r in rows if "error" not in r] == (["/nonexistent/h1"] if words != ["pool", "ls"]
                                                                 else [])
        missing = {r["host"]: r["error"] for r in rows if "error" in r}
        assert missing == {"/nonexistent/h2": {"code": "unreachable", "message": "timed out", "detail": {}},
                           "/nonexistent/h3": {"code": "unreachable", "message": "down: heartbeat failed",
                                               "detail": {}}}, rows


@pytest.mark.parametrize("words", [["ps"], ["image", "ls"], ["pool", "ls"]])
def test_a_host_lost_during_a_listing_has_one_error_row(words, capsys):
    """A connection lost mid-request marks its host down before the request
    fails: the host was listed twice, as down and as failing to answer."""
    a = cli.parse_args(["fleet", "--hosts", "x", "--json", *words])
    fleet = fleet_of_three()
    h2 = fleet.hosts["/nonexistent/h2"]
    answer = h2.client._answer

    async def lost_mid_request(value):
        h2.up, h2.reason = False, "connection lost: EOF"
        return await answer(value)

    h2.client._answer = lost_mid_request
    assert asyncio.run(fleet_cli.FLEET_COMMANDS[words[0]](fleet, a)) == 1
    hosts = [r["host"] for r in json.loads(capsys.readouterr().out) if "error" in r]
    assert sorted(hosts) == ["/nonexistent/h2", "/nonexistent/h3"], hosts


@pytest.mark.parametrize("as_json", [False, True])
def test_rm_all_on_a_host_that_fails_to_answer_fails_the_status(as_json, capsys):
    """`dsec fleet rm --all`: a host up but failing to answer (its
    connection lost mid-request) removed nothing there, yet the status was
    0 and nothing said which host; the sandboxes of the others are removed."""
    fleet = fleet_of_three()
    fleet.hosts["/nonexistent/h3"].up = True

    for host in fleet.hosts.values():
        async def destroy_all(force, labels, client=host.client):
            return await client._answer({"destroyed": [f"sb-{client.target}"], "failed": {}})
        host.client.destroy_all = destroy_all
    a = cli.parse_args(["fleet", "--hosts", "x", *(["--json"] if as_json else []), "rm", "--all"])
    status = asyncio.run(fleet_cli.fleet_rm_all(fleet, a))
    out = capsys.readouterr()
    assert status == 1
    assert out.err == "dsec fleet rm --all: /nonexistent/h2: failed: timed out\n", out.err
    if as_json:
        r = json.loads(out.out)
        assert r["destroyed"] == ["sb-/nonexistent/h1", "sb-/nonexistent/h3"] and r["hosts"]["/nonexistent/h2"] \
            == "failed: timed out", r
    else:
        assert out.out == "removed 2 sandbox(es) on 2 host(s)\n", out.out


def test_a_command_on_every_host_names_the_hosts_down_in_its_json(capsys):
    a = cli.parse_args(["fleet", "--hosts", "x", "--json", "image", "build", "/src", "--name", "img"])
    status = asyncio.run(fleet_cli.fleet_image(fleet_of_three(), a))
    found = json.loads(capsys.readouterr().out)
    assert status == 1
    assert found["/nonexistent/h1"]["name"] == "img"
    assert found["/nonexistent/h2"] == {"error": "timed out"}
    assert found["/nonexistent/h3"] == {"error": "down: heartbeat failed"}


def test_fleet_image_rm_says_the_image_was_removed(capsys):
    """The daemon answers image_rm with the image it removed: each host's
    line says it was removed, not what a build would print."""
    fleet = fleet_of_three()
    for host in fleet.hosts.values():
        async def remove_image(name):
            return {"name": name, "layers": [{"digest": "sha256:0"}], "bytes": 8 << 20}
        host.client.remove_image = remove_image
    a = cli.parse_args(["fleet", "--hosts", "x", "image", "rm", "img"])
    status = asyncio.run(fleet_cli.fleet_image(fleet, a))
    out = capsys.readouterr().out
    assert status == 1                                   # h3 is down
    assert "h1: removed image name img (its layers go at the next `dsec image gc`)" in out
    assert "layer(s)" not in out


def test_fleet_image_tag_names_the_image_on_every_host(capsys):
    fleet = fleet_of_three()
    asked = []
    for host in fleet.hosts.values():
        async def tag_image(source, name):
            asked.append((source, name))
            return {"name": name, "layers": [{"digest": "sha256:0"}], "bytes": 8 << 20, "replaced": None}
        host.client.tag_image = tag_image
    a = cli.parse_args(["fleet", "--hosts", "x", "image", "tag", "img", "img:stable"])
    status = asyncio.run(fleet_cli.fleet_image(fleet, a))
    out = capsys.readouterr().out
    assert status == 1                                   # h3 is down
    assert ("img", "img:stable") in asked and "h1: img:stable: 1 layer(s), 8.0M" in out


class EventsClient:
    """A host whose events stream gives one event, then fails (or ends)."""

    def __init__(self, target: str, fails: BaseException | None):
        self.target = target
        self.fails = fails

    async def events(self, sandbox=None, replay=False, follow=True):
        yield {"seq": 1, "time": 0.0, "event": "created", "sandbox": f"sb-{self.target[-2:]}"}
        if self.fails is not None:
            raise self.fails


@pytest.mark.parametrize("as_json", [False, True])
def test_fleet_events_says_a_host_whose_stream_failed(as_json, capsys):
    """h1's stream is cut (its daemon went): the status is 1 and the error
    names h1, on stderr and, with --json, as one more line; h2's events
    are all there."""
    from dsecd import ConnectionLost

    hosts = [SimpleNamespace(target="ssh://h1", client=None), SimpleNamespace(target="ssh://h2", client=None)]
    hosts[0].client = EventsClient("ssh://h1", ConnectionLost("events on ssh://h1: connection lost: gone",
                                                             target="ssh://h1", op="events", sent=True))
    hosts[1].client = EventsClient("ssh://h2", None)
    fleet = SimpleNamespace(up_hosts=lambda: hosts)
    a = argparse.Namespace(sandbox=None, replay=False, follow=True, json=as_json)
    status = asyncio.run(fleet_cli.fleet_events(fleet, a))
    out = capsys.readouterr()
    assert status == 1
    assert "dsec fleet events: h1: events on ssh://h1: connection lost: gone" in out.err, out.err
    if as_json:
        lines = [json.loads(line) for line in out.out.splitlines()]
        errors = [line for line in lines if "error" in line]
        assert errors == [{"error": {"code": "unreachable", "message": "events on ssh://h1: connection lost: gone",
                                     "detail": {"target": "ssh://h1", "op": "events", "sent": True}},
                           "host": "ssh://h1"}]
        assert sorted(line["sandbox"] for line in lines if "event" in line) == ["sb-h1", "sb-h2"]


def test_fleet_events_of_one_sandbox_come_from_its_host_quietly(capsys):
    """`dsec fleet events SB`: the hosts without SB answer not_found, which
    is no failure while one host holds it; when none does, it is the error."""
    hosts = [SimpleNamespace(target="ssh://h1", client=EventsClient("ssh://h1", None)),
             SimpleNamespace(target="ssh://h2", client=None)]

    class NotHere:
        async def events(self, sandbox=None, replay=False, follow=True):
            raise NotFound(f"no sandbox {sandbox!r}")
            yield

    hosts[1].client = NotHere()
    fleet = SimpleNamespace(up_hosts=lambda: hosts)
    a = argparse.Namespace(sandbox="sb-h1", sandbox_id=None, replay=True, follow=False, json=True)
    assert asyncio.run(fleet_cli.fleet_events(fleet, a)) == 0
    out = capsys.readouterr()
    assert [json.loads(line)["sandbox"] for line in out.out.splitlines()] == ["sb-h1"] and out.err == ""
    hosts[0].client = NotHere()
    with pytest.raises(NotFound):
        asyncio.run(fleet_cli.fleet_events(fleet, a))


def test_a_host_lost_under_a_fleet_command_says_to_run_it_again(tmp_path):
    """A host's daemon that drops the connection under `dsec fleet exec`:
    the error's advice is the command's (run it again), not the SDK
    fleet's (it reconnects; Fleet.status()), which a one-shot dsec never
    does."""
    from dsecd import ConnectionLost, protocol

    answers = {"hello": {"limits": {}}, "list": {"sandboxes": []}, "info": {}, "image_list": {"images": []},
               "image_du": {}, "ping": {}, "inspect": {"id": "sb1"}}

    async def daemon(reader, writer):
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f["op"] not in answers:
                    writer.transport.abort()            # dies under the exec
                    return
                writer.write(protocol.encode_frame({"id": f["id"], "result": answers[f["op"]]}))

    path = str(tmp_path / "h1.sock")
    said = _fleet_cli_fails(daemon, path, ["fleet", "--hosts", path, "exec", "sb1", "--", "true"], ConnectionLost)
    assert said.startswith(f"exec on {path}: connection lost") and "run the command again" in said, said
    assert "Fleet.status()" not in said, said


def test_a_sandbox_maybe_on_a_host_down_says_to_run_the_command_again(tmp_path):
    """`dsec fleet exec SB` with SB on no host that answered while another
    is down: unreachable, with the command's advice, not the SDK's
    (Fleet.status() means nothing at a shell)."""
    from dsecd import protocol
    from dsecd.errors import HostsDown

    async def daemon(reader, writer):
        dec = protocol.FrameDecoder(1 << 20)
        while data := await reader.read(65536):
            for f in dec.feed(data):
                if f["op"] == "inspect":
                    err = NotFound(f"no sandbox {f['args']['sandbox']!r}").to_wire()
                    writer.write(protocol.encode_frame({"id": f["id"], "error": err}))
                    continue
                answers = {"list": {"sandboxes": []}, "image_list": {"images": []}}
                writer.write(protocol.encode_frame({"id": f["id"], "result": answers.get(f["op"], {})}))

    path = str(tmp_path / "h1.sock")
    said = _fleet_cli_fails(daemon, path, ["fleet", "--hosts", f"{path},{tmp_path / 'h2.sock'}", "exec", "sb1",
                                           "--", "true"], HostsDown)
    assert "may be on one that is down" in said and "run the command again" in said, said
    assert "Fleet.status()" not in said, said


@pytest.mark.parametrize("words", [["sb-h1"], ["--sandbox", "sb-h1"]])
def test_fleet_events_asks_each_host_for_the_sandbox_named(words, capsys):
    """`dsec fleet events SB` (as `dsec events SB`) and `--sandbox SB`:
    each host is asked for SB's events only, not for all of its events."""
    asked = []

    class Recording:
        async def events(self, sandbox=None, replay=False, follow=True):
            asked.append(sandbox)
            if sandbox != "sb-h1":
                yield {"seq": 1, "time": 0.0, "event": "created", "sandbox": "sb-other"}

    hosts = [SimpleNamespace(target="ssh://h1", client=Recording())]
    a = cli.parse_args(["fleet", "--hosts", "x", "events", *words, "--replay", "--no-follow", "--json"])
    assert asyncio.run(fleet_cli.fleet_events(SimpleNamespace(up_hosts=lambda: hosts), a)) == 0
    assert asked == ["sb-h1"] and capsys.readouterr().out == ""


def test_fleet_top_orders_its_rows_by_sort(capsys):
    """`dsec fleet top --sort mem` (or id, state...) as `dsec top --sort`."""
    def row(sb, host, cpu_pct, memory):
        return {"id": sb, "host": host, "qos": "be", "state": "running", "cpu": 1.0, "cpu_pct": cpu_pct,
                "throttled_pct": 0.0, "memory": memory, "memory_limit": 1 << 30}

    async def top(labels=None):
        return {"hosts": {}, "down": {}, "errors": {},
                "sandboxes": [row("sb-a", "ssh://h1", 90.0, 1 << 20), row("sb-b", "ssh://h2", 5.0, 300 << 20),
                              row("sb-c", "ssh://h1", 50.0, 100 << 20)]}

    fleet = SimpleNamespace(top=top, hosts={})
    for sort, want in (("mem", ["sb-b", "sb-c", "sb-a"]), ("cpu", ["sb-a", "sb-c", "sb-b"]),
                       ("id", ["sb-a", "sb-b", "sb-c"])):
        a = cli.parse_args(["fleet", "--hosts", "x", "top", "--sort", sort])
        assert asyncio.run(fleet_cli.fleet_top(fleet, a)) == 0
        rows = [line.split()[1] for line in capsys.readouterr().out.splitlines() if " sb-" in line]
        assert rows == want, (sort, rows)
        a = cli.parse_args(["fleet", "--hosts", "x", "--json", "top", "--sort", sort])
        assert asyncio.run(fleet_cli.fleet_top(fleet, a)) == 0
        assert [s["id"] for s in json.loads(capsys.readouterr().out)["sandboxes"]] == want, sort


@pytest.mark.parametrize("as_json", [False, True])
def test_fleet_info_with_a_host_down_or_failing_fails_the_status(as_json, capsys):
    """As ps and top: the rows of hosts that are down say so, and the status
    is 1, so that `dsec fleet info && ...` does not take a partial fleet for
    a whole one."""
    a = cli.parse_args(["fleet", "--hosts", "x", *(["--json"] if as_json else []), "info"])
    assert asyncio.run(fleet_cli.fleet_info(fleet_of_three(), a)) == 1
    out = capsys.readouterr().out
    if as_json:
        hosts = json.loads(out)["hosts"]
        assert [hosts[f"/nonexistent/h{i}"]["up"] for i in (1, 2, 3)] == [True, False, False]
    else:
        assert "timed out" in out and "heartbeat failed" in out
    fleet = fleet_of_three()
    for host in fleet.hosts.values():
        host.up, host.client.fails = True, False
    assert asyncio.run(fleet_cli.fleet_info(fleet, a)) == 0


def _fleet_cli_fails(daemon, path: str, argv: list[str], raises: type) -> str:
    """What `dsec ARGV` raises (of type `raises`) with a fake daemon (a
    coroutine serving one connection) listening at `path`."""
    from dsecd import SshOptions

    async def go():
        server = await asyncio.start_unix_server(daemon, path)
        try:
            a = cli.parse_args(argv)
            with pytest.raises(raises) as e:
                await fleet_cli.run(a, cli.COMMANDS, cli.named_sandboxes, SshOptions())
            return str(e.value)
        finally:
            server.close()

    return asyncio.run(go())


def test_a_fleet_command_waits_for_a_hung_host_only_as_long_as_asked(tmp_path):
    async def hung(reader, writer):          # takes the connection, never says hello
        await asyncio.sleep(30)

    from dsecd.errors import HostsDown

    path = str(tmp_path / "hung.sock")
    said = _fleet_cli_fails(hung, path, ["fleet", "--hosts", path, "--connect-timeout", "0.4", "ps"], HostsDown)
    assert "did not answer in 0.4 s" in said, said


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf", "1e-9"])
def test_a_bad_connect_timeout_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["fleet", "--hosts", "h1", "--connect-timeout", value, "ps"])
    assert e.value.code == 2 and "--connect-timeout" in capsys.readouterr().err
    assert cli.parse_args(["fleet", "--hosts", "h1", "ps"]).connect_timeout == cli.FLEET_CONNECT_TIMEOUT_S


@pytest.mark.parametrize("value", ["0.001", "inf", "nan", "1e9"])
def test_top_interval_keeps_its_bounds_beside_the_fleet_connect_timeout(value, capsys):
    # `dsec top --interval` refreshes every S seconds: 0.001 would redraw
    # (and ask the daemon) a thousand times a second.
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["top", "--interval", value])
    assert e.value.code == 2 and "between 0.1 and 3600" in capsys.readouterr().err


def test_dsec_top_json_orders_its_sandboxes_by_sort(capsys):
    """`dsec top --json --sort mem` lists them as the table would."""
    def row(sb, cpu_pct, memory):
        return {"id": sb, "qos": "be", "state": "running", "cpu": 1.0, "cpu_pct": cpu_pct,
                "throttled_pct": 0.0, "memory": memory, "memory_limit": 1 << 30}

    class Top:
        async def top(self, labels=None):
            return {"host": {}, "sandboxes": [row("sb-a", 90.0, 1 << 20), row("sb-b", 5.0, 300 << 20),
                                              row("sb-c", 50.0, 100 << 20)]}

    for sort, want in (("mem", ["sb-b", "sb-c", "sb-a"]), ("cpu", ["sb-a", "sb-c", "sb-b"])):
        a = cli.parse_args(["top", "--json", "--sort", sort])
        assert asyncio.run(cli.cmd_top(Top(), a)) == 0
        assert [s["id"] for s in json.loads(capsys.readouterr().out)["sandboxes"]] == want, sort


def test_fleet_run_of_an_image_no_host_has_says_so_for_the_fleet():
    """`dsec fleet run nosuch` answered with one host's own not_found (which
    host unsaid, `dsec image ls` advised): it now names the fleet's hosts."""
    from dsecd.errors import NotFound

    class Host:
        def __init__(self, target):
            self.target = target
            self.asked = 0

        async def inspect_image(self, name):
            self.asked += 1
            raise NotFound(f"no image named {name!r}", {})

        async def close(self):
            pass

    async def go():
        f = _two_up_hosts(Host, images={"busybox": []})
        with pytest.raises(NotFound) as e:
            await fleet_cli._ThroughFleet(f).inspect_image("nosuch")
        return str(e.value), e.value.detail

    said, detail = asyncio.run(go())
    assert "no host of the fleet has an image named 'nosuch'" in said and "dsec fleet" in said, said
    assert set(detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}


def test_fleet_image_pull_pulls_on_every_host_instead_of_printing_du(capsys):
    """`dsec fleet image pull REF` fell through to `image du`: each host's
    store totals printed, exit 0, and nothing pulled."""

    class Host:
        def __init__(self, target):
            self.target = target

        async def pull_image(self, ref, progress=None, platform=None):
            return {"name": f"docker.io/library/{ref}", "layers": [{}], "bytes": 2048,
                    "pull": {"platform": platform}}

        async def image_du(self):
            raise AssertionError("image du asked instead of a pull")

        async def close(self):
            pass

    async def go():
        f = _two_up_hosts(Host)
        a = cli.parse_args(["fleet", "--hosts", "h1,h2", "image", "pull", "alpine:3", "--platform", "linux/arm64"])
        return await fleet_cli.fleet_image(f, a)

    assert asyncio.run(go()) == 0
    out = capsys.readouterr().out
    assert out.count("docker.io/library/alpine:3") == 2 and "pulled" in out, out


def test_fleet_image_build_sends_the_config_dsec_image_build_does():
    """--entrypoint went as one string (every host answered bad_request),
    and --cmd, --label and --expose were dropped without a word."""
    from dsecd.fleet import Fleet

    built = []

    class Host:
        def __init__(self, target):
            self.target = target

        async def build_image(self, path, name, parent=None, progress=None, **config):
            built.append(config)
            return {"name": name, "layers": [{}], "bytes": 1}

        async def close(self):
            pass

    async def go(argv):
        f = Fleet(["/nonexistent/h1.sock"])
        for h in f.hosts.values():
            h.up = h.joined = True
            h.client = Host(h.target)
        return await fleet_cli.fleet_image(f, cli.parse_args(argv))

    fleet = ["fleet", "--hosts", "h1", "image", "build", "/rootfs", "--name", "b"]
    assert asyncio.run(go([*fleet, "--entrypoint", "/bin/sh -c", "--cmd", '["echo", "hi"]',
                           "--label", "a=b", "--expose", "80", "--env", "X=1"])) == 0
    assert built == [{"entrypoint": ["/bin/sh", "-c"], "cmd": ["echo", "hi"], "labels": {"a": "b"},
                      "exposed_ports": ["80"], "env": {"X": "1"}}]
    # A Dockerfile is read from this machine's disk: not something each host can run from a path.
    with pytest.raises(cli.UsageError, match="--file"):
        asyncio.run(go([*fleet[:4], "build", "-f", "/ctx/Dockerfile", "/ctx", "--name", "b"]))


@pytest.mark.parametrize("argv,says", [
    (["fleet", "--hosts", "h1,h2", "run", "-d", "busybox", "true"], "dsec --host ssh://h2 logs sb1 7"),
    (["--host", "ssh://h2", "run", "-d", "busybox", "true"], "dsec --host ssh://h2 logs sb1 7"),
    (["run", "-d", "busybox", "true"], "dsec logs sb1 7"),
])
def test_run_detached_names_the_host_in_the_commands_it_suggests(argv, says, capsys):
    """`dsec fleet run -d` said `dsec logs SB PID; dsec rm --force SB`:
    run as written they asked this machine's daemon, not the sandbox's host."""
    from types import SimpleNamespace

    class C:
        async def run_detached(self, image, argv, entrypoint, **kw):
            client = SimpleNamespace(target="ssh://h2")
            return SimpleNamespace(pid=7, sb=SimpleNamespace(id="sb1", host="ssh://h2", client=client))

    a = cli.parse_args(argv)
    assert asyncio.run(cli._run_detached(C(), a)) == 0
    err = capsys.readouterr().err
    assert says in err and says.replace("logs sb1 7", "rm --force sb1") in err, err


@pytest.mark.parametrize("verb", [["rm", "--force"], ["pause"], ["resume"]])
def test_fleet_json_rm_pause_resume_print_each_missing_sandbox_as_json(verb, capsys):
    """`dsec --json rm nosuch` prints the error object on stdout; `dsec
    fleet --json rm nosuch` printed nothing there (stderr only), so a
    script reading stdout saw no answer for that sandbox."""
    from dsecd.errors import NotFound
    from dsecd.fleet import Fleet

    class Host:
        def __init__(self, target):
            self.target = target

        async def get(self, sandbox_id):
            raise NotFound(f"no sandbox {sandbox_id!r}", {"sandbox": sandbox_id})

        async def close(self):
            pass

    async def go():
        f = Fleet(["/nonexistent/h1.sock"])
        for h in f.hosts.values():
            h.up = h.joined = True
            h.client = Host(h.target)
        a = cli.parse_args(["fleet", "--hosts", "h1", "--json", *verb, "nosuch"])
        return await fleet_cli._each_sandbox(f, a, cli.COMMANDS, ["nosuch"])

    assert asyncio.run(go()) == 1
    out = capsys.readouterr().out
    err = json.loads(out)["error"]
    assert err["code"] == "not_found" and err["detail"]["sandbox"] == "nosuch", out


def _two_up_hosts(client_of, **attrs):
    """A Fleet of two hosts taken as joined and up, each host's client
    client_of(its target), and `attrs` set on each host."""
    from dsecd.fleet import Fleet

    f = Fleet(["/nonexistent/h1.sock", "/nonexistent/h2.sock"])
    for h in f.hosts.values():
        h.up = h.joined = True
        h.client = client_of(h.target)
        for name, value in attrs.items():
            setattr(h, name, value)
    return f


@pytest.mark.parametrize("removed", [False, True])
def test_fleet_pool_set_says_each_hosts_pool_and_a_removal(removed, capsys):
    """`pool set --min 0 --max 0` removes the pool, and the daemon's answer
    then has removed: true: each host's line was taken for an image gc's
    and the command died with a TypeError after the pools were removed."""

    class Host:
        def __init__(self, target):
            self.target = target

        async def pool_set(self, image, min, max, cpu=None, memory=None):
            return {"name": f"{image}@1cpu-512M", "image": image, "min": min, "max": max, "ready": 0,
                    **({"removed": True} if removed else {})}

    n = 0 if removed else 2
    a = cli.parse_args(["fleet", "--hosts", "h1,h2", "pool", "set", "--image", "busybox", "--min", str(n),
                        "--max", str(n)])
    assert asyncio.run(fleet_cli.fleet_pool(_two_up_hosts(Host), a)) == 0
    out = capsys.readouterr().out
    line = f"busybox@1cpu-512M: min {n} max {n}" + (" (removed)" if removed else "")
    assert out.splitlines() == [f"/nonexistent/h1.sock: pool {line}", f"/nonexistent/h2.sock: pool {line}"], out


@pytest.mark.parametrize("verb", ["drain", "undrain"])
def test_fleet_drain_drains_every_host_not_just_one(verb, capsys):
    """A command about no sandbox went to the first host up: `dsec fleet
    drain` drained one host and said nothing of the others."""
    done = []

    class Host:
        def __init__(self, target):
            self.target = target

        async def drain(self, reason=""):
            done.append(("drain", self.target, reason))
            return {"drained": True, "reason": reason, "since": 1.0}

        async def undrain(self):
            done.append(("undrain", self.target, None))
            return {"drained": False, "reason": None, "since": None}

    words = ["drain", "--reason", "rack move"] if verb == "drain" else ["undrain"]
    a = cli.parse_args(["fleet", "--hosts", "h1,h2", *words])
    assert asyncio.run(fleet_cli.FLEET_COMMANDS[verb](_two_up_hosts(Host), a)) == 0
    reason = "rack move" if verb == "drain" else None
    assert sorted(done) == [(verb, "/nonexistent/h1.sock", reason), (verb, "/nonexistent/h2.sock", reason)]
    said = "drained (rack move)" if verb == "drain" else "undrained"
    assert capsys.readouterr().out.splitlines() == [f"/nonexistent/h1.sock: {said}", f"/nonexistent/h2.sock: {said}"]
