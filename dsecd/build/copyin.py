"""COPY, ADD and WORKDIR: files written into a build sandbox from the host.

The builder makes a sandbox of the image so far and writes through its
root fd; the sandbox's writable layer then holds exactly the step's
changes (overlay copies up the directories it writes into, with their
attributes, and records what it replaces), and is packed as the step's
layer like a snapshot.

Every path is resolved with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS
| RESOLVE_NO_XDEV) against the sandbox root: the image's symlinks resolve
inside it (as they would for a process in it), and a path that would cross
into one of the sandbox's own mounts (/proc, /dev, the /tmp tmpfs) fails
with EXDEV instead of writing outside the image. The last component is
never followed: an existing file or symlink there is replaced, an existing
directory merged into (a file onto a directory is refused). One exception:
a directory copied (or extracted by ADD) onto a symlink to a directory of
the image goes through it, and the link stays. `COPY rootfs /` onto an image with a merged /usr
(Debian 12, Ubuntu: /bin -> usr/bin) then adds rootfs/bin's files to
/usr/bin; replacing the link with a directory holding only those files
would lose every command in /bin (BuildKit refuses that copy instead).

Owners: COPY writes root's files unless --chown, and directories it makes
for the destination belong to that owner too (`Accounts.owner`: BuildKit's
rules, where a numeric uid without a group is also the gid); ADD of a tar keeps the archive's
owners unless --chown; WORKDIR's directories belong to the USER so far. Ids are the sandbox's: `to_host` maps them to the host ids
its user namespace stores them as. Modes are the source's (or --chmod).

The caller runs these in a worker thread with the sandbox root's fs ids
(userns.as_sandbox_root), like every host-side write into a sandbox.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import stat
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import imageconfig, native, tarsafe
from ..fs import users
from .context import Entry, Source

RESOLVE = native.RESOLVE_IN_ROOT | native.RESOLVE_NO_MAGICLINKS | native.RESOLVE_NO_XDEV
COPY_CHUNK = 1 << 20
ToHost = Callable[[int, int], tuple[int, int]]


class CopyError(ValueError):
    """What cannot be copied, and where; the builder adds the Dockerfile line."""


class CopyStopped(Exception):
    """The copy was stopped (its build cancelled): checked before each entry
    and each chunk of a file's bytes, so that a cancelled build's copy ends
    within one chunk instead of copying on after its client is gone."""


Stop = threading.Event | None


class CopyTooLarge(CopyError):
    """A step's copy wrote more than its layer may hold (`max_bytes`)."""

    def __init__(self, message: str, max_bytes: int):
        super().__init__(message)
        self.max_bytes = max_bytes


