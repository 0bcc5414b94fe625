"""Idempotency keys of exec, proc_start and snapshot, and proc_input's
offset: a request sent again is answered with what the first one did
instead of doing it twice."""

from __future__ import annotations

import pytest

from dsecd.errors import BadRequest, Conflict


def test_a_key_given_again_with_other_arguments_is_a_conflict_naming_it(client, sandbox):
    first = client.request("exec", sandbox=sandbox.id, argv=["echo", "one"], stream=False, key="step-1")
    again = client.request("exec", sandbox=sandbox.id, argv=["echo", "one"], stream=False, key="step-1")
    with pytest.raises(Conflict) as e:
        client.request("exec", sandbox=sandbox.id, argv=["echo", "two"], stream=False, key="step-1")
    assert first["stdout"] == b"one\n" and again["stdout"] == b"one\n" and again["existing"] is True
    assert "'step-1'" in e.value.message and "other arguments" in e.value.message, e.value.message
    assert e.value.detail["key"] == "step-1"
    # One key per exec the SDK sends: for the daemon, not for what listings show.
    listed = next(row for row in client.list() if row["id"] == sandbox.id)
    assert "op_keys" not in sandbox.inspect() and "op_keys" not in listed


def test_a_key_is_refused_where_a_request_cannot_be_sent_again(client, sandbox):
    """A streamed exec's output would come twice: a key is for collected execs."""
    with pytest.raises(BadRequest) as e:
        client.request("exec", sandbox=sandbox.id, argv=["true"], stream=True, key="k")
    assert "stream" in e.value.message, e.value.message


def test_an_input_at_an_offset_past_what_was_written_is_a_conflict_naming_where_to_send_from(client, sandbox):
    proc = sandbox.spawn("cat > /dev/null")
    client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"abc", offset=0)
    again = client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"abcdef", offset=0)
    with pytest.raises(Conflict) as e:
        client.request("proc_input", sandbox=sandbox.id, pid=proc.pid, data=b"x", offset=9)
    assert again["skipped"] == 3 and e.value.detail["taken"] == 6 and "from offset 6" in e.value.message
