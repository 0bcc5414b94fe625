/* upperfs.c - the sandbox's writable layer on a size-capped tmpfs.
 *
 * The host has no usable project quotas when the kernel lacks CONFIG_QUOTA
 * or the state dir's file system is mounted without prjquota; a per-sandbox
 * tmpfs caps bytes (size=) and inodes (nr_inodes=) in the kernel itself, in
 * tens of microseconds, and a full one gives ENOSPC inside. It is created
 * detached (fsopen/fsmount: no mount in any namespace, so the host's mount
 * table does not grow with the sandboxes), and overlayfs takes it as upper
 * through /proc/self/fd/N (clone_private_mount accepts detached mounts since
 * Linux 6.15). The mount fd is what the daemon keeps to read the layer
 * (pack_diff), and what the sandbox's PID 1 holds for a restarted daemon
 * (pidfd_getfd). Policy (sizes, when) lives in dsecd/fs/upper.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/quota.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

static int fsconfig_u64(int fsfd, const char *key, uint64_t value)
{
    char buf[24];

    snprintf(buf, sizeof(buf), "%" PRIu64, value);
    return fsconfig(fsfd, FSCONFIG_SET_STRING, key, buf, 0);
}

/* A new tmpfs as a detached mount: returns its O_PATH mount fd (close-on-exec)
 * or -errno. nodev/nosuid: nothing in a writable layer is a device or setuid
 * on the host side either. */
int dsec_upperfs_create(uint64_t size_bytes, uint64_t nr_inodes)
{
    int fsfd, mfd, err;

    if (size_bytes == 0 || nr_inodes == 0)
        return -EINVAL; /* 0 means "unlimited" to tmpfs */
    fsfd = fsopen("tmpfs", FSOPEN_CLOEXEC);
    if (fsfd < 0)
        return -errno;
    if (fsconfig_u64(fsfd, "size", size_bytes) < 0 || fsconfig_u64(fsfd, "nr_inodes", nr_inodes) < 0 ||
        fsconfig(fsfd, FSCONFIG_SET_STRING, "mode", "0755", 0) < 0 ||
        fsconfig(fsfd, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0) {
        err = errno;
        close(fsfd);
        return -err;
    }
    mfd = fsmount(fsfd, FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID);
    err = errno;
    close(fsfd);
    return mfd < 0 ? -err : mfd;
}

int dsec_pidfd_getfd(int pidfd, int targetfd)
{
    long fd = syscall(SYS_pidfd_getfd, pidfd, targetfd, 0);

    return fd < 0 ? -errno : (int)fd;
}

/* The probe child: in a private mount namespace, mount the prepared overlay
 * over "/" of that namespace only. Raw syscalls and _exit: it is forked from
 * a threaded daemon. */
static int probe_child(const char *opts)
{
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
        mount("overlay", "/", "overlay", MS_NODEV, opts) < 0)
        return errno;
    return 0;
}

/* 0 if overlayfs takes a detached tmpfs as upper here, else -errno (EINVAL:
 * kernel < 6.15; ENOSYS: no new mount API). lowerdir: any directory. */
int dsec_probe_upperfs(const char *lowerdir)
{
    char opts[512];
    int status, mfd, rc = 0;
    pid_t pid;

    mfd = dsec_upperfs_create(1 << 20, 16);
    if (mfd < 0)
        return mfd;
    if (mkdirat(mfd, "u", 0755) < 0 || mkdirat(mfd, "w", 0755) < 0) {
        rc = -errno;
        close(mfd);
        return rc;
    }
    snprintf(opts, sizeof(opts), "lowerdir=%s,upperdir=/proc/self/fd/%d/u,workdir=/proc/self/fd/%d/w",
             lowerdir, mfd, mfd);
    pid = fork();
    if (pid == 0)
        _exit(probe_child(opts));
    if (pid < 0)
        rc = -errno;
    while (pid > 0 && waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) {
            rc = -errno;
            break;
        }
    if (pid > 0 && rc == 0)
        rc = WIFEXITED(status) ? -WEXITSTATUS(status) : -ECHILD;
    close(mfd);
    return rc;
}

/* Project quotas, the other way to cap a writable layer (on the state dir's
 * own file system, sandbox uppers as quota projects), are only reported: 0
 * if they are on for the file system holding `dir`, else -errno (ENOSYS:
 * kernel without CONFIG_QUOTACTL; ESRCH: not turned on for that mount). */
int dsec_probe_project_quota(const char *dir)
{
    struct if_dqinfo info;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    long rc;

    if (fd < 0)
        return -errno;
    rc = syscall(SYS_quotactl_fd, fd, QCMD(Q_GETINFO, PRJQUOTA), 0, &info);
    rc = rc < 0 ? -errno : 0;
    close(fd);
    return (int)rc;
}

/* Attach a clone of the detached upper tmpfs at `target` (a host directory),
 * for programs that need a path (mkfs.erofs realpath()s its source, and a
 * /proc/PID/fd/N path resolves to the detached mount's "/"). The caller
 * unmounts it (MNT_DETACH) when done; the sandbox's layer is unaffected. */
int dsec_upperfs_attach(int mfd, const char *target)
{
    int tree = open_tree(mfd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
    int rc = 0;

    if (tree < 0)
        return -errno;
    if (move_mount(tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        rc = -errno;
    close(tree);
    return rc;
}
