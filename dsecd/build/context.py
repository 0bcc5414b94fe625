"""The build context: the directory on the daemon's host that COPY and ADD
read from, as .dockerignore leaves it, and the content hash of what a step
copies (its cache key).

The daemon reads the context in place (the client names a local path; it
is never uploaded), so a build must run on the host that holds the files.
Sources are context-relative (a leading `/` is the context's root) and never
leave it: `..` out of it is refused, and a source that is a symlink is
followed only to a target inside the context. Below a copied directory,
symlinks are copied as symlinks. FIFOs, sockets and devices are skipped.

Everything here blocks (directory walks, hashing): call it from a worker.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .ignore import IgnoreRules, compile_pattern

GLOB_CHARS = set("*?[")
HASH_CHUNK = 1 << 20


class ContextError(ValueError):
    """A source that does not exist, is excluded, or leaves the context."""


@dataclass(frozen=True)
class Entry:
    """A file, directory or symlink a step copies. `rel` is its path below
    the copied source ("" for the source itself); `path` its host path."""

    rel: str
    path: str
    kind: str            # "file" | "dir" | "symlink"
    mode: int            # permission bits, st_mode & 0o7777
    size: int = 0
    target: str = ""     # a symlink's target


@dataclass(frozen=True)
class Source:
    """One matched source of a COPY/ADD: its context path and its entries."""

    rel: str             # context-relative ("." for the context itself)
    entries: list[Entry]

    @property
    def is_dir(self) -> bool:
        return self.entries[0].kind == "dir"


class DigestCache:
    """File content digests by (device, inode, size, mtime, ctime): a rebuild
    hashes only the files that changed. A change to a file's content moves
    its ctime (which nothing but the kernel sets), so a hit is the same
    bytes. Bounded: past `max_entries` it starts again empty."""

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self._cache: dict[str, tuple[tuple[int, ...], str]] = {}

    def file_digest(self, path: str, st: os.stat_result) -> str:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[path] = (key, digest)
        return digest


class BuildContext:
    def __init__(self, root: str, ignore: IgnoreRules):
        self.root = os.path.realpath(root)
        self.ignore = ignore

    @classmethod
    def open(cls, root: str, shown: str | None = None) -> BuildContext:
        """The context at `root` (an absolute directory) with its .dockerignore.
        `shown`: how messages name it (the client's path, where `root` is
        where the daemon has it attached)."""
        shown = shown or root
        if not os.path.isabs(root):
            raise ContextError(f"the build context must be an absolute path on the daemon's host, got {shown!r}")
        if not os.path.isdir(root):
            raise ContextError(f"the build context {shown} is not a directory on the daemon's host")
        try:
            text = Path(root, ".dockerignore").read_text(errors="surrogateescape")
        except FileNotFoundError:
            text = ""
        return cls(root, IgnoreRules.parse(text))

    # ------------------------------------------------------------ sources

    def sources(self, pattern: str) -> list[Source]:
        """The context paths a COPY/ADD source names (a glob may name several),
        each with its entries. ContextError if it names nothing."""
        rel = self._relative(pattern)
        if not GLOB_CHARS & set(rel):
            return [self._source(rel, pattern)]
        matches = sorted(self._glob(rel, pattern))
        if not matches:
            raise ContextError(f"{pattern}: no file of the build context matches it"
                               f"{' (or .dockerignore excludes them)' if self.ignore else ''}")
        return [self._source(m, pattern) for m in matches]

    def _relative(self, pattern: str) -> str:
        cleaned = posixpath.normpath("/" + pattern).lstrip("/")
        if posixpath.normpath(pattern.lstrip("/")).startswith(".."):
            raise ContextError(f"{pattern}: the source is outside the build context; COPY and ADD read "
                               "only files below it")
        return cleaned or "."

    def _host(self, rel: str) -> str:
        return self.root if rel == "." else os.path.join(self.root, rel)

    def _glob(self, rel: str, pattern: str) -> Iterator[str]:
        """Context paths matching `rel` component by component (Go's
        filepath.Match per component: `*` never crosses a /)."""
        parts = rel.split("/")

        def walk(prefix: str, i: int) -> Iterator[str]:
            if i == len(parts):
                yield prefix
                return
            part = parts[i]
            if not GLOB_CHARS & set(part):
                nxt = f"{prefix}/{part}" if prefix else part
                if os.path.lexists(self._host(nxt)):
                    yield from walk(nxt, i + 1)
                return
            regex = compile_pattern(part)
            base = self._host(prefix or ".")
            if prefix and not self._inside(os.path.realpath(base)):    # listed only inside the context
                raise ContextError(f"{pattern}: a symlinked directory on the way to {prefix}/{part} leads out "
                                   "of the build context; COPY follows symlinks only inside it")
            try:
                names = sorted(os.listdir(base))
            except (NotADirectoryError, FileNotFoundError):
                return
            for name in names:
                nxt = f"{prefix}/{name}" if prefix else name
                if regex.match(name) and not self.ignore.excluded(nxt):
                    yield from walk(nxt, i + 1)

        return walk("", 0)

    def _source(self, rel: str, pattern: str) -> Source:
        excluded = rel != "." and self.ignore.excluded(rel)
        if excluded and not self.ignore.has_exceptions:
            raise ContextError(f"{pattern}: .dockerignore excludes {rel}")
        host = self._host(rel)
        # A symlinked directory on the way (sub -> /etc, in sub/hostname) would
        # take the source out of the context: checked for every source.
        if rel != "." and not self._inside(os.path.realpath(os.path.dirname(host))):
            raise ContextError(f"{pattern}: a symlinked directory on the way to {rel} leads out of the build "
                               "context; COPY follows symlinks only inside it")
        try:
            st = os.lstat(host)
        except FileNotFoundError:
            raise ContextError(f"{pattern}: no such file or directory in the build context") from None
        if stat.S_ISLNK(st.st_mode):
            real = os.path.realpath(host)
            if not self._inside(real):
                raise ContextError(self._outside(pattern, rel, host, real))
            try:
                st = os.stat(real)
            except FileNotFoundError:
                raise ContextError(f"{pattern}: the symlink {rel} is dangling") from None
            host = real
        if stat.S_ISDIR(st.st_mode):
            below = list(self._walk(host, rel))
            if excluded and not below:          # an exception pattern brings nothing below it back
                raise ContextError(f"{pattern}: .dockerignore excludes {rel}")
            entries = [Entry("", host, "dir", stat.S_IMODE(st.st_mode)), *below]
        elif excluded:
            raise ContextError(f"{pattern}: .dockerignore excludes {rel}")
        elif stat.S_ISREG(st.st_mode):
            entries = [Entry("", host, "file", stat.S_IMODE(st.st_mode), st.st_size)]
        else:
            raise ContextError(f"{pattern}: {rel} is not a file, directory or symlink")
        return Source(rel, entries)

    def _inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root + os.sep)

    def _outside(self, pattern: str, rel: str, host: str, real: str) -> str:
        """Why the source symlink `rel` is not followed. The context may be
        attached where the client does not have it (fs/clientpaths.py), so an
        absolute target would be looked up in the daemon's view of the host,
        outside the context: it is refused, as anything outside is."""
        target = os.readlink(host) if os.path.islink(host) else ""
        if os.path.isabs(target):
            return (f"{pattern}: the symlink {rel} points to the absolute path {target}; COPY follows a "
                    "source symlink only by a relative path to inside the build context")
        return (f"{pattern}: the symlink {rel} points outside the build context (to "
                f"{os.path.relpath(real, self.root)}); COPY follows a source symlink only inside it")

    def _walk(self, top: str, top_ctx: str, top_rel: str = "") -> Iterator[Entry]:
        """Everything below directory `top` (context path `top_ctx`, entry path
        `top_rel`) that .dockerignore leaves in, directories before their
        contents, names sorted. An excluded directory is entered only when an
        exception pattern could bring something below it back; it is then
        listed if something below it is."""
        for name in sorted(os.listdir(top)):
            path = os.path.join(top, name)
            ctx = name if top_ctx == "." else f"{top_ctx}/{name}"
            rel = f"{top_rel}/{name}" if top_rel else name
            excluded = self.ignore.excluded(ctx)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue            # removed while we walked
            if stat.S_ISDIR(st.st_mode):
                if excluded and not self.ignore.has_exceptions:
                    continue
                below = list(self._walk(path, ctx, rel))
                if excluded and not below:
                    continue
                yield Entry(rel, path, "dir", stat.S_IMODE(st.st_mode))
                yield from below
            elif excluded:
                continue
            elif stat.S_ISREG(st.st_mode):
                yield Entry(rel, path, "file", stat.S_IMODE(st.st_mode), st.st_size)
            elif stat.S_ISLNK(st.st_mode):
                yield Entry(rel, path, "symlink", 0o777, 0, os.readlink(path))

    # ------------------------------------------------------------ hashing

    def digest(self, sources: list[Source], cache: DigestCache) -> str:
        """sha256 of what a step copies: for each source, each entry's path,
        type, permission bits, and content (files) or target (symlinks).
        Owners are not in it: COPY sets them (root, or --chown)."""
        h = hashlib.sha256()
        for src in sources:
            h.update(f"S {src.rel}\0".encode(errors="surrogateescape"))
            for e in src.entries:
                if e.kind == "file":
                    try:
                        content = cache.file_digest(e.path, os.stat(e.path))
                    except FileNotFoundError:
                        raise ContextError(f"{src.rel}: {e.rel or e.path} was removed while the build "
                                           "read the context") from None
                else:
                    content = e.target
                h.update(f"{e.rel}\0{e.kind}\0{e.mode:o}\0{e.size}\0{content}\n"
                         .encode(errors="surrogateescape"))
        return "sha256:" + h.hexdigest()
