"""unixsock.bind_private: the listening socket has its final mode and group
when it appears, and the process's umask (shared by every thread) is never
changed to get there."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from dsecd import unixsock


def test_the_socket_appears_0660_with_its_group_and_nothing_else_is_left(tmp_path, monkeypatch):
    def no_umask(_mask):
        raise AssertionError("bind_private changed the process-wide umask")

    monkeypatch.setattr(os, "umask", no_umask)
    path = tmp_path / "d.sock"
    sock = unixsock.bind_private(str(path), 4242)
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_uid, st.st_gid) == (os.geteuid(), 4242)
        assert os.listdir(tmp_path) == ["d.sock"], "the private bind dir was left behind"
        sock.listen(1)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))                 # bound where it was renamed to
        client.close()
    finally:
        sock.close()


def test_a_failed_bind_leaves_no_socket_and_no_dir(tmp_path):
    with pytest.raises(OSError):
        unixsock.bind_private(str(tmp_path / "missing" / "d.sock"), 0)
    assert os.listdir(tmp_path) == []
