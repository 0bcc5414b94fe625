"""dsecd.Fleet without hosts: placement, the retry of a refused create with
its key, and the settling of keys whose create answer was lost. The hosts'
Clients are stand-ins; what a host reports is a hand-made `info`."""

from __future__ import annotations

import asyncio
import collections

import pytest

from dsecd import ConnectionLost, Fleet
from dsecd.client import Sandbox
from dsecd.errors import BadRequest, Busy, HostsDown, NotFound


def info(cpu_req=0.0, cpu_cap=128.0, mem_req=0, mem_cap=100 << 30, live=0, max_sandboxes=4096) -> dict:
    return {"cpu": {"admission": {"cpu": {"requested": cpu_req, "capacity": cpu_cap},
                                  "memory": {"requested": mem_req, "capacity": mem_cap}}},
            "limits": {"max_sandboxes": max_sandboxes}, "sandboxes": {"running": live},
            "admission": {"queued": 0}, "userns": {"enabled": False}}


def fleet_of(n: int) -> Fleet:
    f = Fleet([f"/nonexistent/h{i}.sock" for i in range(1, n + 1)])
    for h in f.hosts.values():
        h.up = h.joined = True
        h.info = info()
        h.images = {"busybox": ["sha256:aa"]}
    return f


class FakeClient:
    """Answers create from a script: an exception to raise, or a sandbox."""

    def __init__(self, target: str, answers: list):
        self.target = target
        self.answers = answers
        self.keys: list[str] = []
        self.destroyed: list[str] = []

    async def create(self, image, key=None, labels=None, **kw):
        self.keys.append(key)
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return Sandbox(self, answer, {"id": answer, "key": key, "labels": labels or {}})

    async def request(self, op, **args):
        assert op == "destroy"
        self.destroyed.append(args["sandbox"])
        return {}

    async def close(self):
        pass


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("hosts", ["h12", "h1,h2"])
def test_hosts_given_as_one_string_say_to_give_a_list(hosts):
    with pytest.raises(TypeError, match=r"Fleet takes a list of hosts, not a string: Fleet\(\['h1"):
        Fleet(hosts)


def test_an_async_on_event_is_refused_not_left_unawaited():
    async def on_event(ev):
        pass

    class Handler:
        async def __call__(self, ev):
            pass

    for handler in (on_event, Handler()):
        with pytest.raises(TypeError, match=r"must not be async; iterate fleet.events\(\)"):
            Fleet(["h1"], on_event=handler)
    Fleet(["h1"], on_event=print)


@pytest.mark.parametrize("ask", [{"memory": "lots"}, {"memory": -5}, {"cpu": "x"}, {"cpu": [1]}])
def test_a_cpu_or_memory_that_does_not_read_is_a_bad_request(ask):
    """As a host's own create answers it: a BadRequest (a DsecError), not
    the ValueError of reading it for placement; no host is asked."""
    async def go():
        f = fleet_of(2)
        for h in f.hosts.values():
            h.client = FakeClient(h.target, [])
        with pytest.raises(BadRequest, match=f"create: {next(iter(ask))}"):
            await f.create("busybox", **ask)
        return [h.client.keys for h in f.hosts.values()]

    assert run(go()) == [[], []]


def test_a_closed_fleet_says_so_instead_of_busy_or_empty():
    """Its hosts still read as up: a create was `busy` (retry later), a
    list an empty list. Each request now says the fleet is closed."""
    async def go():
        f = fleet_of(2)
        for h in f.hosts.values():
            h.client = FakeClient(h.target, ["sb"])
        await f.close()
        said = []
        for call in (lambda: f.create("busybox"), f.list, lambda: f.get("abcd1234"), lambda: f.job_pause("j"),
                     lambda: f.call("busybox")):
            with pytest.raises(RuntimeError, match="the fleet is closed") as e:
                await call()
            said.append(str(e.value))
        return said

    said = run(go())
    assert said[0] == "create 'busybox': the fleet is closed"


@pytest.mark.parametrize("arg", ["heartbeat_s", "down_after_s", "rejoin_s", "refresh_s", "connect_timeout"])
def test_every_period_of_the_fleet_must_be_positive(arg):
    """rejoin_s=0 would start a new ssh to a down host without pause, refresh_s=0
    read every host's info, images and du without pause."""
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"{arg} must be positive, got {bad}"):
            Fleet(["h1"], **{arg: bad})


