// SPDX-License-Identifier: GPL-2.0
// Egress allowlists for sandboxes, attached to each sandbox's cgroup v2 dir.
//
// Compiled once per daemon by bcc (dsecd/net/policy.py passes the -D sizes) and
// shared by every sandbox; a sandbox costs map entries and seven attaches.
//
//   sandboxes   hash      sandbox cgroup id -> {policy id, stats slot}
//   rules       lpm_trie  {policy id, family, address prefix} -> port/protocol entries
//   rule_hits   array     counter slot -> connects/sends an entry allowed (atomic adds)
//   sb_stats    percpu    stats slot -> what the default-deny refused
//   accepted    lru_hash  socket cookie of each TCP connection the sandbox accepted (dsec_sockops)
//   taps        hash      ifindex of a microVM's tap -> {its `sandboxes` key, addresses, MAC} (dsec_tap)
//   vm_inbound  lru_hash  TCP flows made to a microVM (dsec_tap_in), whose answers dsec_tap lets out
//   udp_published hash    {sandbox key, UDP port} -> publication number of each published UDP port
//                         (written by the daemon)
//   udp_peers   lru_hash  who sent a datagram to a published UDP port (dsec_ingress, dsec_tap_in),
//                         whom the sandbox may answer from that port, -> the publication it wrote to
//
// Atomic updates: user space writes a whole new policy under a fresh policy id,
// then flips the sandbox's one `sandboxes` entry to it (a single map update),
// then deletes the old id's entries. A program reads the policy id once per
// decision, so every decision sees either the old policy or the new one.
//
// The trie answers the longest matching prefix only, so user space copies the
// entries of every covering prefix into each more specific one ("inheritance");
// one lookup then gives every port/protocol entry that applies to an address.

#include <uapi/linux/bpf.h>
#include <uapi/linux/if_arp.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>

#ifndef MAX_SANDBOXES
#define MAX_SANDBOXES 4096
#endif
#ifndef MAX_PREFIXES
#define MAX_PREFIXES 65536
#endif
#ifndef MAX_COUNTERS
#define MAX_COUNTERS 65536
#endif
#define MAX_ENTRIES 16

// Protocol bits of an entry (a rule without /tcp|udp but with a port = TCP|UDP;
// without a port either = every protocol, ICMP included).
#define P_TCP 1
#define P_UDP 2
#define P_OTHER 4

#define FAM_V4 4
#define FAM_V6 6

struct sb_val {
    u32 policy;
    u32 slot;
};

struct lpm_key {
    u32 prefixlen;  // 32 (policy) + 8 (family) + address prefix length
    u32 policy;
    u8 family;
    u8 addr[16];    // IPv4 in the first 4 bytes
};

struct entry {
    u16 port_lo;    // host byte order
    u16 port_hi;
    u8 protos;      // P_* bits
    u8 pad[3];
    u32 counter;    // index into rule_hits
};

struct rule_val {
    u32 n;
    u32 pad;
    struct entry e[MAX_ENTRIES];
};

struct sb_stat {
    u64 denied_connect;
    u64 denied_sendmsg;
    u64 dropped_packets;
};

BPF_ARRAY(config, u32, 1);  // [0]: cgroup level of sandbox dirs (root = 0)
BPF_HASH(sandboxes, u64, struct sb_val, MAX_SANDBOXES);
BPF_F_TABLE("lpm_trie", struct lpm_key, struct rule_val, rules, MAX_PREFIXES, BPF_F_NO_PREALLOC);
// A plain array with atomic adds, not a per-CPU one: only connects and sends
// count (never packets), so contention is rare, and a per-CPU array of
// MAX_COUNTERS slots took 220 ms to allocate per start (one allocation per
// slot) against ~1 ms for this one.
BPF_ARRAY(rule_hits, u64, MAX_COUNTERS);
BPF_PERCPU_ARRAY(sb_stats, struct sb_stat, MAX_SANDBOXES);
// Keyed by socket cookie, not socket storage: the daemon loads these programs
// with plain bpf(2) calls (dsecd/net/bpfsys.py), and an sk_storage map needs
// BTF for its key and value. Cookies are never reused while the host runs, so
// an entry left by a closed socket is harmless; the LRU drops the oldest.
#ifndef MAX_ACCEPTED
#define MAX_ACCEPTED 65536
#endif
BPF_TABLE("lru_hash", u64, u8, accepted, MAX_ACCEPTED);

// A microVM's tap (dsec_tap): which sandbox it is and what the guest may
// send as. `key` is the VM's key in `sandboxes` (not a cgroup id: no socket
// of the guest is on the host; dsecd/net/network.py vm_key), the addresses
// are its lease (network byte order), the MAC the one the agent gave its NIC.
// ip6 is all zero when the VM has no IPv6 lease (net.ipv6_subnet unset): then
// no IPv6 frame of it passes. ll6 is the link-local address its kernel makes
// from the MAC (EUI-64), the source of its neighbor discovery only.
struct tap_val {
    u64 key;
    u32 ip4;
    u8 mac[6];
    u8 pad[2];
    u8 ip6[16];
    u8 ll6[16];
};
BPF_HASH(taps, u32, struct tap_val, MAX_SANDBOXES);

