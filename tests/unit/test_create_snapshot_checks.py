"""Arguments the daemon refuses before it does anything: a create's
hostname (dsecd/engine/creates.py check_hostname) and a snapshot's exclude
paths (dsecd/engine/images.py check_excludes)."""

from __future__ import annotations

import pytest

from dsecd.engine.creates import check_hostname
from dsecd.engine.images import check_excludes
from dsecd.errors import BadRequest


@pytest.mark.parametrize("name", [
    "sb-0123456789ab",                 # the default, sb-<id>
    "a", "web-1", "1web", "DB", "db.internal", "a.b.c-d.e",
    "x" * 63, ".".join(["x" * 31, "y" * 32]),          # 64 characters: the kernel's UTS limit
])
def test_host_names_are_taken(name):
    check_hostname(name)


@pytest.mark.parametrize("name", [
    "bad host!", "under_score", "-lead", "trail-", "x" * 64, ".".join(["x" * 32, "y" * 32]),
    "a..b", ".lead", "trail.", "tab\t", "line\n", "ünï", "a/b",
])
def test_other_hostnames_are_bad_requests_that_say_what_is_allowed(name):
    with pytest.raises(BadRequest) as info:
        check_hostname(name)
    message = str(info.value)
    assert message.startswith(f"bad_request: hostname {name!r} is not a host name")
    assert "1 to 64 characters" in message and "letters, digits and hyphens" in message
    assert info.value.detail == {"hostname": name}


def test_snapshot_excludes_are_paths_inside_the_sandbox():
    check_excludes([])
    check_excludes(["/tmp", "/work/cache/", "/a b/.c", "tmp", "root/.cache"])    # relative: from the root
    for bad in ("/work/../etc", "/..", "../etc", "/a\0b"):
        with pytest.raises(BadRequest, match="must not hold '..' or NUL") as info:
            check_excludes([bad])
        assert info.value.detail == {"exclude": bad}
