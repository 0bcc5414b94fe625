/* dsec_native.h - the C entry points of dsecd._native (see docs/native-api.md).
 *
 * Error contract (csrc/ERRORS.md): every entry point returns >= 0 on success and
 * -errno on failure; the spawn helpers also fill a struct dsec_err with the step
 * that failed and the path it failed on.
 *
 * The block between CFFI-BEGIN and CFFI-END is read verbatim by
 * dsecd/_native_build.py as the cffi cdef, so it holds plain declarations only:
 * no #if, no macros with expressions, no includes.
 */
#ifndef DSEC_NATIVE_H
#define DSEC_NATIVE_H

#include <stdint.h>
#include <sys/types.h>

/* CFFI-BEGIN */
#define DSEC_ERR_PATH_MAX 256
#define DSEC_MAX_CGROUPS 16
/* supplementary groups an exec may have (a user listed in more /etc/group lines is refused) */
#define DSEC_MAX_GROUPS 1024
/* fds a container spawn may name by /proc/self/fd/N (idmapped layers, the upper dir) */
#define DSEC_MAX_PATH_FDS 256

/* Which step of a multi-step helper failed. Python names them by lowercasing
 * what follows DSEC_STEP_, so renaming one is an API change. */
enum dsec_step {
    DSEC_STEP_NONE = 0,
    /* in the calling thread, before clone */
    DSEC_STEP_OPEN_INIT = 1,
    DSEC_STEP_OPEN_CGROUP = 2,
    DSEC_STEP_STACK = 3,
    DSEC_STEP_CLONE = 4,
    /* in the container child, in this order */
    DSEC_STEP_CGROUP_JOIN = 10,
    DSEC_STEP_CGROUP_NS = 11,
    DSEC_STEP_MOUNT_PRIVATE = 12,
    DSEC_STEP_MOUNT_OVERLAY = 13,
    DSEC_STEP_CHDIR_ROOTFS = 14,
    DSEC_STEP_MKDIR = 15,
    DSEC_STEP_MOUNT_PROC = 16,
    DSEC_STEP_MOUNT_DEV = 17,
    DSEC_STEP_DEV_NODE = 18,
    DSEC_STEP_MOUNT_DEVPTS = 19,
    DSEC_STEP_MOUNT_SHM = 20,
    DSEC_STEP_DEV_LINK = 21,
    DSEC_STEP_MOUNT_TMP = 22,
    DSEC_STEP_HOSTNAME = 23,
    DSEC_STEP_LOOPBACK = 24,
    DSEC_STEP_PIVOT_ROOT = 25,
    DSEC_STEP_STDIO = 26,
    DSEC_STEP_CLOSE_FDS = 27,
    DSEC_STEP_NO_NEW_PRIVS = 28,
    DSEC_STEP_CAPS = 29,
    DSEC_STEP_EXEC_INIT = 30,
    /* CPU QoS, in the container child (after cgroup_ns) and in the exec
     * child (before ids: sharing a cookie needs ptrace access to PID 1) */
    DSEC_STEP_SCHED_IDLE = 31,
    DSEC_STEP_SCHED_CORE = 32,
    /* last step before execve / execveat of init, in both children */
    DSEC_STEP_SECCOMP = 33,
    /* container child, first: join the pooled network namespace (netns_fd) */
    DSEC_STEP_NETNS_JOIN = 34,
    /* container child, after stdio: the upper tmpfs's fd kept open for init */
    DSEC_STEP_UPPER_FD = 35,
    DSEC_STEP_CTL_FD = 36, /* the exec channel's end kept open for init */
    /* container child with root_ns_fd: a copy of that mount namespace
     * entered, the overlay attached on its root, chroot into it */
    DSEC_STEP_ROOT_NS = 37,
    /* dsec_vm_root: the VM's root (its tmpfs, pivot_root into it), and one
     * bind into it (path: the target, relative to that root) */
    DSEC_STEP_VM_ROOT = 38,
    DSEC_STEP_VM_ROOT_BIND = 39,
    /* in the exec helper and the exec child (stdio, close_fds, caps,
     * no_new_privs above are shared) */
    DSEC_STEP_SETNS = 40,
    DSEC_STEP_SETSID = 41,
    DSEC_STEP_IDS = 42,
    DSEC_STEP_CHDIR = 43,
    DSEC_STEP_EXEC = 44,
    DSEC_STEP_EXEC_INTERP = 45,
    /* dsec-init could not take an exec request (malformed, too many execs,
     * no pidfd for it) */
    DSEC_STEP_INIT_REQUEST = 46,
    /* container and exec children: oom_score_adj back to 0 */
    DSEC_STEP_OOM_SCORE = 47,
    /* exec children of a pty exec: ioctl(0, TIOCSCTTY) after setsid and stdio */
    DSEC_STEP_CTTY = 48,
    /* user namespaces (csrc/userns.c; docs/hardening.md "User namespaces"):
     * userns_map in the daemon (dsec_userns_create); fsids, sysctl and
     * userns_enter in the container child; userns_enter in the exec child */
    DSEC_STEP_USERNS_MAP = 50,
    DSEC_STEP_USERNS_FSIDS = 51,
    DSEC_STEP_USERNS_SYSCTL = 52,
    DSEC_STEP_USERNS_ENTER = 53,
    /* exec children, last before execve: the exec's task policy with
     * Landlock (csrc/policy_steps.h); the path names the rule that failed */
    DSEC_STEP_LANDLOCK = 54,
    /* container child with root_ns_fd: the idmapped layer clones attached
     * under the overlay (park_fds) */
    DSEC_STEP_PARK_LAYERS = 55,
    /* an exec's step (helper or dsec-init), after the user namespace */
    DSEC_STEP_IPC_NS = 56,
    /* a sandbox's cgroups in the daemon (cgroupfs.c dsec_cgroup_make) */
    DSEC_STEP_CGROUP_MKDIR = 60,
    DSEC_STEP_CGROUP_WRITE = 61,
    /* a path as a client sees it (dsec_peer_tree): its mount namespace
     * and root entered, the tree at the path cloned */
    DSEC_STEP_PEER_NS = 62,
    DSEC_STEP_PEER_TREE = 63,
    /* ... as a client other than root: its ids taken, the path opened with them */
    DSEC_STEP_PEER_IDS = 64,
    DSEC_STEP_PEER_OPEN = 65
};

