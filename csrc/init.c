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
 * helper would otherwise set up per exec (docs/burst.md, "Execs by init"): the
 * sandbox's namespaces, cgroups, CPU QoS and the seccomp filter, compiled
 * once for init. For that, init keeps in its permitted and bounding sets the
 * capabilities it hands on (the daemon's cap_keep plus SETUID, SETGID and
 * SETPCAP, to change ids and drop the rest); none is ever effective in init
 * itself. The channel carries only what the daemon sends; no sandbox process
 * can reach it (see PR_SET_DUMPABLE below).
 *
 * It also holds the daemon's end of the channel as fd 5, never used here: a
 * restarted daemon takes it back (pidfd_getfd), so the channel outlives the
 * daemon that made it. And fd 3, the sandbox's writable-layer tmpfs, which
 * only the daemon takes back. For a background exec it holds the daemon's ends
 * of that exec's pipes too (DSEC_INIT_START_HOLD), until the daemon releases
 * them: they outlive a daemon restart like the channel. It is started by execveat() from spawn.c with stdio
 * on /dev/null.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "exec_steps.h"
#include "missing_defs.h"
#include "policy_steps.h"

/* Execs at once; a request beyond that is refused with EAGAIN (the sandbox's
 * pids.max usually stops it first). */
#define MAX_EXECS 4096
#define MAX_STRINGS_PTRS (DSEC_INIT_MAX_STRINGS + 2)

/* A running exec init forked: the daemon's id for it. */
static struct {
    pid_t pid;
    uint32_t id;
} execs[MAX_EXECS];
static int n_execs;

/* The daemon's ends of a background exec's stdio pipes (DSEC_INIT_START_HOLD),
 * held until the daemon releases them (DSEC_INIT_OP_RELEASE); -1: released.
 * Kept past the exec's end: what it wrote last is still in its pipes for a
 * daemon that was not running when it ended. */
static struct {
    uint32_t id;
    int fd[3];
} held[DSEC_INIT_MAX_HELD];
static int n_held;

/* Whether an exec must set its oom_score_adj back to 0: init's own is
 * negative when the daemon protected it from the OOM killer (-1000, through
 * the legacy oom_adj), and a fork inherits it. Looked up at the first request:
 * the daemon sets it before it answers the create. -1: not looked up yet. */
static int oom_reset_needed = -1;

/* Static, not on the stack: requests are up to 64 KiB of strings, a
 * groups list and a policy of up to 16 KiB. Untouched pages cost no memory. */
#define GROUPS_MAX_BYTES (sizeof(uint32_t) * (1 + DSEC_MAX_GROUPS))
static union {
    struct dsec_init_req req;
    char bytes[sizeof(struct dsec_init_req) + DSEC_INIT_MAX_STRINGS + GROUPS_MAX_BYTES + DSEC_POLICY_MAX_BYTES];
} in;
static const char *ptrs[MAX_STRINGS_PTRS];

struct request {
    const struct dsec_init_req *req;
    const char *cwd;
    const char *const *argv;
    const char *const *envp;
    const uint32_t *groups; /* supplementary gids (DSEC_INIT_START_GROUPS): req_groups */
    uint32_t n_groups;
    const unsigned char *policy; /* a task policy's plan (DSEC_INIT_START_POLICY), or NULL */
    size_t policy_len;
    int ruleset;                 /* its Landlock ruleset (policy_ruleset), or -1 */
    int stdio[3];
};

/* ---- the exec child (vforked: shares init's memory until execve) -------- */

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
 * With DSEC_INIT_START_OWN_IPC the child unshares an IPC namespace once its
 * capabilities are in effect (CAP_SYS_ADMIN over the sandbox's user
 * namespace, which init holds for that in a call sandbox), before it drops
 * them: a plain call's SysV objects and message queues are then its own.
 * Signal dispositions need no reset: init never installs a handler. A vfork
 * child: it writes nothing of init's memory but e (exec_search leaves e alone
 * unless nothing ran). Returns only on failure, with e filled.
 *
 * The task policy's ruleset is built by init (policy_ruleset); the child
 * restricts itself with it while it still holds init's fds, after the
 * seccomp filter init installed for itself: the exec and all it forks stay
 * in the Landlock domain made here. */
