"""`dsec cp`: files and directories into and out of a sandbox, as docker cp
copies them: a tar on stdin or stdout, symlinks kept with -r, a directory
merged into one that exists (cpmerge.py)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import posixpath
import secrets
import signal
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator

from .. import cpmerge, cptar, localcopy
from ..cliargs import _interrupted
from ..client import Client, named_as
from ..clitext import UsageError
from ..clitext import print_json as _print_json
from ..cptar import in_a_thread_of_its_own as _in_a_thread_of_its_own
from ..errors import BadRequest, DsecError, NotFound, PermissionDenied
from .common import _cancelled_by_ending_signals, _split_remote, _stdin_chunks
from .files import _to_stdout


def _relative_remote(spec: str) -> bool:
    """SB:path with a path that is not absolute (SB:tmp/x, SB:), and no
    local file of that name: a sandbox's path given as docker cp takes
    one, relative to the container's directory, which dsec does not."""
    head, sep, tail = spec.partition(":")
    return bool(sep and head and "/" not in head and not tail.startswith("/") and not os.path.lexists(spec))


def _cp_sides(a) -> tuple[str | None, str, str | None, str]:
    """(source sandbox, source path, destination sandbox, destination path): one side is a sandbox's."""
    src_sb, src = _split_remote(a.src)
    dst_sb, dst = _split_remote(a.dst)
    if (src_sb is None) == (dst_sb is None):
        relative = [s for s in (a.src, a.dst) if src_sb is None and _relative_remote(s)]
        if relative:
            raise UsageError(f"dsec cp: a sandbox's path must be absolute: give SANDBOX:/path, got {relative[0]!r}")
        raise UsageError("dsec cp: exactly one side must be SANDBOX:/absolute/path")
    return src_sb, src, dst_sb, dst


def _contents_of(path: str) -> bool:
    """`DIR/.`: docker cp's form for a directory's contents, not the directory."""
    return path == "." or path.endswith("/.")


async def _cp_dir(c: Client, a, src_sb: str | None, src: str, dst_sb: str | None, dst: str) -> int:
    """cp -r: a directory as a tar stream. Like cp -r, an existing directory
    as the destination receives the copy under the source's name; with
    `SRC/.`, as docker cp, the source's contents go into it instead. Where
    the copy's directory exists already it is merged into, as docker cp
    does (_cp_merged). --json: the daemon's result (path, count, bytes;
    skipped when copied from it) with the sandbox and the local path."""
    if src_sb is None:
        sb = await c.get(dst_sb)
        if await _remote_dir(sb, dst):
            if not _contents_of(src):
                dst = posixpath.join(dst, os.path.basename(os.path.normpath(src)))
            if _contents_of(src) or await _remote_dir(sb, dst):
                return await _cp_merged(a, sb, src, dst, upload=True)
        r = await sb.upload_dir(src, dst, owner=a.owner)
        if a.json:
            _print_json({**r, "sandbox": sb.id, "local": src})
        return 0
    sb = await c.get(src_sb)
    if os.path.isdir(dst):
        if not _contents_of(src):
            dst = os.path.join(dst, posixpath.basename(posixpath.normpath(src)) or "root")
        if _contents_of(src) or os.path.isdir(dst):
            return await _cp_merged(a, sb, src, dst, upload=False)
    elif not os.path.isdir(os.path.dirname(os.path.abspath(dst))):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    r = await sb.download_dir(src, dst)
    if a.json:
        _print_json({**r, "sandbox": sb.id, "local": dst})
    _report_skipped(src, r)
    return 0


async def _remote_dir(sb, path: str, follow: bool = False) -> bool:
    """Whether `path` is a directory in the sandbox (one stat; a missing path
    is not); with `follow`, a symlink to one is too (a listing as well)."""
    try:
        kind = (await sb.stat(path))["type"]
    except NotFound:
        return False
    return kind == "dir" or (follow and kind == "symlink" and await _lists_as_dir(sb, path))


