"""dsecd.mem.swapfile pieces that need no root: config, filesystem checks
against fixture mountinfo, the swap header label, and refusing files that
are not dsecd's. Swapping on and off is in tests/integration."""

from __future__ import annotations

import errno
import os

import pytest

from dsecd.mem import swapfile as sf
from dsecd.mem.zram import SWAP_MAGIC, swap_header

MOUNTINFO = """\
1 0 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
2 1 0:21 / /dev/shm rw,nosuid shared:2 - tmpfs tmpfs rw
3 1 0:40 / /var/lib/over rw shared:3 - overlay overlay rw,lowerdir=/a,upperdir=/b,workdir=/c
4 3 253:1 / /var/lib/over/disk rw shared:4 - xfs /dev/vdb rw
5 1 0:41 / /mnt/with\\040space rw shared:5 - tmpfs tmpfs rw
"""


@pytest.fixture
def mountinfo(tmp_path):
    p = tmp_path / "mountinfo"
    p.write_text(MOUNTINFO)
    return str(p)


def test_mount_points_under_a_dir_deepest_first(mountinfo):
    from dsecd.sysfs import mount_points_under

    assert mount_points_under("/var/lib", mountinfo) == ["/var/lib/over/disk", "/var/lib/over"]
    assert mount_points_under("/var/lib/over/", mountinfo) == ["/var/lib/over/disk"]     # strictly below
    assert mount_points_under("/var/li", mountinfo) == []                                # a prefix of a name
    assert mount_points_under("/mnt", mountinfo) == ["/mnt/with space"]


def test_fs_type_is_the_longest_mount_prefix(mountinfo):
    assert sf.fs_type("/", mountinfo) == ("ext4", "/")
    assert sf.fs_type("/dev/shm", mountinfo) == ("tmpfs", "/dev/shm")
    assert sf.fs_type("/var/lib/over", mountinfo) == ("overlay", "/var/lib/over")
    assert sf.fs_type("/var/lib/over/disk", mountinfo) == ("xfs", "/var/lib/over/disk")
    assert sf.fs_type("/var/lib/overt", mountinfo) == ("ext4", "/")          # a prefix of a name is not a parent
    assert sf.fs_type("/mnt/with space", mountinfo) == ("tmpfs", "/mnt/with space")


@pytest.mark.parametrize("parent", ["/dev/shm", "/var/lib/over"])
def test_filesystems_that_cannot_swap_are_refused_by_name(mountinfo, parent):
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=f"{parent}/swapfile"), mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.EINVAL
    assert "cannot hold swap" in str(exc.value) and parent in str(exc.value)
    assert not os.path.exists(f"{parent}/swapfile")


def test_a_missing_directory_is_named(mountinfo, tmp_path):
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(tmp_path / "nodir" / "swap")), mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.ENOENT and "nodir" in str(exc.value)


def test_a_file_that_is_not_ours_is_never_touched(tmp_path, mountinfo):
    path = tmp_path / "swapfile"
    path.write_bytes(swap_header(1 << 20, label=b"someone-else"))      # a real swap header, not ours
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path)), mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.EEXIST and "not made by dsecd" in str(exc.value)
    s.teardown()                                                          # refuses silently too
    assert path.read_bytes()[-len(SWAP_MAGIC):] == SWAP_MAGIC


def test_label_round_trip_and_plain_files(tmp_path):
    p = tmp_path / "h"
    p.write_bytes(swap_header(64 << 20, label=sf.LABEL))
    assert sf.read_label(p) == sf.LABEL
    p.write_bytes(b"\0" * 4096)
    assert sf.read_label(p) is None
    assert sf.read_label(tmp_path / "absent") is None
    with pytest.raises(ValueError):
        swap_header(1 << 20, label=b"x" * 17)


def test_config_from_section():
    base = {"enabled": True, "path": "", "size": "1G", "priority": 10}
    c = sf.SwapfileConfig.from_section(base, "/var/lib/dsecd")
    assert c.path == "/var/lib/dsecd/swapfile" and c.size_bytes == 1 << 30 and c.enabled
    assert sf.SwapfileConfig.from_section({**base, "size": "100000"}, "/s").size_bytes % 4096 == 0
    for bad in ({"path": "rel/swap"}, {"priority": 40000}, {"size": "4K"}):
        with pytest.raises(ValueError):
            sf.SwapfileConfig.from_section({**base, **bad}, "/s")


def test_a_size_past_the_free_disk_space_is_refused_before_any_allocation(tmp_path, mountinfo, monkeypatch):
    """posix_fallocate on ext4 allocates block after block until ENOSPC, so
    a size larger than the free space would fill the disk the state dir and
    every other writer share before it failed: refused before it begins."""
    real_statvfs = os.statvfs
    free = 64 << 20

    def statvfs(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, free // 4096, free // 4096, *tuple(st)[5:]))

    allocated = []
    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: allocated.append(n))
    path = tmp_path / "swapfile"
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path), size_bytes=1 << 30), mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.ENOSPC, exc.value
    assert "1024 MiB" in str(exc.value) and "64 MiB free" in str(exc.value), exc.value
    assert allocated == [] and not path.exists()


