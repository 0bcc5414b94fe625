"""`dsec top`'s table (dsecd/topview.py): its columns, the BALLOON column of
microVMs, the live view."""

from dsecd import topview

MiB = 1 << 20


def _row(**kw) -> dict:
    return {"id": "ab12", "qos": "be", "state": "running", "cpu": 1.0, "cpu_pct": 1.0, "throttled_pct": 0.0,
            "memory": 10 * MiB, "memory_limit": 256 * MiB, **kw}


def test_balloon_column_says_guest_size_over_ram_or_why_not():
    top = {"sandboxes": [_row(id="vm", vm_balloon={"guest_size": 129 * MiB, "ram": 256 * MiB, "skipped": False}),
                         _row(id="tmpl", vm_balloon={"guest_size": 256 * MiB, "ram": 256 * MiB, "skipped": True}),
                         _row(id="box", vm_balloon=None), _row(id="old")]}
    at = topview.HEADER.index("BALLOON")
    cells = {r[0]: r[at] for r in topview.rows(top, "id")}
    assert cells == {"vm": "129.0M/256.0M", "tmpl": "256.0M/256.0M (off)", "box": "-", "old": "-"}


def test_columns_keep_their_places_and_balloon_stays_last():
    """Scripts read a snapshot's columns by position: SWAP goes after the
    eight columns they read, and BALLOON, whose cell may hold a space,
    stays last (read as the rest of the line)."""
    assert topview.HEADER == ["ID", "QOS", "STATE", "CPU", "CPU%", "THROTTLED", "MEM", "MEM LIMIT", "SWAP",
                              "BALLOON"]
    rows = {r[0]: r for r in topview.rows({"sandboxes": [_row(id="a", swap=3 * MiB), _row(id="b")]}, "id")}
    assert rows["a"][6:] == ["10.0M", "256.0M", "3.0M", "-"]
    assert rows["b"][8] == "-"                   # a daemon without the figure


def test_the_live_view_goes_on_through_a_daemon_restart(monkeypatch):
    """A restart drops the connection while the sandboxes run on: the live
    view says why its fetch failed, keeps the last figures, and shows new
    ones once the daemon answers again (the client connects again)."""
    import asyncio
    import io
    import os
    import pty

    from rich.console import Console

    master, slave = pty.openpty()
    monkeypatch.setattr(topview.sys, "stdin", os.fdopen(slave, "r", closefd=False))
    screens = []
    real_screen = topview._screen

    def screen(*args):
        out = Console(file=io.StringIO(), width=200, record=True)
        out.print(real_screen(*args))
        screens.append(out.export_text())
        return real_screen(*args)

    monkeypatch.setattr(topview, "_screen", screen)
    answers = iter([{"sandboxes": [_row(id="before")]}, ConnectionError("connection lost: the daemon closed it"),
                    {"sandboxes": [_row(id="after")]}])

    async def fetch():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        if answer["sandboxes"][0]["id"] == "after":
            os.write(master, b"q")
        return answer

    try:
        assert asyncio.run(topview.run_live(fetch, 0.05, "id", {})) == 0
    finally:
        os.close(master)
        os.close(slave)
    assert len(screens) == 3
    assert "before" in screens[0] and "connection lost" not in screens[0]
    assert "connection lost: the daemon closed it" in screens[1] and "before" in screens[1]
    assert "after" in screens[2] and "connection lost" not in screens[2]
