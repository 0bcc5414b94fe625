/* madvise.c - another process's memory: process_madvise(2) over a pidfd, and
 * fault-in through process_vm_readv(2).
 *
 * Used at pause (MADV_PAGEOUT, the reclaim that works per process on cgroup
 * v1, where memory.reclaim does not exist) and at resume (populate, or
 * MADV_WILLNEED: bring the sandbox's swapped anon pages and dropped file pages
 * back before it is thawed). dsecd/mem/pause.py finds the ranges in
 * /proc/<pid>/maps and pagemap; this file only makes the syscalls.
 *
 * A range can vanish between the parse and the call (the process unmapped it):
 * the kernel then fails that iovec with ENOMEM. Such ranges are skipped and
 * counted; errors about the process or the call itself (ESRCH, EBADF, EPERM,
 * EINVAL) end the call, because no later range would fare better.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

/* IOV_MAX (1024) iovecs per syscall: the kernel refuses more with EINVAL. */
#define CHUNK 1024

static int fatal(int err)
{
    return err != ENOMEM && err != EFAULT && err != EAGAIN && err != EINTR && err != EIO;
}

int dsec_process_madvise(int pidfd, const uint64_t *starts, const uint64_t *lens, int n,
                         int advice, struct dsec_madvise_result *out)
{
    struct iovec iov[CHUNK];
    int i = 0, retries = 0;

    memset(out, 0, sizeof(*out));
    while (i < n) {
        int cnt = n - i < CHUNK ? n - i : CHUNK;
        for (int k = 0; k < cnt; k++) {
            iov[k].iov_base = (void *)(uintptr_t)starts[i + k];
            iov[k].iov_len = (size_t)lens[i + k];
        }
        long rc = syscall(SYS_process_madvise, pidfd, iov, (size_t)cnt, advice, 0U);
        if (rc < 0) {
            int err = errno;
            if ((err == EINTR || err == EAGAIN) && ++retries < 8) /* retry the chunk */
                continue;
            if (fatal(err))
                return -err;
            /* the first iovec of the chunk failed: skip it, remember why */
            out->nr_failed++;
            if (!out->first_err)
                out->first_err = err;
            i++;
            continue;
        }
        out->bytes += (uint64_t)rc;
        /* rc covers whole iovecs from the start of the chunk; a short count
         * means the next iovec failed, which the next round reports. */
        int done = 0;
        uint64_t left = (uint64_t)rc;
        while (done < cnt && left >= iov[done].iov_len) {
            left -= iov[done].iov_len;
            done++;
        }
        i += done;
        if (done < cnt && left) { /* a partially advised iovec: move past it */
            out->nr_failed++;
            i++;
        }
    }
    return 0;
}

/* Fault pages of another process in, mapped, by reading one byte of each
 * through process_vm_readv(2): the kernel pins (and so swaps in or reads)
 * every page it copies from, and leaves it mapped in the target. This is
 * MADV_POPULATE_READ for another process, which process_madvise does not
 * offer; WILLNEED only fills the swap cache, and the target then still takes
 * a fault per page. `pages` are page addresses; a page that fails (unmapped,
 * PROT_NONE: EFAULT) is skipped and counted. */
int dsec_process_populate(int pid, const uint64_t *pages, int n, struct dsec_madvise_result *out)
{
    struct iovec remote[CHUNK], local;
    char sink[CHUNK];
    int i = 0, retries = 0;

    memset(out, 0, sizeof(*out));
    local.iov_base = sink;
    while (i < n) {
        int cnt = n - i < CHUNK ? n - i : CHUNK;
        for (int k = 0; k < cnt; k++) {
            remote[k].iov_base = (void *)(uintptr_t)pages[i + k];
            remote[k].iov_len = 1;
        }
        local.iov_len = (size_t)cnt;
        ssize_t rc = process_vm_readv(pid, &local, 1, remote, (unsigned long)cnt, 0);
        if (rc < 0) {
            int err = errno;
            if ((err == EINTR || err == EAGAIN) && ++retries < 8)
                continue;
            if (err != EFAULT && err != ENOMEM)
                return -err;
            out->nr_failed++; /* the first page of the chunk failed */
            if (!out->first_err)
                out->first_err = err;
            i++;
            continue;
        }
        /* rc pages done (one byte each); a short count: page i+rc failed */
        out->bytes += (uint64_t)rc;
        i += (int)rc;
        if (rc < cnt) {
            out->nr_failed++;
            if (!out->first_err)
                out->first_err = EFAULT;
            i++;
        }
    }
    return 0;
}
