"""Image names (dsecd/fs/images.py): the parsed ref is cached per name but
never stale, also when another daemon on the same store changes it (no root;
needs mkfs.erofs)."""

from __future__ import annotations

import shutil

import pytest

from dsecd.fs.images import ImageError, ImageStore

pytestmark = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs erofs-utils")


def _src(tmp_path, name: str, text: str):
    d = tmp_path / name
    d.mkdir()
    (d / "f").write_text(text)
    return str(d)


def test_a_name_removed_and_rebuilt_elsewhere_is_seen_at_once(tmp_path):
    store = tmp_path / "store"
    here, there = ImageStore(store, tmp_path / "s1"), ImageStore(store, tmp_path / "s2")
    first = here.build_from_dir(_src(tmp_path, "a", "one"), "img")
    assert here.get("img").manifest == first.manifest
    assert here.get("img").manifest == first.manifest        # served from the cache
    there.remove("img")                                      # another daemon on the same store
    with pytest.raises(ImageError) as info:
        here.get("img")
    assert info.value.code == "not_found"
    second = there.build_from_dir(_src(tmp_path, "b", "two"), "img")
    assert second.manifest != first.manifest
    assert here.get("img").manifest == second.manifest


def test_an_unreadable_store_serves_names_read_before_and_says_so_for_others(tmp_path):
    """A ref that cannot be read (a shared store whose servers are gone; here a
    directory where the file was, so read fails with an OSError) resolves to
    the copy this daemon read before; a name never read here is `io`, naming
    the store and what to check."""
    store = tmp_path / "store"
    here, there = ImageStore(store, tmp_path / "s1"), ImageStore(store, tmp_path / "s2")
    built = there.build_from_dir(_src(tmp_path, "a", "one"), "seen")
    there.build_from_dir(_src(tmp_path, "b", "two"), "unseen")
    assert here.get("seen").manifest == built.manifest
    for name in ("seen", "unseen"):
        ref = store / "refs" / name
        ref.unlink()
        ref.mkdir()
    assert here.get("seen").manifest == built.manifest
    with pytest.raises(ImageError) as info:
        here.get("unseen")
    assert info.value.code == "io"
    assert "unreachable or failing" in str(info.value) and str(store) in str(info.value)


@pytest.mark.parametrize("name, pull", [
    ("nosuch", "`dsec image pull nosuch` fetches one from a registry"),      # pulled as nosuch:latest
    ("ghcr.io/org/app:v1", "`dsec image pull ghcr.io/org/app:v1` fetches one from a registry"),
    ("UPPER", None),                   # a local name no registry could have: no pull to suggest
    ("trailing-", None),
])
def test_a_missing_image_hints_a_pull_only_of_a_name_a_pull_takes(tmp_path, name, pull):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    with pytest.raises(ImageError) as info:
        store.get(name)
    assert info.value.code == "not_found"
    assert "see `dsec image ls`" in str(info.value)
    if pull:
        assert pull in str(info.value)
    else:
        assert "image pull" not in str(info.value) and "no registry reference" in str(info.value)


@pytest.mark.parametrize("name", ["nosuch", "UPPER", "ghcr.io/org/app:v1"])
def test_removing_a_missing_image_points_at_the_list_not_at_a_pull(tmp_path, name):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    with pytest.raises(ImageError) as info:
        store.remove(name)
    assert info.value.code == "not_found"
    assert str(info.value) == f"no image named {name!r} (see `dsec image ls`)"


@pytest.mark.parametrize("damage", ["truncated ref", "manifest gone"])
def test_a_name_whose_image_cannot_be_read_can_still_be_removed(tmp_path, damage):
    """A ref left half-written by a crash, or whose manifest a gc (of
    another host on the store) collected, fails every lookup; `image rm`
    is the way out, so it removes the name all the same and says what was
    wrong with it."""
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    built = store.build_from_dir(_src(tmp_path, "a", "one"), "team/app:1")
    store.build_from_dir(_src(tmp_path, "b", "two"), "other")
    ref = tmp_path / "store" / "refs" / "_repos" / "docker.io" / "team" / "app" / ":1"
    if damage == "truncated ref":
        ref.write_text('{"manif')
    else:
        store.store.remove(built.manifest)
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")         # nothing read before
    with pytest.raises(ImageError) as info:
        store.get("team/app:1")
    if damage == "truncated ref":
        assert "is damaged" in str(info.value) and "dsec image rm docker.io/team/app:1" in str(info.value)
    removed = store.remove("team/app:1")
    assert removed.name == "docker.io/team/app:1" and removed.manifest is None and removed.extra["damaged"]
    assert not ref.exists()
    with pytest.raises(ImageError) as info:
        store.remove("team/app:1")
    assert info.value.code == "not_found"
    assert store.get("other").name == "other"