/* Whose access checks a lookup makes (dsec_peer_tree, dsec_reader_ids_set):
 * a client's uid, gid and supplementary groups. */
struct dsec_reader {
    uint32_t uid;
    uint32_t gid;
    const uint32_t *groups;
    int n_groups;
};

struct dsec_err {
    int err;  /* positive errno, 0 = no error */
    int step; /* enum dsec_step */
    char path[DSEC_ERR_PATH_MAX];
};

/* All strings are prepared by native.py: the child may not allocate. */
struct dsec_container_args {
    const char *rootfs;       /* empty host dir, the overlay mount point */
    const char *overlay_opts; /* "lowerdir=a:b,upperdir=u,workdir=w" */
    const char *init_path;    /* host path of dsec-init */
    const char *hostname;
    const char *scratch_opts; /* tmpfs data of the scratch: /dev, /dev/shm, /tmp (spawn.c) */
    const char *const *cgroup_procs;
    int n_cgroups;
    int sched_idle; /* nonzero: SCHED_IDLE for init (and what it forks) */
    int core_sched; /* nonzero: a new core-scheduling cookie for init */
    int seccomp_profile; /* >= 0: install this pre-built filter before exec of init; -1: none */
    int userns_fd;       /* >= 0: init enters this user namespace last (dsec_userns_create) */
    uint32_t userns_uid; /* host uid and gid that in-sandbox 0 maps to: the fs ids of */
    uint32_t userns_gid; /* the setup steps, so what they create belongs to sandbox root */
    int netns_fd; /* >= 0: join this network namespace (the netns pool's); -1: a new one */
    int upper_fd; /* >= 0: mount fd of the upper tmpfs, left open in init as DSEC_INIT_UPPER_FD */
    const int *path_fds; /* the fds named by /proc/self/fd/N paths in rootfs or overlay_opts */
    int n_path_fds;      /* at most DSEC_MAX_PATH_FDS */
    const int *park_fds; /* detached mounts among path_fds the overlay is done with (idmapped */
    int n_park_fds;      /* layer clones): with root_ns_fd, attached under the overlay */
    int ctl_fd;       /* >= 0: init's end of its exec channel, left open in init as DSEC_INIT_CTL_FD */
    int ctl_peer_fd;  /* with ctl_fd: the daemon's end, also kept by init (DSEC_INIT_PEER_FD) */
    int oom_reset;    /* nonzero: oom_score_adj back to 0 (the daemon's own is negative) */
    uint64_t init_caps; /* capabilities init keeps permitted (never effective) for the execs it forks */
    int root_ns_fd;   /* >= 0: a mount namespace from dsec_root_ns(): init gets a copy of it, with the
                       * overlay on its root, instead of a copy of the daemon's pivot_root'ed */
    const char *proc_opts; /* mount data of the sandbox's /proc ("hidepid=invisible,gid=N"); NULL: none */
    int root_readonly;     /* nonzero: the merged root (not /proc, /dev, /tmp, /dev/shm) is read-only */
};

