/* netns.c - a new network namespace held by an fd, for the netns pool.
 *
 * unshare(CLONE_NEWNET) moves only the calling thread (namespaces are
 * per task), so a worker thread of the daemon can make a namespace, open it,
 * and go back to where it was; the other threads never notice. Nothing is
 * mounted: the returned fd is the only reference, so the namespace (and the
 * veth end inside it) dies when the fd is closed - or when the daemon dies -
 * unless a sandbox joined it first (spawn.c, netns_fd). Policy (which
 * namespaces to keep, how many) is dsecd/net/pool.py's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include "dsec_native.h"

/* Returns an O_CLOEXEC fd of a new, empty network namespace (only lo, down),
 * or -errno. The calling thread is back in its own namespace either way; if
 * even that fails (it cannot, short of the kernel losing the old namespace),
 * -ENOTRECOVERABLE says the thread must not be used for networking again. */
int dsec_netns_create(void)
{
    int back, fd, rc = 0;

    back = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (back < 0)
        return -errno;
    if (unshare(CLONE_NEWNET) < 0) {
        rc = -errno;
        close(back);
        return rc;
    }
    fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        rc = -errno;
    if (setns(back, CLONE_NEWNET) < 0) {
        if (fd >= 0)
            close(fd);
        close(back);
        return -ENOTRECOVERABLE;
    }
    close(back);
    return rc < 0 ? rc : fd;
}
