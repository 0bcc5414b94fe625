"""`dsec image ...` and `dsec snapshot`: images built (from a directory, a
tarball or a Dockerfile), pulled, listed, inspected, tagged, flattened,
removed and collected, and a sandbox's files made an image."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .. import imageconfig, pullview
from ..client import Client
from ..clitext import UsageError, image_config, image_removed
from ..clitext import human_bytes as _human_bytes
from ..clitext import kv as _kv
from ..clitext import print_json as _print_json
from ..clitext import table as _table
from ..errors import BadRequest, DsecError
from ..pullview import PullView
from .common import _ProgressBar


def _replaced(img: dict) -> str:
    """A build's note of the image its name had: the name moved, and that
    image stays for the sandboxes on it until `image gc`."""
    return f"; replaced manifest {img['replaced'][:19]} under that name" if img.get("replaced") else ""


def _print_image(img: dict, verb: str, note: str = "") -> None:
    layers = ", ".join(layer["digest"][7:19] for layer in img["layers"])
    print(f"{verb} {img['name']}: {len(img['layers'])} layer(s) [{layers}], {_human_bytes(img['bytes'])}, "
          f"manifest {img['manifest'][:19]}{note}")


def _stdin_dockerfile() -> str:
    """The Dockerfile `-f -` reads from stdin: UTF-8, as a Dockerfile read
    from a file must be (stdin's text layer would pass other bytes on as
    surrogates, which no request can carry)."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(f"the Dockerfile on stdin (-f -) is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "is it the Dockerfile?", {"dockerfile": "<stdin>"}) from None


async def cmd_image_dockerfile(c: Client, a) -> int:
    """`dsec image build -f Dockerfile CONTEXT --name N`: progress on a
    terminal (dsecd/buildview.py), else only the result."""
    view = None
    if not a.json and sys.stdout.isatty():
        from ..buildview import BuildView

        view = BuildView()

    def warnings_only(event: dict) -> None:
        # Off a terminal: no steps, but what a warning says (files left out) on stderr.
        if event.get("event") == "warning":
            print(f"dsec image build: warning: {event['message']}", file=sys.stderr)

    dockerfile, text = (a.file, None) if a.file != "-" else ("<stdin>", _stdin_dockerfile())    # docker's -f -
    try:
        img = await c.build_dockerfile(a.path, a.name, dockerfile, text, build_args=_build_args(a.build_arg),
                                       allow=a.allow, no_cache=a.no_cache, progress=view or warnings_only)
    except DsecError as err:
        if view is None and err.detail.get("output_tail"):     # nothing of the failed RUN was shown: its last output
            print(err.detail["output_tail"].rstrip("\n"), file=sys.stderr)
        raise
    finally:
        if view is not None:        # whatever ends the build (Ctrl-C too): or the cursor stays hidden
            view.close()
    if a.json:
        _print_json(img)
        return 0
    cached = sum(1 for s in img["steps"] if s["cached"])
    _print_image(img, "built", _replaced(img))
    if view is not None:
        print(f"{len(img['steps'])} steps, {cached} cached, {img['seconds']:.2f}s")
    return 0


# What `dsec image inspect` says after the last name of an image's
# ancestors, by why the walk stopped there (image_inspect's ancestors_end).
_ANCESTORS_END = {
    "removed": " (removed since)",
    "replaced": " (the name was moved to another image since)",
    "loop": " again: a cycle of parents in refs written before parents were recorded with their manifest",
}


def _ancestors(img: dict) -> str:
    """An image's chain of parents as inspect answers it, by name, each the
    parent of the one before, and what became of the last one."""
    chain = img.get("ancestors")
    if not chain:                    # none, or a daemon that does not answer it
        return "-"
    return " -> ".join(chain) + _ANCESTORS_END.get(img.get("ancestors_end"), "")


