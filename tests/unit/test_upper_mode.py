"""dsecd/fs/upper.py pick_mode: which writable layer a daemon uses, from config and the probe."""

import pytest

from dsecd.features import Feature, Features
from dsecd.fs import upper


def feats(available: bool) -> Features:
    detail = "works" if available else "overlay over a detached tmpfs: EINVAL; before Linux 6.15"
    return Features(kernel="x", cgroup_mode="v2", cgroup_controllers={},
                    items={"upperfs": Feature(available, detail)})


@pytest.mark.parametrize("configured, available, mode", [
    ("auto", True, "tmpfs"), ("auto", False, "dir"), ("tmpfs", True, "tmpfs"),
    ("dir", True, "dir"), ("dir", False, "dir"),
])
def test_pick_mode(configured, available, mode):
    assert upper.pick_mode(configured, feats(available)) == mode


def test_tmpfs_on_a_kernel_that_cannot_is_refused_with_the_reason():
    with pytest.raises(upper.UpperError, match="6.15"):
        upper.pick_mode("tmpfs", feats(False))


def test_unknown_mode_is_refused():
    with pytest.raises(upper.UpperError, match="auto, tmpfs, dir"):
        upper.pick_mode("zfs", feats(True))
