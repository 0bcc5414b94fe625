/* sched.c - CPU QoS of sandbox processes: SCHED_IDLE and core-scheduling
 * cookies; and the I/O class of the daemon's background threads.
 *
 * Each helper is one raw syscall and returns 0 or -errno, so the spawn
 * children (CLONE_VM, no malloc, no locks) call them as steps, and Python
 * calls them directly (tests, probes). Policy - which sandbox gets what - is
 * decided in dsecd/cpu/qos.py, never here.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

/* SCHED_IDLE is inherited across fork and kept across execve. A sandbox
 * process cannot leave it: going back to SCHED_OTHER needs CAP_SYS_NICE or an
 * RLIMIT_NICE of 20+ (sched(7)), and sandboxes get neither. Lowering one's own
 * policy needs no privilege. */
int dsec_sched_set_idle(int pid)
{
    struct sched_param p = {.sched_priority = 0};

    return syscall(SYS_sched_setscheduler, pid, SCHED_IDLE, &p) < 0 ? -errno : 0;
}

/* A new cookie for the whole thread group of pid (0 = the caller); children
 * forked later inherit it. EINVAL: no CONFIG_SCHED_CORE; ENODEV: no SMT. */
int dsec_sched_core_create(int pid)
{
    return prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, pid, PR_SCHED_CORE_SCOPE_THREAD_GROUP, 0) < 0
               ? -errno
               : 0;
}

/* Copy pid's cookie onto the calling thread (the kernel allows only thread
 * scope for SHARE_FROM). Needs ptrace-read access to pid. */
int dsec_sched_core_share_from(int pid)
{
    return prctl(PR_SCHED_CORE, PR_SCHED_CORE_SHARE_FROM, pid, PR_SCHED_CORE_SCOPE_THREAD, 0) < 0
               ? -errno
               : 0;
}

/* The calling thread's I/O to the idle class (ioprio_set(2), IOPRIO_WHO_PROCESS
 * with who 0: this thread only): the block layer serves it only when no other
 * I/O waits (mq-deadline and BFQ honour the classes). For the daemon's
 * background memory work (the prefetch after a resume), so that a sandbox's
 * own page faults are read first. */
int dsec_ioprio_idle(void)
{
    const int class_idle = 3, class_shift = 13, who_process = 1;

    return syscall(SYS_ioprio_set, who_process, 0, class_idle << class_shift) < 0 ? -errno : 0;
}
