/* spawn.c - create a container sandbox, and exec a process inside one.
 *
 * Both follow glibc's posix_spawn: clone(CLONE_VM|CLONE_VFORK) on a private
 * mmap'ed stack, with every signal blocked in the calling thread around the
 * clone. The child shares the daemon's memory until it execs, so it only makes
 * raw, async-signal-safe syscalls on memory prepared before the clone: no
 * malloc, no stdio, no glibc wrappers that take locks or talk to other threads
 * (setuid() is the trap: glibc broadcasts it to every thread of the *daemon*,
 * so credentials are changed with syscall(SYS_setres*id)). A failing child
 * records {errno, step, path} in the caller's struct dsec_err and _exit()s; the
 * caller sees it as soon as the vfork wait ends. Rules: csrc/ERRORS.md.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <net/if.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsec_native.h"
#include "exec_steps.h"
#include "missing_defs.h"
#include "policy_steps.h"

/* Deepest child frame is exec_search's PATH_MAX buffer, or overlay_detached's
 * copy of the overlay options; 64 KiB leaves room. */
#define DSEC_OVERLAY_OPTS_MAX 4096
#define DSEC_STACK_SIZE (64 * 1024)

/* CLONE_NEWNET is added unless the sandbox joins a ready netns (netns_fd). */
#define CONTAINER_CLONE_FLAGS                                                                      \
    (CLONE_VM | CLONE_VFORK | CLONE_FILES | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | SIGCHLD)
#define SANDBOX_NS_FLAGS                                                                           \
    (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWCGROUP)

/* Parent side: record and return -errno, the entry points' return value. */
static int parent_fail(struct dsec_err *e, int step, const char *path, int err)
{
    err_set(e, step, err, path);
    return -err;
}

/* ---- resources the parent prepares: stacks, fds ------------------------- */

struct stacks {
    char *base;
    size_t one; /* guard page + stack */
    int n;
};

/* The child stacks of the calling thread, kept for its next spawn: a map,
 * mprotect and munmap per spawn were ~1% of a burst's samples, the munmap
 * of a multithreaded process sending TLB-flush IPIs to every CPU running
 * one of its threads. A stack is free again once clone returns (the vfork
 * child has exec'ed or exited; the exec helper's child too, before the
 * helper exits). Unmapped when the thread exits (thread_stacks_free). */
#define STACKS_KEPT 2
static __thread struct stacks kept;
static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;

static void thread_stacks_free(void *unused)
{
    (void)unused;
    if (kept.base)
        munmap(kept.base, kept.one * kept.n);
    kept.base = NULL;
}

static void kept_key_make(void)
{
    pthread_key_create(&kept_key, thread_stacks_free);
}

/* Each stack sits above a PROT_NONE guard page: the child shares the daemon's
 * memory, so an overflow must fault rather than scribble on a neighbour. */
static int stacks_map(struct stacks *s, int n, struct dsec_err *e)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);

    if (kept.base && kept.n >= n) {
        *s = kept;
        return 0;
    }
    s->n = n < STACKS_KEPT ? STACKS_KEPT : n;
    s->one = page + DSEC_STACK_SIZE;
    s->base = mmap(NULL, s->one * s->n, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (s->base == MAP_FAILED) {
        s->base = NULL;
        return parent_fail(e, DSEC_STEP_STACK, NULL, errno);
    }
    for (int i = 0; i < s->n; i++)
        if (mprotect(s->base + i * s->one, page, PROT_NONE) < 0) {
            munmap(s->base, s->one * s->n);
            s->base = NULL;
            return parent_fail(e, DSEC_STEP_STACK, NULL, errno);
        }
    if (!kept.base && pthread_once(&kept_once, kept_key_make) == 0 &&
        pthread_setspecific(kept_key, &kept) == 0)
        kept = *s; /* the destructor runs only for a non-NULL value: &kept */
    return 0;
}

static void *stack_top(const struct stacks *s, int i)
{
    return s->base + (i + 1) * s->one; /* stacks grow down; the top is 16-aligned */
}

/* Stacks that are not the thread's kept ones go (a thread that could not
 * register its destructor keeps none). */
static void stacks_unmap(struct stacks *s)
{
    if (s->base && s->base != kept.base)
        munmap(s->base, s->one * s->n);
}

/* O_CLOEXEC everywhere: other daemon threads may fork at any moment. */
static int cgroups_open(const char *const *paths, int n, int *fds, struct dsec_err *e)
{
    for (int i = 0; i < DSEC_MAX_CGROUPS; i++)
        fds[i] = -1;
    if (n < 0 || n > DSEC_MAX_CGROUPS)
        return parent_fail(e, DSEC_STEP_OPEN_CGROUP, NULL, E2BIG);
    for (int i = 0; i < n; i++) {
        fds[i] = open(paths[i], O_WRONLY | O_CLOEXEC);
        if (fds[i] < 0)
            return parent_fail(e, DSEC_STEP_OPEN_CGROUP, paths[i], errno);
    }
    return 0;
}

static void fds_close(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

/* Retry on EINTR: Python installs its handlers without SA_RESTART. */
static int reap(pid_t pid)
{
    int status;

    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -errno;
    return 0;
}

/* Block every signal around clone so that no handler of the daemon can run in
 * the child on the shared memory before the child has reset the dispositions.
 * errno is not reliable after a successful clone: the child shares our TLS. */
static pid_t clone_blocked(int (*fn)(void *), void *top, int flags, void *arg, struct dsec_err *e)
{
    sigset_t all, old;
    pid_t pid;
    int saved;

    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid = clone(fn, top, flags, arg);
    saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0)
        return parent_fail(e, DSEC_STEP_CLONE, NULL, saved);
    return pid;
}

/* ---- child steps shared by both spawns ---------------------------------- */

/* Writing "0" moves the writer; done before CLONE_NEWCGROUP so the namespace
 * root becomes the sandbox's own cgroup. */
static int cgroups_join(const int *fds, const char *const *paths, int n, struct dsec_err *e)
{
    for (int i = 0; i < n; i++)
        if (check(write(fds[i], "0", 1), e, DSEC_STEP_CGROUP_JOIN, paths[i]) < 0)
            return -1;
    return 0;
}

/* The child's own fd table, holding only the fds below keep_below.
 *
 * The daemon holds a few fds per live sandbox (pidfd, root, upper tmpfs):
 * thousands during a burst. A child cloned without CLONE_FILES copies that
 * whole table (dup_fd) and closes it again (close_range, close-on-exec at
 * execve, or exit): O(live sandboxes) of kernel time in every spawn, ~11% of
 * a burst's CPU at 1,500 sandboxes (docs/burst.md). So the children are
 * cloned with CLONE_FILES, and their first fd step is this one:
 * close_range(keep_below, ~0U, CLOSE_RANGE_UNSHARE) on a shared table makes
 * the kernel copy just [0, keep_below) into a private table (fs/file.c,
 * __close_range). The daemon keeps its long-lived fds high (dsecd/fds.py), so
 * the fds a spawn needs, made just before it, are low.
 *
 * Until this step a child must not open, close or dup2 any fd: the table is
 * still the daemon's. */
static int fd_table_private(int keep_below, struct dsec_err *e)
{
    if (keep_below < 3)
        keep_below = 3;
    return check(syscall(SYS_close_range, (unsigned int)keep_below, ~0U, CLOSE_RANGE_UNSHARE), e,
                 DSEC_STEP_CLOSE_FDS, NULL);
}

static int fd_max(int a, int b)
{
    return a > b ? a : b;
}

/* A dsec_* helper's result (0 or -errno) as a recorded step. */
static int helper_step(int rc, struct dsec_err *e, int step)
{
    if (rc < 0) {
        err_set(e, step, -rc, NULL);
        return -1;
    }
    return 0;
}

/* ---- container child ----------------------------------------------------- */

struct container_ctx {
    const struct dsec_container_args *a;
    struct dsec_err *err;
    int init_fd;
    int ctl_fd;      /* the parent's dup of a->ctl_fd above DSEC_INIT_PEER_FD, or -1 */
    int ctl_peer_fd; /* the parent's dup of a->ctl_peer_fd above DSEC_INIT_PEER_FD, or -1 */
    int userns_fd;   /* a->userns_fd, or the parent's dup of it above DSEC_INIT_PEER_FD */
    int root_ns_fd;  /* the parent's low dup of a->root_ns_fd (a parked fd), or -1 */
    /* The scratch tmpfs's mount fd once rootfs_attach parked it under the
     * overlay, else -1. Written by the child: with CLONE_VM it points into
     * the blocked parent's frame, which ignores it. */
    int *scratch_fd;
    int cg_fds[DSEC_MAX_CGROUPS];
    int keep[8 + DSEC_MAX_CGROUPS + DSEC_MAX_PATH_FDS]; /* every fd >= 3 the child uses, sorted */
    int n_keep;
};

