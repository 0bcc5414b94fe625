"""pytest imports test modules by their basename (rootdir-relative, no
packages): two files of one name under tests/ stop the whole run's
collection ("import file mismatch"), which running one directory at a time
never shows."""

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_module_name_is_used_twice():
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
