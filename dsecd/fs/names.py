"""Image names: local names and registry references, and the ref file of each.

Two kinds of name, told apart by their characters:

    local name   busybox, repo-1-built            1-128 of [A-Za-z0-9._-], first a letter
                                                  or digit: what `image build` has always
                                                  taken; no '/', ':' or '@'
    reference    python:3.11                      [registry/]repository[:tag][@sha256:<64 hex>]
                 ghcr.io/org/app@sha256:<hex>     the grammar of every container tool

A reference is normalized the way docker and podman do it: without a
registry (its first component has no '.' or ':' and is not `localhost`) it
is on images.default_registry, where docker.io puts a one-component
repository under `library/`; without a tag or digest it is `:latest`; with
both, the digest alone names it (the tag is ignored, as when pulling). So
`python:3.11`, `library/python:3.11` and `docker.io/library/python:3.11`
are one image, stored once under its canonical form.

Ref files (store.py's `refs/`): a local name is `refs/<name>`, as before; a
reference is `refs/_repos/<registry>/<repository path>/:<tag>` or
`.../@sha256:<hex>`. No local name starts with '_', so `_repos` never
collides with one; no repository component starts with ':' or '@', so a
tag file never collides with a nested repository's directory; and no
component is '.' or '..' (the grammar starts each with a letter or digit),
so a name never reaches outside `refs/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

LOCAL_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,127}\Z")
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
DOMAIN_RE = re.compile(rf"^{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?\Z")
PATH_PART_RE = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*\Z")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
MAX_REPOSITORY = 255          # registry + repository, as docker's reference grammar bounds it
REPOS_DIR = "_repos"          # under refs/: the references' tree

GRAMMAR = ("a local name (1-128 of [A-Za-z0-9._-], starting with a letter or digit) or a reference "
           "[registry[:port]/]path[:tag][@sha256:<64 hex>], path = lowercase components of "
           "[a-z0-9] joined by '.', '_', '__' or '-', separated by '/'; tag = 1-128 of [A-Za-z0-9_.-] "
           "not starting with '.' or '-'")


class BadName(ValueError):
    """A name that fits neither grammar; the message says which part and the grammar."""


@dataclass(frozen=True)
class ImageName:
    """A parsed name. `registry` is None for a local name (then `repository`
    is the name itself)."""

    repository: str
    registry: str | None = None
    tag: str | None = None
    digest: str | None = None

    @property
    def local(self) -> bool:
        return self.registry is None

    @property
    def repo(self) -> str:
        """registry/repository: what a registry client is given, without tag or digest."""
        return self.repository if self.local else f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        if self.local:
            return self.repository
        if self.digest:
            return f"{self.repo}@{self.digest}"
        return f"{self.repo}:{self.tag}"

    def ref_path(self, refs: Path) -> Path:
        """The ref file of this name under `refs`."""
        if self.local:
            return refs / self.repository
        leaf = f"@{self.digest}" if self.digest else f":{self.tag}"
        return refs.joinpath(REPOS_DIR, self.registry, *self.repository.split("/"), leaf)


def _bad(name: str, why: str) -> BadName:
    return BadName(f"bad image name {name!r}: {why}; an image name is {GRAMMAR}")


def parse(name: str, default_registry: str = "docker.io") -> ImageName:
    """The name `name` stands for (see the module docstring); BadName if it fits no grammar."""
    if not isinstance(name, str) or not name:
        raise _bad(str(name), "it is empty")
    if not any(c in name for c in "/:@"):
        if LOCAL_RE.match(name):
            return ImageName(repository=name)
        raise _bad(name, "a local name has only [A-Za-z0-9._-] (at most 128), starting with a letter or digit")
    rest, digest = name, None
    if "@" in rest:
        rest, _, digest = rest.partition("@")
        if not DIGEST_RE.match(digest):
            raise _bad(name, f"the digest {digest!r} is not sha256:<64 lowercase hex digits>")
    tag = None
    last = rest.rpartition("/")[2]
    if ":" in last:                          # a ':' after the last '/' starts a tag; before it, a port
        rest, _, tag = rest.rpartition(":")
        if not TAG_RE.match(tag):
            raise _bad(name, f"the tag {tag!r} is not 1-128 of [A-Za-z0-9_.-] starting with a letter, "
                       "digit or '_'")
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
        if not DOMAIN_RE.match(registry):
            raise _bad(name, f"the registry {registry!r} is not a host name with an optional :port")
    else:
        registry, path = default_registry, rest
        if registry == "docker.io" and "/" not in path:
            path = f"library/{path}"
    if not path:
        raise _bad(name, "it names no repository")
    for part in path.split("/"):
        if not PATH_PART_RE.match(part):
            raise _bad(name, f"the path component {part!r} is not lowercase [a-z0-9] words joined by "
                       "'.', '_', '__' or '-'")
    if len(registry) + 1 + len(path) > MAX_REPOSITORY:
        raise _bad(name, f"registry and repository are longer than {MAX_REPOSITORY} characters")
    if digest:
        tag = None                           # the digest alone names the image
    elif tag is None:
        tag = "latest"
    return ImageName(repository=path, registry=registry, tag=tag, digest=digest)


def from_ref_path(rel: PurePosixPath) -> str | None:
    """The name of the ref file at `rel` (relative to refs/), or None when
    `rel` is no ref file of either kind (a temp file, a stray entry)."""
    parts = rel.parts
    if len(parts) == 1:
        return parts[0] if LOCAL_RE.match(parts[0]) else None
    if len(parts) < 4 or parts[0] != REPOS_DIR or not DOMAIN_RE.match(parts[1]):
        return None
    path, leaf = parts[2:-1], parts[-1]
    if not all(PATH_PART_RE.match(p) for p in path):
        return None
    if leaf.startswith(":") and TAG_RE.match(leaf[1:]):
        return str(ImageName("/".join(path), parts[1], tag=leaf[1:]))
    if leaf.startswith("@") and DIGEST_RE.match(leaf[1:]):
        return str(ImageName("/".join(path), parts[1], digest=leaf[1:]))
    return None
