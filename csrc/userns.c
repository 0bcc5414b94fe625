/* userns.c - user namespaces and idmapped mounts for sandboxes.
 *
 * A sandbox's processes run in a user namespace that maps in-sandbox ids
 * 0..count-1 to an unprivileged host range. The daemon builds that namespace
 * before the spawn (dsec_userns_create) because its id maps can only be written
 * from outside, by a process holding CAP_SETUID in the parent namespace, and
 * the spawn child runs under CLONE_VFORK (its parent is asleep). The same fd
 * then serves as the idmap of the layer mounts (dsec_mount_idmapped), so files
 * keep their in-sandbox ids on disk (uid 0 stays 0 in the upper dir and in
 * pack_diff) while the sandbox's processes see them as their own.
 *
 * dsec_fsids_set runs in spawn children too: raw syscalls only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

#define HOLDER_STACK_SIZE (16 * 1024)

static void err_rec(struct dsec_err *e, int step, int err, const char *path)
{
    e->err = err;
    e->step = step;
    snprintf(e->path, sizeof(e->path), "%s", path ? path : "");
}

/* The daemon's pid, which every holder checks is still its parent. Set
 * before each clone; the same value from every thread. */
static pid_t holder_parent;

/* The namespace's first process. It shares the daemon's memory (CLONE_VM: no
 * page-table copy of a large daemon) and fd table (CLONE_FILES: no copy of a
 * few thousand fds made, and closed again when it is killed: ~6% of a burst's
 * CPU) but not its thread, so it must touch nothing: every signal is blocked
 * (inherited from clone_holder), so pause() never returns and never writes
 * errno into the daemon's TLS (nor do the other calls: they cannot fail);
 * SIGKILL ends it.
 *
 * It dies with the daemon too (PR_SET_PDEATHSIG, and the getppid check for a
 * daemon that died before the prctl): a daemon killed between the clone and
 * the holder's kill would otherwise leave it pausing for good, keeping the
 * daemon's memory and every fd it had, the state dir's lock and the listening
 * socket among them, so that no daemon could start again on that state dir
 * and clients would connect to a socket nobody answers. */
static int holder_main(void *arg)
{
    (void)arg;
    syscall(SYS_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (syscall(SYS_getppid) != holder_parent)
        syscall(SYS_exit, 0);
    for (;;)
        syscall(SYS_pause);
    return 0;
}

static pid_t clone_holder(void *stack_top)
{
    sigset_t all, old;
    pid_t pid;
    int saved;

    holder_parent = getpid();
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid = clone(holder_main, stack_top, CLONE_VM | CLONE_FILES | CLONE_NEWUSER | SIGCHLD, NULL);
    saved = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = saved;
    return pid;
}

/* "0 <host> <count>\n" into /proc/<pid>/<file> (uid_map or gid_map). */
static int map_write(pid_t pid, const char *file, uint32_t host, uint32_t count)
{
    char path[64], line[64];
    int fd, len, rc = 0;

    snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, file);
    len = snprintf(line, sizeof(line), "0 %u %u\n", host, count);
    fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (write(fd, line, (size_t)len) != len)
        rc = -errno;
    close(fd);
    return rc;
}

static int userns_of(pid_t pid, uint32_t uid, uint32_t gid, uint32_t count, struct dsec_err *err)
{
    char path[64];
    int rc, fd;

    rc = map_write(pid, "uid_map", uid, count);
    if (rc < 0) {
        err_rec(err, DSEC_STEP_USERNS_MAP, -rc, "uid_map");
        return rc;
    }
    rc = map_write(pid, "gid_map", gid, count);
    if (rc < 0) {
        err_rec(err, DSEC_STEP_USERNS_MAP, -rc, "gid_map");
        return rc;
    }
    snprintf(path, sizeof(path), "/proc/%d/ns/user", (int)pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        rc = -errno;
        err_rec(err, DSEC_STEP_USERNS_MAP, -rc, path);
        return rc;
    }
    return fd;
}

/* A user namespace mapping ids 0..count-1 to uid..uid+count-1 (gids alike),
 * as an fd (setns, MOUNT_ATTR_IDMAP). setgroups stays "allow": apt and sshd
 * call setgroups inside, and the mapping was written by a privileged
 * process, so no unmapped group can be dropped to gain access. The holder is
 * killed right away: the fd keeps the namespace alive. */