// TCP connections made *to* a microVM (dsec_tap_in saw their SYN go to the
// guest: through a published port's DNAT, from the bridge netns, from a
// sandbox whose policy let it connect), so that dsec_tap lets the guest's
// answers out whatever its allowlist says, as answers_inbound() does for a
// container's accepted sockets. Keyed by the whole flow, as the guest sends
// it: an answer only ever goes to the peer that connected. Ports and address
// in network byte order; the LRU drops the oldest. Every byte of a key is
// set (pad included): the hash compares them all.
//
// A flow leaves the map when its connection ends, so that the LRU, which
// every VM shares, holds the open ones and churn does not push out an idle
// long-lived connection's flow: at a RST either way, and after both FINs at
// the ACK of the second one (the value keeps which FINs were seen: VM_FLOW_*).
// The guest's frames are looked up only when its policy refuses them or they
// carry FIN or RST, so the flow of a peer its policy allows, closed by the
// guest's ACK, stays until the LRU drops it (its answers need no flow).
#define VM_FLOW_OPEN 1
#define VM_FLOW_GUEST_FIN 2
#define VM_FLOW_PEER_FIN 4
#define TCP_FIN 0x01
#define TCP_SYN 0x02
#define TCP_RST 0x04
#define TCP_ACK 0x10
struct vm_flow {
    u64 key;        // the VM's `sandboxes` key
    u8 peer[16];    // IPv4 in the first 4 bytes
    u16 peer_port;
    u16 vm_port;
    u8 family;      // FAM_V4 | FAM_V6
    u8 pad[3];
};
BPF_TABLE("lru_hash", struct vm_flow, u8, vm_inbound, MAX_ACCEPTED);

// Published UDP ports. A datagram has no connection a passive open could
// mark, so the daemon names the sandbox's published UDP ports here
// (`publish`: {its `sandboxes` key, the port in network byte order}), and
// every datagram that arrives on one (dsec_ingress for a container,
// dsec_tap_in for a microVM) puts its flow, as the sandbox's answer would
// go, in `udp_peers`: {key, peer address, peer port, published port,
// family}, the layout of struct vm_flow. The sandbox may then send from
// that port to that peer whatever its allowlist says (sendmsg, connect,
// and the packets themselves), and to no one else: a published port does
// not open the sandbox's egress, it lets it answer whoever wrote to it.
// The daemon deletes a port's entry and its peers at unpublish; the LRU
// drops the least recently marked peers.
//
// Each publication of a port has its own number, which the daemon never
// gives another publication while its maps live (Engine.publish_udp):
// the value of the port's `udp_published` entry. A peer's mark is that
// number, and answers it only while the port's entry holds the same one.
// Unpublish reads `udp_peers` after deleting the port's entry, and a
// datagram whose note_udp_peer read the entry before that delete can mark
// its sender after that read: the mark is left behind, with the old
// publication's number. Were marks a bare "yes", it would let the sandbox
// answer that peer as soon as the port is published again, though the
// peer never wrote to that publication; with the number it answers no
// one until the peer writes again (and is marked with the new number).
// A datagram that raced both that unpublish and the next publish can write
// its old number over a mark the new publication made: that peer is then
// refused until it writes again. The memory of a deleted entry may be
// reused at once for a new one (a hash map's are), even while a program
// that found the deleted entry reads it: that program then reads the new
// entry's number, of a publication in place while its datagram was being
// let in, and for another port a number this port never has. Either way
// a mark has the number of a publication its datagram arrived under.
#ifndef MAX_UDP_PUBLISHED
#define MAX_UDP_PUBLISHED 16384
#endif
struct udp_port {
    u64 key;
    u16 port;       // network byte order
    u8 pad[6];
};
BPF_HASH(udp_published, struct udp_port, u32, MAX_UDP_PUBLISHED);
BPF_TABLE("lru_hash", struct vm_flow, u32, udp_peers, MAX_ACCEPTED);

// A microVM's UDP datagram bigger than its tap's MTU leaves the guest in IP
// fragments, and only the first has the ports the policy decides on (an
// answer to a peer of a published port, a send to an allowed port): the
// others would be "other protocol" to that address. dsec_tap notes here,
// as {VM key, destination, IP id, family}, each first fragment of a UDP
// datagram it passes (more fragments to follow), and lets the rest of that
// datagram, to the same destination, through. (A container's datagrams are
// checked by its cgroup hooks before the kernel fragments them.) The LRU
// drops what is done.
#ifndef MAX_VM_FRAGS
#define MAX_VM_FRAGS 4096
#endif
struct vm_frag {
    u64 key;
    u8 daddr[16];   // IPv4 in the first 4 bytes
    u32 id;         // IPv4's 16-bit id or the IPv6 fragment header's; network byte order
    u8 family;      // FAM_V4 | FAM_V6
    u8 pad[3];
};
BPF_TABLE("lru_hash", struct vm_frag, u8, vm_frags, MAX_VM_FRAGS);

// IPv6's fragment header (RFC 8200 4.5): in every fragment, right after the
// fixed header (dsec_tap takes any other extension header for "other
// protocol"), before the fragment's part of the datagram.
#ifndef IPPROTO_FRAGMENT
#define IPPROTO_FRAGMENT 44
#endif
struct frag6 {
    u8 nexthdr;     // the datagram's protocol, in every fragment
    u8 reserved;
    u16 frag_off;   // offset (8-byte units) << 3 | M (more fragments); network byte order
    u32 id;
};
#define FRAG6_OFFSET 0xfff8
#define FRAG6_MORE 1