def test_a_jobs_sandboxes_spread_over_equal_hosts():
    async def go():
        f = fleet_of(4)
        from dsecd.fleet import _Shape
        for _ in range(100):
            h = f._place("busybox", "j1", _Shape(0.1, 64 << 20), {})
            h.add(f"sb{len(h.sandboxes)}-{h.name}", "j1")
            h.done.append((0.0, _Shape(0.1, 64 << 20)))
            h.count(_Shape(0.1, 64 << 20), 1)
        return [len(h.sandboxes) for h in f.hosts.values()]

    counts = run(go())
    assert max(counts) - min(counts) <= 1, counts


def test_full_host_unknown_image_and_recent_busy_are_skipped():
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(4)
        h1, h2, h3, h4 = f.hosts.values()
        h1.info = info(cpu_req=128.0)                        # no CPU left
        h2.images = {}                                       # no such image
        h3.busy_until = asyncio.get_running_loop().time() + 60
        skip = {}
        assert f._place("busybox", "", _Shape(1.0, 1 << 20), skip) is h4
        return skip

    skip = run(go())
    # h2 is passed over while a host that lists the image is left, not skipped
    # for good: its list may be stale (the next test).
    assert set(skip) == {"/nonexistent/h1.sock", "/nonexistent/h3.sock"}
    assert "full" in skip["/nonexistent/h1.sock"]


