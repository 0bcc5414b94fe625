"""dsecd/server.py routes each request type to one handler (dsecd/node.py
routes): every op of the protocol has exactly one, on the service that owns
it or, until it moves there, on the node."""

from __future__ import annotations

import inspect

from dsecd import node, protocol
from dsecd.engine.calls import CallService
from dsecd.engine.events import EventBus
from dsecd.engine.execs import ExecService
from dsecd.engine.files import FileService
from dsecd.engine.images import ImageService
from dsecd.engine.lifetimes import LifetimeService
from dsecd.engine.memory import MemoryService
from dsecd.engine.network import NetworkService

# The type of the service each attribute of the node named in SERVICE_ROUTES holds.
SERVICES = {"exec_service": ExecService, "file_service": FileService, "image_service": ImageService,
            "net_service": NetworkService, "memory": MemoryService, "lifetimes": LifetimeService,
            "events": EventBus, "call_service": CallService}


def test_every_request_type_has_one_handler():
    for op in protocol.REQUESTS:
        if op in node.SERVER_OPS:
            assert not hasattr(node.Node, f"op_{op}"), f"{op} is the server's"
            continue
        if op in node.SERVICE_ROUTES:
            service, method = node.SERVICE_ROUTES[op]
            handler = getattr(SERVICES[service], method, None)
            assert handler is not None, f"{op}: {SERVICES[service].__name__}.{method} is missing"
            assert not hasattr(node.Node, f"op_{op}"), f"{op} is handled twice"
        else:
            handler = getattr(node.Node, f"op_{op}", None)
            assert handler is not None, f"no handler for op {op!r}"
        assert inspect.iscoroutinefunction(handler), op
        assert list(inspect.signature(handler).parameters)[1:] == ["req", "ctx"], op


def test_routes_name_only_real_ops():
    assert set(node.SERVICE_ROUTES) <= set(protocol.REQUESTS)
    assert {s for s, _ in node.SERVICE_ROUTES.values()} <= set(SERVICES)
