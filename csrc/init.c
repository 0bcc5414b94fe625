/* init.c - dsec-init, PID 1 of every container sandbox (static binary).
 *
 * A PID 1 must reap: orphans of the sandbox are re-parented to it, and
 * unreaped they stay zombies holding pids of the sandbox's pids.max. The
 * kernel also gives a namespace's PID 1 no default signal actions, so it would
 * never die from SIGTERM unless it handles it. Both are done with all signals
 * blocked and taken synchronously (signalfd, or sigwaitinfo without a
 * channel; blocked signals are queued for PID 1 even without a handler), so
 * there is no handler and no race. When it exits, the kernel kills every
 * other process of the sandbox.
 *
 * Started as `dsec-init ctl`, fd 4 is its end of the exec channel
 * (dsec_native.h, docs/native-api.md): the daemon asks it to start execs, and
 * it forks them itself. An exec forked here inherits what the daemon's exec
 * helper would otherwise set up per exec (docs/burst.md round 5): the
 * sandbox's namespaces, cgroups, CPU QoS and the seccomp filter, compiled
 * once for init. For that, init keeps in its permitted and bounding sets the
 * capabilities it hands on (the daemon's cap_keep plus SETUID, SETGID and
 * SETPCAP, to change ids and drop the rest); none is ever effective in init
 * itself. The channel carries only what the daemon sends; no sandbox process
 * can reach it (see PR_SET_DUMPABLE below).
 *
 * Otherwise it holds fd 3, the sandbox's writable-layer tmpfs, which only
 * the daemon takes back. It is started by execveat() from spawn.c with stdio
 * on /dev/null.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "exec_steps.h"
#include "missing_defs.h"

/* Execs at once; a request beyond that is refused with EAGAIN (the sandbox's
 * pids.max usually stops it first). */
#define MAX_EXECS 4096
/* Execs forked but not yet exec'ed (each with its error pipe in the poll
 * set); while that many are starting, init reads no further requests. */
#define MAX_STARTING 64
#define MAX_STRINGS_PTRS (DSEC_INIT_MAX_STRINGS + 2)

/* An exec init forked. `pipe` >= 0 while it is starting: the read end of a
 * close-on-exec pipe the child writes its struct dsec_err to if a step before
 * execve fails; EOF means it exec'ed (or died before writing). */
struct exec {
    pid_t pid;
    uint32_t id;
    int pipe;
};
static struct exec execs[MAX_EXECS];
static int n_execs, n_starting;

/* Static, not on the stack: requests are up to 64 KiB. Untouched pages cost
 * no memory. */
static union {
    struct dsec_init_req req;
    char bytes[sizeof(struct dsec_init_req) + DSEC_INIT_MAX_STRINGS];
} in;
static const char *ptrs[MAX_STRINGS_PTRS];

struct request {
    const struct dsec_init_req *req;
    const char *cwd;
    const char *const *argv;
    const char *const *envp;
    int stdio[3];
};

/* ---- the exec child (forked: its own copy of init's memory) -------------- */

/* Effective = permitted: init holds the caps it hands on, never in effect.
 * *held is that set, which is also init's bounding set (spawn.c). */
static int caps_raise(uint64_t *held, struct dsec_err *e)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    if (check(syscall(SYS_capget, &hdr, data), e, DSEC_STEP_CAPS, NULL) < 0)
        return -1;
    for (int i = 0; i < 2; i++)
        data[i].effective = data[i].permitted;
    *held = (uint64_t)data[1].permitted << 32 | data[0].permitted;
    return check(syscall(SYS_capset, &hdr, data), e, DSEC_STEP_CAPS, NULL);
}

/* Drop from the bounding set what init holds and the exec may not: one
 * prctl per cap dropped (usually none), where caps_bound makes 64. */
static int caps_bound_drop(uint64_t drop, struct dsec_err *e)
{
    for (int cap = 0; cap < 64; cap++)
        if ((drop & (1ULL << cap)) && check(prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), e, DSEC_STEP_CAPS, NULL) < 0)
            return -1;
    return 0;
}

/* The same checklist as spawn.c's exec_child, minus what init already did
 * for the whole sandbox (namespaces, cgroups, QoS, no_new_privs, seccomp).
 * Signal dispositions need no reset: init never installs a handler. Every
 * fd from 3 up (the channel, the upper tmpfs, the signalfd, the error pipe)
 * is marked close-on-exec rather than closed: the error pipe must stay
 * writable until execve. Returns only on failure, with e filled. */