struct dsec_exec_args {
    int pidfd; /* pidfd of the sandbox's PID 1 */
    const char *const *cgroup_procs;
    int n_cgroups;
    const char *const *argv; /* NULL-terminated; argv[0] is searched in PATH */
    const char *const *envp; /* NULL-terminated */
    const char *cwd;
    uint32_t uid;
    uint32_t gid;
    const uint32_t *groups; /* supplementary gids, set with setgroups before gid and uid */
    uint32_t n_groups;      /* at most DSEC_MAX_GROUPS; 0: none */
    int stdin_fd;
    int stdout_fd;
    int stderr_fd;
    uint64_t cap_keep;
    int sched_idle; /* nonzero: SCHED_IDLE before execve (children inherit it) */
    int core_sched; /* nonzero: share the cookie of the sandbox's PID 1 */
    int seccomp_profile; /* >= 0: install this pre-built filter just before execve; -1: none */
    int userns;          /* nonzero: join the user namespace of PID 1 (before caps and ids) */
    int oom_reset;       /* nonzero: oom_score_adj back to 0 (the daemon's own is negative) */
    int ctty;            /* nonzero: stdin is a tty slave that becomes the controlling terminal */
    const unsigned char *policy; /* NULL, or a task policy's plan (struct dsec_policy_head ...) */
    size_t policy_len;
    int own_ipc;         /* nonzero: unshare an IPC namespace of its own (needs userns) before its ids */
};

/* A task policy as the exec children apply it (csrc/policy_steps.h), compiled
 * by dsecd/policy.py: this head, n_ports struct dsec_policy_port, then n_paths
 * entries, each a struct dsec_policy_path followed by strings_len bytes: its
 * absolute path and n_except names, each NUL-terminated (padded to 8). Native
 * byte order: it never leaves the host. */
#define DSEC_POLICY_MAGIC 0x64737031
#define DSEC_POLICY_MAX_BYTES 16384
/* Entries one DSEC_POLICY_CHILDREN directory may have (one rule each); more fail the exec with E2BIG. */
#define DSEC_POLICY_MAX_CHILDREN 4096
#define DSEC_POLICY_RULE 0     /* access on path, and beneath it for a directory */
#define DSEC_POLICY_CHILDREN 1 /* access on every entry of the directory path, but the names after it */
struct dsec_policy_head {
    uint32_t magic;
    uint32_t n_ports;
    uint32_t n_paths;
    uint32_t restrict_flags; /* landlock_restrict_self's flags */
    uint64_t handled_fs;     /* struct landlock_ruleset_attr */
    uint64_t handled_net;
    uint64_t scoped;
};
struct dsec_policy_port {
    uint64_t port;
    uint64_t access; /* LANDLOCK_ACCESS_NET_* */
};
struct dsec_policy_path {
    uint64_t access; /* LANDLOCK_ACCESS_FS_* */
    uint32_t kind;   /* DSEC_POLICY_RULE or DSEC_POLICY_CHILDREN */
    uint32_t n_except;
    uint32_t strings_len;
    uint32_t reserved;
};

