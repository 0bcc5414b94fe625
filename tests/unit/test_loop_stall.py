"""LoopMonitor's stall report: when the event loop stops turning, the log
says where it is stuck before systemd's watchdog kills the daemon, which
leaves nothing but "Watchdog timeout" and a SIGABRT."""

from __future__ import annotations

import asyncio
import logging
import time

from log_kit import records_of

from dsecd import looplag
from dsecd.sdnotify import Notifier


def wedged_in_a_callback():
    time.sleep(4.0)


def _monitored(monkeypatch, caplog, body) -> None:
    """Run `await body()` under a LoopMonitor that reports a stall of 1 s."""
    monkeypatch.setattr(looplag, "STALL_REPORT_S", 1.0)
    monkeypatch.setattr(looplag, "STALL_CHECK_S", 0.05)

    async def run():
        monitor = looplag.LoopMonitor(Notifier(environ={}), lambda: "")
        monitor.start()
        try:
            await body()
        finally:
            monitor.stop()

    with caplog.at_level(logging.INFO, "dsecd.looplag"):
        asyncio.run(run())


def test_a_stalled_loop_is_reported_with_where_it_is_stuck(monkeypatch, caplog):
    async def body():
        await asyncio.sleep(0.3)         # turning: nothing said
        wedged_in_a_callback()           # the loop stops turning here
        await asyncio.sleep(1.0)         # and turns again

    _monitored(monkeypatch, caplog, body)
    stalled = records_of(caplog, "loop_stalled")
    assert len(stalled) == 1, [r.getMessage() for r in caplog.records]
    assert stalled[0].levelno == logging.WARNING and "wedged_in_a_callback" in stalled[0].fields["stack"]
    assert "has not turned" in stalled[0].getMessage()
    resumed = records_of(caplog, "loop_resumed")
    assert len(resumed) == 1 and resumed[0].fields["stalled_s"] > 0, [r.getMessage() for r in caplog.records]


def test_a_loop_that_turns_is_not_reported(monkeypatch, caplog):
    _monitored(monkeypatch, caplog, lambda: asyncio.sleep(0.5))
    assert not [r for r in caplog.records if getattr(r, "fields", {}).get("event")], caplog.records
