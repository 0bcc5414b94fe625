"""How `dsec image build -f` shows a Dockerfile build on a terminal.

A `BuildView` takes the events the build streams (Client.build_dockerfile's
`progress`) and draws them with rich: a live line for the running step
(step N/M, its instruction, a spinner, the time so far), RUN output printed
above it as it comes, and one line per finished step with CACHED or its
time. The CLI uses it only when stdout is a terminal and --json is not
given; otherwise it prints the result alone.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text


class BuildView:
    def __init__(self, console: Console | None = None):
        self.console = console or Console(file=sys.stdout, highlight=False)
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]\\[{task.fields[n]}/{task.fields[of]}]"),
                                 TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                                 console=self.console, transient=True)
        self.tasks: dict[int, int] = {}
        self.steps: dict[int, str] = {}
        self.partial: dict[tuple[int, int], bytes] = {}      # (step, fd) -> an unfinished line
        self.progress.start()

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "step":
            n = event["step"]
            self.steps[n] = event["instruction"]
            width = max(20, self.console.width - 30)
            text = event["instruction"]
            shown = text if len(text) <= width else text[:width - 1] + "…"
            self.tasks[n] = self.progress.add_task(shown, total=None, n=n, of=event["of"])
        elif kind == "output":
            self._output(event["step"], event["fd"], bytes(event["data"]))
        elif kind == "step_done":
            self._done(event)
        elif kind == "warning":
            self.console.print(Text(f"warning: {event['message']}", style="yellow"))

    def _output(self, step: int, fd: int, data: bytes) -> None:
        buf = self.partial.pop((step, fd), b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self._line(line, fd)
        if rest:
            self.partial[(step, fd)] = rest

    def _line(self, line: bytes, fd: int) -> None:
        # What a terminal would show of it: a \r (progress redrawn in place)
        # starts the line over; one before the \n (CRLF) ends it.
        shown = line.decode(errors="replace").rstrip("\r").rpartition("\r")[2]
        self.console.print(Text("  " + shown, style="dim" if fd == 1 else "dim red"), soft_wrap=True)

    def _done(self, event: dict) -> None:
        n = event["step"]
        for (step, fd) in [k for k in self.partial if k[0] == n]:
            self._line(self.partial.pop((step, fd)), fd)
        task = self.tasks.pop(n, None)
        if task is not None:
            self.progress.remove_task(task)
        line = Text()
        line.append(f"[{n}/{event['of']}] ", style="bold")
        line.append(self.steps.get(n, ""))
        line.append("  ")
        if event["cached"]:
            line.append("CACHED", style="cyan")
        else:
            line.append(f"{event['seconds']:.2f}s", style="green")
        self.console.print(line, soft_wrap=True)

    def close(self) -> None:
        for key in list(self.partial):
            self._line(self.partial.pop(key), key[1])
        self.progress.stop()