struct dsec_kvm_probe {
    int api;         /* KVM_GET_API_VERSION, or -errno */
    int open_err;    /* 0 or -errno of open("/dev/kvm") */
    int create_vm;   /* 0 or -errno */
    int create_vcpu; /* 0 or -errno */
    int run;         /* 0: a real-mode test guest ran to HLT; -errno; or the
                        unexpected KVM_EXIT_* reason (> 0) */
};

/* netns.c */
int dsec_netns_create(void);

/* What one entry of a VM's root (dsec_vm_root) makes, at `target` (relative
 * to that root; its parent made by an earlier entry). */
enum dsec_root_kind {
    DSEC_ROOT_DIR = 1,       /* an empty directory, mode 0755 */
    DSEC_ROOT_SYMLINK = 2,   /* a symlink whose text is src */
    DSEC_ROOT_BIND_DIR = 3,  /* host directory src bound (recursively), then remounted with flags */
    DSEC_ROOT_BIND_FILE = 4, /* host file (or device node) src bound, then remounted with flags */
    DSEC_ROOT_PROC = 5       /* a new procfs mounted with flags, src its options */
};

struct dsec_root_entry {
    int kind;            /* enum dsec_root_kind */
    unsigned long flags; /* binds and proc: MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC */
    const char *src;
    const char *target;
};

/* spawn.c */
int dsec_spawn_container(const struct dsec_container_args *args, struct dsec_err *err);
int dsec_root_ns(const char *dir, struct dsec_err *err);
int dsec_vm_root(const char *dir, const struct dsec_root_entry *entries, int n, struct dsec_err *err);
int dsec_peer_tree(int pidfd, int rootfd, const char *path, const struct dsec_reader *reader,
                   struct dsec_err *err);
int dsec_attach_tree(int tree, const char *target);
int dsec_spawn_exec(const struct dsec_exec_args *args, struct dsec_err *err);
int dsec_kill_uid_in(int pidfd, uint32_t uid);
int dsec_pidfd_open(int pid, unsigned int flags);
int dsec_pidfd_send_signal(int pidfd, int sig);

/* fileops.c */
int dsec_file_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve);
long dsec_file_fs_magic(int fd);
long dsec_vmsplice(int fd, const void *buf, size_t len);

/* cgroupfs.c */
int dsec_cgroup_make(const char *const *dirs, int n_dirs, const char *const *files,
                     const char *const *values, int n_writes, struct dsec_err *err);

/* sched.c */
int dsec_sched_set_idle(int pid);
int dsec_sched_core_create(int pid);
int dsec_sched_core_share_from(int pid);
int dsec_ioprio_idle(void);

/* probe.c */
int dsec_probe_sched_core(void);
int dsec_probe_landlock_abi(void);
int dsec_probe_seccomp(void);
int dsec_probe_bpf_cgroup(const char *cgroup_dir);
void dsec_probe_kvm(struct dsec_kvm_probe *out);
int dsec_probe_openat2(void);
int dsec_probe_pidfd(void);
int dsec_probe_clone3(void);

/* madvise.c: advice on / fault-in of ranges of another process */
struct dsec_madvise_result {
    uint64_t bytes; /* bytes the kernel accepted advice for */
    int nr_failed;  /* ranges skipped (unmapped meanwhile: ENOMEM, ...) */
    int first_err;  /* positive errno of the first skipped range, 0 if none */
};
int dsec_process_madvise(int pidfd, const uint64_t *starts, const uint64_t *lens, int n,
                         int advice, struct dsec_madvise_result *out);
int dsec_process_populate(int pid, const uint64_t *pages, int n, struct dsec_madvise_result *out);

/* swap.c */
int dsec_swapon(const char *path, int priority);
int dsec_swapoff(const char *path);
/* seccomp.c: the sandbox seccomp profile, built once in the daemon
 * (dsec_seccomp_build), installed in an exec child just before execve
 * (dsec_seccomp_install: async-signal-safe, no allocation) */
