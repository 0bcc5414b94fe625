"""What the daemon's file service says of bad offsets, lengths and sizes
(dsecd/engine/files.py), before it looks at any sandbox."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.engine.files import FileService
from dsecd.errors import BadRequest, LimitExceeded


def _service() -> FileService:
    return FileService(registry=None, workers=None, ensure_running=None, max_chunk=1 << 20, copy_by_init=None)


@pytest.mark.parametrize("offset,length,error,words", [
    (-1, 10, BadRequest, "read sb:/f: offset and length must be >= 0, got offset -1 length 10"),
    (0, -5, BadRequest, "read sb:/f: offset and length must be >= 0, got offset 0 length -5"),
    (0, (1 << 20) + 1, LimitExceeded, "read sb:/f: length 1048577 exceeds 1048576; read in chunks"),
])
def test_a_bad_read_says_which_file_and_is_a_bad_request_unless_too_big(offset, length, error, words):
    """A negative offset was `limit` (as if it were too big) and named no file."""
    req = SimpleNamespace(sandbox="sb", path="/f", offset=offset, length=length)
    with pytest.raises(error) as info:
        asyncio.run(_service().read(req, None))
    assert str(info.value.message).startswith(words) and info.value.detail["path"] == "/f"


def test_a_bad_write_names_its_file():
    req = SimpleNamespace(sandbox="sb", path="/f", data=b"x" * ((1 << 20) + 1), mode=0o644, offset=None,
                          append=False)
    with pytest.raises(LimitExceeded, match=r"^limit: write sb:/f: data of 1048577 bytes exceeds 1048576"):
        asyncio.run(_service().write(req, None))
    req = SimpleNamespace(sandbox="sb", path="/f", data=b"x", mode=0o644, offset=-1, append=False)
    with pytest.raises(BadRequest, match=r"^bad_request: write sb:/f: offset must be >= 0"):
        asyncio.run(_service().write(req, None))
