"""A microVM's writable layer, sent by its guest agent as a tar, unpacked
into a directory that the layer builder reads as it reads a container's
upper dir (images.snapshot: pack_diff).

The guest's overlay keeps its upper dir in a tmpfs inside the guest; the
agent walks it (csrc/guest/agent.c, M_TAR) and streams a POSIX tar of it:
directories, regular files, symlinks, FIFOs, overlay whiteouts (0:0
character devices), hard links (each further name of a file, FIFO or
symlink, as a link to its first name), and as pax records the xattrs
trusted.overlay.opaque (opaque directories), user.*, trusted.* (but
overlayfs's own) and security.capability, of any size (the guest's tmpfs
holds no user.*: the agent sends those of the image's file a copied-up one
came from, agent.c tar_origin_xattrs). Unpacked here as root into a
fresh private directory, with owners, modes (setuid and setgid kept: an
image layer's files are what the guest made), mtimes, those xattrs and the
links (one inode, its link count), so that erofs.build copies whiteouts,
opaque directories and hard links as it does from a container's upper.

The archive comes from a guest, which is not trusted: every name is checked
(dsecd/tarsafe.py's entry_name: relative, no `..`, within PATH_MAX), no
entry may go below a symlink or file of the archive, a name comes once, a
hard link names a file, FIFO or symlink the archive made before it (never
a directory, a whiteout or a path of its own), and devices other than
whiteouts, sockets and sparse entries are refused. The directory is the
daemon's own (0700 under the scratch dir), so nothing else changes it
meanwhile.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from pathlib import Path

from .. import tarsafe

XATTRS_KEPT = ("trusted.overlay.opaque", "security.capability")     # and user.*, trusted.* (xattr_kept)
XATTR_PREFIX = "SCHILY.xattr."
MODE_BITS = 0o7777
CHUNK = 1 << 20
ZEROS = memoryview(bytes(CHUNK))


def unpack(tar_path: Path, dest: Path, max_entries: int = 10_000_000) -> dict:
    """Unpack the agent's tar `tar_path` into the empty directory `dest`.
    Returns {"entries", "bytes"}; raises tarsafe.Refused (a bad entry, named),
    ValueError (a tar cut short or damaged: tarfile would end it quietly at
    the damage, a layer with fewer entries) or OSError."""
    try:
        return _unpack(tar_path, Path(dest), max_entries)
    except tarfile.ReadError as err:
        raise ValueError(f"the agent's tar of the layer: {err}") from err


def _unpack(tar_path: Path, dest: Path, max_entries: int) -> dict:
    dirs: set[str] = {""}
    others: set[str] = set()            # files, symlinks, whiteouts, FIFOs: nothing goes below them
    linkable: set[str] = set()          # files, symlinks, FIFOs: what a hard link may name
    dir_times: list[tuple[str, float]] = []
    entries = nbytes = 0
    with tarfile.open(tar_path, mode="r:", errorlevel=2, tarinfo=tarsafe.Member) as tf:
        for m in tf:
            entries += 1
            if entries > max_entries:
                raise tarsafe.TooLarge(f"the writable layer has more than {max_entries} entries")
            rel = tarsafe.entry_name(m.name)
            path = dest / rel if rel else dest
            if not rel and not m.isdir():
                raise tarsafe.Refused(f"entry {m.name!r} names the layer's root but is not a directory")
            if rel:
                _check_parents(m.name, rel, dirs, others)
                if rel in dirs or rel in others:
                    raise tarsafe.Refused(f"entry {m.name!r} comes twice in the writable layer's tar")
            if m.isdir():
                if rel:
                    os.mkdir(path, 0o700)
                    dirs.add(rel)
                dir_times.append((rel, m.mtime))
            elif m.islnk():
                target = tarsafe.entry_name(m.linkname)
                if target not in linkable:
                    raise tarsafe.Refused(f"entry {m.name!r} of the writable layer's tar is a hard link to "
                                          f"{m.linkname!r}, not an earlier file, FIFO or symlink of the tar")
                # The inode the first name made, with its owner, mode and
                # xattrs: linkat without AT_SYMLINK_FOLLOW, so a symlink is
                # linked itself, never what it points to.
                os.link(dest / target, path, follow_symlinks=False)
                others.add(rel)
                continue
            elif m.isreg() and not m.issparse():
                nbytes += _write_file(tf, m, path)
                others.add(rel)
                linkable.add(rel)
            elif m.issym():
                os.symlink(m.linkname, path)
                others.add(rel)
                linkable.add(rel)
            elif m.ischr() and m.devmajor == 0 and m.devminor == 0:
                os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))      # an overlay whiteout
                others.add(rel)
            elif m.isfifo():
                os.mkfifo(path, 0o600)
                others.add(rel)
                linkable.add(rel)
            else:
                raise tarsafe.Refused(f"entry {m.name!r} of the writable layer's tar is of type {m.type!r} "
                                      "(a device or sparse file); the guest agent sends only directories, "
                                      "files, symlinks, FIFOs, hard links and whiteouts")
            _attributes(path, m)
        tarsafe.check_end(tf)
    for rel, mtime in reversed(dir_times):     # children first: making them changed their parent's mtime
        os.utime(dest / rel if rel else dest, (mtime, mtime))
    return {"entries": entries, "bytes": nbytes}


def xattr_kept(name: str) -> bool:
    """Whether the layer keeps xattr `name` (the agent's tar_xattr_kept):
    what mkfs.erofs keeps of a container's upper dir, but overlayfs's own
    trusted.overlay.* other than the opaque mark (its bookkeeping of the
    guest's overlay, which an overlay having the layer as a lower layer
    would act on: a redirect or metacopy there changes what it shows)."""
    if name.startswith("trusted.overlay."):
        return name == "trusted.overlay.opaque"
    return name in XATTRS_KEPT or name.startswith(("user.", "trusted."))


def _check_parents(name: str, rel: str, dirs: set[str], others: set[str]) -> None:
    parent = rel.rpartition("/")[0]
    path = ""
    for part in parent.split("/") if parent else ():
        path = f"{path}/{part}" if path else part
        if path not in dirs:
            raise tarsafe.Refused(f"entry {name!r} comes before its directory {path!r}, or below a "
                                  f"{'symlink or file' if path in others else 'path'} the tar did not make a "
                                  "directory")


def _write_file(tf: tarfile.TarFile, m: tarfile.TarInfo, path: Path) -> int:
    """The file's bytes, a chunk of zeros left a hole: the agent sends a
    sparse file's holes as zeros (the layer stores them so, as a
    container's does), and written out they would take the file's apparent
    size in the scratch dir a second time, beside the tar."""
    src = tf.extractfile(m)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        left = m.size
        while left:
            data = src.read(min(left, CHUNK))
            if not data:
                raise tarsafe.Refused(f"entry {m.name!r}: the tar ends inside the file")
            if data == ZEROS[:len(data)]:
                os.lseek(fd, len(data), os.SEEK_CUR)
            else:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            left -= len(data)
        os.ftruncate(fd, m.size)            # a hole at the end too
    finally:
        os.close(fd)
    return m.size


def _attributes(path: Path, m: tarfile.TarInfo) -> None:
    """Owner, mode, xattrs and (but directories: set last) mtime of an entry
    just made. chown before chmod: chown clears setuid and setgid."""
    os.chown(path, m.uid, m.gid, follow_symlinks=False)
    if m.issym():
        os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)
        return
    for key, value in m.pax_headers.items():
        if not key.startswith(XATTR_PREFIX):
            continue
        name = key[len(XATTR_PREFIX):]
        if xattr_kept(name):
            _set_xattr(path, name, value.encode("utf-8", "surrogateescape"))
    os.chmod(path, m.mode & MODE_BITS)
    if not m.isdir():
        os.utime(path, (m.mtime, m.mtime))


def _set_xattr(path: Path, name: str, value: bytes) -> None:
    """One xattr of an entry. ENOSPC here is mostly the file system's room
    for one file's xattrs (ext4: about one block, unless ea_inode) rather
    than a full disk: the error says which xattr did not fit and what to do."""
    try:
        os.setxattr(path, name, value, follow_symlinks=False)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        raise OSError(errno.ENOSPC, f"xattr {name} of {len(value)} bytes does not fit on the scratch file "
                      "system: it is full, or (ext4 holds about one block of xattrs per file) the file's "
                      "xattrs are too large for it; leave the file out of the snapshot (`dsec snapshot "
                      "--exclude PATH`), or put daemon.state_dir on a file system that holds larger xattrs "
                      "(xfs, or ext4 with ea_inode)", str(path)) from err
