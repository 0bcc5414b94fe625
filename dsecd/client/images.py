"""Client's image requests: build, import, pull, Dockerfile builds, list,
inspect, tag, flatten, remove, gc and du.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from ..errors import BadRequest, NotFound
from .args import _given, string_map
from .wire import _Wire


def _read_dockerfile(path: str, default: bool) -> str:
    """The Dockerfile at `path` (CONTEXT/Dockerfile where `default`), read
    here, on the client's side; an error names it and how it was found."""
    if default:
        where = " (without -f, the build reads CONTEXT/Dockerfile; give another with -f)"
    elif not os.path.isabs(path):
        where = f" (a relative -f is read from the current directory, {os.getcwd()})"
    else:
        where = ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise BadRequest(f"the Dockerfile {path} is not UTF-8 text (byte {err.start}: {err.reason}); "
                         "is it the Dockerfile?", {"dockerfile": path}) from None
    except FileNotFoundError:
        raise NotFound(f"read the Dockerfile {path}: No such file or directory{where}",
                       {"dockerfile": path}) from None
    except OSError as err:
        raise BadRequest(f"read the Dockerfile {path}: {err.strerror or err}{where}",
                         {"dockerfile": path}) from None


class _Images(_Wire):
    """The image requests of Client (a base of it)."""

    async def build_image(self, source: str, name: str, parent: str | None = None,
                          progress: Callable[[dict], None] | None = None, **config) -> dict:
        """A root file system, or a docker save or OCI layout (a directory or
        tarball on the daemon's host) -> image `name`, optionally on top of
        image `parent`; config overrides: env, cwd, user, entrypoint, cmd,
        labels, exposed_ports (dsecd/imageconfig.py). Over ssh:// `source` is
        a path on that host, so it must be absolute."""
        if self.remote and not source.startswith("/"):
            raise ValueError(f"build_image on {self.target}: {source!r} must be an absolute path on that host "
                             "(the daemon reads it there)")
        args = {"source": source if self.remote else os.path.abspath(source), "name": name, **config}
        if parent:
            args["parent"] = parent
        return await self._with_progress("image_build", args, progress)

    async def pull_image(self, ref: str, progress: Callable[[dict], None] | None = None,
                         platform: str | None = None) -> dict:
        """Pull `ref` (python:3.11, registry/namespace/name@sha256:...) from its
        registry into the daemon's store; `progress` gets each progress event
        (docs/protocol.md, image_pull): per-layer bytes and states. Returns the
        image, with `pull` (bytes downloaded, layers reused, timings)."""
        args = {"ref": ref, **({"platform": platform} if platform else {})}
        return await self._with_progress("image_pull", args, progress)

    async def build_dockerfile(self, context: str, name: str, dockerfile: str | None = None,
                               text: str | None = None, build_args: dict[str, str] | None = None,
                               allow: list[str] | None = None, no_cache: bool = False,
                               progress: Callable[[dict], None] | None = None) -> dict:
        """Build image `name` from a Dockerfile. `context`: a directory on the
        daemon's host (the daemon reads COPY/ADD sources there, in place: no
        upload, so the daemon must be local). The Dockerfile is read here,
        from `dockerfile` (default: CONTEXT/Dockerfile), or given as `text`.
        `allow`: egress rules for RUN steps (rule-set names such as "pypi"
        too; without any, RUN has no network). `progress(event)` gets every
        event the build streams: {"event": "step", step, of, line, instruction},
        {"event": "output", step, fd, data}, {"event": "step_done", step, of,
        cached, seconds, layer}, {"event": "warning", message}. Result: the
        image, plus `steps` (each step's line, instruction, cached, seconds,
        layer), `seconds`, `replaced` (the manifest the name had before).
        Over ssh:// (or through a Ray actor) the daemon reads `context` on
        its host, so it must be absolute there."""
        if self.remote and not context.startswith("/"):
            # Made absolute here, it would name this machine's directory on that host.
            raise ValueError(f"build_dockerfile on {self.target}: the context {context!r} must be an absolute "
                             "path on that host (the daemon reads it there)")
        context = os.path.abspath(context)
        if text is None:
            text = _read_dockerfile(dockerfile or os.path.join(context, "Dockerfile"), dockerfile is None)
        shown = dockerfile or "Dockerfile"
        args = _given({"context": context, "dockerfile": text, "name": name, "dockerfile_name": shown,
                       "build_args": string_map(build_args, "build_args"), "no_cache": bool(no_cache)},
                      allow=list(allow) if allow else None)
        async with contextlib.aclosing(self.frames("image_build_dockerfile", **args)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return frame["__result__"]
                if progress:
                    progress(frame)
        raise ConnectionError("image_build_dockerfile: no final frame")

    async def import_image(self, path: str, name: str, progress: Callable[[dict], None] | None = None) -> dict:
        """A root directory as a one-layer image (same as build_image without a parent)."""
        return await self.build_image(path, name, progress=progress)

    async def image_gc(self) -> dict:
        return await self.request("image_gc")

    async def image_du(self) -> dict:
        return await self.request("image_du")

    async def list_images(self) -> list[dict]:
        return (await self.image_listing())["images"]

    async def image_listing(self) -> dict:
        """The image_list result: `images`, and `unreadable` (names whose
        image cannot be read, each `name` and `error`). From a daemon that
        streams it, in as many frames as it takes, so that any number of
        images lists (one frame of them all may be past the frame limit).
        An older daemon (or a client not connected yet, which the request
        tells so) gets the request of one answer."""
        if "image.list.stream" not in self.server.get("capabilities", ()):
            return await self.request("image_list")
        out: dict[str, list] = {"images": [], "unreadable": []}
        async with contextlib.aclosing(self.frames("image_list", stream=True)) as frames:
            async for frame in frames:
                if "__result__" in frame:
                    return out
                out["images"].extend(frame.get("images", ()))
                out["unreadable"].extend(frame.get("unreadable", ()))
        raise ConnectionError("image_list: no final frame")

    async def inspect_image(self, name: str) -> dict:
        return await self.request("image_inspect", name=name)

    async def remove_image(self, name: str) -> dict:
        return await self.request("image_rm", name=name)

    async def tag_image(self, source: str, name: str) -> dict:
        """Name image `source` `name` too (docker tag): the same image, nothing
        copied; an image of that name is replaced. Result: the image under
        `name`, with `replaced` (the manifest the name had, or None)."""
        return await self.request("image_tag", source=source, name=name)

    async def flatten_image(self, name: str, as_name: str | None = None,
                            progress: Callable[[dict], None] | None = None) -> dict:
        """Image `name` as one layer (its layers merged as a sandbox sees
        them), the same config: under `as_name` (new; its parent is `name`),
        or `name` itself moves to it. `progress` gets each event:
        {"step": "queued", max} while it waits for one of
        images.max_flattens, {"step": "merge", layer, of, entries, bytes},
        then the pack's. Result:
        the flat image, with `flattened` (the manifest and layer count it
        was made from) and `replaced`."""
        args = {"name": name, **({"as_name": as_name} if as_name else {})}
        return await self._with_progress("image_flatten", args, progress)