def test_a_host_whose_list_lacks_the_image_is_asked_once_those_listing_it_refused():
    """Lists are a second old: the one host that lists the image answers
    not_found (its image was removed), the one that does not list it has it
    by now. The create lands there; not_found only when it too says so."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        b.images = {}
        a.client = FakeClient(a.target, [NotFound("no image 'busybox'")])
        b.client = FakeClient(b.target, ["sb-b"])
        sb = await f.create("busybox")
        return sb.id, len(a.client.keys), len(b.client.keys)

    assert run(go()) == ("sb-b", 1, 1)


def test_mounted_layers_win_a_tie():
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(3)
        warm = list(f.hosts.values())[2]
        warm.mounted = {"sha256:aa"}
        return [f._place("busybox", "", _Shape(1.0, 1 << 20), {}) is warm for _ in range(20)]

    assert all(run(go()))


def test_the_host_whose_pager_cache_holds_the_image_wins_a_tie():
    """A shared store: every host lists the image, none has it mounted; the
    one that paged most of its bytes in is chosen, the layers weighed by size."""
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(3)
        cold, little, most = f.hosts.values()
        for h in f.hosts.values():
            h.images = {"busybox": ["sha256:aa", "sha256:bb"]}
            h.layer_sizes = {"sha256:aa": 90 << 20, "sha256:bb": 10 << 20}
        little.cached = {"sha256:bb": 1.0}                   # all of the small layer: 10%
        most.cached = {"sha256:aa": 0.8}                     # most of the big one: 72%
        shares = [round(h.warmth("busybox"), 2) for h in (cold, little, most)]
        return shares, [f._place("busybox", "", _Shape(1.0, 1 << 20), {}) is most for _ in range(20)]

    shares, picks = run(go())
    assert shares == [0.0, 0.1, 0.72]
    assert all(picks)


def test_busy_goes_to_the_next_host_with_the_same_key():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, [Busy("full", {"retry_after_s": 1})] * 5)
        b.client = FakeClient(b.target, ["sb-b"])
        a.mounted = {"sha256:aa"}                            # a is tried first
        sb = await f.create("busybox", labels={"job": "j"})
        return sb, a, b

    sb, a, b = run(go())
    assert sb.id == "sb-b" and sb.host == b.target
    assert a.client.keys == b.client.keys and a.client.keys[0].startswith("fleet-")
    assert b.jobs["j"] == 1 and a.busy_until > 0


def test_every_host_refusing_is_busy_with_each_reason():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, [Busy("cpu full")])
        b.client = FakeClient(b.target, [NotFound("no image 'busybox'")])
        with pytest.raises(Busy) as e:
            await f.create("busybox")
        return e.value

    err = run(go())
    assert set(err.detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}
    assert "cpu full" in str(err) and "no image" in str(err)


def test_no_host_having_the_image_is_not_found_not_busy():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.images = b.images = {}                             # neither lists it: both are asked all the same
        a.client = FakeClient(a.target, [NotFound("no image 'nosuch'")])
        b.client = FakeClient(b.target, [NotFound("no image 'nosuch'")])
        with pytest.raises(NotFound) as e:
            await f.create("nosuch")
        return e.value, a.client.keys + b.client.keys

    err, asked = run(go())
    assert len(asked) == 2 and "retry" not in str(err) and "retry_after_s" not in err.detail
    assert set(err.detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}
    assert "no host of the fleet has the image" in str(err) and "no image 'nosuch'" in str(err)


def test_a_not_found_of_something_else_than_the_image_is_not_said_to_be_the_image():
    """A create naming a policy no host has: every host answers not_found
    about the policy. That was "no host of the fleet has the image" (for
    an image every host has), and each host's image list lost the image
    until its next refresh. A host lacking the policy is still passed
    over for one that may have it."""
    policy = NotFound("create: policy: no policy 'nosuch'; this daemon has agent",
                      {"policy": "nosuch", "known": ["agent"]})

    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, [policy])
        b.client = FakeClient(b.target, [policy])
        with pytest.raises(NotFound) as e:
            await f.create("busybox", policy="nosuch")
        return e.value, a.client.keys + b.client.keys, [h.images for h in (a, b)]

    err, asked, images = run(go())
    assert len(asked) == 2 and "retry_after_s" not in err.detail
    assert "has the image" not in str(err) and "no policy 'nosuch'" in str(err), str(err)
    assert "no host of the fleet can take it as asked" in str(err), str(err)
    assert set(err.detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}
    assert images == [{"busybox": ["sha256:aa"]}] * 2


@pytest.mark.parametrize("ask", [{"cpu": 1000}, {"memory": "1T"}])
def test_more_than_any_host_can_ever_give_is_a_bad_request_not_busy(ask):
    async def go():
        f = fleet_of(2)
        for h in f.hosts.values():
            h.info["cpu"]["admission"]["cpu"]["cpus"] = 16
            h.info["cpu"]["admission"]["memory"]["mem_total"] = 64 << 30
            h.client = FakeClient(h.target, [])              # never asked: its info says it cannot
        with pytest.raises(BadRequest) as e:
            await f.create("busybox", **ask)
        return e.value

    err = run(go())
    assert "more than this host can ever give" in str(err) and "retry_after_s" not in err.detail
    assert set(err.detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}


def test_a_host_too_small_by_its_own_answer_is_passed_over_for_a_larger_one():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.mounted = {"sha256:aa"}                            # a is tried first
        a.client = FakeClient(a.target, [BadRequest(
            "asks for 8 CPUs, more than this host can ever give a sandbox (4)",
            {"resource": "cpu", "asking": 8, "max": 4})])
        b.client = FakeClient(b.target, ["sb-b"])
        return await f.create("busybox", cpu=8)

    assert run(go()).id == "sb-b"


def test_a_bad_request_every_host_would_give_is_raised_at_once():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.mounted = {"sha256:aa"}
        a.client = FakeClient(a.target, [BadRequest("unknown qos class 'x'")])
        b.client = FakeClient(b.target, ["sb-b"])
        with pytest.raises(BadRequest, match="unknown qos"):
            await f.create("busybox", qos="x")
        return b.client.keys

    assert run(go()) == []


def test_a_permanent_refusal_beside_a_busy_or_down_host_is_still_busy():
    async def go():
        f = fleet_of(3)
        a, b, c = f.hosts.values()
        a.client = FakeClient(a.target, [NotFound("no image 'busybox'")])
        b.client = FakeClient(b.target, [Busy("cpu full")])
        c.up = False
        c.reason = "heartbeat failed"
        with pytest.raises(Busy) as e:
            await f.create("busybox")
        return e.value

    err = run(go())
    assert err.detail["retry_after_s"] and "down: heartbeat failed" in str(err) and "no image" in str(err)


def _answer_lost_on_the_first_host():
    """A fleet of two whose first host (placed first: its layers are there)
    loses the answer of its create, and whose second one makes "sb-b"."""
    f = fleet_of(2)
    a, b = f.hosts.values()
    lost = ConnectionLost("create: connection lost", target=a.target, op="create", sent=True)
    a.client = FakeClient(a.target, [lost])
    b.client = FakeClient(b.target, ["sb-b"])
    a.mounted = {"sha256:aa"}
    return f, a, b


def test_a_lost_answer_is_settled_when_the_host_rejoins():
    """The create's answer was lost on h1 (it may exist there); it was made on
    h2 with the same key. When h1 rejoins, its copy is destroyed."""
    async def go():
        f, a, b = _answer_lost_on_the_first_host()
        events = []
        f.on_event = events.append
        sb = await f.create("busybox", key="k1")
        assert "k1" in a.uncertain_keys and sb.host == b.target
        rows = [{"id": "sb-a", "key": "k1", "labels": {}, "state": "running"},
                {"id": "other", "key": "k9", "labels": {}, "state": "running"}]
        await f._settle_keys(a, rows)
        return a.client.destroyed, events, a.uncertain_keys

    destroyed, events, left = run(go())
    assert destroyed == ["sb-a"] and not left
    assert [e["event"] for e in events] == ["duplicate_removed"] and events[0]["kept_on"] == "/nonexistent/h2.sock"


def test_a_key_whose_host_is_down_is_not_made_again_elsewhere():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, ["sb-a"])
        b.client = FakeClient(b.target, ["sb-b"])
        a.mounted = {"sha256:aa"}
        await f.create("busybox", key="k1")
        a.up = False
        with pytest.raises(ConnectionLost, match="its sandbox is on"):
            await f.create("busybox", key="k1")
        return b.client.keys

    assert run(go()) == []


def test_a_new_key_waits_for_hosts_that_never_answered():
    """A driver restarted while a host was down: a key it sends again may
    be that of a sandbox on that host, which this fleet has not learned.
    Placed elsewhere it would be a second sandbox for the key, so a keyed
    create is HostsDown until every host answered once; one without a key
    is placed as usual."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, ["sb-a1", "sb-a2"])
        b.up = b.joined = False
        b.reason = "cannot connect: refused"
        with pytest.raises(HostsDown, match="may be on a host that has not answered") as err:
            await f.create("busybox", key="k1")
        anonymous = await f.create("busybox")
        b.joined = True               # it answered once, and went down again: its keys are known
        keyed = await f.create("busybox", key="k1")
        return err.value.detail, anonymous.host, keyed.host, a.client.keys

    detail, anonymous, keyed, keys = run(go())
    assert detail["key"] == "k1" and list(detail["down"]) == ["/nonexistent/h2.sock"]
    assert anonymous == keyed == "/nonexistent/h1.sock" and keys[-1] == "k1"