// A datagram arrived for the sandbox `key` from `peer`:`peer_port` to its
// `port` (ports in network byte order): if that port is published, the
// peer may be answered from it while this publication lasts.
static __always_inline void note_udp_peer(u64 key, u8 family, const u8 *peer, int peer_len, u16 peer_port,
                                          u16 port)
{
    struct udp_port up = {};
    up.key = key;
    up.port = port;
    u32 *pub = udp_published.lookup(&up);
    if (!pub)
        return;
    u32 gen = *pub;
    struct vm_flow f = {};
    f.key = key;
    if (peer_len == 4)
        __builtin_memcpy(f.peer, peer, 4);
    else
        __builtin_memcpy(f.peer, peer, 16);
    f.peer_port = peer_port;
    f.vm_port = port;
    f.family = family;
    udp_peers.update(&f, &gen);
}

// The sandbox `key` sends a datagram from its `port` to `k`'s address,
// `peer_port` (network byte order): an answer to a peer that wrote to that
// port under its current publication. A mark left by a datagram that raced
// an unpublish has another publication's number, or no entry to compare
// with while the port is not published: it is not answered.
static __always_inline int answers_udp_peer(u64 key, struct lpm_key *k, u16 peer_port, u16 port)
{
    struct udp_port up = {};
    up.key = key;
    up.port = port;
    u32 *pub = udp_published.lookup(&up);
    if (!pub)
        return 0;
    u32 gen = *pub;
    struct vm_flow f = {};
    f.key = key;
    __builtin_memcpy(f.peer, k->addr, 16);
    f.peer_port = peer_port;
    f.vm_port = port;
    f.family = k->family;
    u32 *mark = udp_peers.lookup(&f);
    return mark && *mark == gen;
}

static __always_inline u32 sandbox_level(void)
{
    int zero = 0;
    u32 *lvl = config.lookup(&zero);
    return lvl ? *lvl : 0;
}

// 1 allow, 0 deny. `count` bumps the matching entry's counter (the hooks count,
// the per-packet backstop does not: it would cost on every packet).
static __always_inline int decide(struct sb_val *sb, struct lpm_key *k, u16 port, u8 proto, int count)
{
    k->policy = sb->policy;
    k->prefixlen = 32 + 8 + (k->family == FAM_V4 ? 32 : 128);
    struct rule_val *v = rules.lookup(k);
    if (!v)
        return 0;
#pragma unroll
    for (int i = 0; i < MAX_ENTRIES; i++) {
        if (i >= v->n)
            break;
        struct entry *e = &v->e[i];
        if ((e->protos & proto) && port >= e->port_lo && port <= e->port_hi) {
            if (count) {
                u32 c = e->counter;
                u64 *hits = rule_hits.lookup(&c);
                if (hits)
                    __sync_fetch_and_add(hits, 1);
            }
            return 1;
        }
    }
    return 0;
}

static __always_inline u8 proto_bit(u32 proto)
{
    if (proto == IPPROTO_TCP)
        return P_TCP;
    if (proto == IPPROTO_UDP)
        return P_UDP;
    return P_OTHER;
}

// The sandbox's own loopback is always reachable (--net none is loopback only).
static __always_inline int is_loopback(struct lpm_key *k)
{
    if (k->family == FAM_V4)
        return k->addr[0] == 127;
    u32 acc = 0;
#pragma unroll
    for (int i = 0; i < 15; i++)
        acc |= k->addr[i];
    return acc == 0 && k->addr[15] == 1;
}

// An IPv4-mapped IPv6 address (::ffff:a.b.c.d, dual-stack sockets) is IPv4.
static __always_inline void fold_v4_mapped(struct lpm_key *k)
{
    u32 acc = 0;
#pragma unroll
    for (int i = 0; i < 10; i++)
        acc |= k->addr[i];
    if (acc == 0 && k->addr[10] == 0xff && k->addr[11] == 0xff) {
        k->family = FAM_V4;
        __builtin_memcpy(k->addr, &k->addr[12], 4);
        __builtin_memset(&k->addr[4], 0, 12);
    }
}

static __always_inline void bump_denied(u32 slot, int sendmsg)
{
    struct sb_stat *st = sb_stats.lookup(&slot);
    if (!st)
        return;
    if (sendmsg)
        st->denied_sendmsg += 1;
    else
        st->denied_connect += 1;
}

/* Shared tail of the v4/v6 hooks: loopback passes, else the policy decides;
   a datagram (or a UDP connect) from a published UDP port to a peer that
   wrote to it is an answer, and passes. */
static __always_inline int sock_addr_decide(struct bpf_sock_addr *ctx, u64 cg, struct sb_val *sb,
                                            struct lpm_key *k, int sendmsg)
{
    if (is_loopback(k))
        return 1;
    u16 port = bpf_ntohs((u16)ctx->user_port);
    if (decide(sb, k, port, proto_bit(ctx->protocol), 1))
        return 1;
    if (ctx->protocol == IPPROTO_UDP) {
        struct bpf_sock *sk = ctx->sk;
        if (sk && sk->src_port && answers_udp_peer(cg, k, (u16)ctx->user_port, bpf_htons((u16)sk->src_port)))
            return 1;
    }
    bump_denied(sb->slot, sendmsg);
    return 0;
}