int dsec_userns_create(uint32_t uid, uint32_t gid, uint32_t count, struct dsec_err *err)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *stack;
    pid_t pid;
    int rc;

    err_rec(err, DSEC_STEP_NONE, 0, NULL);
    stack = mmap(NULL, page + HOLDER_STACK_SIZE, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK | MAP_NORESERVE, -1, 0);
    if (stack == MAP_FAILED) {
        err_rec(err, DSEC_STEP_STACK, errno, NULL);
        return -err->err;
    }
    mprotect(stack, page, PROT_NONE); /* guard page; a failure only loses the guard */
    pid = clone_holder(stack + page + HOLDER_STACK_SIZE);
    if (pid < 0) {
        err_rec(err, DSEC_STEP_CLONE, errno, NULL);
        munmap(stack, page + HOLDER_STACK_SIZE);
        return -err->err;
    }
    rc = userns_of(pid, uid, gid, count, err);
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
        ;
    munmap(stack, page + HOLDER_STACK_SIZE); /* only after the holder is gone */
    return rc;
}

/* A detached copy of the mount tree at path (open_tree OPEN_TREE_CLONE), with
 * the idmap of userns_fd. Usable as an overlay layer via /proc/self/fd/N
 * (kernel >= 6.15 takes detached mounts as layers). EINVAL from mount_setattr:
 * the file system lacks FS_ALLOW_IDMAP. Private: a clone of a shared mount
 * (the state dir's, where / is shared, as under systemd) would be its peer,
 * and the spawn attaches the clones in the sandbox's namespace (spawn.c
 * layers_park), whence every mount stacked on them would propagate back to
 * the host's layer mount. */
int dsec_mount_idmapped(const char *path, int userns_fd)
{
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_IDMAP, .propagation = MS_PRIVATE,
                              .userns_fd = (uint64_t)userns_fd};
    int fd, saved;

    fd = open_tree(AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (mount_setattr(fd, "", AT_EMPTY_PATH, &attr, sizeof(attr)) < 0) {
        saved = errno;
        close(fd);
        return -saved;
    }
    return fd;
}

/* The calling thread's fs gid and uid (raw syscalls: glibc would not
 * broadcast these anyway, but its wrappers are not async-signal-safe).
 * setfsuid reports no error: reading the value back is the check (EPERM if
 * the change did not take). */
static int fsids_take(uint32_t uid, uint32_t gid)
{
    syscall(SYS_setfsgid, gid);
    syscall(SYS_setfsuid, uid);
    if ((uint32_t)syscall(SYS_setfsgid, -1) != gid || (uint32_t)syscall(SYS_setfsuid, -1) != uid)
        return -EPERM;
    return 0;
}

/* The calling thread's effective capabilities: its whole permitted set
 * (`raised`), or none. */
static int caps_effective(int raised)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    if (syscall(SYS_capget, &hdr, data) < 0)
        return -errno;
    data[0].effective = raised ? data[0].permitted : 0;
    data[1].effective = raised ? data[1].permitted : 0;
    return syscall(SYS_capset, &hdr, data) < 0 ? -errno : 0;
}

/* File-system ids of the calling thread only. Moving fsuid away from 0
 * clears CAP_DAC_OVERRIDE & co. from the effective set; they are raised
 * again from the permitted set, so the thread keeps acting with root's
 * power, under the new ids. */
int dsec_fsids_set(uint32_t uid, uint32_t gid)
{
    int rc = fsids_take(uid, gid);

    return rc < 0 ? rc : caps_effective(1);
}

/* The calling thread's access checks become a reader's (a client's): its
 * supplementary groups, its fs gid and uid, and no effective capability at
 * all (CAP_DAC_* would pass the file modes, CAP_SYS_PTRACE the ptrace check
 * that guards /proc/<pid>/cwd and root), so the kernel checks every lookup
 * and open against the reader's ids and modes. The permitted set stays:
 * dsec_caps_raise gives them back (a spawn child's open_tree after its open
 * as the reader). Undo with dsec_fsids_set(0, 0), which raises them too,
 * then dsec_thread_groups_set(the daemon's). Raw syscalls: this thread
 * only (glibc's setgroups would change every thread), and safe in spawn
 * children. */
int dsec_reader_ids_set(const struct dsec_reader *reader)
{
    int rc;

    if (reader->uid == 0)
        return -EINVAL; /* fsuid 0 would keep the DAC capabilities: root needs no check */
    if (syscall(SYS_setgroups, reader->n_groups, reader->groups) < 0)
        return -errno;
    rc = fsids_take(reader->uid, reader->gid);
    return rc < 0 ? rc : caps_effective(0);
}

/* The calling thread's effective capabilities back to its permitted set
 * (after dsec_reader_ids_set), its fs ids left as they are. */
int dsec_caps_raise(void)
{
    return caps_effective(1);
}

/* The calling thread's supplementary groups (raw syscall: this thread only). */
int dsec_thread_groups_set(const uint32_t *groups, int n)
{
    return syscall(SYS_setgroups, n, groups) < 0 ? -errno : 0;
}