/* mkdir, but refuse anything that is not a real directory: a symlink named
 * "dev" in an image would otherwise redirect the next mount to a host path. */
static int mkdir_strict(const char *name, mode_t mode, struct dsec_err *e)
{
    struct stat st;

    if (mkdir(name, mode) == 0)
        return 0;
    if (errno != EEXIST)
        return check(-1, e, DSEC_STEP_MKDIR, name);
    if (check(fstatat(AT_FDCWD, name, &st, AT_SYMLINK_NOFOLLOW), e, DSEC_STEP_MKDIR, name) < 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        err_set(e, DSEC_STEP_MKDIR, ENOTDIR, name);
        return -1;
    }
    return 0;
}

/* mount(2), recording the step and target on failure. */
static int mount_step(int step, const char *src, const char *target, const char *fstype,
                      unsigned long flags, const char *data, struct dsec_err *e)
{
    return check(mount(src, target, fstype, flags, data), e, step, target);
}

/* First of all: the child's own fd table (fd_table_private), before any step
 * that opens, closes or dup2s an fd; then every fd in it that the child does
 * not use goes. Below keep_below the copy also holds fds other daemon threads
 * opened for their own work: kept until execveat (milliseconds of mounts
 * later), a file one of them wrote for write_file would still be open for
 * writing, and an exec of it in its sandbox would fail with ETXTBSY. */
static int fds_own(const struct container_ctx *c)
{
    int low = 3;

    if (fd_table_private(c->n_keep ? c->keep[c->n_keep - 1] + 1 : 3, c->err) < 0)
        return -1;
    for (int i = 0; i < c->n_keep; i++) {
        if (c->keep[i] > low &&
            check(syscall(SYS_close_range, (unsigned int)low, (unsigned int)c->keep[i] - 1, 0), c->err,
                  DSEC_STEP_CLOSE_FDS, NULL) < 0)
            return -1;
        low = fd_max(low, c->keep[i] + 1);
    }
    return 0;
}

/* A netns from the pool (csrc/netns.c, dsecd/net/pool.py) already holds the
 * sandbox's veth end, address and routes: joining it replaces creating one and
 * configuring it on the create path. Early, while the child still has every
 * capability; the fd is the parent's (O_CLOEXEC, gone at exec of init). */
static int netns_join(const struct container_ctx *c)
{
    if (c->a->netns_fd < 0)
        return 0;
    return check(setns(c->a->netns_fd, CLONE_NEWNET), c->err, DSEC_STEP_NETNS_JOIN, NULL);
}

static int cgroups_enter(const struct container_ctx *c)
{
    if (cgroups_join(c->cg_fds, c->a->cgroup_procs, c->a->n_cgroups, c->err) < 0)
        return -1;
    return check(unshare(CLONE_NEWCGROUP), c->err, DSEC_STEP_CGROUP_NS, NULL);
}

/* CPU QoS of PID 1, set before anything forks so every later process of the
 * sandbox inherits it: SCHED_IDLE for best-effort sandboxes, and a cookie of
 * its own for latency-sensitive ones on kernels with core scheduling (execs
 * copy it from PID 1). */
static int sched_enter(const struct container_ctx *c)
{
    if (c->a->sched_idle && helper_step(dsec_sched_set_idle(0), c->err, DSEC_STEP_SCHED_IDLE) < 0)
        return -1;
    if (c->a->core_sched &&
        helper_step(dsec_sched_core_create(0), c->err, DSEC_STEP_SCHED_CORE) < 0)
        return -1;
    return 0;
}

/* fsconfig copies a string value of at most FSCONFIG_VALUE_MAX - 1 bytes
 * (strndup_user(value, 256) in fs/fsopen.c) and refuses a longer one with
 * EINVAL. */
#define FSCONFIG_VALUE_MAX 256

/* overlayfs's lowerdir list (top layer first, ':'-separated, modified in
 * place) one layer per fsconfig, as "lowerdir+" (Linux 6.8): a list of 16
 * /proc/self/fd/N paths is already past what one value may hold. */
static int lowerdirs_append(int fs, char *list, int step, const char *path, struct dsec_err *e)
{
    for (char *dir = list, *next; dir; dir = next) {
        next = strchr(dir, ':');
        if (next)
            *next++ = '\0';
        if (check(syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "lowerdir+", dir, 0), e, step, path) < 0)
            return -1;
    }
    return 0;
}

/* Each "key=value" or "flag" of the comma list opts (modified in place) as
 * one fsconfig on the fs context fs; a lowerdir too long for one value as
 * one per layer. */
static int fs_configure(int fs, char *opts, int step, const char *path, struct dsec_err *e)
{
    for (char *opt = opts, *next; opt; opt = next) {
        char *eq;

        next = strchr(opt, ',');
        if (next)
            *next++ = '\0';
        eq = strchr(opt, '=');
        if (eq)
            *eq++ = '\0';
        if (eq && strcmp(opt, "lowerdir") == 0 && strlen(eq) >= FSCONFIG_VALUE_MAX) {
            if (lowerdirs_append(fs, eq, step, path, e) < 0)
                return -1;
            continue;
        }
        if (check(syscall(SYS_fsconfig, fs, eq ? FSCONFIG_SET_STRING : FSCONFIG_SET_FLAG, opt, eq, 0), e,
                  step, path) < 0)
            return -1;
    }
    return 0;
}

/* A new file system of `type` as a detached mount (fsopen, one fsconfig per
 * option of the comma list opts, fsmount with mount_attrs): its mount fd
 * (close-on-exec), or -1 with step and path in e. */
static int fs_detached(const char *type, const char *opts, unsigned int mount_attrs, int step,
                       const char *path, struct dsec_err *e)
{
    char buf[DSEC_OVERLAY_OPTS_MAX];
    size_t len = strlen(opts);
    int fs, mnt = -1;

    if (len >= sizeof(buf)) {
        err_set(e, step, E2BIG, path);
        return -1;
    }
    memcpy(buf, opts, len + 1);
    fs = (int)syscall(SYS_fsopen, type, FSOPEN_CLOEXEC);
    if (check(fs, e, step, path) < 0)
        return -1;
    if (fs_configure(fs, buf, step, path, e) == 0 &&
        check(syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "source", type, 0), e, step, path) == 0 &&
        check(syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0), e, step, path) == 0) {
        mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, mount_attrs);
        check(mnt, e, step, path);
    }
    close(fs);
    return mnt < 0 ? -1 : mnt;
}

/* The overlay as a detached mount, made while the child is still in the
 * daemon's mount namespace, where the layer paths resolve. The options are
 * overlay_opts ("lowerdir=a:b,upperdir=u,workdir=w"), one fsconfig each:
 * native.py refuses ',' in the paths, so splitting on it is safe. The fds
 * are the child's own (after fds_own) and close-on-exec. MOUNT_ATTR_NODEV:
 * device nodes of images are inert. */
static int overlay_detached(const struct container_ctx *c)
{
    return fs_detached("overlay", c->a->overlay_opts, MOUNT_ATTR_NODEV, DSEC_STEP_MOUNT_OVERLAY,
                       c->a->rootfs, c->err);
}

/* The idmapped clones of the layers (park_fds: detached mounts the daemon
 * made for the overlay, which holds private clones of its own once made)
 * are attached on the root of the sandbox's namespace, under where the
 * overlay goes: they end with the namespace, with everything else in it.
 * Dropped with their last fd instead (the daemon's close after the spawn),
 * each was an unmount of its own, and every unmount waits for an expedited
 * RCU grace period (namespace_unlock), which the kernel runs one at a time
 * host-wide and which interrupts every CPU: with the scratch's unmount,
 * three per create of a one-layer image, ~8% of a burst's host CPU per
 * sandbox (docs/burst.md, "No unmounts"). Under the overlay nothing in the
 * sandbox reaches them: no path leads there (rootfs_attach), its
 * /proc/self/mountinfo leaves out what lies outside the reader's root, and
 * no sandbox process may unmount (no CAP_SYS_ADMIN over this namespace;
 * seccomp refuses umount). */
static int layers_park(const struct container_ctx *c)
{
    for (int i = 0; i < c->a->n_park_fds; i++)
        if (check((int)syscall(SYS_move_mount, c->a->park_fds[i], "", AT_FDCWD, "/",
                               MOVE_MOUNT_F_EMPTY_PATH),
                  c->err, DSEC_STEP_PARK_LAYERS, "/") < 0)
            return -1;
    return 0;
}

/* The scratch tmpfs (below), made detached and parked like the layers:
 * scratch_mount then binds its dirs from the fd, and no unmount of it ever
 * waits for a grace period. Owned by the sandbox's root: the child's fs ids
 * are already its (userns_fsids). */