class LayerBudget:
    """What a step's copy may write, over all its files: images.max_layer_bytes
    (0: no bound). The plan refuses sources that add up to more by their
    sizes; this holds the copy to it when a source grew since, and for what
    an ADD's archive unpacks to, which its size does not say."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0

    def take(self, n: int, path: str) -> None:
        self.used += n
        if self.max_bytes and self.used > self.max_bytes:
            raise CopyTooLarge(f"{path}: what the step writes adds up to more than a step's layer may hold "
                               f"(images.max_layer_bytes ({self.max_bytes} bytes)): a source grew since the "
                               "build looked at it, or an archive unpacks to more; copy less, or raise "
                               "images.max_layer_bytes", self.max_bytes)


def _check(stop: Stop) -> None:
    if stop is not None and stop.is_set():
        raise CopyStopped("the copy was stopped: its build was cancelled")


@dataclass
class Counts:
    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)     # archive entries not extracted (devices, FIFOs)


def _failed(path: str, err: OSError) -> CopyError:
    if err.errno == errno.EXDEV:
        return CopyError(f"{path}: the path crosses into a mount of the build sandbox (/proc, /dev and "
                         "/tmp are the sandbox's own, not part of the image); copy somewhere else")
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return CopyError(f"{path}: {err.strerror}: the step's writable layer is full; what one step may add "
                         "is bounded by the daemon's [build] disk and memory")
    return CopyError(f"{path}: {err.strerror or err}")


def _open(rootfd: int, path: str, flags: int) -> int:
    return native.openat2(rootfd, path, flags | os.O_CLOEXEC, 0, RESOLVE)


# ---------------------------------------------------------------- users and groups

@dataclass(frozen=True)
class Accounts:
    """The image's /etc/passwd and /etc/group (None: it has none), resolved as
    a create resolves its user (dsecd/fs/users.py)."""

    passwd: str | None
    group: str | None

    @classmethod
    def read(cls, rootfd: int) -> Accounts:
        return cls(users.read_account_file(rootfd, "/etc/passwd"), users.read_account_file(rootfd, "/etc/group"))

    def _identity(self, spec: str) -> users.Identity:
        try:
            return users.resolve(spec, self.passwd, self.group)
        except (users.UserError, users.ConfigError) as err:
            raise CopyError(f"user {spec!r}: {err}") from err

    def user(self, spec: str) -> tuple[int, int]:
        """(uid, gid) a RUN runs as under USER `spec` (name, uid, name:group,
        uid:gid), as a create resolves it: a uid's gid is its /etc/passwd
        line's where it has one. CopyError names what the image lacks."""
        ident = self._identity(spec)
        return ident.uid, ident.gid

    def process_ids(self, spec: str) -> users.ProcessIds:
        """What `user` says, with the supplementary groups a create gives the
        same user (BuildKit's RUN has them too)."""
        return self._identity(spec).ids

    def owner(self, spec: str) -> tuple[int, int]:
        """(uid, gid) of files COPY --chown `spec` writes, and of the
        directories WORKDIR makes under USER `spec`: as `user`, except that a
        numeric uid without a group is the gid too (BuildKit's readUser; a
        name takes its /etc/passwd gid)."""
        name, sep, _ = spec.partition(":")
        if imageconfig.is_id(name) and not sep:
            return int(name), int(name)
        return self.user(spec)

    def home(self, spec: str) -> str | None:
        return self._identity(spec).home


# ---------------------------------------------------------------- directories

def _parent(rootfd: int, path: str) -> tuple[int, str]:
    """(an O_PATH fd of the directory holding `path`, its last name)."""
    parent, name = posixpath.split(path.rstrip("/"))
    try:
        return _open(rootfd, parent or "/", os.O_PATH | os.O_DIRECTORY), name
    except OSError as err:
        raise _failed(parent or "/", err) from err


def is_dir(rootfd: int, path: str) -> bool:
    """`path` is a directory of the image (symlinks resolved inside it);
    False if it is missing or not a directory, CopyError if it cannot be
    reached (through a mount of the sandbox, a symlink loop)."""
    try:
        fd = _open(rootfd, path, os.O_PATH | os.O_DIRECTORY)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return False
        raise _failed(path, err) from err
    os.close(fd)
    return True


def make_dirs(rootfd: int, path: str, mode: int = 0o755, owner: tuple[int, int] | None = None) -> bool:
    """mkdir -p `path` in the image; True if its last component was made.
    Every directory made belongs to `owner` (host ids; None: the sandbox's
    root) and gets `mode`, as BuildKit makes them for WORKDIR and COPY
    --chown/--chmod (fsutil's MkdirAll gives each the one mode)."""
    path = "/" + path.strip("/")
    if path == "/" or is_dir(rootfd, path):
        return False
    current = ""
    made = False
    for part in path.strip("/").split("/"):
        current = f"{current}/{part}"
        if is_dir(rootfd, current):
            continue
        pfd, name = _parent(rootfd, current)
        try:
            try:
                os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                raise CopyError(f"{current} exists and is not a directory; cannot make {path}")
            os.mkdir(name, 0o755, dir_fd=pfd)
            made = current == path
            _set_attrs_at(pfd, name, current, mode, owner)
        except OSError as err:
            raise _failed(current, err) from err
        finally:
            os.close(pfd)
    return made


def _set_attrs_at(pfd: int, name: str, shown: str, mode: int | None, owner: tuple[int, int] | None) -> None:
    """Mode and owner of the directory `name` in `pfd` (opened without
    following a link, so only a directory is ever changed)."""
    if mode is None and owner is None:
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        if mode is not None:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- writing entries

