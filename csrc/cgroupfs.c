/* cgroupfs.c - a sandbox's cgroup directories and their first writes, in one call.
 *
 * A create makes one group in each hierarchy (five on a hybrid host) and
 * writes its limits and QoS (cpu.shares, memory.limit_in_bytes, pids.max,
 * cpu.idle, ...): some twenty syscalls. From Python each one released and
 * took back the GIL, a futex hand-off whenever another of the daemon's
 * eight worker threads or its event loop wanted it; in a burst those
 * hand-offs were as costly as the syscalls. Here they are one call. What
 * to make and write is decided in dsecd/cgroup.py (Group.make).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dsec_native.h"

static void fail_at(struct dsec_err *e, int step, int err, const char *path)
{
    e->err = err;
    e->step = step;
    strncpy(e->path, path, sizeof(e->path) - 1);
    e->path[sizeof(e->path) - 1] = '\0';
}

/* One write of the whole value, again if a signal interrupted it: v1's
 * memory.limit_in_bytes returns EINTR whenever the writer has a signal
 * pending (mem_cgroup_resize_max), and a daemon thread may have one, e.g.
 * while a tracer attaches (a create failed under `strace -p`). */
static ssize_t write_value(int fd, const char *value, size_t len)
{
    ssize_t n;

    do
        n = write(fd, value, len);
    while (n < 0 && errno == EINTR);
    return n;
}

/* mkdir each of dirs (their parents exist), then write each value to its
 * file, one write(2) each (a control file parses every write on its own).
 * On any failure the dirs made are removed again (reverse order) and
 * -errno returned, with the step (cgroup_mkdir or cgroup_write) and path
 * in err. A dir that exists already is a failure (EEXIST): it is not ours
 * to reuse. */
int dsec_cgroup_make(const char *const *dirs, int n_dirs, const char *const *files,
                     const char *const *values, int n_writes, struct dsec_err *err)
{
    int made = 0;

    err->err = 0;
    err->step = DSEC_STEP_NONE;
    err->path[0] = '\0';
    for (; made < n_dirs; made++)
        if (mkdir(dirs[made], 0755) < 0) {
            fail_at(err, DSEC_STEP_CGROUP_MKDIR, errno, dirs[made]);
            goto undo;
        }
    for (int i = 0; i < n_writes; i++) {
        size_t len = strlen(values[i]);
        int fd = open(files[i], O_WRONLY | O_CLOEXEC);

        if (fd < 0) {
            fail_at(err, DSEC_STEP_CGROUP_WRITE, errno, files[i]);
            goto undo;
        }
        if (write_value(fd, values[i], len) != (ssize_t)len) {
            fail_at(err, DSEC_STEP_CGROUP_WRITE, errno ? errno : EIO, files[i]);
            close(fd);
            goto undo;
        }
        close(fd);
    }
    return 0;
undo:
    while (made-- > 0)
        rmdir(dirs[made]);
    return -err->err;
}