static __always_inline int sock_addr_v4(struct bpf_sock_addr *ctx, int sendmsg)
{
    u64 cg = bpf_get_current_ancestor_cgroup_id(sandbox_level());
    struct sb_val *sb = sandboxes.lookup(&cg);
    if (!sb)
        return 0;  // attached but not registered: fail closed
    struct lpm_key k = {};
    k.family = FAM_V4;
    u32 ip = ctx->user_ip4;
    __builtin_memcpy(k.addr, &ip, 4);
    return sock_addr_decide(ctx, cg, sb, &k, sendmsg);
}

static __always_inline int sock_addr_v6(struct bpf_sock_addr *ctx, int sendmsg)
{
    u64 cg = bpf_get_current_ancestor_cgroup_id(sandbox_level());
    struct sb_val *sb = sandboxes.lookup(&cg);
    if (!sb)
        return 0;
    struct lpm_key k = {};
    k.family = FAM_V6;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 w = ctx->user_ip6[i];
        __builtin_memcpy(&k.addr[i * 4], &w, 4);
    }
    fold_v4_mapped(&k);
    return sock_addr_decide(ctx, cg, sb, &k, sendmsg);
}

int dsec_connect4(struct bpf_sock_addr *ctx) { return sock_addr_v4(ctx, 0); }
int dsec_connect6(struct bpf_sock_addr *ctx) { return sock_addr_v6(ctx, 0); }
int dsec_sendmsg4(struct bpf_sock_addr *ctx) { return sock_addr_v4(ctx, 1); }
int dsec_sendmsg6(struct bpf_sock_addr *ctx) { return sock_addr_v6(ctx, 1); }

// A connection the sandbox made to itself: from loopback (127/8, ::1, their
// IPv4-mapped forms) or from its own address. Its answers need no mark (the
// sandbox's loopback and own address are always allowed), and marking them
// let one sandbox churn `accepted`, an LRU every sandbox shares, with
// thousands of connections to itself until other sandboxes' marks fell out.
static __always_inline int from_itself(struct bpf_sock_ops *skops)
{
    if (skops->family == 2 /* AF_INET */)
        return (bpf_ntohl(skops->remote_ip4) >> 24) == 127 || skops->remote_ip4 == skops->local_ip4;
    u32 r0 = skops->remote_ip6[0], r1 = skops->remote_ip6[1], r2 = skops->remote_ip6[2];
    u32 r3 = skops->remote_ip6[3];
    if (r0 == skops->local_ip6[0] && r1 == skops->local_ip6[1] && r2 == skops->local_ip6[2] &&
        r3 == skops->local_ip6[3])
        return 1;
    if (r0 | r1)
        return 0;
    return (r2 == 0 && r3 == bpf_htonl(1)) ||
           (r2 == bpf_htonl(0xffff) && (bpf_ntohl(r3) >> 24) == 127);
}

// A TCP connection the sandbox accepted (the 3-way handshake completed on a
// listening socket of the sandbox: someone connected to it, through a published
// port or from the bridge) is marked on its socket, so that dsec_egress lets its
// replies out whatever the allowlist says. The mark is made by the kernel's
// passive-open callback only; a socket the sandbox connect()s never gets it.
// The socket then reports its state changes here, and its mark goes when it
// closes: `accepted` holds the connections that are open, not every one
// since the daemon started (the LRU would push out a long-lived one's).
int dsec_sockops(struct bpf_sock_ops *skops)
{
    u64 cookie;

    if (skops->op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
        if (from_itself(skops))
            return 1;
        cookie = bpf_get_socket_cookie(skops);
        u8 one = 1;
        accepted.update(&cookie, &one);
        bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
    } else if (skops->op == BPF_SOCK_OPS_STATE_CB && skops->args[1] == BPF_TCP_CLOSE) {
        cookie = bpf_get_socket_cookie(skops);
        accepted.delete(&cookie);
    }
    return 1;
}

// Packets that answer a connection made *to* the sandbox: a listening socket's
// SYN-ACKs (the cgroup hook runs them with the listener as their socket) and
// every packet of a socket dsec_sockops marked. Neither can start a connection
// of the sandbox's own: a listener only answers SYNs, and a marked socket only
// talks to the peer that connected.
static __always_inline int answers_inbound(struct __sk_buff *skb)
{
    struct bpf_sock *sk = skb->sk;
    if (!sk)
        return 0;
    sk = bpf_sk_fullsock(sk);
    if (!sk || sk->protocol != IPPROTO_TCP || sk->type != 1 /* SOCK_STREAM */)
        return 0;
    if (sk->state == 10 /* TCP_LISTEN */)
        return 1;
    u64 cookie = bpf_get_socket_cookie(skb);
    return accepted.lookup(&cookie) != 0;
}

