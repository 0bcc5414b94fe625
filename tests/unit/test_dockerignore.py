""".dockerignore matching (dsecd/build/ignore.py) and what the build context
gives COPY (dsecd/build/context.py): sources, globs, exclusions and their
exceptions, and the content hash a step's cache key uses. No root."""

from __future__ import annotations

import os
import socket

import pytest

from dsecd.build.context import BuildContext, ContextError, DigestCache
from dsecd.build.ignore import IgnoreRules


def rules(text: str) -> IgnoreRules:
    return IgnoreRules.parse(text)


@pytest.mark.parametrize("text,path,excluded", [
    ("*.log", "a.log", True),
    ("*.log", "dir/a.log", False),             # * never crosses a /
    ("**/*.log", "dir/sub/a.log", True),
    ("**/*.log", "a.log", True),               # ** is zero directories too
    ("build", "build/x/y.o", True),            # a directory excludes what is below it
    ("/build", "build", True),                 # a leading / is the context's root
    ("./build/", "build/out", True),
    ("build/**", "build/a/b", True),
    ("a?c", "abc", True),
    ("a?c", "a/c", False),
    ("[a-c]x", "bx", True),
    ("[!a-c]x", "dx", True),
    ("[!a-c]x", "ax", False),
    ("# comment\n\n  \n", "# comment", False),
    ("*\n!keep.txt", "keep.txt", False),
    ("*\n!keep.txt", "other.txt", True),
    ("docs\n!docs/README.md", "docs/README.md", False),
    ("docs\n!docs/README.md", "docs/other.md", True),
    ("!x\nx", "x", True),                      # the last pattern that matches decides
    ("x\\*y", "x*y", True),
    ("x\\*y", "xay", False),
    ("foo.txt ", "foo.txt", True),             # surrounding whitespace is dropped
])
def test_patterns(text, path, excluded):
    assert rules(text).excluded(path) is excluded


def make_tree(root, files: dict[str, str]):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def rels(sources) -> list[list[str]]:
    return [[e.rel for e in s.entries] for s in sources]


def test_sources_walk_what_dockerignore_leaves(tmp_path):
    make_tree(tmp_path, {"src/a.py": "a", "src/__pycache__/a.pyc": "x", "src/sub/b.py": "b",
                         "docs/README.md": "r", "docs/x.md": "x", ".dockerignore":
                         "**/__pycache__\ndocs\n!docs/README.md\n"})
    ctx = BuildContext.open(str(tmp_path))
    assert rels(ctx.sources("src")) == [["", "a.py", "sub", "sub/b.py"]]
    assert rels(ctx.sources("/docs/")) == [["", "README.md"]]
    assert rels(ctx.sources(".")) == [["", ".dockerignore", "docs", "docs/README.md", "src", "src/a.py",
                                       "src/sub", "src/sub/b.py"]]
    with pytest.raises(ContextError, match="excludes docs/x.md"):
        ctx.sources("docs/x.md")


def test_globs_match_per_component(tmp_path):
    make_tree(tmp_path, {"a1.txt": "", "a2.txt": "", "b.txt": "", "d/a3.txt": ""})
    ctx = BuildContext.open(str(tmp_path))
    assert [s.rel for s in ctx.sources("a*.txt")] == ["a1.txt", "a2.txt"]
    assert [s.rel for s in ctx.sources("*/a*.txt")] == ["d/a3.txt"]
    assert ctx.sources("z*") == []              # skipped, as BuildKit skips it
    with pytest.raises(ContextError, match="no such file or directory"):
        ctx.sources("z")
    make_tree(tmp_path, {"..data": "d", "..d/x": "x"})
    assert [s.rel for s in ctx.sources("..data")] == ["..data"]     # a name, not `..`
    assert [s.rel for s in ctx.sources("..d/x")] == ["..d/x"]


def test_sources_never_leave_the_context(tmp_path):
    """Symlinks on a source's path are followed inside the context, as
    BuildKit does: an absolute target or a `..` past the top is looked up
    from the context's root, never on the host."""
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    ctx_dir = tmp_path / "ctx"
    ctx_dir.mkdir()
    (ctx_dir / "in.txt").write_text("in")
    os.symlink(outside, ctx_dir / "out-link")
    os.symlink("../outside.txt", ctx_dir / "up-link")
    os.symlink("in.txt", ctx_dir / "in-link")
    os.symlink(tmp_path, ctx_dir / "out-dir")
    (ctx_dir / "sub").mkdir()
    os.symlink("sub", ctx_dir / "in-dir")
    ctx = BuildContext.open(str(ctx_dir))
    with pytest.raises(ContextError, match="outside the build context"):
        ctx.sources("../outside.txt")
    with pytest.raises(ContextError, match="the symlink up-link leads to nothing in the build context"):
        ctx.sources("up-link")
    with pytest.raises(ContextError, match="the symlink out-link leads to nothing in the build context"):
        ctx.sources("out-link")
    assert ctx.sources("in-link")[0].entries[0].kind == "file"      # a source symlink is followed inside
    with pytest.raises(ContextError, match="no such file or directory in the build context"):
        ctx.sources("out-dir/outside.txt")
    assert ctx.sources("out-dir/out*") == []        # listed where it leads inside: nothing
    (ctx_dir / "sub" / "f").write_text("f")
    assert ctx.sources("in-dir/f")[0].entries[0].kind == "file"     # one on the way, inside
    assert [s.rel for s in ctx.sources("a/../in.txt")] == ["in.txt"]
    with pytest.raises(ContextError, match="absolute path"):
        BuildContext.open("relative/dir")


