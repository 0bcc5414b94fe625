/* init.c - dsec-init, PID 1 of every container sandbox (static binary).
 *
 * A PID 1 must reap: orphans of the sandbox are re-parented to it, and
 * unreaped they stay zombies holding pids of the sandbox's pids.max. The
 * kernel also gives a namespace's PID 1 no default signal actions, so it would
 * never die from SIGTERM unless it handles it. Both are done with all signals
 * blocked and taken synchronously with sigwaitinfo (blocked signals are queued
 * for PID 1 even without a handler), so there is no handler and no race. When
 * it exits, the kernel kills every other process of the sandbox.
 *
 * Nothing else: no arguments, no sockets; the one file it may hold is fd 3,
 * the sandbox's writable-layer tmpfs, which only the daemon takes back. It is started by
 * execveat() from spawn.c with stdio on /dev/null and no capabilities.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static void reap_all(void)
{
    while (waitpid(-1, NULL, WNOHANG) > 0)
        ;
}

int main(void)
{
    sigset_t all;
    siginfo_t info;

    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    /* older kernels name an execveat(fd) process after the fd number */
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    setsid(); /* leave the daemon's session: no SIGHUP from its terminal */
    /* Non-dumpable: /proc/1/fd (fd 3 may be the sandbox's upper tmpfs, kept
     * for the daemon) and /proc/1/mem then need CAP_SYS_PTRACE, which no
     * sandbox process holds. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    for (;;) {
        reap_all(); /* also catches children that exited before we blocked */
        if (sigwaitinfo(&all, &info) < 0)
            continue; /* EINTR */
        if (info.si_signo == SIGTERM || info.si_signo == SIGINT)
            return EXIT_SUCCESS;
    }
}
