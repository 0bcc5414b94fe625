"""The SDK's argument habits, without a daemon: commands as argv or shell
strings, env and labels checked with the key and type that is wrong."""

from __future__ import annotations

import pytest

from dsecd.client import command_argv, string_map


def test_a_string_runs_through_the_shell_and_a_list_as_it_is():
    assert command_argv("echo hi | wc -c") == ["/bin/sh", "-c", "echo hi | wc -c"]
    assert command_argv(["echo", "hi"]) == ["echo", "hi"]
    assert command_argv(("ls", "-l")) == ["ls", "-l"]


@pytest.mark.parametrize("bad,words", [(None, "NoneType"), (["echo", 1], "holding int"), (b"ls", "bytes")])
def test_other_commands_are_a_type_error(bad, words):
    with pytest.raises(TypeError, match="list of strings or a shell string") as info:
        command_argv(bad)
    assert words in str(info.value)


def test_env_values_must_be_strings_and_the_message_names_the_key():
    assert string_map({"A": "1"}, "env") == {"A": "1"} and string_map(None, "env") == {}
    with pytest.raises(TypeError, match=r"env\['A'\] must be a str, got int 1; convert it, e.g. str\(1\)"):
        string_map({"A": 1}, "env")
    with pytest.raises(TypeError, match="labels keys must be str, got int"):
        string_map({1: "x"}, "labels")
    with pytest.raises(TypeError, match="env must be a dict of str to str, got list"):
        string_map(["A=1"], "env")
