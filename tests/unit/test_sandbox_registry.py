"""The registry's counts that admission reads at every create: kept as
sandboxes come, die and go, never by a scan, and equal to one."""

import math
import random

import pytest
from journal_kit import MemoryJournal

from dsecd.cpu import admission
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import Conflict

GiB = 1 << 30


def _sb(i: int, cpu: float, memory: int, state: str = "running") -> Sandbox:
    return Sandbox(id=f"{i:012x}", image="busybox", state=state, created=0.0,
                   limits={"cpu": cpu, "memory": memory, "pids": 64, "disk": 0})


def _scan(reg: SandboxRegistry) -> admission.Requested:
    return admission.total([s.limits for s in reg.by_id.values() if s.state != "dead"])


def test_requested_follows_add_die_destroy_and_failed_creates():
    reg = SandboxRegistry(MemoryJournal())
    a, b, c = _sb(1, 0.1, GiB), _sb(2, 0.2, 2 * GiB), _sb(3, 1.5, GiB, state="creating")
    for sb in (a, b, c):
        reg.add(sb)
    assert reg.requested() == admission.Requested(cpu=pytest.approx(1.8), memory=4 * GiB, sandboxes=3)
    reg.forget(c.id)                      # its create failed
    assert reg.requested() == admission.Requested(cpu=pytest.approx(0.3), memory=3 * GiB, sandboxes=2)
    reg.mark_dead(a)
    reg.mark_dead(a)                      # twice: counted off once
    assert reg.requested() == admission.Requested(cpu=pytest.approx(0.2), memory=2 * GiB, sandboxes=1)
    reg.remove(a)
    reg.remove(b)
    assert reg.requested() == admission.Requested() and reg.live_count() == 0


def test_a_sandbox_that_dies_during_its_destroy_is_counted_off_once():
    """Its init may exit while the destroy awaits (mark_dead, then remove):
    the live count must not go wrong for good."""
    reg = SandboxRegistry(MemoryJournal())
    a, b = _sb(1, 0.5, GiB), _sb(2, 0.5, GiB)
    reg.add(a)
    reg.add(b)
    reg.mark_dead(a)
    reg.remove(a)
    assert reg.live_count() == 1 and reg.requested().sandboxes == 1


def test_adding_a_sandbox_again_replaces_its_count():
    """A re-added id (a record read back) counts once, with its latest limits."""
    reg = SandboxRegistry(MemoryJournal())
    reg.add(_sb(1, 0.5, GiB))
    reg.add(_sb(1, 2.0, 2 * GiB))
    assert reg.requested() == admission.Requested(cpu=2.0, memory=2 * GiB, sandboxes=1)


def test_a_held_call_sandbox_counts_as_a_live_one_until_released():
    """FnCall's call sandboxes are not in by_id, yet take a slot of
    max_sandboxes and their CPU and memory, shown apart."""
    reg = SandboxRegistry(MemoryJournal())
    reg.add(_sb(1, 0.5, GiB))
    reg.hold("fn-0123456789", 2.0, 2 * GiB)
    reg.hold("fn-0123456789", 2.0, 2 * GiB)          # again: counted once
    assert reg.requested() == admission.Requested(cpu=2.5, memory=3 * GiB, sandboxes=2, call_sandboxes=1)
    assert reg.live_count() == 2 and "fn-0123456789" not in reg.by_id
    reg.release("fn-0123456789")
    reg.release("fn-0123456789")                     # twice: counted off once
    assert reg.requested() == admission.Requested(cpu=0.5, memory=GiB, sandboxes=1)


def test_requested_equals_a_scan_after_many_random_changes():
    """Fractional CPUs added and taken away many times leave no drift."""
    rng = random.Random(3)
    reg = SandboxRegistry(MemoryJournal())
    live: list[Sandbox] = []
    for i in range(5000):
        roll = rng.random()
        if roll < 0.55 or not live:
            sb = _sb(i, rng.choice([0.1, 0.25, 1 / 3, 2.0]), rng.randrange(1, 64) << 20)
            reg.add(sb)
            live.append(sb)
        elif roll < 0.7:
            reg.mark_dead(rng.choice(live))
        elif roll < 0.9:
            sb = live.pop(rng.randrange(len(live)))
            reg.remove(sb)
        else:
            sb = live.pop(rng.randrange(len(live)))
            if sb.state == "dead":
                reg.remove(sb)
            else:
                sb.state = "creating"
                reg.forget(sb.id)
    got, want = reg.requested(), _scan(reg)
    assert got.memory == want.memory and got.sandboxes == want.sandboxes
    # The exact sum, rounded once: what a correctly rounded sum of the live ones gives.
    assert got.cpu == math.fsum(s.limits["cpu"] for s in reg.by_id.values() if s.state != "dead")
    assert reg.live_count() == want.sandboxes


@pytest.mark.parametrize("reason, says", [
    ("ttl", "its ttl ran out"), ("idle_ttl", "it was idle past its idle_ttl"),
    ("lease", "its lease was not renewed"), ("request", "by a destroy request"),
    ("job", "by a job rm"), ("all", "by a destroy of all sandboxes"), ("pool", "by its warm pool")])