def _print_image_details(img: dict) -> None:
    """`dsec image inspect` without --json: the image and its config, one field a line."""
    cfg = imageconfig.normalise(img.get("config"))
    rows = [("name", img["name"]), ("manifest", img["manifest"]),
            ("layers", ", ".join(f"{layer['digest'][7:19]} ({_human_bytes(layer.get('bytes', layer['size']))})"
                                 for layer in img["layers"]) or "none"),
            ("size", _human_bytes(img["bytes"])), ("parent", img.get("parent") or "-"),
            ("ancestors", _ancestors(img)),
            ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(img["created"]))
             if img.get("created") else "-"),
            ("user", cfg["user"] or "(root)"), ("cwd", cfg["cwd"]),
            ("entrypoint", json.dumps(cfg["entrypoint"], ensure_ascii=False)),
            ("cmd", json.dumps(cfg["cmd"], ensure_ascii=False)),
            ("exposed ports", " ".join(cfg["exposed_ports"]) or "-")]
    rows += [("env", f"{k}={v}") for k, v in sorted(cfg["env"].items())]
    rows += [("label", f"{k}={v}") for k, v in sorted(cfg["labels"].items())]
    rows.append(("sandboxes", " ".join(img.get("sandboxes") or []) or "-"))
    for name, value in rows:
        print(f"{name + ':':<15}{value}")


async def _warn_if_shadowed(c: Client, ref: str, pulled: str) -> None:
    """A bare name (`app`) finds a local image of that name before the
    pulled `app:latest` (local names first): say so after a pull of one, or
    the next `dsec run app` runs the other image without a word."""
    if any(ch in ref for ch in "/:@"):
        return
    try:
        found = await c.inspect_image(ref)
    except DsecError:
        return
    if found["name"] != pulled:
        print(f"dsec image pull: warning: {ref!r} names the local image {found['name']} (made here), which a "
              f"bare name finds first; name the pulled image {pulled}, or remove the local one "
              f"(`dsec image rm {found['name']}`)", file=sys.stderr)


async def cmd_image(c: Client, a) -> int:
    if a.image_cmd == "build" and a.file:
        return await cmd_image_dockerfile(c, a)
    if a.image_cmd in ("build", "import"):
        bar = _ProgressBar(not a.json)
        try:
            img = await c.build_image(a.path, a.name, getattr(a, "parent", None), bar, **image_config(a))
        finally:
            bar.done()          # ends its status line: an error goes on a line of its own
        if a.json:
            _print_json(img)
        else:
            _print_image(img, "built", _replaced(img))
        return 0
    if a.image_cmd == "pull":
        with PullView(pullview.wanted(a.json)) as view:
            img = await c.pull_image(a.ref, view, a.platform)
        if a.json:
            _print_json(img)
        else:
            via = img["pull"].get("registry")
            mirrored = via and not img["name"].startswith(f"{via}/") and via != "docker.io"
            _print_image(img, "up to date" if img["pull"].get("up_to_date") else "pulled",
                         f", from the mirror {via}" if mirrored else "")
        await _warn_if_shadowed(c, a.ref, img["name"])
        return 0
    if a.image_cmd == "ls":
        listing = await c.image_listing()
        images = listing["images"]
        for bad in listing.get("unreadable", []):
            print(f"dsec image ls: image {bad['name']} cannot be read: {bad['error']} (`dsec image rm "
                  f"{bad['name']}` removes the name)", file=sys.stderr)
        if a.json:
            _print_json(images)
        else:
            _table([[i["name"], str(len(i["layers"])), _human_bytes(i["bytes"]), i["manifest"][7:19],
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(i["created"]))] for i in images],
                   ["NAME", "LAYERS", "SIZE", "MANIFEST", "CREATED"])
        return 0
    if a.image_cmd == "inspect":
        img = await c.inspect_image(a.name)
        _print_json(img) if a.json else _print_image_details(img)
        return 0
    if a.image_cmd == "rm":
        r = await c.remove_image(a.name)
        if a.json:
            _print_json(r)
        else:
            print(image_removed(r, a.name))
            if r.get("damaged"):
                print(f"dsec image rm: the image could not be read: {r['damaged']}", file=sys.stderr)
        return 0
    if a.image_cmd == "tag":
        img = await c.tag_image(a.source, a.name)
        _print_json(img) if a.json else _print_image(img, "tagged", _replaced(img))
        return 0
    if a.image_cmd == "flatten":
        bar = _ProgressBar(not a.json)
        try:
            img = await c.flatten_image(a.name, a.as_name, bar)
        finally:
            bar.done()
        if a.json:
            _print_json(img)
        else:
            _print_image(img, "flattened", f" (from {img['flattened']['layers']} layer(s), manifest "
                         f"{img['flattened']['manifest'][:19]}){_replaced(img)}")
        return 0
    if a.image_cmd == "gc":
        r = await c.image_gc()
        _print_json(r) if a.json else print(f"removed {len(r['removed'])} blob(s), "
                                            f"freed {_human_bytes(r['freed_bytes'])}")
        return 0
    if a.image_cmd == "du":
        r = await c.image_du()
        if a.json:
            _print_json(r)
            return 0
        print(f"{r['blobs']} blobs, {_human_bytes(r['bytes'])} in the store; shared layers "
              f"{_human_bytes(r['shared_layer_bytes'])}; unreferenced {_human_bytes(r['unreferenced_bytes'])}")
        _table([[i["name"], str(i["layers"]), _human_bytes(i["bytes"])] for i in r["images"]],
               ["IMAGE", "LAYERS", "SIZE"])
        return 0
    raise UsageError("dsec image: give a subcommand: build, import, pull, ls, inspect, tag, rm, gc, du")


