"""Sandbox networking as the engine sees it: --net default|none, --allow
rules, `net show`, `net set`, and a sandbox's network at create and destroy.

The mechanisms (bridge, veth, IPAM, eBPF allowlists) are dsecd/net/. The
eBPF programs are loaded at daemon start in a background thread (net.preload:
from the cached compiled object, ~0.2 s; the first start compiles it in a
helper process, seconds), never on the event loop. The Network itself (bridge,
IPAM, netns pool) is built on first need - the first `--net default` create,
or at start when a journaled sandbox has networking or net.uplink is set, or
in the background after a start on a host that uses networking (the bridge is
there, or --net default is the default mode) - and waits for that load only
while it is not done. Where it cannot be built (no bcc and no cached
object, no cgroup v2), `--net none` keeps working, `--net default` answers
`unsupported`, and `dsec info` says why.

With net.dns (the default) the sandboxes' resolver (dsecd/net/dns.py) starts
with the Network, on the event loop, and each --net default sandbox gets an
/etc/resolv.conf naming it, written into its writable layer at create.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import logging
import os
import threading

from .. import cgroup
from ..config import ConfigError
from ..errors import BadRequest, Conflict, DsecError, Unsupported, io_error
from ..fs import files as sbfiles
from ..protocol import check_protocol, published_port
from .sandboxes import SandboxRegistry, in_root
from .workers import Workers

log = logging.getLogger(__name__)


def _check_config(net: dict, max_sandboxes: int) -> None:
    """ConfigError for a [net] setting the network could not be built with.
    They are read when it is built, maybe at the first --net default create:
    a bad one must stop the start, not leave networking unavailable with
    the daemon up."""
    from ..net import rules as R
    from ..net.ipam import Ipam

    # Learned addresses get a quarter of the trie, and each sandbox a
    # reserved share of it (Network.learned_shares), at least one: below
    # one a sandbox, sandboxes at their cap could starve the others.
    learns = net.get("dns", True) and min(int(net.get("dns_max_learned", 256)), int(net["max_rules_per_sandbox"])) > 0
    if learns and int(net["max_prefixes"]) // 4 < max(1, int(max_sandboxes)):
        raise ConfigError(
            f"net.max_prefixes = {net['max_prefixes']} leaves {int(net['max_prefixes']) // 4} (a quarter) for the "
            f"addresses the sandboxes' resolver learns, less than one for each of limits.max_sandboxes = "
            f"{max_sandboxes}: give net.max_prefixes at least {4 * max(1, int(max_sandboxes))}, or fewer "
            "limits.max_sandboxes, or net.dns_max_learned = 0 (name rules then allow nothing)")

    try:
        sets = R.parse_rule_sets(net.get("rule_sets", {}))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    for term in net.get("essentials", []):
        try:
            R.canonical_term(term, sets)
        except BadRequest as err:
            raise ConfigError(f"net.essentials: {err.message}") from err
    # Each network alone first, so that the error names its key; then how
    # they fit together, which Ipam's errors name.
    for key, net_of in (("ipv4_subnet", ipaddress.IPv4Network), ("ipv4_pool", ipaddress.IPv4Network),
                        ("ipv6_subnet", ipaddress.IPv6Network)):
        if net[key] or key == "ipv4_subnet":
            try:
                net_of(net[key])
            except ValueError as err:
                raise ConfigError(f"net.{key}: {err}") from err
    try:
        Ipam(net["ipv4_subnet"], net["ipv4_pool"], net["ipv6_subnet"])
    except ValueError as err:
        raise ConfigError(str(err)) from err


# A detach that failed is tried again after these many seconds each (the
# kernel refusing to delete a veth, nftables a rule: often passing). The
# last retry is ~16 minutes after the destroy; after that the next daemon
# start removes what is left.
DETACH_RETRY_S = (1.0, 5.0, 30.0, 120.0, 800.0)


# What a sandbox cut off at a restart has left when its veth could not be deleted.
SEALED = "its veth could not be deleted, so all of its traffic is refused, loopback too"


class NetworkService:
    """`backend` destroys a sandbox whose create was cancelled mid-spawn
    (spawn_joining); `cgroup_root` and `max_sandboxes` size and place the
    eBPF programs and maps."""

    def __init__(self, cfg, layout: cgroup.Layout, cgroup_root: str, max_sandboxes: int,
                 registry: SandboxRegistry, workers: Workers, backend):
        self.net_cfg = cfg.section("net")
        self.state_dir = cfg.state_dir
        self.layout = layout
        self.cgroup_root = cgroup_root
        self.max_sandboxes = max_sandboxes
        self.registry = registry
        self.workers = workers
        self.backend = backend
        self.net = None
        self.net_error: str | None = None
        self.resolver = None
        self.dns_error: str | None = None
        self.address_watch = None
        self.address_watch_error: str | None = None
        self.events = None                  # the node's EventBus: `net_lost` (set by the node)
        self._lost: dict[str, str] = {}     # what the last build could not re-adopt: sandbox id -> why
        self._held: list[str] = []          # gone sandboxes whose leftovers the last build could not remove
        self._detach_retries: dict[str, asyncio.Task] = {}     # sandbox id -> its detach, retried
        self.detach_retry_s = DETACH_RETRY_S
        self._net_ready: asyncio.Future | None = None
        self._warmup: asyncio.Task | None = None
        self._bpf_loader: threading.Thread | None = None
        _check_config(self.net_cfg, max_sandboxes)

    async def network(self):
        """The Network, built once (in a worker thread) on first use."""
        if self._net_ready is None:
            self._net_ready = self.workers.loop.create_future()
            # A microVM's netns is its guest's: the Network re-adopts it by its record ("kind": "vm").
            live = {s.id: ("vm" if s.backend == "microvm" else s.handle.init_pid,
                           str(s.handle.group.dirs["unified"]))
                    for s in self.registry.by_id.values()
                    if _networked(s) and s.handle is not None}
            try:
                self.net = await self.workers.run(self._build_network, live)
                self._report_lost()
                held, self._held = self._held, []
                for sb_id in held:
                    self._retry_detach(sb_id)
                self._watch_host_addresses(self.net)
                await self._start_resolver(self.net)
                self._net_ready.set_result(self.net)
            except Exception as err:       # no bcc, no v2 tree, compile error: degrade, say why
                self.net_error = f"{type(err).__name__}: {err}"
                log.error("networking unavailable (--net default refused): %s", self.net_error)
                self._net_ready.set_result(None)
        net = await asyncio.shield(self._net_ready)
        if net is None:
            raise Unsupported(f"--net default is unavailable on this host: {self.net_error}")
        return net

    def _watch_host_addresses(self, net) -> None:
        """Keep the egress fences on the host's addresses as they change. If
        that cannot be watched, they stay as they were at start, which
        `dsec info` says (net.fences)."""
        from ..net.addrwatch import HostAddressWatch

        watch = HostAddressWatch(net.plumbing.ns_path, net.refresh_host_fences, net.fences_pending,
                                 self.workers.run, self.workers.loop)
        try:
            watch.start()
        except OSError as err:
            self.address_watch_error = f"the host's addresses are fenced as they were at start: {err}"
            log.error("%s", self.address_watch_error)
            return
        self.address_watch = watch

    def _fences_info(self) -> dict:
        """The host addresses fenced off from broad egress rules, and whether they follow changes."""
        out = {"host_addresses": [str(n.network_address) for n in self.net.host_nets],
               "follows_changes": self.address_watch is not None}
        if self.address_watch_error:
            out["error"] = self.address_watch_error
        return out

    async def _start_resolver(self, net) -> None:
        """The sandboxes' resolver; if it cannot start, networking works without
        it (names resolve nowhere) and `dsec info` says why."""
        if not net.dns_enabled:
            return
        from ..net.dns import Resolver

        try:
            resolver = Resolver(net, self.net_cfg, self.workers.run)
            await resolver.start()
            self.resolver = resolver
        except (OSError, ValueError) as err:
            self.dns_error = str(err)
            log.error("the sandboxes' resolver did not start (name rules resolve nothing): %s", err)
            await self.workers.run(net.resolver_gone)

    def _build_network(self, live: dict):
        """Build, then re-adopt the live sandboxes' networking and free what the records
        hold for the rest (also when no live sandbox has networking: leases, veths)."""
        from ..net import Network

        if self.layout.v2 is None:
            raise RuntimeError("no cgroup v2 hierarchy to attach the eBPF programs to")
        net = Network(self.net_cfg, self.state_dir, self.layout.v2, self.cgroup_root,
                      max_sandboxes=self.max_sandboxes)
        try:
            res = net.readopt(live)
        except BaseException:
            net.close()
            raise
        self._lost = {}
        self._held = list(res.get("held", ()))
        for sb_id, why in res.get("failed", {}).items():
            if sb_id in res.get("sealed", ()):
                why += f"; {SEALED}"
            else:
                why += "; it keeps loopback only"
            log.error("sandbox %s lost its networking across the restart (%s)", sb_id, why)
            self._lost[sb_id] = why
        return net

    def _report_lost(self) -> None:
        """On the loop, after the build: each sandbox whose networking could
        not be re-adopted runs on cut off (fail closed). Its record says so
        (`dsec ps`, inspect, net show and set answer with it) and a
        `net_lost` event tells whoever follows the events."""
        lost, self._lost = self._lost, {}
        for sb_id, why in lost.items():
            sb = self.registry.by_id.get(sb_id)
            if sb is None:
                continue
            sb.net = {"mode": "default", "lease": None,
                      "lost": f"its networking could not be re-adopted when the daemon restarted ({why}): "
                              "destroy it and create another"}
            try:
                self.registry.save(sb)
            except OSError as err:
                log.error("sandbox %s: journal that it lost its networking: %s", sb_id, err)
            if self.events is not None:
                self.events.publish("net_lost", sb_id, reason=why)

    def _check_not_lost(self, sb) -> None:
        """Conflict for a sandbox cut off by a failed readopt: its networking is gone for good."""
        if sb.net and sb.net.get("lost"):
            raise Conflict(f"sandbox {sb.id}: {sb.net['lost']}", {"sandbox": sb.id})

    def net_mode(self, req) -> str:
        mode = req.net or self.net_cfg["default_mode"]
        if mode not in ("none", "default"):
            raise BadRequest(f"net must be 'none' or 'default', got {mode!r}")
        if mode == "none" and req.allow:
            raise BadRequest("--allow needs --net default (--net none is loopback only)")
        if mode == "none" and req.publish:
            raise BadRequest("--publish needs --net default (--net none has no address to publish)")
        for spec in req.publish or ():
            published_port(spec)            # a bad one is said before anything is made
        return mode

    async def take_netns(self, mode: str):
        """Before the container is spawned: a ready netns from the pool for it to
        join (dsecd/net/pool.py), or None (--net none, pool off or empty)."""
        if mode != "default":
            return None
        return (await self.network()).take_ready()      # never blocks: a list pop

    async def spawn_joining(self, create, ready, after_abandoned, *args):
        """backend.create(*args, netns_fd) in a worker, PID 1 joining `ready`'s netns.

        `ready` is removed if the spawn fails, or if the create is cancelled - but
        never while the worker may still pass its fd to the spawn (a closed, or
        worse reused, fd number would put the sandbox in some other namespace).
        Once a cancel reached this call, after_abandoned() runs on the loop when
        the worker is done and what it made is destroyed: what the sandbox
        uses (its id range, its layers) is released there, not before."""
        abandoned = functools.partial(self._abandoned_create, args[0], after_abandoned)
        if ready is None:
            return await self.workers.run_shielded(abandoned, create, *args, -1)
        lock, st = threading.Lock(), {"busy": False, "abandoned": False}

        def work():
            with lock:
                if st["abandoned"]:
                    return None
                st["busy"] = True
            try:
                return create(*args, ready.nsfd)
            finally:
                with lock:
                    st["busy"] = False
                    release = st["abandoned"]
                if release:                       # cancelled while we worked
                    self.net.release_ready(ready)

        try:
            return await self.workers.run_shielded(abandoned, work)
        except asyncio.CancelledError:
            with lock:
                st["abandoned"] = True
                busy = st["busy"]
            if not busy:
                self.release_netns(ready)
            raise
        except BaseException:
            self.release_netns(ready)
            raise

    def _abandoned_create(self, sb_id: str, after_abandoned, fut: asyncio.Future) -> None:
        """A create cancelled during its spawn: the sandbox its worker still
        made is destroyed, not left running unrecorded until the next start's
        orphan sweep; then after_abandoned() runs (on the loop)."""
        def release() -> None:
            try:
                after_abandoned()
            except Exception:
                log.exception("release what the cancelled create of sandbox %s held", sb_id)

        if fut.cancelled() or fut.exception() is not None or fut.result() is None:
            release()
            return

        def destroy() -> None:
            try:
                self.backend.destroy(sb_id, fut.result())
            except Exception as err:
                log.error("destroy sandbox %s, whose create was cancelled: %s", sb_id, err)
            self.workers.loop.call_soon_threadsafe(release)

        self.workers.behind(destroy)

    def release_netns(self, ready) -> None:
        """The spawn that was to join `ready` failed: remove it, behind the answer."""
        if ready is None or self.net is None:
            return

        def release() -> None:
            try:
                self.net.release_ready(ready)
            except Exception as err:
                log.error("remove pooled netns %s: %s", ready.name, err)

        self.workers.behind(release)

    async def attach_net(self, sb, mode: str, allow: list[str], ready=None) -> None:
        """After the container exists: policy first, then the veth (never a link without policy);
        with `ready`, the netns its PID 1 joined at spawn.

        A create cancelled meanwhile (client gone, `cancel`) must not leave networking
        behind for a sandbox the node then destroys: the worker undoes its attach if it
        finishes after the cancellation, and a `ready` nobody consumed is removed."""
        if mode == "none":
            return
        try:
            net = await self.network()
            await self.check_names(net, allow)
        except BaseException:
            self.release_netns(ready)
            raise
        h = sb.handle
        args = (sb.id, h.init_pid, str(h.group.dirs["unified"]), list(allow), mode, ready)
        lock, st = threading.Lock(), {"started": False, "done": False, "abandoned": False}

        def work():
            with lock:
                if st["abandoned"]:
                    return None
                st["started"] = True
            view = net.attach(*args)       # on failure it undoes itself (and removes `ready`)
            with lock:
                st["done"] = True
                undo = st["abandoned"]
            if undo:
                net.detach(sb.id)
            return view

        try:
            view = await self.workers.run(work)
        except OSError as err:
            raise io_error("attach networking of sandbox", sb.id, err) from err
        except asyncio.CancelledError:
            with lock:
                st["abandoned"] = True
                started, done = st["started"], st["done"]
            if not started:
                self.release_netns(ready)
            elif done:
                self.workers.behind(net.detach, sb.id)
            raise
        sb.net = {"mode": mode, "lease": view.get("lease")}
        files = {"/etc/hosts": hosts_text(sb.hostname, view.get("lease") or {})}
        if net.dns_enabled:
            files["/etc/resolv.conf"] = f"nameserver {net.ipam.gateway4}\n"
        try:
            # On a copy of the root: a cancelled create's undo closes the handle's.
            await in_root(self.workers, sb, write_net_files, files)
        except BaseException as err:
            # Attached, but the create fails (or was cancelled) before it
            # registers the detach: its slot, lease and policy go now.
            self.workers.behind(net.detach, sb.id)
            if isinstance(err, (OSError, sbfiles.PathError)):
                raise io_error("write /etc/hosts and /etc/resolv.conf of sandbox", sb.id, err) from err
            raise

    async def attach_vm_net(self, sb, allow: list[str]) -> None:
        """A microVM's policy and lease, before its QEMU starts (its tap comes
        with each QEMU: MicroVMService). A create cancelled meanwhile leaves
        nothing: what the worker attached after the cancel is detached."""
        net = await self.network()
        await self.check_names(net, allow)

        def abandoned(fut) -> None:
            if not fut.cancelled() and fut.exception() is None:
                self.workers.behind(net.detach, sb.id)

        try:
            view = await self.workers.run_shielded(abandoned, net.attach_vm, sb.id, list(allow))
        except OSError as err:
            raise io_error("attach networking of sandbox", sb.id, err) from err
        sb.net = {"mode": "default", "lease": view.get("lease")}

    async def check_names(self, net, terms: list[str]) -> None:
        """BadRequest for name rules (given, or in a named set) while the
        sandboxes' resolver does not run: a name is allowed only through
        the addresses the resolver answers, so such a rule would be taken
        and then allow nothing, and the sandbox only see lookups fail. A
        request too large is refused before it is parsed, and the parse
        (~30 us a term) runs in a worker, not on the loop every client
        shares."""
        if self.resolver is not None or not terms:
            return
        # As small as Network.update_now applies on the loop: no thread hop for those.
        from ..net.network import INLINE_MAX_RULES
        terms = list(dict.fromkeys(terms))
        size = net.expanded_size(terms)
        net.check_request_size(size)
        if size <= INLINE_MAX_RULES:
            names = _name_rules(net.sets, terms)
        else:
            names = await self.workers.run(_name_rules, net.sets, terms)
        if names:
            why = f"did not start: {self.dns_error}" if self.dns_error else "is off (net.dns = false)"
            raise BadRequest(f"name rules ({', '.join(names)}) allow the addresses the daemon's "
                             f"resolver answers, and its resolver {why}; give addresses (CIDR rules) instead",
                             {"names": names})

    async def detach_net(self, sb) -> None:
        """The sandbox's networking goes (its destroy or death). A detach
        that fails may keep its address leased and its record (a veth or a
        published port's DNAT that could not be deleted: Network._teardown);
        the sandbox leaves the registry anyway, so nothing would call it
        again before the next daemon start: it is retried in the background,
        DETACH_RETRY_S apart. The retries need no journal of their own: the
        record the failed detach kept is it. A daemon that stops (or dies)
        between tries leaves that record, and the next start's readopt
        removes what it names, as for any record no live sandbox has; what
        it cannot remove then (`held`) is retried the same way (network())."""
        if self.net is None or not _networked(sb):
            return
        try:
            await self.workers.run(self.net.detach, sb.id)
        except (OSError, DsecError) as err:
            log.error("detach networking of sandbox %s: %s; retried in the background", sb.id, err)
            self._retry_detach(sb.id)

    def _retry_detach(self, sb_id: str) -> None:
        if sb_id in self._detach_retries:
            return
        task = self.workers.loop.create_task(self._detach_later(self.net, sb_id))
        self._detach_retries[sb_id] = task
        task.add_done_callback(lambda _t: self._detach_retries.pop(sb_id, None))

    async def _detach_later(self, net, sb_id: str) -> None:
        tries = len(self.detach_retry_s)
        for i, delay in enumerate(self.detach_retry_s, 1):
            await asyncio.sleep(delay)
            work = asyncio.ensure_future(self.workers.run(net.retry_detach, sb_id))
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                # The daemon stops: a try under way in its worker ends
                # before close_net closes what it uses.
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()
                raise
            except (OSError, DsecError) as err:
                log.error("sandbox %s: detach its networking again (try %d of %d): %s", sb_id, i, tries, err)
                continue
            log.info("sandbox %s: its networking is detached (try %d of %d)", sb_id, i, tries)
            return
        log.error("sandbox %s: its networking could not be detached after %d more tries; what is left of it "
                  "(its address, its record) is removed at the next daemon start", sb_id, tries)

    def preload(self) -> None:
        """Daemon start: load (or first compile) the eBPF programs in the background."""
        if self.layout.v2 is None or not self.net_cfg.get("preload", True):
            return
        from ..net.network import bpf_cache_dir
        from ..net.policy import Engine

        self._bpf_loader = Engine.prepare(
            self.max_sandboxes, int(self.net_cfg["max_prefixes"]), int(self.net_cfg["max_counters"]),
            bpf_cache_dir(self.net_cfg, self.state_dir))

    async def readopt_net(self) -> None:
        """After the journal's sandboxes were re-adopted: building the Network re-adopts live sandboxes' policies and
        published ports and frees the leases of the rest (_build_network). With net.uplink set
        the Network is built now whatever: dsecd's nftables table (egress NAT) is made at start."""
        self.preload()
        if not self.net_cfg.get("uplink") and not any(
                _networked(s) for s in self.registry.by_id.values()):
            # Records of dead ones are freed whenever the Network is first built.
            if self.layout.v2 is not None and self.net_cfg.get("preload", True):
                self._warmup = self.workers.loop.create_task(self._build_if_in_use())
            return
        with contextlib.suppress(Unsupported):
            await self.network()

    async def _build_if_in_use(self) -> None:
        """In the background after a start: build the Network (bridge, IPAM, netns pool,
        resolver) if networking is used on this host - --net default is the default
        mode, or dsecd's bridge is there from an earlier daemon - so the first
        --net default create finds it ready instead of paying for it. A host that
        never used networking gets no bridge until a create asks for one."""
        from ..net.plumbing import bridge_exists

        if self.net_cfg["default_mode"] != "default" and not await self.workers.run(
                bridge_exists, self.net_cfg.get("host_netns", ""), self.net_cfg["bridge"]):
            return
        with contextlib.suppress(Unsupported):
            await self.network()

    async def close_net(self) -> None:
        if self._warmup is not None:
            # Not cancelled by a stop that gives up on this close (a Network
            # half built in a worker would leak its pool): only the stop's
            # last step cancels it, with every task left, just before the
            # daemon exits anyway (stopclock.end_what_is_left).
            await asyncio.shield(self._warmup)
        if self.resolver is not None:
            await self.resolver.close()
        if self.address_watch is not None:
            await self.address_watch.close()
        retries = list(self._detach_retries.values())
        for task in retries:
            task.cancel()         # what they would remove, the next daemon start does
        await asyncio.gather(*retries, return_exceptions=True)
        if self.net is not None:
            await self.workers.run(self.net.close)

    def starting(self) -> list[str]:
        """What the start-up work in the background is still doing. Until it
        is done the first --net default create waits for it, and the daemon
        is still opening the fds (programs, maps, pooled namespaces) it keeps."""
        out = []
        if self._bpf_loader is not None and self._bpf_loader.is_alive():
            out.append("loading the BPF programs")
        if self._warmup is not None and not self._warmup.done():
            out.append("building the network")
        elif self.net is not None:
            pool = self.net.pool.stats()
            if pool["ready"] < pool["size"] and "last_error" not in pool:
                out.append("filling the netns pool")
        return out

    def net_info(self) -> dict:
        out = self._net_info()
        starting = self.starting()
        if starting:
            out["starting"] = starting
        return out

    def _net_info(self) -> dict:
        if self.net is not None:
            dns = self.resolver.info() if self.resolver else {"error": self.dns_error or "off (net.dns)"}
            if self.resolver:
                dns["learned"] = self.net.learned_info()
            return {"available": True, "detail": f"bridge {self.net_cfg['bridge']}, "
                    f"{self.net_cfg['ipv4_subnet']}, eBPF allowlists loaded",
                    "pool": self.net.pool.stats(), "updates": self.net.update_stats(),
                    "bpf": dict(self.net.engine.load_stats), "nat": self.net.nat_info(),
                    "dns": dns, "fences": self._fences_info()}
        if self.net_error:
            return {"available": False, "detail": self.net_error}
        from ..net.policy import Engine

        out = {"available": None, "detail": "not started yet (on the first --net default create)"}
        loaded = Engine.loaded_stats()
        if loaded:
            out["bpf"] = loaded
        return out

    async def drop_totals(self) -> dict:
        """For the metrics: {"denied_connect", "denied_sendmsg",
        "dropped_packets", "dns": {outcome: count}}, over every sandbox this
        daemon networked; {} before networking started."""
        if self.net is None:
            return {}
        totals = await self.workers.run(self.net.drop_totals)
        out = {k: v for k, v in totals.items() if not k.startswith("dns_")}
        dns = {k[4:]: v for k, v in totals.items() if k.startswith("dns_")}
        if self.resolver is not None:
            for k, v in self.resolver.stats.items():      # queries of no sandbox, malformed, ...
                dns[k] = dns.get(k, 0) + v
        out["dns"] = dns
        return out

    async def show(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        self._check_not_lost(sb)
        if not _networked(sb):
            return {"sandbox": sb.id, "mode": "none"}
        return await self.workers.run((await self.network()).show, sb.id)

    async def sets(self, req, ctx) -> dict:
        """The rule sets --allow NAME accepts (config [net.rule_sets]); no Network needed."""
        from ..net import rules as R

        sets = R.parse_rule_sets(self.net_cfg.get("rule_sets", {}))
        return {"sets": [{"name": n, "rules": [str(r) for r in rs]} for n, rs in sorted(sets.items())]}

    async def set(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        self._check_not_lost(sb)
        if not _networked(sb):
            raise BadRequest(f"sandbox {sb.id} has --net none: no policy to change")
        if req.replace is not None and (req.add or req.remove):
            raise BadRequest("give either replace, or add/remove, not both")
        net = await self.network()
        await self.check_names(net, (req.add or []) + (req.replace or []))
        try:
            # Small policies are updated right here (Network.update_now says why and when).
            view = net.update_now(sb.id, add=req.add, remove=req.remove, replace=req.replace)
            if view is not None:
                return view
            return await self.workers.run(lambda: net.update(sb.id, add=req.add, remove=req.remove,
                                                              replace=req.replace))
        except OSError as err:
            raise io_error("update the policy of sandbox", sb.id, err) from err

    async def publish_at_create(self, sb, ports: list[int | str]) -> None:
        """`create`'s publish: each port on a host port of net.publish_ports."""
        net = await self.network()
        for port, protocol in dict.fromkeys(map(published_port, ports)):   # `--publish 8080 --publish 8080`: one
            await self._publish(net, sb.id, port, None, "", protocol)

    async def _publish(self, net, sb_id: str, port: int, host_port: int | None, bind: str,
                       protocol: str = "tcp") -> dict:
        try:
            return await self.workers.run(net.publish, sb_id, port, host_port, bind, protocol)
        except OSError as err:
            raise io_error(f"publish port {port}/{protocol} of sandbox", sb_id, err) from err

    async def publish(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        self._check_not_lost(sb)
        protocol = check_protocol(req.protocol)
        if not _networked(sb):
            raise BadRequest(f"sandbox {sb.id} has --net none: no address to publish a port of; "
                             "create it with --net default")
        return await self._publish(await self.network(), sb.id, req.port, req.host_port, req.bind, protocol)

    async def published(self, sb) -> list[dict]:
        """The sandbox's published ports as `net_show` lists them (for
        `inspect`); none while the Network is not built (nothing is
        published then)."""
        if not _networked(sb) or self.net is None:
            return []
        return await self.workers.run(self.net.ports, sb.id)

    async def unpublish(self, req, ctx) -> dict:
        sb = self.registry.get(req.sandbox, req)
        self._check_not_lost(sb)
        protocol = check_protocol(req.protocol)
        if not _networked(sb):
            raise BadRequest(f"sandbox {sb.id} has --net none: no published ports")
        net = await self.network()
        try:
            return await self.workers.run(net.unpublish, sb.id, req.port, protocol)
        except OSError as err:
            raise io_error(f"unpublish port {req.port}/{protocol} of sandbox", sb.id, err) from err


def _networked(sb) -> bool:
    """Whether the sandbox has a network of its own (--net default)."""
    return bool(sb.net) and sb.net.get("mode") == "default"


# Written into a --net default sandbox's writable layer at create: the
# sandbox's, not its image's, so a snapshot or a build step never packs them
# (docker's are bind mounts, which a commit leaves out too).
NET_FILES = ("etc/hosts", "etc/resolv.conf")


def hosts_text(hostname: str, lease: dict) -> str:
    """A networked sandbox's /etc/hosts, as docker writes one: localhost, and
    its hostname on its addresses, so that gethostbyname(gethostname())
    works (Ray, torch.distributed and MPI ask it) with no DNS record."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    for family in ("ipv4", "ipv6"):
        if lease.get(family):
            lines.append(f"{str(lease[family]).split('/')[0]}\t{hostname}")
    return "\n".join(lines) + "\n"


def write_net_files(rootfd: int, files: dict[str, str]) -> None:
    """Each path -> text of `files` in a sandbox's root, as its root user
    (userns.file_op). A symlink there (images often point /etc/resolv.conf
    at a resolver daemon's runtime file) is replaced by the file, not followed."""
    for path, text in files.items():
        try:
            if sbfiles.stat_path(rootfd, path).get("type") == "symlink":
                sbfiles.remove(rootfd, path, recursive=False)
        except OSError as err:
            if err.errno != errno.ENOENT:
                raise
        fd = sbfiles.open_for_write(rootfd, path, append=False, keep=False, mode=0o644, parents=True)
        try:
            sbfiles.write_data(fd, text.encode())
        finally:
            os.close(fd)


def _name_rules(sets: dict, terms: list[str]) -> list[str]:
    """The name rules among `terms` (named sets expanded), each once."""
    from ..net import rules as R

    return list(dict.fromkeys(str(r) for t in terms for r in R.expand([R.canonical_term(t, sets)], sets)
                              if isinstance(r, R.NameRule)))