static int scratch_park(const struct container_ctx *c)
{
    int mnt = fs_detached("tmpfs", c->a->scratch_opts, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                          DSEC_STEP_MOUNT_DEV, "dev", c->err);

    if (mnt < 0)
        return -1;
    if (check((int)syscall(SYS_move_mount, mnt, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH), c->err,
              DSEC_STEP_MOUNT_DEV, "/") < 0) {
        close(mnt);
        return -1;
    }
    *c->scratch_fd = mnt;
    return 0;
}

/* The sandbox's mount namespace as a copy of the root namespace
 * (dsec_root_ns: one empty, read-only tmpfs, nothing of the host), with the
 * parked mounts (above) and the overlay on top of its root; the child then
 * works in the overlay (its cwd) and root_enter chroots there. Copying this
 * namespace instead of the daemon's spares the copy of every host mount
 * and, with chroot instead of pivot_root, pivot_root's walk over every
 * thread on the host (chroot_fs_refs: 9% of a burst's CPU among 2,000
 * sandboxes). A process that breaks out of a chroot inside the sandbox
 * gets no further than the namespace's root, and a lookup there follows
 * the mounts stacked on it up to the overlay: the tmpfs and the parked
 * mounts are on no path (and the namespace belongs to the host's user
 * namespace: no sandbox process can mount or unmount in it). setns into
 * this namespace (the exec helper) lands on the overlay for the same
 * reason. */
static int rootfs_attach(const struct container_ctx *c)
{
    struct dsec_err *e = c->err;
    int mnt = overlay_detached(c), rc = -1;

    if (mnt < 0)
        return -1;
    if (check(setns(c->root_ns_fd, CLONE_NEWNS), e, DSEC_STEP_ROOT_NS, NULL) == 0 &&
        check(unshare(CLONE_NEWNS), e, DSEC_STEP_ROOT_NS, NULL) == 0 && layers_park(c) == 0 &&
        scratch_park(c) == 0 &&
        check(syscall(SYS_move_mount, mnt, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH), e,
              DSEC_STEP_ROOT_NS, "/") == 0 &&
        check(fchdir(mnt), e, DSEC_STEP_CHDIR_ROOTFS, c->a->rootfs) == 0)
        rc = 0;
    close(mnt);
    return rc;
}

/* Without a root namespace (dsec_root_ns failed at start): the overlay is
 * mounted inside a copy of the daemon's mount namespace, after making every
 * mount private (the host never sees it, and it dies with the sandbox), and
 * root_enter pivots into it. */
static int rootfs_mount_here(const struct container_ctx *c)
{
    const struct dsec_container_args *a = c->a;
    struct dsec_err *e = c->err;

    if (mount_step(DSEC_STEP_MOUNT_PRIVATE, NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL, e) < 0 ||
        mount_step(DSEC_STEP_MOUNT_OVERLAY, "overlay", a->rootfs, "overlay", MS_NODEV,
                   a->overlay_opts, e) < 0 ||
        check(chdir(a->rootfs), e, DSEC_STEP_CHDIR_ROOTFS, a->rootfs) < 0)
        return -1;
    return 0;
}

/* The merged root, then /proc in it, with the sandbox's proc options (a
 * call sandbox hides each process from the others' uids). From here on the
 * child works relative to the merged root (its cwd). */
static int rootfs_mount(const struct container_ctx *c)
{
    struct dsec_err *e = c->err;

    if ((c->root_ns_fd >= 0 ? rootfs_attach(c) : rootfs_mount_here(c)) < 0)
        return -1;
    if (mkdir_strict("proc", 0555, e) < 0 || mkdir_strict("dev", 0755, e) < 0 ||
        mkdir_strict("tmp", 01777, e) < 0)
        return -1;
    return mount_step(DSEC_STEP_MOUNT_PROC, "proc", "proc", "proc",
                      MS_NOSUID | MS_NODEV | MS_NOEXEC, c->a->proc_opts, e);
}

/* ---- the scratch tmpfs: /dev, /dev/shm, /tmp, the masks of /proc dirs -- */

/* One tmpfs per sandbox (its root owns it, so it is capped at the tmp and
 * shm sizes together) holds four dirs, each bound where it belongs: dev/ on
 * /dev, shm/ on /dev/shm, tmp/ on /tmp, and empty/ (read-only) over /proc's
 * hardware dirs. Not a tmpfs each: every superblock brings two
 * memory-cgroup-aware list_lrus, and each time a memory cgroup goes the
 * kernel walks every such list_lru on the host (memcg_reparent_list_lrus,
 * under cgroup_mutex), so a destroy cost O(live sandboxes x superblocks
 * each). On this host (one masked dir) that is 6 superblocks per sandbox
 * instead of 9, and 13-25% less host CPU per destroy among 2,000 sandboxes
 * (docs/burst.md, "A destroy").
 *
 * Its dirs are bound from its root as detached clones (open_tree), each
 * attached where it belongs. In a copy of the root namespace the root is
 * parked under the overlay (scratch_park) and stays there, unreachable;
 * else it is mounted on dev/ for a moment and leaves before /dev's clone
 * lands there. */
static const struct {
    const char *name;
    mode_t mode;
} scratch_dirs[] = {
    {"dev", 0755}, {"shm", 01777}, {"tmp", 01777}, {"empty", 0555},
};

/* Directories of host hardware, hidden under the scratch's empty dir. */
static const char *const proc_masked_dirs[] = {"proc/acpi", "proc/scsi", "proc/asound"};

#define NELEMS(a) (sizeof(a) / sizeof((a)[0]))

/* Per-mount flags of a bind (a bind takes them only on remount). */
static int bind_flags(int step, const char *target, unsigned long flags, struct dsec_err *e)
{
    return mount_step(step, NULL, target, NULL, MS_REMOUNT | MS_BIND | flags, NULL, e);
}

static int scratch_make_dirs(int root, struct dsec_err *e)
{
    for (size_t i = 0; i < NELEMS(scratch_dirs); i++) {
        const char *name = scratch_dirs[i].name;
        mode_t mode = scratch_dirs[i].mode;

        /* chmod after mkdir: the umask would drop 1777's write bits */
        if (check(mkdirat(root, name, mode), e, DSEC_STEP_MKDIR, name) < 0 ||
            check(fchmodat(root, name, mode, 0), e, DSEC_STEP_MKDIR, name) < 0)
            return -1;
    }
    return 0;
}

/* A detached clone of the scratch's dir `name`, to attach where it belongs. */
static int scratch_clone(int root, const char *name, int step, struct dsec_err *e)
{
    int fd = (int)syscall(SYS_open_tree, root, name, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);

    return fd < 0 ? check(-1, e, step, name) : fd;
}

static int scratch_attach(int fd, const char *target, int step, struct dsec_err *e)
{
    return check((int)syscall(SYS_move_mount, fd, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH),
                 e, step, target);
}

/* The scratch's dir `name` bound on target with the mount attributes
 * attrs (beyond the scratch's own nosuid, nodev). A clone that could not
 * be attached is dropped again (an error path: the sandbox is not made). */
static int scratch_bind(int root, const char *name, const char *target, uint64_t attrs, int step,
                        struct dsec_err *e)
{
    struct mount_attr attr = {.attr_set = attrs};
    int fd = scratch_clone(root, name, step, e), rc;

    if (fd < 0)
        return -1;
    rc = attrs ? check(mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)), e, step, target) : 0;
    if (rc == 0)
        rc = scratch_attach(fd, target, step, e);
    close(fd);
    return rc;
}

/* proc_masked_dirs the kernel has (the others are skipped) get the empty
 * dir, read-only. Nothing inside can undo a mask: umount and mount need
 * CAP_SYS_ADMIN, which no sandbox process holds, and seccomp denies them. */
static int scratch_mask_proc_dirs(int root, struct dsec_err *e)
{
    const uint64_t ro = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC;

    for (size_t i = 0; i < NELEMS(proc_masked_dirs); i++) {
        const char *path = proc_masked_dirs[i];
        struct stat st;

        if (fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno == ENOENT)
                continue;
            return check(-1, e, DSEC_STEP_MOUNT_PROC, path);
        }
        if (scratch_bind(root, "empty", path, ro, DSEC_STEP_MOUNT_PROC, e) < 0)
            return -1;
    }
    return 0;
}

/* Host device nodes are bind-mounted, not mknod'ed: the sandbox gets exactly
 * these, and the overlay itself is nodev. */
static const char *const dev_node_paths[][2] = {
    {"/dev/null", "dev/null"},     {"/dev/zero", "dev/zero"},       {"/dev/full", "dev/full"},
    {"/dev/random", "dev/random"}, {"/dev/urandom", "dev/urandom"}, {"/dev/tty", "dev/tty"},
};

