"""dsecd/server.py routes each request type to one handler (dsecd/node.py
SERVICE_ROUTES): every op of the protocol but the server's own has exactly
one, a coroutine taking (req, ctx) on the service that owns it."""

from __future__ import annotations

import inspect

from dsecd import node, protocol
from dsecd.engine.builds import BuildService
from dsecd.engine.calls import CallService
from dsecd.engine.creates import CreateService
from dsecd.engine.dircopies import DirCopyService
from dsecd.engine.events import EventBus
from dsecd.engine.execs import ExecService
from dsecd.engine.files import FileService
from dsecd.engine.images import ImageService
from dsecd.engine.lifecycle import LifecycleService
from dsecd.engine.lifetimes import LifetimeService
from dsecd.engine.memory import MemoryService
from dsecd.engine.network import NetworkService
from dsecd.engine.policies import PolicyService
from dsecd.engine.procs import ProcessService
from dsecd.engine.watches import WatchService

# The type of what each attribute of the node named in SERVICE_ROUTES holds.
SERVICES = {"node": node.Node, "create_service": CreateService, "lifecycle": LifecycleService,
            "exec_service": ExecService, "file_service": FileService, "image_service": ImageService,
            "net_service": NetworkService, "memory": MemoryService, "lifetimes": LifetimeService,
            "events": EventBus, "call_service": CallService, "watch_service": WatchService,
            "dir_copies": DirCopyService, "procs": ProcessService, "builds": BuildService,
            "policies": PolicyService}


def test_every_request_type_has_one_handler():
    assert set(node.SERVICE_ROUTES) == set(protocol.REQUESTS) - set(node.SERVER_OPS)
    for op, (service, method) in node.SERVICE_ROUTES.items():
        handler = getattr(SERVICES[service], method, None)
        assert handler is not None, f"{op}: {SERVICES[service].__name__}.{method} is missing"
        assert inspect.iscoroutinefunction(handler), op
        assert list(inspect.signature(handler).parameters)[1:] == ["req", "ctx"], op


def test_no_service_is_reached_through_a_mixin():
    assert node.Node.__bases__ == (object,)
    assert not [name for name in dir(node.Node) if name.startswith("op_")]