// The backstop: every egress packet of the sandbox's sockets (raw sockets,
// connected UDP, established TCP) is checked against the same policy. This is
// also why a removed rule cuts established connections: their next packet drops.
// Connections the sandbox accepted are not its egress: answers_inbound().
int dsec_egress(struct __sk_buff *skb)
{
    u64 cg = bpf_skb_ancestor_cgroup_id(skb, sandbox_level());
    struct sb_val *sb = sandboxes.lookup(&cg);
    if (!sb)
        return 0;
    if (answers_inbound(skb))
        return 1;
    struct lpm_key k = {};
    u8 proto;
    u32 l4;
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0)
            goto drop;
        k.family = FAM_V4;
        __builtin_memcpy(k.addr, &ip.daddr, 4);
        proto = ip.protocol;
        l4 = ip.ihl * 4;
        // A non-first fragment has no ports (egress normally sees whole GSO
        // packets, fragmented later; this is for IP_HDRINCL raw sockets).
        if (ip.frag_off & bpf_htons(0x1fff))
            proto = 0;
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) < 0)
            goto drop;
        k.family = FAM_V6;
        __builtin_memcpy(k.addr, &ip6.daddr, 16);
        fold_v4_mapped(&k);
        proto = ip6.nexthdr;  // extension headers: treated as "other protocol"
        l4 = sizeof(ip6);
    } else {
        return 1;  // not IP (no socket sends these through cgroup egress)
    }
    if (is_loopback(&k))
        return 1;
    u16 ports[2] = {};  // source, destination; network byte order
    u8 bit = proto_bit(proto);
    if (bit != P_OTHER) {
        if (bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)) < 0)
            goto drop;
    }
    if (decide(sb, &k, bpf_ntohs(ports[1]), bit, 0))
        return 1;
    if (bit == P_UDP && answers_udp_peer(cg, &k, ports[1], ports[0]))
        return 1;
drop:;
    u32 slot = sb->slot;
    struct sb_stat *st = sb_stats.lookup(&slot);
    if (st)
        st->dropped_packets += 1;
    return 0;
}

// n bytes equal, n <= 16 (no memcmp: a libcall the object cannot carry).
static __always_inline int same_bytes(const u8 *a, const u8 *b, int n)
{
    u8 acc = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        if (i < n)
            acc |= a[i] ^ b[i];
    return acc == 0;
}

static __always_inline int all_zero16(const u8 *a)
{
    u8 acc = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        acc |= a[i];
    return acc == 0;
}

// What arrives for the sandbox's sockets: every packet passes (this is no
// ingress policy). A UDP datagram to a published UDP port marks its sender
// as a peer the sandbox may answer (note_udp_peer), unless the sandbox sent
// it itself: whatever arrives on its loopback device (only its own netns
// sends there, whatever source address it wrote: one that can forge a
// source, with IP_TRANSPARENT or a raw socket, would otherwise mark any
// address and then send to it), from a loopback address, or to its own
// address from that address (always allowed anyway). Marking those let one
// sandbox churn `udp_peers`, an LRU every sandbox shares, with datagrams to
// itself from thousands of ports until other sandboxes' peers fell out (as
// `accepted` once was: from_itself).
#ifndef LOOPBACK_IFINDEX
#define LOOPBACK_IFINDEX 1   // every netns' lo (include/net/flow.h)
#endif
int dsec_ingress(struct __sk_buff *skb)
{
    if (skb->ifindex == LOOPBACK_IFINDEX)
        return 1;
    u64 cg = bpf_skb_ancestor_cgroup_id(skb, sandbox_level());
    u16 ports[2];  // source, destination; network byte order
    struct lpm_key k = {};
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)) < 0 || ip.protocol != IPPROTO_UDP ||
            (ip.frag_off & bpf_htons(0x1fff)) || ip.saddr == ip.daddr)
            return 1;
        if (bpf_skb_load_bytes(skb, ip.ihl * 4, ports, sizeof(ports)) < 0)
            return 1;
        k.family = FAM_V4;
        __builtin_memcpy(k.addr, &ip.saddr, 4);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)) < 0 || ip6.nexthdr != IPPROTO_UDP ||
            same_bytes((const u8 *)&ip6.saddr, (const u8 *)&ip6.daddr, 16))
            return 1;
        if (bpf_skb_load_bytes(skb, sizeof(ip6), ports, sizeof(ports)) < 0)
            return 1;
        k.family = FAM_V6;
        __builtin_memcpy(k.addr, &ip6.saddr, 16);
        fold_v4_mapped(&k);   // as dsec_egress sees the answer's destination
    } else {
        return 1;
    }
    if (!is_loopback(&k))
        note_udp_peer(cg, k.family, k.addr, 16, ports[0], ports[1]);
    return 1;
}

#ifndef IPPROTO_ICMPV6
#define IPPROTO_ICMPV6 58
#endif
// ICMPv6 neighbor discovery (RFC 4861): the types, and the option kinds that
// carry a link-layer address.
#define ND_ROUTER_SOLICIT 133
#define ND_NEIGHBOR_SOLICIT 135
#define ND_NEIGHBOR_ADVERT 136
#define ND_OPT_SOURCE_LL 1
#define ND_OPT_TARGET_LL 2

