import errno

import pytest

from dsecd.errors import ERROR_CODES, BadRequest, DsecError, NotFound, io_error


def test_wire_roundtrip_keeps_class_and_detail():
    e = DsecError.from_wire(NotFound("no sandbox x", {"sandbox": "x"}).to_wire())
    assert isinstance(e, NotFound) and e.detail == {"sandbox": "x"} and e.code == "not_found"


def test_unknown_code_from_wire_becomes_internal():
    assert DsecError.from_wire({"code": "weird", "message": "m"}).code == "internal"


def test_io_error_maps_errno_and_names_it():
    e = io_error("read", "sb:/x", OSError(errno.ENOENT, "x"))
    assert isinstance(e, NotFound) and e.detail["errno"] == "ENOENT" and "sb:/x" in e.message
    assert isinstance(io_error("open", "p", OSError(errno.ELOOP, "x")), BadRequest)
    assert io_error("write", "p", OSError(errno.ENOSPC, "x")).code == "io"


def test_every_class_code_is_in_the_closed_set():
    for klass in DsecError.__subclasses__():
        assert klass.code in ERROR_CODES


def test_a_request_an_older_init_refuses_says_to_recreate_the_sandbox():
    import errno

    from dsecd.errors import Conflict, run_error
    from dsecd.native import NativeError

    err = run_error(NativeError(errno.EINVAL, "have the sandbox's init start an exec: Invalid argument",
                                step="init_request"), "sb1", "sh", "/")
    assert isinstance(err, Conflict) and "recreate the sandbox" in str(err) and "older than this dsecd" in str(err)


def test_a_background_process_an_older_init_refuses_says_what_it_asked():
    """`dsec exec -d -u nobody` in a sandbox made before an upgrade whose
    init predates supplementary groups: the error names them, and the way
    round them, not four things the request might have been."""
    import errno

    from dsecd.engine.procs import init_needs
    from dsecd.errors import run_error
    from dsecd.fs.users import ProcessIds
    from dsecd.native import NativeError

    refused = NativeError(errno.EINVAL, "have the sandbox's init start an exec: Invalid argument",
                          step="init_request")
    err = run_error(refused, "sb1", "id", "/", init_needs(False, ProcessIds(65534, 65534, (65534,))))
    assert "(a background process, with supplementary groups (65534))" in str(err), str(err)
    assert "give the user as UID:GID" in str(err) and "pty" not in str(err)
    plain = run_error(refused, "sb1", "id", "/", init_needs(True, ProcessIds(1000, 1000)))
    assert "(a background process, under a task policy)" in str(plain) and "UID:GID" not in str(plain)


def test_the_package_names_the_class_of_every_code():
    """A scaffold catches `dsecd.NotFound` as it imports `dsecd.Client`."""
    import dsecd
    from dsecd.errors import _BY_CODE

    for code, cls in _BY_CODE.items():
        assert getattr(dsecd, cls.__name__) is cls and cls.__name__ in dsecd.__all__, code


def test_an_exec_denied_names_its_program_and_a_working_directory_denied_names_it():
    from dsecd.errors import exec_error
    from dsecd.native import NativeError

    err = exec_error(NativeError(errno.EACCES, "execve: Permission denied", step="exec"), "/etc/passwd", "/")
    assert err.code == "permission" and err.detail["argv0"] == "/etc/passwd", err.detail
    err = exec_error(NativeError(errno.EACCES, "chdir: Permission denied", step="chdir"), "ls", "/root")
    assert err.code == "permission" and "argv0" not in err.detail and "'/root'" in err.message, err.message


def test_a_program_of_no_executable_format_cannot_be_executed_as_a_shell_says():
    """execve's ENOEXEC (no ELF, no #! line) is a program that cannot be
    executed: `permission` naming it, which dsec exec turns into 126 as bash
    does, not dsec's own failure (io, 125)."""
    import argparse

    from dsecd import cli
    from dsecd.errors import exec_error
    from dsecd.native import NativeError

    err = exec_error(NativeError(errno.ENOEXEC, "exec `/work/x`: Exec format error; not an ELF binary and no #! "
                                 "line", step="exec"), "/work/x", "/")
    assert err.code == "permission" and err.detail["argv0"] == "/work/x", (err.code, err.detail)
    assert "Exec format error" in err.message and "/work/x" in err.message, err.message
    assert cli._failed_status(argparse.Namespace(cmd="exec"), err) == 126


def test_a_denied_step_of_the_daemons_own_is_no_program_denied():
    """EACCES joining the cgroup or a namespace is dsec's own failure
    (exit 125), not the program's (126): no argv0."""
    import argparse

    from dsecd import cli
    from dsecd.errors import exec_error
    from dsecd.native import NativeError

    err = exec_error(NativeError(errno.EACCES, "setns: Permission denied", step="setns"), "ls", "/")
    assert err.code == "permission" and "argv0" not in err.detail and "at setns" in err.message, err.message
    assert cli._failed_status(argparse.Namespace(cmd="exec"), err) == 125


def test_a_bad_environment_variable_says_what_a_name_and_a_value_may_hold():
    """env {"A=B": "1"} (a create's, an exec's, a call's) is refused naming
    the variable and the rule it breaks, not only "bad name or value"."""
    from dsecd.engine.execs import check_env

    for env, bad in (({"A=B": "1"}, "'A=B'"), ({"": "1"}, "''"), ({"A": "x\0y"}, "'A'")):
        with pytest.raises(BadRequest) as err:
            check_env(env)
        assert bad in err.value.message and "without '='" in err.value.message, err.value.message


def test_the_cli_says_every_reason_of_a_destroy_as_the_daemon_does():
    """`dsec exec` killed by its sandbox's destroy says why (destroyed_by)
    in the words a later request on the sandbox gets from the daemon."""
    from dsecd import cli
    from dsecd.engine.sandboxes import DESTROYED_BECAUSE

    assert cli.DESTROYED_BY == DESTROYED_BECAUSE
