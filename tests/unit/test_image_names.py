"""Image names (dsecd/fs/names.py): local names, references, ref file paths."""

from pathlib import Path, PurePosixPath

import pytest

from dsecd.fs import names

HEX = "0123456789abcdef" * 4


@pytest.mark.parametrize("given, canonical", [
    ("busybox", "busybox"),
    ("Repo-1.built_x", "Repo-1.built_x"),
    ("python:3.11", "docker.io/library/python:3.11"),
    ("python", "python"),                                # no '/', ':' or '@': a local name
    ("library/python:3.11", "docker.io/library/python:3.11"),
    ("team/app", "docker.io/team/app:latest"),
    ("docker.io/library/python:3.11", "docker.io/library/python:3.11"),
    ("ghcr.io/org/sub/app:v1.2-rc_3", "ghcr.io/org/sub/app:v1.2-rc_3"),
    ("localhost/app", "localhost/app:latest"),
    ("localhost:5000/a/b", "localhost:5000/a/b:latest"),
    ("127.0.0.1:5000/a__b/c-d.e:t", "127.0.0.1:5000/a__b/c-d.e:t"),
    (f"app@sha256:{HEX}", f"docker.io/library/app@sha256:{HEX}"),
    (f"quay.io/x/app:1@sha256:{HEX}", f"quay.io/x/app@sha256:{HEX}"),    # the digest alone names it
])
def test_canonical_forms(given, canonical):
    name = names.parse(given)
    assert str(name) == canonical
    assert str(names.parse(canonical)) == canonical                      # stable
    rel = PurePosixPath(name.ref_path(Path("/refs")).relative_to("/refs"))
    assert names.from_ref_path(rel) == canonical


def test_another_default_registry():
    assert str(names.parse("python:3.11", "registry.local:5000")) == "registry.local:5000/python:3.11"


@pytest.mark.parametrize("bad, why", [
    ("", "empty"), ("-x", "local name"), ("a" * 129, "local name"), ("x y", "local name"),
    ("Team/App", "path component 'Team'"), ("a/../b", "path component '..'"), ("a//b", "path component ''"),
    ("../x", "registry '..'"), ("a:b:c", "path component 'a:b'"), ("x:.tag", "tag '.tag'"),
    ("x@sha256:12", "digest"), (f"x@md5:{HEX}", "digest"), ("/abs", "no repository|path component"),
    ("a/b_", "path component 'b_'"), ("r.io/" + "a" * 260, "longer than 255"),
    # A name read from a file keeps its newline: it is not the name without one.
    ("app\n", "local name"), ("app:v1\n", "tag"), ("r.io\n/app", "registry"),
    ("app/x\n", "path component"), (f"app@sha256:{HEX}\n", "digest"), ("app:t\u00fcg", "tag"),
])
def test_bad_names_say_what_and_the_grammar(bad, why):
    with pytest.raises(names.BadName, match=why) as info:
        names.parse(bad)
    assert "an image name is a local name" in str(info.value)


def test_ref_paths_never_leave_refs_or_collide_with_local_names():
    refs = Path("/refs")
    local = names.parse("docker.io").ref_path(refs)          # a legal local name
    remote = names.parse("docker.io/x:1").ref_path(refs)
    assert local == refs / "docker.io" and remote.parts[2] == names.REPOS_DIR
    assert not names.LOCAL_RE.match(names.REPOS_DIR)
    nested = names.parse("r.io/a:1").ref_path(refs), names.parse("r.io/a/b:1").ref_path(refs)
    assert nested[0].parent in nested[1].parents and nested[0] not in nested[1].parents
    assert names.from_ref_path(PurePosixPath("_repos/r.io/a/stray.tmp")) is None
    assert names.from_ref_path(PurePosixPath(".hidden")) is None


def test_an_image_made_here_is_not_named_by_a_digest(tmp_path):
    """A digest names the image a registry serves under it: a build, import
    or snapshot given such a name is refused (it would claim a digest its
    content does not have), a name or name:tag is taken."""
    from dsecd.fs.images import ImageError, ImageStore

    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    assert store.new_name("team/app:1") == "docker.io/team/app:1"
    assert store.new_name("app") == "app"
    for name in (f"app@sha256:{HEX}", f"quay.io/x/app:1@sha256:{HEX}"):
        with pytest.raises(ImageError, match=r"has a digest .*NAME or NAME:TAG") as err:
            store.new_name(name)
        assert err.value.code == "bad_request"