// The policy's verdict on a frame the guest sends, IPv4 or IPv6 alike: `k`
// holds the destination, `l4` where the transport header starts. What the
// cgroup hooks count (a connect, a datagram sent) is counted here as a TCP
// SYN without ACK, and every UDP or other datagram. 1 pass, 0 drop.
// What a frame's TCP flags do to its flow in `vm_inbound` (`v`, its value),
// `from_guest` telling which way it goes: whether the flow is over and
// leaves the map. The frame itself passes either way.
static __always_inline int vm_flow_ends(u8 *v, u8 flags, int from_guest)
{
    if (flags & TCP_RST)
        return 1;
    u8 mine = from_guest ? VM_FLOW_GUEST_FIN : VM_FLOW_PEER_FIN;
    u8 theirs = from_guest ? VM_FLOW_PEER_FIN : VM_FLOW_GUEST_FIN;
    if (flags & TCP_FIN) {
        *v |= mine;
        return 0;
    }
    // Both FINs seen, and this side's ACK of the other's: the last frame.
    return (*v & mine) && (*v & theirs) && (flags & TCP_ACK);
}

static __always_inline int tap_decide(struct __sk_buff *skb, struct tap_val *tap, struct sb_val *sb,
                                      struct lpm_key *k, u8 proto, u32 l4)
{
    u8 bit = proto_bit(proto);
    u16 ports[2] = {};  // source, destination; network byte order
    u8 flags = 0;
    int count = bit != P_TCP;
    if (bit != P_OTHER) {
        if (bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)) < 0)
            return 0;
        if (bit == P_TCP) {
            if (bpf_skb_load_bytes(skb, l4 + 13, &flags, 1) < 0)
                return 0;
            count = (flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;  // a connect of the guest's
        }
    }
    int allowed = decide(sb, k, bpf_ntohs(ports[1]), bit, count);
    if (bit == P_TCP && !count && (!allowed || (flags & (TCP_FIN | TCP_RST)))) {
        // Not a connection of the guest's own: an answer to one made to it?
        struct vm_flow f = {};
        f.key = tap->key;
        __builtin_memcpy(f.peer, k->addr, 16);
        f.peer_port = ports[1];
        f.vm_port = ports[0];
        f.family = k->family;
        u8 *v = vm_inbound.lookup(&f);
        if (v) {
            if (vm_flow_ends(v, flags, 1))
                vm_inbound.delete(&f);
            return 1;
        }
    }
    if (allowed)
        return 1;
    if (bit == P_UDP && answers_udp_peer(tap->key, k, ports[1], ports[0]))
        return 1;
    if (count)
        bump_denied(sb->slot, bit != P_TCP);
    return 0;
}

// IPv6 neighbor discovery of the guest's kernel, what ARP is to IPv4: it must
// pass whatever the allowlist says (it goes to multicast groups and to
// neighbors no rule names), so it is held to what resolving addresses needs.
// From one of the VM's own addresses, hop limit 255 (as RFC 4861 requires of
// every receiver), a neighbor advertisement only for one of its own
// addresses, and a link-layer address option, if any, only with its own MAC:
// no poisoning another host's neighbor cache with another sandbox's address
// or MAC. Returns 1: ND that passes; -1: ND (or something that claims to be)
// that does not; 0: no ND, the policy decides.
static __always_inline int tap_nd(struct __sk_buff *skb, struct tap_val *tap, struct ipv6hdr *ip6, int own_src)
{
    u32 at = sizeof(struct ethhdr) + sizeof(struct ipv6hdr);
    u8 type;
    if (bpf_skb_load_bytes(skb, at, &type, 1) < 0)
        return -1;
    u32 hdr;  // the message's bytes before its options
    if (type == ND_ROUTER_SOLICIT)
        hdr = 8;
    else if (type == ND_NEIGHBOR_SOLICIT || type == ND_NEIGHBOR_ADVERT)
        hdr = 24;
    else
        return 0;
    if (!own_src || ip6->hop_limit != 255)
        return -1;
    if (type == ND_NEIGHBOR_ADVERT) {
        u8 target[16];
        if (bpf_skb_load_bytes(skb, at + 8, target, sizeof(target)) < 0)
            return -1;
        if (!same_bytes(target, tap->ip6, 16) && !same_bytes(target, tap->ll6, 16))
            return -1;
    }
    u32 plen = bpf_ntohs(ip6->payload_len);
    if (plen == hdr)
        return 1;
    // One option, as the kernel sends it: this MAC, 8 bytes.
    if (plen != hdr + 8)
        return -1;
    struct {
        u8 type;
        u8 len;     // in units of 8 bytes
        u8 mac[ETH_ALEN];
    } opt;
    if (bpf_skb_load_bytes(skb, at + hdr, &opt, sizeof(opt)) < 0)
        return -1;
    u8 want = type == ND_NEIGHBOR_ADVERT ? ND_OPT_TARGET_LL : ND_OPT_SOURCE_LL;
    if (opt.type != want || opt.len != 1 || !same_bytes(opt.mac, tap->mac, ETH_ALEN))
        return -1;
    return 1;
}

