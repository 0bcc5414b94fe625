/* fileops.c - host-side file access into a sandbox's tree.
 *
 * The daemon reads and writes files of a sandbox from the host, where the
 * sandbox's symlinks would otherwise resolve against the host's root. openat2
 * with RESOLVE_IN_ROOT makes "/" and ".." of every step (symlink targets
 * included) stop at dirfd, atomically in the kernel: no userspace walk, no
 * check-then-open race. Policy (which resolve flags, O_CLOEXEC, retry on
 * EAGAIN) lives in native.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

/* struct open_how of linux/openat2.h, spelled out for headers older than 5.6.
 * The kernel takes its size as an argument, so this layout is ABI. */
struct dsec_open_how {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

int dsec_file_openat2(int dirfd, const char *path, uint64_t flags, uint64_t mode, uint64_t resolve)
{
    struct dsec_open_how how = {.flags = flags, .mode = mode, .resolve = resolve};
    long fd = syscall(SYS_openat2, dirfd, path, &how, sizeof(how));

    return fd < 0 ? -errno : (int)fd;
}

/* The file system type (statfs f_type, a *_MAGIC of linux/magic.h) of an
 * open file, or -errno. The daemon uses it to refuse kernel interfaces
 * (procfs, sysfs, ...) a sandbox's symlink may lead its file API to. */
long dsec_file_fs_magic(int fd)
{
    struct statfs st;

    return fstatfs(fd, &st) < 0 ? -errno : (long)st.f_type;
}

/* Map len bytes at buf into pipe fd without copying them (vmsplice, no
 * SPLICE_F_GIFT: the pipe refers to the caller's pages, which must stay
 * unchanged until the reader consumed them). Blocks while the pipe is full
 * (unless fd is O_NONBLOCK). Bytes mapped, or -errno. */
long dsec_vmsplice(int fd, const void *buf, size_t len)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    ssize_t n = vmsplice(fd, &iov, 1, 0);

    return n < 0 ? -errno : (long)n;
}