static void exec_child(const struct request *r, struct dsec_err *e)
{
    const struct dsec_init_req *q = r->req;
    uint64_t held = 0;

    if (check(setsid(), e, DSEC_STEP_SETSID, NULL) < 0 || oom_score_reset(e) < 0 ||
        stdio_dup(r->stdio, e) < 0 ||
        check(syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC), e, DSEC_STEP_CLOSE_FDS, NULL) < 0 ||
        caps_raise(&held, e) < 0 || caps_bound_drop(held & ~q->cap_keep, e) < 0 ||
        ids_set(q->uid, q->gid, q->cap_keep, e) < 0 || caps_set(q->cap_keep, e) < 0 ||
        check(chdir(r->cwd), e, DSEC_STEP_CHDIR, r->cwd) < 0)
        return;
    umask(022);
    signals_unblock();
    exec_search(r->argv, r->envp, e);
}

/* ---- the channel ---------------------------------------------------------- */

static int send_reply(int ctl, const struct dsec_init_reply *rep, int fd)
{
    char anc[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = (void *)rep, .iov_len = sizeof(*rep)};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};

    if (fd >= 0) {
        struct cmsghdr *cm;

        memset(anc, 0, sizeof(anc));
        msg.msg_control = anc;
        msg.msg_controllen = sizeof(anc);
        cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    while (sendmsg(ctl, &msg, MSG_NOSIGNAL) < 0)
        if (errno != EINTR)
            return -1;
    return 0;
}

/* The channel, or -1 once it is gone: a failed send closes it. */
static int ctl_fd = -1;

static void reply(const struct dsec_init_reply *rep, int fd)
{
    if (ctl_fd >= 0 && send_reply(ctl_fd, rep, fd) < 0) {
        close(ctl_fd);
        ctl_fd = -1;
    }
}

/* STARTED: with a pidfd (-1: none, the exec ended already) or an error. */
static void reply_started(uint32_t id, pid_t pid, const struct dsec_err *e, int pidfd)
{
    struct dsec_init_reply rep = {.magic = DSEC_INIT_MAGIC, .kind = DSEC_INIT_STARTED, .id = id, .pid = pid};

    if (e)
        rep.err = *e;
    reply(&rep, pidfd);
}

static void reply_failed(uint32_t id, int step, int err)
{
    struct dsec_err e = {0};

    err_set(&e, step, err, NULL);
    reply_started(id, 0, &e, -1);
}

static void reply_exited(uint32_t id, int status)
{
    struct dsec_init_reply rep = {.magic = DSEC_INIT_MAGIC, .kind = DSEC_INIT_EXITED, .id = id, .status = status};

    reply(&rep, -1);
}

/* Split the strings after the header into cwd, argv and envp; 0 if they
 * are not exactly 1 + argc + envc NUL-terminated strings, argv[0] non-empty. */
static int parse(struct request *r, size_t len)
{
    const struct dsec_init_req *q = &in.req;
    size_t want = 1 + (size_t)q->argc + q->envc, n = 0;
    const char *p = in.bytes + sizeof(*q), *end = in.bytes + len;

    if (q->strings_len != len - sizeof(*q) || q->argc < 1 || want + 2 > MAX_STRINGS_PTRS ||
        (len > sizeof(*q) && end[-1] != '\0'))
        return 0;
    for (; p < end && n < want; n++) {
        ptrs[n + (n > q->argc)] = p; /* a NULL after argv */
        p += strlen(p) + 1;
    }
    if (n != want || p != end)
        return 0;
    ptrs[1 + q->argc] = NULL;
    ptrs[want + 1] = NULL;
    r->req = q;
    r->cwd = ptrs[0];
    r->argv = &ptrs[1];
    r->envp = &ptrs[2 + q->argc];
    return r->argv[0][0] != '\0';
}

/* The fds of an SCM_RIGHTS message, into out[max]; returns how many came
 * (all received ones are closed if more than max came or the message was cut). */
