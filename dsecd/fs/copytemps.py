"""The temporary names copies make inside a sandbox, recorded while they exist.

An atomic write (the SDK's write_file, `dsec cp FILE SB:...`) writes a
`.dsec-<hex>` file beside its target and renames it over the target; a
directory copy extracts into a `.dsec-put-<hex>` directory and renames it
into place. A daemon killed in between leaves that name in the sandbox,
and nobody else knows it is ours. So each is recorded here (a small file
in the state dir, naming the sandbox, the path and the inode made) while
it exists, and the next daemon removes what the records name once it has
re-adopted their sandboxes. A path is removed only if it still has the
device and inode number recorded: not a user's file that took the
(random) name meanwhile, nor one of a similar name. A microVM's are its
guest's numbers, which its agent reports (engine/files.py). A write's record
also serves while the daemon runs: the client that made the temporary
gone before its rename, the daemon removes it then (engine/files.py).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from pathlib import Path

from . import files

DIR = "copy-temps"

log = logging.getLogger(__name__)


class CopyTemps:
    """The records under `top` (state_dir/copy-temps). add/drop/load block:
    call them from a worker, or from the loop (a small file each)."""

    def __init__(self, top: Path):
        self.top = Path(top)
        self._made = False          # top made by this process (once, not per record)

    def add(self, sb_id: str, path: str, st: os.stat_result) -> Path:
        return self.add_ids(sb_id, path, st.st_dev, st.st_ino)

    def add_ids(self, sb_id: str, path: str, dev: int, ino: int) -> Path:
        """add, by the device and inode numbers (a microVM's: its guest's)."""
        if not self._made:
            self.top.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._made = True
        rec = self.top / f"{sb_id}.{secrets.token_hex(8)}.json"
        tmp = rec.with_suffix(".part")
        tmp.write_text(json.dumps({"sandbox": sb_id, "path": path, "dev": dev, "ino": ino}))
        os.replace(tmp, rec)
        return rec

    def record(self, sb_id: str, path: str, st: os.stat_result) -> Path | None:
        """add, or None when the record cannot be written (the state dir's
        disk full): the copy goes on, only a crash would leave its temporary."""
        return self.record_ids(sb_id, path, st.st_dev, st.st_ino)

    def record_ids(self, sb_id: str, path: str, dev: int, ino: int) -> Path | None:
        """record, by the device and inode numbers."""
        try:
            return self.add_ids(sb_id, path, dev, ino)
        except OSError as err:
            log.warning("cannot record %s:%s, the temporary of a copy, in %s: %s; a daemon killed before the "
                        "copy ends will leave it", sb_id, path, self.top, err)
            return None

    def drop(self, rec: Path) -> None:
        rec.unlink(missing_ok=True)

    def load(self) -> list[tuple[Path, dict | None]]:
        """Every record (None: one that cannot be read), and no half-written ones."""
        out: list[tuple[Path, dict | None]] = []
        try:
            names = sorted(os.listdir(self.top))
        except FileNotFoundError:
            return out
        for name in names:
            path = self.top / name
            if not name.endswith(".json"):
                path.unlink(missing_ok=True)
                continue
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                rec = None
            out.append((path, rec if _well_formed(rec) else None))
        return out


def _well_formed(rec) -> bool:
    """Whether a loaded record has the fields add writes, of their types (a
    damaged one must not stop the daemon's start)."""
    return (isinstance(rec, dict) and isinstance(rec.get("sandbox"), str) and isinstance(rec.get("path"), str)
            and isinstance(rec.get("dev"), int) and isinstance(rec.get("ino"), int))


def remove_if_same(rootfd: int, path: str, dev: int, ino: int) -> bool:
    """Remove `path` of the sandbox (a directory with all it holds) if it is
    still inode (dev, ino); whether it was removed."""
    parent, name = files._split(files.check_path(path))
    try:
        pfd = files._open(rootfd, parent, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) != (dev, ino):
            return False
        files._remove_at(pfd, name, stat.S_ISDIR(st.st_mode), path)
        return True
    finally:
        os.close(pfd)
