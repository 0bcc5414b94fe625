"""An image's layers merged into one directory tree, as its overlay shows them.

`image_flatten` makes one layer of a deep image (a long chain of snapshots
of snapshots): its layers, each mounted (fs/layers.py), are copied into a
scratch directory bottom first, each applied over the ones below as
overlayfs stacks them, and mkfs.erofs packs the result. No overlay is
mounted for it, so no limit on how many layers one mount takes applies:
an image too deep for a sandbox (its overlay options past a page) is
flattened all the same.

Applying a layer, for each of its entries (a directory before what it
holds):
  * a whiteout (a 0:0 character device) removes the path below it;
  * a directory with the opaque xattr hides what the layers below hold in
    it: its contents so far are removed first;
  * a directory is merged into the one below (its owner, mode and xattrs
    replace that one's), anything else replaces the path.
Owners, modes, xattrs (overlay's own `trusted.overlay.*` left out: they
describe how a layer was made, not a file of the image; a nested overlay's,
escaped as `trusted.overlay.overlay.*`, are kept: the sandbox's overlay
shows them as `trusted.overlay.*` and acts on none of them), symlinks, device
nodes, fifos and hard links within a layer are kept. mtimes are not:
mkfs.erofs writes every layer with timestamp 0 (fs/erofs.py).

measure() walks the layers' file listings alone, as merge() applies them,
for what it would write, at the end and at most at once: the room and the
inodes a flatten checks first.

Overlay bookkeeping the merge does not reproduce is refused (Unsupported):
a redirect (overlayfs follows one in a lower layer, redirect_dir=follow,
merging another directory's contents in), a metacopy (the file's data is
that of the same file in a layer below), and the whiteouts kept as xattrs
(a file marked trusted.overlay.whiteout in a directory whose opaque mark is
"x", which overlayfs hides). No layer dsecd makes holds them: a container's
overlay is mounted redirect_dir=follow,metacopy=off whatever the host's
overlay module defaults to (native.ContainerSpec.overlay_options), so the
upper dir a snapshot or a build step packs has none; a microVM's layer
leaves overlay's trusted.overlay.* but the opaque mark out (the guest
agent's tar_xattr_kept); a pulled or imported OCI layer marks what it
removes with whiteout files, not xattrs, and keeps none of its tar's
xattrs (csrc/tarerofs.c, oci._Unpacker). Only a layer built from a host
directory (image_build of a root file system directory: mkfs.erofs keeps
its xattrs) can, one that was another overlay's upper dir. The
user.overlay.* equivalents (an overlay mounted userxattr) are plain xattrs
to a sandbox's overlay, which is not mounted so: kept as any.

Blocking: call it from a worker thread.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OVERLAY_XATTRS = "trusted.overlay."
# overlayfs (Linux >= 6.7) stores a trusted.overlay.* xattr written through an
# overlay (a nested overlay's) as this, and shows it without the escape.
ESCAPED_XATTRS = "trusted.overlay.overlay."
OPAQUE = "trusted.overlay.opaque"
PROGRESS_EVERY_S = 0.2
CHUNK = 1 << 20


# What overlayfs acts on in a lower layer that the merge does not do.
UNSUPPORTED = {"trusted.overlay.redirect": "a redirect (a renamed directory)",
               "trusted.overlay.metacopy": "a metacopy (a file whose data is below)",
               "trusted.overlay.whiteout": "a whiteout kept as an xattr"}


class Cancelled(Exception):
    """The merge saw its `cancelled` event set: the tree is incomplete."""


class Unsupported(Exception):
    """A layer holds overlay bookkeeping the merge does not reproduce;
    `layer`: which (1-based, bottom first)."""

    def __init__(self, message: str, layer: int):
        super().__init__(message)
        self.layer = layer


class TooLarge(Exception):
    """The merged tree's files came to more than the merge's `max_bytes`."""

    def __init__(self, total: int, max_bytes: int, path: str, layer: int, of: int):
        super().__init__(f"layer {layer} of {of} brings the merged tree's files to {total} bytes at {path}")
        self.total, self.max_bytes, self.path, self.layer, self.of = total, max_bytes, path, layer, of


class NoRoom(Exception):
    """The next file would not fit in what `room()` says is free."""

    def __init__(self, need: int, free: int, path: str, written: int):
        super().__init__(f"{path} ({need} bytes) does not fit in the {max(0, free)} bytes free to write "
                         f"after {written} bytes of the merged tree")
        self.need, self.free, self.path, self.written = need, free, path, written


@dataclass
class Footprint:
    """What merge() of some layers would write, as measure() counts it."""
    files: int = 0          # regular files, each once (a file of several names once)
    data: int = 0           # their apparent bytes
    data_blocks: int = 0    # their bytes in whole BLOCKs
    dirs: int = 0
    entries: int = 0        # names of all kinds, the root left out
    # The most the tree holds at once while merge() writes it: more than
    # the finished tree when a layer removes what the layers below wrote.
    most_entries: int = 0
    most_tree_bytes: int = 0

    def tree_bytes(self) -> int:
        """About what the merged tree takes on the scratch dir's file system:
        its files in whole blocks, a block for each directory (ext4's, xfs's
        for a small one; tmpfs takes none)."""
        return self.data_blocks + self.dirs * BLOCK

    def note_most(self) -> None:
        """The tree holds what the counts say now: keep the most."""
        self.most_entries = max(self.most_entries, self.entries)
        self.most_tree_bytes = max(self.most_tree_bytes, self.tree_bytes())

    def layer_bytes(self) -> int:
        """About the EROFS layer mkfs.erofs packs of it: every file's data in
        whole blocks (fs/erofs.py writes them -Enoinline_data), and
        ENTRY_BYTES for each entry's inode, dirent and name."""
        return self.data_blocks + self.entries * ENTRY_BYTES


