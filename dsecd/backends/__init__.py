"""Sandbox backends (docs/architecture.md).

container.py    namespaces, cgroups, overlay over EROFS layers, dsec-init as PID 1
fncall.py       call sandboxes and their zygotes, for stateless function calls
zygote_main.py  the zygote: a pre-imported Python that forks one worker per call
"""
