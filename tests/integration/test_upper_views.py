"""A daemon killed mid-snapshot leaves a writable-layer view mounted in
state_dir/upper-views; the next start unmounts it (dsecd/fs/upper.py sweep_views)."""

import subprocess


def _mounted(path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_start_unmounts_views_left_behind(daemon_factory):
    d = daemon_factory(start=False)
    point = d.state / "upper-views" / "upper-left"
    point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "left", str(point)], check=True)
    assert _mounted(point)
    d.start()
    assert not _mounted(point) and not point.exists()
    assert "left by an earlier daemon" in d.log.read_text()
