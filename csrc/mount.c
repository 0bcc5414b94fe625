/* mount.c: the host mounts dsecd makes outside any sandbox (shared EROFS
 * layers). Each call is one syscall returning 0 or -errno; policy (where,
 * when, reference counts) lives in dsecd/fs/layers.py. */
#include <errno.h>
#include <sys/mount.h>

#include "dsec_native.h"

/* A file-backed EROFS mount (Linux >= 6.12): the source is a regular file,
 * read-only, and neither devices nor setuid bits in a layer take effect on
 * the host side. */
int dsec_mount_erofs(const char *file, const char *target)
{
    if (mount(file, target, "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID, NULL) < 0)
        return -errno;
    return 0;
}

int dsec_umount(const char *target, int flags)
{
    if (umount2(target, flags) < 0)
        return -errno;
    return 0;
}