async def _cp_tar_out(a, sb, sb_id: str, src: str) -> int:
    """`dsec cp SB:/dir -`: the tree as a tar on stdout, its entries below
    the directory's base name (SB:/dir/.: the contents, without it), as
    docker cp gives it; written as it comes (dsecd/cptar.py)."""
    if a.json:
        raise UsageError(f"dsec cp: --json: stdout carries the tar of {sb_id}:{src}; drop --json (what "
                         "was left out is said on stderr)")
    if os.isatty(1):        # as tar(1) refuses: the bytes would garble the terminal
        raise UsageError(f"dsec cp: {sb_id}:{src} is a directory, and stdout is a terminal: not writing a tar "
                         "there; redirect it (> dir.tar) or pipe it (| tar -x)")
    top = "" if _contents_of(src) else posixpath.basename(posixpath.normpath(src))
    r = await cptar.tar_to_fd(sb, src if src.endswith("/") else src + "/", top)     # a symlink: what it leads to
    _report_skipped(src, r)
    return 0


async def _cp_file_tar_out(a, sb, sb_id: str, src: str) -> int:
    """`dsec cp --tar SB:/file -`: a tar of the one file (a symlink: what it
    leads to, as a plain copy follows one), named by its base name, with its
    permission bits and mtime, as docker cp gives it. The file is spooled
    first (to $TMPDIR, never all in memory), so that the size its header
    says is the size that follows, whatever the sandbox does meanwhile."""
    if a.json or os.isatty(1):
        raise UsageError(f"dsec cp: --tar: stdout carries the tar of {sb_id}:{src}: not with --json, nor onto "
                         "a terminal; redirect it (> file.tar) or pipe it (| tar -x)")
    st = await sb.stat(src)
    if st["type"] == "symlink":
        with contextlib.suppress(BadRequest):       # a microVM's agent before version 8 does not follow
            st = await sb.stat(src, follow=True)
    with tempfile.TemporaryFile() as spool:
        async with contextlib.aclosing(sb.read_chunks(src)) as chunks:
            async for piece in chunks:
                spool.write(piece)
        info = cptar.RawNameTarInfo(posixpath.basename(src.rstrip("/")))
        info.size = spool.tell()
        info.mode = st["mode"] & 0o777 if st["type"] == "file" else 0o644
        info.mtime = int(st.get("mtime") or time.time())
        spool.seek(0)
        await _in_a_thread_of_its_own(cptar.one_file_tar, info, spool)
    return 0


def _landing_name() -> str:
    """A name of this client's own, beside what a copy lands on, for the
    copy to arrive whole under before it moves into place."""
    return f".dsec-cp-{os.getpid()}-{secrets.token_hex(4)}"


