/* exec_steps.h - the steps that turn a fresh child into the process a
 * caller asked for, shared by the daemon's exec helper (spawn.c) and by
 * dsec-init, which forks execs itself (init.c).
 *
 * Static functions in a header because dsec-init is a separate static binary
 * built from init.c alone. Everything here is async-signal-safe and
 * allocation-free: in spawn.c these run in a CLONE_VM child that shares the
 * daemon's memory, in init.c in a vforked child of init (its memory too,
 * until execve). Credentials are changed with raw syscalls (glibc's setuid()
 * broadcasts to every thread of the process whose memory the child shares).
 * Rules: csrc/ERRORS.md.
 */
#ifndef DSEC_EXEC_STEPS_H
#define DSEC_EXEC_STEPS_H

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsec_native.h"

#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* ---- error recording ------------------------------------------------------ */

static inline void err_set(struct dsec_err *e, int step, int err, const char *path)
{
    size_t i = 0;

    e->err = err;
    e->step = step;
    for (; path && path[i] && i < sizeof(e->path) - 1; i++)
        e->path[i] = path[i];
    e->path[i] = '\0';
}

/* Child side: turn a failed syscall (rc < 0, errno set) into a recorded step. */
static inline int check(long rc, struct dsec_err *e, int step, const char *path)
{
    if (rc < 0) {
        err_set(e, step, errno, path);
        return -1;
    }
    return 0;
}

/* Every disposition back to SIG_DFL, ignored ones included: Python ignores
 * SIGPIPE and SIGXFSZ, and SIG_IGN survives execve, so a sandboxed `yes | head`
 * would otherwise see EPIPE instead of dying. Signals are still blocked here;
 * EINVAL for SIGKILL, SIGSTOP and glibc's internal signals is expected. */
static inline void signals_reset(void)
{
    struct sigaction dfl = {.sa_handler = SIG_DFL};

    for (int sig = 1; sig < _NSIG; sig++)
        sigaction(sig, &dfl, NULL);
}

static inline void signals_unblock(void)
{
    sigset_t none;

    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

/* oom_score_adj back to 0, done only where the inherited score is negative
 * (a positive one is left alone: lowering it below its floor would need
 * CAP_SYS_RESOURCE). A child inherits its parent's value and floor
 * (oom_score_adj_min): the daemon's (systemd gives it -900) or its init's
 * (-1000: the OOM killer is to pick the workload, not PID 1). Raising it
 * needs no capability. Written by a holder of CAP_SYS_RESOURCE over the host
 * (the spawn children, before they enter a user namespace), it also resets
 * the floor, so the process cannot lower itself again; without that
 * capability the floor stays (the daemon logs it at start). An exec of init
 * inherits init's floor, which stays that of the container child, as init's
 * -1000 is set through the legacy oom_adj, which leaves the floor alone
 * (container.py _protect_init_from_oom). */
static inline int oom_score_reset(struct dsec_err *e)
{
    static const char path[] = "/proc/self/oom_score_adj";
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    long rc;

    if (check(fd, e, DSEC_STEP_OOM_SCORE, path) < 0)
        return -1;
    rc = write(fd, "0", 1);
    close(fd);
    return check(rc, e, DSEC_STEP_OOM_SCORE, path);
}

/* Drop from the bounding set every capability not in keep. The loop ends at
 * the first EINVAL, i.e. past the kernel's last capability. */
static inline int caps_bound(uint64_t keep, struct dsec_err *e)
{
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL)
                return 0;
            return check(-1, e, DSEC_STEP_CAPS, NULL);
        }
    }
    return 0;
}

/* Effective = permitted = inheritable = keep, and keep raised as ambient so a
 * non-root uid still holds it after execve (without ambient, exec by a
 * non-root uid clears the permitted set). */
static inline int caps_set(uint64_t keep, struct dsec_err *e)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2] = {{0}};

    for (int i = 0; i < 2; i++) {
        uint32_t word = (uint32_t)(keep >> (32 * i));
        data[i].effective = data[i].permitted = data[i].inheritable = word;
    }
    if (check(syscall(SYS_capset, &hdr, data), e, DSEC_STEP_CAPS, NULL) < 0)
        return -1;
    for (int cap = 0; cap < 64; cap++) {
        if (!(keep & (1ULL << cap)))
            continue;
        long rc = prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0);

        if (check(rc, e, DSEC_STEP_CAPS, NULL) < 0)
            return -1;
    }
    return 0;
}

/* Park the sources above 2 first, so that dup2 onto 0..2 cannot clobber a
 * source that is itself 0..2; dup2 also clears FD_CLOEXEC on the target. */