/* Each host node bound on a new file of the same name under the cwd's dev/.
 * Also how the root namespace gets its copies (dsec_root_ns): a sandbox in
 * a copy of it binds from those, the host's /dev being out of its reach. */
static int dev_nodes(struct dsec_err *e)
{
    for (size_t i = 0; i < NELEMS(dev_node_paths); i++) {
        const char *host = dev_node_paths[i][0], *target = dev_node_paths[i][1];
        int fd = open(target, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);

        if (check(fd, e, DSEC_STEP_DEV_NODE, target) < 0)
            return -1;
        close(fd);
        if (mount_step(DSEC_STEP_DEV_NODE, host, target, NULL, MS_BIND, NULL, e) < 0)
            return -1;
    }
    return 0;
}

static int dev_links(struct dsec_err *e)
{
    static const char *const links[][2] = {
        {"pts/ptmx", "dev/ptmx"},          {"/proc/self/fd", "dev/fd"},
        {"/proc/self/fd/0", "dev/stdin"},  {"/proc/self/fd/1", "dev/stdout"},
        {"/proc/self/fd/2", "dev/stderr"},
    };

    for (size_t i = 0; i < NELEMS(links); i++)
        if (check(symlink(links[i][0], links[i][1]), e, DSEC_STEP_DEV_LINK, links[i][1]) < 0)
            return -1;
    return 0;
}

/* /dev: the bound nodes, a private devpts instance (its own pty numbering,
 * ptys of no other sandbox), the /dev/shm mountpoint and the usual links.
 * noexec and nodev: there is no device cgroup, so with CAP_MKNOD kept
 * (Docker's default set has it) `mknod /dev/x b 254 0` would open the host's
 * disk; the bound nodes keep working (a bind mount carries its source's
 * flags, not those of the mount it lands on). */
static int dev_fill(int shm_fd, struct dsec_err *e)
{
    if (bind_flags(DSEC_STEP_MOUNT_DEV, "dev", MS_NOSUID | MS_NODEV | MS_NOEXEC, e) < 0 ||
        dev_nodes(e) < 0 || mkdir_strict("dev/pts", 0755, e) < 0 ||
        mount_step(DSEC_STEP_MOUNT_DEVPTS, "devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                   "newinstance,ptmxmode=0666,mode=0620", e) < 0 ||
        mkdir_strict("dev/shm", 01777, e) < 0 ||
        scratch_attach(shm_fd, "dev/shm", DSEC_STEP_MOUNT_SHM, e) < 0)
        return -1;
    return dev_links(e);
}

static int scratch_mount(const struct container_ctx *c)
{
    struct dsec_err *e = c->err;
    int root = *c->scratch_fd, on_dev = root < 0, dev_fd = -1, shm_fd = -1, rc = -1;

    if (on_dev) {
        if (mount_step(DSEC_STEP_MOUNT_DEV, "tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NODEV,
                       c->a->scratch_opts, e) < 0)
            return -1;
        root = open("dev", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (check(root, e, DSEC_STEP_MOUNT_DEV, "dev") < 0)
            return -1;
    }
    if (scratch_make_dirs(root, e) < 0 || scratch_bind(root, "tmp", "tmp", 0, DSEC_STEP_MOUNT_TMP, e) < 0 ||
        scratch_mask_proc_dirs(root, e) < 0 ||
        (dev_fd = scratch_clone(root, "dev", DSEC_STEP_MOUNT_DEV, e)) < 0 ||
        (shm_fd = scratch_clone(root, "shm", DSEC_STEP_MOUNT_SHM, e)) < 0 ||
        (on_dev && check(umount2("dev", MNT_DETACH), e, DSEC_STEP_MOUNT_DEV, "dev") < 0) ||
        scratch_attach(dev_fd, "dev", DSEC_STEP_MOUNT_DEV, e) < 0)
        goto out;
    rc = dev_fill(shm_fd, e);
out:
    if (dev_fd >= 0)
        close(dev_fd);
    if (shm_fd >= 0)
        close(shm_fd);
    if (on_dev)
        close(root);
    return rc;
}

/* ---- /proc: read-only knobs, masked kernel views ------------------------- */

/* The sandbox may run as uid 0 (without capabilities). procfs checks many
 * writes by uid alone (sysctls, sysrq-trigger), so those become read-only: a
 * write fails with EROFS, visibly (a /dev/null mask would swallow it). */
static const char *const proc_readonly[] = {
    "proc/sys", "proc/sysrq-trigger", "proc/irq", "proc/bus", "proc/fs",
};

/* Files whose content is the kernel's, not the sandbox's, replaced by
 * /dev/null (reads give EOF, nothing reaches the kernel's handler):
 * kpage* walk every physical page (DSec's agent crashed a kernel with a
 * `grep -r` that read kpagecgroup), kcore is physical memory, kallsyms,
 * vmallocinfo and slabinfo feed exploits, kmsg/keys/key-users/timer_list/
 * sched_debug/latency_stats leak the host's other tenants. */
static const char *const proc_masked_files[] = {
    "proc/kcore",         "proc/kpagecount",  "proc/kpageflags", "proc/kpagecgroup",
    "proc/kallsyms",      "proc/kmsg",        "proc/keys",       "proc/key-users",
    "proc/timer_list",    "proc/timer_stats", "proc/sched_debug", "proc/latency_stats",
    "proc/vmallocinfo",   "proc/slabinfo",    "proc/config.gz",
};

/* A bind of the entry onto itself, then remounted read-only (a bind mount
 * takes MS_RDONLY only on remount). */
static int proc_make_readonly(const char *path, struct dsec_err *e)
{
    const unsigned long ro_flags =
        MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC;

    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0)
        return errno == ENOENT ? 0 : check(-1, e, DSEC_STEP_MOUNT_PROC, path);
    return mount_step(DSEC_STEP_MOUNT_PROC, NULL, path, NULL, ro_flags, NULL, e);
}

static int proc_mask_file(const char *path, struct dsec_err *e)
{
    if (mount("dev/null", path, NULL, MS_BIND, NULL) < 0 && errno != ENOENT)
        return check(-1, e, DSEC_STEP_MOUNT_PROC, path);
    return 0;
}

/* Entries the kernel lacks (ENOENT) are skipped: the lists cover several
 * kernel configs. Nothing inside can undo a mask: umount and mount need
 * CAP_SYS_ADMIN, which no sandbox process holds, and seccomp denies them. */
static int proc_protect(const struct container_ctx *c)
{
    struct dsec_err *e = c->err;

    for (size_t i = 0; i < NELEMS(proc_readonly); i++)
        if (proc_make_readonly(proc_readonly[i], e) < 0)
            return -1;
    for (size_t i = 0; i < NELEMS(proc_masked_files); i++)
        if (proc_mask_file(proc_masked_files[i], e) < 0)
            return -1;
    return 0;
}

/* A read-only merged root, when asked (a call sandbox's: no place of the
 * image keeps what one call wrote for the next). Only the overlay's own
 * mount: /proc, /dev, /tmp and /dev/shm are mounts of their own and stay as
 * they are. Nothing inside can make it writable again: that needs
 * CAP_SYS_ADMIN over this mount namespace, and seccomp denies it. */
static int root_readonly(const struct container_ctx *c)
{
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY};

    if (!c->a->root_readonly)
        return 0;
    return check(mount_setattr(AT_FDCWD, ".", 0, &attr, sizeof(attr)), c->err, DSEC_STEP_MOUNT_OVERLAY, ".");
}

static int hostname_set(const struct container_ctx *c)
{
    const char *name = c->a->hostname;

    return check(sethostname(name, strlen(name)), c->err, DSEC_STEP_HOSTNAME, name);
}

