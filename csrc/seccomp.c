/* seccomp.c - the sandbox seccomp profile: built once in the daemon, installed
 * in exec children.
 *
 * Two halves, because the exec child (spawn.c) shares the daemon's memory
 * (CLONE_VM|CLONE_VFORK) and may not allocate:
 *
 *   dsec_seccomp_build(profile)    in the daemon, once, at start: libseccomp
 *                                  builds the filter and exports its classic
 *                                  BPF into static storage of this file.
 *   dsec_seccomp_install(profile)  in the child, just before execve: one raw
 *                                  seccomp(2) on that pre-built program.
 *                                  Async-signal-safe: no malloc, no locks, no
 *                                  libseccomp, no errno (the child shares the
 *                                  caller's TLS: the result is returned).
 *
 * The profile is a deny list (what no agent task needs: see
 * docs/hardening.md), denied with EPERM rather than a kill, so a tool that
 * probes for a feature sees a plain error and carries on. Syscalls of another
 * ABI (i386 via int 0x80, x32) are refused with EPERM by libseccomp's
 * architecture check: otherwise `int 0x80` would reach the i386 numbers of
 * mount and friends, which this x86_64 list does not name.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/fs.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <seccomp.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

#define PROFILES 2

/* A built program; `len` is published last (release), read first (acquire). */
static struct sock_filter programs[PROFILES][DSEC_SECCOMP_MAX_INSNS];
static unsigned short program_len[PROFILES];
static pthread_mutex_t build_lock = PTHREAD_MUTEX_INITIALIZER;

/* Denied outright. Each is either a way out of the sandbox's namespaces or
 * mounts, a kernel-wide knob, or a large attack surface no agent task uses. */
static const char *const denied_syscalls[] = {
    /* mounts: the sandbox's mount table is the daemon's to shape */
    "mount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr",
    /* namespaces: joining another's, or making a user namespace, is the
     * classic first step of a container escape (unshare/clone: see below) */
    "setns",
    /* kernel-wide state */
    "bpf", "perf_event_open", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "iopl", "ioperm", "lookup_dcookie",
    "fanotify_init",
    /* the kernel keyring is not namespaced per sandbox */
    "keyctl", "add_key", "request_key",
    /* file handles bypass path permission checks (the "shocker" escape) */
    "open_by_handle_at",
    /* userfaultfd stretches kernel race windows at will (exploit primitive) */
    "userfaultfd",
    /* other processes' memory: only the daemon may trace (dsecd.trace) */
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    /* io_uring runs opens, connects and uring_cmd ioctls that this filter never
     * sees, and is a large kernel attack surface */
    "io_uring_setup", "io_uring_enter", "io_uring_register",
};

/* clone/unshare flags that make a namespace. CLONE_NEWTIME (0x80) only for
 * unshare: in clone(2)'s flags the low byte is the exit signal. */
static const uint64_t ns_flags[] = {CLONE_NEWUSER, CLONE_NEWNS,  CLONE_NEWPID,    CLONE_NEWNET,
                                    CLONE_NEWUTS,  CLONE_NEWIPC, CLONE_NEWCGROUP, 0x80};
#define NS_FLAGS_CLONE (sizeof(ns_flags) / sizeof(ns_flags[0]) - 1)

#define IOC_TYPE_NR_MASK ((uint64_t)((_IOC_TYPEMASK << _IOC_TYPESHIFT) | (_IOC_NRMASK << _IOC_NRSHIFT)))
#define IOC_TYPE_NR(type, nr) ((uint64_t)(((type) << _IOC_TYPESHIFT) | ((nr) << _IOC_NRSHIFT)))

/* ioctls matched by type and number only, whatever the size and direction
 * bits say: the struct sizes differ between header versions, and a request
 * with a wrong size still reaches the same handler in some drivers. */
static const uint64_t denied_ioctls_type_nr[] = {
    IOC_TYPE_NR('X', 109), /* XFS_IOC_SWAPEXT: swap extents of two files */
    IOC_TYPE_NR('X', 129), /* XFS_IOC_EXCHANGE_RANGE (Linux 6.10) */
    IOC_TYPE_NR('X', 119), /* FIFREEZE: freeze the whole file system */
    IOC_TYPE_NR('X', 120), /* FITHAW */
    IOC_TYPE_NR('f', 15),  /* EXT4_IOC_MOVE_EXT: move extents between files */
    IOC_TYPE_NR('f', 17),  /* EXT4_IOC_SWAP_BOOT: swap an inode with the boot loader inode */
};

