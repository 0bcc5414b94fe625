"""dsecd.mem: the host's memory, per sandbox (docs/memory.md).

pause.py   freeze/thaw, reclaim, working set, prefetch
zram.py    dsecd's own zram swap device
damon.py   dsecd's own kdamond: cold-page pageout per sandbox memcg
"""