def test_a_destroyed_sandboxs_key_is_free_again_and_not_kept():
    """The daemon frees a key with its sandbox. The fleet forgets it too: a
    long-lived fleet holds no key per sandbox it ever made, and a create
    with the key again is placed anew, not sent to the old host (here down)."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = FakeClient(a.target, [f"sb-a{i}" for i in range(102)])
        b.client = FakeClient(b.target, [f"sb-b{i}" for i in range(102)])
        for i in range(100):
            await (await f.create("busybox", key=f"k{i}")).destroy()
        kept = (dict(f._key_home), dict(f._key_of))
        first = await f.create("busybox", key="k1")
        await first.destroy()
        f.hosts[first.host].up = False
        again = await f.create("busybox", key="k1")
        return kept, first.host, again.host

    (key_home, key_of), first, again = run(go())
    assert key_home == {} and key_of == {}
    assert again != first


def test_a_key_that_may_have_a_copy_on_a_down_host_is_kept_past_a_destroy():
    """The answer of a create was lost on h1 and it was made on h2; the
    sandbox on h2 is destroyed while h1 is away. h1's copy is still removed
    when it rejoins: the key still names h2 as its home."""
    async def go():
        f, a, b = _answer_lost_on_the_first_host()
        sb = await f.create("busybox", key="k1")
        await sb.destroy()
        await f._settle_keys(a, [{"id": "sb-a", "key": "k1", "labels": {}, "state": "running"}])
        return a.client.destroyed

    assert run(go()) == ["sb-a"]


def test_a_hosts_call_sandboxes_count_against_its_room():
    """FnCall's call sandboxes take slots of limits.max_sandboxes (info's
    admission counts them) though `sandboxes` lists none: a host whose
    slots they fill is not placed on, to answer busy."""
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(1)
        h = list(f.hosts.values())[0]
        h.info = info(live=2, max_sandboxes=4)
        h.info["cpu"]["admission"]["sandboxes"] = {"live": 4, "call_sandboxes": 2, "queued": 0, "max": 4}
        shape = _Shape(0.1, 1 << 20)
        return h.load_after(shape), f._place("busybox", "", shape, {})

    assert run(go()) == (None, None)


def test_creates_since_the_last_info_count_against_the_room():
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(1)
        h = list(f.hosts.values())[0]
        h.info = info(live=2, max_sandboxes=4)
        shape = _Shape(0.1, 1 << 20)
        assert h.load_after(shape) == 0.75
        h.count(shape, 1)                           # one sent since: the last slot
        assert h.load_after(shape) == 1.0
        h.count(shape, 1)
        assert h.load_after(shape) is None and f._place("busybox", "", shape, {}) is None

    run(go())


def test_job_shares_count_per_host():
    f = fleet_of(2)
    a = list(f.hosts.values())[0]
    a.resync([{"id": "x", "labels": {"job": "j"}, "state": "running"},
              {"id": "y", "labels": {}, "state": "running"}, {"id": "z", "labels": {"job": "j"}, "state": "dead"}])
    assert a.jobs == collections.Counter({"j": 1, "": 1}) and set(a.sandboxes) == {"x", "y"}
    a.forget("x")
    assert a.jobs["j"] == 0


class JoinableClient:
    """A host that answers what joining and the heartbeat ask: no sandboxes, busybox, room."""

    def __init__(self, target: str):
        self.target = target
        self.on_lost = None
        self.last_frame_at = 0.0

    async def connect(self):
        pass

    async def list(self, labels=None):
        return []

    async def info(self):
        return info()

    async def list_images(self):
        return [{"name": "busybox", "layers": [{"digest": "sha256:aa"}]}]

    async def image_du(self):
        return {"mounted_layers": {}}

    async def request(self, op, **args):
        assert op == "ping"
        return {}

    def abort_now(self, reason):
        return None

    async def abort(self, reason):
        pass

    async def close(self):
        pass


def test_a_host_that_connects_but_fails_to_join_does_not_say_cannot_connect():
    """Its daemon answered hello, then an error on what joining reads (a
    daemon without image_du, say): the reason is that error, not "cannot
    connect", which sends the user to check ssh."""
    class NoDu(JoinableClient):
        async def image_du(self):
            raise BadRequest("unknown op 'image_du'")

    async def go():
        async with Fleet(["h1"], client_factory=NoDu, heartbeat_s=0.05, rejoin_s=60) as f:
            return f.status()[0]["reason"]

    reason = run(go())
    assert reason == "connected, but joining failed: bad_request: unknown op 'image_du'", reason


