"""`dsec top`: the daemon's per-sandbox samples (the `top` op), as one
snapshot or, on a terminal, a live table like top(1).

Snapshot (stdout is not a terminal, --once, or --json): host line and a
plain table, or the op's JSON, printed once; scripts and pipes read this.

Live (stdout and stdin are terminals): the screen is redrawn every
--interval seconds through rich; keys: c cpu, m memory, w swap, t throttled,
i id, s state, o QoS to sort by, r to reverse the order, q (or ^C) to quit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import termios
import tty

SORTS = {  # --sort name -> (key, its hotkey, biggest first by default)
    "cpu": (lambda s: s["cpu_pct"] or 0.0, "c", True),
    "mem": (lambda s: s["memory"] or 0, "m", True),
    "swap": (lambda s: s.get("swap") or 0, "w", True),
    "throttled": (lambda s: s["throttled_pct"] or 0.0, "t", True),
    "id": (lambda s: s["id"], "i", False),
    "state": (lambda s: (s["state"], s["id"]), "s", False),
    "qos": (lambda s: (s["qos"] or "", s["id"]), "o", False),
}
HOTKEYS = {hot: name for name, (_, hot, _) in SORTS.items()}
COLUMN = {"cpu": "CPU%", "mem": "MEM", "swap": "SWAP", "throttled": "THROTTLED", "id": "ID", "state": "STATE", "qos": "QOS"}


def human_bytes(n: int | float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def pct(v) -> str:
    return "-" if v is None else f"{v:.1f}%"


def host_line(top: dict) -> str:
    h = top.get("host") or {}
    if not h:
        return "host: no sample yet"
    psi = (h.get("psi_cpu") or {}).get("some_avg10")
    return (f"host: {h['cpus']} cpus, cpu {pct(h['cpu_pct'])}, load {' '.join(map(str, h['loadavg']))}, "
            f"mem {human_bytes(h['mem_total'] - h['mem_available'])}/{human_bytes(h['mem_total'])}, "
            f"cpu pressure {pct(psi)}")


# Scripts read the snapshot's columns by position: SWAP came after the
# eight they had, and BALLOON stays last (its cell may hold a space:
# "256.0M/256.0M (off)", read as the rest of the line).
HEADER = ["ID", "QOS", "STATE", "CPU", "CPU%", "THROTTLED", "MEM", "MEM LIMIT", "SWAP", "BALLOON"]


def balloon_cell(b: dict | None) -> str:
    """A microVM's guest size / its RAM (the idle balloon made it smaller
    when the first is less); "(off)": not ballooned (a template's restore);
    "-": a container, or a VM not looked at yet."""
    if not b:
        return "-"
    cell = f"{human_bytes(b['guest_size'])}/{human_bytes(b['ram'])}"
    return f"{cell} (off)" if b.get("skipped") else cell


def ordered(top: dict, sort: str = "cpu", reverse: bool = False) -> list[dict]:
    """The sandboxes of a `top` answer in the order `sort` names."""
    key, _, biggest_first = SORTS[sort]
    return sorted(top["sandboxes"], key=key, reverse=biggest_first != reverse)


def rows(top: dict, sort: str = "cpu", reverse: bool = False) -> list[list[str]]:
    return [[s["id"], s["qos"] or "-", s["state"], f"{s['cpu']:g}", pct(s["cpu_pct"]), pct(s["throttled_pct"]),
             "-" if s["memory"] is None else human_bytes(s["memory"]), human_bytes(s["memory_limit"]),
             "-" if s.get("swap") is None else human_bytes(s["swap"]), balloon_cell(s.get("vm_balloon"))]
            for s in ordered(top, sort, reverse)]


def print_snapshot(top: dict, sort: str) -> None:
    print(host_line(top))
    table = rows(top, sort)
    widths = [max(len(str(x)) for x in col) for col in zip(HEADER, *table, strict=False)]
    for row in [HEADER, *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())


def live_possible() -> bool:
    """A terminal on both ends, and rich to draw with (without it: one
    snapshot, and a word on stderr of what to install)."""
    if not (sys.stdout.isatty() and sys.stdin is not None and os.isatty(0)):
        return False
    if importlib.util.find_spec("rich") is None:
        print("dsec top: the live view needs rich (apt-get install python3-rich); one snapshot instead",
              file=sys.stderr)
        return False
    return True


# rich is imported where the live view starts: it costs ~0.1 s, which every
# other dsec command (and a piped `dsec top`) need not pay.
def _screen(top: dict | None, sort: str, reverse: bool, interval: float, labels: dict, lost: str | None = None):
    """The live view; with `lost`, why the last fetch failed, above the
    figures of the one before (if any)."""
    from rich.console import Group
    from rich.text import Text

    if lost is None:
        return _figures(top, sort, reverse, interval, labels)
    said = Text(f"{lost}\ntrying again every {interval:g}s (q quits)", style="bold red")
    if top is None:
        return said
    return Group(said, Text("the figures below are from before", style="dim"),
                 _figures(top, sort, reverse, interval, labels))


def _figures(top: dict, sort: str, reverse: bool, interval: float, labels: dict):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(expand=True, box=None, header_style="bold reverse", pad_edge=False)
    for name in HEADER:
        table.add_column(name + (" \u25bc" if name == COLUMN[sort] else ""),
                         justify="left" if name in ("ID", "QOS", "STATE") else "right", no_wrap=True)
    for row in rows(top, sort, reverse):
        table.add_row(*row, style="dim" if row[2] != "running" else None)
    n = len(top["sandboxes"])
    where = f" matching {labels}" if labels else ""
    keys = "  ".join(f"{hot}:{name}" for name, (_, hot, _) in SORTS.items())
    head = Text.assemble((host_line(top), "bold"), f"\n{n} sandboxes{where}, sorted by {sort}"
                         f"{' (reversed)' if reverse else ''}, every {interval:g}s   {keys}  r:reverse  q:quit")
    return Group(head, Text(""), table)


async def run_live(fetch, interval: float, sort: str, labels: dict) -> int:
    """Redraw every `interval` s until q or ^C. `fetch()`: the top op's result."""
    from rich.console import Console
    from rich.live import Live

    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[str] = asyncio.Queue()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    reverse = False
    try:
        tty.setcbreak(fd)
        loop.add_reader(fd, lambda: keys.put_nowait(os.read(fd, 32).decode(errors="replace")))
        top = None
        with Live(console=Console(), screen=True, auto_refresh=False) as live:
            while True:
                try:
                    top, lost = await fetch(), None
                except ConnectionError as err:
                    # A daemon restart (the sandboxes run on): the client
                    # connects again at the next fetch.
                    lost = str(err)
                live.update(_screen(top, sort, reverse, interval, labels, lost), refresh=True)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        pressed = await keys.get()
                        for key in pressed.lower():
                            if key == "q":
                                return 0
                            if key == "r":
                                reverse = not reverse
                            elif key in HOTKEYS:
                                sort, reverse = HOTKEYS[key], False
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