static inline int stdio_dup(const int src[3], struct dsec_err *e)
{
    int tmp[3];

    for (int i = 0; i < 3; i++) {
        tmp[i] = fcntl(src[i], F_DUPFD, 3);
        if (check(tmp[i], e, DSEC_STEP_STDIO, NULL) < 0)
            return -1;
    }
    for (int i = 0; i < 3; i++)
        if (check(dup2(tmp[i], i), e, DSEC_STEP_STDIO, NULL) < 0)
            return -1;
    return 0;
}

/* After setsid, with stdio in place: stdin, a pty slave no session owns
 * yet, becomes the controlling terminal of the new session (arg 0: never
 * steal one another session holds). The line discipline then turns ^C, ^Z
 * and ^\ typed into the master into signals to the foreground process
 * group, and shells can do job control. */
static inline int ctty_take(struct dsec_err *e)
{
    return check(ioctl(0, TIOCSCTTY, 0), e, DSEC_STEP_CTTY, NULL);
}

/* Groups and gid before uid (after setresuid we could no longer change them).
 * KEEPCAPS keeps the permitted set across a change to a non-root uid so that
 * caps_set can hand cap_keep on. */
static inline int ids_set(uint32_t uid, uint32_t gid, const uint32_t *groups, uint32_t n_groups, uint64_t cap_keep,
                          struct dsec_err *e)
{
    if (cap_keep && check(prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), e, DSEC_STEP_CAPS, NULL) < 0)
        return -1;
    if (check(syscall(SYS_setgroups, n_groups, n_groups ? groups : NULL), e, DSEC_STEP_IDS, NULL) < 0 ||
        check(syscall(SYS_setresgid, gid, gid, gid), e, DSEC_STEP_IDS, NULL) < 0 ||
        check(syscall(SYS_setresuid, uid, uid, uid), e, DSEC_STEP_IDS, NULL) < 0)
        return -1;
    return 0;
}

static inline const char *env_path(const char *const *envp)
{
    for (; *envp; envp++)
        if (strncmp(*envp, "PATH=", 5) == 0)
            return *envp + 5;
    return DEFAULT_PATH;
}

/* execve; returns its errno, or 0 for an ENOENT on a file that exists: then
 * the ELF interpreter or the #! interpreter is what is missing. */
static inline int exec_try(const char *path, const char *const *argv, const char *const *envp)
{
    execve(path, (char *const *)argv, (char *const *)envp);
    if (errno == ENOENT && faccessat(AT_FDCWD, path, F_OK, 0) == 0)
        return 0;
    return errno;
}

/* Errors that mean "not in this PATH directory": go on with the next one. */
static inline int exec_try_next(int err)
{
    return err == ENOENT || err == ENOTDIR || err == ESTALE || err == ENODEV || err == ETIMEDOUT ||
           err == ELOOP || err == ENAMETOOLONG;
}

/* execvpe over the PATH of the sandbox's env, without malloc: candidates are
 * built in a buffer on the child's stack. Like execvpe, a candidate that
 * exists but cannot run (EACCES, missing interpreter) is remembered while
 * later directories are tried; the first such one is reported. Returns only
 * when nothing ran, e filled; e is not touched before that (a caller reading
 * it meanwhile, a vfork parent, must not see a failure for an exec that went
 * on to succeed in a later directory). */
static inline void exec_search(const char *const *argv, const char *const *envp, struct dsec_err *out)
{
    const char *file = argv[0], *dir = env_path(envp);
    size_t flen = strlen(file);
    char buf[PATH_MAX];
    struct dsec_err first = {0}, *e = &first;
    int err, seen = 0;

    if (strchr(file, '/')) {
        err = exec_try(file, argv, envp);
        err_set(out, err ? DSEC_STEP_EXEC : DSEC_STEP_EXEC_INTERP, err ? err : ENOENT, file);
        return;
    }
    for (;;) {
        const char *end = strchrnul(dir, ':');
        size_t dlen = end > dir ? (size_t)(end - dir) : 1; /* empty entry = cwd */

        if (dlen + flen + 2 <= sizeof(buf)) {
            memcpy(buf, end > dir ? dir : ".", dlen);
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
            err = exec_try(buf, argv, envp);
            if ((err == 0 || err == EACCES) && !seen++)
                err_set(e, err ? DSEC_STEP_EXEC : DSEC_STEP_EXEC_INTERP, err ? err : ENOENT, buf);
            else if (err && err != EACCES && !exec_try_next(err)) {
                err_set(out, DSEC_STEP_EXEC, err, buf);
                return;
            }
        }
        if (!*end)
            break;
        dir = end + 1;
    }
    if (seen)
        *out = first;
    else
        err_set(out, DSEC_STEP_EXEC, ENOENT, file);
}

#endif
