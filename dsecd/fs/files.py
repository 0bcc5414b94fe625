"""File access inside a sandbox from the host, never escaping it.

Every path is resolved with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
against a directory fd of the sandbox's root (from /proc/<init>/root), so the
kernel treats `..`, absolute symlinks and magic links as if the sandbox root
were `/`: a symlink planted by the sandbox can never lead the daemon to a host
file. Only regular files are read or written (a FIFO or device would block a
worker thread or stream forever). All functions block: call them in a thread.
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from .. import native
from . import libc

RESOLVE = native.RESOLVE_IN_ROOT | native.RESOLVE_NO_MAGICLINKS
# Below a directory the daemon already holds, no link of any kind followed
# (the walks of a directory copy and a recursive watch).
BENEATH = native.RESOLVE_BENEATH | native.RESOLVE_NO_SYMLINKS | native.RESOLVE_NO_MAGICLINKS


class PathError(ValueError):
    """The path itself is unacceptable (not absolute, `..`, NUL, too long)."""


def check_path(path: str) -> str:
    if not path.startswith("/"):
        raise PathError(f"path {path!r} must be absolute (paths are inside the sandbox)")
    if "\0" in path:
        raise PathError("path must not contain NUL bytes")
    if len(os.fsencode(path)) > 4095:
        raise PathError("path is longer than PATH_MAX (4095 bytes)")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathError(f"path {path!r} must not contain '..' components")
    return "/" + "/".join(parts)


def _open(rootfd: int, path: str, flags: int, mode: int = 0) -> int:
    return native.openat2(rootfd, path, flags | os.O_CLOEXEC, mode, RESOLVE)


# What a write, remove or rename may not do to the sandbox's root, in the
# words both backends give (the microVM's checks it before its agent does).
_ROOT_REFUSED = {"write": "cannot write to /", "remove": "refusing to remove / (remove what is under it instead)",
                 "rename": "cannot rename / or onto /"}


def refuse_root(verb: str, *paths: str) -> None:
    """PathError if one of the checked `paths` is / (verb: write, remove or rename)."""
    if "/" in paths:
        raise PathError(_ROOT_REFUSED[verb])


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent or "/", name


def _require_regular(fd: int, path: str) -> os.stat_result:
    """An ordinary file: not a FIFO or device (would block or stream forever),
    and not a kernel interface. procfs and sysfs files are S_IFREG too, but
    reading or writing them is a kernel call made with the daemon's full
    privileges: a sandbox that symlinks /work/out.txt to /proc/mtrr, or to
    /proc/kallsyms (real addresses for root), would have the daemon write or
    read them the next time a client touches that path (found by
    tests/integration/test_attack_control.py)."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        raise PathError(f"{path} is a directory, not a regular file (`dsec ls` lists it, `dsec cp -r` "
                        "copies it)")
    if not stat.S_ISREG(st.st_mode):
        raise PathError(f"{path} is a {_type_of(st.st_mode)}, not a regular file")
    kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, path))
    if kind is not None:
        raise PathError(f"{path} is on {kind}, a kernel interface, not an ordinary file; "
                        "read it with an exec inside the sandbox")
    return st


def _kernel_fs_above(rootfd: int, path: str) -> str | None:
    """The kernel file system (proc, sysfs...) the nearest existing directory
    above `path` is on, if any: /proc/self/status is missing as the daemon
    resolves it (its own pid is not in the sandbox's /proc), which a plain
    "not found" would hide."""
    parent = path
    while parent != "/":
        parent = _split(parent)[0]
        try:
            fd = _open(rootfd, parent, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            return native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, parent))
        finally:
            os.close(fd)
    return None


