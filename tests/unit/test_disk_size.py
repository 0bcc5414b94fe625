"""The writable layer's size a create asks for: its bounds said in units it takes."""

from types import SimpleNamespace

import pytest

from dsecd.engine.creates import CreateService
from dsecd.errors import BadRequest


def _disk(disk):
    return CreateService._disk_size(SimpleNamespace(disk_default=1 << 30), SimpleNamespace(disk=disk))


def test_the_largest_disk_is_said_in_a_unit_a_create_takes():
    # "1P" was the bound it named, which the size parser refuses.
    with pytest.raises(BadRequest) as e:
        _disk("2048T")
    assert "between 1M and 1024T, got 2048.0T" in str(e.value)
    assert _disk("1024T") == 1 << 50 and _disk(None) == 1 << 30


def test_a_disk_too_small_is_said_as_a_size():
    with pytest.raises(BadRequest, match=r"got 1\.0K$"):
        _disk("1K")
