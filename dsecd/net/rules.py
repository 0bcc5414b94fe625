"""Egress rules: parsing, named rule sets, merge semantics, compilation to trie entries.

Pure Python (no root, no kernel): everything here is unit-tested on its own.

A rule is `CIDR[:port[-port]][/tcp|udp]`; IPv6 takes brackets when it has a
port (`[2001:db8::/32]:443/tcp`). A bare address is a /32 (or /128). Without a
port a rule allows every protocol to the CIDR (ICMP included); with a port but
no protocol it allows TCP and UDP on those ports.

A name rule is `NAME[:port[-port]][/tcp|udp]` with a host name in place of the
CIDR (`pypi.org:443/tcp`), or a wildcard `*.NAME` (every name strictly below
NAME, not NAME itself). It allows nothing by itself: when the daemon's resolver
(dsecd/net/dns.py) answers the sandbox's query for a name it matches, the
answer's addresses join the sandbox's allowlist with the rule's ports, for the
answer's TTL plus a grace period (Network.learn).

A policy is an ordered list of *terms*: canonical rule texts and rule-set
names ("pypi", "dns", defined in the daemon's config). Merge semantics:
  add      appends terms not present yet (present ones are a no-op)
  remove   removes terms; removing a term that is not in the policy is an error
           (a typo must not look like a success); removing a literal rule never
           carves a hole out of a broader rule or out of a set
  replace  the whole list; exclusive with add/remove
Any error leaves the policy unchanged (the caller applies nothing).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

from ..errors import BadRequest, LimitExceeded

P_TCP, P_UDP, P_OTHER = 1, 2, 4
P_ANY = P_TCP | P_UDP | P_OTHER
PROTOS = {"tcp": P_TCP, "udp": P_UDP}
FAM_V4, FAM_V6 = 4, 6
MAX_ENTRIES = 16          # port/protocol entries per prefix: MAX_ENTRIES in bpf/net_policy.c
MAX_RULE_TEXT = 128

# Never the internet, whatever a rule's breadth, so fenced (Network.fences)
# beside the gateway, the pool and the host: link-local (the host's bridge and
# every sandbox's eth0 have an fe80:: address; most clouds' metadata service
# is 169.254.169.254), multicast, the limited broadcast (one datagram there
# reaches the host and every sandbox on the bridge), and the metadata
# services that are not link-local (Alibaba Cloud's 100.100.100.200, EC2's
# IPv6 fd00:ec2::254): reached through the host's NAT, they would hand a
# sandbox the host's cloud credentials.
LINK_SCOPED = ("169.254.0.0/16", "224.0.0.0/4", "255.255.255.255/32", "fe80::/10", "ff00::/8",
               "100.100.100.200/32", "fd00:ec2::254/128")

_V4_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
# A URL given as a rule: the port its scheme implies, for the "did you mean".
_URL_PORTS = {"http": 80, "https": 443}
_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
_PORTS = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")
# A host name: dot-separated LDH labels, the last one starting with a letter (so
# no IPv4 address is a name), at most 253 characters; `*.` in front = wildcard.
_HOST = re.compile(r"^(\*\.)?(?:[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\.)+[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Rule:
    family: int           # FAM_V4 | FAM_V6
    addr: int             # network address as an integer
    plen: int             # prefix length
    port_lo: int = 0
    port_hi: int = 65535
    protos: int = P_ANY

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        cls = ipaddress.IPv4Network if self.family == FAM_V4 else ipaddress.IPv6Network
        return cls((self.addr, self.plen))

    def __str__(self) -> str:
        return self.text

    def __hash__(self) -> int:
        # Explicit (dataclass keeps it): policies hash thousands of rules per update.
        return self._hash

    @functools.cached_property
    def key(self) -> tuple[int, int, int]:
        """(family, addr, plen): its prefix, the LPM trie's key."""
        return (self.family, self.addr, self.plen)

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.family, self.addr, self.plen, self.port_lo, self.port_hi, self.protos))

    @functools.cached_property
    def text(self) -> str:
        """Canonical text (cached: frozen dataclass, cached_property writes __dict__ directly)."""
        net = self.network
        net = str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
        if self.protos == P_ANY:
            return net
        ports = str(self.port_lo) if self.port_lo == self.port_hi else f"{self.port_lo}-{self.port_hi}"
        host = f"[{net}]" if self.family == FAM_V6 else net
        proto = {P_TCP: "/tcp", P_UDP: "/udp"}.get(self.protos, "")
        return f"{host}:{ports}{proto}"

    def covers(self, other: Rule) -> bool:
        """True if every connection `other` allows is allowed by self (same prefix)."""
        return (self.protos & other.protos) == other.protos and \
            self.port_lo <= other.port_lo and other.port_hi <= self.port_hi