/* The interface exists in every new net namespace but starts down. */
static int loopback_up(const struct container_ctx *c)
{
    struct ifreq ifr = {.ifr_name = "lo"};
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    int rc;

    if (check(fd, c->err, DSEC_STEP_LOOPBACK, "lo") < 0)
        return -1;
    rc = ioctl(fd, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP;
        rc = ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    rc = check(rc, c->err, DSEC_STEP_LOOPBACK, "lo");
    close(fd);
    return rc;
}

/* Into the merged root (the cwd). In a copy of the root namespace
 * (rootfs_attach) a chroot: the only thing above it is that namespace's
 * empty tmpfs. Else pivot_root(".", ".") stacks the old root on top of the
 * new one, and detaching it leaves the merged tree as "/" with no path back
 * to the host. */
static int root_enter(const struct container_ctx *c)
{
    if (c->root_ns_fd >= 0) {
        if (check(chroot("."), c->err, DSEC_STEP_ROOT_NS, ".") < 0)
            return -1;
    } else if (check(syscall(SYS_pivot_root, ".", "."), c->err, DSEC_STEP_PIVOT_ROOT, ".") < 0 ||
               check(umount2(".", MNT_DETACH), c->err, DSEC_STEP_PIVOT_ROOT, ".") < 0) {
        return -1;
    }
    return check(chdir("/"), c->err, DSEC_STEP_PIVOT_ROOT, "/");
}

/* init's stdio is the sandbox's /dev/null, and every other fd is marked
 * close-on-exec (not closed: init_fd must survive until execveat); the
 * handoffs below then give init its fds 3 to 5 without that mark. */
static int init_stdio(const struct container_ctx *c)
{
    int fd = open("/dev/null", O_RDWR | O_CLOEXEC);

    if (check(fd, c->err, DSEC_STEP_STDIO, "/dev/null") < 0)
        return -1;
    for (int i = 0; i < 3; i++)
        if (check(dup2(fd, i), c->err, DSEC_STEP_STDIO, "/dev/null") < 0)
            return -1;
    return check(syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC), c->err, DSEC_STEP_CLOSE_FDS,
                 NULL);
}

/* The upper tmpfs (csrc/upperfs.c) stays open in init as fd 3 (dup2 clears
 * the close-on-exec mark init_stdio set): a restarted daemon takes it back
 * with pidfd_getfd. Init makes itself non-dumpable, so the sandbox's own
 * processes (same uid, no CAP_SYS_PTRACE) cannot open /proc/1/fd/3. The
 * parent made sure init_fd is not fd 3. */
static int upper_handoff(const struct container_ctx *c)
{
    int fd = c->a->upper_fd;

    if (fd < 0)
        return 0;
    if (fd == DSEC_INIT_UPPER_FD) /* dup2 onto itself would keep FD_CLOEXEC */
        return check(fcntl(fd, F_SETFD, 0), c->err, DSEC_STEP_UPPER_FD, NULL);
    return check(dup2(fd, DSEC_INIT_UPPER_FD), c->err, DSEC_STEP_UPPER_FD, NULL);
}

/* The pre-built seccomp filter (csrc/seccomp.c): one syscall, no allocation.
 * Last before exec: nothing after it may need a call the filter denies. */
static int seccomp_step(int profile, struct dsec_err *e)
{
    return profile < 0 ? 0 : helper_step(dsec_seccomp_install(profile), e, DSEC_STEP_SECCOMP);
}

/* The exec channel (init.c) stays open in init as fd 4, and the daemon's
 * end of it as fd 5 (for a restarted daemon), after the upper tmpfs took
 * fd 3: the parent made sure that none of init_fd, the user namespace fd
 * and its dups of the channel is 3, 4 or 5. */
static int ctl_handoff(const struct container_ctx *c)
{
    if (c->ctl_fd < 0)
        return 0;
    if (check(dup2(c->ctl_fd, DSEC_INIT_CTL_FD), c->err, DSEC_STEP_CTL_FD, NULL) < 0)
        return -1;
    return check(dup2(c->ctl_peer_fd, DSEC_INIT_PEER_FD), c->err, DSEC_STEP_CTL_FD, NULL);
}

/* Permitted = bounding = caps, effective and inheritable empty: init runs
 * with no capability in effect, and can still hand caps to an exec it forks
 * (init.c caps_raise). */
static int caps_permit(uint64_t caps, struct dsec_err *e)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2] = {{0}};

    for (int i = 0; i < 2; i++)
        data[i].permitted = (uint32_t)(caps >> (32 * i));
    return check(syscall(SYS_capset, &hdr, data), e, DSEC_STEP_CAPS, NULL);
}

/* Last: both need privileges that the steps above still use. Init and all it
 * ever forks keep the filter (filters survive fork and exec, never removed). */
static int privileges_drop(const struct container_ctx *c)
{
    if (check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), c->err, DSEC_STEP_NO_NEW_PRIVS, NULL) < 0)
        return -1;
    if (caps_bound(c->a->init_caps, c->err) < 0 || caps_permit(c->a->init_caps, c->err) < 0)
        return -1;
    return seccomp_step(c->a->seccomp_profile, c->err);
}

/* ---- user namespace steps (csrc/userns.c; docs/hardening.md) -----------
 * With a->userns_fd >= 0 the child does all its setup as host root (the
 * namespaces it made are owned by the host's user namespace, so sandbox root
 * gets no capability over its own mounts, network or hostname), but under the
 * fs ids of the sandbox's root: the overlay records its mounter's creds, and
 * an idmapped upper layer can only store files of ids it maps; tmpfs roots
 * take the mounter's fsuid as owner. The user namespace is entered last. */

static int userns_fsids(const struct container_ctx *c)
{
    if (c->a->userns_fd < 0)
        return 0;
    return helper_step(dsec_fsids_set(c->a->userns_uid, c->a->userns_gid), c->err,
                       DSEC_STEP_USERNS_FSIDS);
}

/* Binding a port < 1024 needs CAP_NET_BIND_SERVICE in the user namespace that
 * owns the net namespace: the host's, where sandbox root has none. Docker's
 * answer, per net namespace: no privileged ports at all. Needs /proc (mounted
 * by rootfs_mount) before proc_protect makes /proc/sys read-only. */