static void exec_child(const struct request *r, struct dsec_err *e)
{
    const struct dsec_init_req *q = r->req;
    uint64_t held = 0;

    if (check(setsid(), e, DSEC_STEP_SETSID, NULL) < 0 || (oom_reset_needed && oom_score_reset(e) < 0) ||
        stdio_dup(r->stdio, e) < 0 || ((q->op & DSEC_INIT_START_CTTY) && ctty_take(e) < 0) ||
        (r->ruleset >= 0 && policy_restrict(r->ruleset, r->policy, e) < 0) ||
        check(syscall(SYS_close_range, 3, ~0U, 0), e, DSEC_STEP_CLOSE_FDS, NULL) < 0 ||
        caps_raise(&held, e) < 0 ||
        ((q->op & DSEC_INIT_START_OWN_IPC) && check(unshare(CLONE_NEWIPC), e, DSEC_STEP_IPC_NS, NULL) < 0) ||
        caps_bound_drop(held & ~q->cap_keep, e) < 0 ||
        ids_set(q->uid, q->gid, r->groups, r->n_groups, q->cap_keep, e) < 0 || caps_set(q->cap_keep, e) < 0 ||
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

/* A request's supplementary gids, copied aligned out of in.bytes. Static,
 * not in struct request: serve() zeroes that per request, and a request is
 * served (its child started) before the next is read. */
static uint32_t req_groups[DSEC_MAX_GROUPS];

/* The groups list after the strings (DSEC_INIT_START_GROUPS) into r; *at
 * and *left move past it. 0 if it is cut short or too long. */
static int parse_groups(struct request *r, const char **at, size_t *left)
{
    uint32_t n;

    if (*left < sizeof(n))
        return 0;
    memcpy(&n, *at, sizeof(n));
    if (n > DSEC_MAX_GROUPS || *left - sizeof(n) < n * sizeof(uint32_t))
        return 0;
    memcpy(req_groups, *at + sizeof(n), n * sizeof(uint32_t));
    r->groups = req_groups;
    r->n_groups = n;
    *at += sizeof(n) + n * sizeof(uint32_t);
    *left -= sizeof(n) + n * sizeof(uint32_t);
    return 1;
}

/* Split the strings after the header into cwd, argv and envp, and find the
 * groups (DSEC_INIT_START_GROUPS) and the policy (DSEC_INIT_START_POLICY)
 * after them; 0 if they are not exactly 1 + argc + envc NUL-terminated
 * strings, argv[0] non-empty, followed by a well-formed groups list and a
 * policy of at most DSEC_POLICY_MAX_BYTES exactly when the flags say so. */
static int parse(struct request *r, size_t len)
{
    const struct dsec_init_req *q = &in.req;
    size_t want = 1 + (size_t)q->argc + q->envc, n = 0, extra;
    const char *p = in.bytes + sizeof(*q), *end, *after;

    if (q->strings_len > len - sizeof(*q) || q->argc < 1 || want + 2 > MAX_STRINGS_PTRS)
        return 0;
    end = after = p + q->strings_len;
    extra = len - sizeof(*q) - q->strings_len;
    if ((q->op & DSEC_INIT_START_GROUPS) && !parse_groups(r, &after, &extra))
        return 0;
    if ((q->op & DSEC_INIT_START_POLICY) ? (extra == 0 || extra > DSEC_POLICY_MAX_BYTES) : extra != 0)
        return 0;
    if (q->strings_len > 0 && end[-1] != '\0')
        return 0;
    r->policy = extra ? (const unsigned char *)after : NULL;
    r->policy_len = extra;
    r->ruleset = -1;
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

/* Init's own oom_score_adj; 0 if it cannot be read (then execs keep it: a
 * reset that fails would fail every exec). */
static int own_oom_score_adj(void)
{
    char buf[16] = {0};
    int fd = open("/proc/self/oom_score_adj", O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return 0;
    if (read(fd, buf, sizeof(buf) - 1) < 0)
        buf[0] = '\0';
    close(fd);
    return atoi(buf);
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

/* SIGKILL an exec's process group. Init's caps are permitted, not effective,
 * and a group of another uid needs CAP_KILL: in effect for this call only
 * (should raising fail, a group of init's own uid still dies). */
static void kill_group(pid_t pid)
{
    struct dsec_err ignored;
    uint64_t held;

    caps_raise(&held, &ignored);
    kill(-pid, SIGKILL);
    caps_lower();
}

static int track(uint32_t id, pid_t pid);

/* ---- task policies: rulesets built once, used while their paths stay ---- */

/* A Landlock ruleset can restrict any number of processes, so init keeps the
 * rulesets of the last few plans it was sent (an agent's execs all send the
 * same) with the signature of their paths (policy_steps.h policy_sign): an
 * exec whose plan and paths are unchanged only restricts itself with the
 * kept ruleset, one syscall, where a build takes ~30 (a directory listed,
 * a rule per entry). Memory: static, untouched slots cost nothing. */
#define POLICY_SLOTS 4
#define POLICY_SIG_MAX 128
static struct {
    size_t len; /* 0: free */
    unsigned char plan[DSEC_POLICY_MAX_BYTES];
    int fd;
    int n_sigs;
    struct dsec_policy_sig sigs[POLICY_SIG_MAX];
    uint64_t used;
} rulesets[POLICY_SLOTS];
static struct dsec_policy_sig sig_now[POLICY_SIG_MAX];
static uint64_t policy_tick;

/* The ruleset for r's plan, kept or built now; -1 with e filled if it
 * cannot be built (the exec fails with that error). With *own set, the
 * caller closes it after the vfork (a plan too large to keep). Paths are
 * looked at with init's capabilities raised, as root of the sandbox that
 * may search any directory, whatever uid the exec will run as. */
static int policy_ruleset(const struct request *r, int *own, struct dsec_err *e)
{
    int n, slot = -1, fd;
    uint64_t held;

    *own = 0;
    if (caps_raise(&held, e) < 0)
        return -1;
    n = policy_sign(r->policy, r->policy_len, sig_now, POLICY_SIG_MAX);
    for (int i = 0; i < POLICY_SLOTS; i++)
        if (rulesets[i].len == r->policy_len && memcmp(rulesets[i].plan, r->policy, r->policy_len) == 0) {
            slot = i;
            break;
        }
    if (slot >= 0 && n >= 0 && n == rulesets[slot].n_sigs &&
        memcmp(rulesets[slot].sigs, sig_now, (size_t)n * sizeof(sig_now[0])) == 0) {
        caps_lower();
        rulesets[slot].used = ++policy_tick;
        return rulesets[slot].fd;
    }
    fd = policy_build(r->policy, r->policy_len, e);
    caps_lower();
    if (fd < 0 || n < 0) {
        *own = fd >= 0;
        return fd;
    }
    if (slot < 0) { /* a free slot, else the least recently used */
        slot = 0;
        for (int i = 0; i < POLICY_SLOTS; i++) {
            if (rulesets[i].len == 0) {
                slot = i;
                break;
            }
            if (rulesets[i].used < rulesets[slot].used)
                slot = i;
        }
    }
    if (rulesets[slot].len)
        close(rulesets[slot].fd);
    memcpy(rulesets[slot].plan, r->policy, r->policy_len);
    rulesets[slot].len = r->policy_len;
    rulesets[slot].fd = fd;
    rulesets[slot].n_sigs = n;
    memcpy(rulesets[slot].sigs, sig_now, (size_t)n * sizeof(sig_now[0]));
    rulesets[slot].used = ++policy_tick;
    return fd;
}

/* vfork: init waits while the child sets up (tens of microseconds; no page
 * table copy, no copy-on-write faults after). A sandbox process can SIGSTOP
 * the child in that window and so stop its own init: execs of that sandbox
 * then take the daemon's helper (init's queue fills up), a timeout's kill of
 * one sent to init fails after a grace period, and a destroy still works
 * (a vfork wait is killable). Nothing outside that sandbox waits on it. */
static int start(struct request *r)
{
    /* Static: the vfork child writes it, and the compiler must not assume
     * that the parent's copy stayed {0} across vfork (a local would). */
    static struct dsec_err e;
    uint32_t id = r->req->id;
    int own_ruleset = 0;
    pid_t pid;

    if (n_execs == MAX_EXECS) {
        fds_close(r->stdio, 3);
        reply_failed(id, DSEC_STEP_INIT_REQUEST, EAGAIN);
        return 0;
    }
    if (oom_reset_needed < 0)
        oom_reset_needed = own_oom_score_adj() < 0;
    memset(&e, 0, sizeof(e));
    if (r->policy && (r->ruleset = policy_ruleset(r, &own_ruleset, &e)) < 0) {
        fds_close(r->stdio, 3);
        reply_started(id, 0, &e, -1);
        return 0;
    }
    pid = vfork();
    if (pid == 0) {
        exec_child(r, &e);
        _exit(127);
    }
    if (pid < 0)
        err_set(&e, DSEC_STEP_CLONE, errno, NULL);
    fds_close(r->stdio, 3); /* the child has its copies */
    if (own_ruleset)
        close(r->ruleset);
    /* A set*id of the child to another uid makes the mm it shares with init
     * dumpable again when fs.suid_dumpable is 1: undo that for init. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (e.err) { /* it _exit()ed: reaped as an orphan */
        reply_started(id, 0, &e, -1);
        return 0;
    }
    return track(id, pid);
}

/* A started child: the daemon gets its pidfd, init reports its end. 1 if
 * it is tracked, 0 if it was killed for want of a pidfd. */
static int track(uint32_t id, pid_t pid)
{
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);

    if (pidfd < 0) { /* the daemon could not kill it: it does not run */
        int err = errno;

        kill_group(pid); /* it leads its own group; reaped as an orphan */
        reply_failed(id, DSEC_STEP_INIT_REQUEST, err);
        return 0;
    }
    execs[n_execs].pid = pid;
    execs[n_execs].id = id;
    n_execs++;
    reply_started(id, pid, NULL, pidfd);
    close(pidfd);
    return 1;
}

/* A START with DSEC_INIT_START_HOLD: start it, and hold the daemon's ends
 * of its pipes if it started (else they go: there is nothing to hold them for). */
static void start_holding(struct request *r, const int ends[3])
{
    if (n_held == DSEC_INIT_MAX_HELD) {
        fds_close(r->stdio, 3);
        fds_close(ends, 3);
        reply_failed(r->req->id, DSEC_STEP_INIT_REQUEST, EAGAIN);
        return;
    }
    held[n_held].id = r->req->id;
    if (!start(r)) {
        fds_close(ends, 3);
        return;
    }
    memcpy(held[n_held].fd, ends, sizeof(held[n_held].fd));
    n_held++;
}

/* DSEC_INIT_OP_RELEASE: close the held ends of exec `id` that `mask` names
 * (1 stdin, 2 stdout, 4 stderr); the entry goes once all three are closed. */
static void release_held(uint32_t id, uint32_t mask)
{
    for (int i = 0; i < n_held; i++) {
        if (held[i].id != id)
            continue;
        int left = 0;

        for (int k = 0; k < 3; k++) {
            if ((mask & (1U << k)) && held[i].fd[k] >= 0) {
                close(held[i].fd[k]);
                held[i].fd[k] = -1;
            }
            left |= held[i].fd[k] >= 0;
        }
        if (!left)
            held[i] = held[--n_held];
        return;
    }
}

/* ---- the copy child (forked: a file the daemon writes into the sandbox) -- */

/* Copy fd 0 to its end into fd 1; 0 or the errno that stopped it. splice
 * moves the pipe's pages into the file without a copy through user memory;
 * a destination it cannot take (an O_APPEND file: EINVAL) is written with
 * read and write. */
static int copy_all(void)
{
    static char buf[65536];
    ssize_t n;

    while ((n = splice(0, NULL, 1, NULL, 1 << 20, SPLICE_F_MOVE)) != 0) {
        if (n > 0)
            continue;
        if (errno == EINTR)
            continue;
        if (errno != EINVAL)
            return errno;
        goto by_read;
    }
    return 0;
by_read:
    while ((n = read(0, buf, sizeof(buf))) != 0) {
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        for (ssize_t done = 0; done < n;) {
            ssize_t w = write(1, buf + done, (size_t)(n - done));

            if (w < 0 && errno != EINTR)
                return errno;
            done += w > 0 ? w : 0;
        }
    }
    return 0;
}

/* The copier runs as a fork of init, so it is in the sandbox's memory
 * cgroup: the page cache and tmpfs pages its writes allocate are charged
 * there, to the sandbox's limit, as if the sandbox had written them. It
 * needs no privilege to write an fd it was given, so it drops init's
 * capabilities; its oom_score_adj is the highest, so that a copy which takes
 * the sandbox past its memory limit is what the OOM killer ends, not the
 * sandbox's own processes. Exits with 0 or the errno that stopped it. */
static void copy_child(const int fds[2])
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct none[2] = {{0}};
    int fd;

    setsid();
    if (dup2(fds[0], 0) < 0 || dup2(fds[1], 1) < 0)
        _exit(errno);
    syscall(SYS_close_range, 2, ~0U, 0);
    if (syscall(SYS_capset, &hdr, none) < 0)
        _exit(errno);
    fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) { /* no /proc in the sandbox: the copy keeps init's score */
        ssize_t ignored = write(fd, "1000", 4);

        (void)ignored;
        close(fd);
    }
    signals_unblock();
    _exit(copy_all());
}

/* DSEC_INIT_OP_COPY: fork the copier (not vfork: it runs here, no execve). */
static void start_copy(uint32_t id, const int fds[2])
{
    pid_t pid;

    if (n_execs == MAX_EXECS) {
        fds_close(fds, 2);
        reply_failed(id, DSEC_STEP_INIT_REQUEST, EAGAIN);
        return;
    }
    pid = fork();
    if (pid == 0)
        copy_child(fds);
    fds_close(fds, 2);
    if (pid < 0) {
        reply_failed(id, DSEC_STEP_CLONE, errno);
        return;
    }
    track(id, pid);
}

/* DSEC_INIT_OP_KILL: SIGKILL the group of a running exec (the daemon asks
 * when it has no pidfd for it yet, its STARTED still in flight). */
static void kill_exec(uint32_t id)
{
    for (int i = 0; i < n_execs; i++)
        if (execs[i].id == id) {
            kill_group(execs[i].pid);
            return;
        }
}

/* DSEC_INIT_OP_PRUNE: SIGKILL the group of every exec not among the `n`
 * ids at `ids` (unaligned): what a daemon that died left running. */
static void prune_execs(const char *ids, uint32_t n)
{
    for (int i = 0; i < n_execs; i++) {
        int kept = 0;

        for (uint32_t k = 0; k < n && !kept; k++) {
            uint32_t id;

            memcpy(&id, ids + (size_t)k * sizeof(id), sizeof(id));
            kept = id == execs[i].id;
        }
        if (!kept)
            kill_group(execs[i].pid);
    }
}

/* One request; -1 when the channel is gone (the daemon shut it down). */
static int serve(void)
{
    char anc[CMSG_SPACE(8 * sizeof(int))];
    int fds[6];
    struct iovec iov = {.iov_base = in.bytes, .iov_len = sizeof(in.bytes)};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = anc, .msg_controllen = sizeof(anc)};
    struct request r = {0};
    ssize_t len = recvmsg(ctl_fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    int n;

    if (len < 0)
        return errno == EINTR || errno == EAGAIN ? 0 : -1;
    if (len == 0)
        return -1;
    n = take_fds(&msg, fds, 6);
    if ((size_t)len >= sizeof(in.req) && in.req.magic == DSEC_INIT_MAGIC && in.req.op == DSEC_INIT_OP_KILL &&
        n == 0) {
        kill_exec(in.req.id);
        return 0;
    }
    if ((size_t)len >= sizeof(in.req) && in.req.magic == DSEC_INIT_MAGIC && in.req.op == DSEC_INIT_OP_PRUNE &&
        n == 0 && in.req.strings_len == (size_t)in.req.argc * sizeof(uint32_t) &&
        (size_t)len == sizeof(in.req) + in.req.strings_len) {
        prune_execs(in.bytes + sizeof(in.req), in.req.argc);
        return 0;
    }
    if ((size_t)len >= sizeof(in.req) && in.req.magic == DSEC_INIT_MAGIC && in.req.op == DSEC_INIT_OP_RELEASE &&
        n == 0) {
        release_held(in.req.id, in.req.uid);
        return 0;
    }
    if ((size_t)len == sizeof(in.req) && in.req.magic == DSEC_INIT_MAGIC && in.req.op == DSEC_INIT_OP_COPY &&
        n == 2 && !(msg.msg_flags & MSG_TRUNC)) {
        start_copy(in.req.id, fds);
        return 0;
    }
    int hold = (size_t)len >= sizeof(in.req) && (in.req.op & DSEC_INIT_START_HOLD);

    if ((size_t)len < sizeof(in.req) || in.req.magic != DSEC_INIT_MAGIC ||
        (in.req.op & ~(uint32_t)(DSEC_INIT_START_CTTY | DSEC_INIT_START_HOLD | DSEC_INIT_START_POLICY |
                               DSEC_INIT_START_GROUPS | DSEC_INIT_START_OWN_IPC)) !=
            DSEC_INIT_OP_START ||
        n != (hold ? 6 : 3) || (msg.msg_flags & MSG_TRUNC) || !parse(&r, (size_t)len)) {
        fds_close(fds, n > 0 ? n : 0);
        reply_failed((size_t)len >= sizeof(in.req) ? in.req.id : 0, DSEC_STEP_INIT_REQUEST, EINVAL);
        return 0;
    }
    memcpy(r.stdio, fds, sizeof(r.stdio));
    if (hold)
        start_holding(&r, fds + 3);
    else
        start(&r);
    return 0;
}

/* ---- reaping ---------------------------------------------------------------- */

/* Reap every child that exited; an exec's status goes to the daemon, the
 * others are the sandbox's orphans (or an exec that failed to start). */
static void reap_all(void)
{
    int status;
    pid_t pid;

    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        for (int i = 0; i < n_execs; i++)
            if (execs[i].pid == pid) {
                uint32_t id = execs[i].id;

                execs[i] = execs[--n_execs];
                reply_exited(id, status);
                break;
            }
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

static int serve_forever(const sigset_t *all)
{
    int sfd = signalfd(-1, all, SFD_CLOEXEC | SFD_NONBLOCK);

    if (sfd < 0) {
        close(ctl_fd); /* the daemon sees the channel close and uses its own exec helper */
        close(DSEC_INIT_PEER_FD);
        ctl_fd = -1;
        return reaper_only(all);
    }
    for (;;) {
        struct pollfd p[2] = {{.fd = sfd, .events = POLLIN}, {.fd = ctl_fd, .events = POLLIN}};
        struct signalfd_siginfo si;

        reap_all();
        if (poll(p, ctl_fd >= 0 ? 2 : 1, -1) < 0)
            continue; /* EINTR */
        while (read(sfd, &si, sizeof(si)) == sizeof(si))
            if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT)
                return EXIT_SUCCESS;
        if (ctl_fd < 0 || !p[1].revents)
            continue;
        /* The daemon shut the channel down (it gave it up, or a restarted
         * daemon will not use it; init keeps the daemon's end too, so a close
         * alone would not show here): nothing more starts. */
        if ((p[1].revents & (POLLHUP | POLLERR)) || serve() < 0) {
            close(ctl_fd);
            ctl_fd = -1;
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
        close(DSEC_INIT_PEER_FD);
        return reaper_only(&all);
    }
    if (argc > 1 && strcmp(argv[1], "ctl") == 0) {
        ctl_fd = DSEC_INIT_CTL_FD;
        return serve_forever(&all);
    }
    return reaper_only(&all);
}