#define DSEC_SECCOMP_MAX_INSNS 1024
#define DSEC_SECCOMP_DEFAULT 0
#define DSEC_SECCOMP_FNCALL 1  /* default + unshare(CLONE_NEWIPC, CLONE_NEWNET): call sandboxes */
int dsec_seccomp_build(int profile);
int dsec_seccomp_install(int profile);
int dsec_seccomp_no_new_privs(void);
int dsec_seccomp_export_pfc(int profile, int fd);
/* init.c: the exec channel, a SOCK_SEQPACKET socketpair between the daemon
 * and a sandbox's dsec-init (init's end is its fd DSEC_INIT_CTL_FD), one
 * packet per message; docs/native-api.md. The daemon sends DSEC_INIT_OP_START
 * with exactly three fds (SCM_RIGHTS: the exec's stdin, stdout, stderr); init
 * answers DSEC_INIT_STARTED (with a pidfd of the exec as the one fd, or
 * err.err set and no fd: it failed before execve) and, once it
 * reaped the exec, DSEC_INIT_EXITED with its wait status. DSEC_INIT_OP_KILL
 * (header only) asks init to SIGKILL an exec the daemon has no pidfd for yet.
 * DSEC_INIT_OP_COPY (header only, exactly two fds: a source and a
 * destination) has init fork a child that copies the source to its end into
 * the destination and exits with 0 or the errno that stopped it; answered like
 * a START. The daemon writes files into the sandbox that way, so that the
 * pages they take are charged to the sandbox's memory cgroup, not the
 * daemon's.
 * A START's op may carry flags: DSEC_INIT_START_CTTY makes the exec's
 * stdin (a pty slave) its controlling terminal; an init that predates a
 * flag refuses the request (EINVAL, step init_request).
 * DSEC_INIT_START_POLICY: the bytes after the strings (strings_len counts
 * the strings only) are a task policy's plan (struct dsec_policy_head ...),
 * which the exec child applies with Landlock as its last step before execve.
 * DSEC_INIT_START_GROUPS: right after the strings, a uint32_t count (at
 * most DSEC_MAX_GROUPS) and that many uint32_t supplementary gids (native
 * byte order, unaligned), before any policy; without the flag the exec has
 * no supplementary groups.
 * DSEC_INIT_START_OWN_IPC: the exec child unshares an IPC namespace of its
 * own (owned by the sandbox's user namespace) while it still holds init's
 * capabilities, before its ids change; init must hold CAP_SYS_ADMIN over
 * that user namespace (init_caps) and its seccomp filter let
 * unshare(CLONE_NEWIPC) through.
 * DSEC_INIT_START_HOLD: the START carries three more fds (six in all): the
 * daemon's own ends of the exec's stdio pipes, which init holds for it until
 * the daemon asks it to let them go (DSEC_INIT_OP_RELEASE, header only, its
 * `uid` a mask: 1 stdin, 2 stdout, 4 stderr), even past the exec's end. A
 * background process thus keeps its pipes while no daemon runs (it blocks on
 * a full pipe instead of dying of SIGPIPE; what it wrote stays in the pipe),
 * and a restarted daemon takes the ends back with pidfd_getfd. A RELEASE of
 * an id init holds nothing for is ignored.
 * DSEC_INIT_OP_PRUNE (no fds; `argc` uint32 exec ids as its strings, in
 * native byte order) has init SIGKILL the process group of every exec and
 * copy it still runs whose id is not listed: a daemon started after one
 * that died keeps the background processes it adopts and ends the
 * foreground execs whose clients went with that daemon. No answer; an init
 * older than the op refuses it (a failure answer for an id nobody awaits).
 * Init also keeps the daemon's end, never used, as DSEC_INIT_PEER_FD: a
 * restarted daemon takes it back with pidfd_getfd. */