@dataclass(frozen=True)
class NameRule:
    """A host name (or `*.` wildcard) with ports: allows the addresses the resolver learns for it."""
    name: str             # lowercase, no trailing dot; "*.example.org" for a wildcard
    port_lo: int = 0
    port_hi: int = 65535
    protos: int = P_ANY

    def __str__(self) -> str:
        return self.text

    @functools.cached_property
    def text(self) -> str:
        if self.protos == P_ANY:
            return self.name
        ports = str(self.port_lo) if self.port_lo == self.port_hi else f"{self.port_lo}-{self.port_hi}"
        proto = {P_TCP: "/tcp", P_UDP: "/udp"}.get(self.protos, "")
        return f"{self.name}:{ports}{proto}"

    def matches(self, qname: str) -> bool:
        """qname: lowercase, no trailing dot."""
        if self.name.startswith("*."):
            return qname.endswith(self.name[1:]) and len(qname) > len(self.name) - 1
        return qname == self.name

    def address_rule(self, family: int, addr: int) -> Rule:
        """This rule's ports for one learned address."""
        return Rule(family, addr, 32 if family == FAM_V4 else 128, self.port_lo, self.port_hi, self.protos)


def _bad(text: str, why: str) -> BadRequest:
    return BadRequest(f"bad rule {text!r}: {why}", {"rule": text})


