"""The host's CPU, per sandbox (README "CPU: QoS classes, admission, sampling").

qos.py        classes: best-effort (cpu.idle, SCHED_IDLE) and latency-sensitive
admission.py  oversubscription arithmetic: does one more sandbox fit?
sampler.py    cgroup counters, PSI and psutil sampled for top, info, placement
manager.py    CpuHost: the node's one entry point to the above
"""
