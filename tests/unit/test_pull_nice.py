"""A pull's conversion threads are niced below the download while it runs,
and back at the daemon's nice once it is over."""

from __future__ import annotations

import os
import threading

import pytest

from dsecd.fs.pull import CONVERT_NICE, _BelowTheDownload

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority back needs CAP_SYS_NICE")


def test_conversion_threads_yield_during_the_download_only():
    niced = _BelowTheDownload()
    seen: dict[str, int] = {}
    entered, over = threading.Event(), threading.Event()

    def thread():
        niced.enter()
        seen["during"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        entered.set()
        over.wait(10)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=thread)
    t.start()
    assert entered.wait(10)
    niced.download_over()
    over.set()
    t.join()
    late = {}

    def later():                    # a thread the pool starts after the download: not niced
        niced.enter()
        late["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=later)
    t.start()
    t.join()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert seen == {"during": max(base, CONVERT_NICE), "after": base} and late == {"nice": base}