def test_a_request_on_a_destroyed_sandbox_says_it_was_destroyed_and_why(reason, says):
    """A scaffold whose sandbox a TTL took away is told so, not only that
    there is no such sandbox."""
    from dsecd.errors import NotFound

    reg = SandboxRegistry(MemoryJournal())
    a = _sb(1, 0.1, GiB)
    reg.add(a)
    reg.remove(a, reason)
    with pytest.raises(NotFound, match=f"no sandbox '{a.id}': it was destroyed .* ago, {says}") as info:
        reg.named(a.id)
    assert info.value.detail == {"sandbox": a.id, "destroyed": reason}
    with pytest.raises(NotFound, match=r"no sandbox 'ffffffffffff' \(see `dsec ps`\)$"):
        reg.named("ffffffffffff")


def test_destroyed_sandboxes_are_remembered_up_to_a_bound():
    reg = SandboxRegistry(MemoryJournal())
    for i in range(reg.REMEMBER_DESTROYED + 10):
        sb = _sb(i, 0.1, GiB)
        reg.add(sb)
        reg.remove(sb, "request")
    assert len(reg.destroyed) == reg.REMEMBER_DESTROYED
    assert f"{0:012x}" not in reg.destroyed and f"{reg.REMEMBER_DESTROYED + 9:012x}" in reg.destroyed


def test_a_request_for_a_dead_sandbox_says_how_to_be_rid_of_it():
    from dsecd import protocol
    from dsecd.errors import Conflict

    reg = SandboxRegistry(MemoryJournal())
    sb = _sb(7, 0.1, GiB, state="dead")
    reg.add(sb)
    with pytest.raises(Conflict) as err:
        reg.get(sb.id, protocol.REQUESTS["exec"])
    assert f"sandbox {sb.id} is dead" in err.value.message
    assert f"dsec rm {sb.id}" in err.value.message, err.value.message
    assert err.value.detail == {"sandbox": sb.id, "state": "dead"}


def test_an_ambiguous_prefix_names_what_it_begins_and_a_short_one_says_how_long():
    """What to do next is said: which ids an ambiguous prefix begins, and
    that a prefix shorter than MIN_PREFIX names no sandbox even where
    one id begins with it."""
    from dsecd.errors import BadRequest, NotFound

    reg = SandboxRegistry(MemoryJournal())
    a, b = _sb(0xabcd01000000, 0.1, GiB), _sb(0xabcd02000000, 0.1, GiB)
    for sb in (a, b):
        reg.add(sb)
    assert reg.named(a.id[:-1]) is a and reg.named(a.id) is a
    with pytest.raises(BadRequest, match=f"ambiguous: it begins {a.id}, {b.id}; give more of the id") as info:
        reg.named("abcd0")
    assert info.value.detail == {"matches": [a.id, b.id]}
    with pytest.raises(NotFound, match="an id prefix needs 4 characters at least") as info:
        reg.named("abc")
    assert info.value.detail == {"sandbox": "abc"}
    with pytest.raises(NotFound, match=r"no sandbox 'fff' \(see `dsec ps`\)$"):
        reg.named("fff")


class _Exec:
    OP, STATES = "exec", ("running",)


@pytest.mark.parametrize("death, says", [
    ({"reason": "its init (pid 7) exited", "signal": "SIGKILL"}, "its init (pid 7) exited; killed by SIGKILL"),
    ({"reason": "exited", "signal": "SIGKILL", "oom_kills": 2},
     "its QEMU exited; killed by SIGKILL; 2 OOM kill(s) of its QEMU's memory cgroup"),
    ({"reason": "panic", "exit_code": 0, "detail": "Kernel panic - not syncing: sysrq triggered crash"},
     "its guest kernel panicked; exit code 0; Kernel panic - not syncing: sysrq triggered crash"),
    ({"reason": "gone", "detail": "its VM ended while no daemon ran"},
     "found dead when the daemon started; its VM ended while no daemon ran"),
])
def test_a_request_to_a_dead_sandbox_says_what_it_died_of(death, says):
    reg = SandboxRegistry(MemoryJournal())
    sb = _sb(1, 0.1, GiB)
    reg.add(sb)
    reg.mark_dead(sb)
    sb.death = death
    with pytest.raises(Conflict) as err:
        reg.get(sb.id, _Exec)
    assert f"is dead ({says}); exec needs it running" in str(err.value)
    assert err.value.detail["death"] == death and sb.public()["death"] == death


@pytest.mark.parametrize("death, tag", [
    (None, ""),
    ({"reason": "its init (pid 7) exited", "signal": "SIGKILL"}, ", SIGKILL"),
    ({"reason": "its init exited while no daemon ran"}, ""),
    ({"reason": "exited", "signal": "SIGKILL", "oom_kills": 1}, ", exited, SIGKILL, 1 oom kills"),
    ({"reason": "panic", "exit_code": 0, "detail": "Kernel panic"}, ", panic, exit 0"),
])
def test_dsec_ps_says_in_short_what_a_dead_sandbox_died_of(death, tag):
    from dsecd.cli.sandboxes import _death_tag
    assert _death_tag(death) == tag


def test_a_dead_sandbox_of_an_older_daemon_has_no_death_to_say():
    reg = SandboxRegistry(MemoryJournal())
    sb = _sb(1, 0.1, GiB)
    reg.add(sb)
    reg.mark_dead(sb)
    with pytest.raises(Conflict, match=r"is dead; exec needs it running") as err:
        reg.get(sb.id, _Exec)
    assert "death" not in err.value.detail