# The block files take on the scratch dir's file system (ext4's, xfs's, a
# tmpfs page) and in an EROFS layer (fs/erofs.py's mkfs.erofs).
BLOCK = 4096
# An EROFS entry's metadata above its data blocks: mkfs.erofs -Enoinline_data
# of /usr/include, /usr/share/doc and /usr/lib/python3.11 took 59-65 bytes an
# entry (its inode, dirent and name); twice that for names longer and xattrs.
ENTRY_BYTES = 128


class _Bookkeeping(Exception):
    """_attrs met one of UNSUPPORTED (or an "x" opaque mark): its name."""


def merge(layers: list[str], dest: Path, progress: Callable[[dict], None] | None = None,
          cancelled: threading.Event | None = None, max_bytes: int = 0,
          room: Callable[[], int] | None = None) -> None:
    """Apply the layer trees `layers` (bottom first) into `dest`, a new
    directory. Progress: {"step": "merge", "layer", "of", "entries",
    "bytes"} (of the layer being applied, 1-based; entries and bytes copied
    so far in all), at most every PROGRESS_EVERY_S.

    `max_bytes` (0: none) bounds the apparent size of the files the tree
    holds (a file of several names once; a file a later layer replaces or
    removes no longer counts): TooLarge as soon as one copied would take it
    past, before it is written, as the tree is the flat layer mkfs.erofs
    packs. `room()` (None: not asked) gives the bytes the tree may still
    take on its file system: NoRoom before a file that would not fit is
    written (a copy is written whole, sparse or not)."""
    dest.mkdir(mode=0o700)
    state = _State(len(layers), progress, cancelled, max_bytes, room)
    for n, top in enumerate(layers, 1):
        state.layer = n
        _apply(Path(top), dest, state)
    state.report(force=True)


def measure(layers: list[str], progress: Callable[[dict], None] | None = None,
            cancelled: threading.Event | None = None) -> Footprint:
    """What merge(layers) would write, from the layers' metadata alone (no
    data read, nothing written): the finished tree, and the most it holds
    at once while it is written, names (an inode each on the scratch dir's
    file system: a hard link's extra name takes none on ext4 or xfs but one
    on tmpfs, which charges each link) and bytes.

    The most at once is more than the finished tree when a layer removes
    what the layers below wrote: merge writes those first, and a layer's
    new files before its whiteouts (or a directory or file it puts over a
    directory below) remove older ones next to them, when they sort first.
    (merge writes no whiteout, and removes a file a layer replaces just
    before its copy is written: a replacement adds nothing.) So this walks
    the layers as merge applies them, bottom first, a directory's entries
    by name and each directory's after its parent's, adding and removing
    what merge does, and notes the counts after each entry: merge's own
    peak. Walks every entry of every layer, what a layer above hides too;
    holds the tree merged so far in memory meanwhile. Progress: {"step":
    "measure", "layer", "of", "entries"} (the layer being walked, 1-based,
    and the names of the tree so far), at most every PROGRESS_EVERY_S;
    Cancelled as merge."""
    tree: dict = {}                 # name -> dict (a directory) or _Leaf
    out = Footprint()
    last = 0.0
    of = len(layers)
    for n, top in enumerate(layers, 1):
        if _opaque(top):
            _drop_under(tree, out)
        linked: dict[tuple[int, int], _Leaf] = {}     # as _apply's: a file with more names in this layer
        stack = [(tree, top)]
        while stack:
            node, src_dir = stack.pop()
            with os.scandir(src_dir) as entries:
                for entry in sorted(entries, key=lambda e: e.name):
                    _measure_entry(entry, node, stack, linked, out)
                    out.note_most()
                    if cancelled is not None and cancelled.is_set():
                        raise Cancelled()
                    now = time.monotonic()
                    if progress is not None and now - last >= PROGRESS_EVERY_S:
                        last = now
                        progress({"step": "measure", "layer": n, "of": of, "entries": out.entries})
    return out