def _replace_leaf(pfd: int, name: str, path: str, want_dir: bool) -> bool:
    """Clear the way for a new entry `name`: a file or symlink there is
    removed; an existing directory is kept for a directory (True) and
    refused for anything else."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if want_dir:
            return True
        raise CopyError(f"{path} is a directory in the image; cannot replace it with a file or symlink")
    os.unlink(name, dir_fd=pfd)
    return False


def _links_to_dir(rootfd: int, pfd: int, name: str, path: str) -> bool:
    """`name` in `pfd` is a symlink to a directory of the image (resolved
    inside it, as everything here is)."""
    try:
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISLNK(st.st_mode) and is_dir(rootfd, path)


def _write_file(pfd: int, name: str, data_fd: int | None, chunks, mode: int,
                owner: tuple[int, int] | None, stop: Stop = None, budget: LayerBudget | None = None,
                path: str = "") -> int:
    """A new file `name` in `pfd` (`path` in the image) with the bytes of
    `data_fd` (sent, a chunk at a time) or of `chunks`; `stop` is checked
    after each chunk is read, `budget` charged with each chunk written."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
    written = 0
    try:
        if data_fd is not None:
            while True:
                _check(stop)
                n = os.sendfile(fd, data_fd, None, COPY_CHUNK)
                if n == 0:
                    break
                written += n
                if budget is not None:
                    budget.take(n, path)
        else:
            for chunk in chunks:
                _check(stop)
                view = memoryview(chunk)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    written += n
                if budget is not None:
                    budget.take(len(chunk), path)
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)         # after fchown: a chown clears setuid/setgid bits
    finally:
        os.close(fd)
    return written


class ChangedSinceHashed(CopyError):
    """A source's bytes, as the copy read them, are not those its step's key
    hashed. `file`: its (device, inode), whose digest the caller's cache
    must forget (a write that moved no time would leave it there)."""

    def __init__(self, shown: str, file: tuple[int, int]):
        super().__init__(f"{shown} changed in the build context during the build, after it was hashed for the "
                         "step's cache key; build again when it holds still")
        self.file = file


def _hashed(fd: int, h):
    """The bytes of open file `fd` from where it is, in chunks, each added to `h`.
    The copy's own read is what is checked against the step's key: the
    build cache must never hold, under a key, other bytes than the key's
    (the next build with those files would take them)."""
    while chunk := os.read(fd, COPY_CHUNK):
        h.update(chunk)
        yield chunk


def _put_entry(rootfd: int, path: str, source: Source, e: Entry, owner: tuple[int, int] | None,
               chmod: int | None, dir_modes: list[tuple[str, int]], stop: Stop = None,
               budget: LayerBudget | None = None) -> int:
    """One context entry of `source` at `path` in the image; returns the bytes written."""
    pfd, name = _parent(rootfd, path)
    try:
        if e.kind == "dir" and _links_to_dir(rootfd, pfd, name, path):
            return 0        # merged through the link; the directory it names keeps its mode and owner
        existed = _replace_leaf(pfd, name, path, e.kind == "dir")
        if e.kind == "dir":
            if not existed:
                os.mkdir(name, 0o700, dir_fd=pfd)
            # Modes last, deepest first: a read-only directory must not stop what goes in it.
            dir_modes.append((path, chmod if chmod is not None else e.mode))
            if owner is not None:
                _set_attrs_at(pfd, name, path, None, owner)
            return 0
        if e.kind == "symlink":
            os.symlink(e.target, name, dir_fd=pfd)
            if owner is not None:
                os.chown(name, *owner, dir_fd=pfd, follow_symlinks=False)
            return 0
        # Named below the context, as the Dockerfile names it (e.path is where the daemon reads it).
        shown = posixpath.normpath(posixpath.join(source.rel, e.rel))
        try:
            src = source.open(e)
        except FileNotFoundError:
            raise CopyError(f"{shown} was removed from the build context during the build") from None
        except OSError as err:
            raise CopyError(f"{shown} changed in the build context during the build: {err.strerror}") from None
        try:
            want = source.digests.get(e.rel)
            if want is None:
                return _write_file(pfd, name, src, None, chmod if chmod is not None else e.mode, owner, stop,
                                   budget, path)
            h = hashlib.sha256()
            written = _write_file(pfd, name, None, _hashed(src, h), chmod if chmod is not None else e.mode, owner,
                                  stop, budget, path)
            if h.hexdigest() != want:
                st = os.fstat(src)
                raise ChangedSinceHashed(shown, (st.st_dev, st.st_ino))
            return written
        finally:
            os.close(src)
    except OSError as err:
        raise _failed(path, err) from err
    finally:
        os.close(pfd)