async def _cp_merged(a, sb, src: str, dst: str, upload: bool, tar: AsyncIterator[bytes] | None = None) -> int:
    """`dsec cp -r` into the existing directory DST: SRC's entries (of SRC/.,
    or of the directory SRC where DST is its namesake; or those of `tar`, a
    tar stream, where SRC is "-") become entries of DST, merged as docker
    cp merges (dsecd/cpmerge.py). The tree arrives whole in a new directory
    inside DST, then moves into place."""
    landing = _landing_name()
    if upload:
        held = posixpath.join(dst, landing)
        try:
            if tar is not None:
                r = await sb.upload_tar(tar, held, temporary=True, owner=a.owner, dirs=True)
            else:
                r = await sb.upload_dir(src, held, temporary=True, owner=a.owner, dirs=True)
        except DsecError as err:            # named as the user named it, not by the landing
            raise named_as(err, held, dst) from None
        dirs = r.pop("dirs", ())
        if tar is None and _contents_of(src) and dirs:
            # As docker cp: SRC/. gives DST its contents, not SRC's own mode and mtime.
            dirs = [entry for entry in dirs if entry[0]]
        try:
            replaced = await cpmerge.into_sandbox(sb, held, dst, dirs,
                                                  lambda text: print(f"dsec cp: {text}", file=sys.stderr))
        except BaseException:
            with contextlib.suppress(DsecError, ConnectionError):    # keep the error that got us here
                await sb.remove(held, recursive=True)
            raise
    else:
        held = os.path.join(dst, landing)
        r = await sb.download_dir(src, held)
        try:
            # As docker cp: SRC/. gives DST its contents, not SRC's own mode and mtime.
            st = os.lstat(held)
            top = None if _contents_of(src) else (stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            os.chmod(held, 0o700)        # it has SRC's mode, which may not let us move entries out
            replaced = await cpmerge.into_local(held, dst, top)
        except BaseException:
            localcopy.remove_tree(held)
            raise
    if a.json:
        _print_json({**r, "path": dst if upload else r["path"], "sandbox": sb.id,
                     "local": src if upload else dst, "replaced": replaced})
    _report_skipped(src, r)
    return 0


def _report_skipped(src: str, r: dict) -> None:
    """What a copy out of a sandbox left behind (FIFOs, devices, sockets)."""
    top = src[:-2] if src.endswith("/.") else src.rstrip("/")
    for item in r.get("skipped", []):
        print(f"dsec cp: not copied: {top}/{item['path']} ({item['type']}): {item['reason']}", file=sys.stderr)


async def cmd_cp(c: Client, a) -> int:
    """SIGTERM and SIGHUP end a copy as ^C does: the copy is cancelled, and
    an upload's temporary file in the sandbox removed, not left there
    half-written; exits 128+signal."""
    signals: list[int] = []
    try:
        with _cancelled_by_ending_signals(signals):
            return await _cp(c, a)
    except asyncio.CancelledError:
        if not signals:
            raise
        message = f"{signal.Signals(signals[0]).name}: the copy was cancelled"
        _interrupted(a, signals[0], message)
        print(f"dsec cp: {message}", file=sys.stderr)
        return 128 + signals[0]


async def _cp(c: Client, a) -> int:
    src_sb, src, dst_sb, dst = _cp_sides(a)
    if a.owner is not None and src_sb is not None:
        raise UsageError("dsec cp: --owner gives what a copy into a sandbox makes to a user of the sandbox; "
                         "a copy out of one belongs to whoever runs dsec")
    if getattr(a, "tar", False) and (dst if src_sb is not None else src) != "-":
        raise UsageError("dsec cp: --tar goes with '-': dsec cp --tar SB:/path - or dsec cp --tar - SB:/dir")
    if src_sb is not None and dst == "-":
        sb = await c.get(src_sb)
        # As docker cp - gives it: a directory (or a symlink to one) as a tar;
        # a file's bytes as they are, or with --tar a tar of the one file.
        if await _remote_dir(sb, src, follow=True):
            return await _cp_tar_out(a, sb, src_sb, src)
        if getattr(a, "tar", False):
            return await _cp_file_tar_out(a, sb, src_sb, src)
    if src_sb is not None and dst != "-" and _keeps_links(a) and await _cp_link_out(c, a, src_sb, src, dst):
        return 0
    if src_sb is None and _keeps_links(a) and await _cp_link_in(c, a, src, dst_sb, dst):
        return 0
    if src_sb is None and a.recursive and getattr(a, "follow_link", False) and os.path.islink(src) \
            and os.path.isdir(src):
        src += "/"              # -L: the directory it leads to, as LINK/ names it
    if a.recursive and not await _is_a_file(c, src_sb, src):     # cp -r copies a file as a file
        return await _cp_dir(c, a, src_sb, src, dst_sb, dst)
    if src_sb is None and os.path.isdir(src):
        raise UsageError(f"dsec cp: {src} is a directory; copy it with dsec cp -r")
    if src_sb is None:
        sb = await c.get(dst_sb)
        if src == "-" and await _remote_dir(sb, dst, follow=True):
            # As docker cp - takes it: a tar stream, its entries merged into the directory.
            if os.isatty(0):
                raise UsageError(f"dsec cp: {dst} is a directory, which takes a tar on stdin, and stdin is a "
                                 "terminal: pipe the tar in (tar -cf - . | dsec cp - SB:/dir), or name a file "
                                 f"(SB:{dst.rstrip('/')}/NAME)")
            try:
                return await _cp_merged(a, sb, src, dst, upload=True,
                                        tar=cptar.batched(cptar.decompressed(_stdin_chunks())))
            except BadRequest as err:
                if "not a valid archive" not in err.message:
                    raise
                raise BadRequest(f"{err.message} (stdin into a directory is a tar, as docker cp - takes it; "
                                 f"name a file to write stdin's bytes to: SB:{dst.rstrip('/')}/NAME)",
                                 err.detail) from None
        if getattr(a, "tar", False):
            raise UsageError(f"dsec cp: {dst}: no such directory; a tar goes into a directory that exists, as "
                             "docker cp - requires")
        dst = await _cp_remote_target(sb, src, dst)
        # Streamed, never all in memory; atomic: a failed copy leaves nothing.
        if src == "-":
            size = await sb.write_file(dst, _stdin_chunks(), mode=0o644, atomic=True, owner=a.owner)
        else:
            # A FIFO's open waits for its writer: not on the loop, or no signal could end dsec.
            with await _in_a_thread_of_its_own(open, src, "rb") as f:
                st = os.fstat(f.fileno())
                # A pipe or FIFO (<(cmd), /dev/stdin) may block for as long as its writer likes.
                source = f if stat.S_ISREG(st.st_mode) else _stdin_chunks(f.fileno())
                size = await sb.write_file(dst, source, mode=st.st_mode & 0o7777, atomic=True, owner=a.owner)
        if a.json:
            _print_json({"sandbox": sb.id, "path": dst, "local": src, "size": size})
        return 0
    sb = await c.get(src_sb)
    if dst == "-":
        if a.json:               # the one object on stdout: the bytes as text, as `cat --json` gives them
            data = await sb.read_file(src)
            _print_json({"sandbox": sb.id, "path": src, "size": len(data), "data": data.decode("utf-8", "replace")})
        else:
            await _to_stdout(sb, src)
        return 0
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    elif dst.endswith("/"):
        raise UsageError(f"dsec cp: {dst}: no such directory (a destination ending in / must be one)")
    st = await sb.stat(src)
    if st["type"] == "symlink":     # -L (or a microVM's link): its target's bits
        with contextlib.suppress(BadRequest):       # a microVM's agent before version 8 does not follow
            st = await sb.stat(src, follow=True)
    # Its permission bits, as docker cp keeps them; never setuid or setgid
    # on our side (a sandbox's file, owned here by whoever runs dsec).
    size = await _copy_out(sb, src, dst, st["mode"] & 0o777 if st["type"] == "file" else None)
    if a.json:
        _print_json({"sandbox": sb.id, "path": src, "local": dst, "size": size})
    return 0


def _keeps_links(a) -> bool:
    """Whether a symlink named as the source of a copy (out, or in) is copied
    as a symlink, as cp(1) has it: with -r (or -P), not without (or with -L). A
    plain copy follows it inside the sandbox: a link the sandbox made would
    otherwise land on the host as a link resolved against the host's files
    (/etc/shadow, ~/.ssh/id_rsa), which the next copy into a sandbox sends."""
    return (a.recursive or getattr(a, "no_dereference", False)) and not getattr(a, "follow_link", False)


async def _cp_link_out(c: Client, a, sb_id: str, src: str, dst: str) -> bool:
    """`dsec cp -r SB:/link DST` (or -P), as cp -a and docker cp do it: a
    symlink comes out as a symlink with the same target (a trailing / or /.
    follows it). False when `src` is no symlink, or its target is not known
    (a microVM's agent before version 8 reads no links): the caller copies
    what it leads to."""
    if src.endswith("/") or _contents_of(src):
        return False
    sb = await c.get(sb_id)
    try:
        st = await sb.stat(src)
    except NotFound:
        return False        # the copy says what is missing
    if st["type"] != "symlink" or "target" not in st:
        return False
    if os.path.isdir(dst):
        dst = os.path.join(dst, posixpath.basename(src))
    elif dst.endswith("/"):
        raise UsageError(f"dsec cp: {dst}: no such directory (a destination ending in / must be one)")
    _link_local(dst, st["target"])         # os.fsdecode's str where it is not UTF-8 (the SDK's stat)
    if a.json:
        _print_json({"sandbox": sb.id, "path": src, "local": dst, "target": st["target"]})
    return True


async def _cp_link_in(c: Client, a, src: str, sb_id: str, dst: str) -> bool:
    """`dsec cp -r LINK SB:DST` (or -P): the host symlink LINK arrives as a
    symlink with the same target, as _cp_link_out gives one out; nothing it
    leads to is read. False when `src` is no symlink (or LINK/ follows it).
    It is sent as a tar of that one entry into a new directory beside the
    destination, and renamed from there over DST."""
    if src.endswith("/") or _contents_of(src) or not os.path.islink(src):
        return False
    target = os.readlink(src)
    sb = await c.get(sb_id)
    dst = await _cp_remote_target(sb, src, dst)
    parent, name = posixpath.split(dst)
    landing = posixpath.join(parent, _landing_name())
    spool = io.BytesIO()
    with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tf:
        link = tarfile.TarInfo(name)
        link.type, link.linkname, link.mode = tarfile.SYMTYPE, target, 0o777
        link.mtime = int(os.lstat(src).st_mtime)
        tf.addfile(link)
    spool.seek(0)
    await sb.mkdir(parent, parents=True, owner=a.owner)      # as a file's copy makes them
    try:
        await sb.upload_tar(spool, landing, temporary=True, owner=a.owner)
        try:
            await sb.rename(posixpath.join(landing, name), dst, overwrite=True)
        finally:
            with contextlib.suppress(DsecError, ConnectionError):    # keep the error that got us here
                await sb.remove(landing, recursive=True)
    except DsecError as err:                  # named as the user named it, not by the landing
        raise named_as(named_as(err, posixpath.join(landing, name), dst), landing, dst) from None
    if a.json:
        _print_json({"sandbox": sb.id, "path": dst, "local": src, "target": target})
    return True


def _link_local(dst: str, target: str) -> None:
    """Symlink `dst` -> `target`, made under a temporary name beside it and
    renamed over what `dst` was (as _copy_out does a file)."""
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    tmp = f"{dst}.dsec-tmp-{os.getpid()}"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, dst)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise type(err)(err.errno, err.strerror, dst) from err