async def cmd_snapshot(c: Client, a) -> int:
    for path in a.exclude or []:
        if set(path) & set("*?["):        # a glob habit: nothing expands it, so little or nothing is left out
            print(f"dsec snapshot: warning: --exclude {path!r} is a path, not a pattern: only an entry of that "
                  "exact name is left out (name a directory to leave out all of it)", file=sys.stderr)
    sb = await c.get(a.sandbox)
    bar = _ProgressBar(not a.json)
    img = await sb.snapshot(a.name, a.exclude or [], bar)
    bar.done()
    _print_json(img) if a.json else _print_image(img, "snapshot")
    return 0


def _absolute_excludes(paths: list[str]) -> None:
    """`dsec snapshot --exclude` takes absolute paths in the sandbox. The
    daemon reads a relative one from the sandbox's root (`root/.cache` is
    /root/.cache, as images.snapshot_exclude writes them), but on a command
    line `node_modules` reads as from the working directory (/app/node_modules)
    and would leave out nothing there, without a word: said instead."""
    for path in paths:
        if path and not path.startswith("/"):
            raise UsageError(f"dsec snapshot: --exclude {path!r} is relative; give an absolute path in the "
                             f"sandbox: /{path.removeprefix('./')} from its root, or the one under its working "
                             "directory you mean (a relative path is not read from there)")


def _build_args(items: list[str] | None) -> dict[str, str]:
    """--build-arg K=V, or K alone for the value of $K here (none when it is
    unset), as docker build takes them: `--build-arg HTTP_PROXY`."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" in item:
            out.update(_kv([item], "--build-arg"))
        elif not item:
            raise UsageError("dsec: --build-arg must look like KEY=VALUE or KEY (its value from the environment)")
        elif item in os.environ:
            out[item] = os.environ[item]
    return out


def _check_image_build(a: argparse.Namespace) -> None:
    """A Dockerfile build (-f) and a directory or tarball build take different options."""
    if a.file:
        for option, value in (("--from", a.parent), ("--env", a.env), ("--cwd", a.cwd), ("--user", a.user),
                              ("--entrypoint", a.entrypoint)):
            if value:
                raise UsageError(f"dsec image build: {option} is for a directory or tarball build; with -f "
                                 "the Dockerfile says it (FROM, ENV, WORKDIR, USER, ENTRYPOINT)")
        _build_args(a.build_arg)
        return
    for option, value in (("--build-arg", a.build_arg), ("--allow", a.allow), ("--no-cache", a.no_cache)):
        if value:
            raise UsageError(f"dsec image build: {option} goes with -f DOCKERFILE (a Dockerfile build)")
    # `docker build .` habit: without -f the directory itself becomes the
    # image's root, and an image of a project's sources runs nothing.
    dockerfile = os.path.join(a.path, "Dockerfile")
    if not (a.host or getattr(a, "fleet", None)) and os.path.isfile(dockerfile):
        print(f"dsec image build: warning: {a.path} holds a Dockerfile, but without -f the directory is "
              f"imported as the image's root file system; to build from the Dockerfile: "
              f"dsec image build -f {dockerfile} {a.path} --name {a.name}", file=sys.stderr)