def test_gc_removes_nothing_when_a_ref_cannot_be_read(tmp_path, monkeypatch):
    """A ref the store does not answer for (a distributed file system with
    the brick holding it down: ENOTCONN) leaves its image's blobs unknown:
    gc stops before removing anything instead of collecting them as
    unreferenced. A ref that reads but is not JSON names nothing gc could
    keep, and does not stop it."""
    import errno
    from pathlib import Path

    store = tmp_path / "store"
    builder = ImageStore(store, tmp_path / "s1")
    kept = builder.build_from_dir(_src(tmp_path, "a", "one"), "kept")
    builder.build_from_dir(_src(tmp_path, "b", "two"), "damaged")
    here = ImageStore(store, tmp_path / "s2")           # a daemon that never read these names
    read_text = Path.read_text

    def brick_down(path, *args, **kw):
        if path.name == "kept":
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected", str(path))
        return read_text(path, *args, **kw)

    monkeypatch.setattr(Path, "read_text", brick_down)
    blobs = set(here.store.all_digests())
    with pytest.raises(ImageError) as info:
        here.gc(set(), set())
    assert info.value.code == "io" and "'kept'" in str(info.value) and "nothing was removed" in str(info.value)
    assert here.store.all_digests() == blobs
    monkeypatch.setattr(Path, "read_text", read_text)
    (store / "refs" / "damaged").write_text('{"manif')
    gc = here.gc(set(), set())
    assert gc["removed"] and kept.manifest not in gc["removed"]
    assert here.get("kept").manifest == kept.manifest


def test_the_listing_names_what_it_cannot_read(tmp_path):
    """`image ls` shows the images it can read and says which names it
    cannot, instead of leaving them out unsaid."""
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    store.build_from_dir(_src(tmp_path, "a", "one"), "team/app:1")
    store.build_from_dir(_src(tmp_path, "b", "two"), "other")
    ref = tmp_path / "store" / "refs" / "_repos" / "docker.io" / "team" / "app" / ":1"
    ref.write_text('{"manif')
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    images, unreadable = store.list()
    assert [i.name for i in images] == ["other"]
    assert [u["name"] for u in unreadable] == ["docker.io/team/app:1"] and "damaged" in unreadable[0]["error"]


def test_a_name_removed_while_listed_is_not_called_unreadable(tmp_path, monkeypatch):
    store = ImageStore(tmp_path / "store", tmp_path / "scratch")
    store.build_from_dir(_src(tmp_path, "a", "one"), "gone")
    store.build_from_dir(_src(tmp_path, "b", "two"), "other")
    get = store.get

    def removed_first(name, **kw):
        if name == "gone":
            store._ref("gone").unlink()     # another client's image rm, between names() and get()
        return get(name, **kw)

    monkeypatch.setattr(store, "get", removed_first)
    images, unreadable = store.list()
    assert [i.name for i in images] == ["other"] and unreadable == []


def test_a_ref_another_host_renamed_over_is_read_anew(tmp_path, monkeypatch):
    """On a network file system, a ref replaced by another host (a rebuild,
    a tag, a pull moving a tag) answers ESTALE to a host whose mount looked
    the name up before: the read is made again and finds the new image,
    neither the copy read before nor an `io` error."""
    import errno
    from pathlib import Path

    store = tmp_path / "store"
    here, there = ImageStore(store, tmp_path / "s1"), ImageStore(store, tmp_path / "s2")
    first = there.build_from_dir(_src(tmp_path, "a", "one"), "seen")
    there.build_from_dir(_src(tmp_path, "b", "two"), "unseen")
    assert here.get("seen").manifest == first.manifest
    second = there.build_from_dir(_src(tmp_path, "c", "three"), "seen")
    read_text = Path.read_text
    stale: list[str] = []

    def replaced_elsewhere(path, *args, **kw):
        if path.parent == store / "refs" and path.name not in stale:
            stale.append(path.name)         # once per name: the next lookup finds the new file
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return read_text(path, *args, **kw)

    monkeypatch.setattr(Path, "read_text", replaced_elsewhere)
    assert here.get("seen").manifest == second.manifest
    assert here.get("unseen").name == "unseen"
    assert stale == ["seen", "unseen"]


@pytest.mark.parametrize("how", ["build", "tag"])
def test_a_publish_answers_the_image_it_published_whatever_the_name_says_next(tmp_path, monkeypatch, how):
    """On a shared store another host may rename its own image over a name
    (or be renaming it: the name missing a moment on a FUSE mount) right
    after this daemon published: the answer is the image this one
    published, never a read of the name back (which found another image,
    or none: not_found)."""
    store = tmp_path / "store"
    here = ImageStore(store, tmp_path / "s1")
    source = here.build_from_dir(_src(tmp_path, "src", "zero"), "src")
    real_changed = here._changed

    def other_host_renames(name):
        real_changed(name)
        if name == "img":
            (store / "refs" / "img").unlink()            # mid-rename on another host: no name for a moment

    monkeypatch.setattr(here, "_changed", other_host_renames)
    image = here.build_from_dir(_src(tmp_path, "a", "one"), "img") if how == "build" else here.tag("src", "img")
    assert image.name == "img" and image.manifest is not None
    if how == "tag":
        assert image.manifest == source.manifest