/* Legacy tty ioctls without _IOC encoding: matched on all 32 bits. */
static const uint64_t denied_ioctls_exact[] = {
    TIOCSTI,  /* push input into a terminal: typing into another session */
    TIOCLINUX, /* console selection and keyboard tricks */
    TIOCCONS, /* redirect the console */
    TIOCSETD, /* line disciplines autoload modules (n_hdlc, n_gsm CVEs) */
};

/* The kernel takes ioctl's request as an unsigned int: the upper 32 bits of
 * the register are ignored, so every comparison masks them away (a filter
 * that compared 64 bits could be passed by TIOCSTI | 1 << 32). */
#define LOW32 0xffffffffULL

/* Socket families outside the sandbox's network namespace: vsock is not
 * namespaced, so a vsock socket reaches the hypervisor of a host that is a
 * VM (CID 2) and the host's other VMs, whatever the sandbox's network
 * (--net none included) and its egress allowlist. Docker's default profile
 * refuses it too. socket() takes the family as an int: masked as ioctl's. */
static const uint64_t denied_socket_families[] = {AF_VSOCK};

static int add_rules(scmp_filter_ctx ctx, uint32_t deny, int profile)
{
    int rc = 0;

    for (size_t i = 0; i < sizeof(denied_syscalls) / sizeof(denied_syscalls[0]); i++) {
        int nr = seccomp_syscall_resolve_name(denied_syscalls[i]);
        if (nr == __NR_SCMP_ERROR)
            return -EINVAL; /* a name this libseccomp does not know: fix the list */
        if ((rc = seccomp_rule_add(ctx, deny, nr, 0)) < 0)
            return rc;
    }
    for (size_t i = 0; i < sizeof(ns_flags) / sizeof(ns_flags[0]); i++) {
        uint64_t f = ns_flags[i];
        /* DSEC_SECCOMP_FNCALL lets unshare make an IPC or a net namespace
         * (clone still may not): the zygote of a call sandbox, which alone
         * there holds CAP_SYS_ADMIN, gives each call its own. Every other
         * process of the sandbox lacks the capability, and unshare fails with
         * EPERM. */
        int unshare_allowed = profile == DSEC_SECCOMP_FNCALL && (f == CLONE_NEWIPC || f == CLONE_NEWNET);

        if (!unshare_allowed && (rc = seccomp_rule_add(ctx, deny, SCMP_SYS(unshare), 1,
                                                       SCMP_A0(SCMP_CMP_MASKED_EQ, f, f))) < 0)
            return rc;
        if (i < NS_FLAGS_CLONE &&
            (rc = seccomp_rule_add(ctx, deny, SCMP_SYS(clone), 1,
                                   SCMP_A0(SCMP_CMP_MASKED_EQ, f, f))) < 0)
            return rc;
    }
    /* clone3 passes its flags in memory, out of a filter's reach: ENOSYS makes
     * glibc (and Go, and musl) fall back to clone(2), whose flags are checked. */
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0)) < 0)
        return rc;
    for (size_t i = 0; i < sizeof(denied_ioctls_type_nr) / sizeof(denied_ioctls_type_nr[0]); i++)
        if ((rc = seccomp_rule_add(ctx, deny, SCMP_SYS(ioctl), 1,
                                   SCMP_A1(SCMP_CMP_MASKED_EQ, IOC_TYPE_NR_MASK,
                                           denied_ioctls_type_nr[i]))) < 0)
            return rc;
    for (size_t i = 0; i < sizeof(denied_ioctls_exact) / sizeof(denied_ioctls_exact[0]); i++)
        if ((rc = seccomp_rule_add(ctx, deny, SCMP_SYS(ioctl), 1,
                                   SCMP_A1(SCMP_CMP_MASKED_EQ, LOW32, denied_ioctls_exact[i]))) < 0)
            return rc;
    for (size_t i = 0; i < sizeof(denied_socket_families) / sizeof(denied_socket_families[0]); i++)
        if ((rc = seccomp_rule_add(ctx, deny, SCMP_SYS(socket), 1,
                                   SCMP_A0(SCMP_CMP_MASKED_EQ, LOW32, denied_socket_families[i]))) < 0)
            return rc;
    return 0;
}

