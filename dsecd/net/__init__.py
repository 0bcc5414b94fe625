"""Sandbox networking: netns plumbing, IPAM, eBPF egress allowlists (docs/network.md).

The node uses only `Network` (dsecd/net/network.py); the other modules are its parts:
rules.py (rule syntax, sets, merge, trie compilation), ipam.py (leases),
plumbing.py (bridge and veths over rtnetlink), policy.py (bcc programs and maps).
"""

from .network import MODES, Network

__all__ = ["MODES", "Network"]