// A microVM's egress: tc ingress of its tap (what the guest sends), attached
// with TCX (dsecd/net/policy.py attach_tap). No socket of the guest exists on
// the host, so this program is the whole policy for it: every frame is
// checked, against the same `rules` as the cgroup programs, through the VM's
// `sandboxes` entry (a live update flips it the same way). The guest is root
// in its own kernel and can send any frame, so the frame must also carry the
// VM's own MAC and address: no spoofing another sandbox on the bridge. What
// is allowed: ARP for its own IPv4 address; IPv6 neighbor discovery for its
// own IPv6 addresses (tap_nd); IPv4 and IPv6 from its own address that the
// policy allows; TCP that answers a connection made to the VM (`vm_inbound`),
// UDP that answers a peer that wrote to a published UDP port (`udp_peers`).
// IPv6 only with an IPv6 lease; from its link-local address only neighbor
// discovery. No other ethertype. Unknown tap or sandbox: dropped (fail
// closed).
int dsec_tap(struct __sk_buff *skb)
{
    u32 ifindex = skb->ifindex;
    struct tap_val *tap = taps.lookup(&ifindex);
    if (!tap)
        return TC_ACT_SHOT;
    u64 key = tap->key;
    struct sb_val *sb = sandboxes.lookup(&key);
    if (!sb)
        return TC_ACT_SHOT;
    struct ethhdr eth;
    if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
        goto drop;
    if (!same_bytes(eth.h_source, tap->mac, ETH_ALEN))
        goto drop;
    struct lpm_key k = {};
    if (eth.h_proto == bpf_htons(ETH_P_ARP)) {
        // arphdr, then sender MAC (6) and sender IPv4 (4) for Ethernet/IPv4
        struct {
            struct arphdr h;
            u8 sha[ETH_ALEN];
            u8 spa[4];
        } __attribute__((packed)) arp;
        if (bpf_skb_load_bytes(skb, sizeof(eth), &arp, sizeof(arp)) < 0)
            goto drop;
        if (arp.h.ar_hrd != bpf_htons(ARPHRD_ETHER) || arp.h.ar_pro != bpf_htons(ETH_P_IP) ||
            arp.h.ar_hln != ETH_ALEN || arp.h.ar_pln != 4)
            goto drop;
        if (!same_bytes(arp.sha, tap->mac, ETH_ALEN) || !same_bytes(arp.spa, (const u8 *)&tap->ip4, 4))
            goto drop;
        return TC_ACT_OK;
    }
    if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (all_zero16(tap->ip6))
            goto drop;  // no IPv6 lease: no IPv6 at all
        if (bpf_skb_load_bytes(skb, sizeof(eth), &ip6, sizeof(ip6)) < 0 || ip6.version != 6)
            goto drop;
        int from_ip6 = same_bytes((const u8 *)&ip6.saddr, tap->ip6, 16);
        int from_ll6 = same_bytes((const u8 *)&ip6.saddr, tap->ll6, 16);
        if (ip6.nexthdr == IPPROTO_ICMPV6) {
            int nd = tap_nd(skb, tap, &ip6, from_ip6 || from_ll6);
            if (nd > 0)
                return TC_ACT_OK;
            if (nd < 0)
                goto drop;
        }
        // The link-local address is for neighbor discovery only: the kernel's
        // MLD reports from it are dropped here too, uncounted (no send of the
        // sandbox's; the bridge floods multicast it has no report for).
        if (!from_ip6)
            goto drop;
        k.family = FAM_V6;
        __builtin_memcpy(k.addr, &ip6.daddr, 16);
        // No fold_v4_mapped(): on the wire ::ffff:a.b.c.d is no IPv4 destination.
        // Extension headers are "other protocol", as in dsec_egress, but for
        // the fragment header of a UDP datagram: its first fragment is decided
        // as the datagram, the others pass with it (vm_frags).
        u8 proto6 = ip6.nexthdr;
        u32 l4 = sizeof(eth) + sizeof(ip6);
        struct vm_frag fr6 = {};
        int more6 = 0;
        if (proto6 == IPPROTO_FRAGMENT) {
            struct frag6 fh;
            if (bpf_skb_load_bytes(skb, l4, &fh, sizeof(fh)) < 0)
                goto drop;
            fr6.key = key;
            __builtin_memcpy(fr6.daddr, &ip6.daddr, 16);
            fr6.id = fh.id;
            fr6.family = FAM_V6;
            if (fh.nexthdr == IPPROTO_UDP) {
                if (fh.frag_off & bpf_htons(FRAG6_OFFSET)) {
                    if (vm_frags.lookup(&fr6))
                        return TC_ACT_OK;
                } else {
                    proto6 = IPPROTO_UDP;
                    l4 += sizeof(fh);
                    more6 = (fh.frag_off & bpf_htons(FRAG6_MORE)) != 0;
                }
            }
        }
        if (tap_decide(skb, tap, sb, &k, proto6, l4)) {
            if (more6) {
                u8 one = 1;
                vm_frags.update(&fr6, &one);
            }
            return TC_ACT_OK;
        }
        goto drop;
    }
    if (eth.h_proto != bpf_htons(ETH_P_IP))
        goto drop;
    struct iphdr ip;
    if (bpf_skb_load_bytes(skb, sizeof(eth), &ip, sizeof(ip)) < 0)
        goto drop;
    if (ip.saddr != tap->ip4)
        goto drop;
    k.family = FAM_V4;
    __builtin_memcpy(k.addr, &ip.daddr, 4);
    u8 proto = ip.protocol;
    struct vm_frag fr = {};
    fr.key = key;
    __builtin_memcpy(fr.daddr, &ip.daddr, 4);
    fr.id = ip.id;
    fr.family = FAM_V4;
    if (ip.frag_off & bpf_htons(0x1fff)) {
        // A later fragment of a UDP datagram whose first one passed (vm_frags).
        if (proto == IPPROTO_UDP && vm_frags.lookup(&fr))
            return TC_ACT_OK;
        proto = 0;  // else it has no ports: "other protocol"
    }
    if (tap_decide(skb, tap, sb, &k, proto, sizeof(eth) + ip.ihl * 4)) {
        if (proto == IPPROTO_UDP && (ip.frag_off & bpf_htons(0x2000 /* IP_MF */))) {
            u8 one = 1;
            vm_frags.update(&fr, &one);
        }
        return TC_ACT_OK;
    }
