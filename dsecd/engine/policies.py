"""Task policies on execs: which policy an exec runs under, checked against
the kernel, compiled once (dsecd/policy.py); `policy_list`; what `dsec info`
says about them.

An exec runs under the policy its request names (a config name or an inline
dict), else under its sandbox's default (`create --policy`), else under
none. A policy the kernel's Landlock cannot enforce whole is refused with
`unsupported` naming the fields and the ABI they need: it never runs half
enforced. The client that names a policy is trusted (it is the RL framework,
not the agent: nothing inside a sandbox reaches the daemon's socket), so an
exec may run under a wider policy than its sandbox's default: that is how a
grader runs beside its agent.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from .. import policy as P
from ..errors import BadRequest, NotFound, Unsupported
from .sandboxes import Sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """The policy one exec runs under: its name ("inline" for a request's
    dict), its compiled plan (None: no Landlock rule, no domain) and the
    policy itself (its `capabilities`)."""

    name: str
    plan: bytes | None
    policy: P.Policy

    def cap_keep(self, sandbox_caps: int) -> int | None:
        """The exec's capabilities if the policy narrows them, else None (the sandbox's)."""
        return None if self.policy.capabilities is None else self.policy.cap_keep(sandbox_caps)


class PolicyService:
    """`policy_list`; the policy of each exec (`for_exec`) and the default of
    each create (`for_create`). `abi` is the kernel's Landlock ABI (0: none)."""

    def __init__(self, tables: dict, abi: int):
        self.abi = abi
        self.named = P.named(tables)          # validated by config.load_config already
        # Sandboxes' default policies, parsed: id(record) -> (record, policy).
        self._records: dict[int, tuple[dict, P.Policy]] = {}
        # Why a named policy cannot be used here, if it cannot (logged once).
        self.unusable: dict[str, str] = {}
        for name, pol in self.named.items():
            try:
                pol.check(abi)
                _compile(pol)
            except P.PolicyError as err:
                self.unusable[name] = str(err)
                log.warning("%s; execs asking for it are refused", err)

    # ------------------------------------------------------------ resolving

    def resolve(self, value: str | dict, what: str) -> P.Policy:
        """The policy a request field names (a name or an inline dict), checked
        against this kernel; `what` names the field in errors."""
        if isinstance(value, str):
            pol = self.named.get(value)
            if pol is None:
                raise NotFound(f"{what}: no policy {value!r}; this daemon has {', '.join(sorted(self.named))} "
                               "(`dsec policy ls`; [policy.<name>] in its config)",
                               {"policy": value, "known": sorted(self.named)})
        else:
            try:
                pol = P.parse(P.INLINE, value, where=what)
            except P.PolicyError as err:
                raise BadRequest(str(err), {"field": err.field}) from err
        try:
            pol.check(self.abi)
        except P.PolicyError as err:
            raise Unsupported(str(err), {"policy": pol.name, **(err.unsupported or {})}) from err
        return pol

    def for_create(self, value: str | dict | None) -> dict | None:
        """A create's `policy` as the sandbox records it (journaled, so a daemon
        with another config keeps enforcing what the sandbox was made with)."""
        if value is None:
            return None
        pol = self.resolve(value, "create: policy")
        self._plan(pol)          # fails now, not at the first exec
        return {"name": pol.name, "spec": pol.spec()}

    def for_exec(self, sb: Sandbox, value: str | dict | None, what: str = "exec") -> Applied | None:
        """The policy an exec in sb runs under: the request's, else the
        sandbox's default, else None (no policy at all)."""
        if value is not None:
            pol = self.resolve(value, f"{what}: policy")
        elif sb.policy is not None:
            pol = self._recorded(sb.policy)
        else:
            return None
        return Applied(pol.name, self._plan(pol), pol)

    def _recorded(self, rec: dict) -> P.Policy:
        """A sandbox's default policy from its record, parsed once per record
        (the sandbox keeps the same dict) and checked again (a record may come
        from another kernel)."""
        cached = self._records.get(id(rec))
        if cached is not None and cached[0] is rec:
            pol = cached[1]
        else:
            pol = P.parse(rec["name"], rec["spec"], where=f"the sandbox's policy {rec['name']!r}")
            if len(self._records) >= 4096:
                self._records.clear()
            self._records[id(rec)] = (rec, pol)
        try:
            pol.check(self.abi)
        except P.PolicyError as err:
            raise Unsupported(str(err), {"policy": pol.name, **(err.unsupported or {})}) from err
        return pol

    def _plan(self, pol: P.Policy) -> bytes | None:
        try:
            return _compile(pol)
        except P.PolicyError as err:
            raise BadRequest(str(err), {"field": err.field}) from err

    # ------------------------------------------------------------ requests and info

    async def list(self, req, ctx) -> dict:
        return {"landlock_abi": self.abi,
                "policies": [{"name": name, **pol.spec(), "needs": pol.needs(),
                              "restricts": pol.restricts() or pol.capabilities is not None,
                              "enforceable": name not in self.unusable, "error": self.unusable.get(name)}
                             for name, pol in sorted(self.named.items())]}

    def info(self) -> dict:
        """What `dsec info` says: the ABI, what each field needs and whether
        this kernel has it, and the named policies that cannot be enforced."""
        return {"landlock_abi": self.abi,
                "fields": {f: {"abi": need, "available": self.abi >= need} for f, need in P.FIELD_ABI.items()},
                "policies": sorted(self.named), "unusable": dict(self.unusable)}


@functools.lru_cache(maxsize=1024)
def _compile(pol: P.Policy) -> bytes | None:
    """A policy's plan, compiled once per distinct policy (a frozen, hashable dataclass)."""
    return pol.compile()

