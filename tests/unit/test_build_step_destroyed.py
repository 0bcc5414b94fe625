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


class _Handle:
    group = None


@pytest.mark.parametrize("when", ["before its freeze", "while it froze"])
def test_a_step_whose_sandbox_was_destroyed_before_its_pack_says_so(when, monkeypatch):
    """A destroy from outside the build once the step's command is done
    (before the pack, or while the sandbox is frozen for it) fails the
    build with the step's line and what happened, not with the freeze's
    "cannot freeze it" or the state check's "is stopping"."""
    from functools import partial

    from dsecd.engine import images as images_mod
    from dsecd.engine.images import ImageService

    instruction = STEPS[WORKDIR][0]
    step = Step(n=2, instruction=instruction, kind=WORKDIR, text=str(instruction), config=ImageConfig(),
                argv=[], dest="/app")
    registry = SandboxRegistry(None)
    sb = Sandbox(id="b-1", image="build:app", state="running", created=0.0, limits={"cpu": 1, "memory": 1 << 20})
    sb.handle = _Handle()
    registry.by_id[sb.id] = sb

    def destroy_from_outside() -> None:
        sb.state = "stopping"
        del registry.by_id[sb.id]

    def freeze(_timeout) -> None:
        destroy_from_outside()         # its cgroup is gone
        raise FileNotFoundError(2, "No such file or directory", "cgroup.freeze")

    monkeypatch.setattr(images_mod.pause.Freezer, "of", classmethod(lambda cls, group: SimpleNamespace(freeze=freeze)))

    def behind(fn, *args):
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except Exception as err:        # noqa: BLE001 -- handed to the awaiter, as a worker does
            fut.set_exception(err)
        return fut

    fake = SimpleNamespace(workers=SimpleNamespace(behind=behind), freeze_timeout_s=1.0, registry=registry)
    destroyed = []

    async def destroy(sb_, force, reason):
        destroyed.append(sb_.id)

    svc = SimpleNamespace(registry=registry, destroy=destroy,
                          images=SimpleNamespace(images=SimpleNamespace(max_layer_bytes=1 << 30),
                                                 snapshot_exclude=[],
                                                 frozen_upper=partial(ImageService.frozen_upper, fake)))
    build = _Build(svc, SimpleNamespace(name="app", dockerfile_name=None), None)

    async def sandbox(_step, _image, _networked):
        return sb

    async def workdir(_sb, _step):
        if when == "before its freeze":
            destroy_from_outside()

    build._sandbox, build._workdir = sandbox, workdir
    with pytest.raises(DsecError) as caught:
        asyncio.run(build._in_sandbox(step, None, []))
    err = caught.value
    assert err.message == "Dockerfile:4: pack the changes of WORKDIR: the step's sandbox b-1 was destroyed meanwhile"
    assert err.code == "conflict" and err.detail["line"] == 4 and err.detail["sandbox"] == "b-1"
    assert destroyed == []          # not the build's to destroy again (refused, logged as an error)


def test_a_run_killed_by_a_destroy_of_its_sandbox_says_so():
    """A RUN whose step sandbox a destroy from outside the build took while
    it ran was killed by that destroy (the exec's killed_by "destroy"): the
    build says the step's sandbox was destroyed meanwhile, not that the
    RUN failed with signal 9 as if the command had crashed."""
    instruction = Instruction(line=4, cmd="RUN", args="make", original="RUN make")
    step = Step(n=2, instruction=instruction, kind=RUN, text=str(instruction), config=ImageConfig(),
                argv=["/bin/sh", "-c", "make"], dest="/app")
    sb = Sandbox(id="b-1", image="build:app", state="stopping", created=0.0, limits={})
    accounts = SimpleNamespace(process_ids=lambda user: SimpleNamespace(uid=0, gid=0, groups=[]),
                               home=lambda user: "/root")

    async def run_streamed(sb_, argv, env, cwd, ids, timeout, emit):
        return {"exit_code": None, "signal": 9, "timed_out": False, "killed_by": "destroy", "destroyed_by": "all"}

    svc = SimpleNamespace(registry=SandboxRegistry(None), execs=SimpleNamespace(run_streamed=run_streamed),
                          limits=SimpleNamespace(run_timeout_s=0, memory=1 << 30),
                          images=SimpleNamespace(images=SimpleNamespace(max_layer_bytes=1 << 30)))
    build = _Build(svc, SimpleNamespace(name="app", dockerfile_name=None), None)

    async def files(_sb, _step, fn, *args, stop=None):
        return accounts

    build._files = files
    with pytest.raises(DsecError) as caught:
        asyncio.run(build._run(sb, step))
    err = caught.value
    assert err.message == ("Dockerfile:4: RUN: the step's sandbox b-1 was destroyed meanwhile, "
                           "by a destroy of all sandboxes")
    assert err.code == "conflict" and err.detail["line"] == 4 and err.detail["sandbox"] == "b-1"