@functools.lru_cache(maxsize=1 << 16)
def parse_rule(text: str) -> Rule | NameRule:
    """One rule from its text; BadRequest with the reason otherwise (cached: policies
    are re-expanded from their terms on every update)."""
    if not isinstance(text, str) or not text.strip():
        raise _bad(str(text), "empty")
    if len(text) > MAX_RULE_TEXT:
        raise _bad(text[:40] + "...", f"longer than {MAX_RULE_TEXT} characters")
    s = text.strip()
    if "://" in s:
        scheme, _, rest = s.partition("://")
        host, port = rest.split("/", 1)[0] or "NAME", ""
        if re.search(r":\d+$", host) and (host.count(":") == 1 or "]:" in host):
            host, _, port = host.rpartition(":")
        port = port or _URL_PORTS.get(scheme.lower(), "PORT")
        raise _bad(text, f"a rule names a host and port, not a URL: did you mean '{host}:{port}/tcp'?")
    if "," in s or any(c.isspace() for c in s):
        raise _bad(text, "one rule per term: give each rule its own --allow (--add, or list item)")
    proto = None
    head, slash, tail = s.rpartition("/")
    if slash and tail.lower() in PROTOS:
        s, proto = head, tail.lower()
    elif slash and tail.isalpha():
        raise _bad(text, f"unknown protocol {tail!r} (use tcp or udp)")
    ports = None
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep:
            raise _bad(text, "missing ']' after an IPv6 address")
        if rest:
            if rest.startswith("/"):      # [::]/0:443: the prefix length outside the brackets
                plen = re.match(r"/\d*", rest).group(0)
                raise _bad(text, f"the prefix length goes inside the brackets: did you mean "
                                 f"{text.replace(f']{plen}', f'{plen}]', 1)!r}?")
            if not rest.startswith(":"):
                raise _bad(text, "expected ':port' after ']'")
            ports = rest[1:]
    elif s.count(":") == 1:
        host, ports = s.split(":")
    else:
        host = s          # IPv4 without port, or IPv6 without brackets (no port)
    name = host.lower().rstrip(".") if not host.startswith("[") else ""
    is_name = bool(name) and any(c.isalpha() for c in name) and ":" not in name
    if is_name and (len(name) > 253 or not _HOST.match(name)):
        raise _bad(text, f"bad host name {host!r} (letters, digits, '-' and '_' in dot-separated labels, "
                         "the last one starting with a letter; '*.' in front for every name below)")
    if not is_name and host.count(":") > 1 and "/" in host.rpartition(":")[0] \
            and _PORTS.match(host.rpartition(":")[2]) and _is_ipv6_net(host.rpartition(":")[0]):
        # 2001:db8::/32:443: a port after an IPv6 prefix needs the brackets
        # (without a prefix length, 2001:db8::1:443 is an address itself).
        head, _, port = host.rpartition(":")
        raise _bad(text, f"an IPv6 rule with a port takes brackets: did you mean "
                         f"{text.replace(host, f'[{head}]:{port}', 1)!r}?")
    net = None if is_name else _parse_net(text, host)
    if net is not None and net.version == 6 and net.subnet_of(_V4_MAPPED):
        # The hooks look a connection to ::ffff:a.b.c.d up as one to a.b.c.d
        # (bpf/net_policy.c fold_v4_mapped): as an IPv6 rule it would allow nothing.
        v4 = ipaddress.IPv4Network((int(net.network_address) & 0xFFFFFFFF, net.prefixlen - 96))
        want = str(v4.network_address) if v4.prefixlen == 32 else str(v4)
        want += (f":{ports}" if ports is not None else "") + (f"/{proto}" if proto else "")
        raise _bad(text, f"an IPv4-mapped address is IPv4 to the allowlist: did you mean {want!r}?")
    lo, hi = (0, 65535) if ports is None else _parse_ports(text, ports)
    if ports is None and proto is not None:
        raise _bad(text, "a protocol needs a port or port range (e.g. 10.0.0.0/8:1-65535/tcp)")
    protos = P_ANY if ports is None else (PROTOS[proto] if proto else P_TCP | P_UDP)
    if net is None:
        return NameRule(name, lo, hi, protos)
    family = FAM_V4 if net.version == 4 else FAM_V6
    return Rule(family, int(net.network_address), net.prefixlen, lo, hi, protos)


def _is_ipv6_net(text: str) -> bool:
    try:
        return ipaddress.ip_network(text, strict=False).version == 6
    except ValueError:
        return False


def _parse_net(text: str, host: str):
    try:
        return ipaddress.ip_network(host, strict=True)
    except ValueError as err:
        try:
            loose = ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise _bad(text, f"bad CIDR {host!r}: {err}") from err
        raise _bad(text, f"{host} has host bits set; did you mean {loose}?") from err


