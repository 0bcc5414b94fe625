"""Arguments as the daemon takes them, and answers as callers take them:
commands, string maps, ports, a sandbox's info; the optional ones sent only
when given.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Sequence

from .. import protocol
from ..errors import BadRequest

# A command as exec, exec_stream, spawn and call take it (command_argv): a
# string run by /bin/sh -c, or a list (or tuple) of arguments, each a str or
# bytes.
Command = str | Sequence[str | bytes]
# An exec's stdin: bytes-like, or an async iterable of bytes (ExecStream).
Stdin = bytes | bytearray | memoryview | AsyncIterable[bytes]


def command_argv(command) -> list[str | bytes]:
    """A command as the daemon's argv: a list, tuple or other sequence of
    strings (Command) as it is, a string run by /bin/sh -c (as `docker exec
    SB sh -c '...'` would). An argument may be bytes (a file name that is
    not UTF-8, as os.listdir(b".") gives it), or the str os.fsdecode makes
    of them: both reach execve as those bytes."""
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    # A sequence of arguments, not one of bytes' ints (b"ls" is no command).
    words = isinstance(command, Sequence) and not isinstance(command, (bytes, bytearray, memoryview))
    if words and all(isinstance(a, (str, bytes)) for a in command):
        return list(command)
    raise TypeError(f"a command must be a list of strings or a shell string (an argument may be bytes), "
                    f"got {type(command).__name__}"
                    + (f" holding {type(next(a for a in command if not isinstance(a, (str, bytes)))).__name__}"
                       if words else ""))


def string_map(values: dict | None, what: str, raw: bool = False) -> dict[str, str]:
    """`values` (env, labels) checked to be str -> str, with the key and type
    that is not. raw: bytes are strings too (a command's environment: what
    execve takes is bytes, and a value read from a file need not be UTF-8)."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict of str to str, got {type(values).__name__}")
    kinds = (str, bytes) if raw else str
    for key, value in values.items():
        if not isinstance(key, kinds):
            raise TypeError(f"{what} keys must be str, got {type(key).__name__} {key!r}")
        if not isinstance(value, kinds):
            raise TypeError(f"{what}[{key!r}] must be a str, got {type(value).__name__} {value!r}; "
                            f"convert it, e.g. str({value!r})")
    return dict(values)


def _protocol_arg(proto: str) -> dict:
    """net_publish's and net_unpublish's `protocol`, sent only when it is not
    TCP (the default): a daemon that publishes TCP only knows no such field
    and would refuse the request for it."""
    proto = protocol.check_protocol(proto)
    return {} if proto == "tcp" else {"protocol": proto}


def _port_arg(port: int | str, proto: str | None) -> tuple[int, str]:
    """A sandbox's port as the SDK takes it: 5353 with `proto` (TCP when
    None), or "5353/udp" as create's `publish` and `dsec port` take it, whose
    protocol `proto` must then not contradict. BadRequest, before anything
    is sent, for anything else."""
    number, named = protocol.published_port(port)
    if proto is None:
        return number, named
    proto = protocol.check_protocol(proto)
    if isinstance(port, str) and "/" in port and named != proto:
        raise BadRequest(f"port {port!r} is {named}, but protocol {proto!r} was given", {"port": port})
    return number, proto


def _publish_spec(spec: int | str) -> int | str:
    """A port of create's `publish` as sent: a TCP port as its number (what
    every daemon takes), else "PORT/PROTOCOL"."""
    port, proto = protocol.published_port(spec)
    return port if proto == "tcp" else f"{port}/{proto}"


def _sandbox_info(info: dict) -> dict:
    """A sandbox's create, inspect or list entry with its env and cwd as
    create took them: a name, value or path that is not UTF-8 comes as
    bytes, and is os.fsdecode's str again (what os.environ would hold)."""
    if isinstance(info.get("cwd"), bytes):
        info["cwd"] = os.fsdecode(info["cwd"])
    env = info.get("env")
    if isinstance(env, dict) and any(isinstance(k, bytes) or isinstance(v, bytes) for k, v in env.items()):
        info["env"] = {os.fsdecode(k) if isinstance(k, bytes) else k: os.fsdecode(v) if isinstance(v, bytes) else v
                       for k, v in env.items()}
    return info


def _given(args: dict, /, **optional) -> dict:
    """`args` plus those optional arguments that were given (not None): the daemon applies its defaults."""
    args.update((k, v) for k, v in optional.items() if v is not None)
    return args
