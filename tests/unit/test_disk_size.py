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


def test_a_disk_a_byte_short_of_the_least_is_not_said_as_1024k_or_as_the_least():
    # size_text rounded 1048575 bytes to "1024.0K"; rounded up to "1.0M", it
    # would read as the bound it is refused for missing: the bytes say it.
    with pytest.raises(BadRequest, match=r"between 1M and 1024T, got 1\.0M \(1048575 bytes\)$"):
        _disk(str((1 << 20) - 1))


def test_a_size_rounded_to_1024_of_a_unit_is_said_in_the_next():
    from dsecd.config import size_text

    assert [size_text(n) for n in ((1 << 20) - 1, (1 << 30) - 1, 1023, 1 << 20, (1 << 40) + (1 << 30))] == \
        ["1.0M", "1.0G", "1023B", "1.0M", "1.0T"]
    assert size_text(2 << 50) == "2048.0T"          # past T: T still
