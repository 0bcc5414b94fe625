// SPDX-License-Identifier: GPL-2.0
// Failed syscalls of processes in watched sandboxes, for the denial counts of
// task policies (dsecd/denials.py; docs/hardening.md "Task policies").
//
// Landlock reports its denials only through the audit subsystem, which is off
// on hosts without auditd, and fentry programs on its functions need program
// types this CI kernel refuses. So this program looks at what a denial does
// to the process instead: a raw tracepoint on sys_exit sees every syscall
// return; those that Landlock mediates and that fail with EACCES or EPERM, in
// a sandbox the daemon watches, go to user space through a ring buffer with
// their arguments (paths, socket address, signal target) and the session id
// of the process (each exec leads a session of its own: that names the exec).
//
// Struct offsets come from the kernel's BTF (dsecd/btf.py) as -D constants:
// the headers bcc compiles against may be another kernel's.
//
//   watched   hash      sandbox cgroup v2 id -> 1
//   events    ringbuf   struct denial records
//   lost      array     [0]: records dropped because the ring buffer was full

#include <uapi/linux/bpf.h>

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif
#ifndef MAX_SANDBOXES
#define MAX_SANDBOXES 4096
#endif
#define PATH_LEN 256
#define PATH2_LEN 128
#define ADDR_LEN 128         // a power of two: reads of the address's own length are masked with it

#define EPERM 1
#define EACCES 13

// struct pt_regs of x86_64, from r10 (offset 56) to orig_ax (offset 120): a
// kernel ABI (ptrace's user_regs_struct has the same order).
#define REGS_FROM 56
#define R_R10 0
#define R_R9 1
#define R_R8 2
#define R_DX 5
#define R_SI 6
#define R_DI 7
#define R_ORIG_AX 8
#define N_REGS 9

// What to read at the syscall's arguments (x86_64 numbers).
#define NO_ARG 7

struct denial {
    u64 cgroup;
    u64 pid_tgid;
    u32 session;      // the session leader's pid in its own (the sandbox's) pid namespace
    s32 ret;          // -EACCES or -EPERM
    u32 nr;           // syscall number
    u32 pad;
    u64 args[6];
    char comm[16];
    char path[PATH_LEN];     // the path argument, as the process gave it
    char path2[PATH2_LEN];   // the second path (rename, link, symlink's target)
    u8 addr[ADDR_LEN];       // a socket address (connect, bind, sendto, sendmsg), zero-padded
};

BPF_HASH(watched, u64, u32, MAX_SANDBOXES);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(lost, u64, 1);

// Which argument holds a path, a second path, a sockaddr, a msghdr (NO_ARG:
// none); 0 for a syscall Landlock does not mediate.
static __always_inline int shape(u32 nr, int *p1, int *p2, int *sa, int *msg)
{
    *p1 = *p2 = *sa = *msg = NO_ARG;
    switch (nr) {
    case 2: case 59: case 76: case 83: case 84: case 85: case 87: case 133:   // open execve truncate mkdir rmdir creat unlink mknod
        *p1 = 0; return 1;
    case 257: case 258: case 259: case 263: case 322: case 437:   // openat mkdirat mknodat unlinkat execveat openat2
        *p1 = 1; return 1;
    case 82: case 86:             // rename link
        *p1 = 0; *p2 = 1; return 1;
    case 88:                      // symlink(target, linkpath)
        *p1 = 1; *p2 = 0; return 1;
    case 264: case 265: case 316: // renameat linkat renameat2
        *p1 = 1; *p2 = 3; return 1;
    case 266:                     // symlinkat(target, newdirfd, linkpath)
        *p1 = 2; *p2 = 0; return 1;
    case 42: case 49:             // connect bind
        *sa = 1; return 1;
    case 44:                      // sendto(fd, buf, len, flags, addr, addrlen)
        *sa = 4; return 1;
    case 46:                      // sendmsg(fd, msghdr, flags)
        *msg = 1; return 1;
    case 77: case 62: case 200: case 234: case 129: case 297: case 424:
        return 1;                 // ftruncate kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo pidfd_send_signal
    }
    return 0;
}