def _apply_dir_modes(rootfd: int, dir_modes: list[tuple[str, int]]) -> None:
    for path, mode in sorted(dir_modes, key=lambda pm: -pm[0].count("/")):
        pfd, name = _parent(rootfd, path)
        try:
            _set_attrs_at(pfd, name, path, mode, None)
        except OSError as err:
            raise _failed(path, err) from err
        finally:
            os.close(pfd)


def copy_sources(rootfd: int, sources: list[Source], dest: str, owner: tuple[int, int] | None,
                 chmod: int | None, stop: Stop = None, budget: LayerBudget | None = None) -> Counts:
    """COPY (and ADD of what is not an archive): each source at `dest`. A
    directory's contents go into `dest`; a file goes to `dest` itself, or
    into it when `dest` ends with / or is a directory of the image.
    `stop`: once set, CopyStopped before the next entry or chunk (what was
    written stays, for the caller's sandbox to go with it). `budget`: what
    the step may still write (CopyTooLarge past it)."""
    counts = Counts()
    dir_modes: list[tuple[str, int]] = []
    into = dest.endswith("/") or is_dir(rootfd, dest)
    top = "/" + dest.strip("/")
    for src in sources:
        if src.is_dir:
            make_dirs(rootfd, top, chmod if chmod is not None else 0o755, owner)
            base = top
            entries = src.entries[1:]
        else:
            if into:
                make_dirs(rootfd, top, chmod if chmod is not None else 0o755, owner)
                base = posixpath.join(top, posixpath.basename(src.rel))
            else:
                make_dirs(rootfd, posixpath.dirname(top), chmod if chmod is not None else 0o755, owner)
                base = top
            entries = [src.entries[0]]
        for e in entries:
            path = posixpath.join(base, e.rel) if e.rel else base
            _check(stop)
            counts.bytes += _put_entry(rootfd, path, src, e, owner, chmod, dir_modes, stop, budget)
            counts.files += 1
    _apply_dir_modes(rootfd, dir_modes)
    return counts


# ---------------------------------------------------------------- ADD of an archive

def is_archive(f) -> bool:
    """A tar, plain or compressed (gzip, bzip2, xz): ADD extracts these.
    `f`: the file, open for reading (read from its start, left there)."""
    try:
        return tarfile.is_tarfile(f)
    except OSError:
        return False
    finally:
        f.seek(0)


class HashedReader:
    """A file read forward only (tarfile's stream mode), every byte read
    added to a sha256 once; `check` reads on to the end and raises
    ChangedSinceHashed unless the whole file hashed to `want` (None: not
    checked). What an ADD extracts is then what its step's key hashed."""

    def __init__(self, f, want: str | None, shown: str, stop: Stop = None):
        self.f, self.want, self.shown, self.stop = f, want, shown, stop
        self.h = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        _check(self.stop)
        data = self.f.read(n)
        self.h.update(data)
        return data

    def check(self) -> None:
        while self.read(COPY_CHUNK):
            pass
        if self.want is not None and self.h.hexdigest() != self.want:
            st = os.fstat(self.f.fileno())
            raise ChangedSinceHashed(self.shown, (st.st_dev, st.st_ino))