static int take_fds(struct msghdr *msg, int *out, int max)
{
    int n = 0, over = (msg->msg_flags & MSG_CTRUNC) != 0;

    for (struct cmsghdr *cm = CMSG_FIRSTHDR(msg); cm; cm = CMSG_NXTHDR(msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        int *fds = (int *)CMSG_DATA(cm);

        for (int i = 0; i < k; i++) {
            if (n < max)
                out[n++] = fds[i];
            else {
                close(fds[i]);
                over = 1;
            }
        }
    }
    if (over) {
        for (int i = 0; i < n; i++)
            close(out[i]);
        return -1;
    }
    return n;
}

static void fds_close(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

/* Fork the exec; its answer comes when its error pipe reports (started()).
 * fork, not vfork: a sandbox process may SIGSTOP the child before it execs,
 * and a vfork parent would then wait with it; init never waits on one. */
static void start(struct request *r)
{
    uint32_t id = r->req->id;
    int err_pipe[2];
    pid_t pid;

    if (n_execs == MAX_EXECS) {
        fds_close(r->stdio, 3);
        reply_failed(id, DSEC_STEP_INIT_REQUEST, EAGAIN);
        return;
    }
    if (pipe2(err_pipe, O_CLOEXEC) < 0) {
        fds_close(r->stdio, 3);
        reply_failed(id, DSEC_STEP_CLONE, errno);
        return;
    }
    pid = fork();
    if (pid == 0) {
        struct dsec_err e = {0};

        exec_child(r, &e);
        while (write(err_pipe[1], &e, sizeof(e)) < 0 && errno == EINTR)
            ;
        _exit(127);
    }
    fds_close(r->stdio, 3); /* the child has its copies */
    close(err_pipe[1]);
    if (pid < 0) {
        close(err_pipe[0]);
        reply_failed(id, DSEC_STEP_CLONE, errno);
        return;
    }
    execs[n_execs++] = (struct exec){.pid = pid, .id = id, .pipe = err_pipe[0]};
    n_starting++;
}

/* Starting exec i has exec'ed or failed (its pipe is readable). `status`
 * >= 0: it was reaped already, with that wait status. */
static void started(int i, int status)
{
    struct exec *x = &execs[i];
    struct dsec_err e;
    ssize_t n;
    int pidfd = -1;

    while ((n = read(x->pipe, &e, sizeof(e))) < 0 && errno == EINTR)
        ;
    close(x->pipe);
    x->pipe = -1;
    n_starting--;
    if (n == (ssize_t)sizeof(e) && e.err) { /* a step before execve failed; reaped as an orphan */
        reply_started(x->id, 0, &e, -1);
        *x = execs[--n_execs];
        return;
    }
    if (status < 0) {
        pidfd = (int)syscall(SYS_pidfd_open, x->pid, 0);
        if (pidfd < 0) { /* no way for the daemon to kill it: it does not run */
            kill(x->pid, SIGKILL);
            reply_failed(x->id, DSEC_STEP_INIT_REQUEST, errno);
            *x = execs[--n_execs];
            return;
        }
    }
    reply_started(x->id, x->pid, NULL, pidfd);
    if (pidfd >= 0)
        close(pidfd);
    if (status >= 0) {
        reply_exited(x->id, status);
        *x = execs[--n_execs];
    }
}

/* DSEC_INIT_OP_KILL: SIGKILL an exec that has not answered STARTED yet (the
 * daemon has no pidfd for it), or the group of one that runs. */
static void kill_exec(uint32_t id)
{
    for (int i = 0; i < n_execs; i++)
        if (execs[i].id == id) {
            kill(execs[i].pipe >= 0 ? execs[i].pid : -execs[i].pid, SIGKILL);
            return;
        }
}

/* One request; -1 when the channel is gone (the daemon closed it or died). */
static int serve(void)
{
    char anc[CMSG_SPACE(4 * sizeof(int))];
    struct iovec iov = {.iov_base = in.bytes, .iov_len = sizeof(in.bytes)};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = anc, .msg_controllen = sizeof(anc)};
    struct request r = {0};
    ssize_t len = recvmsg(ctl_fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    int n;

    if (len < 0)
        return errno == EINTR || errno == EAGAIN ? 0 : -1;
    if (len == 0)
        return -1;
    n = take_fds(&msg, r.stdio, 3);
    if ((size_t)len >= sizeof(in.req) && in.req.magic == DSEC_INIT_MAGIC && in.req.op == DSEC_INIT_OP_KILL &&
        n == 0) {
        kill_exec(in.req.id);
        return 0;
    }
    if ((size_t)len < sizeof(in.req) || in.req.magic != DSEC_INIT_MAGIC || in.req.op != DSEC_INIT_OP_START ||
        n != 3 || (msg.msg_flags & MSG_TRUNC) || !parse(&r, (size_t)len)) {
        fds_close(r.stdio, n > 0 ? n : 0);
        reply_failed((size_t)len >= sizeof(in.req) ? in.req.id : 0, DSEC_STEP_INIT_REQUEST, EINVAL);
        return 0;
    }
    start(&r);
    return 0;
}

/* ---- reaping ---------------------------------------------------------------- */

/* Reap every child that exited. A running exec's status goes to the daemon;
 * a starting one is answered first (its pipe is at EOF or holds its error
 * now that it is gone); others are the sandbox's orphans. */
static void reap_all(void)
{
    int status;
    pid_t pid;

    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < n_execs; i++) {
            if (execs[i].pid != pid)
                continue;
            if (execs[i].pipe >= 0)
                started(i, status);
            else {
                reply_exited(execs[i].id, status);
                execs[i] = execs[--n_execs];
            }
            break;
        }
    }
}