static __always_inline u64 arg(const u64 *a, int i)
{
    switch (i) {
    case 0: return a[R_DI];
    case 1: return a[R_SI];
    case 2: return a[R_DX];
    case 3: return a[R_R10];
    case 4: return a[R_R8];
    case 5: return a[R_R9];
    }
    return 0;
}

// The session leader's pid in the innermost pid namespace it belongs to.
static __always_inline u32 session_of_current(void)
{
    u64 task = bpf_get_current_task(), signal = 0, pid = 0;
    u32 level = 0, nr = 0;

    bpf_probe_read_kernel(&signal, sizeof(signal), (void *)(task + OFF_TASK_SIGNAL));
    if (!signal)
        return 0;
    bpf_probe_read_kernel(&pid, sizeof(pid), (void *)(signal + OFF_SIGNAL_SID_PID));
    if (!pid)
        return 0;
    bpf_probe_read_kernel(&level, sizeof(level), (void *)(pid + OFF_PID_LEVEL));
    if (level > 32)
        return 0;
    bpf_probe_read_kernel(&nr, sizeof(nr), (void *)(pid + OFF_PID_NUMBERS + level * SIZEOF_UPID + OFF_UPID_NR));
    return nr;
}

// Not bcc's RAW_TRACEPOINT_PROBE: bcc would attach that in the compiling helper
// too. The daemon attaches this by name (dsecd/net/bpfsys.py raw_tracepoint_open).
int dsec_sys_exit(struct bpf_raw_tracepoint_args *ctx)
{
    long ret = (long)ctx->args[1];
    u64 cg, regs[N_REGS] = {0};
    int p1, p2, sa, msg, zero = 0;
    struct denial *d;

    if (ret != -EACCES && ret != -EPERM)
        return 0;
    cg = bpf_get_current_cgroup_id();
    if (!watched.lookup(&cg))
        return 0;
    bpf_probe_read_kernel(regs, sizeof(regs), (void *)(ctx->args[0] + REGS_FROM));
    if (!shape((u32)regs[R_ORIG_AX], &p1, &p2, &sa, &msg))
        return 0;
    d = events.ringbuf_reserve(sizeof(struct denial));
    if (!d) {
        u64 *n = lost.lookup(&zero);
        if (n)
            __sync_fetch_and_add(n, 1);
        return 0;
    }
    d->cgroup = cg;
    d->pid_tgid = bpf_get_current_pid_tgid();
    d->session = session_of_current();
    d->ret = (s32)ret;
    d->nr = (u32)regs[R_ORIG_AX];
    d->pad = 0;
    for (int i = 0; i < 6; i++)
        d->args[i] = arg(regs, i);
    bpf_get_current_comm(d->comm, sizeof(d->comm));
    d->path[0] = d->path2[0] = 0;
    __builtin_memset(d->addr, 0, sizeof(d->addr));
    if (p1 != NO_ARG)
        bpf_probe_read_user_str(d->path, sizeof(d->path), (void *)arg(regs, p1));
    if (p2 != NO_ARG)
        bpf_probe_read_user_str(d->path2, sizeof(d->path2), (void *)arg(regs, p2));
    if (msg != NO_ARG || sa != NO_ARG) {
        u64 name = 0, len = 0;

        if (msg != NO_ARG) {      // struct msghdr: msg_name (offset 0), msg_namelen (u32, offset 8)
            struct { u64 name; u32 len; } m = {0};

            bpf_probe_read_user(&m, sizeof(m), (void *)arg(regs, msg));
            name = m.name;
            len = m.len;
        } else {
            name = arg(regs, sa);
            len = arg(regs, sa + 1);     // the address length follows the address
        }
        if (len > ADDR_LEN)
            len = ADDR_LEN;
        len &= ADDR_LEN * 2 - 1;
        if (name && len > 0 && len <= ADDR_LEN)
            bpf_probe_read_user(d->addr, len, (void *)name);
    }
    events.ringbuf_submit(d, 0);
    return 0;
}