def test_a_host_added_later_joins_and_takes_creates():
    async def go():
        events = []
        f = Fleet(["h1"], client_factory=JoinableClient, on_event=events.append, heartbeat_s=0.05)
        async with f:
            assert [e["event"] for e in events] == ["host_up"]
            with pytest.raises(ValueError, match="given twice"):
                f.add_host("h1")
            h2 = f.add_host("h2")
            assert not h2.up and events[-1] == {**events[-1], "event": "host_added", "host": "h2"}
            async with asyncio.timeout(5):
                while not h2.up:
                    await asyncio.sleep(0.01)
            from dsecd.fleet import _Shape
            f.hosts["h1"].add("sb1", "j")                  # h1 holds one of the job's: h2 gets the next
            placed = f._place("busybox", "j", _Shape(0.1, 1 << 20), {})
        return [e["event"] for e in events], placed

    kinds, placed = run(go())
    assert kinds == ["host_up", "host_added", "host_up"], kinds
    assert placed.target == "h2"


class GetClient:
    """Answers get: the sandbox if it is `held` here, else not_found."""

    def __init__(self, target: str, held: set[str]):
        self.target = target
        self.held = held

    async def get(self, sandbox_id):
        if sandbox_id not in self.held:
            raise NotFound(f"no sandbox {sandbox_id!r}")
        return Sandbox(self, sandbox_id, {"id": sandbox_id})


def test_a_sandbox_not_on_the_up_hosts_while_one_is_down_is_unreachable_not_missing():
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.up, a.reason = False, "heartbeat failed: connection lost"
        b.client = GetClient(b.target, {"sb-b"})
        assert (await f.get("sb-b")).host == b.target
        with pytest.raises(HostsDown) as e:
            await f.get("sb-a")
        a.up = True
        a.client = GetClient(a.target, set())
        with pytest.raises(NotFound):
            await f.get("sb-a")                          # every host answered: it is nowhere
        return e.value

    err = run(go())
    assert isinstance(err, ConnectionError) and err.detail["down"] == {"/nonexistent/h1.sock":
                                                                      "heartbeat failed: connection lost"}
    assert "may be on one that is down" in str(err) and "h1.sock: heartbeat failed" in str(err)


