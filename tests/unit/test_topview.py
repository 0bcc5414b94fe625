"""`dsec top`'s table (dsecd/topview.py): the BALLOON column of microVMs."""

from dsecd import topview

MiB = 1 << 20


def _row(**kw) -> dict:
    return {"id": "ab12", "qos": "be", "state": "running", "cpu": 1.0, "cpu_pct": 1.0, "throttled_pct": 0.0,
            "memory": 10 * MiB, "memory_limit": 256 * MiB, **kw}


def test_balloon_column_says_guest_size_over_ram_or_why_not():
    top = {"sandboxes": [_row(id="vm", vm_balloon={"guest_size": 129 * MiB, "ram": 256 * MiB, "skipped": False}),
                         _row(id="tmpl", vm_balloon={"guest_size": 256 * MiB, "ram": 256 * MiB, "skipped": True}),
                         _row(id="box", vm_balloon=None), _row(id="old")]}
    cells = {r[0]: r[-1] for r in topview.rows(top, "id")}
    assert topview.HEADER[-1] == "BALLOON"
    assert cells == {"vm": "129.0M/256.0M", "tmpl": "256.0M/256.0M (off)", "box": "-", "old": "-"}