class _Leaf:
    """A non-directory of measure's tree: its size, whether it is a regular
    file (its bytes counted), and how many names it has there."""
    __slots__ = ("size", "regular", "names")

    def __init__(self, size: int, regular: bool):
        self.size, self.regular, self.names = size, regular, 1


def _measure_entry(entry: os.DirEntry, node: dict, stack: list, linked: dict, out: Footprint) -> None:
    """What _apply_entry does with `entry`, done to measure's `node` (its
    directory) and counts `out`; a directory pushed on `stack` as _apply
    does."""
    st = entry.stat(follow_symlinks=False)
    below = node.get(entry.name)
    if stat.S_ISDIR(st.st_mode) and isinstance(below, dict):     # merged into
        if _opaque(entry.path):
            _drop_under(below, out)
        stack.append((below, entry.path))
        return
    if below is not None:                   # replaced or removed, before anything is written
        _drop(below, out)
        del node[entry.name]
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:        # a whiteout
        return
    out.entries += 1
    if stat.S_ISDIR(st.st_mode):
        out.dirs += 1
        node[entry.name] = {}
        stack.append((node[entry.name], entry.path))
        return
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in linked:   # another name of a file this layer wrote
        leaf = node[entry.name] = linked[key]
        leaf.names += 1
        return
    leaf = node[entry.name] = _Leaf(st.st_size, stat.S_ISREG(st.st_mode))
    if leaf.regular:
        out.files += 1
        out.data += st.st_size
        out.data_blocks += _blocks(st.st_size)
    if st.st_nlink > 1:
        linked[key] = leaf


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _drop(value, out: Footprint) -> None:
    """A name of measure's tree removed, and what it holds: off the counts
    (a file's bytes once its last name goes)."""
    stack = [value]
    while stack:
        value = stack.pop()
        out.entries -= 1
        if isinstance(value, dict):
            out.dirs -= 1
            stack.extend(value.values())
            continue
        value.names -= 1
        if value.names == 0 and value.regular:
            out.files -= 1
            out.data -= value.size
            out.data_blocks -= _blocks(value.size)


def _drop_under(node: dict, out: Footprint) -> None:
    """What the directory `node` of measure's tree holds, removed."""
    for value in node.values():
        _drop(value, out)
    node.clear()


class _State:
    def __init__(self, of: int, progress, cancelled, max_bytes: int = 0, room=None):
        self.of, self.layer = of, 0
        self.entries = self.bytes = 0
        self.progress, self.cancelled = progress, cancelled
        self.last = 0.0
        self.max_bytes, self.room = max_bytes, room
        self.live = 0         # apparent bytes of the files the tree holds now, each once

    def adding(self, size: int, path: str) -> None:
        """A copy of `size` bytes is about to be written at `path`."""
        if self.max_bytes and self.live + size > self.max_bytes:
            raise TooLarge(self.live + size, self.max_bytes, path, self.layer, self.of)
        if self.room is not None and size:
            free = self.room()
            if size > free:
                raise NoRoom(size, free, path, self.bytes)
        self.live += size

    def tick(self, copied: int = 0) -> None:
        self.entries += 1
        self.bytes += copied
        if self.cancelled is not None and self.cancelled.is_set():
            raise Cancelled()
        self.report()

    def report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.progress is not None and (force or now - self.last >= PROGRESS_EVERY_S):
            self.last = now
            self.progress({"step": "merge", "layer": self.layer, "of": self.of, "entries": self.entries,
                           "bytes": self.bytes})


