"""`dsec image pull` on a terminal: one progress bar per layer (bytes, rate,
ETA) drawn with rich on stderr, from the pull's progress events
(docs/protocol.md, image_pull). Nothing is drawn unless both stdout and
stderr are terminals and --json is off: a script gets the result alone."""

from __future__ import annotations

import sys

STATES = {"waiting": "waiting", "downloading": "downloading", "converting": "converting", "stored": "stored",
          "reused": "already stored"}


def wanted(json_output: bool) -> bool:
    return not json_output and sys.stdout.isatty() and sys.stderr.isatty()


class PullView:
    """A progress callback for Client.pull_image; use as a context manager."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = None
        self.tasks: dict[int, int] = {}
        self.status = None

    def __enter__(self) -> PullView:
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[state]}"),
            console=Console(stderr=True), transient=False)
        self.progress.start()
        self.status = self.progress.add_task("resolving", total=None, state="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, p: dict) -> None:
        if self.progress is None:
            return
        step = p.get("step")
        if step == "resolve":
            via = f" from {p['registry']}" if p.get("registry") and not p["ref"].startswith(p["registry"] + "/") else ""
            self.progress.update(self.status, description=f"{p['ref']}{via} ({p['platform']})",
                                 # The registry's digest (what `image pull REF@sha256:...` takes),
                                 # not the store's own manifest the result names.
                                 state=f"{p['layers']} layer(s), registry digest {p['digest'][:19]}")
        elif step == "mirror":
            # The next source's manifest may differ: its layers get bars of their own.
            for task in self.tasks.values():
                self.progress.remove_task(task)
            self.tasks.clear()
            self.progress.console.print(f"mirror {p['mirror']} failed, trying {p['next']}: {p['error']}")
        elif step == "wait":
            self.progress.update(self.status, state=f"waiting for {p['holder']}, who pulls it too")
        elif step == "pull":
            task = self.tasks.get(p["layer"])
            if task is None:
                task = self.tasks[p["layer"]] = self.progress.add_task(
                    f"  layer {p['layer'] + 1}/{p['of']} {p['digest'][7:19]}", total=p["size"], state="")
            self.progress.update(task, completed=p["bytes"], state=STATES.get(p["state"], p["state"]))