@pytest.mark.parametrize("fs_gib, reserve_mib", [(100, 1024), (4, 204)])
def test_a_swap_file_leaves_part_of_its_filesystem_free(tmp_path, mountinfo, monkeypatch, fs_gib, reserve_mib):
    """A file that fits the free space exactly would leave the state dir and
    every other writer on that disk nothing: the smaller of 1 GiB and 5% of
    the filesystem stays free."""
    real_statvfs = os.statvfs
    free = 2 << 30

    def statvfs(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, 4096, (fs_gib << 30) // 4096, free // 4096, free // 4096,
                                  *tuple(st)[5:]))

    allocated = []
    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: allocated.append(n))
    path = tmp_path / "swapfile"
    reserve = sf.free_reserve(fs_gib << 30)
    assert reserve >> 20 == reserve_mib
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path), size_bytes=free - reserve + 4096),
                    mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.ENOSPC, exc.value
    assert f"{reserve_mib} MiB of it stay free" in str(exc.value), exc.value
    assert f"at most {(free - reserve) >> 20} MiB" in str(exc.value), exc.value
    assert allocated == [] and not path.exists()
    # One page less: it fits, and the allocation is tried (the fake allocates nothing).
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path), size_bytes=free - reserve),
                    mountinfo=mountinfo)
    with pytest.raises(sf.SwapfileError):
        s.setup()
    assert allocated == [free - reserve]


def test_adopt_takes_only_a_file_of_ours_that_is_on(tmp_path, mountinfo):
    """What a daemon with the swap file disabled looks at, at start: never
    a file without our label, nor a directory at the path."""
    (tmp_path / "dir").mkdir()
    assert not sf.Swapfile(sf.SwapfileConfig(path=str(tmp_path / "dir")), mountinfo=mountinfo).adopt()
    off = tmp_path / "swapfile"
    off.write_bytes(swap_header(1 << 20, label=sf.LABEL))        # ours, but not on
    assert not sf.Swapfile(sf.SwapfileConfig(path=str(off)), mountinfo=mountinfo).adopt()
    assert not sf.Swapfile(sf.SwapfileConfig(path=str(tmp_path / "absent")), mountinfo=mountinfo).adopt()


def test_the_swap_file_of_another_daemon_is_refused_and_never_touched(tmp_path, mountinfo, monkeypatch):
    """Two daemons configured with one memory.swapfile.path: the second
    neither adopts nor takes down the first's file, and says whose it is."""
    from dsecd import native

    other_state = tmp_path / "other-state"
    other_state.mkdir()
    (other_state / "dsecd.lock").write_text(f"{os.getpid()}\n")       # the other daemon, running
    path = tmp_path / "swapfile"
    header = swap_header(1 << 20, label=sf.LABEL, owner=str(other_state))
    path.write_bytes(header)
    monkeypatch.setattr(sf, "active_swaps", lambda: {str(path)})     # the other daemon swaps on it
    swapoffs = []
    monkeypatch.setattr(native, "swapoff", swapoffs.append)
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path)), mountinfo=mountinfo,
                    owner=str(tmp_path / "my-state"))
    with pytest.raises(sf.SwapfileError) as exc:
        s.setup()
    assert exc.value.errno == errno.EBUSY
    assert f"state dir {other_state} (pid {os.getpid()})" in str(exc.value)
    assert "memory.swapfile.path" in str(exc.value)
    assert not s.adopt() and not s.active
    s.teardown()
    assert swapoffs == [] and path.read_bytes() == header
    # Its own daemon, restarted, adopts it.
    mine = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path)), mountinfo=mountinfo, owner=str(other_state))
    assert mine.setup() == str(path) and mine.active
    assert sf.read_owner(path) == str(other_state)


def test_a_file_left_off_by_a_daemon_that_no_longer_runs_is_made_afresh(tmp_path, mountinfo, monkeypatch):
    """state_dir moved, memory.swapfile.path kept: the file names the old
    state dir, whose daemon is gone, and it is off, so nothing is in it.
    Refused, it would stay there for good; it is made afresh instead. On,
    or with its daemon running, it stays refused."""
    other_state = tmp_path / "old-state"
    other_state.mkdir()
    (other_state / "dsecd.lock").write_text("999999999\n")            # no such process
    path = tmp_path / "swapfile"
    path.write_bytes(swap_header(1 << 20, label=sf.LABEL, owner=str(other_state)))
    on: set[str] = {str(path)}
    monkeypatch.setattr(sf, "active_swaps", lambda: on)
    made = []
    monkeypatch.setattr(sf.Swapfile, "_create", lambda self, fstype: made.append(self.path))
    monkeypatch.setattr(sf.Swapfile, "swapon", lambda self: None)
    s = sf.Swapfile(sf.SwapfileConfig(enabled=True, path=str(path)), mountinfo=mountinfo,
                    owner=str(tmp_path / "new-state"))
    with pytest.raises(sf.SwapfileError) as exc:                       # still on: pages may be in it
        s.setup()
    assert exc.value.errno == errno.EBUSY and made == []
    on.clear()
    (other_state / "dsecd.lock").write_text(f"{os.getpid()}\n")       # its daemon runs
    with pytest.raises(sf.SwapfileError):
        s.setup()
    assert made == [] and path.exists()
    (other_state / "dsecd.lock").unlink()                              # gone, and the file off
    assert s.setup() == str(path) and s.active
    assert made == [str(path)] and not path.exists()                   # the old one removed first


def test_a_daemon_knows_its_own_file_under_a_state_dir_too_long_for_the_header(tmp_path, mountinfo, monkeypatch):
    """The header holds 1 KiB of the state dir: a longer one is cut short,
    and still names its daemon."""
    path = tmp_path / "swapfile"
    owner = "/var/lib/" + "d" * 2000
    path.write_bytes(swap_header(1 << 20, label=sf.LABEL, owner=owner))
    monkeypatch.setattr(sf, "active_swaps", lambda: {str(path)})
    assert sf.Swapfile(sf.SwapfileConfig(path=str(path)), mountinfo=mountinfo, owner=owner).adopt()
    other = sf.Swapfile(sf.SwapfileConfig(path=str(path)), mountinfo=mountinfo, owner="/var/lib/e" + owner[10:])
    assert not other.adopt() and other.other_owner() is not None
