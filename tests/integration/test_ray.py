"""dsecd.ray on a local Ray cluster: two Ray nodes on this machine (a head
and one more raylet, ray.cluster_utils.Cluster), each
advertising the `dsec` resource, each node's actor talking to a test daemon
of its own. Creates, execs, files and a job's pause and resume go through
RayFleet; an actor killed with ray.kill marks its host down with its
sandboxes lost, and the host rejoins with a new actor; a raylet removed
and started again (a new node id) takes its host down and back.

Ray is an optional extra: these tests skip without it (`pip install
dsecd[ray]`, or DSECD_SETUP_RAY=1 scripts/setup.sh). The cluster's
processes are the ones Cluster started, stopped by Cluster.shutdown (by
their pids). Ray listens on this machine's own address (Cluster given
node_ip_address 127.0.0.1 never saw its GCS come up with Ray 2.60), so
its traffic stays on this machine. Ray's files, its address file included, go to a private
RAY_TMPDIR, so another Ray on this machine is neither seen nor touched.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import Daemon

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'dsecd[ray]' "
                                        "(or DSECD_SETUP_RAY=1 scripts/setup.sh)")

SMALL = {"cpu": 0.1, "memory": "64M"}
DOWN_BOUND_S = 10.0        # an actor's death is seen at the next heartbeat (0.5 s here); slack for a loaded host


@pytest.fixture(scope="module")
def cluster(busybox_rootfs):
    """Two daemons with busybox, and a Ray cluster of two dsec nodes."""
    from ray.cluster_utils import Cluster

    daemons = [Daemon(Path(tempfile.mkdtemp(prefix="dsecd-test-"))) for _ in range(2)]
    # Short: Ray's unix sockets live under it (108 bytes at most).
    ray_tmp = tempfile.mkdtemp(prefix="dsr-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    c = None
    try:
        for d in daemons:
            d.start()
            client = d.client()
            client.import_image(busybox_rootfs, "busybox")
            client.close()
        node_args = {"num_cpus": 1, "resources": {"dsec": 1}}
        c = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        second = c.add_node(**node_args)
        ray.init(address=c.address, logging_level="warning", log_to_driver=False)
        ids = [c.head_node.node_id, second.node_id]
        yield {"sockets": {nid: d.socket for nid, d in zip(ids, daemons, strict=True)}, "daemons": daemons,
               "node_ids": ids, "cluster": c, "second": second, "node_args": node_args}
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        for d in daemons:
            d.cleanup()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(ray_tmp, ignore_errors=True)


async def next_event(events, want: str, timeout: float) -> dict:
    async with asyncio.timeout(timeout):
        async for ev in events:
            if ev["event"] == want:
                return ev
    raise AssertionError(f"the fleet's events ended before {want}")


def test_ray_fleet_places_execs_pauses_and_survives_a_killed_actor(cluster):
    import dsecd.ray

    async def go():
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], heartbeat_s=0.5, down_after_s=3.0,
                                   rejoin_s=0.5)
        async with fleet:
            targets = sorted(fleet.hosts)
            assert len(targets) == 2 and all(s["up"] for s in fleet.status()), fleet.status()
            # The fleet's own placement: one job's sandboxes spread evenly over the two nodes.
            sbs = await asyncio.gather(*(fleet.create(image="busybox", labels={"job": "rj"}, **SMALL)
                                         for _ in range(4)))
            per_host = {t: sum(sb.host == t for sb in sbs) for t in targets}
            assert per_host == {t: 2 for t in targets}, per_host
            results = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sbs))
            assert [r.stdout for r in results] == [f"{sb.id}\n".encode() for sb in sbs]
            data = os.urandom(3 << 20)
            await sbs[0].write_file("/tmp/blob", data)
            assert await sbs[0].read_file("/tmp/blob") == data
            streamed = [chunk async for _fd, chunk in sbs[1].exec_stream(["sh", "-c", "echo a; echo b"])]
            assert b"".join(streamed) == b"a\nb\n"

            paused = await fleet.job_pause("rj")
            assert sorted(paused["paused"]) == sorted(sb.id for sb in sbs), paused
            assert {r["state"] for r in await fleet.list({"job": "rj"})} == {"paused"}
            resumed = await fleet.job_resume("rj")
            assert sorted(resumed["resumed"]) == sorted(sb.id for sb in sbs), resumed
            assert (await sbs[2].exec("true")).exit_code == 0

            # Kill one host's actor: Ray reports it dead, the fleet marks the host down.
            victim = fleet.hosts[targets[0]]
            on_victim = sorted(sb.id for sb in sbs if sb.host == victim.target)
            events = fleet.events()
            started = time.monotonic()
            ray.kill(victim.client._actor, no_restart=True)
            down = await next_event(events, "host_down", DOWN_BOUND_S)
            detect_s = time.monotonic() - started
            assert down["host"] == victim.target and sorted(down["sandboxes"]) == on_victim, down
            assert not victim.up
            # Placement avoids it meanwhile.
            extra = await fleet.create(image="busybox", **SMALL)
            assert extra.host == targets[1]
            # A new actor on the same node: the host is back with its sandboxes.
            up = await next_event(events, "host_up", 20.0)
            assert up["host"] == victim.target and sorted(up["back"]) == on_victim, up
            back_sb = next(sb for sb in sbs if sb.host == victim.target)
            assert (await back_sb.exec("true")).exit_code == 0
            await events.aclose()
            await extra.destroy(force=True)
            gone = await fleet.job_rm("rj", force=True)
            assert sorted(gone["destroyed"]) == sorted(sb.id for sb in sbs), gone
            print(f"ray: actor death seen in {detect_s:.2f} s")

    asyncio.run(go())


def test_ray_fleet_refuses_a_fed_stream_with_a_reason(cluster):
    import dsecd.ray
    from dsecd.errors import Unsupported

    async def go():
        async with dsecd.ray.RayFleet(sockets=cluster["sockets"]) as fleet:
            sb = await fleet.create(image="busybox", **SMALL)
            try:
                with pytest.raises(Unsupported, match="ssh://"):
                    await sb.exec("cat", stdin=b"x")
            finally:
                await sb.destroy(force=True)

    asyncio.run(go())


def test_ray_fleet_host_of_a_restarted_raylet_rejoins(cluster):
    """The second node's raylet goes (Cluster.remove_node: its processes,
    by pid) and a new one starts: Ray gives it a new node id. The host (the
    daemon's socket on this machine) rejoins through an actor on whichever
    dsec node at this machine's address Ray has alive first (the head here,
    or the new raylet), its sandbox still running."""
    import dsecd.ray

    async def go():
        fleet = dsecd.ray.RayFleet(sockets=cluster["sockets"], heartbeat_s=0.5, down_after_s=3.0,
                                   rejoin_s=0.5)
        async with fleet:
            second = cluster["daemons"][1].socket
            host = next(h for h in fleet.hosts.values() if h.target.endswith(second))
            sb = await fleet.create(image="busybox", labels={"job": "rn"}, **SMALL)
            while sb.host != host.target:           # one on the second node's daemon
                sb = await fleet.create(image="busybox", labels={"job": "rn"}, **SMALL)
            events = fleet.events()
            old_node = host.client.node_id
            await asyncio.to_thread(cluster["cluster"].remove_node, cluster["second"])
            down = await next_event(events, "host_down", 60.0)
            assert down["host"] == host.target and sb.id in down["sandboxes"], down
            # In this thread: Ray sets signal handlers there. The loop waits the seconds it takes.
            cluster["second"] = cluster["cluster"].add_node(**cluster["node_args"])
            up = await next_event(events, "host_up", 60.0)
            assert up["host"] == host.target and sb.id in up["back"], up
            assert host.client.node_id != old_node
            assert (await sb.exec(["echo", "back"])).stdout == b"back\n"
            await events.aclose()
            await fleet.job_rm("rn", force=True)

    asyncio.run(go())