def extract_archive(rootfd: int, f, archive: str, dest: str, owner: tuple[int, int] | None,
                    to_host: ToHost, id_count: int | None, stop: Stop = None,
                    budget: LayerBudget | None = None) -> Counts:
    """ADD of a local archive (`f`, open for reading; `archive` names it in
    messages): its entries into directory `dest`, owners from the archive
    (mapped by `to_host`; an id the sandbox cannot hold, `id_count` and up,
    is refused) unless --chown gave `owner`. Names are
    checked as a directory copy's (tarsafe: no absolute names, no `..`);
    hard links only to files the archive made before; devices and FIFOs
    are skipped (listed in the counts). `stop`, `budget`: as copy_sources'."""
    top = "/" + dest.strip("/")
    make_dirs(rootfd, top)
    counts = Counts()
    dir_modes: list[tuple[str, int]] = []
    made_files: set[str] = set()
    try:
        # Stream mode: the archive is read once, forward (HashedReader).
        with tarfile.open(fileobj=f, mode="r|*") as tf:
            for m in tf:
                _check(stop)
                try:
                    rel = tarsafe.entry_name(m.name)
                except tarsafe.Refused as err:
                    raise CopyError(f"{archive}: {err}") from None
                if not rel:
                    continue
                path = f"{top.rstrip('/')}/{rel}"
                if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
                    counts.skipped.append(rel)
                    continue
                ids = owner
                if ids is None:
                    if id_count is not None and (m.uid >= id_count or m.gid >= id_count):
                        raise CopyError(f"{archive}: {rel} is owned by {m.uid}:{m.gid}, past the ids a "
                                        f"sandbox maps (0..{id_count - 1}); ADD it with --chown")
                    ids = to_host(m.uid, m.gid)
                make_dirs(rootfd, posixpath.dirname(path))
                try:
                    counts.bytes += _put_member(rootfd, tf, m, path, top, ids, dir_modes, made_files, stop,
                                                budget)
                except CopyTooLarge as err:
                    raise CopyTooLarge(f"{archive}: {err}", err.max_bytes) from None
                except CopyError as err:
                    raise CopyError(f"{archive}: {err}") from None
                counts.files += 1
    except (tarfile.TarError, EOFError) as err:
        raise CopyError(f"{archive}: not a readable archive: {err}") from None
    _apply_dir_modes(rootfd, dir_modes)
    return counts


def _put_member(rootfd: int, tf: tarfile.TarFile, m: tarfile.TarInfo, path: str, top: str,
                owner: tuple[int, int], dir_modes: list[tuple[str, int]], made_files: set[str],
                stop: Stop = None, budget: LayerBudget | None = None) -> int:
    pfd, name = _parent(rootfd, path)
    try:
        if m.isdir() and _links_to_dir(rootfd, pfd, name, path):
            return 0        # as COPY: through the image's link to a directory, which keeps its attributes
        existed = _replace_leaf(pfd, name, path, m.isdir())
        mode = m.mode & 0o7777
        if m.isdir():
            if not existed:
                os.mkdir(name, 0o700, dir_fd=pfd)
            _set_attrs_at(pfd, name, path, None, owner)
            dir_modes.append((path, mode))
            return 0
        if m.issym():
            os.symlink(m.linkname, name, dir_fd=pfd)
            os.chown(name, *owner, dir_fd=pfd, follow_symlinks=False)
            return 0
        if m.islnk():
            try:
                target = f"{top.rstrip('/')}/{tarsafe.entry_name(m.linkname)}"
            except tarsafe.Refused as err:
                raise CopyError(f"hard link {m.name} -> {m.linkname}: {err}") from None
            if target not in made_files:
                raise CopyError(f"hard link {m.name} -> {m.linkname}: the target is not a file the archive "
                                "made before it")
            sfd, sname = _parent(rootfd, target)
            try:
                os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(sfd)
            made_files.add(path)
            return 0
        src = tf.extractfile(m)
        written = _write_file(pfd, name, None, iter(lambda: src.read(COPY_CHUNK), b""), mode, owner, stop,
                              budget, path)
        made_files.add(path)
        return written
    except OSError as err:
        raise _failed(path, err) from err
    finally:
        os.close(pfd)