/* execve gave init, a root of its namespace, every capability of its bounding
 * set as effective: it keeps them permitted only, to hand to execs. */
static int caps_lower(void)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    if (syscall(SYS_capget, &hdr, data) < 0)
        return -1;
    for (int i = 0; i < 2; i++)
        data[i].effective = data[i].inheritable = 0;
    return (int)syscall(SYS_capset, &hdr, data);
}

/* Without a channel: reap and wait for SIGTERM, nothing else. */
static int reaper_only(const sigset_t *all)
{
    siginfo_t info;

    for (;;) {
        reap_all(); /* also catches children that exited before we blocked */
        if (sigwaitinfo(all, &info) < 0)
            continue; /* EINTR */
        if (info.si_signo == SIGTERM || info.si_signo == SIGINT)
            return EXIT_SUCCESS;
    }
}

/* The poll set: the signalfd, the channel (while it is up and fewer than
 * MAX_STARTING execs are starting) and the error pipe of each starting exec. */
static int poll_set(struct pollfd *p, int sfd, int *index)
{
    int n = 0;

    p[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
    if (ctl_fd >= 0 && n_starting < MAX_STARTING)
        p[n++] = (struct pollfd){.fd = ctl_fd, .events = POLLIN};
    for (int i = 0; i < n_execs; i++)
        if (execs[i].pipe >= 0) {
            index[n] = i;
            p[n++] = (struct pollfd){.fd = execs[i].pipe, .events = POLLIN};
        }
    return n;
}

static int serve_forever(const sigset_t *all)
{
    int sfd = signalfd(-1, all, SFD_CLOEXEC | SFD_NONBLOCK);

    if (sfd < 0) {
        close(ctl_fd); /* the daemon sees the channel close and uses its own exec helper */
        ctl_fd = -1;
        return reaper_only(all);
    }
    for (;;) {
        struct pollfd p[2 + MAX_STARTING];
        int index[2 + MAX_STARTING], n, ctl_polled;
        struct signalfd_siginfo si;

        reap_all();
        n = poll_set(p, sfd, index);
        ctl_polled = n > 1 && p[1].fd == ctl_fd;
        if (poll(p, (nfds_t)n, -1) < 0)
            continue; /* EINTR */
        while (read(sfd, &si, sizeof(si)) == sizeof(si))
            if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT)
                return EXIT_SUCCESS;
        /* Pipes first, from the highest index: started() may move the last
         * exec into slot i, never one below it. */
        for (int k = n - 1; k >= 1 + ctl_polled; k--)
            if (p[k].revents)
                started(index[k], -1);
        if (ctl_polled && p[1].revents) {
            /* The daemon closed its end: what it still queued was for a link
             * it gave up (it failed those execs), so nothing more starts. */
            if ((p[1].revents & (POLLHUP | POLLERR)) || serve() < 0) {
                close(ctl_fd);
                ctl_fd = -1;
            }
        }
    }
}

int main(int argc, char **argv)
{
    sigset_t all;

    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    /* older kernels name an execveat(fd) process after the fd number */
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    setsid(); /* leave the daemon's session: no SIGHUP from its terminal */
    /* Non-dumpable: /proc/1/fd (fd 3 may be the sandbox's upper tmpfs, kept
     * for the daemon; fd 4 the exec channel) and /proc/1/mem then need
     * CAP_SYS_PTRACE, which no sandbox process holds; nor can they ptrace
     * init to use the capabilities it keeps for its execs. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (caps_lower() < 0) {
        close(DSEC_INIT_CTL_FD); /* serve nothing: the daemon's helper starts execs */
        return reaper_only(&all);
    }
    if (argc > 1 && strcmp(argv[1], "ctl") == 0) {
        ctl_fd = DSEC_INIT_CTL_FD;
        return serve_forever(&all);
    }
    return reaper_only(&all);
}