def test_a_source_is_opened_inside_the_context_again_at_copy_time(tmp_path):
    """The client may change its context between the plan and the copy: a
    directory swapped for a symlink out of it leads nowhere outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.txt").write_text("SECRET")
    ctx = tmp_path / "ctx"
    make_tree(ctx, {"sub/f.txt": "in the context"})
    [src] = BuildContext.open(str(ctx)).sources("sub/f.txt")
    fd = src.open(src.entries[0])
    assert os.read(fd, 100) == b"in the context"
    os.close(fd)
    os.rename(ctx / "sub", ctx / "sub.old")
    os.symlink(outside, ctx / "sub")          # an absolute link: from the context's root, nothing there
    with pytest.raises(FileNotFoundError):
        src.open(src.entries[0])
    os.remove(ctx / "sub")
    os.symlink("../outside", ctx / "sub")     # `..` stops at the context's root: ctx/outside, nothing there
    with pytest.raises(FileNotFoundError):
        src.open(src.entries[0])
    os.remove(ctx / "sub")
    os.rename(ctx / "sub.old", ctx / "sub")
    os.remove(ctx / "sub" / "f.txt")
    os.mkfifo(ctx / "sub" / "f.txt")           # a FIFO now: refused at once, never waited on
    with pytest.raises(OSError, match="no longer a regular file"):
        src.open(src.entries[0])


def test_absolute_symlinks_lead_from_the_contexts_root(tmp_path):
    make_tree(tmp_path, {"sub/f": "f", "sub/g.txt": "g", "etc/hostname": "ctx-host"})
    os.symlink("/sub/f", tmp_path / "abs-link")
    os.symlink("/sub", tmp_path / "abs-dir")
    os.symlink("../../../etc", tmp_path / "sub" / "up-dir")     # `..` stops at the context's root
    os.symlink("/etc", tmp_path / "etc-link")
    ctx = BuildContext.open(str(tmp_path))
    [src] = ctx.sources("abs-link")
    assert (src.rel, src.entries[0].path) == ("abs-link", str(tmp_path / "sub" / "f"))
    assert rels(ctx.sources("abs-dir")) == [["", "f", "g.txt", "up-dir"]]
    assert [s.entries[0].path for s in ctx.sources("abs-dir/*.txt")] == [str(tmp_path / "sub" / "g.txt")]
    assert ctx.sources("sub/up-dir/hostname")[0].entries[0].path == str(tmp_path / "etc" / "hostname")
    assert ctx.sources("etc-link/hostname")[0].entries[0].path == str(tmp_path / "etc" / "hostname")
    os.symlink("loop-b", tmp_path / "loop-a")
    os.symlink("loop-a", tmp_path / "loop-b")
    with pytest.raises(ContextError, match="too many symlinks on the way to loop-a"):
        ctx.sources("loop-a")


def test_dockerignore_applies_to_what_a_symlink_leads_to(tmp_path):
    make_tree(tmp_path, {"secrets/key.pem": "KEY", "secrets/public.txt": "pub", "ok.txt": "ok",
                         ".dockerignore": "secrets\n"})
    os.symlink("secrets/key.pem", tmp_path / "key-link")
    os.symlink("/secrets", tmp_path / "dir-link")
    os.symlink("ok.txt", tmp_path / "ok-link")
    ctx = BuildContext.open(str(tmp_path))
    with pytest.raises(ContextError, match="key-link leads to secrets/key.pem, which .dockerignore excludes"):
        ctx.sources("key-link")
    with pytest.raises(ContextError, match="dir-link leads to secrets, which .dockerignore excludes"):
        ctx.sources("dir-link")
    assert ctx.sources("ok-link")[0].entries[0].path == str(tmp_path / "ok.txt")
    assert ctx.sources("dir-link/*") == []          # a glob skips what it would only reach through a link
    assert [s.rel for s in ctx.sources("*-link")] == ["ok-link"]
    # With an exception pattern, only what it brings back comes through the link.
    (tmp_path / ".dockerignore").write_text("secrets\n!secrets/public.txt\n")
    ctx = BuildContext.open(str(tmp_path))
    assert rels(ctx.sources("dir-link")) == [["", "public.txt"]]
    with pytest.raises(ContextError, match="excludes secrets/key.pem"):
        ctx.sources("key-link")


def test_the_content_hash_follows_bytes_modes_and_names(tmp_path):
    make_tree(tmp_path, {"d/a.txt": "one", "d/b.txt": "two"})
    ctx = BuildContext.open(str(tmp_path))
    cache = DigestCache()

    def digest():
        return ctx.digest(ctx.sources("d"), cache)

    first = digest()
    assert digest() == first
    (tmp_path / "d" / "a.txt").write_text("ONE")
    changed = digest()
    assert changed != first
    (tmp_path / "d" / "a.txt").chmod(0o600)
    assert digest() != changed
    (tmp_path / "d" / "a.txt").chmod(0o644)
    assert digest() == changed
    os.rename(tmp_path / "d" / "b.txt", tmp_path / "d" / "c.txt")
    assert digest() != changed
    os.symlink("a.txt", tmp_path / "d" / "link")
    with_link = digest()
    os.remove(tmp_path / "d" / "link")
    os.symlink("c.txt", tmp_path / "d" / "link")
    assert digest() != with_link                  # a symlink's target is content


def test_the_digest_cache_rehashes_a_rewritten_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("aaaa")
    cache = DigestCache()

    def digest() -> str:
        fd = os.open(f, os.O_RDONLY)
        try:
            return cache.file_digest(fd)
        finally:
            os.close(fd)

    first = digest()
    st = os.stat(f)
    f.write_text("bbbb")                          # same size; ctime moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert digest() != first


def test_a_glob_skips_fifos_and_sockets_as_a_copied_directory_does(tmp_path):
    """`COPY * /app/` in a project dir holding a socket (a dev server's, an
    agent's) copies what `COPY . /app/` copies; only a special file named on
    its own is refused."""
    make_tree(tmp_path, {"a.txt": "a", "d/b.txt": "b"})
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s.sock"))
        ctx = BuildContext.open(str(tmp_path))
        assert rels(ctx.sources(".")) == [["", "a.txt", "d", "d/b.txt"]]
        assert [s.rel for s in ctx.sources("*")] == ["a.txt", "d"]
        assert ctx.sources("*.sock") == []
        with pytest.raises(ContextError, match="fifo is not a file, directory or symlink"):
            ctx.sources("fifo")
    finally:
        sock.close()


def test_the_dockerignore_is_read_inside_the_context(tmp_path):
    """A .dockerignore that links out of the context is looked up inside it,
    as COPY sources are (the daemon reads as root what the client may not
    read); one that is a directory says which file is wrong."""
    ctx_dir = tmp_path / "ctx"
    make_tree(ctx_dir, {"a.txt": "a", "b.txt": "b", "rules": "b.txt\n"})
    (tmp_path / "outside").write_text("a.txt\n")
    (ctx_dir / ".dockerignore").symlink_to(tmp_path / "outside")
    assert [s.rel for s in BuildContext.open(str(ctx_dir)).sources("*.txt")] == ["a.txt", "b.txt"]
    (ctx_dir / ".dockerignore").unlink()
    (ctx_dir / ".dockerignore").symlink_to("/rules")            # absolute: from the context's root
    assert [s.rel for s in BuildContext.open(str(ctx_dir)).sources("*.txt")] == ["a.txt"]
    (ctx_dir / ".dockerignore").unlink()
    (ctx_dir / ".dockerignore").mkdir()
    with pytest.raises(ContextError, match=r"\.dockerignore .*is not a file"):
        BuildContext.open(str(ctx_dir))


def test_a_dockerignore_past_its_bound_is_refused_unread(tmp_path):
    """The daemon reads the .dockerignore into memory: a sparse one of any
    size costs its maker nothing. Past MAX_DOCKERIGNORE_BYTES the build is
    refused, saying so; one of exactly that size is read."""
    from dsecd.build import context

    make_tree(tmp_path, {"a.txt": "a"})
    with open(tmp_path / ".dockerignore", "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(ContextError, match=r"\.dockerignore is larger than 1 MiB"):
        BuildContext.open(str(tmp_path))
    with open(tmp_path / ".dockerignore", "wb") as f:
        f.write(b"# rules\n" + b" " * (context.MAX_DOCKERIGNORE_BYTES - 9) + b"\n")
    assert os.path.getsize(tmp_path / ".dockerignore") == context.MAX_DOCKERIGNORE_BYTES == 1 << 20
    assert [s.rel for s in BuildContext.open(str(tmp_path)).sources("*.txt")] == ["a.txt"]
