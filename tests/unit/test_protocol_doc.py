"""docs/protocol.md documents every op, every field and every error code."""

import re
from pathlib import Path

from dsecd import protocol
from dsecd.errors import ERROR_CODES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def _section(op: str) -> str:
    m = re.search(rf"^### {re.escape(op)}\b.*?(?=^### |\Z)", DOC, re.M | re.S)
    assert m, f"docs/protocol.md has no section for op {op!r}"
    return m.group(0)


def test_every_op_and_field_is_documented():
    for op in protocol.REQUESTS:
        text = _section(op)
        for field in protocol.op_fields(op):
            assert f"`{field}" in text, f"field {field!r} of {op!r} undocumented"


def test_documented_ops_all_exist():
    documented = set(re.findall(r"^### (\w+)", DOC, re.M))
    assert documented == set(protocol.REQUESTS)


def test_every_error_code_is_documented():
    table = {m for m in re.findall(r"^\| `(\w+)` \|", DOC, re.M)}
    assert table == set(ERROR_CODES)


def test_states_accepted_are_documented():
    for op, cls in protocol.REQUESTS.items():
        if cls.STATES:
            assert "States: " in _section(op), op
        if cls.STATES == protocol.RUNNING:
            assert "States: running." in _section(op), op
        if cls.STATES == protocol.ACTIVE:
            assert "States: running, paused." in _section(op), op