def _parse_ports(text: str, ports: str) -> tuple[int, int]:
    m = _PORTS.match(ports)
    if not m:
        raise _bad(text, f"bad port {ports!r} (use N or N-M)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    for p in (lo, hi):
        if not 1 <= p <= 65535:
            raise _bad(text, f"port {p} out of range 1-65535")
    if lo > hi:
        raise _bad(text, f"port range {lo}-{hi} is reversed")
    return lo, hi


# ------------------------------------------------------------------ rule sets


def parse_rule_sets(table: dict) -> dict[str, tuple[Rule | NameRule, ...]]:
    """The config's `[net.rule_sets]`: name -> list of rule texts (sets do not nest)."""
    out: dict[str, tuple[Rule, ...]] = {}
    for name, texts in table.items():
        if not _NAME.match(name):
            raise ValueError(f"net.rule_sets: bad set name {name!r} (lowercase letters, digits, - and _)")
        if not isinstance(texts, list) or not texts:
            raise ValueError(f"net.rule_sets.{name}: must be a non-empty list of rules")
        try:
            out[name] = tuple(dict.fromkeys(parse_rule(t) for t in texts))
        except BadRequest as err:
            raise ValueError(f"net.rule_sets.{name}: {err.message}") from err
    return out


def canonical_term(text: str, sets: dict[str, tuple[Rule, ...]]) -> str:
    """A set name as is, a rule in canonical form; unknown names are errors."""
    if not isinstance(text, str):
        raise BadRequest(f"a rule must be a string, got {type(text).__name__}")
    t = text.strip()
    if _NAME.match(t):
        if t not in sets:
            known = ", ".join(sorted(sets)) or "none configured"
            raise BadRequest(f"unknown rule set {t!r} (known: {known}); give a rule such as "
                             f"10.1.2.0/24:443/tcp, or define the set in the daemon's config under "
                             f'[net.rule_sets], e.g. {t} = ["10.1.2.0/24:443/tcp"]', {"rule": t, "known": sorted(sets)})
        return t
    return str(parse_rule(t))


def expand(terms: list[str] | tuple[str, ...], sets: dict[str, tuple[Rule, ...]]) -> list[Rule | NameRule]:
    """Distinct rules (address and name rules) of canonical terms, in order of first appearance."""
    out: dict[Rule, None] = {}
    for t in terms:
        for r in sets[t] if t in sets else (parse_rule(t),):
            out.setdefault(r, None)
    return list(out)


def merge(current: tuple[str, ...], sets: dict[str, tuple[Rule, ...]], *,
          add: list[str] | None = None, remove: list[str] | None = None,
          replace: list[str] | None = None) -> tuple[str, ...]:
    """The new term list, or an error (and the caller keeps `current`)."""
    add, remove = list(add or []), list(remove or [])
    if replace is not None:
        if add or remove:
            raise BadRequest("replace cannot be combined with add or remove")
        return tuple(dict.fromkeys(canonical_term(t, sets) for t in replace))
    add_c = list(dict.fromkeys(canonical_term(t, sets) for t in add))
    rm_c = list(dict.fromkeys(canonical_term(t, sets) for t in remove))
    both = set(add_c) & set(rm_c)
    if both:
        raise BadRequest(f"rules both added and removed: {sorted(both)}")
    missing = [t for t in rm_c if t not in current]
    if missing:
        raise BadRequest(f"cannot remove {missing}: not in the policy {list(current)}",
                         {"missing": missing})
    kept = [t for t in current if t not in set(rm_c)]
    return tuple(kept + [t for t in add_c if t not in kept])


def check_size(rules: list[Rule], max_rules: int) -> None:
    if len(rules) > max_rules:
        raise LimitExceeded(f"policy has {len(rules)} rules after expanding sets; net.max_rules_per_sandbox "
                            f"is {max_rules}", {"rules": len(rules), "max": max_rules})


# ------------------------------------------------------------------ compilation


@dataclass(frozen=True)
class Entry:
    port_lo: int
    port_hi: int
    protos: int
    rule: Rule            # whose counter this entry bumps


Key = tuple[int, int, int]       # (family, network address, prefix length): a trie key


def _within(key: Key, outer: Key) -> bool:
    """Whether prefix `key` lies inside prefix `outer` (or is it)."""
    fam, addr, plen = key
    ofam, oaddr, oplen = outer
    if fam != ofam or plen < oplen:
        return False
    bits = 32 if fam == FAM_V4 else 128
    mask = ((1 << oplen) - 1) << (bits - oplen) if oplen else 0
    return addr & mask == oaddr


def fence_keys(rules: list[Rule], fences: tuple[Key, ...]) -> set[Key]:
    """The fences some rule on a broader prefix covers: each gets a trie entry
    of its own, holding only the rules inside it, so that the broader rule
    does not reach into it (compile_prefixes)."""
    return {f for f in fences if any(r.key != f and _within(f, r.key) for r in rules)}


def touches_fence(rules, fences: tuple[Key, ...]) -> bool:
    """Whether any of `rules` lies inside a fence or covers one (its change
    can change a fence's own entry: recompile the whole policy)."""
    return any(_within(r.key, f) or _within(f, r.key) for r in rules for f in fences)


def compile_prefixes(rules: list[Rule], only: set | None = None,
                     fences: tuple[Key, ...] = ()) -> dict[Key, list[Entry]]:
    """{(family, addr, plen): entries} for the LPM trie (only the keys in `only`, if given).

    The trie returns only the longest matching prefix, so each prefix also
    carries the entries of every rule on a covering prefix, most specific
    first (a connection is counted against the most specific rule that allows
    it). Entries an earlier one already covers are dropped: they could never
    match first.

    `fences` are prefixes no broader rule reaches into (the sandboxes'
    bridge subnet, the host's own addresses): a prefix inside a fence takes
    the entries of covering prefixes inside that fence only, and a fence a
    broader rule covers gets an entry of its own (empty unless a rule names
    it), so `0.0.0.0/0:443` does not open another sandbox or the host while
    `10.88.1.7:443` does.
    """
    by_prefix: dict[Key, list[Rule]] = {}
    walled = fence_keys(rules, fences)
    if only is None:
        for r in rules:
            by_prefix.setdefault(r.key, []).append(r)
        for f in walled:
            by_prefix.setdefault(f, [])
    else:
        # Only the rules on a key of `only` or on a prefix covering one matter.
        need = set()
        for fam, addr, plen in only:
            bits = 32 if fam == FAM_V4 else 128
            need.update((fam, addr & (((1 << p) - 1) << (bits - p)), p) for p in range(plen + 1))
        for r in rules:
            if r.key in need:
                by_prefix.setdefault(r.key, []).append(r)
        for f in walled & set(only):
            by_prefix.setdefault(f, [])
    # Only prefix lengths the policy uses can cover anything: walk those, not all 32/128.
    plens: dict[int, list[int]] = {}
    for fam, _addr, plen in by_prefix:
        plens.setdefault(fam, []).append(plen)
    plens = {f: sorted(set(v), reverse=True) for f, v in plens.items()}
    out: dict[Key, list[Entry]] = {}
    keys = by_prefix if only is None else [k for k in only if k in by_prefix]
    for key in keys:
        fam, addr, plen = key
        bits = 32 if fam == FAM_V4 else 128
        chain = list(by_prefix[key])
        # Inside a fence, nothing broader than the fence covers it.
        floor = max((f[2] for f in fences if _within(key, f)), default=0)
        for p in (q for q in plens[fam] if floor <= q < plen):      # covering prefixes, most specific first
            mask = ((1 << p) - 1) << (bits - p) if p else 0
            chain.extend(by_prefix.get((fam, addr & mask, p), ()))
        kept: list[Rule] = []
        for r in chain:
            if not any(k.covers(r) for k in kept):
                kept.append(r)
        if len(kept) > MAX_ENTRIES:
            net = Rule(fam, addr, plen).network
            raise BadRequest(f"{len(kept)} port/protocol entries apply to {net} (its own rules and those "
                             f"of covering CIDRs); at most {MAX_ENTRIES}: merge port ranges",
                             {"prefix": str(net)})
        out[key] = [Entry(r.port_lo, r.port_hi, r.protos, r) for r in kept]
    return out


def affected_prefixes(delta: set[Rule], keys) -> set[tuple[int, int, int]]:
    """Trie keys whose entries can change when the rules in `delta` come or go:
    their own prefixes and every prefix in `keys` they cover."""
    out = {(r.family, r.addr, r.plen) for r in delta}
    # (family, plen) -> the delta's networks at that length, as shifted addresses:
    # a key is covered when its address shifted the same way is one of them.
    nets: dict[tuple[int, int], set[int]] = {}
    for r in delta:
        bits = 32 if r.family == FAM_V4 else 128
        nets.setdefault((r.family, r.plen), set()).add(r.addr >> (bits - r.plen))
    if not nets:
        return out
    shortest = {fam: min(p for f, p in nets if f == fam) for fam, _ in nets}
    levels = sorted(nets.items(), key=lambda kv: kv[0][1])
    for key in keys:
        fam, addr, plen = key
        if plen <= shortest.get(fam, 128):
            continue
        bits = 32 if fam == FAM_V4 else 128
        for (f, p), shifted in levels:
            if p >= plen:
                break
            if f == fam and addr >> (bits - p) in shifted:
                out.add(key)
                break
    return out