drop:;
    u32 slot = sb->slot;
    struct sb_stat *st = sb_stats.lookup(&slot);
    if (st)
        st->dropped_packets += 1;
    return TC_ACT_SHOT;
}

// A TCP frame to the VM's own address: a SYN without ACK is a connection
// made to it, whose flow goes into `vm_inbound` (peer = the frame's
// source); the peer's FIN, RST and last ACK of a flow there end it
// (vm_flow_ends).
static __always_inline void note_inbound(struct __sk_buff *skb, struct tap_val *tap, u8 family,
                                         const u8 *peer, int peer_len, u32 l4)
{
    u16 ports[2];
    u8 flags;
    if (bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)) < 0 || bpf_skb_load_bytes(skb, l4 + 13, &flags, 1) < 0)
        return;
    struct vm_flow f = {};
    f.key = tap->key;
    if (peer_len == 4)
        __builtin_memcpy(f.peer, peer, 4);
    else
        __builtin_memcpy(f.peer, peer, 16);
    f.peer_port = ports[0];
    f.vm_port = ports[1];
    f.family = family;
    if ((flags & (TCP_SYN | TCP_ACK)) == TCP_SYN) {
        u8 open = VM_FLOW_OPEN;
        vm_inbound.update(&f, &open);
        return;
    }
    if (!(flags & (TCP_FIN | TCP_RST | TCP_ACK)))
        return;
    u8 *v = vm_inbound.lookup(&f);
    if (v && vm_flow_ends(v, flags, 0))
        vm_inbound.delete(&f);
}

// What goes *to* a microVM: tc egress of its tap (TCX), every frame let
// through. A TCP SYN without ACK to the VM's own address (IPv4, or IPv6 with
// an IPv6 lease) is a connection made to it: its flow goes into `vm_inbound`
// so that dsec_tap lets the answers out, until the connection ends
// (note_inbound). A UDP datagram to a published UDP port of the VM marks its
// sender in `udp_peers` (note_udp_peer). Nothing the guest does can add an
// entry: these frames come from the bridge.
int dsec_tap_in(struct __sk_buff *skb)
{
    u32 ifindex = skb->ifindex;
    struct tap_val *tap = taps.lookup(&ifindex);
    if (!tap)
        return TC_ACT_OK;
    struct ethhdr eth;
    if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
        return TC_ACT_OK;
    u16 ports[2];  // a datagram's source and destination; network byte order
    if (eth.h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (bpf_skb_load_bytes(skb, sizeof(eth), &ip, sizeof(ip)) < 0 || ip.daddr != tap->ip4 ||
            (ip.frag_off & bpf_htons(0x1fff)))
            return TC_ACT_OK;
        u32 l4 = sizeof(eth) + ip.ihl * 4;
        if (ip.protocol == IPPROTO_TCP)
            note_inbound(skb, tap, FAM_V4, (const u8 *)&ip.saddr, 4, l4);
        else if (ip.protocol == IPPROTO_UDP && bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)) == 0)
            note_udp_peer(tap->key, FAM_V4, (const u8 *)&ip.saddr, 4, ports[0], ports[1]);
    } else if (eth.h_proto == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (all_zero16(tap->ip6) || bpf_skb_load_bytes(skb, sizeof(eth), &ip6, sizeof(ip6)) < 0 ||
            !same_bytes((const u8 *)&ip6.daddr, tap->ip6, 16))
            return TC_ACT_OK;
        u32 l4 = sizeof(eth) + sizeof(ip6);
        u8 proto6 = ip6.nexthdr;
        if (proto6 == IPPROTO_FRAGMENT) {
            // A datagram past the MTU: its first fragment has the UDP header
            // after the fragment header; the others have no ports.
            struct frag6 fh;
            if (bpf_skb_load_bytes(skb, l4, &fh, sizeof(fh)) < 0 || fh.nexthdr != IPPROTO_UDP ||
                (fh.frag_off & bpf_htons(FRAG6_OFFSET)))
                return TC_ACT_OK;
            proto6 = IPPROTO_UDP;
            l4 += sizeof(fh);
        }
        if (proto6 == IPPROTO_TCP)
            note_inbound(skb, tap, FAM_V6, (const u8 *)&ip6.saddr, 16, l4);
        else if (proto6 == IPPROTO_UDP && bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)) == 0)
            note_udp_peer(tap->key, FAM_V6, (const u8 *)&ip6.saddr, 16, ports[0], ports[1]);
    }
    return TC_ACT_OK;
}
