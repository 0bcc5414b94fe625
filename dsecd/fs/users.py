"""A user spec ("app", "1000", "app:staff", "1000:1000") resolved to ids
against an image's /etc/passwd and /etc/group, as `docker run --user` does.

    ""          root: uid 0, gid 0 (no file is read)
    "app"       uid, primary gid and home of app's line in /etc/passwd;
                supplementary groups: that gid and every /etc/group line
                listing app among its members
    "1000"      uid 1000; gid, home and groups from /etc/passwd's line for
                uid 1000 (by its name) if there is one, else gid 1000 and no
                groups (docker would give gid 0; a group of root is more than
                an unknown user should get)
    "app:staff" app's uid, the gid of staff in /etc/group, no other groups
    "1000:50"   exactly these ids: numeric ids need no entry, no groups

Supplementary groups follow runc's rules (libcontainer/user GetExecUser):
only a user found in /etc/passwd whose spec names no group gets them; its
primary gid is among them, as initgroups(3) makes it. Root by default ("")
gets none: no file is read for the common case of a create, and root's
capabilities in its sandbox pass the group checks anyway.

`resolve` takes the files' text; `read_account_file` reads one through a
sandbox's root (dsecd/fs/files.py: its symlinks stay inside), in a worker
thread, before anything ran in the sandbox, so the image's own file.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..imageconfig import ConfigError, is_id, parse_user
from ..native import MAX_GROUPS
from . import files

# Bytes of /etc/passwd or /etc/group read at most: an account database of
# thousands of lines fits; a larger one is read in part.
MAX_ACCOUNT_FILE = 1 << 20


class UserError(ValueError):
    """The spec names a user or group the image does not have. The message
    speaks of "the image"; the caller names it."""


@dataclass(frozen=True)
class ProcessIds:
    """The ids a process runs with, in its sandbox's user namespace."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()     # supplementary gids (setgroups)


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    home: str | None = None      # the user's home directory from /etc/passwd, if it has a line there
    groups: tuple[int, ...] = ()   # supplementary gids: see the module's docstring

    @property
    def ids(self) -> ProcessIds:
        return ProcessIds(self.uid, self.gid, self.groups)


@dataclass(frozen=True)
class _Entry:
    name: str
    uid: int
    gid: int
    home: str


def _lines(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def parse_passwd(text: str) -> list[_Entry]:
    """The entries of a passwd file (name:password:uid:gid:gecos:home:shell);
    malformed lines are skipped, as getpwnam skips them."""
    out = []
    for f in _lines(text):
        if len(f) >= 4 and is_id(f[2]) and is_id(f[3]):
            out.append(_Entry(f[0], int(f[2]), int(f[3]), f[5] if len(f) > 5 else ""))
    return out


def parse_group(text: str) -> dict[str, int]:
    """Group name -> gid of a group file (name:password:gid:members); the first line of a name wins."""
    out: dict[str, int] = {}
    for f in _lines(text):
        if len(f) >= 3 and is_id(f[2]):
            out.setdefault(f[0], int(f[2]))
    return out


def member_gids(text: str, name: str) -> list[int]:
    """The gids of the group file's lines that list `name` among their members."""
    return [int(f[2]) for f in _lines(text)
            if len(f) >= 4 and is_id(f[2]) and name in f[3].strip().split(",")]


def files_needed(spec: str) -> tuple[bool, bool]:
    """(passwd, group): which files resolving `spec` reads (/etc/group for a
    named group, and for the supplementary groups of a user without one)."""
    user, group = parse_user(spec)
    if not user:
        return False, False
    return True, group is None or not is_id(group)


def supplementary(entry: _Entry, group: str | None) -> tuple[int, ...]:
    """The supplementary gids of a user found in /etc/passwd whose spec names
    no group: its primary gid and the groups listing it, sorted. UserError
    past native.MAX_GROUPS, which setgroups would refuse in every exec."""
    gids = sorted({entry.gid, *member_gids(group or "", entry.name)})
    if len(gids) > MAX_GROUPS:
        raise UserError(f"user {entry.name!r} is in {len(gids)} groups of /etc/group; a process may have at "
                        f"most {MAX_GROUPS}: name a group (user:group) to run it with that one only")
    return tuple(gids)


def resolve(spec: str, passwd: str | None, group: str | None, holder: str = "the image") -> Identity:
    """`spec` -> ids, with the /etc/passwd and /etc/group text of `holder`
    (the image, or a sandbox as it is now; None: it has no such file).
    ConfigError for a malformed spec, UserError for a name the files do
    not have, whose advice names `holder`."""
    user, grp = parse_user(spec)
    if not user:
        return Identity(0, 0, None)
    entries = parse_passwd(passwd or "")
    if is_id(user):
        uid = int(user)
        entry = next((e for e in entries if e.uid == uid), None)
    else:
        entry = next((e for e in entries if e.name == user), None)
        if entry is None:
            where = "it has no /etc/passwd" if passwd is None else "its /etc/passwd has no such user"
            raise UserError(f"no user {user!r}: {where}; give a numeric uid[:gid], or add the user "
                            f"to {holder}")
        uid = entry.uid
    groups: tuple[int, ...] = ()
    if grp is None:
        gid = entry.gid if entry is not None else uid
        if entry is not None:
            groups = supplementary(entry, group)
    elif is_id(grp):
        gid = int(grp)
    else:
        by_name = parse_group(group or "")
        if grp not in by_name:
            where = "it has no /etc/group" if group is None else "its /etc/group has no such group"
            raise UserError(f"no group {grp!r}: {where}; give a numeric gid, or add the group to "
                            f"{holder}")
        gid = by_name[grp]
    home = entry.home if entry is not None and entry.home else None
    return Identity(uid, gid, home, groups)


def read_account_file(rootfd: int, path: str) -> str | None:
    """The text of /etc/passwd or /etc/group under a sandbox's root (its first
    MAX_ACCOUNT_FILE bytes), None if the image has none or it is no regular
    file. Blocking."""
    try:
        data = files.read_file(rootfd, path, 0, MAX_ACCOUNT_FILE)["data"]
    except (FileNotFoundError, NotADirectoryError, files.PathError):
        return None
    return data.decode("utf-8", "replace")


__all__ = ["ConfigError", "Identity", "MAX_ACCOUNT_FILE", "ProcessIds", "UserError", "files_needed",
           "member_gids", "parse_group", "parse_passwd", "read_account_file", "resolve"]