def test_a_prefix_one_host_finds_ambiguous_is_said_not_missing():
    """A prefix naming two sandboxes on one host: that host's bad_request
    (ambiguous, with the matches) is the answer, not "no sandbox"."""
    class Ambiguous(GetClient):
        async def get(self, sandbox_id):
            raise BadRequest(f"sandbox prefix {sandbox_id!r} is ambiguous", {"matches": ["abcd1", "abcd2"]})

    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = Ambiguous(a.target, set())
        b.client = GetClient(b.target, set())
        with pytest.raises(BadRequest) as e:
            await f.get("abcd")
        return e.value

    err = run(go())
    assert "is ambiguous" in str(err) and err.detail["matches"] == ["abcd1", "abcd2"]


def test_sync_fleet_has_the_fleets_events_hosts_and_each_host():
    from dsecd import SyncFleet

    with SyncFleet(["h1"], client_factory=JoinableClient, heartbeat_s=0.05) as f:
        assert [h.target for h in f.up_hosts()] == ["h1"]
        events = f.events()
        first = f.add_host("h2")
        assert first.target == "h2"
        seen = []
        for ev in events:
            seen.append((ev["event"], ev["host"]))
            if ev["event"] == "host_up":
                events.close()
        assert seen == [("host_added", "h2"), ("host_up", "h2")]
        assert sorted(h.target for h in f.up_hosts()) == ["h1", "h2"]
        found = f.each_host(lambda c: c.image_du())
        assert found == {"h1": {"mounted_layers": {}}, "h2": {"mounted_layers": {}}}
        f.events().close()                                   # closed before any next(): unsubscribed too
        assert f._fleet._subscribers == []


def test_fleet_events_hold_what_came_after_the_call():
    """events() is subscribed when called: an event between the call and
    the first next() is not missed; closed, it is unsubscribed."""
    async def go():
        f = fleet_of(1)
        host = next(iter(f.hosts.values()))
        events = f.events()
        f._emit("host_down", host, reason="test", sandboxes=[])
        ev = await asyncio.wait_for(anext(events), 1.0)
        assert (ev["event"], ev["host"]) == ("host_down", host.target)
        await events.aclose()
        unused = f.events()
        await unused.aclose()                        # closed before any next(): unsubscribed too
        assert f._subscribers == []
        async for _ in events:                      # a closed one gives nothing more
            raise AssertionError("an event after aclose")

    run(go())


class KeyedHostClient(JoinableClient):
    """A host already holding sandboxes made with idempotency keys (by an
    earlier fleet); a create with a key it holds is answered with that sandbox."""

    held: dict[str, dict[str, str]] = {}             # target -> key -> sandbox id

    def __init__(self, target: str):
        super().__init__(target)
        self.creates: list[str] = []

    async def list(self, labels=None):
        return [{"id": sb, "key": key, "state": "running", "labels": {"job": "j"}}
                for key, sb in self.held.get(self.target, {}).items()]

    async def create(self, image, key=None, labels=None, **kw):
        self.creates.append(key)
        sb = self.held.setdefault(self.target, {}).setdefault(key, f"sb-{key}-{self.target}")
        return Sandbox(self, sb, {"id": sb, "key": key, "labels": labels or {}})


def test_a_key_made_before_the_fleet_goes_back_to_its_host():
    """A driver restarted sends its creates again with their keys: each
    goes to the host already holding the key's sandbox (learned when the
    host joined), not, by placement, to another host as a second one."""
    KeyedHostClient.held = {"h2": {"k1": "sb-old", "k2": "sb-old2"}}

    async def go():
        async with Fleet(["h1", "h2"], client_factory=KeyedHostClient, heartbeat_s=0.05) as f:
            # h2 holds two of job j, h1 none: placement alone would pick h1.
            got = [await f.create("busybox", key=k, labels={"job": "j"}, cpu=0.1, memory="1M") for k in ("k1", "k2")]
            return [(sb.host, sb.id) for sb in got], f.hosts["h1"].client.creates

    got, h1_creates = run(go())
    assert got == [("h2", "sb-old"), ("h2", "sb-old2")]
    assert h1_creates == []