static int userns_sysctls(const struct container_ctx *c)
{
    static const char path[] = "proc/sys/net/ipv4/ip_unprivileged_port_start";
    int fd;

    if (c->a->userns_fd < 0)
        return 0;
    fd = open(path, O_WRONLY | O_CLOEXEC);
    if (check(fd, c->err, DSEC_STEP_USERNS_SYSCTL, path) < 0)
        return -1;
    if (check(write(fd, "0", 1), c->err, DSEC_STEP_USERNS_SYSCTL, path) < 0) {
        close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* setns() keeps the host kuid 0, unmapped inside: become the namespace's own
 * root (the mapped host uid). setns also resets the capability sets to full
 * (inside the namespace only), so this precedes privileges_drop. */
static int userns_enter(const struct container_ctx *c)
{
    struct dsec_err *e = c->err;

    if (c->a->userns_fd < 0)
        return 0;
    if (check(setns(c->userns_fd, CLONE_NEWUSER), e, DSEC_STEP_USERNS_ENTER, NULL) < 0 ||
        check(syscall(SYS_setgroups, 0, NULL), e, DSEC_STEP_USERNS_ENTER, NULL) < 0 ||
        check(syscall(SYS_setresgid, 0, 0, 0), e, DSEC_STEP_USERNS_ENTER, NULL) < 0 ||
        check(syscall(SYS_setresuid, 0, 0, 0), e, DSEC_STEP_USERNS_ENTER, NULL) < 0)
        return -1;
    return 0;
}

/* Not the daemon's negative oom_score_adj (and its floor): see exec_steps.h. */
static int oom_reset(const struct container_ctx *c)
{
    return c->a->oom_reset ? oom_score_reset(c->err) : 0;
}

/* The container child's checklist, in order (docs/native-api.md). */
static int (*const container_steps[])(const struct container_ctx *) = {
    fds_own,       oom_reset,     netns_join,    cgroups_enter, sched_enter,  userns_fsids, rootfs_mount,
    userns_sysctls, scratch_mount, proc_protect, root_readonly, hostname_set,
    loopback_up,   root_enter,    init_stdio,   upper_handoff, ctl_handoff,
    userns_enter,  privileges_drop,
};

static int container_child(void *arg)
{
    const struct container_ctx *c = arg;
    static const char *const init_argv[] = {"dsec-init", NULL};
    static const char *const init_argv_ctl[] = {"dsec-init", "ctl", NULL};
    static const char *const init_envp[] = {NULL};

    signals_reset();
    for (size_t i = 0; i < sizeof(container_steps) / sizeof(container_steps[0]); i++)
        if (container_steps[i](c) < 0)
            _exit(127);
    signals_unblock();
    syscall(SYS_execveat, c->init_fd, "", c->ctl_fd >= 0 ? init_argv_ctl : init_argv, init_envp,
            AT_EMPTY_PATH);
    check(-1, c->err, DSEC_STEP_EXEC_INIT, c->a->init_path);
    _exit(127);
}

/* upper_handoff and ctl_handoff dup2 onto fds 3 to 5, late in the child:
 * an fd the child still needs after them (init_fd, the user namespace, the
 * channel's ends) must not be 3 to 5. *dup is fd itself when it is above 5
 * (or < 0), else a close-on-exec copy of it above 5 that the parent closes
 * after the clone (fd_close_dup). */
static int fd_dup_high(int fd, int *dup, int step, struct dsec_err *err)
{
    *dup = fd;
    if (fd < 0 || fd > DSEC_INIT_PEER_FD)
        return 0;
    *dup = fcntl(fd, F_DUPFD_CLOEXEC, DSEC_INIT_PEER_FD + 1);
    return *dup < 0 ? parent_fail(err, step, NULL, errno) : 0;
}

static void fd_close_dup(int dup, int original)
{
    if (dup >= 0 && dup != original)
        close(dup);
}

/* Adds fd (if >= 3) to the child's keep list, which stays sorted. */
static void keep_add(struct container_ctx *c, int fd)
{
    int i = c->n_keep;

    if (fd < 3)
        return;
    for (; i > 0 && c->keep[i - 1] > fd; i--)
        c->keep[i] = c->keep[i - 1];
    c->keep[i] = fd;
    c->n_keep++;
}

/* The fds the container child uses (fds_own keeps them and closes the rest). */
static void keep_list(struct container_ctx *c)
{
    const struct dsec_container_args *a = c->a;

    c->n_keep = 0;
    keep_add(c, c->init_fd);
    keep_add(c, a->netns_fd);
    keep_add(c, c->userns_fd);
    keep_add(c, a->upper_fd);
    keep_add(c, c->ctl_fd);
    keep_add(c, c->ctl_peer_fd);
    keep_add(c, c->root_ns_fd);
    for (int i = 0; i < a->n_cgroups; i++)
        keep_add(c, c->cg_fds[i]);
    for (int i = 0; i < a->n_path_fds; i++)
        keep_add(c, a->path_fds[i]);
}

int dsec_spawn_container(const struct dsec_container_args *a, struct dsec_err *err)
{
    int scratch_fd = -1; /* the child's (container_ctx.scratch_fd) */
    struct container_ctx c = {.a = a, .err = err, .init_fd = -1, .ctl_fd = -1, .ctl_peer_fd = -1,
                              .userns_fd = a->userns_fd, .root_ns_fd = -1, .scratch_fd = &scratch_fd};
    int flags = CONTAINER_CLONE_FLAGS | (a->netns_fd >= 0 ? 0 : CLONE_NEWNET);
    int init_fd = -1;
    struct stacks st = {0};
    int rc;

    err_set(err, DSEC_STEP_NONE, 0, NULL);
    rc = cgroups_open(a->cgroup_procs, a->n_cgroups, c.cg_fds, err);
    if (rc == 0) {
        /* O_PATH is enough for execveat, and keeps dsec-init out of the rootfs. */
        init_fd = open(a->init_path, O_PATH | O_CLOEXEC);
        if (init_fd < 0)
            rc = parent_fail(err, DSEC_STEP_OPEN_INIT, a->init_path, errno);
    }
    if (rc == 0)
        rc = fd_dup_high(init_fd, &c.init_fd, DSEC_STEP_OPEN_INIT, err);
    if (rc == 0)
        rc = fd_dup_high(a->ctl_fd, &c.ctl_fd, DSEC_STEP_CTL_FD, err);
    if (rc == 0 && a->ctl_fd >= 0)
        rc = fd_dup_high(a->ctl_peer_fd, &c.ctl_peer_fd, DSEC_STEP_CTL_FD, err);
    if (rc == 0)
        rc = fd_dup_high(a->userns_fd, &c.userns_fd, DSEC_STEP_USERNS_ENTER, err);
    /* The root namespace's fd is parked high (dsecd/fds.py): a low dup of it
     * keeps the child's private fd table small (fd_table_private). The child
     * then enters a copy of it instead of getting a copy of ours. */
    if (rc == 0 && a->root_ns_fd >= 0) {
        c.root_ns_fd = fcntl(a->root_ns_fd, F_DUPFD_CLOEXEC, DSEC_INIT_PEER_FD + 1);
        if (c.root_ns_fd < 0)
            rc = parent_fail(err, DSEC_STEP_ROOT_NS, NULL, errno);
        flags &= ~CLONE_NEWNS;
    }
    if (rc == 0)
        rc = stacks_map(&st, 1, err);
    if (rc == 0) {
        keep_list(&c);
        rc = clone_blocked(container_child, stack_top(&st, 0), flags, &c, err);
    }
    if (rc > 0 && err->err) {
        reap(rc); /* the child failed before execveat: collect it */
        rc = -err->err;
    }
    stacks_unmap(&st);
    fds_close(c.cg_fds, DSEC_MAX_CGROUPS);
    if (init_fd >= 0)
        close(init_fd);
    fd_close_dup(c.init_fd, init_fd);
    fd_close_dup(c.ctl_fd, a->ctl_fd);
    fd_close_dup(c.ctl_peer_fd, a->ctl_peer_fd);
    fd_close_dup(c.userns_fd, a->userns_fd);
    if (c.root_ns_fd >= 0)
        close(c.root_ns_fd);
    return rc;
}

/* ---- the root namespace --------------------------------------------------- */

struct root_ns_ctx {
    const char *dir;
    struct dsec_err *err;
    int fd;
};

/* In a copy of the caller's mount namespace: a fd of it (taken before it is
 * changed: the namespace stays the same object), an empty tmpfs on `dir`
 * with binds of the host's device nodes a sandbox gets (dev_nodes: /dev/null,
 * zero, full, random, urandom, tty), pivot_root into it, the old root
 * detached, the tmpfs remounted read-only.
 * Every mount private, so the copies made from it never propagate to one
 * another. */
/* In a blocked clone: a private copy of the caller's mount namespace, its
 * fd in *fd, a tmpfs with `opts` on `dir`, and `dir` the working directory;
 * -1 with the failing step in e (`step` for all but the private remount). */
static int private_ns_on_tmpfs(int step, const char *dir, const char *opts, int *fd, struct dsec_err *e)
{
    if (check(unshare(CLONE_NEWNS), e, step, NULL) < 0 ||
        mount_step(DSEC_STEP_MOUNT_PRIVATE, NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL, e) < 0)
        return -1;
    *fd = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (check(*fd, e, step, "/proc/self/ns/mnt") < 0 ||
        mount_step(step, "tmpfs", dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts, e) < 0 ||
        check(chdir(dir), e, step, dir) < 0)
        return -1;
    return 0;
}

static int root_ns_child(void *arg)
{
    struct root_ns_ctx *c = arg;
    struct dsec_err *e = c->err;
    const unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;

    if (private_ns_on_tmpfs(DSEC_STEP_ROOT_NS, c->dir, "mode=0555,size=4k,nr_inodes=16", &c->fd, e) < 0 ||
        check(mkdir("dev", 0555), e, DSEC_STEP_MKDIR, "dev") < 0 || dev_nodes(e) < 0 ||
        check(syscall(SYS_pivot_root, ".", "."), e, DSEC_STEP_ROOT_NS, c->dir) < 0 ||
        check(umount2(".", MNT_DETACH), e, DSEC_STEP_ROOT_NS, c->dir) < 0 ||
        mount_step(DSEC_STEP_ROOT_NS, NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | flags, NULL, e) < 0 ||
        mount_step(DSEC_STEP_ROOT_NS, NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL, e) < 0)
        _exit(127);
    _exit(0);
}

/* The mount namespace every sandbox's is copied from (root_ns_fd of
 * dsec_spawn_container): nothing in it but a read-only tmpfs as its root
 * with the six device nodes in /dev that the sandboxes bind from. `dir` is any directory of the caller's (the tmpfs is mounted on it
 * in the child's copy only). Returns the namespace's fd (close-on-exec),
 * which keeps it alive, or -errno. Made once per daemon. */
/* Run `child` in a clone sharing our memory and fd table (not our fs_struct:
 * it may enter another mount namespace), the caller blocked until it ends:
 * it leaves an fd (of a mount namespace it made, or of a mount tree) in *fd
 * (a field of `ctx`). That fd, or -errno with the failing step in err. */
static int make_ns_in_child(int (*child)(void *), void *ctx, int *fd, struct dsec_err *err)
{
    struct stacks st = {0};
    int rc;

    err_set(err, DSEC_STEP_NONE, 0, NULL);
    rc = stacks_map(&st, 1, err);
    if (rc == 0)
        rc = clone_blocked(child, stack_top(&st, 0), CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, ctx, err);
    if (rc > 0) {
        reap(rc);
        rc = err->err ? -err->err : *fd;
        if (err->err && *fd >= 0)
            close(*fd);
    }
    stacks_unmap(&st);
    return rc;
}

int dsec_root_ns(const char *dir, struct dsec_err *err)
{
    struct root_ns_ctx c = {.dir = dir, .err = err, .fd = -1};

    return make_ns_in_child(root_ns_child, &c, &c.fd, err);
}

/* ---- a microVM's root ----------------------------------------------------- */

struct vm_root_ctx {
    const char *dir;
    const struct dsec_root_entry *entries;
    int n;
    struct dsec_err *err;
    int fd;
};

/* A bind remounted with the entry's flags: the bind itself takes the
 * source mount's flags, MS_REMOUNT|MS_BIND sets them on the new mount only. */
static int vm_root_bind(const struct dsec_root_entry *en, int rec, struct dsec_err *e)
{
    return mount_step(DSEC_STEP_VM_ROOT_BIND, en->src, en->target, NULL, MS_BIND | rec, NULL, e) < 0 ||
                   mount_step(DSEC_STEP_VM_ROOT_BIND, NULL, en->target, NULL, MS_REMOUNT | MS_BIND | en->flags,
                              NULL, e) < 0
               ? -1
               : 0;
}

/* An empty file to bind a file on; O_EXCL|O_NOFOLLOW: the root is new and
 * ours, anything already there is a mistake in the entry list. */
static int vm_root_file(const char *target, struct dsec_err *e)
{
    int fd = open(target, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444);

    if (check(fd, e, DSEC_STEP_VM_ROOT_BIND, target) < 0)
        return -1;
    close(fd);
    return 0;
}

static int vm_root_entry(const struct dsec_root_entry *en, struct dsec_err *e)
{
    switch (en->kind) {
    case DSEC_ROOT_DIR:
        return mkdir_strict(en->target, 0755, e);
    case DSEC_ROOT_SYMLINK:
        return check(symlink(en->src, en->target), e, DSEC_STEP_DEV_LINK, en->target);
    case DSEC_ROOT_BIND_DIR:
        return mkdir_strict(en->target, 0755, e) < 0 ? -1 : vm_root_bind(en, MS_REC, e);
    case DSEC_ROOT_BIND_FILE:
        return vm_root_file(en->target, e) < 0 ? -1 : vm_root_bind(en, 0, e);
    case DSEC_ROOT_PROC:
        if (mkdir_strict(en->target, 0555, e) < 0)
            return -1;
        return mount_step(DSEC_STEP_MOUNT_PROC, "proc", en->target, "proc", en->flags, en->src, e);
    }
    err_set(e, DSEC_STEP_VM_ROOT, EINVAL, en->target);
    return -1;
}

/* In a copy of the caller's mount namespace, all of it made private first
 * (nothing done here reaches the caller's, nor later mounts of the caller's
 * this one): a fd of it, a small tmpfs on `dir`, the entries made in it in
 * order, pivot_root into it, the old root detached (with it every mount of
 * the copy but the entries'), the tmpfs remounted read-only. */
static int vm_root_child(void *arg)
{
    struct vm_root_ctx *c = arg;
    struct dsec_err *e = c->err;
    const unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;

    if (private_ns_on_tmpfs(DSEC_STEP_VM_ROOT, c->dir, "mode=0755,size=64k,nr_inodes=256", &c->fd, e) < 0)
        _exit(127);
    for (int i = 0; i < c->n; i++)
        if (vm_root_entry(&c->entries[i], e) < 0)
            _exit(127);
    if (check(syscall(SYS_pivot_root, ".", "."), e, DSEC_STEP_VM_ROOT, c->dir) < 0 ||
        check(umount2(".", MNT_DETACH), e, DSEC_STEP_VM_ROOT, c->dir) < 0 ||
        mount_step(DSEC_STEP_VM_ROOT, NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | flags, NULL, e) < 0)
        _exit(127);
    _exit(0);
}

/* A mount namespace whose root holds only `entries` (a microVM's QEMU
 * enters it before exec: dsecd/backends/microvm/vmroot.py). `dir` is any
 * empty directory of the caller's (the tmpfs is mounted on it in the new
 * namespace only). Returns the namespace's fd (close-on-exec), the one
 * reference to it until a process enters it, or -errno with the failing
 * step and target in err. */
int dsec_vm_root(const char *dir, const struct dsec_root_entry *entries, int n, struct dsec_err *err)
{
    struct vm_root_ctx c = {.dir = dir, .entries = entries, .n = n, .err = err, .fd = -1};

    return make_ns_in_child(vm_root_child, &c, &c.fd, err);
}

/* ---- a client's tree ---------------------------------------------------- */

struct peer_tree_ctx {
    int pidfd;
    int rootfd;
    const char *path;
    const struct dsec_reader *reader; /* NULL: as the daemon */
    struct dsec_err *err;
    int fd;
};

/* The path opened with the reader's ids and the fd cloned, so that a client
 * other than root reaches only what it could open itself: every directory
 * on the way must let it search, the path itself let it read. The clone is
 * of what was opened (a symlink swapped in afterwards changes nothing). */
static int peer_tree_as_reader(const struct peer_tree_ctx *c)
{
    int rc = dsec_reader_ids_set(c->reader), opened, fd, saved;

    if (rc < 0) {
        err_set(c->err, DSEC_STEP_PEER_IDS, -rc, c->path);
        return -1;
    }
    opened = open(c->path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (check(opened, c->err, DSEC_STEP_PEER_OPEN, c->path) < 0)
        return -1;
    rc = dsec_caps_raise(); /* CAP_SYS_ADMIN for the clone; the lookups are done */
    if (rc < 0) {
        close(opened);
        err_set(c->err, DSEC_STEP_PEER_IDS, -rc, c->path);
        return -1;
    }
    fd = open_tree(opened, "", AT_EMPTY_PATH | OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    saved = errno;
    close(opened);
    errno = saved;
    return fd;
}

/* In the mount namespace of the process behind pidfd, and under its root
 * (rootfd: its /proc/<pid>/root; setns alone would give the namespace's
 * root, which a chrooted process does not see): a detached clone of the
 * tree at `path`, its submounts included, left in the fd table we share.
 *
 * The clone is made private, read-only, nosuid and nodev, all of it. A
 * clone of a shared mount joins the original's peer group, and unmounting
 * it would then propagate to the client's own mounts (its submounts would
 * go); and the daemon only reads what a client names. */
static int peer_tree_child(void *arg)
{
    struct peer_tree_ctx *c = arg;
    struct mount_attr attr = {
        .attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        .propagation = MS_PRIVATE,
    };
    int fd;

    if (check(setns(c->pidfd, CLONE_NEWNS), c->err, DSEC_STEP_PEER_NS, c->path) < 0 ||
        check(fchdir(c->rootfd), c->err, DSEC_STEP_PEER_NS, c->path) < 0 ||
        check(chroot("."), c->err, DSEC_STEP_PEER_NS, c->path) < 0)
        _exit(127);
    if (c->reader) {
        fd = peer_tree_as_reader(c);
        if (fd < 0 && c->err->err)
            _exit(127);
    } else {
        fd = open_tree(AT_FDCWD, c->path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE);
    }
    if (check(fd, c->err, DSEC_STEP_PEER_TREE, c->path) < 0)
        _exit(127);
    if (check(mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof(attr)), c->err,
              DSEC_STEP_PEER_TREE, c->path) < 0) {
        close(fd);
        _exit(127);
    }
    c->fd = fd;
    _exit(0);
}

/* A path a client names, as the client sees it (dsecd/fs/clientpaths.py):
 * the fd of a detached clone of the tree at absolute `path` in the mount
 * namespace of the process behind `pidfd`, under its root `rootfd`, or
 * -errno with the step. Needs CAP_SYS_ADMIN and CAP_SYS_CHROOT (setns into
 * a mount namespace, chroot). With `reader`, the path is looked up and
 * opened with the reader's ids (peer_tree_as_reader). */
int dsec_peer_tree(int pidfd, int rootfd, const char *path, const struct dsec_reader *reader,
                   struct dsec_err *err)
{
    struct peer_tree_ctx c = {.pidfd = pidfd, .rootfd = rootfd, .path = path, .reader = reader, .err = err,
                              .fd = -1};

    return make_ns_in_child(peer_tree_child, &c, &c.fd, err);
}

/* Attach the detached tree `tree` (dsec_peer_tree) at `target` in our mount
 * namespace: 0 or -errno. The caller unmounts it (MNT_DETACH) when done. */
int dsec_attach_tree(int tree, const char *target)
{
    if (move_mount(tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        return -errno;
    return 0;
}

/* ---- exec in a sandbox --------------------------------------------------- */

struct exec_ctx {
    const struct dsec_exec_args *a;
    struct dsec_err *err;
    void *child_top;
    pid_t child_pid; /* set by the helper */
    int cg_fds[DSEC_MAX_CGROUPS];
};

/* The user namespace is joined apart from the others, by the child: joined
 * together with the mount namespace, setns would check the right to enter
 * that (host-owned) namespace with the new, in-namespace credentials. */
static int userns_join(const struct dsec_exec_args *a, struct dsec_err *e)
{
    if (!a->userns)
        return 0;
    return check(setns(a->pidfd, CLONE_NEWUSER), e, DSEC_STEP_USERNS_ENTER, NULL);
}

/* The process the caller asked for: already in the sandbox's namespaces and
 * cgroups (inherited from the helper), a child of the daemon (CLONE_PARENT).
 * Its task policy (policy_steps.h) goes on while it is still root of the
 * sandbox with every capability, so its rule paths are opened and listed
 * whatever the exec's uid; no_new_privs comes first, as Landlock needs it. */
static int exec_child(void *arg)
{
    struct exec_ctx *c = arg;
    const struct dsec_exec_args *a = c->a;
    struct dsec_err *e = c->err;
    const int stdio[3] = {a->stdin_fd, a->stdout_fd, a->stderr_fd};

    signals_reset();
    /* QoS first, while still root with every capability: SHARE_FROM needs
     * ptrace access to the sandbox's PID 1 (pid 1 in our pid namespace). */
    if ((a->sched_idle && helper_step(dsec_sched_set_idle(0), e, DSEC_STEP_SCHED_IDLE) < 0) ||
        (a->core_sched && helper_step(dsec_sched_core_share_from(1), e, DSEC_STEP_SCHED_CORE) < 0))
        _exit(127);
    /* The user namespace next, through the pidfd, a long-lived fd of the
     * daemon's (parked high): before the child's fd table is its own. With
     * own_ipc, an IPC namespace of its own, owned by that user namespace
     * (where it holds every capability until its ids change). */
    if (userns_join(a, e) < 0 ||
        (a->own_ipc && check(unshare(CLONE_NEWIPC), e, DSEC_STEP_IPC_NS, NULL) < 0) ||
        check(setsid(), e, DSEC_STEP_SETSID, NULL) < 0 ||
        fd_table_private(1 + fd_max(a->stdin_fd, fd_max(a->stdout_fd, a->stderr_fd)), e) < 0 ||
        stdio_dup(stdio, e) < 0 || (a->ctty && ctty_take(e) < 0) ||
        check(syscall(SYS_close_range, 3, ~0U, 0), e, DSEC_STEP_CLOSE_FDS, NULL) < 0 ||
        check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), e, DSEC_STEP_NO_NEW_PRIVS, NULL) < 0 ||
        (a->policy && policy_apply(a->policy, a->policy_len, e) < 0) ||
        caps_bound(a->cap_keep, e) < 0 || ids_set(a->uid, a->gid, a->groups, a->n_groups, a->cap_keep, e) < 0 || caps_set(a->cap_keep, e) < 0 ||
        check(chdir(a->cwd), e, DSEC_STEP_CHDIR, a->cwd) < 0 ||
        seccomp_step(a->seccomp_profile, e) < 0)
        _exit(127);
    umask(022);
    signals_unblock();
    exec_search(a->argv, a->envp, e);
    _exit(127);
}

/* The helper exists because the calling thread cannot setns() into a mount
 * namespace (it shares its fs_struct with the daemon's other threads). It has
 * its own fs_struct (no CLONE_FS) but shares the fd table (CLONE_FILES: saves
 * one copy of the daemon's table). setns(CLONE_NEWPID) only affects children,
 * hence the second clone; CLONE_PARENT makes that child the daemon's. */
static int exec_helper(void *arg)
{
    struct exec_ctx *c = arg;
    const struct dsec_exec_args *a = c->a;
    pid_t pid;

    /* The OOM score while /proc is still the host's (the child inherits it,
     * and its floor, at clone): see exec_steps.h. */
    if ((a->oom_reset && oom_score_reset(c->err) < 0) ||
        cgroups_join(c->cg_fds, a->cgroup_procs, a->n_cgroups, c->err) < 0 ||
        check(setns(a->pidfd, SANDBOX_NS_FLAGS), c->err, DSEC_STEP_SETNS, NULL) < 0)
        _exit(127);
    pid = clone(exec_child, c->child_top, CLONE_VM | CLONE_VFORK | CLONE_FILES | CLONE_PARENT | SIGCHLD,
                c);
    if (pid < 0)
        check(-1, c->err, DSEC_STEP_CLONE, NULL);
    c->child_pid = pid;
    _exit(0);
}

/* Reap the helper (its status says nothing that err does not); if the child
 * failed before execve, it is our child now (CLONE_PARENT): reap it too. */
static int exec_collect(pid_t helper, struct exec_ctx *c, struct dsec_err *err)
{
    reap(helper);
    if (err->err) {
        if (c->child_pid > 0)
            reap(c->child_pid);
        return -err->err;
    }
    if (c->child_pid <= 0) /* helper killed before it could report */
        return parent_fail(err, DSEC_STEP_CLONE, NULL, ECHILD);
    return c->child_pid;
}

int dsec_spawn_exec(const struct dsec_exec_args *a, struct dsec_err *err)
{
    struct exec_ctx c = {.a = a, .err = err, .child_pid = -1};
    struct stacks st = {0};
    int rc;

    err_set(err, DSEC_STEP_NONE, 0, NULL);
    rc = cgroups_open(a->cgroup_procs, a->n_cgroups, c.cg_fds, err);
    if (rc == 0)
        rc = stacks_map(&st, 2, err);
    if (rc == 0) {
        c.child_top = stack_top(&st, 1);
        rc = clone_blocked(exec_helper, stack_top(&st, 0),
                           CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, &c, err);
    }
    if (rc > 0)
        rc = exec_collect(rc, &c, err);
    stacks_unmap(&st);
    fds_close(c.cg_fds, DSEC_MAX_CGROUPS);
    return rc;
}

/* ---- a call's leftovers, killed by uid in its sandbox --------------------- */

struct kill_ctx {
    int pidfd;         /* the sandbox's init */
    uint32_t uid;      /* host uid of the call */
    void *child_top;
    int rc;            /* 0, or -errno of the step that failed */
};

/* In the sandbox's pid namespace: kill(-1) as the uid reaches each of the
 * uid's processes there at once (the kernel fails a fork whose parent has the
 * signal pending: nothing outruns it), and no process outside that namespace,
 * which this one cannot see: another sandbox's (another daemon's, whose id
 * ranges may overlap this one's) or the host's of the same uid. All signals
 * stay blocked (clone_blocked): no handler of the daemon runs here. */
static int kill_as_uid(void *arg)
{
    struct kill_ctx *k = arg;

    if (syscall(SYS_setresuid, k->uid, k->uid, k->uid) < 0 ||
        (syscall(SYS_kill, -1, SIGKILL) < 0 && errno != ESRCH))
        k->rc = -errno;
    _exit(0);
}

/* setns(CLONE_NEWPID) only places children: the kill runs in a second clone. */
static int kill_helper(void *arg)
{
    struct kill_ctx *k = arg;
    pid_t pid;

    if (setns(k->pidfd, CLONE_NEWPID) < 0) {
        k->rc = -errno;
        _exit(0);
    }
    pid = clone(kill_as_uid, k->child_top, CLONE_VM | CLONE_VFORK | SIGCHLD, k);
    if (pid < 0)
        k->rc = -errno;
    else
        reap(pid);
    _exit(0);
}

/* SIGKILL every process of host uid `uid` in the pid namespace of pidfd's
 * process (a call sandbox's init). 0, or -errno; uid 0 is refused. */
int dsec_kill_uid_in(int pidfd, uint32_t uid)
{
    struct kill_ctx k = {.pidfd = pidfd, .uid = uid, .rc = 0};
    struct stacks st = {0};
    struct dsec_err err;
    pid_t pid;

    if (uid == 0)
        return -EINVAL;
    err_set(&err, DSEC_STEP_NONE, 0, NULL);
    if (stacks_map(&st, 2, &err) < 0)
        return -err.err;
    k.child_top = stack_top(&st, 1);
    pid = clone_blocked(kill_helper, stack_top(&st, 0), CLONE_VM | CLONE_VFORK | SIGCHLD, &k, &err);
    if (pid > 0)
        reap(pid);
    stacks_unmap(&st);
    return pid < 0 ? -err.err : k.rc;
}

/* ---- pidfds -------------------------------------------------------------- */

int dsec_pidfd_open(int pid, unsigned int flags)
{
    long fd = syscall(SYS_pidfd_open, pid, flags);

    return fd < 0 ? -errno : (int)fd;
}

int dsec_pidfd_send_signal(int pidfd, int sig)
{
    return syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0) < 0 ? -errno : 0;
}

/* sig to the process group led by pidfd's process (the kernel takes its pid
 * as the group's id; an exec dsec-init forks leads its own session): Linux
 * 6.9+, EINVAL before. The group is found by that pid even after its leader
 * was reaped; ESRCH once no member is left. */
int dsec_pidfd_kill_group(int pidfd, int sig)
{
    return syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, PIDFD_SIGNAL_PROCESS_GROUP) < 0 ? -errno : 0;
}