/* libseccomp 2.5 exports only to an fd: a memfd, read back into `out`. */
static int export_program(scmp_filter_ctx ctx, struct sock_filter *out, size_t max)
{
    int fd = memfd_create("dsec-seccomp", MFD_CLOEXEC);
    ssize_t n;
    int rc;

    if (fd < 0)
        return -errno;
    rc = seccomp_export_bpf(ctx, fd);
    if (rc < 0)
        goto out;
    n = pread(fd, out, max * sizeof(*out), 0);
    if (n < 0)
        rc = -errno;
    else if (n == 0 || n % sizeof(*out))
        rc = -EIO;
    else if ((size_t)n == max * sizeof(*out) && lseek(fd, 0, SEEK_END) > n)
        rc = -E2BIG;
    else
        rc = (int)(n / sizeof(*out));
out:
    close(fd);
    return rc;
}

/* A libseccomp context holding `profile`, or NULL with *rc = -errno. */
static scmp_filter_ctx make_filter(int profile, int *rc)
{
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);

    if (!ctx) {
        *rc = -ENOMEM;
        return NULL;
    }
    /* Native x86_64 only: i386 (int 0x80) and x32 calls are another ABI with
     * other numbers; refuse them all rather than filter three tables. */
    *rc = seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_ERRNO(EPERM));
    /* Syscall numbers as a binary tree, not a chain of comparisons. Every
     * install (each sandbox's init, each exec) makes the kernel run the filter
     * for every syscall number to cache the always-allowed ones
     * (seccomp_cache_prepare, with interrupts off): through the chain that was
     * ~4% of an exec's CPU, through the tree a few comparisons per number.
     * Processes pay less per syscall that the cache does not cover, too. */
    if (*rc == 0)
        *rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2);
    if (*rc == 0)
        *rc = add_rules(ctx, SCMP_ACT_ERRNO(EPERM), profile);
    if (*rc < 0) {
        seccomp_release(ctx);
        return NULL;
    }
    return ctx;
}

/* Build `profile` into static storage (once; later calls return the same
 * length). Returns the number of BPF instructions, or -errno. */
int dsec_seccomp_build(int profile)
{
    scmp_filter_ctx ctx;
    int rc;

    if (profile < 0 || profile >= PROFILES)
        return -EINVAL;
    pthread_mutex_lock(&build_lock);
    rc = __atomic_load_n(&program_len[profile], __ATOMIC_ACQUIRE);
    if (rc == 0 && (ctx = make_filter(profile, &rc)) != NULL) {
        rc = export_program(ctx, programs[profile], DSEC_SECCOMP_MAX_INSNS);
        seccomp_release(ctx);
        if (rc > 0)
            __atomic_store_n(&program_len[profile], (unsigned short)rc, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&build_lock);
    return rc;
}

/* Install the pre-built `profile` on the calling thread. Async-signal-safe.
 * Needs no_new_privs or CAP_SYS_ADMIN (else -EACCES). -ENOENT: never built. */
int dsec_seccomp_install(int profile)
{
    struct sock_fprog prog;
    long rc;

    if (profile < 0 || profile >= PROFILES)
        return -EINVAL;
    prog.len = __atomic_load_n(&program_len[profile], __ATOMIC_ACQUIRE);
    if (prog.len == 0)
        return -ENOENT;
    prog.filter = programs[profile];
    rc = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog);
    /* In a CLONE_VM child errno is the caller's TLS: read it at once. */
    return rc < 0 ? -errno : 0;
}

/* prctl(PR_SET_NO_NEW_PRIVS) for callers outside spawn.c (tests, fncall). */
int dsec_seccomp_no_new_privs(void)
{
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ? -errno : 0;
}

/* The filter as libseccomp's pseudo-C, for docs and debugging. */
int dsec_seccomp_export_pfc(int profile, int fd)
{
    scmp_filter_ctx ctx;
    int rc;

    if (profile < 0 || profile >= PROFILES)
        return -EINVAL;
    if ((ctx = make_filter(profile, &rc)) == NULL)
        return rc;
    rc = seccomp_export_pfc(ctx, fd);
    seccomp_release(ctx);
    return rc;
}