def test_sandboxes_a_host_no_longer_runs_are_forgotten_at_a_refresh():
    """Destroyed by their TTL or another client: the fleet counted them
    for placement and kept their keys for ever. When a host's info counts
    fewer live sandboxes than the fleet does, it lists them and forgets
    the gone ones (their keys too) and stops counting the dead."""
    class Host:
        def __init__(self, rows):
            self.rows = rows

        async def info(self):
            return {**info(), "sandboxes": {"running": 1, "dead": 1}}

        async def list_images(self):
            return []

        async def image_du(self):
            return {}

        async def list(self, labels=None):
            return self.rows

    async def go():
        f = fleet_of(1)
        (h,) = f.hosts.values()
        for sb_id, key in (("kept", "k1"), ("gone", "k2"), ("died", "k3")):
            h.add(sb_id, "j")
            f._where[sb_id] = h.target
            f._key_of[sb_id] = key
            f._key_home[key] = h.target
        h.client = Host([{"id": "kept", "state": "running"}, {"id": "died", "state": "dead"}])
        await f._refresh(h)
        return dict(h.sandboxes), h.jobs["j"], set(f._where), set(f._key_home)

    sandboxes, job_count, where, keys = run(go())
    assert sandboxes == {"kept": "j"} and job_count == 1
    assert where == {"kept", "died"} and keys == {"k1", "k3"}     # a dead one can still be inspected or destroyed


def test_a_gone_sandbox_hidden_by_a_new_one_is_forgotten_at_the_next_listing():
    """The counts match (another client made one as one of ours went): the
    listing every PRUNE_S forgets the gone one all the same."""
    class Host:
        listed = 0

        async def info(self):
            return info(live=1)

        async def list_images(self):
            return []

        async def image_du(self):
            return {}

        async def list(self, labels=None):
            Host.listed += 1
            return [{"id": "theirs", "state": "running"}]

    async def go():
        f = fleet_of(1)
        (h,) = f.hosts.values()
        h.add("ours", "j")
        f._where["ours"] = h.target
        h.client = Host()
        await f._refresh(h)              # the first refresh lists
        first = (Host.listed, set(h.sandboxes))
        h.add("ours2", "j")
        f._where["ours2"] = h.target
        await f._refresh(h)              # within PRUNE_S, counts equal: no listing
        return first, Host.listed, set(h.sandboxes)

    first, listed, left = run(go())
    assert first == (1, set()) and listed == 1 and left == {"ours2"}


def test_a_host_whose_daemon_predates_image_du_still_refreshes():
    """A fleet mid-upgrade: an older daemon answers image_du with "unknown
    op"; the host's warmth is unknown, and it is not kept down for it."""
    class OlderHost:
        async def info(self):
            return info()

        async def list_images(self):
            return [{"name": "busybox", "layers": [{"digest": "sha256:aa", "size": 1}]}]

        async def image_du(self):
            raise BadRequest("unknown op 'image_du'", {"id": 7, "ops": ["info", "image_list"]})

        async def list(self, labels=None):
            return []

    async def go():
        f = fleet_of(1)
        (h,) = f.hosts.values()
        h.client = OlderHost()
        await f._refresh(h)
        return h.images, h.mounted, h.cached

    assert run(go()) == ({"busybox": ["sha256:aa"]}, set(), {})