async def _is_a_file(c: Client, sb_id: str | None, path: str) -> bool:
    """Whether a cp source is a regular file (a sandbox's, or ours: sb_id None)."""
    if sb_id is None:
        return path == "-" or os.path.isfile(path)
    sb = await c.get(sb_id)
    try:
        kind = (await sb.stat(path))["type"]
    except NotFound:
        return False        # the directory copy says what is missing
    # file_stat does not follow a symlink; listing does (a link to a directory lists).
    return kind == "file" or (kind == "symlink" and not await _lists_as_dir(sb, path))


async def _cp_remote_target(sb, src: str, dst: str) -> str:
    """Where `dsec cp SRC SB:DST` writes, as cp(1) would: DST, or DST/NAME
    (NAME: the source's) when DST ends in /, is a directory or a symlink to
    one (one stat; a listing too when DST is a symlink, the one call that
    follows it). A symlink to anything else is replaced, as the write's
    rename replaces any name."""
    into = dst.endswith("/")
    if not into:
        try:
            kind = (await sb.stat(dst))["type"]
            into = kind == "dir" or (kind == "symlink" and await _lists_as_dir(sb, dst))
        except NotFound:
            pass
    if not into:
        return dst
    if src == "-":              # a directory takes stdin as a tar (_cp): this one is not there
        raise UsageError(f"dsec cp: {dst}: no such directory (stdin goes into a directory that exists as a "
                         "tar stream, or to a file named without a trailing /)")
    return posixpath.join(dst, os.path.basename(src))


