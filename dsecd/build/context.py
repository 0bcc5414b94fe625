"""The build context: the directory on the daemon's host that COPY and ADD
read from, as .dockerignore leaves it, and the content hash of what a step
copies (its cache key).

The daemon reads the context in place (the client names a local path; it
is never uploaded), so a build must run on the host that holds the files.
Sources are context-relative (a leading `/` is the context's root) and never
leave it: `..` out of it is refused, and the symlinks on a source's path
(its last component too) are followed inside the context, as BuildKit
resolves a COPY source: an absolute target, or a `..` past the top, is
looked up from the context's root. What a symlink leads to must be in the
context as .dockerignore leaves it (BuildKit never receives an excluded
file, whatever links to it). Below a copied directory, symlinks are copied
as symlinks. FIFOs, sockets and devices are skipped.

Everything here blocks (directory walks, hashing): call it from a worker.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import native
from ..fs import clientpaths
from .ignore import IgnoreRules, compile_pattern

GLOB_CHARS = set("*?[")
HASH_CHUNK = 1 << 20
# The most of a .dockerignore the daemon reads (into memory, whole): a
# sparse one of any size costs its maker nothing. Real ones are a few KiB.
MAX_DOCKERIGNORE_BYTES = 1 << 20


class ContextError(ValueError):
    """A source that does not exist, is excluded, or leaves the context."""


class SourceTooLarge(ContextError):
    """A file a step copies that is larger than the step could ever write
    (`max_bytes`): hashing it would read it all for nothing."""

    def __init__(self, message: str, rel: str, size: int, max_bytes: int):
        super().__init__(message)
        self.rel, self.size, self.max_bytes = rel, size, max_bytes


class SourcesTooLarge(ContextError):
    """The files a step copies add up to more than the step's layer may hold
    (`max_bytes`), each of them under it: refused before any is read."""

    def __init__(self, message: str, files: int, size: int, max_bytes: int):
        super().__init__(message)
        self.files, self.size, self.max_bytes = files, size, max_bytes


class HashStopped(Exception):
    """The hashing of the context was stopped (its build was cancelled)."""


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


class ContextRoot:
    """The build context's top directory, open (by the daemon), and every
    lookup below it: made as `reader` (the client's ids, no capability)
    when one is given, as the calling thread otherwise. Symlinks on the way
    (and `..`) stay inside the top: RESOLVE_IN_ROOT, no magic links.

    With a reader, nothing on a kernel file system (proc, sysfs, ...) is
    opened: the reads run in a thread of the daemon's process, where
    /proc/<the daemon's pid> files pass the kernel's ptrace check as the
    process's own whatever the thread's ids, and a client in a mount
    namespace of its own can bind them into its context
    (fs/clientpaths.py)."""

    def __init__(self, path: str, reader: native.Reader | None = None):
        self.path = os.path.realpath(path)
        self.reader = reader
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._refuse_kernel_fs(fd, ".")
        self.fd = fd

    def __del__(self):
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def reading(self):
        """Lookups and opens of the thread as the reader, for the with block."""
        return native.reader_ids(self.reader) if self.reader is not None else contextlib.nullcontext()

    def open(self, rel: str, flags: int) -> int:
        """An fd of `rel`, opened inside the context as the reader;
        ContextError, with a reader, if it is on a kernel file system."""
        with self.reading():
            fd = native.openat2(self.fd, rel, flags, 0, native.RESOLVE_IN_ROOT | native.RESOLVE_NO_MAGICLINKS)
        self._refuse_kernel_fs(fd, rel)
        return fd

    def read_link(self, dirfd: int, name: str, rel: str) -> str:
        """The target of symlink `name` in `dirfd` (entry `rel`), read as the
        reader; with a reader, ContextError if the link itself is on a
        kernel file system (clientpaths.read_link)."""
        if self.reader is None:
            return os.readlink(name, dir_fd=dirfd)
        try:
            return clientpaths.read_link(dirfd, name, rel)
        except clientpaths.KernelFileError as err:
            raise ContextError(f"{posixpath.normpath(rel)} is on {err.kind}, {clientpaths.KERNEL_FS_REFUSED}") \
                from None

    def _refuse_kernel_fs(self, fd: int, rel: str) -> None:
        """Close `fd` and raise ContextError if a reader is set and it is on
        a kernel file system."""
        if self.reader is None:
            return
        try:
            clientpaths.refuse_kernel_fs(fd, rel)
        except clientpaths.KernelFileError as err:
            os.close(fd)
            shown = "the build context" if rel == "." else posixpath.normpath(rel)
            raise ContextError(f"{shown} is on {err.kind}, {clientpaths.KERNEL_FS_REFUSED}") from None
        except BaseException:
            os.close(fd)
            raise

    def lstat(self, rel: str) -> os.stat_result:
        """The entry `rel` itself (a symlink's own), its directories resolved inside."""
        if rel == ".":
            return os.fstat(self.fd)
        parent, name = posixpath.split(rel)
        pfd = self.open(parent or ".", os.O_PATH | os.O_DIRECTORY)
        try:
            with self.reading():
                return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)


@dataclass(frozen=True)
class Source:
    """One matched source of a COPY/ADD: its context path and its entries."""

    rel: str             # context-relative ("." for the context itself)
    entries: list[Entry]
    root: ContextRoot    # the context's top, and who reads below it
    # Entry.rel -> the sha256 of the file's content that went into the
    # step's key (BuildContext.digest): what a copy must read, or fail.
    digests: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def is_dir(self) -> bool:
        return self.entries[0].kind == "dir"

    def open(self, entry: Entry) -> int:
        """An fd to read `entry` from, looked up inside the context again
        (as the client, for one other than root): its directories' symlinks
        followed inside it, its last name never. The client may change its
        context between the plan and the copy (the daemon reads it in
        place); a directory swapped for a symlink to / meanwhile must lead
        nowhere but into the context, and a file swapped for a FIFO must
        not block the copy (O_NONBLOCK, which a regular file's reads ignore;
        anything else is refused)."""
        fd = self.root.open(os.path.relpath(entry.path, self.root.path),
                            os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "no longer a regular file", entry.path)
        return fd


def _read_dockerignore(root: ContextRoot, shown: str) -> str:
    """The context's .dockerignore ("" when it has none), looked up inside
    it as COPY sources are: a symlink out of the context must not make the
    daemon read a file of the host the client may not read. Opened without
    waiting: a FIFO there must fail the build, not hold the daemon's worker
    until something writes to it. At most MAX_DOCKERIGNORE_BYTES are read:
    past them (by its size, or by what is read: it may grow meanwhile) the
    build is refused."""
    try:
        fd = root.open(".dockerignore", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return ""
        raise ContextError(f"{shown}/.dockerignore: {err.strerror or err}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ContextError(f"{shown}/.dockerignore is not a file; remove or rename it")
    with os.fdopen(fd, "rb") as f:
        data = b"" if st.st_size > MAX_DOCKERIGNORE_BYTES else f.read(MAX_DOCKERIGNORE_BYTES + 1)
    if st.st_size > MAX_DOCKERIGNORE_BYTES or len(data) > MAX_DOCKERIGNORE_BYTES:
        raise ContextError(f"{shown}/.dockerignore is larger than {MAX_DOCKERIGNORE_BYTES >> 20} MiB, more "
                           "than any list of patterns needs; shorten it")
    return data.decode(errors="surrogateescape")


class DigestCache:
    """File content digests by (device, inode, size, mtime, ctime): a rebuild
    hashes only the files that changed. A change to a file's content moves
    its ctime (which nothing but the kernel sets), so a hit is the same
    bytes. Kept by the file, not by its path: each build attaches its
    context at a path of its own (fs/clientpaths.py). Bounded: past
    `max_entries` it starts again empty."""

    def __init__(self, max_entries: int = 200_000):
        self.max_entries = max_entries
        self._cache: dict[tuple[int, int], tuple[tuple[int, ...], str]] = {}

    def file_digest(self, fd: int, stop: threading.Event | None = None, max_bytes: int = 0) -> str:
        """The digest of the file open at `fd` (read from its start).
        `stop`: checked before each chunk; once set, HashStopped.
        `max_bytes` (0: no bound): a file larger, by its size or by what is
        read (it may grow meanwhile), is OverflowError, before it is read."""
        st = os.fstat(fd)
        if max_bytes and st.st_size > max_bytes:
            raise OverflowError(st.st_size)
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        hit = self._cache.get((st.st_dev, st.st_ino))
        if hit is not None and hit[0] == key:
            return hit[1]
        h = hashlib.sha256()
        offset = 0
        while True:
            if stop is not None and stop.is_set():
                raise HashStopped("the build stopped while it hashed its context")
            chunk = os.pread(fd, HASH_CHUNK, offset)
            if not chunk:
                break
            h.update(chunk)
            offset += len(chunk)
            if max_bytes and offset > max_bytes:
                raise OverflowError(offset)
        digest = h.hexdigest()
        if len(self._cache) >= self.max_entries:
            self._cache.clear()
        self._cache[(st.st_dev, st.st_ino)] = (key, digest)
        return digest

    def forget(self, file: tuple[int, int]) -> None:
        """Drop the digest of the file with this (device, inode): its bytes
        were found to be others than the digest's, under the same size and
        times (a write within the times' granularity, or through a mapping)."""
        self._cache.pop(file, None)


class BuildContext:
    def __init__(self, top: ContextRoot, ignore: IgnoreRules):
        self.top = top
        self.root = top.path
        self.ignore = ignore

    @classmethod
    def open(cls, root: str, shown: str | None = None, reader: native.Reader | None = None) -> BuildContext:
        """The context at `root` (an absolute directory) with its .dockerignore.
        `shown`: how messages name it (the client's path, where `root` is
        where the daemon has it attached). `reader`: the client's ids when
        it is not root; everything below `root` is read as it."""
        shown = shown or root
        if not os.path.isabs(root):
            raise ContextError(f"the build context must be an absolute path on the daemon's host, got {shown!r}")
        if not os.path.isdir(root):
            raise ContextError(f"the build context {shown} is not a directory on the daemon's host")
        top = ContextRoot(root, reader)
        return cls(top, IgnoreRules.parse(_read_dockerignore(top, shown)))

    # ------------------------------------------------------------ sources

    def sources(self, pattern: str) -> list[Source]:
        """The context paths a COPY/ADD source names (a glob may name several),
        each with its entries. A path that names nothing is a ContextError; a
        glob that matches nothing names nothing ([]), as BuildKit skips it:
        `COPY package.json yarn.lock* ./` is how a Dockerfile copies a file
        that may be missing."""
        rel = self._relative(pattern)
        if not GLOB_CHARS & set(rel):
            return [self._source(rel, self._resolve(rel, pattern), pattern)]
        out = []
        for m in sorted(self._glob(rel, pattern)):
            real = self._resolve(m, pattern)
            if not self._leads_to_excluded(m, real) and not self._special(real):
                out.append(self._source(m, real, pattern))
        return out

    def _special(self, real: str | None) -> bool:
        """A glob's match that leads to a FIFO, socket or device: the glob
        does not match it, as a copied directory's walk skips them (a
        project's socket must not fail `COPY * /app/` that `COPY . /app/`
        copies). Named on its own, such a file is refused (_source)."""
        if real is None or real == ".":
            return False
        try:
            mode = self.top.lstat(real).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return False
        return not (stat.S_ISDIR(mode) or stat.S_ISREG(mode))

    def _leads_to_excluded(self, rel: str, real: str | None) -> bool:
        """A glob's match `rel` whose symlinks lead (to `real`) to what
        .dockerignore excludes, with no exception pattern to bring part of it
        back: BuildKit never received it, so the glob does not match it."""
        return real not in (None, ".", rel) and self.ignore.excluded(real) and not self.ignore.has_exceptions

    def _relative(self, pattern: str) -> str:
        cleaned = posixpath.normpath("/" + pattern).lstrip("/")
        if posixpath.normpath(pattern.lstrip("/")).split("/")[0] == "..":      # `..data` is a name
            raise ContextError(f"{pattern}: the source is outside the build context; COPY and ADD read "
                               "only files below it")
        return cleaned or "."

    def _host(self, rel: str) -> str:
        return self.root if rel == "." else os.path.join(self.root, rel)

    def _glob(self, rel: str, pattern: str) -> Iterator[str]:
        """Context paths matching `rel` component by component (Go's
        filepath.Match per component: `*` never crosses a /); directories
        are listed where their path leads inside the context."""
        parts = rel.split("/")

        def walk(prefix: str, i: int) -> Iterator[str]:
            if i == len(parts):
                yield prefix
                return
            part = parts[i]
            if not GLOB_CHARS & set(part):
                nxt = f"{prefix}/{part}" if prefix else part
                if self._lexists(nxt, pattern):
                    yield from walk(nxt, i + 1)
                return
            regex = compile_pattern(part)
            for name in self._listdir(prefix or ".", pattern):
                nxt = f"{prefix}/{name}" if prefix else name
                if regex.match(name) and not self.ignore.excluded(nxt):
                    yield from walk(nxt, i + 1)

        return walk("", 0)

    def _source(self, rel: str, real: str | None, pattern: str) -> Source:
        """Source `rel`, which leads to `real` (_resolve: None, nowhere)."""
        excluded = rel != "." and self.ignore.excluded(rel)
        if excluded and not self.ignore.has_exceptions:
            raise ContextError(f"{pattern}: .dockerignore excludes {rel}")
        if real is None:
            if self._lexists(rel, pattern):
                raise ContextError(f"{pattern}: the symlink {rel} leads to nothing in the build context "
                                   "(symlinks are followed inside it: an absolute target is looked up "
                                   "from the context's root)")
            raise ContextError(f"{pattern}: no such file or directory in the build context")
        if real != rel:
            # Symlinks were followed: .dockerignore applies to what they lead to.
            excluded = excluded or (real != "." and self.ignore.excluded(real))
            if excluded and not self.ignore.has_exceptions:
                raise ContextError(f"{pattern}: {rel} leads to {real}, which .dockerignore excludes")
        host = self._host(real)
        try:
            st = self.top.lstat(real)
        except (FileNotFoundError, NotADirectoryError):
            raise ContextError(f"{pattern}: {rel} was removed from the build context during the build") from None
        if stat.S_ISDIR(st.st_mode):
            below = list(self._walk(real))
            if excluded and not below:          # an exception pattern brings nothing below it back
                raise ContextError(f"{pattern}: .dockerignore excludes {rel if real == rel else real}")
            entries = [Entry("", host, "dir", stat.S_IMODE(st.st_mode)), *below]
        elif excluded:
            raise ContextError(f"{pattern}: .dockerignore excludes {rel if real == rel else real}")
        elif stat.S_ISREG(st.st_mode):
            entries = [Entry("", host, "file", stat.S_IMODE(st.st_mode), st.st_size)]
        else:
            raise ContextError(f"{pattern}: {rel} is not a file, directory or symlink")
        return Source(rel, entries, self.top)

    # ------------------------------------------------------------ paths inside the context

    def _open(self, rel: str, flags: int, pattern: str) -> int | None:
        """An fd of context path `rel`, every symlink on the way followed
        inside the context; None if it leads nowhere."""
        try:
            return self.top.open(rel, flags)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            if err.errno == errno.ELOOP:
                raise ContextError(f"{pattern}: too many symlinks on the way to {rel} (a loop?)") from None
            raise ContextError(f"{pattern}: {rel}: {err.strerror}") from None

    def _resolve(self, rel: str, pattern: str) -> str | None:
        """The context path `rel` leads to (symlinks followed inside the
        context), or None if it leads nowhere: missing, dangling, a file
        on the way."""
        if rel == ".":
            return "."
        fd = self._open(rel, os.O_PATH, pattern)
        if fd is None:
            return None
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        if real == self.root:
            return "."
        if not real.startswith(self.root + os.sep):     # RESOLVE_IN_ROOT cannot lead here
            raise ContextError(f"{pattern}: {rel} resolved outside the build context, to {real}")
        return real[len(self.root) + 1:]

    def _lexists(self, rel: str, pattern: str) -> bool:
        """`rel` names an entry (a dangling symlink too), its directories
        resolved inside the context."""
        parent, name = posixpath.split(rel)
        fd = self._open(parent or ".", os.O_PATH | os.O_DIRECTORY, pattern)
        if fd is None:
            return False
        try:
            with self.top.reading():
                os.stat(name, dir_fd=fd, follow_symlinks=False)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        finally:
            os.close(fd)

    def _listdir(self, rel: str, pattern: str) -> list[str]:
        """Names in directory `rel` (resolved inside the context), sorted;
        [] if it is not a directory."""
        fd = self._open(rel, os.O_RDONLY | os.O_DIRECTORY, pattern)
        if fd is None:
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def _walk(self, top_ctx: str, top_rel: str = "") -> Iterator[Entry]:
        """Everything below directory `top_ctx` (a context path; entry path
        `top_rel`) that .dockerignore leaves in, directories before their
        contents, names sorted. An excluded directory is entered only when an
        exception pattern could bring something below it back; it is then
        listed if something below it is. Each directory is listed, and its
        entries looked at, through a descriptor of it opened inside the
        context: one swapped for a symlink meanwhile leads nowhere else."""
        try:
            fd = self.top.open(top_ctx, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return              # removed or replaced while we walked
            raise
        try:
            for name in sorted(os.listdir(fd)):
                ctx = name if top_ctx == "." else f"{top_ctx}/{name}"
                rel = f"{top_rel}/{name}" if top_rel else name
                excluded = self.ignore.excluded(ctx)
                try:
                    with self.top.reading():
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        target = self.top.read_link(fd, name, ctx) if stat.S_ISLNK(st.st_mode) else ""
                except FileNotFoundError:
                    continue        # removed while we walked
                except OSError as err:
                    if err.errno == errno.EINVAL:
                        continue    # no longer a symlink
                    raise
                if stat.S_ISDIR(st.st_mode):
                    if excluded and not self.ignore.has_exceptions:
                        continue
                    below = list(self._walk(ctx, rel))
                    if excluded and not below:
                        continue
                    yield Entry(rel, self._host(ctx), "dir", stat.S_IMODE(st.st_mode))
                    yield from below
                elif excluded:
                    continue
                elif stat.S_ISREG(st.st_mode):
                    yield Entry(rel, self._host(ctx), "file", stat.S_IMODE(st.st_mode), st.st_size)
                elif stat.S_ISLNK(st.st_mode):
                    yield Entry(rel, self._host(ctx), "symlink", 0o777, 0, target)
        finally:
            os.close(fd)

    # ------------------------------------------------------------ hashing

    def digest(self, sources: list[Source], cache: DigestCache, stop: threading.Event | None = None,
               max_bytes: int = 0) -> str:
        """sha256 of what a step copies: for each source, each entry's path,
        type, permission bits, and content (files) or target (symlinks).
        Owners are not in it: COPY sets them (root, or --chown).
        `stop`: once set, the hashing ends at its next chunk (HashStopped).
        `max_bytes` (0: no bound): what the step's layer may hold; a file
        larger than it is SourceTooLarge, and files that add up to more
        SourcesTooLarge, before any of it is read: the step could never
        write them, and a sparse file of any size costs its maker nothing."""
        files = [e for src in sources for e in src.entries if e.kind == "file"]
        total = sum(e.size for e in files)
        if max_bytes and total > max_bytes and all(e.size <= max_bytes for e in files):
            raise SourcesTooLarge(f"its {len(files)} files add up to {total} bytes, more than a step's layer may "
                                  f"hold (images.max_layer_bytes ({max_bytes} bytes)); copy fewer or smaller "
                                  "files (.dockerignore some), split them over several steps, or raise "
                                  "images.max_layer_bytes", len(files), total, max_bytes)
        h = hashlib.sha256()
        for src in sources:
            h.update(f"S {src.rel}\0".encode(errors="surrogateescape"))
            for e in src.entries:
                if e.kind == "file":
                    shown = posixpath.normpath(posixpath.join(src.rel, e.rel))     # e.path: the daemon's
                    if max_bytes and e.size > max_bytes:
                        raise _too_large(shown, e.size, max_bytes)
                    try:
                        fd = src.open(e)
                        try:
                            content = cache.file_digest(fd, stop, max_bytes)
                        finally:
                            os.close(fd)
                        src.digests[e.rel] = content
                    except OverflowError as err:
                        raise _too_large(shown, err.args[0], max_bytes) from None
                    except FileNotFoundError:
                        raise ContextError(f"{shown} was removed while the build read the context") from None
                    except OSError as err:
                        raise ContextError(f"{shown}: cannot read it: {err.strerror or err}") from None
                else:
                    content = e.target
                h.update(f"{e.rel}\0{e.kind}\0{e.mode:o}\0{e.size}\0{content}\n"
                         .encode(errors="surrogateescape"))
        return "sha256:" + h.hexdigest()


def _too_large(shown: str, size: int, max_bytes: int) -> SourceTooLarge:
    return SourceTooLarge(f"{shown} is {size} bytes, more than a step's layer may hold "
                          f"(images.max_layer_bytes ({max_bytes} bytes)); remove it from the build context "
                          "or .dockerignore it, or raise images.max_layer_bytes", shown, size, max_bytes)
