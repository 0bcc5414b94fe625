"""What a config reload (dsecd/configreload.py) finds changed between the
running config and the file read again."""

from dsecd.config import load_config
from dsecd.configreload import RELOADABLE, changes


def test_an_unchanged_file_changes_nothing(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[daemon]\nlog_level = "debug"\n')
    assert changes(load_config(str(f)).raw, load_config(str(f)).raw) == []


def test_each_setting_changed_is_named_once_and_a_user_named_entry_whole(tmp_path):
    old = load_config(None).raw
    f = tmp_path / "c.toml"
    f.write_text('[fncall]\nmax_boxes = 8\n[limits]\nmax_sandboxes = 9\n'
                 '[policy.agent]\nrest = "writable"\n[policy.mine]\nrest = "hidden"\n')
    got = {key: (was, now) for key, was, now in changes(old, load_config(str(f)).raw)}
    assert got["fncall.max_boxes"] == (64, 8) and got["limits.max_sandboxes"] == (4096, 9)
    assert got["policy.mine"] == (None, {"rest": "hidden"})
    assert got["policy.agent"][1] == {"rest": "writable"} and got["policy.agent"][0]["hidden"] == ["/grader"]
    assert set(got) == {"fncall.max_boxes", "limits.max_sandboxes", "policy.agent", "policy.mine"}


def test_every_reloadable_setting_is_a_config_key():
    raw = load_config(None).raw
    for key in RELOADABLE:
        section, _, name = key.partition(".")
        assert name in raw[section], key


def test_a_stopping_daemon_finishes_the_reload_under_way_and_starts_none():
    """A SIGHUP as the daemon stopped ran a reload alongside the close of
    the services it applies settings to (a worker pool shut down under it,
    an idle sweep started again after the call service closed). close()
    waits for the reload under way; a reload asked for after it reads
    nothing."""
    import asyncio
    from types import SimpleNamespace

    from dsecd.configreload import Reloader

    async def go():
        gate = asyncio.Event()
        builds = []

        async def run(fn, *args):
            builds.append(fn)
            await gate.wait()
            return fn(*args)

        raw = load_config(None).raw
        node = SimpleNamespace(workers=SimpleNamespace(run=run), cfg=SimpleNamespace(raw=raw))
        r = Reloader(SimpleNamespace(config=None), node, lambda args: load_config(None),
                     lambda given: None, lambda error, keys: None)
        r.request()
        await asyncio.sleep(0)
        assert len(builds) == 1                     # the reload under way waits in its build
        closing = asyncio.get_running_loop().create_task(r.close(10))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not closing.done()
        gate.set()
        await closing
        assert r.last is not None and r.last["ok"], r.last
        r.request()
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(builds) == 1 and not r._tasks

    asyncio.run(go())


def test_a_stop_waits_for_a_reload_that_does_not_end_only_so_long(caplog):
    """A reload whose read of the config never returns (the file on a hung
    file system, its worker stuck) held the stop before anything else
    closed. close(timeout) gives up on it after `timeout`, says so, and
    cancels it where it waits: it applies nothing after."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from dsecd.configreload import Reloader

    async def go():
        async def run(fn, *args):
            await asyncio.Event().wait()        # a worker that never answers

        node = SimpleNamespace(workers=SimpleNamespace(run=run), cfg=SimpleNamespace(raw=load_config(None).raw))
        r = Reloader(SimpleNamespace(config=None), node, lambda args: load_config(None),
                     lambda given: None, lambda error, keys: None)
        r.request()
        await asyncio.sleep(0)
        await asyncio.wait_for(r.close(0.05), 5)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not r._tasks and r.last is None          # cancelled, nothing recorded as applied

    with caplog.at_level(logging.WARNING, logger="dsecd"):
        asyncio.run(go())
    assert "a config reload still under way after 0.1 s; cancelled" in caplog.text