async def _lists_as_dir(sb, path: str) -> bool:
    """Whether symlink `path` leads to a directory: file_list follows it."""
    try:
        await sb.list_files(path)
    except (NotFound, BadRequest, PermissionDenied):
        return False
    return True


async def _copy_out(sb, src: str, dst: str, mode: int | None = None) -> int:
    """The sandbox's file `src` as local file `dst` (with permission bits
    `mode`; None: as a new file gets them), streamed into a temporary name
    beside it and renamed over it (a failed or cancelled copy leaves the old
    file or none). Errors name `dst`, the path the user gave, not the
    temporary file. The bytes copied."""
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), dst)
    tmp = f"{dst}.dsec-tmp-{os.getpid()}"
    try:
        with _named_as_ours(dst, f" (creating the copy in {parent} first)"):
            f = open(tmp, "wb")
        with f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            # Its own errors (the daemon's, a lost connection) as they are;
            # the local file's writes say which file.
            size = await sb.read_file_to(src, _LocalFile(f, dst, parent))
        with _named_as_ours(dst):
            os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return size


@contextlib.contextmanager
def _named_as_ours(dst: str, where: str = ""):
    """An OSError of our side's file (not a daemon's error, nor a lost
    connection: no plain OSError) named as the path the user gave."""
    try:
        yield
    except ConnectionError:
        raise
    except OSError as err:
        raise OSError(err.errno, f"{err.strerror}{where}", dst) from err


class _LocalFile:
    """The local file a copy out writes, whose write errors (a full disk)
    name the path the user gave, not the temporary file."""

    def __init__(self, f, dst: str, parent: str):
        self.f, self.dst, self.parent = f, dst, parent

    def write(self, data) -> int:
        with _named_as_ours(self.dst, f" (writing the copy in {self.parent})"):
            return self.f.write(data)

    def seekable(self) -> bool:
        return self.f.seekable()

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int) -> int:
        return self.f.seek(pos)

    def truncate(self) -> int:
        return self.f.truncate()