def _apply(top: Path, dest: Path, state: _State) -> None:
    """One layer's tree over `dest`."""
    linked: dict[tuple[int, int], str] = {}      # (dev, ino) of a file with more names -> its copy
    st = os.lstat(top)
    try:
        _attrs(str(top), str(dest), st)
    except _Bookkeeping as err:
        raise _unsupported(state, "/", str(err)) from None
    if _opaque(str(top)):
        state.live -= _clear(str(dest))
    stack = [("", str(top))]
    while stack:
        rel, src_dir = stack.pop()
        with os.scandir(src_dir) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                try:
                    _apply_entry(entry, rel, dest, stack, linked, state)
                except _Bookkeeping as err:
                    raise _unsupported(state, "/" + os.path.join(rel, entry.name), str(err)) from None


def _unsupported(state: _State, path: str, name: str) -> Unsupported:
    what = UNSUPPORTED.get(name, 'a mark of whiteouts kept as xattrs (opaque "x")')
    return Unsupported(f"layer {state.layer} of {state.of} has overlay's {name} on {path}, {what}: "
                       "flattening does not reproduce it (what a sandbox of the image shows would change). "
                       "No layer dsecd makes has one: this one was built from a host directory that was "
                       "another overlay's upper dir; build it from what that overlay shows (its mount) "
                       "instead", state.layer)


def _apply_entry(entry: os.DirEntry, rel: str, dest: Path, stack: list, linked: dict, state: _State) -> None:
    """One entry of a layer's directory `rel` over `dest`."""
    src = entry.path
    out = os.path.join(dest, rel, entry.name)
    st = os.lstat(src)
    copied = 0
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:        # a whiteout
        state.live -= _remove(out)
    elif stat.S_ISDIR(st.st_mode):
        if not os.path.isdir(out) or os.path.islink(out):
            state.live -= _remove(out)
            os.mkdir(out, 0o700)
        elif _opaque(src):
            state.live -= _clear(out)
        _attrs(src, out, st)
        stack.append((os.path.join(rel, entry.name), src))
    else:
        state.live -= _remove(out)
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in linked:
            os.link(linked[key], out)
        else:
            if stat.S_ISREG(st.st_mode):
                state.adding(st.st_size, "/" + os.path.join(rel, entry.name))
            copied = _copy(src, out, st)
            if st.st_nlink > 1:
                linked[key] = out
    state.tick(copied)


def _copy(src: str, out: str, st: os.stat_result) -> int:
    """A non-directory entry: its copy at `out` (absent), with its owner,
    mode and xattrs. Returns the data bytes copied."""
    copied = 0
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), out)
    elif stat.S_ISREG(st.st_mode):
        fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                while n := os.sendfile(fd_out, fd_in, None, CHUNK):
                    copied += n
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)
    else:                                   # a device, fifo or socket
        os.mknod(out, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev)
    _attrs(src, out, st)
    return copied


def _attrs(src: str, out: str, st: os.stat_result) -> None:
    """Owner, then mode (a chown clears set-id bits), then xattrs: those of
    `src` replace whatever `out` had."""
    os.chown(out, st.st_uid, st.st_gid, follow_symlinks=False)
    link = stat.S_ISLNK(st.st_mode)
    if not link:
        os.chmod(out, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(out, follow_symlinks=False):
        os.removexattr(out, name, follow_symlinks=False)
    for name in os.listxattr(src, follow_symlinks=False):
        if name in UNSUPPORTED or (name == OPAQUE and _opaque_mark(src) == b"x"):
            raise _Bookkeeping(name)
        if not name.startswith(OVERLAY_XATTRS) or name.startswith(ESCAPED_XATTRS):
            os.setxattr(out, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)


def _opaque_mark(path: str) -> bytes | None:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False)
    except OSError:
        return None


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: str) -> int:
    """Remove whatever is at `path`, a tree included; nothing there is
    fine. Returns the apparent bytes of the files that went with it (those
    with a name left elsewhere in the tree stay)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        freed = _tree_bytes(path)
        shutil.rmtree(path)
        return freed
    os.unlink(path)
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def _tree_bytes(top: str) -> int:
    """The apparent bytes of the regular files under `top` that have no
    name outside it."""
    names: dict[tuple[int, int], list] = {}       # (dev, ino) -> [names under top, nlink, size]
    for root, _dirs, files in os.walk(top):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode):
                names.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])[0] += 1
    return sum(size for n, nlink, size in names.values() if n >= nlink)


def _clear(path: str) -> int:
    """Remove what the directory `path` holds (the layers below an opaque
    one); the apparent bytes freed, as _remove counts them."""
    freed = _tree_bytes(path)
    with os.scandir(path) as entries:
        for entry in list(entries):
            _remove(entry.path)
    return freed