def test_a_sandbox_gone_while_its_host_was_down_is_forgotten_with_its_key_at_the_rejoin():
    """Its TTL ended it while its host was down: the rejoin says it is gone
    (host_up's `gone`), and the fleet forgets it and its key. Kept, the
    key still named that host, and a create with it, once that host was
    down again, was refused as "its sandbox is on" a host that held none."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.client = JoinableClient(a.target)          # lists no sandbox: "gone" went meanwhile
        b.client = FakeClient(b.target, ["sb-new"])
        a.add("gone", "j")
        f._where["gone"] = a.target
        f._key_of["gone"] = "k1"
        f._key_home["k1"] = a.target
        events = []
        f.on_event = events.append
        f._host_down(a, "test")
        await f._join(a)
        a.up = False                                  # down again
        sb = await f.create("busybox", key="k1")
        return events[-1], set(f._where), f._key_of, sb.host

    up, where, key_of, placed = run(go())
    assert up["event"] == "host_up" and up["gone"] == ["gone"]
    assert "gone" not in where and "gone" not in key_of
    assert placed == "/nonexistent/h2.sock"


def test_sync_fleet_listings_say_which_host_failed_to_answer():
    """SyncFleet.list and list_images take Fleet's `errors`: without it a
    script could not tell a listing missing an up host that failed to
    answer from a whole one (it was a TypeError)."""
    from dsecd import SyncFleet

    async def fails(*args):
        raise ConnectionLost("list on h2: connection lost", target="h2", op="list", sent=True)

    with SyncFleet(["h1", "h2"], client_factory=JoinableClient, heartbeat_s=0.05) as f:
        h2 = f._fleet.hosts["h2"].client
        h2.list = h2.list_images = fails
        for listing in (f.list, f.list_images):
            errors = {}
            assert listing(errors=errors) == ([] if listing == f.list else
                                               [{"name": "busybox", "layers": [{"digest": "sha256:aa"}],
                                                 "host": "h1"}])
            assert list(errors) == ["h2"] and isinstance(errors["h2"], ConnectionLost)


class CallClient:
    """Answers call: `answer` (raised if an exception)."""

    def __init__(self, target: str, answer):
        self.target = target
        self.answer = answer
        self.calls = 0

    async def call(self, image, **kw):
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_a_call_goes_on_past_a_host_without_the_image_and_says_which_lack_it():
    """A call placed on a host whose image list is stale (not_found there)
    failed with that one host's error, naming neither it nor the fleet,
    while another host had the image; with no host having it, the error
    now names each host, as create's does."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.mounted = {"sha256:aa"}                            # a is tried first
        a.client = CallClient(a.target, NotFound("no image named 'busybox'"))
        b.client = CallClient(b.target, {"exit_code": 0})
        found = await f.call("busybox")
        a.client.calls = 0
        b.client = CallClient(b.target, NotFound("no image named 'busybox'"))
        a.images = b.images = {"busybox": ["sha256:aa"]}
        with pytest.raises(NotFound) as e:
            await f.call("busybox")
        return found, e.value, a.client.calls + b.client.calls

    found, err, asked = run(go())
    assert found == {"exit_code": 0}
    assert asked == 2 and str(err).startswith("not_found: call 'busybox': no host of the fleet has the image (")
    assert set(err.detail["hosts"]) == {"/nonexistent/h1.sock", "/nonexistent/h2.sock"}


def test_a_drained_host_gets_no_create():
    """A drained host refuses every create (busy): placement skips it by its
    info rather than send it each create first, which cost a round trip
    and, for BUSY_BACKOFF_S only, left it out."""
    async def go():
        f = fleet_of(2)
        a, b = f.hosts.values()
        a.info = {**info(), "drain": {"drained": True, "reason": "", "since": 1.0}}
        b.info = {**info(cpu_req=100.0), "drain": {"drained": False, "reason": None, "since": None}}
        a.client = FakeClient(a.target, ["sb-a"])
        b.client = FakeClient(b.target, ["sb-b"])
        sb = await f.create("busybox")
        return sb.id, a.client.keys

    assert run(go()) == ("sb-b", [])


def test_a_hosts_idle_call_sandboxes_leave_it_room():
    """Idle call sandboxes give way to a create on their host (info's
    admission `idle_call_sandboxes`): their slots, CPU and memory are room
    for placement."""
    async def go():
        from dsecd.fleet import _Shape
        f = fleet_of(1)
        h = list(f.hosts.values())[0]
        h.info = info(cpu_req=1.0, cpu_cap=1.0, mem_req=2 << 20, live=2, max_sandboxes=4)
        adm = h.info["cpu"]["admission"]
        adm["sandboxes"] = {"live": 4, "call_sandboxes": 2, "queued": 0, "max": 4}
        adm["idle_call_sandboxes"] = {"sandboxes": 1, "cpu": 0.5, "memory": 1 << 20}
        shape = _Shape(0.1, 1 << 20)
        full = h.load_after(shape)
        h.info["cpu"]["admission"]["sandboxes"]["max"] = 8
        h.info["limits"]["max_sandboxes"] = 8
        return full, h.load_after(shape)

    full, cpu_bound = run(go())
    assert full == 1.0                          # the last slot: an idle call sandbox's
    assert cpu_bound == pytest.approx(0.6)      # 1.0 CPU requested, 0.5 of it idle call sandboxes'