def _open_to_read(rootfd: int, path: str) -> int:
    try:
        return _open(rootfd, path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        kind = _kernel_fs_above(rootfd, path)
        if kind is None:
            raise
        raise PathError(f"{path} is on {kind}, a kernel interface, not an ordinary file (and /proc/self "
                        "is not the sandbox's from outside); read it with an exec inside the sandbox") from None


def read_file(rootfd: int, path: str, offset: int, length: int) -> dict:
    path = check_path(path)
    fd = _open_to_read(rootfd, path)
    try:
        st = _require_regular(fd, path)
        data = os.pread(fd, length, offset) if length else b""
        return {"data": data, "size": st.st_size, "eof": offset + len(data) >= st.st_size,
                "file": f"{st.st_dev}:{st.st_ino}"}
    finally:
        os.close(fd)


def make_parents(rootfd: int, path: str) -> None:
    """mkdir -p of the directories above `path` (each step resolved in root)."""
    current = "/"
    for part in path.strip("/").split("/")[:-1]:
        nxt = current.rstrip("/") + "/" + part
        try:
            fd = _open(rootfd, nxt, os.O_PATH | os.O_DIRECTORY)
            os.close(fd)
        except FileNotFoundError:
            pfd = _open(rootfd, current, os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            finally:
                os.close(pfd)
        current = nxt


def open_for_write(rootfd: int, path: str, append: bool, keep: bool, mode: int, parents: bool,
                   create: bool = True) -> int:
    """An fd of the regular file at `path`, created (with `mode`) if missing
    and `create` (else FileNotFoundError), O_APPEND if `append`, emptied
    unless `keep`: what write_data or a copier then fills. The truncation
    waits for the checks, so a FIFO or a kernel file is never truncated."""
    path = check_path(path)
    refuse_root("write", path)
    if parents and create:
        make_parents(rootfd, path)
    flags = os.O_WRONLY | (os.O_CREAT if create else 0) | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    fd = _open(rootfd, path, flags, mode & 0o7777 if create else 0)      # openat2: no mode without O_CREAT
    try:
        _require_regular(fd, path)
        if not keep:
            os.ftruncate(fd, 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_data(fd: int, data: bytes) -> None:
    """All of data into fd, by the daemon itself (charged to the daemon)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_regular(dirfd: int, name: str, data_chunks, mode: int, fill=None) -> None:
    """A new file of a directory copy: `name` resolved against `dirfd` as
    root, created (O_CREAT | O_EXCL: a new file, never through a symlink),
    refused unless a regular file on an ordinary filesystem, then filled
    with the chunks of `data_chunks` in order: by fill(fd, chunks) (the
    sandbox's copier, dsecd/engine/copier.py; False if it has none) or else
    by the daemon."""
    fd = _open(dirfd, name, os.O_WRONLY | os.O_NONBLOCK | os.O_CREAT | os.O_EXCL, mode & 0o7777)
    try:
        _require_regular(fd, name)
        if fill is None or not fill(fd, data_chunks):
            for chunk in data_chunks:
                write_data(fd, chunk)
    finally:
        os.close(fd)


def _type_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "unknown"


def _stat_dict(st: os.stat_result) -> dict:
    return {"type": _type_of(st.st_mode), "size": st.st_size, "mode": stat.S_IMODE(st.st_mode),
            "uid": st.st_uid, "gid": st.st_gid, "mtime": st.st_mtime}


def is_directory(rootfd: int, path: str) -> bool:
    """Whether `path` (symlinks followed inside the root) is a directory that
    can be reached; a loop, a too-long name or a denied search is a no."""
    try:
        os.close(_open(rootfd, check_path(path), os.O_PATH | os.O_DIRECTORY))
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP, errno.ENAMETOOLONG):
            return False
        raise
    return True


def name_text(raw: bytes) -> str | bytes:
    """A name as the protocol carries it: str, or bytes where it is not UTF-8
    (a str with surrogates cannot be sent)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw


def stat_path(rootfd: int, path: str, follow: bool = False) -> dict:
    """lstat semantics: a symlink is reported as a symlink, not followed, with
    its `target` (the link's text); with `follow`, stat: what it leads to
    (inside the root)."""
    path = check_path(path)
    fd = _open(rootfd, path, os.O_PATH | (0 if follow else os.O_NOFOLLOW))
    try:
        st = os.fstat(fd)
        out = _stat_dict(st)
        out["path"] = path
        if stat.S_ISLNK(st.st_mode):
            out["target"] = name_text(os.readlink(b"", dir_fd=fd))     # readlinkat of the O_PATH fd: this very link
        return out
    finally:
        os.close(fd)


def list_dir(rootfd: int, path: str, depth: int = 1, max_entries: int = 100_000) -> dict:
    """The entries of a directory, and with depth > 1 of its subdirectories
    down to that depth (names relative to `path`: "a/b"). Symlinks are listed,
    not followed. At most max_entries, then `truncated`."""
    path = check_path(path)
    fd = _open(rootfd, path, os.O_RDONLY | os.O_DIRECTORY)
    entries: list[dict] = []
    try:
        truncated = _list_into(fd, "", depth, max_entries, entries)
    finally:
        os.close(fd)
    entries.sort(key=lambda e: e["name"])
    return {"path": path, "entries": entries, "truncated": truncated}


def _list_into(fd: int, prefix: str, depth: int, max_entries: int, entries: list[dict]) -> bool:
    """Add the entries under directory `fd` (named prefix + name); True if max_entries cut it short."""
    subdirs = []
    with os.scandir(fd) as it:
        for entry in it:
            if len(entries) >= max_entries:
                return True
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue        # removed since it was read: a listing is of one moment or other
            entries.append({"name": prefix + entry.name, **_stat_dict(st)})
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                subdirs.append(entry.name)
    for name in subdirs:
        try:
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            continue            # gone, or made a symlink meanwhile: not entered
        try:
            if _list_into(sub, f"{prefix}{name}/", depth - 1, max_entries, entries):
                return True
        finally:
            os.close(sub)
    return False


def make_dir(rootfd: int, path: str, parents: bool, mode: int) -> dict:
    """mkdir (-p with `parents`: the missing ones above it too, and no error
    if it exists as a directory)."""
    path = check_path(path)
    if path == "/":
        if parents:
            return {"path": path, "created": False}
        raise FileExistsError(errno.EEXIST, "/ exists")
    if parents:
        make_parents(rootfd, path)
    parent, name = _split(path)
    pfd = _open(rootfd, parent, os.O_PATH | os.O_DIRECTORY)
    try:
        try:
            os.mkdir(name, mode & 0o7777, dir_fd=pfd)
        except FileExistsError:
            # -p: an existing directory, or a link to one inside the sandbox, is fine.
            if not parents or not is_directory(rootfd, path):
                raise
            return {"path": path, "created": False}
        return {"path": path, "created": True}
    finally:
        os.close(pfd)


def set_attrs(rootfd: int, path: str, mode: int | None, mtime: float | None, follow: bool = False) -> dict:
    """chmod `path` to `mode` and/or set its modification and access times
    to `mtime`: a regular file or a directory, on an ordinary filesystem.
    Its last name is not followed unless `follow` (a symlink is refused:
    its target is set by its own path); all resolve inside the sandbox."""
    path = check_path(path)
    fd = _open(rootfd, path, os.O_PATH | (0 if follow else os.O_NOFOLLOW))
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise PathError(f"{path} is a {_type_of(st.st_mode)}, not a file or directory" +
                            (": set its target's attributes by the target's own path" if stat.S_ISLNK(st.st_mode)
                             else ""))
        kind = native.KERNEL_FS_MAGICS.get(native.fs_magic(fd, path))
        if kind is not None:
            raise PathError(f"{path} is on {kind}, a kernel interface, not an ordinary file")
        # An O_PATH fd names the inode opened: no path is resolved again.
        proc = f"/proc/self/fd/{fd}"
        if mode is not None:
            os.chmod(proc, mode & 0o7777)
        if mtime is not None:
            ns = int(mtime * 1e9)
            os.utime(proc, ns=(ns, ns))
        return {"path": path}
    finally:
        os.close(fd)


def remove(rootfd: int, path: str, recursive: bool, stop: threading.Event | None = None) -> dict:
    """rm (-r with `recursive`). A symlink is removed, never followed, at any
    depth: what a sandbox points elsewhere is not the daemon's to delete.
    `stop`, once set (the request cancelled), ends a recursive remove before
    its next entry, with InterruptedError."""
    path = check_path(path)
    refuse_root("remove", path)
    parent, name = _split(path)
    pfd = _open(rootfd, parent, os.O_PATH | os.O_DIRECTORY)
    try:
        return {"path": path, "removed": _remove_at(pfd, name, recursive, path, stop)}
    finally:
        os.close(pfd)


def _remove_at(dirfd: int, name: str, recursive: bool, shown: str, stop: threading.Event | None = None) -> int:
    """Remove `name` in `dirfd`; the number of entries removed."""
    if stop is not None and stop.is_set():
        raise InterruptedError(errno.EINTR, f"the remove stopped before {shown}: it was cancelled")
    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dirfd)
        return 1
    if not recursive:
        try:
            os.rmdir(name, dir_fd=dirfd)
        except OSError as err:
            if err.errno == errno.ENOTEMPTY:
                raise OSError(errno.ENOTEMPTY, f"{shown} is a directory that is not empty; remove it "
                              "recursively (`dsec rm -r`, SDK remove(path, recursive=True))") from err
            raise
        return 1
    # O_NOFOLLOW: a directory swapped for a symlink meanwhile is not entered.
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    removed = 0
    try:
        for entry in os.listdir(fd):
            removed += _remove_at(fd, entry, True, f"{shown}/{entry}", stop)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)
    return removed + 1


def rename(rootfd: int, src: str, dst: str, overwrite: bool, keep_attrs: bool = False) -> dict:
    """mv within the sandbox. Without `overwrite` an existing destination is
    an error (renameat2 RENAME_NOREPLACE: no window for one to appear). With
    `keep_attrs`, a regular file `src` that replaces a regular file takes its
    owner, group and mode first: what an atomic write_file needs to look,
    from the sandbox, like a write in place."""
    src, dst = check_path(src), check_path(dst)
    refuse_root("rename", src, dst)
    (sparent, sname), (dparent, dname) = _split(src), _split(dst)
    sfd = _open(rootfd, sparent, os.O_PATH | os.O_DIRECTORY)
    try:
        dfd = _open(rootfd, dparent, os.O_PATH | os.O_DIRECTORY)
        try:
            if not overwrite:
                try:
                    libc.rename_noreplace(sfd, sname, dfd, dname)
                except FileExistsError as err:
                    raise FileExistsError(errno.EEXIST, f"{dst} exists; rename with overwrite to replace it") \
                        from err
                return {"src": src, "dst": dst}
            if keep_attrs:
                try:
                    target = os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    target = None
                if target is not None:
                    source = _type_of(os.stat(sname, dir_fd=sfd, follow_symlinks=False).st_mode)
                    if why := unreplaceable(dst, _type_of(target.st_mode), source):
                        raise PathError(why)
                    _take_attrs(sfd, sname, target)
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            return {"src": src, "dst": dst}
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def unreplaceable(dst: str, kind: str, source: str = "file") -> str | None:
    """Why an atomic write may not replace `dst`, of type `kind` (_type_of),
    with its temporary `source` (a file's type), or None: a device, fifo or
    socket would be swapped for a regular file (a sandbox's /dev/null
    becoming one, say). A write in place refuses them too
    (_require_regular). A directory would fail the rename with a bare
    EISDIR; said here as what it is."""
    if kind == "dir" and source != "dir":
        return f"{dst} is a directory, not a file: a write goes to regular files only (write to a path in it)"
    if kind not in ("char", "block", "fifo", "socket"):
        return None
    what = f"a {kind} device" if kind in ("char", "block") else f"a {kind}"
    return f"{dst} is {what}, not a file: a write goes to regular files only"


def _take_attrs(sfd: int, sname: str, target: os.stat_result) -> None:
    """Give regular file sname the owner, group and mode of the file it
    replaces (`target`, its lstat), if both are regular; chown first, as it
    clears set-id bits."""
    if not stat.S_ISREG(target.st_mode):
        return
    fd = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=sfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        os.fchown(fd, target.st_uid, target.st_gid)
        os.fchmod(fd, stat.S_IMODE(target.st_mode))
    finally:
        os.close(fd)
