"""A build step whose sandbox is destroyed from outside the build (`dsec
rm --all`, a job's rm) before the step reaches its files
(dsecd/engine/builds.py): the build fails naming the Dockerfile line of
the step, as every other step error does, and saying what happened."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dsecd.build.dockerfile import Instruction
from dsecd.build.plan import COPY, RUN, WORKDIR, ImageConfig, Step
from dsecd.engine.builds import _Build
from dsecd.engine.sandboxes import Sandbox, SandboxRegistry
from dsecd.errors import DsecError

STEPS = {
    RUN: (Instruction(line=4, cmd="RUN", args="make", original="RUN make"), "_run"),
    COPY: (Instruction(line=4, cmd="COPY", args="src /src", original="COPY src /src"), "_copy"),
    WORKDIR: (Instruction(line=4, cmd="WORKDIR", args="/app", original="WORKDIR /app"), "_workdir"),
}


@pytest.mark.parametrize("kind", sorted(STEPS))
def test_a_step_whose_sandbox_was_destroyed_says_its_dockerfile_line(kind):
    instruction, method = STEPS[kind]
    step = Step(n=2, instruction=instruction, kind=kind, text=str(instruction), config=ImageConfig(),
                argv=["/bin/sh", "-c", "make"], dest="/app")
    registry = SandboxRegistry(None)
    # What a destroy leaves of it: no root, no longer listed.
    sb = Sandbox(id="b-1", image="build:app", state="stopping", created=0.0, limits={})
    svc = SimpleNamespace(registry=registry, images=SimpleNamespace(images=SimpleNamespace(max_layer_bytes=1 << 30)))
    build = _Build(svc, SimpleNamespace(name="app", dockerfile_name=None), None)
    args = (sb, step, []) if kind == COPY else (sb, step)
    with pytest.raises(DsecError) as caught:
        asyncio.run(getattr(build, method)(*args))
    err = caught.value
    assert err.message == f"Dockerfile:4: {instruction.cmd}: the step's sandbox b-1 was destroyed meanwhile"
    assert err.code == "conflict" and err.detail["line"] == 4 and err.detail["file"] == "Dockerfile"