#define DSEC_INIT_CTL_FD 4
#define DSEC_INIT_PEER_FD 5
#define DSEC_INIT_MAGIC 0x64736931
#define DSEC_INIT_STARTED 1
#define DSEC_INIT_EXITED 2
#define DSEC_INIT_OP_START 0
#define DSEC_INIT_OP_KILL 1
#define DSEC_INIT_OP_COPY 2
#define DSEC_INIT_OP_RELEASE 3
#define DSEC_INIT_OP_PRUNE 4
#define DSEC_INIT_START_CTTY 256
#define DSEC_INIT_START_HOLD 512
#define DSEC_INIT_START_POLICY 1024
#define DSEC_INIT_START_GROUPS 2048
#define DSEC_INIT_START_OWN_IPC 4096
#define DSEC_INIT_MAX_HELD 1024
#define DSEC_INIT_MAX_STRINGS 65536
struct dsec_init_req {
    uint32_t magic;       /* DSEC_INIT_MAGIC */
    uint32_t id;          /* the daemon's, echoed in both answers */
    uint32_t uid;         /* in the sandbox's user namespace */
    uint32_t gid;
    uint64_t cap_keep;    /* as dsec_exec_args.cap_keep; within init_caps */
    uint32_t argc;
    uint32_t envc;
    uint32_t strings_len; /* bytes after this header: cwd, argv, envp, each NUL-terminated (a policy after them) */
    uint32_t op;          /* DSEC_INIT_OP_START (| _START_*), _KILL, _COPY, _RELEASE or _PRUNE */
};
struct dsec_init_reply {
    uint32_t magic;
    uint32_t kind; /* DSEC_INIT_STARTED or DSEC_INIT_EXITED */
    uint32_t id;
    int32_t pid;    /* STARTED: the exec's pid in the sandbox's pid namespace */
    int32_t status; /* EXITED: its wait status */
    int32_t reserved;
    struct dsec_err err; /* STARTED: err.err != 0 if it failed before execve */
};
int dsec_pidfd_kill_group(int pidfd, int sig);
int dsec_probe_pidfd_group_signal(void);
/* upperfs.c: the writable layer on a detached, size-capped tmpfs */
#define DSEC_INIT_UPPER_FD 3
int dsec_upperfs_create(uint64_t size_bytes, uint64_t nr_inodes);
int dsec_pidfd_getfd(int pidfd, int targetfd);
int dsec_probe_upperfs(const char *lowerdir);
int dsec_probe_project_quota(const char *dir);
int dsec_upperfs_attach(int mfd, const char *target);
/* mount.c: host-side layer mounts */
int dsec_mount_erofs(const char *file, const char *target);
int dsec_umount(const char *target, int flags);
/* userns.c: user namespaces, idmapped mounts, per-thread fs ids */
int dsec_userns_create(uint32_t uid, uint32_t gid, uint32_t count, struct dsec_err *err);
int dsec_mount_idmapped(const char *path, int userns_fd);
int dsec_fsids_set(uint32_t uid, uint32_t gid);
int dsec_reader_ids_set(const struct dsec_reader *reader);
int dsec_thread_groups_set(const uint32_t *groups, int n);
int dsec_caps_raise(void);
/* tarerofs.c: an OCI layer's tar stream into an EROFS image (-EOPNOTSUPP:
 * a layer it does not serve; -EINVAL: bad content, dsec_tarfs_error says what) */
struct dsec_tarfs;
struct dsec_tarfs *dsec_tarfs_new(int out_fd, uint32_t root_mode, uint32_t implicit_dir_mode,
                                  uint32_t owner_uid, uint32_t owner_gid, uint64_t max_entries);
int dsec_tarfs_feed(struct dsec_tarfs *w, const char *data, size_t len);
int dsec_tarfs_finish(struct dsec_tarfs *w);
const char *dsec_tarfs_error(struct dsec_tarfs *w);
uint64_t dsec_tarfs_entries(struct dsec_tarfs *w);
uint64_t dsec_tarfs_final_bytes(struct dsec_tarfs *w);
void dsec_tarfs_free(struct dsec_tarfs *w);
/* CFFI-END */

#endif /* DSEC_NATIVE_H */
