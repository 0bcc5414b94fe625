/* agent.c - dsec-guest-agent, PID 1 of every microVM sandbox (static binary).
 *
 * It is /init of the guest's initramfs (dsecd/backends/microvm/guestimg.py
 * builds it). At boot it:
 *   1. mounts /dev, /proc, /sys and loads the kernel modules listed in
 *      /modules.order (finit_module, dependencies first);
 *   2. mounts every image layer, an EROFS file the host shares as a
 *      virtio-pmem device, with dax=always (the guest reads the host's page
 *      cache of the blob, no copy in guest RAM), in the order of the devices'
 *      PCI addresses (the host places layer i, bottom first, at slot BASE+i);
 *   3. mounts a writable upper (a tmpfs of dsec.disk bytes) and the overlay of
 *      both, with /proc, /dev, /dev/pts, /dev/shm and /tmp inside, and moves
 *      it onto / (an initramfs cannot be pivoted away: switch_root's way);
 *   4. serves the host over the virtio-serial port named "dsec.agent".
 *
 * Kernel command-line parameters it reads: dsec.layers=N (pmem devices to
 * mount), dsec.disk=BYTES (the upper tmpfs cap), dsec.inodes=N (its inode
 * cap; the kernel's default, half the RAM's pages, without it),
 * dsec.tmp=BYTES (/tmp cap), dsec.shm=BYTES (/dev/shm cap; 64 MiB without
 * it, as before the parameter).
 *
 * The channel: frames of  u32 length (big-endian, of what follows) | u8 type |
 * u32 id | body, where a body is a sequence of fields, each a u64 (big-endian)
 * or a byte string (u32 length + bytes). dsecd/backends/microvm/wire.py is
 * the host side and names the layout of every message; keep both in step.
 * Requests carry the host's id; answers repeat it. An exec's id names it in
 * STDIN, KILL, OUT and EXITED.
 *
 * One thread, one poll loop: the channel, each exec's stdout/stderr pipes
 * (read while the exec's output window has room, EXEC_WINDOW: a host that
 * does not take an exec's output holds that process back, never the
 * channel) and stdin pipe (written when it can take data: a process that
 * does not read its stdin never stalls the agent), and a signalfd for
 * SIGCHLD. File
 * operations resolve paths with openat2(RESOLVE_IN_ROOT) under the sandbox
 * root, as the container backend does on the host, and run here, in the
 * loop: they are short, and the host sends at most limits.max_file_chunk_bytes
 * per request.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/ptrace.h>
#include <sys/uio.h>
#include <sys/user.h>
#include <sys/mount.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <grp.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <sys/socket.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <net/route.h>
#include <netinet/in.h>

#include "../missing_defs.h"

#ifndef MS_MOVE
#define MS_MOVE 8192
#endif
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif

/* message types: host -> guest */
enum {
    M_HELLO = 1,   /* hostname, unix time ns, seed, sandbox id, keeps execs: answered READY */
    M_EXEC = 2,    /* uid, gid, flags, cwd, argc, argv..., envc, env..., [rows, cols: EXEC_PTY],
                      [max string bytes, max argv entries: EXEC_TRACE], [window bytes: EXEC_WINDOW],
                      [count, gids...: EXEC_GROUPS] */
    M_STDIN = 3,   /* eof, data */
    M_KILL = 4,    /* signal */
    M_READ = 10,   /* path, offset, length */
    M_WRITE = 11,  /* path, flags, mode, offset (2^64-1: none), data[, owner uid, gid] */
    M_STAT = 12,   /* path[, flags (STAT_*)]: OK stat fields (put_stat), dev, ino[, a symlink's target] */
    M_LIST = 13,   /* path, depth[, flags (LIST_TS)]: OK per entry name, stat fields; count, truncated */
    M_MKDIR = 14,  /* path, parents, mode[, owner uid, gid] */
    M_REMOVE = 15, /* path, recursive */
    M_RENAME = 16, /* src, dst, flags (RENAME_*) */
    M_SYNC = 17,   /* (nothing): sync(), answered OK */
    M_NET = 18,    /* mac, IPv4 address, prefix length, gateway, mtu[, IPv6 address, prefix length, gateway]:
                      the NIC set up, answered OK */
    M_TAR = 19,    /* max file bytes[, n, n paths left out]: the writable layer as a tar in DATA frames,
                      then OK (counts) */
    M_PING = 20,   /* (nothing): answered OK at once, the host's liveness check */
    M_RESIZE = 21, /* rows, cols: a pty exec's window size (TIOCSWINSZ; SIGWINCH); no answer */
    /* background processes (proc_*): kept here, output ring and exit status
     * included, so they outlive the host's channel (a pause, a daemon restart) */
    M_PROC_START = 22,  /* ring bytes, uid, gid, flags (EXEC_STDIN, EXEC_GROUPS), cwd, argc, argv..., envc, env...,
                           [count, gids...: EXEC_GROUPS]: OK pid, started ns */
    M_PROC_LIST = 23,   /* (nothing): OK count, then per process: pid, exited, status, written, dropped, kept,
                           stdin open, input received, started ns, ended ns, argv (NUL-joined) */
    M_PROC_ATTACH = 24, /* pid, offset: its output from offset on, then its end, as A_PROC_*; then OK */
    M_PROC_INPUT = 25,  /* pid, offset, eof, data: OK once the pipe took all of it; ERR EPIPE if stdin is
                           closed. offset: of data's first byte in all the input; what was taken is skipped */
    M_PROC_KILL = 26,   /* pid, signal: to its process group; OK sent (0: the group is gone) */
    M_PROC_FORGET = 27, /* pid: an exited process's record and ring freed; OK */
    M_CREDIT = 28,      /* taken: of an EXEC_WINDOW exec (its id), the OUT data bytes the host has taken
                           in all (2^64-1: it discards the rest, send all); no answer */
    M_SETATTR = 29,     /* path, flags (SETATTR_*), mode, mtime (signed ns; SETATTR_TS: signed seconds)
                           [, nanoseconds: SETATTR_TS]: a file's or directory's (a symlink, unless followed:
                           ELOOP); OK */
};
/* guest -> host */
enum {
    A_READY = 101,   /* info text */
    A_STARTED = 102, /* pid */
    A_OUT = 103,     /* fd (1, 2; 3: the tracer's records of an EXEC_TRACE exec), data */
    A_EXITED = 104,  /* wait status */
    A_OK = 105,      /* the op's fields */
    A_ERR = 106,     /* errno, what failed (text) */
    A_DATA = 107,    /* bytes of a stream (M_TAR) */
    A_TAKEN = 108,   /* (nothing): an exec's M_STDIN is all in its pipe, or dropped (stdin closed) */
    A_PROC_OUT = 109, /* id 0: pid, offset, fd, time ns, data: a background process's output */
    A_PROC_END = 110, /* id 0: pid, wait status, ended ns: it exited and its output was all sent */
};

#define EXEC_STDIN 1u       /* M_EXEC flags: the exec takes stdin (else /dev/null) */
#define EXEC_TAR_GET 2u     /* no program: a child of the agent writes a tar of directory argv[0] to stdout */
#define EXEC_TAR_PUT 4u     /* no program: a child of the agent makes directory argv[0] from stdin's records */
#define EXEC_PTY 8u         /* a terminal as stdin/stdout/stderr (its controlling tty); rows, cols follow env */
#define EXEC_WATCH 16u      /* no program: a child of the agent watches directory argv[0] (file_watch) */
#define EXEC_TRACE 32u      /* under a ptrace recorder (trace_main): its records on fd 3 */
#define EXEC_WINDOW 64u     /* the host's flow control of output: a window in bytes follows all other fields */
#define EXEC_GROUPS 128u    /* supplementary groups: a count and that many gids, after every other field */
#define MAX_GROUPS 1024     /* at most this many supplementary groups (the host's DSEC_MAX_GROUPS) */
#define WRITE_APPEND 1u     /* M_WRITE flags */
#define WRITE_KEEP 2u       /* do not truncate */
#define WRITE_PARENTS 4u    /* make missing parent directories */
#define RENAME_OVERWRITE 1u /* M_RENAME flags: replace an existing dst */
#define RENAME_KEEP_ATTRS 2u /* a regular file replacing one takes its owner, group and mode */
#define STAT_FOLLOW 1u      /* M_STAT flags: stat what a symlink leads to (inside the root), not the link */
#define STAT_TS 2u          /* the mtime as signed seconds and a u64 of nanoseconds (put_stat) */
#define LIST_TS 1u          /* M_LIST flags: each entry's mtime as STAT_TS gives it */
#define SETATTR_MODE 1u     /* M_SETATTR flags: chmod to its mode */
#define SETATTR_MTIME 2u    /* set its mtime (and atime) */
#define SETATTR_FOLLOW 4u   /* a symlink as its last name: what it leads to (inside the root) */
#define SETATTR_TS 8u       /* the mtime field is signed seconds; a u64 of nanoseconds follows all others */

#define STR_(x) #x
#define STR(x) STR_(x)
#define MAX_MSG (64u << 20) /* the host never sends more in one frame */
/* A HELLO's length: type, id, hostname, clock, seed (4 + 32 bytes here), then
 * an optional sandbox id and flag; what find_hello takes for one. */
#define HELLO_MIN (5u + 4u + 8u + 4u)
#define HELLO_MAX 4096u
#define MAX_EXECS 256
#define OUT_CHUNK 65536
/* The version READY names. 3: EXEC_WINDOW and M_CREDIT are understood (an
 * older agent ignores the flag, and the host then does not send credit).
 * 4: EXEC_GROUPS (the host sends it to no older agent: one would run the
 * command without the groups). 6: a put's r record (the host sends it to
 * no older agent: the copy is refused). 7: M_SETATTR (the host sends it to
 * no older agent). 8: M_STAT takes STAT_FOLLOW and answers a symlink's
 * target (the host sends the flag to no older agent: one would ignore it).
 * 9: times before 1970 and below a second: a tar's mtime before 1970 in a
 * pax record (was 0), M_SETATTR's mtime signed, and a put told "ns" in its
 * argv takes its records' mtimes as signed nanoseconds (the host sends a
 * negative mtime to no older agent, nor "ns": one would take it as none).
 * 10: M_TAR sends xattrs of any size, and a copied-up file's user.* ones
 * from the image (what the host unpacks is the same as before).
 * 11: a copy out (tar_get_main) gives an mtime's fraction in a pax record
 * (an older agent's tar has whole seconds; the host passes either on).
 * 12: M_TAR finds a renamed file's image inode in an image of several
 * layers, by the uuid in its origin handle (what the host unpacks is the
 * same as before).
 * 13: a put told "ts" in its argv takes its records' mtimes as signed
 * seconds and nanoseconds, any time a time_t holds (signed nanoseconds in
 * 64 bits end in 1677 and 2262; the host refuses a time past them to an
 * agent of 9 to 12).
 * 14: M_SETATTR takes SETATTR_TS: its mtime as signed seconds and
 * nanoseconds, any time a time_t holds (the host refuses a time past 64-bit
 * nanoseconds to an older agent, and sends it no such flag).
 * 15: M_STAT takes STAT_TS and M_LIST LIST_TS: the mtime they answer as
 * signed seconds and nanoseconds, any time a time_t holds (an older agent's
 * 64-bit nanoseconds wrap a time past 2262 or before 1677; the host sends
 * the flags to no older agent, which would ignore them). */
#define AGENT_VERSION 15
#define MAX_LIST 100000

static int chan = -1;   /* the virtio-serial port */
static int rootfd = -1; /* O_PATH of the sandbox root, for openat2 */
static int upperfd = -1; /* the overlay's upper dir (out of the sandbox's view after the switch), for M_TAR */
static int layerfds[64];  /* the image's layers, bottom first (out of view too), for M_TAR: tar_origin_xattrs */
static int nlayerfds;
static unsigned char layer_uuids[64][16]; /* each layer's EROFS uuid (zeros: none, or unreadable) */
/* The cgroup every process the agent starts joins (all the guest's processes
 * but the agent), in a cgroup2 mount of the initramfs (out of the sandbox's
 * view after the switch): its cgroup.procs, cgroup.freeze and cgroup.events,
 * or -1 where it could not be made (M_TAR then stops processes by signals). */
static int cg_procs = -1, cg_freeze = -1, cg_events = -1;
static int cg_top = -1; /* the mount's top cgroup.procs: where the agent puts itself before a freeze */

static void say(const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof(buf) - 2)
        n = sizeof(buf) - 2;
    buf[n++] = '\n';
    /* the console is ttyS0: the host keeps it as the sandbox's serial log */
    int fd = open("/dev/console", O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t ignored = write(fd, "dsec-agent: ", 12);
        ignored = write(fd, buf, (size_t)n);
        (void)ignored;
        close(fd);
    }
}

/* ---- building answers ------------------------------------------------------ */

struct buf {
    unsigned char *p;
    size_t len, cap;
};

static void buf_need(struct buf *b, size_t more)
{
    if (b->len + more <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more)
        cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p) {
        say("out of memory for a %zu-byte answer", b->len + more);
        _exit(1); /* PID 1 exiting panics the guest: the host sees the VM die */
    }
    b->p = p;
    b->cap = cap;
}

static void put_u8(struct buf *b, uint8_t v)
{
    buf_need(b, 1);
    b->p[b->len++] = v;
}

static void put_u32(struct buf *b, uint32_t v)
{
    buf_need(b, 4);
    for (int i = 3; i >= 0; i--)
        b->p[b->len++] = (unsigned char)(v >> (8 * i));
}

static void put_u64(struct buf *b, uint64_t v)
{
    buf_need(b, 8);
    for (int i = 7; i >= 0; i--)
        b->p[b->len++] = (unsigned char)(v >> (8 * i));
}

static void put_bytes(struct buf *b, const void *data, size_t n)
{
    put_u32(b, (uint32_t)n);
    buf_need(b, n);
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void put_str(struct buf *b, const char *s)
{
    put_bytes(b, s, strlen(s));
}

/* A frame: header now, length patched by send_msg. */
static void begin(struct buf *b, uint8_t type, uint32_t id)
{
    b->len = 0;
    put_u32(b, 0);
    put_u8(b, type);
    put_u32(b, id);
}

static void host_gone(void);

static void write_all(int fd, const unsigned char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                struct pollfd pf = {.fd = fd, .events = POLLOUT};
                if (poll(&pf, 1, 1000) > 0 && (pf.revents & POLLHUP) && !(pf.revents & POLLOUT)) {
                    /* No host on the channel (the daemon stopped, or the VM
                     * is being saved): the frame is dropped, not held until
                     * the next host, which would read its tail as a frame. */
                    host_gone();
                    return;
                }
                continue;
            }
            say("channel write: %s", strerror(errno));
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

static void send_msg(struct buf *b)
{
    uint32_t n = (uint32_t)(b->len - 4);

    b->p[0] = (unsigned char)(n >> 24);
    b->p[1] = (unsigned char)(n >> 16);
    b->p[2] = (unsigned char)(n >> 8);
    b->p[3] = (unsigned char)n;
    write_all(chan, b->p, b->len);
}

static struct buf out; /* one answer at a time */

static void send_err(uint32_t id, int err, const char *what)
{
    begin(&out, A_ERR, id);
    put_u64(&out, (uint64_t)err);
    put_str(&out, what);
    send_msg(&out);
}

/* ---- reading requests ------------------------------------------------------ */

struct rd {
    const unsigned char *p, *end;
    int bad;
};

static uint64_t get_u64(struct rd *r)
{
    uint64_t v = 0;

    if (r->end - r->p < 8) {
        r->bad = 1;
        return 0;
    }
    for (int i = 0; i < 8; i++)
        v = v << 8 | *r->p++;
    return v;
}

/* A byte string; NUL-terminated in place is not possible, so strings are
 * copied out by get_str. */
static const unsigned char *get_bytes(struct rd *r, size_t *n)
{
    uint32_t len = 0;

    if (r->end - r->p < 4) {
        r->bad = 1;
        return NULL;
    }
    for (int i = 0; i < 4; i++)
        len = len << 8 | *r->p++;
    if ((size_t)(r->end - r->p) < len) {
        r->bad = 1;
        return NULL;
    }
    *n = len;
    r->p += len;
    return r->p - len;
}

/* A NUL-free string, malloc'd (the caller frees); NULL if bad. */
static char *get_str(struct rd *r)
{
    size_t n;
    const unsigned char *p = get_bytes(r, &n);

    if (!p || memchr(p, 0, n)) {
        r->bad = 1;
        return NULL;
    }
    char *s = malloc(n + 1);
    if (!s) {
        r->bad = 1;
        return NULL;
    }
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

/* ---- execs ------------------------------------------------------------------ */

struct exec {
    uint32_t id;
    pid_t pid;           /* 0: slot free */
    int out[4];          /* [1] stdout, [2] stderr, [3] the tracer's records read ends; -1 closed */
    int in;              /* stdin write end; -1 none or closed */
    unsigned char *pend; /* stdin not yet taken by the pipe */
    size_t pend_len, pend_off;
    int in_eof;          /* close stdin once pend is written */
    int owed;            /* an M_STDIN awaits its A_TAKEN: the host sends the next once it comes */
    int pty;             /* out[1] is a terminal's master (in a dup of it) */
    unsigned copy;       /* EXEC_TAR_GET, EXEC_TAR_PUT or EXEC_WATCH: one of the agent's own copies */
    /* Output flow control (EXEC_WINDOW; window 0: none, an older host): OUT
     * data sent may run at most `window` bytes ahead of what the host has
     * taken (M_CREDIT); past it the pipes are not read, so the process
     * blocks on its write, as a container's does on a slow client. */
    uint64_t window, sent, taken;
    int reaped;          /* it exited: its pipes' last output goes out as the window lets, then EXITED */
    int status;          /* its wait status, once reaped */
    uint64_t reaped_ns;  /* when: the tracer's end is waited for TRACE_END_WAIT_MS from then */
};
static struct exec execs[MAX_EXECS];

static struct exec *exec_by_id(uint32_t id)
{
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].pid && execs[i].id == id)
            return &execs[i];
    return NULL;
}

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* How many output bytes the exec may send now (0: its window is full). */
static size_t exec_room(const struct exec *x)
{
    if (!x->window || x->taken >= UINT64_MAX - x->window)
        return OUT_CHUNK; /* no window asked for, or the host discards the rest */
    uint64_t limit = x->taken + x->window;
    return limit > x->sent ? (size_t)(limit - x->sent < OUT_CHUNK ? limit - x->sent : OUT_CHUNK) : 0;
}

enum { FWD_CLOSED, FWD_EMPTY, FWD_MORE };

/* Read what a stdout/stderr/tracer pipe holds into OUT frames, as far as the
 * window lets: one chunk, or until it is empty (drain). FWD_CLOSED at
 * EOF/error (the pipe is closed), FWD_EMPTY when it had no more, FWD_MORE
 * when it may (one chunk read, or the window full). */
static int forward(struct exec *x, int k, int drain)
{
    static unsigned char chunk[OUT_CHUNK];

    for (;;) {
        size_t room = exec_room(x);

        if (!room)
            return FWD_MORE;
        ssize_t n = read(x->out[k], chunk, room);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return FWD_EMPTY;
        if (n <= 0) {
            close_fd(&x->out[k]);
            return FWD_CLOSED;
        }
        x->sent += (uint64_t)n;
        begin(&out, A_OUT, x->id);
        put_u64(&out, (uint64_t)k);
        put_bytes(&out, chunk, (size_t)n);
        send_msg(&out);
        if (!drain)
            return FWD_MORE;
    }
}

static void exec_free(struct exec *x)
{
    close_fd(&x->out[1]);
    close_fd(&x->out[2]);
    close_fd(&x->out[3]);
    close_fd(&x->in);
    free(x->pend);
    memset(x, 0, sizeof(*x));
}

/* The host's flow control of stdin: one M_STDIN at a time is in the agent,
 * answered A_TAKEN when the pipe has taken all of it (or stdin is closed and
 * it was dropped), so a process that does not read holds the host's next
 * exec_input back instead of filling guest memory. */
static void settle_stdin(struct exec *x)
{
    if (x->owed && (x->in < 0 || x->pend_len == 0)) {
        x->owed = 0;
        begin(&out, A_TAKEN, x->id);
        send_msg(&out);
    }
}

static void flush_stdin(struct exec *x)
{
    while (x->in >= 0 && x->pend_off < x->pend_len) {
        ssize_t w = write(x->in, x->pend + x->pend_off, x->pend_len - x->pend_off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                return;
            close_fd(&x->in); /* EPIPE: the process closed its stdin */
            break;
        }
        x->pend_off += (size_t)w;
    }
    if (x->pend_off >= x->pend_len) {
        free(x->pend);
        x->pend = NULL;
        x->pend_len = x->pend_off = 0;
        if (x->in_eof)
            close_fd(&x->in);
    }
    settle_stdin(x);
}

static void close_proc_fds(void);
static int tar_get_main(const char *path, uint64_t max_entries, uint64_t max_bytes);
/* How a put's records give their mtimes (put_record). */
enum { PUT_SECONDS, PUT_NS, PUT_TS };
static int put_times(const char *word);
static int tar_put_main(const char *path, int times);
static int owner_set(uint32_t uid, uint32_t gid);
static int watch_main(const char *path, int recursive, uint64_t max_dirs);

/* ---- traced execs (EXEC_TRACE) -----------------------------------------------
 *
 * The command of a traced exec runs in this kernel, so its recorder runs here
 * too: the host cannot ptrace it. The agent forks the command as any exec,
 * but the child stops itself (SIGSTOP) right before its execve; then the agent
 * forks the tracer, trace_main, which seizes it (PTRACE_SEIZE with
 * PTRACE_O_EXITKILL: nothing runs on untraced if the tracer dies) and lets it
 * exec. The tracer is a process of its own because it waits with
 * waitpid(-1, __WALL), which would reap the agent's other children; the
 * command stays the agent's child, so its exit status, kill and output are
 * an untraced exec's.
 *
 * The tracer only reads raw fields; dsecd/trace.py (call_event) turns them
 * into the same event dicts as a container's trace and applies the record's
 * bounds, with dsecd/backends/microvm/vmtrace.py reading this stream. Each
 * record, on the pipe the agent forwards as fd 3 of the exec:
 *   u32 length | u64 ns since the seize | u64 pid | u64 kind | fields
 * in the fields' usual encoding (u64, or u32 length + bytes):
 *   TR_SYSCALL: nr, return register, 6 argument registers, path, path cut,
 *               argc, argv..., argv cut, data (connect: the sockaddr;
 *               openat2: struct open_how)
 *   TR_SIGNAL: signal;  TR_FORK: ptrace event (fork, vfork, clone), child;
 *   TR_EXIT: wait status;  TR_ERROR: errno, what failed.
 * The record ends with the command's own exit: the tracer closes the pipe
 * then, and follows what the command left running, unrecorded, until it ends. */

#ifndef PTRACE_SEIZE
#define PTRACE_SEIZE 0x4206
#endif
#ifndef PTRACE_O_EXITKILL
#define PTRACE_O_EXITKILL 0x00100000
#endif
#define TRACE_OPTIONS                                                                            \
    (PTRACE_O_TRACESYSGOOD | PTRACE_O_TRACEFORK | PTRACE_O_TRACEVFORK | PTRACE_O_TRACECLONE |    \
     PTRACE_O_TRACEEXEC | PTRACE_O_EXITKILL)
#define MAX_TRACE_STRING (1u << 20) /* bounds of what the host may ask per string and per argv */
#define MAX_TRACE_ARGV 65536u
#define TRACE_END_WAIT_MS 5000      /* after the command's exit, for the tracer's last records */

enum { TR_SYSCALL = 1, TR_SIGNAL = 2, TR_FORK = 3, TR_EXIT = 4, TR_ERROR = 5 };
/* x86_64 numbers of the recorded syscalls */
enum { NR_OPEN = 2, NR_CONNECT = 42, NR_EXECVE = 59, NR_CREAT = 85, NR_OPENAT = 257, NR_EXECVEAT = 322,
       NR_OPENAT2 = 437 };

struct tracee {
    pid_t pid;
    int in_syscall; /* between its entry and exit stops */
    int pending;    /* a recorded syscall's arguments in args, for its exit */
    uint64_t nr;
    struct buf args;
};

static struct tracee *tracees;
static size_t ntracees, tracee_room;
static int tr_fd = -1;
static uint64_t tr_start;
static size_t tr_max_string, tr_max_argv;
static unsigned char *tr_scratch; /* one string or pointer array read from a tracee */
static struct buf tr_rec;

static uint64_t mono_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Its state, made on its first stop (a new child may stop before its
 * parent's fork event); NULL when no memory is left for it. */
static struct tracee *tracee(pid_t pid)
{
    for (size_t i = 0; i < ntracees; i++)
        if (tracees[i].pid == pid)
            return &tracees[i];
    if (ntracees == tracee_room) {
        size_t room = tracee_room ? 2 * tracee_room : 16;
        struct tracee *more = realloc(tracees, room * sizeof(*more));

        if (!more)
            return NULL;
        tracees = more;
        tracee_room = room;
    }
    struct tracee *t = &tracees[ntracees++];
    memset(t, 0, sizeof(*t));
    t->pid = pid;
    return t;
}

static void tracee_gone(pid_t pid)
{
    for (size_t i = 0; i < ntracees; i++)
        if (tracees[i].pid == pid) {
            free(tracees[i].args.p);
            tracees[i] = tracees[--ntracees];
            return;
        }
}

static void tr_begin(pid_t pid, uint64_t kind)
{
    tr_rec.len = 0;
    put_u32(&tr_rec, 0);
    put_u64(&tr_rec, mono_ns() - tr_start);
    put_u64(&tr_rec, (uint64_t)pid);
    put_u64(&tr_rec, kind);
}

/* The record to the agent; once the pipe is closed (the command ended, or
 * the agent gave up on it), records are dropped. */
static void tr_send(void)
{
    uint32_t n = (uint32_t)(tr_rec.len - 4);
    const unsigned char *p = tr_rec.p;
    size_t left = tr_rec.len;

    tr_rec.p[0] = (unsigned char)(n >> 24);
    tr_rec.p[1] = (unsigned char)(n >> 16);
    tr_rec.p[2] = (unsigned char)(n >> 8);
    tr_rec.p[3] = (unsigned char)n;
    while (tr_fd >= 0 && left) {
        ssize_t w = write(tr_fd, p, left);

        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            close_fd(&tr_fd);
            return;
        }
        p += w;
        left -= (size_t)w;
    }
}

/* Up to n bytes of the tracee's memory at addr; fewer where it is unmapped. */
static size_t tr_read(pid_t pid, uint64_t addr, void *p, size_t n)
{
    struct iovec local = {.iov_base = p, .iov_len = n}, remote = {.iov_base = (void *)addr, .iov_len = n};
    ssize_t got;

    if (!addr || !n)
        return 0;
    got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    return got > 0 ? (size_t)got : 0;
}

/* The NUL-terminated string at addr as bytes; returns 1 if it was cut: no
 * NUL came within tr_max_string bytes (a string ending in unmapped memory is
 * kept as far as it was read, not cut: as dsecd/trace.py _Memory.cstring). */
static int tr_put_cstring(struct buf *b, pid_t pid, uint64_t addr)
{
    size_t len = 0;
    int ended = 0;

    while (len < tr_max_string) {
        size_t want = 256, page = 4096 - (size_t)((addr + len) % 4096);

        if (want > page)
            want = page;
        if (want > tr_max_string - len)
            want = tr_max_string - len;
        size_t got = tr_read(pid, addr + len, tr_scratch + len, want);
        if (!got)
            break;
        unsigned char *nul = memchr(tr_scratch + len, 0, got);
        if (nul) {
            len = (size_t)(nul - tr_scratch);
            ended = 1;
            break;
        }
        len += got;
    }
    put_bytes(b, tr_scratch, len);
    return !ended && len >= tr_max_string;
}

/* At a recorded syscall's entry: its arguments, read now (a path may change
 * or be unmapped by its exit), kept for the record made at its exit. */
static void tr_entry(struct tracee *t, pid_t pid, const struct user_regs_struct *rg)
{
    uint64_t a[6] = {rg->rdi, rg->rsi, rg->rdx, rg->r10, rg->r8, rg->r9};
    uint64_t path = 0, argv = 0, data = 0, data_len = 0;
    int has_argv = 0;
    struct buf *b = &t->args;

    switch (rg->orig_rax) {
    case NR_EXECVE:
        path = a[0], argv = a[1], has_argv = 1;
        break;
    case NR_EXECVEAT:
        path = a[1], argv = a[2], has_argv = 1;
        break;
    case NR_OPEN:
    case NR_CREAT:
        path = a[0];
        break;
    case NR_OPENAT:
        path = a[1];
        break;
    case NR_OPENAT2:
        path = a[1], data = a[2], data_len = 24;
        break;
    case NR_CONNECT:
        data = a[1], data_len = a[2] < 128 ? a[2] : 128;
        break;
    default:
        return;
    }
    t->pending = 1;
    t->nr = rg->orig_rax;
    b->len = 0;
    for (int i = 0; i < 6; i++)
        put_u64(b, a[i]);
    put_u64(b, (uint64_t)tr_put_cstring(b, pid, path)); /* path 0: "" */
    uint64_t ptrs[256], count = 0;
    int cut = 0;
    size_t argc_at = b->len;

    put_u64(b, 0); /* argc, patched below */
    /* The pointer array, 256 at a time, to its NULL or tr_max_argv entries. */
    while (has_argv && count < tr_max_argv) {
        size_t want = tr_max_argv - count < 256 ? tr_max_argv - count : 256;
        size_t got = tr_read(pid, argv + 8 * count, ptrs, 8 * want) / 8;
        size_t i;

        for (i = 0; i < got && ptrs[i]; i++, count++)
            cut |= tr_put_cstring(b, pid, ptrs[i]);
        if (i < want)
            break;
    }
    for (int i = 7; i >= 0; i--)
        b->p[argc_at + 7 - i] = (unsigned char)(count >> (8 * i));
    put_u64(b, (uint64_t)cut);
    if (data_len) {
        unsigned char raw[128];
        size_t got = tr_read(pid, data, raw, data_len);

        put_bytes(b, raw, got);
    } else {
        put_bytes(b, "", 0);
    }
}

static void tr_syscall_stop(struct tracee *t, pid_t pid)
{
    struct user_regs_struct rg;

    if (ptrace(PTRACE_GETREGS, pid, 0, &rg) < 0)
        return; /* killed meanwhile: its exit comes next */
    if (!t->in_syscall) {
        t->in_syscall = 1;
        tr_entry(t, pid, &rg);
        return;
    }
    t->in_syscall = 0;
    if (!t->pending)
        return;
    t->pending = 0;
    tr_begin(pid, TR_SYSCALL);
    put_u64(&tr_rec, t->nr);
    put_u64(&tr_rec, rg.rax);
    buf_need(&tr_rec, t->args.len);
    memcpy(tr_rec.p + tr_rec.len, t->args.p, t->args.len);
    tr_rec.len += t->args.len;
    tr_send();
}

/* The tracer's process (a child of the agent): records `root`, stopped
 * before its execve, and all it starts, to fd; 0 once every tracee is gone. */
static int trace_main(pid_t root, int fd, size_t max_string, size_t max_argv)
{
    tr_fd = fd;
    tr_max_string = max_string;
    tr_max_argv = max_argv;
    tr_scratch = malloc(max_string);
    tr_start = mono_ns();
    if (!tr_scratch || ptrace(PTRACE_SEIZE, root, 0, TRACE_OPTIONS) < 0) {
        int err = tr_scratch ? errno : ENOMEM;

        tr_begin(root, TR_ERROR);
        put_u64(&tr_rec, (uint64_t)err);
        put_str(&tr_rec, tr_scratch ? "seize the command" : "memory for the tracer");
        tr_send();
        kill(root, SIGKILL); /* stopped, waiting for a tracer that will not come */
        return 1;
    }
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, __WALL);

        if (pid < 0) {
            if (errno == EINTR)
                continue;
            return 0; /* ECHILD: no tracee left */
        }
        if (WIFEXITED(status) || WIFSIGNALED(status)) {
            tr_begin(pid, TR_EXIT);
            put_u64(&tr_rec, (uint64_t)(unsigned)status);
            tr_send();
            tracee_gone(pid);
            if (pid == root)
                close_fd(&tr_fd); /* the record ends with the command */
            continue;
        }
        if (!WIFSTOPPED(status))
            continue;
        int sig = WSTOPSIG(status), event = status >> 16, deliver = 0;
        struct tracee *t = tracee(pid);

        if (sig == (SIGTRAP | 0x80)) {
            if (t)
                tr_syscall_stop(t, pid);
        } else if (event == PTRACE_EVENT_FORK || event == PTRACE_EVENT_VFORK || event == PTRACE_EVENT_CLONE) {
            unsigned long child = 0;

            if (ptrace(PTRACE_GETEVENTMSG, pid, 0, &child) == 0) {
                tr_begin(pid, TR_FORK);
                put_u64(&tr_rec, (uint64_t)event);
                put_u64(&tr_rec, (uint64_t)child);
                tr_send();
                tracee((pid_t)child);
            }
        } else if (!event) {
            /* A signal's delivery stop: recorded, then delivered. (Exec
             * events and PTRACE_EVENT_STOP, a group-stop or a new tracee's
             * first stop, are only resumed.) */
            tr_begin(pid, TR_SIGNAL);
            put_u64(&tr_rec, (uint64_t)sig);
            tr_send();
            deliver = sig;
        }
        ptrace(PTRACE_SYSCALL, pid, 0, (void *)(long)deliver);
    }
}

/* Fork the tracer of `root` (stopped before its execve); the read end of its
 * records, or -1 (errno). close_in_child: the agent's ends of this exec's
 * pipes, which the tracer must not hold (a stdin write end kept would hide
 * the input's end). */
static int start_tracer(pid_t root, size_t max_string, size_t max_argv, const int *close_in_child, int nclose)
{
    int tp[2];

    if (pipe2(tp, O_CLOEXEC) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        int err = errno;

        close(tp[0]);
        close(tp[1]);
        errno = err;
        return -1;
    }
    if (pid == 0) {
        sigset_t none;

        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        close(tp[0]);
        close_fd(&chan);
        for (int j = 0; j < MAX_EXECS; j++) {
            if (!execs[j].pid)
                continue;
            for (int k = 1; k <= 3; k++)
                close_fd(&execs[j].out[k]);
            close_fd(&execs[j].in);
        }
        close_proc_fds();
        for (int j = 0; j < nclose; j++)
            if (close_in_child[j] >= 0)
                close(close_in_child[j]);
        _exit(trace_main(root, tp[1], max_string, max_argv));
    }
    close(tp[1]);
    fcntl(tp[0], F_SETFL, O_NONBLOCK);
    return tp[0];
}

/* At the command's exit: the tracer's last records (its exit), until the
 * tracer closes the pipe; bounded, so a stuck tracer cannot hold the agent. */
/* An exec that exited: what its pipes still hold goes out as its window
 * lets (a later M_CREDIT calls this again), each pipe closed once empty, the
 * tracer's pipe at its EOF or TRACE_END_WAIT_MS after the exit; then
 * EXITED, and the slot is free. What a background child of it writes after
 * its pipe was found empty is dropped with the pipe. */
static void exec_settle(struct exec *x)
{
    for (int k = 1; k <= 2; k++)
        if (x->out[k] >= 0 && forward(x, k, 1) == FWD_EMPTY)
            close_fd(&x->out[k]);
    if (x->out[3] >= 0) {
        forward(x, 3, 1);
        if (x->out[3] >= 0 && mono_ns() - x->reaped_ns >= TRACE_END_WAIT_MS * 1000000ull) {
            say("exec %u: the tracer sent no end within %d ms", x->id, TRACE_END_WAIT_MS);
            close_fd(&x->out[3]);
        }
    }
    if (x->out[1] >= 0 || x->out[2] >= 0 || x->out[3] >= 0)
        return;
    begin(&out, A_EXITED, x->id);
    put_u64(&out, (uint64_t)(unsigned)x->status);
    send_msg(&out);
    exec_free(x);
}

/* The poll timeout (ms, -1: none) until the earliest tracer end wait runs out. */
static int trace_wait_ms(void)
{
    int ms = -1;

    for (int i = 0; i < MAX_EXECS; i++) {
        const struct exec *x = &execs[i];

        if (!x->pid || !x->reaped || x->out[3] < 0)
            continue;
        uint64_t gone = (mono_ns() - x->reaped_ns) / 1000000ull;
        int left = gone >= TRACE_END_WAIT_MS ? 0 : (int)(TRACE_END_WAIT_MS - gone);
        if (ms < 0 || left < ms)
            ms = left;
    }
    return ms;
}

/* What a child of the agent runs: an exec's or a background process's
 * command, or one of the agent's own copies (EXEC_TAR_GET, EXEC_TAR_PUT,
 * EXEC_WATCH). setsid(), stdio (`in` -1: /dev/null; `tty` >= 0: the
 * terminal as all three and its controlling tty), the supplementary groups
 * (none unless given), uid and gid, cwd, then the command; a step that fails
 * writes errno and the step's name to `report` in one write and exits 127. */
struct child {
    int in, out, err, tty, report;
    uid_t uid;
    gid_t gid;
    const gid_t *groups;
    size_t n_groups;
    const char *cwd;
    uint64_t argc;
    char **argv, **envp;
    int stop;            /* SIGSTOP itself before the execve, for its tracer (EXEC_TRACE) */
    unsigned copy;       /* EXEC_TAR_GET, EXEC_TAR_PUT or EXEC_WATCH: the agent's code instead of argv */
    int agent_ends[4];   /* the agent's ends of the child's pipes, which a copy closes */
};

/* What a container's exec uses when the env names no PATH (dsecd/imageconfig.py DEFAULT_PATH). */
#define EXEC_DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* execvpe as a container's exec does it (csrc/exec_steps.h exec_search):
 * the PATH searched is the command's own (envp's first PATH=), not the
 * agent's, and a file that is neither a binary nor a #! script fails with
 * ENOEXEC instead of being run by /bin/sh. A candidate that exists but
 * cannot run (EACCES, or ENOENT: its #! interpreter or dynamic loader is
 * missing) is remembered while later directories are tried, and the first
 * such is reported; any other error but "not in this directory" ends the
 * search. Returns only when nothing ran, errno set. */
static void exec_in_path(char *const argv[], char *const envp[])
{
    const char *file = argv[0], *dir = EXEC_DEFAULT_PATH;
    size_t flen = strlen(file);
    char buf[PATH_MAX];
    int first = 0; /* the errno of the first candidate that exists but cannot run */

    if (strchr(file, '/')) {
        execve(file, argv, envp);
        return;
    }
    for (char *const *e = envp; *e; e++)
        if (!strncmp(*e, "PATH=", 5)) {
            dir = *e + 5;
            break;
        }
    for (;;) {
        const char *end = strchrnul(dir, ':');
        size_t dlen = end > dir ? (size_t)(end - dir) : 1; /* an empty entry is the cwd */

        if (dlen + flen + 2 <= sizeof(buf)) {
            memcpy(buf, end > dir ? dir : ".", dlen);
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, file, flen + 1);
            execve(buf, argv, envp);
            int err = errno;
            int exists = err == ENOENT && faccessat(AT_FDCWD, buf, F_OK, 0) == 0;

            if (err == EACCES || exists) {
                if (!first)
                    first = err;
            } else if (err != ENOENT && err != ENOTDIR && err != ESTALE && err != ENODEV && err != ETIMEDOUT &&
                       err != ELOOP && err != ENAMETOOLONG) {
                errno = err;
                return;
            }
        }
        if (!*end)
            break;
        dir = end + 1;
    }
    errno = first ? first : ENOENT;
}

static void __attribute__((noreturn, noinline)) child_main(const struct child *c)
{
    int err, in = c->in >= 0 ? c->in : open("/dev/null", O_RDONLY);
    const char *step = "stdio";
    sigset_t none;

    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (cg_procs >= 0) {
        /* into the cgroup a snapshot freezes; its children follow */
        ssize_t ignored = write(cg_procs, "0", 1);
        (void)ignored;
    }
    setsid();
    if (c->tty >= 0) {
        step = "terminal";
        if (ioctl(c->tty, TIOCSCTTY, 0) < 0 || dup2(c->tty, 0) < 0 || dup2(c->tty, 1) < 0 || dup2(c->tty, 2) < 0)
            goto child_fail;
    } else if (in < 0 || dup2(in, 0) < 0 || dup2(c->out, 1) < 0 || dup2(c->err, 2) < 0) {
        goto child_fail;
    }
    step = "setgroups";
    if (setgroups(c->n_groups, c->n_groups ? c->groups : NULL) < 0)
        goto child_fail;
    step = "setgid";
    if (setgid(c->gid) < 0)
        goto child_fail;
    step = "setuid";
    if (setuid(c->uid) < 0)
        goto child_fail;
    step = "chdir";
    if (chdir(c->cwd) < 0)
        goto child_fail;
    umask(022);
    if (c->copy) {
        close(c->report); /* it started: EOF for the parent */
        for (int k = 0; k < 4; k++) /* the agent's ends: no exec closes them (O_CLOEXEC) here, and */
            if (c->agent_ends[k] >= 0) /* a write end of its own stdin kept would hide that input's end */
                close(c->agent_ends[k]);
        close_fd(&chan); /* and the other execs' pipes: their ends must not wait for this one */
        for (int j = 0; j < MAX_EXECS; j++) {
            if (!execs[j].pid)
                continue; /* a free slot's fields are zero, not -1 */
            close_fd(&execs[j].out[1]);
            close_fd(&execs[j].out[2]);
            close_fd(&execs[j].out[3]);
            close_fd(&execs[j].in);
        }
        close_proc_fds();
        if (c->copy & EXEC_TAR_PUT) {
            /* argv: the directory, then its owner's uid and gid if not root
             * (or a host of version 9 on), then how its records give their
             * mtimes: "ts" (from agent version 13 on) or "ns" (9 to 12),
             * else in seconds (put_times) */
            if (c->argc > 2 && owner_set((uint32_t)strtoul(c->argv[1], NULL, 10),
                                         (uint32_t)strtoul(c->argv[2], NULL, 10)) < 0) {
                step = "take the owner's ids";
                goto child_fail;
            }
            _exit(tar_put_main(c->argv[0], c->argc > 3 ? put_times(c->argv[3]) : PUT_SECONDS));
        }
        if (c->copy & EXEC_WATCH)
            _exit(watch_main(c->argv[0], c->argc > 1 && !strcmp(c->argv[1], "1"),
                             c->argc > 2 ? strtoull(c->argv[2], NULL, 10) : 0));
        _exit(tar_get_main(c->argv[0], c->argc > 1 ? strtoull(c->argv[1], NULL, 10) : 0,
                           c->argc > 2 ? strtoull(c->argv[2], NULL, 10) : 0));
    }
    if (c->stop)
        kill(getpid(), SIGSTOP); /* until its tracer has seized it: the execve is its first record */
    step = "exec";
    exec_in_path(c->argv, c->envp);
child_fail:
    err = errno;
    {
        /* one write: the parent reads errno and step in one read */
        char msg[64];
        size_t n = strlen(step);

        memcpy(msg, &err, sizeof(err));
        memcpy(msg + sizeof(err), step, n);
        ssize_t ignored = write(c->report, msg, sizeof(err) + n);
        (void)ignored;
    }
    _exit(127);
}

/* The child, by vfork (the caller's memory shared until it execs or exits:
 * nothing but `c` lives across it here, so nothing of the caller's can be
 * clobbered) or by fork. */
static pid_t start_child(const struct child *c, int use_vfork)
{
    pid_t pid = use_vfork ? vfork() : fork();

    if (pid == 0)
        child_main(c);
    return pid;
}

static void close_pair(int p[2])
{
    close_fd(&p[0]);
    close_fd(&p[1]);
}

/* The command of an exec or proc_start request, as the host sends it: cwd,
 * argc, argv, envc, envp. */
struct cmdline {
    char *cwd;
    uint64_t argc, envc;
    char **argv, **envp;
};

/* 0, or -1 when it is malformed (no or too many arguments or variables, an
 * empty program name, a short message); free_cmdline frees what was read
 * either way. */
static int read_cmdline(struct rd *r, struct cmdline *cl)
{
    uint64_t i;

    cl->cwd = get_str(r);
    cl->argc = get_u64(r);
    if (r->bad || cl->argc < 1 || cl->argc > 65536)
        return -1;
    cl->argv = calloc(cl->argc + 1, sizeof(char *));
    for (i = 0; cl->argv && i < cl->argc; i++)
        cl->argv[i] = get_str(r);
    cl->envc = get_u64(r);
    if (!cl->argv || r->bad || cl->envc > 65536)
        return -1;
    cl->envp = calloc(cl->envc + 1, sizeof(char *));
    for (i = 0; cl->envp && i < cl->envc; i++)
        cl->envp[i] = get_str(r);
    return !cl->envp || r->bad || !cl->argv[0][0] ? -1 : 0;
}

/* The supplementary groups of an EXEC_GROUPS request into groups[MAX_GROUPS];
 * their count, or -1 (r->bad set) when the list is malformed. */
static long read_groups(struct rd *r, gid_t *groups)
{
    uint64_t n = get_u64(r);

    if (r->bad || n > MAX_GROUPS) {
        r->bad = 1;
        return -1;
    }
    for (uint64_t i = 0; i < n; i++) {
        uint64_t gid = get_u64(r);

        if (gid >= (gid_t)-1) /* (gid_t)-1 is no group: setgroups refuses it */
            r->bad = 1;
        groups[i] = (gid_t)gid;
    }
    return r->bad ? -1 : (long)n;
}

static void free_cmdline(struct cmdline *cl)
{
    uint64_t i;

    for (i = 0; cl->argv && i < cl->argc; i++)
        free(cl->argv[i]);
    for (i = 0; cl->envp && i < cl->envc; i++)
        free(cl->envp[i]);
    free(cl->argv);
    free(cl->envp);
    free(cl->cwd);
}

/* After a child's start: 0 once it exec'd (its report pipe at EOF); else
 * -1, with the error it reported (errno and the failed step) sent as the
 * answer to `id` and the child reaped. Closes *report. */
static int child_start_failed(uint32_t id, pid_t pid, int *report)
{
    char eb[64] = {0};
    ssize_t n;
    int err;

    while ((n = read(*report, eb, sizeof(eb) - 1)) < 0 && errno == EINTR)
        ;
    close_fd(report);
    if (n < (ssize_t)sizeof(int))
        return 0;
    memcpy(&err, eb, sizeof(err));
    waitpid(pid, NULL, 0);
    send_err(id, err, eb + sizeof(int));
    return -1;
}

static void do_exec(uint32_t id, struct rd *r)
{
    uint64_t uid = get_u64(r), gid = get_u64(r), flags = get_u64(r);
    struct cmdline cl = {0};
    uint64_t i, rows = 0, cols = 0, max_string = 0, max_argv = 0, window = 0;
    struct exec *x = NULL;
    int trace = (flags & EXEC_TRACE) != 0, trace_fd = -1, reaped = 0;
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, pi[2] = {-1, -1}, perr[2] = {-1, -1};
    int pty = -1, tty = -1; /* a pty exec's master and slave */
    gid_t groups[MAX_GROUPS];
    long n_groups = 0;

    if (read_cmdline(r, &cl) < 0)
        goto bad;
    if (flags & EXEC_PTY) {
        rows = get_u64(r);
        cols = get_u64(r);
    }
    if (trace) {
        max_string = get_u64(r);
        max_argv = get_u64(r);
    }
    if (flags & EXEC_WINDOW)
        window = get_u64(r);
    if (flags & EXEC_GROUPS)
        n_groups = read_groups(r, groups);
    if (r->bad || rows > 65535 || cols > 65535 || ((flags & EXEC_WINDOW) && !window))
        goto bad;
    /* A terminal's or copy's exec is never traced (the host refuses those). */
    if (trace && ((flags & (EXEC_PTY | EXEC_TAR_GET | EXEC_TAR_PUT | EXEC_WATCH)) || max_string < 1 ||
                  max_string > MAX_TRACE_STRING || max_argv < 1 || max_argv > MAX_TRACE_ARGV))
        goto bad;
    if (exec_by_id(id)) {
        send_err(id, EEXIST, "exec id in use");
        goto done;
    }
    for (i = 0; i < MAX_EXECS && execs[i].pid; i++)
        ;
    if (i == MAX_EXECS) {
        send_err(id, EAGAIN, "too many execs at once");
        goto done;
    }
    x = &execs[i];
    if (flags & EXEC_PTY) {
        /* The sandbox's own devpts instance (mounted newinstance), its
         * slave opened from the master (TIOCGPTPEER): no path lookup; the
         * exec user's, as a login's terminal is (a container's too). */
        struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
        int unlock = 0;

        pty = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (pty < 0 || ioctl(pty, TIOCSPTLCK, &unlock) < 0 || ioctl(pty, TIOCSWINSZ, &ws) < 0 ||
            (tty = ioctl(pty, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0 ||
            fchown(tty, (uid_t)uid, (gid_t)gid) < 0 || (po[0] = dup(pty)) < 0 ||
            (pi[1] = fcntl(pty, F_DUPFD_CLOEXEC, 0)) < 0) {
            send_err(id, errno, "open a terminal");
            goto fail;
        }
        fcntl(po[0], F_SETFD, FD_CLOEXEC);
        close_fd(&pty);
    }
    if (((flags & EXEC_PTY) ? 0 : pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0) ||
        pipe2(perr, O_CLOEXEC) < 0 ||
        (!(flags & EXEC_PTY) && (flags & EXEC_STDIN) && pipe2(pi, O_CLOEXEC) < 0)) {
        send_err(id, errno, "pipe");
        goto fail;
    }
    /* vfork: no copy of the agent's page tables, which under TCG (softmmu)
     * is most of an exec's cost. The child only makes syscalls on its own
     * stack until it execs or _exits (the agent is single-threaded, so
     * glibc's set*id are plain syscalls). A copy runs the agent's own code:
     * a fork of its own, not a vfork; a traced command stops before its
     * execve, which a vfork's parent would wait out forever. */
    struct child c = {.in = tty >= 0 ? tty : (flags & EXEC_STDIN) ? pi[0] : -1, .out = po[1], .err = pe[1],
                      .tty = tty, .report = perr[1], .uid = (uid_t)uid, .gid = (gid_t)gid,
                      .groups = groups, .n_groups = (size_t)n_groups, .cwd = cl.cwd,
                      .argc = cl.argc, .argv = cl.argv, .envp = cl.envp, .stop = trace,
                      .copy = (unsigned)(flags & (EXEC_TAR_GET | EXEC_TAR_PUT | EXEC_WATCH)),
                      .agent_ends = {perr[0], po[0], pe[0], pi[1]}};
    pid_t pid = start_child(&c, !c.copy && !trace);
    if (pid < 0) {
        send_err(id, errno, "fork");
        goto fail;
    }
    close_fd(&po[1]);
    close_fd(&pe[1]);
    close_fd(&pi[0]);
    close_fd(&perr[1]);
    close_fd(&tty);
    if (trace) {
        int status = 0, keep[] = {po[0], pe[0], pi[1], perr[0]};

        while (waitpid(pid, &status, WUNTRACED) < 0 && errno == EINTR)
            ;
        /* Not stopped: a step before the exec failed, as perr says below. */
        reaped = !WIFSTOPPED(status);
        if (WIFSTOPPED(status) && (trace_fd = start_tracer(pid, max_string, max_argv, keep, 4)) < 0) {
            int err = errno;

            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            send_err(id, err, "start the tracer");
            goto fail;
        }
    }
    if (child_start_failed(id, pid, &perr[0]) < 0)
        goto fail;
    if (reaped) { /* it ended before its stop and said nothing: no process to report on */
        send_err(id, ECHILD, "stop before the traced exec");
        goto fail;
    }
    x->id = id;
    x->pid = pid;
    x->out[0] = -1;
    x->out[1] = po[0];
    x->out[2] = pe[0];
    x->out[3] = trace_fd;
    trace_fd = -1;
    x->in = pi[1];
    x->pty = (flags & EXEC_PTY) != 0;
    x->copy = c.copy;
    x->window = window;
    fcntl(po[0], F_SETFL, O_NONBLOCK); /* a pty's master: its stdin end shares the open file */
    if (pe[0] >= 0)
        fcntl(pe[0], F_SETFL, O_NONBLOCK);
    if (x->in >= 0)
        fcntl(x->in, F_SETFL, O_NONBLOCK);
    begin(&out, A_STARTED, id);
    put_u64(&out, (uint64_t)pid);
    send_msg(&out);
    goto done;
bad:
    send_err(id, EINVAL, "malformed exec request");
    goto done;
fail:
    close_fd(&trace_fd);
    close_fd(&pty);
    close_fd(&tty);
    close_pair(po);
    close_pair(pe);
    close_pair(pi);
    close_pair(perr);
done:
    free_cmdline(&cl);
}

static void do_stdin(uint32_t id, struct rd *r)
{
    uint64_t eof = get_u64(r);
    size_t n = 0;
    const unsigned char *data = get_bytes(r, &n);
    struct exec *x = exec_by_id(id);

    if (r->bad)
        return;
    if (!x || x->in < 0) { /* an exec that ended or took no stdin: input is dropped */
        if (x) {
            begin(&out, A_TAKEN, id);
            send_msg(&out);
        }
        return;
    }
    x->owed = 1;
    if (n) {
        unsigned char *p = realloc(x->pend, x->pend_len + n);
        if (!p) {
            close_fd(&x->in); /* no memory for it: the process sees its stdin end */
            settle_stdin(x);
            return;
        }
        memcpy(p + x->pend_len, data, n);
        x->pend = p;
        x->pend_len += n;
    }
    x->in_eof |= eof != 0;
    flush_stdin(x);
}

static void do_resize(uint32_t id, struct rd *r)
{
    uint64_t rows = get_u64(r), cols = get_u64(r);
    struct exec *x = exec_by_id(id);
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};

    if (!r->bad && x && x->pty && x->out[1] >= 0)
        ioctl(x->out[1], TIOCSWINSZ, &ws); /* the kernel signals the foreground group */
}

static void do_kill(uint32_t id, struct rd *r)
{
    uint64_t sig = get_u64(r);
    struct exec *x = exec_by_id(id);

    if (!r->bad && x && !x->reaped) /* reaped: its pid may be another's by now */
        kill(-x->pid, (int)sig); /* its process group: it called setsid */
}

/* The host took more of an exec's output: its pipes are read again (the
 * poll loop), an exited one's rest sent. */
static void do_credit(uint32_t id, struct rd *r)
{
    uint64_t taken = get_u64(r);
    struct exec *x = exec_by_id(id);

    if (r->bad || !x || taken <= x->taken)
        return;
    x->taken = taken;
    if (x->reaped)
        exec_settle(x);
}

static int proc_reaped(pid_t pid, int status);

/* Every child that ended: an exec's output drained, then EXITED
 * (exec_settle; a background process's end goes to its record: proc_ended). */
static void reap(void)
{
    int status;
    pid_t pid;

    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        if (proc_reaped(pid, status))
            continue;
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *x = &execs[i];

            if (x->pid != pid || x->reaped)
                continue;
            x->reaped = 1;
            x->status = status;
            close_fd(&x->in); /* input that comes now is dropped (A_TAKEN), as for an ended exec */
            settle_stdin(x);
            x->reaped_ns = mono_ns();
            exec_settle(x);
            break;
        }
    }
}

/* ---- background processes (proc_*) ------------------------------------------
 *
 * Started like an exec (no terminal, no copy), but kept here whatever
 * becomes of the host's channel: each one's output in a ring of the size the
 * host asks for (limits.proc_output_bytes), every chunk with its offset in
 * all the process wrote and the time it was read, and its exit status. The
 * host follows a process by attaching at the offset it already has
 * (M_PROC_ATTACH): the agent sends what it kept from there on (A_PROC_OUT; an
 * offset past the host's says the ring dropped the bytes between), then new
 * output as it is read, then the end (A_PROC_END). A new host (HELLO: a
 * restarted daemon, a resumed VM's new QEMU) or none at all (POLLHUP on a
 * write) detaches every process; their rings fill on meanwhile, and the next
 * host attaches again where it stopped: nothing it had not seen is lost but
 * what the ring itself dropped. */

struct chunk {
    uint64_t off, t_ns;
    unsigned char *data;
    uint32_t len;
    uint8_t fd;
};

struct proc {
    pid_t pid;                /* 0: slot free */
    int out[3];               /* [1] stdout, [2] stderr read ends; -1 closed */
    int in;                   /* stdin write end; -1 none or closed */
    unsigned char *pend;      /* input not yet taken by the pipe */
    size_t pend_len, pend_off;
    int in_eof;               /* close stdin once pend is written */
    uint32_t input_id;        /* the M_PROC_INPUT answered once pend is written; 0: none */
    uint64_t in_received;     /* input bytes taken from the host, in all (M_PROC_INPUT's offsets) */
    int exited, status;
    uint64_t started_ns, ended_ns;
    char *argv;               /* NUL-joined */
    size_t argv_len;
    uint64_t cap, kept, written; /* the ring: bytes it may hold, holds, and all the process wrote */
    struct chunk *chunks;     /* live: [head, nchunks) */
    size_t head, nchunks, cap_chunks;
    int attached, end_sent;
    uint64_t sent;            /* the attached host has every byte before this offset */
};
static struct proc *procs;
static size_t nprocs; /* slots, used or free */

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct proc *proc_by_pid(uint64_t pid)
{
    for (size_t i = 0; i < nprocs; i++)
        if (procs[i].pid && (uint64_t)procs[i].pid == pid)
            return &procs[i];
    return NULL;
}

/* The offset of the oldest byte the ring holds: what fell out before it. */
static uint64_t proc_dropped(const struct proc *p)
{
    return p->head < p->nchunks ? p->chunks[p->head].off : p->written;
}

#define MERGE_BYTES 4096u            /* reads merged into one chunk up to this size */
#define MERGE_NS 100000000ull        /* when they came within 0.1 s of its first */
#define CHUNK_COST 64u               /* a chunk's bookkeeping: live chunks <= cap / this */

/* The oldest chunks go while the ring holds more than its bytes, or more
 * chunks than cap / CHUNK_COST (each costs memory of its own, beyond its
 * bytes: bounded so, the ring never takes more than about twice its cap). */
static void proc_trim(struct proc *p)
{
    size_t most = (size_t)(p->cap / CHUNK_COST) > 16 ? (size_t)(p->cap / CHUNK_COST) : 16;

    while (p->head < p->nchunks && (p->kept > p->cap || p->nchunks - p->head > most)) {
        p->kept -= p->chunks[p->head].len;
        free(p->chunks[p->head].data);
        p->head++;
    }
}

static void proc_append(struct proc *p, int fd, const unsigned char *data, size_t n)
{
    uint64_t off = p->written;

    p->written += n;
    if (n > p->cap) { /* only its tail fits */
        data += n - p->cap;
        off += n - p->cap;
        n = (size_t)p->cap;
    }
    if (!n)
        return;
    uint64_t now = now_ns();
    if (p->head < p->nchunks) {
        /* Small reads close together (a process writing a line at a time)
         * grow the last chunk: a chunk per byte would cost the guest far
         * more in bookkeeping than in output. */
        struct chunk *last = &p->chunks[p->nchunks - 1];
        if (last->fd == fd && last->len + n <= MERGE_BYTES && last->len + n <= p->cap &&
            now - last->t_ns < MERGE_NS && last->off + last->len == off) {
            unsigned char *grown = realloc(last->data, last->len + n);
            if (grown) {
                memcpy(grown + last->len, data, n);
                last->data = grown;
                last->len += (uint32_t)n;
                p->kept += n;
                proc_trim(p);
                return;
            }
        }
    }
    if (p->nchunks == p->cap_chunks) {
        if (p->head) { /* room at the front: move the live chunks down */
            memmove(p->chunks, p->chunks + p->head, (p->nchunks - p->head) * sizeof(*p->chunks));
            p->nchunks -= p->head;
            p->head = 0;
        } else {
            size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 16;
            struct chunk *c = realloc(p->chunks, cap * sizeof(*c));
            if (!c)
                return; /* no memory: counted as written, so the host sees a gap */
            p->chunks = c;
            p->cap_chunks = cap;
        }
    }
    unsigned char *copy = malloc(n);
    if (!copy)
        return;
    memcpy(copy, data, n);
    p->chunks[p->nchunks++] = (struct chunk){.off = off, .t_ns = now, .data = copy, .len = (uint32_t)n,
                                             .fd = (uint8_t)fd};
    p->kept += n;
    proc_trim(p);
}

/* To the attached host: the output it does not have yet, then the end once
 * the process exited and its pipes were drained. */
static void proc_push(struct proc *p)
{
    for (size_t i = p->head; p->attached && i < p->nchunks; i++) {
        struct chunk *c = &p->chunks[i];
        uint64_t end = c->off + c->len, skip = p->sent > c->off ? p->sent - c->off : 0;

        if (end <= p->sent)
            continue;
        begin(&out, A_PROC_OUT, 0);
        put_u64(&out, (uint64_t)p->pid);
        put_u64(&out, c->off + skip);
        put_u64(&out, c->fd);
        put_u64(&out, c->t_ns);
        put_bytes(&out, c->data + skip, (size_t)(c->len - skip));
        send_msg(&out);
        if (p->attached) /* else the host went during the write: the next one attaches again */
            p->sent = end;
    }
    if (p->attached && p->exited && p->out[1] < 0 && p->out[2] < 0 && !p->end_sent) {
        p->sent = p->written;
        begin(&out, A_PROC_END, 0);
        put_u64(&out, (uint64_t)p->pid);
        put_u64(&out, (uint64_t)(unsigned)p->status);
        put_u64(&out, p->ended_ns);
        send_msg(&out);
        if (p->attached)
            p->end_sent = 1;
    }
}

/* The host's channel has no host any more, or a new one said HELLO: nothing
 * is sent until it attaches again, and no answer to the old host's input
 * request goes to the new one (its ids start over). */
static void detach_procs(void)
{
    for (size_t i = 0; i < nprocs; i++) {
        procs[i].attached = 0;
        procs[i].input_id = 0;
    }
}

/* The execs' host is gone: an exec belongs to the host that started it and
 * no other sends it credit, so its output goes without a window (the next
 * host drops it), else its process would wait on its write for ever. The
 * loop settles the exited ones. */
static void orphan_execs(void)
{
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].pid)
            execs[i].taken = UINT64_MAX;
}

/* Set when the host went: what comes before the next host's first frame, its
 * HELLO, is the rest of the frames of the host that went (a daemon killed
 * mid-request leaves half a frame), which must not be read as frames:
 * read_channel skips to the first HELLO (find_hello). It is not simply
 * dropped: the guest may learn that the host went only after the next one
 * sent its HELLO (the port's open event and the data come on separate
 * virtqueues; a VM restored from a pause sees both at once), and a HELLO
 * dropped then is never answered. */
static int input_stale;

/* A new host that does not follow the running execs (a restarted daemon):
 * a directory copy's child (EXEC_TAR_PUT) still waiting for records will
 * get none, as their host is gone. Its input ends, so that it removes the
 * directory it was making beside the destination (.dsec-put-<hex>), which
 * nobody else knows to be a copy's; else it would wait, and the directory
 * stay, for as long as the VM runs. */
static void end_orphaned_puts(void)
{
    for (int i = 0; i < MAX_EXECS; i++) {
        struct exec *x = &execs[i];

        if (!x->pid || !(x->copy & EXEC_TAR_PUT) || x->in < 0)
            continue;
        free(x->pend);
        x->pend = NULL;
        x->pend_len = x->pend_off = 0;
        x->owed = 0; /* its host is gone: no A_TAKEN for it */
        close_fd(&x->in);
    }
}

static void host_gone(void)
{
    detach_procs();
    orphan_execs();
    input_stale = 1;
}

/* Read a stdout/stderr pipe into the ring (all it holds, with drain); 0 at EOF. */
static int proc_read(struct proc *p, int k, int drain)
{
    static unsigned char chunk[OUT_CHUNK];

    for (;;) {
        ssize_t n = read(p->out[k], chunk, sizeof(chunk));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 1;
        if (n <= 0) {
            close_fd(&p->out[k]);
            proc_push(p);
            return 0;
        }
        proc_append(p, k, chunk, (size_t)n);
        proc_push(p);
        if (!drain)
            return 1;
    }
}

static void proc_answer_input(struct proc *p, int err)
{
    if (!p->input_id)
        return;
    if (err)
        send_err(p->input_id, err, "the process's stdin is closed");
    else {
        begin(&out, A_OK, p->input_id);
        send_msg(&out);
    }
    p->input_id = 0;
}

static void proc_flush_stdin(struct proc *p)
{
    while (p->in >= 0 && p->pend_off < p->pend_len) {
        ssize_t w = write(p->in, p->pend + p->pend_off, p->pend_len - p->pend_off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                return;
            close_fd(&p->in); /* EPIPE: the process closed its stdin */
            break;
        }
        p->pend_off += (size_t)w;
    }
    int lost = p->pend_off < p->pend_len;

    free(p->pend);
    p->pend = NULL;
    p->pend_len = p->pend_off = 0;
    if (p->in_eof)
        close_fd(&p->in);
    proc_answer_input(p, lost ? EPIPE : 0);
}

static void proc_free(struct proc *p)
{
    close_fd(&p->out[1]);
    close_fd(&p->out[2]);
    close_fd(&p->in);
    free(p->pend);
    free(p->argv);
    for (size_t i = p->head; i < p->nchunks; i++)
        free(p->chunks[i].data);
    free(p->chunks);
    memset(p, 0, sizeof(*p));
}

/* Its end (reap): what its pipes hold now is read, then they close (what a
 * child of it writes later is dropped, as for an exec), and the host hears. */
static void proc_ended(struct proc *p, int status)
{
    for (int k = 1; k <= 2; k++)
        if (p->out[k] >= 0)
            proc_read(p, k, 1);
    close_fd(&p->out[1]);
    close_fd(&p->out[2]);
    close_fd(&p->in);
    free(p->pend);
    p->pend = NULL;
    p->pend_len = p->pend_off = 0;
    proc_answer_input(p, EPIPE);
    p->exited = 1;
    p->status = status;
    p->ended_ns = now_ns();
    proc_push(p);
}

/* 1 if pid was a running background process (its end recorded). */
static int proc_reaped(pid_t pid, int status)
{
    struct proc *p = proc_by_pid((uint64_t)pid);

    if (!p || p->exited)
        return 0;
    proc_ended(p, status);
    return 1;
}

/* In a copy's child (a fork of the agent): the background processes' pipe
 * ends are the agent's, not its own; kept, they would hide those ends. */
static void close_proc_fds(void)
{
    for (size_t i = 0; i < nprocs; i++) {
        if (!procs[i].pid)
            continue;
        close_fd(&procs[i].out[1]);
        close_fd(&procs[i].out[2]);
        close_fd(&procs[i].in);
    }
}

static void do_proc_start(uint32_t id, struct rd *r)
{
    uint64_t cap = get_u64(r), uid = get_u64(r), gid = get_u64(r), flags = get_u64(r);
    struct cmdline cl = {0};
    uint64_t i;
    int po[2] = {-1, -1}, pe[2] = {-1, -1}, pi[2] = {-1, -1}, perr[2] = {-1, -1};
    struct proc *p = NULL;
    gid_t groups[MAX_GROUPS];
    long n_groups = 0;

    if (read_cmdline(r, &cl) < 0 || !cap || ((flags & EXEC_GROUPS) && (n_groups = read_groups(r, groups)) < 0))
        goto bad;
    if (pipe2(po, O_CLOEXEC) < 0 || pipe2(pe, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0 ||
        ((flags & EXEC_STDIN) && pipe2(pi, O_CLOEXEC) < 0)) {
        send_err(id, errno, "pipe");
        goto fail;
    }
    /* vfork, as do_exec: the child only makes syscalls until it execs. */
    struct child c = {.in = (flags & EXEC_STDIN) ? pi[0] : -1, .out = po[1], .err = pe[1], .tty = -1,
                      .report = perr[1], .uid = (uid_t)uid, .gid = (gid_t)gid, .groups = groups,
                      .n_groups = (size_t)n_groups, .cwd = cl.cwd, .argc = cl.argc, .argv = cl.argv,
                      .envp = cl.envp, .agent_ends = {-1, -1, -1, -1}};
    pid_t pid = start_child(&c, 1);
    if (pid < 0) {
        send_err(id, errno, "fork");
        goto fail;
    }
    close_fd(&po[1]);
    close_fd(&pe[1]);
    close_fd(&pi[0]);
    close_fd(&perr[1]);
    if (child_start_failed(id, pid, &perr[0]) < 0)
        goto fail;
    p = proc_by_pid((uint64_t)pid); /* an exited record of a pid the guest reused */
    if (p)
        proc_free(p);
    for (i = 0; i < nprocs && procs[i].pid; i++)
        ;
    if (i == nprocs) {
        struct proc *more = realloc(procs, (nprocs + 8) * sizeof(*procs));
        if (!more) {
            kill(-pid, SIGKILL);
            send_err(id, ENOMEM, "record the process");
            goto fail;
        }
        memset(more + nprocs, 0, 8 * sizeof(*procs));
        procs = more;
        nprocs += 8;
    }
    p = &procs[i];
    p->pid = pid;
    p->out[0] = -1;
    p->out[1] = po[0];
    p->out[2] = pe[0];
    p->in = pi[1];
    p->cap = cap;
    p->started_ns = now_ns();
    for (i = 0; i < cl.argc; i++)
        p->argv_len += strlen(cl.argv[i]) + 1;
    p->argv = malloc(p->argv_len);
    if (p->argv) {
        char *at = p->argv;
        for (i = 0; i < cl.argc; i++) {
            size_t n = strlen(cl.argv[i]) + 1;
            memcpy(at, cl.argv[i], n);
            at += n;
        }
    } else {
        p->argv_len = 0;
    }
    fcntl(po[0], F_SETFL, O_NONBLOCK);
    fcntl(pe[0], F_SETFL, O_NONBLOCK);
    if (p->in >= 0)
        fcntl(p->in, F_SETFL, O_NONBLOCK);
    begin(&out, A_OK, id);
    put_u64(&out, (uint64_t)pid);
    put_u64(&out, p->started_ns);
    send_msg(&out);
    goto done;
bad:
    send_err(id, EINVAL, "malformed proc_start request");
    goto done;
fail:
    close_pair(po);
    close_pair(pe);
    close_pair(pi);
    close_pair(perr);
done:
    free_cmdline(&cl);
}

static void do_proc_list(uint32_t id)
{
    uint64_t count = 0;

    for (size_t i = 0; i < nprocs; i++)
        count += procs[i].pid != 0;
    begin(&out, A_OK, id);
    put_u64(&out, count);
    for (size_t i = 0; i < nprocs; i++) {
        struct proc *p = &procs[i];

        if (!p->pid)
            continue;
        put_u64(&out, (uint64_t)p->pid);
        put_u64(&out, (uint64_t)p->exited);
        put_u64(&out, (uint64_t)(unsigned)p->status);
        put_u64(&out, p->written);
        put_u64(&out, proc_dropped(p));
        put_u64(&out, p->kept);
        put_u64(&out, p->in >= 0);
        put_u64(&out, p->in_received);
        put_u64(&out, p->started_ns);
        put_u64(&out, p->ended_ns);
        put_bytes(&out, p->argv ? p->argv : "", p->argv_len);
    }
    send_msg(&out);
}

static struct proc *proc_arg(uint32_t id, struct rd *r)
{
    uint64_t pid = get_u64(r);
    struct proc *p = r->bad ? NULL : proc_by_pid(pid);

    if (r->bad)
        send_err(id, EINVAL, "malformed proc request");
    else if (!p)
        send_err(id, ESRCH, "no such background process");
    return p;
}

static void do_proc_attach(uint32_t id, struct rd *r)
{
    struct proc *p = proc_arg(id, r);
    uint64_t offset = get_u64(r);

    if (!p)
        return;
    p->attached = 1;
    p->sent = offset;
    p->end_sent = 0;
    proc_push(p);
    begin(&out, A_OK, id);
    send_msg(&out);
}

/* The host sends an input again, at the same offset, when the channel went
 * before its answer (a pause, a daemon restart): what was taken before is
 * skipped, so nothing reaches the process twice. */
static void do_proc_input(uint32_t id, struct rd *r)
{
    struct proc *p = proc_arg(id, r);
    uint64_t offset = get_u64(r), eof = get_u64(r);
    size_t n = 0;
    const unsigned char *data = get_bytes(r, &n);

    if (!p)
        return;
    if (r->bad || offset > p->in_received) {
        send_err(id, EINVAL, "malformed proc_input request");
        return;
    }
    size_t skip = p->in_received - offset < n ? (size_t)(p->in_received - offset) : n;
    int fresh = n > skip || (eof && !p->in_eof);

    if (p->input_id) {
        send_err(id, EBUSY, "an input of this process is being written");
        return;
    }
    if (!fresh) { /* all of it was taken before: answered once it is in the pipe */
        p->input_id = id;
        if (!p->pend_len)
            proc_answer_input(p, 0);
        return;
    }
    if (p->in < 0) {
        send_err(id, EPIPE, "the process's stdin is closed");
        return;
    }
    if (n > skip) {
        unsigned char *more = realloc(p->pend, p->pend_len + (n - skip));
        if (!more) {
            send_err(id, ENOMEM, "hold the input");
            return;
        }
        memcpy(more + p->pend_len, data + skip, n - skip);
        p->pend = more;
        p->pend_len += n - skip;
        p->in_received += n - skip;
    }
    p->in_eof |= eof != 0;
    p->input_id = id;
    proc_flush_stdin(p);
}

static void do_proc_kill(uint32_t id, struct rd *r)
{
    struct proc *p = proc_arg(id, r);
    uint64_t sig = get_u64(r);

    if (!p)
        return;
    begin(&out, A_OK, id);
    put_u64(&out, !p->exited && kill(-p->pid, (int)sig) == 0); /* its group: it called setsid */
    send_msg(&out);
}

static void do_proc_forget(uint32_t id, struct rd *r)
{
    struct proc *p = proc_arg(id, r);

    if (!p)
        return;
    if (!p->exited) {
        send_err(id, EBUSY, "the process runs");
        return;
    }
    proc_free(p);
    begin(&out, A_OK, id);
    send_msg(&out);
}

/* ---- files ------------------------------------------------------------------ */

static int open_in_root(const char *path, int flags, mode_t mode)
{
    struct {
        uint64_t flags, mode, resolve;
    } how = {.flags = (uint64_t)(flags | O_CLOEXEC), .mode = mode,
             .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS};

    return (int)syscall(__NR_openat2, rootfd, path, &how, sizeof(how));
}

/* The parent dir of path (opened in root) and the last name; -1 on error. */
static int open_parent(const char *path, const char **name)
{
    const char *slash = strrchr(path, '/');
    char parent[4096];
    size_t n;

    if (!slash || !slash[1]) {
        errno = EINVAL;
        return -1;
    }
    n = (size_t)(slash - path);
    if (n >= sizeof(parent)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(parent, path, n);
    parent[n] = 0;
    *name = slash + 1;
    return open_in_root(n ? parent : "/", O_PATH | O_DIRECTORY, 0);
}

/* A timespec of `field`, signed nanoseconds since the epoch in a u64 (two's
 * complement: before 1970 is negative), as the host sends an mtime. */
static struct timespec ns_time(uint64_t field)
{
    int64_t ns = (int64_t)field, sec = ns / 1000000000, nsec = ns % 1000000000;

    if (nsec < 0) { /* C truncates toward zero; tv_nsec must be 0..10^9-1 */
        sec -= 1;
        nsec += 1000000000;
    }
    return (struct timespec){.tv_sec = (time_t)sec, .tv_nsec = (long)nsec};
}

static const char *type_of(mode_t m)
{
    return S_ISREG(m) ? "file" : S_ISDIR(m) ? "dir" : S_ISLNK(m) ? "symlink" : S_ISCHR(m) ? "char"
         : S_ISBLK(m) ? "block" : S_ISFIFO(m) ? "fifo" : S_ISSOCK(m) ? "socket" : "unknown";
}

/* A file's stat fields: type, size, mode, uid, gid, mtime. The mtime with
 * `ts` (STAT_TS, LIST_TS): signed seconds, then its nanoseconds (0 to
 * 10^9-1), any time a time_t holds; else signed nanoseconds, which 64 bits
 * hold from 1677-09-21 to 2262-04-11 only (a time past them wraps), for a
 * host that asks for no other form. */
static void put_stat(struct buf *b, const struct stat *st, int ts)
{
    put_str(b, type_of(st->st_mode));
    put_u64(b, (uint64_t)st->st_size);
    put_u64(b, st->st_mode & 07777);
    put_u64(b, st->st_uid);
    put_u64(b, st->st_gid);
    if (ts) {
        put_u64(b, (uint64_t)(int64_t)st->st_mtim.tv_sec);
        put_u64(b, (uint64_t)st->st_mtim.tv_nsec);
    } else {
        put_u64(b, (uint64_t)st->st_mtim.tv_sec * 1000000000ull + (uint64_t)st->st_mtim.tv_nsec);
    }
}

/* Only regular files are read or written: a FIFO would block the agent, a
 * device or a kernel file is no file of the sandbox's. */
static int require_regular(int fd, struct stat *st)
{
    if (fstat(fd, st) < 0)
        return -1;
    if (!S_ISREG(st->st_mode)) {
        errno = S_ISDIR(st->st_mode) ? EISDIR : EINVAL;
        return -1;
    }
    return 0;
}

static void do_read(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t off = get_u64(r), len = get_u64(r);
    struct stat st;
    int fd = -1;

    if (r->bad || len > MAX_MSG) {
        send_err(id, EINVAL, "malformed read request");
        goto done;
    }
    fd = open_in_root(path, O_RDONLY | O_NONBLOCK, 0);
    if (fd < 0 || require_regular(fd, &st) < 0) {
        send_err(id, errno, "open");
        goto done;
    }
    begin(&out, A_OK, id);
    put_u64(&out, (uint64_t)st.st_size);
    buf_need(&out, 4 + len);
    size_t at = out.len;
    put_u32(&out, 0);
    ssize_t n = len ? pread(fd, out.p + out.len, len, (off_t)off) : 0;
    if (n < 0) {
        send_err(id, errno, "read");
        goto done;
    }
    out.len += (size_t)n;
    out.p[at] = (unsigned char)(n >> 24);
    out.p[at + 1] = (unsigned char)(n >> 16);
    out.p[at + 2] = (unsigned char)(n >> 8);
    out.p[at + 3] = (unsigned char)n;
    send_msg(&out);
done:
    if (fd >= 0)
        close(fd);
    free(path);
}

static void die(const char *what);

/* What this process creates from now on belongs to uid:gid (a file
 * request's owner; 0:0 gives it back to root), with root's access kept:
 * moving the fs uid away from 0 clears CAP_DAC_OVERRIDE & co. from the
 * effective set, so they are raised again from the permitted set (as the
 * host's dsec_fsids_set does for a thread). */
static int owner_set(uint32_t uid, uint32_t gid)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2];

    syscall(SYS_setfsgid, gid);
    syscall(SYS_setfsuid, uid);
    if ((uint32_t)syscall(SYS_setfsgid, -1) != gid || (uint32_t)syscall(SYS_setfsuid, -1) != uid) {
        errno = EPERM;
        return -1;
    }
    if (syscall(SYS_capget, &hdr, data) < 0)
        return -1;
    data[0].effective = data[0].permitted;
    data[1].effective = data[1].permitted;
    return syscall(SYS_capset, &hdr, data) < 0 ? -1 : 0;
}

/* A file request's owner, after its other fields (an agent before version 5
 * took none: the host sends it only when it is not root): 0 with *uid and
 * *gid set, or 0 with them 0 when the request has none; -1 if malformed. */
static int get_owner(struct rd *r, uint32_t *uid, uint32_t *gid)
{
    *uid = *gid = 0;
    if (r->p == r->end)
        return 0;
    uint64_t u = get_u64(r), g = get_u64(r);

    if (r->bad || u > UINT32_MAX - 1 || g > UINT32_MAX - 1)
        return -1;
    *uid = (uint32_t)u;
    *gid = (uint32_t)g;
    return 0;
}

static int mkdir_parents(const char *path)
{
    char p[4096];
    size_t n = strlen(path);

    if (n >= sizeof(p)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(p, path, n + 1);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = 0;
        const char *name;
        int dfd = open_parent(p, &name);
        if (dfd < 0)
            return -1;
        int rc = mkdirat(dfd, name, 0755);
        int err = errno;
        close(dfd);
        if (rc < 0 && err != EEXIST) {
            errno = err;
            return -1;
        }
        *s = '/';
    }
    return 0;
}

static void do_write(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t flags = get_u64(r), mode = get_u64(r), off = get_u64(r);
    size_t n = 0;
    const unsigned char *data = get_bytes(r, &n);
    struct stat st;
    int fd = -1;
    uint32_t uid = 0, gid = 0;

    if (r->bad || get_owner(r, &uid, &gid) < 0) {
        send_err(id, EINVAL, "malformed write request");
        goto done;
    }
    if ((uid || gid) && owner_set(uid, gid) < 0) {
        send_err(id, errno, "take the owner's ids");
        goto done;
    }
    if ((flags & WRITE_PARENTS) && mkdir_parents(path) < 0) {
        send_err(id, errno, "make parents");
        goto done;
    }
    fd = open_in_root(path, O_WRONLY | O_CREAT | O_NONBLOCK | ((flags & WRITE_APPEND) ? O_APPEND : 0),
                      (mode_t)(mode & 07777));
    if (fd < 0 || require_regular(fd, &st) < 0) {
        send_err(id, errno, "open");
        goto done;
    }
    if (!(flags & (WRITE_KEEP | WRITE_APPEND)) && ftruncate(fd, 0) < 0) {
        send_err(id, errno, "truncate");
        goto done;
    }
    if (off != UINT64_MAX && lseek(fd, (off_t)off, SEEK_SET) < 0) {
        send_err(id, errno, "seek");
        goto done;
    }
    while (n) {
        ssize_t w = write(fd, data, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            send_err(id, errno, "write");
            goto done;
        }
        data += w;
        n -= (size_t)w;
    }
    fstat(fd, &st);
    begin(&out, A_OK, id);
    put_u64(&out, (uint64_t)st.st_size);
    send_msg(&out);
done:
    if (fd >= 0)
        close(fd);
    if ((uid || gid) && owner_set(0, 0) < 0)
        die("give root's fs ids back after a write");
    free(path);
}

static void do_stat(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t flags = r->p < r->end ? get_u64(r) : 0; /* an older host sends none */
    struct stat st;
    int fd = -1;

    if (r->bad) {
        send_err(id, EINVAL, "malformed stat request");
        goto done;
    }
    fd = open_in_root(path, O_PATH | (flags & STAT_FOLLOW ? 0 : O_NOFOLLOW), 0);
    if (fd < 0 || fstat(fd, &st) < 0) {
        send_err(id, errno, "stat");
        goto done;
    }
    begin(&out, A_OK, id);
    put_stat(&out, &st, (flags & STAT_TS) != 0);
    /* Then its device and inode numbers: the host records a temporary a
     * copy made by them, and a restarted daemon removes what a path names
     * only if it is still that file (an older host reads no further). */
    put_u64(&out, (uint64_t)st.st_dev);
    put_u64(&out, (uint64_t)st.st_ino);
    if (S_ISLNK(st.st_mode)) {
        /* A symlink's text, as a container's stat gives it (`dsec cp -r
         * SB:/link` makes the same link): readlinkat of the O_PATH fd with
         * an empty name reads this very link, not one a path resolves to. */
        char target[PATH_MAX];
        ssize_t n = readlinkat(fd, "", target, sizeof(target));

        if (n < 0 || n == (ssize_t)sizeof(target)) {
            send_err(id, n < 0 ? errno : ENAMETOOLONG, "readlink");
            goto done;
        }
        put_bytes(&out, target, (size_t)n);
    }
    send_msg(&out);
done:
    if (fd >= 0)
        close(fd);
    free(path);
}

/* Entries of dir fd into out, names prefixed; recursion down to depth;
 * `ts`: their mtimes as put_stat's seconds and nanoseconds. */
static int list_into(int fd, const char *prefix, uint64_t depth, int ts, uint64_t *count)
{
    DIR *d = fdopendir(fd);
    struct dirent *e;

    if (!d) {
        close(fd);
        return -1;
    }
    while ((e = readdir(d))) {
        struct stat st;
        char name[4096];

        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (*count >= MAX_LIST)
            break;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue; /* gone meanwhile */
        snprintf(name, sizeof(name), "%s%s", prefix, e->d_name);
        put_str(&out, name);
        put_stat(&out, &st, ts);
        (*count)++;
        if (depth > 1 && S_ISDIR(st.st_mode)) {
            int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            char pre[4096];

            snprintf(pre, sizeof(pre), "%s/", name);
            if (sub >= 0)
                list_into(sub, pre, depth - 1, ts, count);
        }
    }
    closedir(d);
    return 0;
}

static void do_list(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t depth = get_u64(r), count = 0;
    uint64_t flags = r->p < r->end ? get_u64(r) : 0; /* an older host sends none */
    int fd;

    if (r->bad || depth < 1 || depth > 64) {
        send_err(id, EINVAL, "malformed list request");
        goto done;
    }
    fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) {
        send_err(id, errno, "open");
        goto done;
    }
    begin(&out, A_OK, id);
    list_into(fd, "", depth, (flags & LIST_TS) != 0, &count);
    put_u64(&out, count);     /* the count last: the host reads entries until it */
    put_u64(&out, count >= MAX_LIST);
    send_msg(&out);
done:
    free(path);
}

static void do_mkdir(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t parents = get_u64(r), mode = get_u64(r);
    const char *name;
    int dfd = -1, created = 1;
    uint32_t uid = 0, gid = 0;

    if (r->bad || get_owner(r, &uid, &gid) < 0) {
        send_err(id, EINVAL, "malformed mkdir request");
        goto done;
    }
    if ((uid || gid) && owner_set(uid, gid) < 0) {
        send_err(id, errno, "take the owner's ids");
        goto done;
    }
    if (parents && mkdir_parents(path) < 0) {
        send_err(id, errno, "make parents");
        goto done;
    }
    dfd = open_parent(path, &name);
    if (dfd < 0) {
        send_err(id, errno, "open parent");
        goto done;
    }
    if (mkdirat(dfd, name, (mode_t)(mode & 07777)) < 0) {
        struct stat st;

        if (!(parents && errno == EEXIST && fstatat(dfd, name, &st, 0) == 0 && S_ISDIR(st.st_mode))) {
            send_err(id, errno, "mkdir");
            goto done;
        }
        created = 0;
    }
    begin(&out, A_OK, id);
    put_u64(&out, (uint64_t)created);
    send_msg(&out);
done:
    if (dfd >= 0)
        close(dfd);
    if ((uid || gid) && owner_set(0, 0) < 0)
        die("give root's fs ids back after a mkdir");
    free(path);
}

/* chmod and/or the times of a file or directory, through its O_PATH fd (a
 * symlink at its last name followed only with SETATTR_FOLLOW;
 * RESOLVE_IN_ROOT). The mtime: signed nanoseconds, which end in 1677 and
 * 2262, or with SETATTR_TS signed seconds and nanoseconds apart. */
static void do_setattr(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t flags = get_u64(r), mode = get_u64(r), mtime = get_u64(r);
    uint64_t nsec = flags & SETATTR_TS ? get_u64(r) : 0;
    char proc[64];
    struct stat st;
    int fd = -1;

    if (r->bad || nsec >= 1000000000u) {
        send_err(id, EINVAL, "malformed setattr request");
        goto done;
    }
    fd = open_in_root(path, O_PATH | (flags & SETATTR_FOLLOW ? 0 : O_NOFOLLOW), 0);
    if (fd < 0 || fstat(fd, &st) < 0) {
        send_err(id, errno, "open");
        goto done;
    }
    if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        send_err(id, S_ISLNK(st.st_mode) ? ELOOP : EINVAL, "not a file or directory");
        goto done;
    }
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    if ((flags & SETATTR_MODE) && chmod(proc, (mode_t)(mode & 07777)) < 0) {
        send_err(id, errno, "chmod");
        goto done;
    }
    if (flags & SETATTR_MTIME) {
        struct timespec t = flags & SETATTR_TS ? (struct timespec){.tv_sec = (time_t)(int64_t)mtime,
                                                                   .tv_nsec = (long)nsec}
                                               : ns_time(mtime);
        struct timespec ts[2] = {t, t};

        if (utimensat(AT_FDCWD, proc, ts, 0) < 0) {
            send_err(id, errno, "utimensat");
            goto done;
        }
    }
    begin(&out, A_OK, id);
    send_msg(&out);
done:
    if (fd >= 0)
        close(fd);
    free(path);
}

/* Remove name in dfd, a whole tree if recursive; counts entries removed. */
static int remove_at(int dfd, const char *name, int recursive, uint64_t *count)
{
    struct stat st;

    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(dfd, name, 0) < 0)
            return -1;
        (*count)++;
        return 0;
    }
    if (recursive) {
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *d = fd < 0 ? NULL : fdopendir(fd);
        struct dirent *e;

        if (!d) {
            if (fd >= 0)
                close(fd);
            return -1;
        }
        while ((e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
                remove_at(dirfd(d), e->d_name, 1, count) < 0) {
                int err = errno;
                closedir(d);
                errno = err;
                return -1;
            }
        closedir(d);
    }
    if (unlinkat(dfd, name, AT_REMOVEDIR) < 0)
        return -1;
    (*count)++;
    return 0;
}

static void do_remove(uint32_t id, struct rd *r)
{
    char *path = get_str(r);
    uint64_t recursive = get_u64(r), count = 0;
    const char *name;
    int dfd = -1;

    if (r->bad) {
        send_err(id, EINVAL, "malformed remove request");
        goto done;
    }
    dfd = open_parent(path, &name);
    if (dfd < 0 || remove_at(dfd, name, recursive != 0, &count) < 0) {
        send_err(id, errno, "remove");
        goto done;
    }
    begin(&out, A_OK, id);
    put_u64(&out, count);
    send_msg(&out);
done:
    if (dfd >= 0)
        close(dfd);
    free(path);
}

static void do_rename(uint32_t id, struct rd *r)
{
    char *src = get_str(r), *dst = get_str(r);
    uint64_t flags = get_u64(r);
    const char *sn, *dn;
    int sfd = -1, dfd = -1;

    if (r->bad) {
        send_err(id, EINVAL, "malformed rename request");
        goto done;
    }
    sfd = open_parent(src, &sn);
    dfd = sfd < 0 ? -1 : open_parent(dst, &dn);
    if (sfd >= 0 && dfd >= 0 && (flags & RENAME_KEEP_ATTRS)) {
        struct stat old, neu;

        if (fstatat(dfd, dn, &old, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(old.st_mode) &&
            fstatat(sfd, sn, &neu, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(neu.st_mode)) {
            fchownat(sfd, sn, old.st_uid, old.st_gid, AT_SYMLINK_NOFOLLOW);
            fchmodat(sfd, sn, old.st_mode & 07777, 0);
        }
    }
    if (sfd < 0 || dfd < 0 ||
        syscall(SYS_renameat2, sfd, sn, dfd, dn, (flags & RENAME_OVERWRITE) ? 0 : RENAME_NOREPLACE) < 0) {
        send_err(id, errno, "rename");
        goto done;
    }
    begin(&out, A_OK, id);
    send_msg(&out);
done:
    if (sfd >= 0)
        close(sfd);
    if (dfd >= 0)
        close(dfd);
    free(src);
    free(dst);
}

/* The sandbox this guest serves, for the console log (HELLO names it). */
static char sandbox_id[64] = "";

/* The host's first message after a boot or a restore: the sandbox's identity.
 * A VM restored from a template snapshot is a copy of the template's memory,
 * so everything a boot would make unique is made so again here:
 *   - the hostname;
 *   - the clock (a restored guest's clock is the snapshot's; a resumed one's
 *     is the pause's);
 *   - the kernel's random state: the host's seed is mixed into the input
 *     pool (credited: it comes from the host's getrandom) and the CRNG is
 *     reseeded from it at once (RNDRESEEDCRNG). Without the reseed every
 *     copy would go on producing the template's CRNG stream until the
 *     kernel's next scheduled reseed, up to minutes later;
 *   - the sandbox id, kept for the console log.
 * The boot id (/proc/sys/kernel/random/boot_id) is made on its first read,
 * which nothing does before the template is snapshotted, so each copy makes
 * its own from its reseeded CRNG. */
static void do_hello(uint32_t id, struct rd *r)
{
    char *host = get_str(r);
    uint64_t now_ns = get_u64(r);
    size_t n = 0;
    const unsigned char *seed = get_bytes(r, &n);
    char *sb = r->p < r->end ? get_str(r) : NULL; /* an older host sends no sandbox id */
    /* 1: the host that started the running execs says HELLO again (a job
     * resume) and still follows them; else (0, or an older host: absent)
     * they are another host's. */
    uint64_t keeps_execs = r->p < r->end ? get_u64(r) : 0;

    if (!r->bad) {
        struct timespec ts = {.tv_sec = (time_t)(now_ns / 1000000000ull),
                              .tv_nsec = (long)(now_ns % 1000000000ull)};
        if (host[0])
            sethostname(host, strlen(host));
        if (now_ns)
            clock_settime(CLOCK_REALTIME, &ts);
        if (n && n <= 512) {
            struct {
                int entropy_count, buf_size;
                unsigned char buf[512];
            } e = {.entropy_count = (int)n * 8, .buf_size = (int)n};
            int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);

            memcpy(e.buf, seed, n);
            if (fd >= 0) {
                if (ioctl(fd, RNDADDENTROPY, &e) < 0 || ioctl(fd, RNDRESEEDCRNG) < 0)
                    say("reseed the kernel's random generator: %s", strerror(errno));
                close(fd);
            }
        }
        detach_procs(); /* a new host: it attaches to the background processes it follows */
        if (!keeps_execs) {
            orphan_execs();
            end_orphaned_puts();
        }
        if (sb && sb[0] && strcmp(sb, sandbox_id)) {
            snprintf(sandbox_id, sizeof(sandbox_id), "%s", sb);
            say("serving sandbox %s", sandbox_id);
        }
    }
    free(host);
    free(sb);
    begin(&out, A_READY, id);
    put_str(&out, "dsec-guest-agent " STR(AGENT_VERSION));
    send_msg(&out);
}

/* Interface flags on (set) or off: SIOCGIFFLAGS, SIOCSIFFLAGS. */
static int if_flags(int s, const char *name, short set)
{
    struct ifreq ifr;

    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        return -1;
    ifr.ifr_flags |= set;
    return ioctl(s, SIOCSIFFLAGS, &ifr);
}

static void put_in(struct sockaddr *sa, uint32_t addr)
{
    struct sockaddr_in *in = (struct sockaddr_in *)sa;

    memset(in, 0, sizeof(*in));
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(addr);
}

static void write_proc(const char *path, const char *value)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);

    if (fd >= 0) {
        ssize_t ignored = write(fd, value, strlen(value));
        (void)ignored;
        close(fd);
    }
}

/* One sysctl under /proc/sys/net/ipv6/conf/<dev>/; -1 (errno set) if it
 * cannot be written. */
static int ipv6_conf(const char *dev, const char *key, const char *value)
{
    char path[128];
    int fd, rc;

    snprintf(path, sizeof(path), "/proc/sys/net/ipv6/conf/%s/%s", dev, key);
    fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    rc = write(fd, value, strlen(value)) == (ssize_t)strlen(value) ? 0 : -1;
    close(fd);
    return rc;
}

/* struct in6_ifreq of <linux/ipv6.h>, which does not mix with libc's headers. */
struct in6_ifreq_ {
    struct in6_addr addr;
    uint32_t prefixlen;
    int ifindex;
};

/* IPv6 on `nic` as the host leased it: no router advertisements or SLAAC
 * (the host routes, nobody advertises), no duplicate address detection (the
 * lease is the VM's alone: the address works at once), the link-local
 * address from the MAC (EUI-64: the one the host's tap program lets do
 * neighbor discovery). Run before the NIC goes up, so the kernel never
 * solicits a router or runs DAD; net_ipv6_addr adds the address and the
 * default route through the bridge's gateway once it is up. Returns the
 * failed step or NULL. */
static const char *net_ipv6_conf(const char *nic)
{
    static const char *const keys[][2] = {
        {"accept_ra", "0"}, {"autoconf", "0"}, {"accept_dad", "0"}, {"router_solicitations", "0"},
        {"addr_gen_mode", "0"}, {"disable_ipv6", "0"},
    };
    const char *const devs[] = {"all", "default", nic};

    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
        for (size_t d = 0; d < 3; d++)
            /* addr_gen_mode is per device only (its "all" cannot be written on older kernels) */
            if (ipv6_conf(devs[d], keys[k][0], keys[k][1]) < 0 && (d == 2 || strcmp(keys[k][0], "addr_gen_mode"))) {
                static char step[80];

                snprintf(step, sizeof(step), "set net.ipv6.conf.%s.%s", devs[d], keys[k][0]);
                return step;
            }
    return NULL;
}

/* The NIC's IPv6 addresses and default route, once it is up: the
 * link-local one from the MAC (modified EUI-64, RFC 4291 appendix A; the
 * kernel makes the same one when it sees the link turn ready, but on VMs
 * restored from a template it often made none, so it is added here either
 * way), the leased one, the route through the gateway.
 * Returns the failed step or NULL. */
static const char *net_ipv6_addr(const char *nic, const unsigned char *mac, const unsigned char *addr,
                                 uint64_t plen, const unsigned char *gw)
{
    static const unsigned char ll_prefix[8] = {0xfe, 0x80};
    struct in6_ifreq_ ifr6;
    struct in6_rtmsg rt6;
    unsigned char ll[16];
    int s = socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);

    if (s < 0)
        return "open an IPv6 socket";
    memcpy(ll, ll_prefix, 8);
    ll[8] = mac[0] ^ 2;
    ll[9] = mac[1];
    ll[10] = mac[2];
    ll[11] = 0xff;
    ll[12] = 0xfe;
    ll[13] = mac[3];
    ll[14] = mac[4];
    ll[15] = mac[5];
    memset(&ifr6, 0, sizeof(ifr6));
    ifr6.ifindex = (int)if_nametoindex(nic);
    memcpy(&ifr6.addr, ll, 16);
    ifr6.prefixlen = 64;
    if (ioctl(s, SIOCSIFADDR, &ifr6) < 0 && errno != EEXIST) {
        int err = errno;
        close(s);
        errno = err;
        return "set the IPv6 link-local address";
    }
    memcpy(&ifr6.addr, addr, 16);
    ifr6.prefixlen = (uint32_t)plen;
    if (ioctl(s, SIOCSIFADDR, &ifr6) < 0 && errno != EEXIST) {
        int err = errno;
        close(s);
        errno = err;
        return "set the IPv6 address";
    }
    memset(&rt6, 0, sizeof(rt6));
    memcpy(&rt6.rtmsg_gateway, gw, 16);
    rt6.rtmsg_type = 1; /* RTN_UNICAST */
    rt6.rtmsg_flags = RTF_UP | RTF_GATEWAY;
    rt6.rtmsg_ifindex = ifr6.ifindex;
    if (ioctl(s, SIOCADDRT, &rt6) < 0 && errno != EEXIST) {
        int err = errno;
        close(s);
        errno = err;
        return "add the default IPv6 route";
    }
    close(s);
    return NULL;
}

/* The guest's one NIC (virtio-net, the only interface but lo), as the host
 * says: its MAC (the host's tap program drops frames from any other), its
 * IPv4 address, the default route through the bridge's gateway, its MTU;
 * with an IPv6 lease (three more fields) its IPv6 address and default route
 * too (net_ipv6_conf). Without one, no IPv6: the tap program drops it, so
 * the kernel is told not to try (no link-local address, no router
 * solicitations). Asked after every boot or restore of a VM with
 * networking; a resumed VM keeps what it had. */
static void do_net(uint32_t id, struct rd *r)
{
    size_t maclen = 0, a6len = 0, g6len = 0;
    const unsigned char *mac = get_bytes(r, &maclen);
    uint64_t addr = get_u64(r), plen = get_u64(r), gw = get_u64(r), mtu = get_u64(r);
    const unsigned char *addr6 = NULL, *gw6 = NULL;
    uint64_t plen6 = 0;
    struct if_nameindex *names = NULL, *ni;
    const char *step = "socket";
    char nic[IFNAMSIZ] = "";
    struct ifreq ifr;
    struct rtentry rt;
    int s = -1;

    if (!r->bad && r->p < r->end) {
        addr6 = get_bytes(r, &a6len);
        plen6 = get_u64(r);
        gw6 = get_bytes(r, &g6len);
        if (a6len != 16 || g6len != 16 || plen6 > 128)
            r->bad = 1;
    }
    if (r->bad || maclen != 6 || plen > 32 || addr > 0xffffffffu || gw > 0xffffffffu) {
        send_err(id, EINVAL, "malformed net request");
        return;
    }
    s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        goto fail;
    step = "find the NIC";
    names = if_nameindex();
    for (ni = names; ni && ni->if_index; ni++)
        if (strcmp(ni->if_name, "lo")) {
            snprintf(nic, sizeof(nic), "%s", ni->if_name);
            break;
        }
    if (!nic[0]) {
        errno = ENODEV;
        goto fail;
    }
    if (!addr6) {
        write_proc("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1");
        write_proc("/proc/sys/net/ipv6/conf/default/disable_ipv6", "1");
        ipv6_conf(nic, "disable_ipv6", "1");
    }
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", nic);
    ifr.ifr_hwaddr.sa_family = ARPHRD_ETHER;
    memcpy(ifr.ifr_hwaddr.sa_data, mac, 6);
    step = "set the MAC";
    if (ioctl(s, SIOCSIFHWADDR, &ifr) < 0)
        goto fail;
    ifr.ifr_mtu = (int)mtu;
    step = "set the MTU";
    if (mtu && ioctl(s, SIOCSIFMTU, &ifr) < 0)
        goto fail;
    /* after the MAC: the link-local address is made from it when IPv6 comes on */
    if (addr6 && (step = net_ipv6_conf(nic)) != NULL)
        goto fail;
    put_in(&ifr.ifr_addr, (uint32_t)addr);
    step = "set the address";
    if (ioctl(s, SIOCSIFADDR, &ifr) < 0)
        goto fail;
    put_in(&ifr.ifr_netmask, plen ? (uint32_t)(0xffffffffu << (32 - plen)) : 0);
    step = "set the netmask";
    if (ioctl(s, SIOCSIFNETMASK, &ifr) < 0)
        goto fail;
    step = "set the NIC up";
    if (if_flags(s, nic, IFF_UP | IFF_RUNNING) < 0)
        goto fail;
    memset(&rt, 0, sizeof(rt));
    put_in(&rt.rt_dst, 0);
    put_in(&rt.rt_genmask, 0);
    put_in(&rt.rt_gateway, (uint32_t)gw);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    step = "add the default route";
    if (ioctl(s, SIOCADDRT, &rt) < 0 && errno != EEXIST)
        goto fail;
    if (addr6 && (step = net_ipv6_addr(nic, mac, addr6, plen6, gw6)) != NULL)
        goto fail;
    if_freenameindex(names);
    close(s);
    say("network: %s up%s", nic, addr6 ? " (IPv4, IPv6)" : "");
    begin(&out, A_OK, id);
    put_str(&out, nic);
    send_msg(&out);
    return;
fail:
    {
        int err = errno;
        char what[96];

        snprintf(what, sizeof(what), "%s%s%s", step, nic[0] ? " of " : "", nic);
        if (names)
            if_freenameindex(names);
        if (s >= 0)
            close(s);
        send_err(id, err, what);
    }
}

/* ---- the writable layer as a tar (M_TAR) ------------------------------------ */

/* The upper dir of the overlay, as a POSIX tar (ustar headers, a pax header
 * where a name, link or size does not fit ustar's fields, or an xattr goes
 * along), streamed in DATA frames; the host unpacks it and builds an image
 * layer from it (dsecd/fs/uppertar.py). What overlayfs keeps there goes
 * as it is: whiteouts (0:0 character devices) and opaque directories (the
 * xattr trusted.overlay.opaque). Other xattrs: tar_xattr_kept. A file,
 * FIFO or symlink of more than one link goes whole under the first of its
 * names the walk meets and as a tar hard link ('1') to that name under every
 * other, so the layer keeps one inode and its link count, as mkfs.erofs
 * keeps those of a container's upper dir (whiteouts are not grouped:
 * overlayfs makes them links of one shared inode). Sockets
 * and devices other than whiteouts are skipped (counted). Every process but
 * this one is frozen meanwhile (hold_still), so the tree does not change
 * under the walk. */

struct tarw {
    uint32_t id;
    struct buf data;    /* a DATA frame being filled */
    uint64_t max_bytes, file_bytes, entries, skipped;
    int err;
    char what[160];
    int outfd;          /* >= 0: the bytes go there (a directory copy's stdout), not in DATA frames */
    int copy;           /* a directory copy (tar_get_main): its rules, not the writable layer's */
    uint64_t max_entries, copied; /* a copy's limit and its entries (headers, pax ones too, are `entries`) */
    char **skip;        /* paths of the writable layer left out, with all below them (a snapshot's excludes) */
    size_t nskip;
    struct tar_link *links; /* inodes of several links: the first name each was sent under */
    size_t nlinks, links_cap; /* an open-addressed table, a power of two, at most half full */
};

struct tar_link {
    dev_t dev;
    ino_t ino;
    char *name; /* NULL: a free slot */
};

#define TAR_FRAME (256u << 10)
#define MAX_SKIP (1u << 20) /* paths a snapshot may leave out (each is a string of the request's frame) */

/* Send the DATA frame filled so far (if it holds any bytes), start the next. */
static void tar_send(struct tarw *t)
{
    uint32_t blen = t->data.len > 13 ? (uint32_t)(t->data.len - 13) : 0;

    if (blen && t->outfd >= 0) {
        write_all(t->outfd, t->data.p + 13, blen);
    } else if (blen) {
        t->data.p[9] = (unsigned char)(blen >> 24); /* the byte string's length */
        t->data.p[10] = (unsigned char)(blen >> 16);
        t->data.p[11] = (unsigned char)(blen >> 8);
        t->data.p[12] = (unsigned char)blen;
        send_msg(&t->data);
    }
    begin(&t->data, A_DATA, t->id);
    put_u32(&t->data, 0);
}

static void tar_put(struct tarw *t, const void *p, size_t n)
{
    const unsigned char *c = p;

    while (n) {
        size_t room = 13 + TAR_FRAME - t->data.len, k = n < room ? n : room;

        buf_need(&t->data, k);
        memcpy(t->data.p + t->data.len, c, k);
        t->data.len += k;
        c += k;
        n -= k;
        if (t->data.len >= 13 + TAR_FRAME)
            tar_send(t);
    }
}

static void octal(char *field, size_t width, uint64_t v)
{
    /* width - 1 digits and a NUL, zero-padded */
    field[width - 1] = 0;
    for (size_t i = width - 1; i-- > 0; v >>= 3)
        field[i] = (char)('0' + (v & 7));
}

/* One pax record: "<len> key=value\n", len counting itself. */
static void pax_record(struct buf *b, const char *key, const void *val, size_t vlen)
{
    size_t base = strlen(key) + vlen + 3, len = base + 1;
    char num[24];

    while ((size_t)snprintf(num, sizeof(num), "%zu", len) + base != len)
        len = (size_t)snprintf(num, sizeof(num), "%zu", len) + base;
    buf_need(b, len);
    b->len += (size_t)sprintf((char *)b->p + b->len, "%s %s=", num, key);
    memcpy(b->p + b->len, val, vlen);
    b->len += vlen;
    b->p[b->len++] = '\n';
}

static void tar_header(struct tarw *t, const char *name, char type, const struct stat *st, uint64_t size,
                       const char *link, const struct buf *pax_extra)
{
    unsigned char h[512];
    struct buf pax = {0};
    size_t nlen = strlen(name), llen = link ? strlen(link) : 0;
    unsigned sum = 0;

    if (nlen > 99)
        pax_record(&pax, "path", name, nlen);
    if (llen > 99)
        pax_record(&pax, "linkpath", link, llen);
    if (size > 077777777777ull) {
        char num[24];
        int k = snprintf(num, sizeof(num), "%llu", (unsigned long long)size);
        pax_record(&pax, "size", num, (size_t)k);
    }
    /* Whole seconds in the header (toward zero, as the container backend's
     * copy stores them: Python's int(st_mtime)). A copy out's mtime with a
     * fraction also goes as a pax record of its exact decimal, as GNU tar
     * writes it (and the container backend: tarsafe.set_mtime_ns); one of
     * whole seconds gets none, a pax header costing 1 KiB of the stream.
     * The writable layer's tar keeps whole seconds. One that ustar's
     * unsigned field cannot hold (before 1970) as a pax record, as Python's
     * tarfile writes it. */
    long long mtime = (long long)st->st_mtim.tv_sec + (st->st_mtim.tv_sec < 0 && st->st_mtim.tv_nsec > 0);

    if (t->copy && st->st_mtim.tv_nsec > 0) {
        /* tv_sec + tv_nsec / 10^9, e.g. -2 s + 0.5 s as -1.5 */
        int neg = st->st_mtim.tv_sec < 0;
        unsigned long long sec = neg ? (unsigned long long)-(st->st_mtim.tv_sec + 1)
                                     : (unsigned long long)st->st_mtim.tv_sec;
        long nsec = neg ? 1000000000L - st->st_mtim.tv_nsec : st->st_mtim.tv_nsec;
        char num[40];
        int k = snprintf(num, sizeof(num), "%s%llu.%09ld", neg ? "-" : "", sec, nsec);

        while (num[k - 1] == '0')
            k--;
        pax_record(&pax, "mtime", num, (size_t)k);
    } else if (mtime < 0 || mtime > 077777777777ll) {
        char num[24];
        int k = snprintf(num, sizeof(num), "%lld", mtime);
        pax_record(&pax, "mtime", num, (size_t)k);
    }
    if (st->st_uid > 07777777 || st->st_gid > 07777777) {
        char num[24];
        int k = snprintf(num, sizeof(num), "%u", (unsigned)st->st_uid);
        pax_record(&pax, "uid", num, (size_t)k);
        k = snprintf(num, sizeof(num), "%u", (unsigned)st->st_gid);
        pax_record(&pax, "gid", num, (size_t)k);
    }
    if (pax_extra && pax_extra->len) {
        buf_need(&pax, pax_extra->len);
        memcpy(pax.p + pax.len, pax_extra->p, pax_extra->len);
        pax.len += pax_extra->len;
    }
    if (pax.len) {
        struct stat pst = {.st_mode = 0644};
        size_t pad = (512 - pax.len % 512) % 512;

        tar_header(t, "././@PaxHeader", 'x', &pst, pax.len, NULL, NULL);
        tar_put(t, pax.p, pax.len);
        memset(h, 0, sizeof(h));
        tar_put(t, h, pad);
        free(pax.p);
    }
    memset(h, 0, sizeof(h));
    memcpy(h, name, nlen > 99 ? 99 : nlen);
    octal((char *)h + 100, 8, st->st_mode & 07777);
    octal((char *)h + 108, 8, st->st_uid & 07777777);
    octal((char *)h + 116, 8, st->st_gid & 07777777);
    octal((char *)h + 124, 12, size > 077777777777ull ? 0 : size);
    octal((char *)h + 136, 12, mtime < 0 ? 0 : (uint64_t)mtime & 077777777777ull);
    memset(h + 148, ' ', 8);
    h[156] = (unsigned char)type;
    if (link)
        memcpy(h + 157, link, llen > 99 ? 99 : llen);
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    if (type == '3' || type == '4') {
        octal((char *)h + 329, 8, major(st->st_rdev));
        octal((char *)h + 337, 8, minor(st->st_rdev));
    }
    for (int i = 0; i < 512; i++)
        sum += h[i];
    octal((char *)h + 148, 7, sum);
    h[155] = ' ';
    tar_put(t, h, 512);
    t->entries++;
}

/* Whether xattr `x` of the writable layer goes in its tar: what mkfs.erofs
 * keeps of a container's upper (user.*, trusted.*, security.capability)
 * and the opaque mark, but overlayfs's other trusted.overlay.* (origin,
 * impure, redirect, ...: this overlay's bookkeeping, which an overlay
 * having the layer as a lower layer would act on). */
static int tar_xattr_kept(const char *x)
{
    if (!strncmp(x, "trusted.overlay.", 16))
        return !strcmp(x, "trusted.overlay.opaque");
    return !strncmp(x, "user.", 5) || !strncmp(x, "trusted.", 8) || !strcmp(x, "security.capability");
}

/* The names of fd's xattrs (NUL-separated, *len bytes in all), malloc'ed;
 * NULL with *len 0 when it has none or they cannot be read. Sized by the
 * kernel, not by a buffer of ours: a list or value past one was dropped. */
static char *xattr_names(int fd, ssize_t *len)
{
    for (int tries = 0; tries < 4; tries++) {
        ssize_t n = flistxattr(fd, NULL, 0);
        char *names = n > 0 ? malloc((size_t)n) : NULL;

        if (!names)
            break;
        *len = flistxattr(fd, names, (size_t)n);
        if (*len > 0)
            return names;
        free(names);
        if (*len == 0 || errno != ERANGE) /* ERANGE: one was added meanwhile */
            break;
    }
    *len = 0;
    return NULL;
}

/* Xattr `x` of fd as a pax record SCHILY.xattr.<x>; 0, or -1 if unreadable. */
static int pax_xattr(int fd, const char *x, struct buf *pax)
{
    ssize_t n = fgetxattr(fd, x, NULL, 0);
    char *val = n >= 0 ? malloc((size_t)n + 1) : NULL, key[300];

    if (!val || (n = fgetxattr(fd, x, val, (size_t)n)) < 0) {
        free(val);
        return -1;
    }
    snprintf(key, sizeof(key), "SCHILY.xattr.%s", x);
    pax_record(pax, key, val, (size_t)n);
    free(val);
    return 0;
}

/* The xattrs that go along, as pax records (SCHILY.xattr.<name>). */
static void tar_xattrs(int fd, struct buf *pax)
{
    ssize_t n;
    char *names = xattr_names(fd, &n);

    for (ssize_t at = 0; at < n; at += (ssize_t)strlen(names + at) + 1)
        if (tar_xattr_kept(names + at))
            pax_xattr(fd, names + at, pax);
    free(names);
}

/* The user.* xattrs of the image's file or directory that `rel` of the
 * writable layer was copied up from, as pax records. The guest's upper is
 * a tmpfs, which in this kernel (before 6.6) holds no user.* xattrs:
 * overlayfs drops them at the copy-up (a chmod, a write, a touch, a rename
 * of a file of the image) where a container's upper keeps them, and
 * nothing in the guest can set, change or remove one. So the image's are
 * still the file's own, and its snapshot's layer gets them as a
 * container's would. Copied up, not made anew: overlayfs marks a copy-up
 * with trusted.overlay.origin, the lower inode's file handle (EROFS's: its
 * 32-bit inode number, type FILEID_INO32_GEN) and the uuid of its file
 * system. Layers built by the daemon each have a uuid of their own (made
 * of their content, dsecd/fs/erofs.py stamp_uuid), so the uuid names the
 * layer and the handle its inode, wherever the file was renamed to. Layers
 * built before that, and pulled ones (csrc/tarerofs.c, which keep no user.*
 * xattrs), share the null uuid: among several of those the handle does not
 * say which layer, and the file the path names in the topmost of them
 * holding it is taken if it is that inode; a renamed file then gets none,
 * rather than those of another layer's inode of the same number. */
static void tar_origin_xattrs(int fd, const char *rel, mode_t type, struct buf *pax)
{
    /* struct ovl_fb: version, magic 0xfb, len, flags, type, uuid[16], fid */
    unsigned char fh[64];
    ssize_t n = fgetxattr(fd, "trusted.overlay.origin", fh, sizeof(fh));
    struct {
        uint64_t flags, mode, resolve;
    } how = {.flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS};
    uint32_t ino;
    int lfd = -1, layers[64], nlayers = 0;
    struct stat lst;

    if (n != 21 + 8 || fh[1] != 0xfb || fh[2] != n || fh[4] != 1 /* FILEID_INO32_GEN: ino, generation */)
        return;
    memcpy(&ino, fh + 21, sizeof(ino));
    for (int i = nlayerfds - 1; i >= 0; i--) /* top first */
        if (!memcmp(layer_uuids[i], fh + 5, 16))
            layers[nlayers++] = i;
    if (nlayers == 1) {
        struct {
            struct file_handle h;
            unsigned char fid[8];
        } handle = {.h = {.handle_bytes = 8, .handle_type = 1}};

        memcpy(handle.h.f_handle, fh + 21, 8);
        lfd = open_by_handle_at(layerfds[layers[0]], &handle.h, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    }
    for (int i = 0; i < nlayers && nlayers > 1 && lfd < 0; i++)
        lfd = (int)syscall(__NR_openat2, layerfds[layers[i]], rel, &how, sizeof(how));
    if (lfd < 0)
        return;
    if (fstat(lfd, &lst) == 0 && (uint32_t)lst.st_ino == ino && (lst.st_mode & S_IFMT) == type) {
        ssize_t len;
        char *names = xattr_names(lfd, &len);

        for (ssize_t at = 0; at < len; at += (ssize_t)strlen(names + at) + 1)
            if (!strncmp(names + at, "user.", 5))
                pax_xattr(lfd, names + at, pax);
        free(names);
    }
    close(lfd);
}

static int tar_tree(struct tarw *t, int dfd, const char *prefix);

static size_t link_slot(const struct tar_link *links, size_t cap, dev_t dev, ino_t ino)
{
    size_t i = (size_t)((ino ^ (uint64_t)dev << 32) * 0x9e3779b97f4a7c15ull) & (cap - 1);

    while (links[i].name && (links[i].ino != ino || links[i].dev != dev))
        i = (i + 1) & (cap - 1);
    return i;
}

/* The name the tar gave inode (`dev`, `ino`) first, or NULL. (A directory
 * copy's tree may span several file systems: the inode number alone is
 * not the file.) */
static const char *link_first(const struct tarw *t, dev_t dev, ino_t ino)
{
    return t->links_cap ? t->links[link_slot(t->links, t->links_cap, dev, ino)].name : NULL;
}

/* Remember `rel` as the name inode (`dev`, `ino`) was sent under. Out of
 * memory, it is not remembered: the inode's other names then go as copies
 * of it, the files whole but not linked. */
static void link_remember(struct tarw *t, dev_t dev, ino_t ino, const char *rel)
{
    if (2 * (t->nlinks + 1) > t->links_cap) {
        size_t cap = t->links_cap ? 2 * t->links_cap : 256;
        struct tar_link *links = calloc(cap, sizeof(*links));

        if (!links)
            return;
        for (size_t i = 0; i < t->links_cap; i++)
            if (t->links[i].name)
                links[link_slot(links, cap, t->links[i].dev, t->links[i].ino)] = t->links[i];
        free(t->links);
        t->links = links;
        t->links_cap = cap;
    }
    size_t i = link_slot(t->links, t->links_cap, dev, ino);
    char *name = strdup(rel);

    if (!name)
        return;
    t->links[i].dev = dev;
    t->links[i].ino = ino;
    t->links[i].name = name;
    t->nlinks++;
}

/* What the writable layer's walk held: its links table and excluded paths. */
static void tar_free(struct tarw *t)
{
    for (size_t i = 0; i < t->links_cap; i++)
        free(t->links[i].name);
    free(t->links);
    t->links = NULL;
    t->nlinks = t->links_cap = 0;
    for (size_t i = 0; i < t->nskip; i++)
        free(t->skip[i]);
    free(t->skip);
    t->skip = NULL;
    t->nskip = 0;
}

static int copy_entry(struct tarw *t, int dfd, const char *name, const char *rel);

static int tar_entry(struct tarw *t, int dfd, const char *name, const char *rel)
{
    struct stat st;
    struct buf pax = {0};
    int fd = -1, rc = 0, linked, sent = 0;

    if (t->copy)
        return copy_entry(t, dfd, name, rel);
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return 0; /* gone meanwhile (nothing runs, but the kernel may) */
    linked = st.st_nlink > 1 && (S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISLNK(st.st_mode));
    if (linked) {
        const char *first = link_first(t, st.st_dev, st.st_ino);

        if (first) {
            tar_header(t, rel, '1', &st, 0, first, NULL);
            return 0;
        }
    }
    if (S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)) {
        fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
        if (fd < 0) {
            snprintf(t->what, sizeof(t->what), "open %.140s", rel);
            return -1;
        }
        tar_xattrs(fd, &pax);
        tar_origin_xattrs(fd, rel, st.st_mode & S_IFMT, &pax);
    }
    if (S_ISDIR(st.st_mode)) {
        char dname[4098];

        snprintf(dname, sizeof(dname), "%s/", rel);
        tar_header(t, dname, '5', &st, 0, NULL, &pax);
        rc = tar_tree(t, fd, rel);
        fd = -1; /* tar_tree closed it */
    } else if (S_ISREG(st.st_mode)) {
        static unsigned char chunk[1 << 16];
        uint64_t left = (uint64_t)st.st_size;

        t->file_bytes += left;
        if (t->max_bytes && t->file_bytes > t->max_bytes) {
            errno = EFBIG;
            snprintf(t->what, sizeof(t->what), "the writable layer's files pass %llu bytes at %.80s",
                     (unsigned long long)t->max_bytes, rel);
            rc = -1;
        } else {
            tar_header(t, rel, '0', &st, left, NULL, &pax);
            sent = 1;
            while (left) {
                ssize_t n = read(fd, chunk, left < sizeof(chunk) ? left : sizeof(chunk));
                if (n <= 0) {
                    /* the header promised st_size bytes: pad what is missing with zeros */
                    memset(chunk, 0, sizeof(chunk));
                    n = (ssize_t)(left < sizeof(chunk) ? left : sizeof(chunk));
                }
                tar_put(t, chunk, (size_t)n);
                left -= (uint64_t)n;
            }
            memset(chunk, 0, 512);
            tar_put(t, chunk, (512 - (size_t)(st.st_size % 512)) % 512);
        }
    } else if (S_ISLNK(st.st_mode)) {
        char target[4096];
        ssize_t n = readlinkat(dfd, name, target, sizeof(target) - 1);

        if (n >= 0) {
            target[n] = 0;
            tar_header(t, rel, '2', &st, 0, target, NULL);
            sent = 1;
        }
    } else if (S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0)) {
        tar_header(t, rel, '3', &st, 0, NULL, NULL); /* an overlay whiteout */
    } else if (S_ISFIFO(st.st_mode)) {
        tar_header(t, rel, '6', &st, 0, NULL, NULL);
        sent = 1;
    } else {
        t->skipped++; /* sockets, devices */
    }
    if (linked && sent)
        link_remember(t, st.st_dev, st.st_ino, rel);
    free(pax.p);
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Whether the writable layer's walk leaves `rel` (and so all below it) out. */
static int tar_skipped(const struct tarw *t, const char *rel)
{
    for (size_t i = 0; i < t->nskip; i++)
        if (!strcmp(t->skip[i], rel))
            return 1;
    return 0;
}

/* Every entry of directory fd (closed here), children after their parent. */
static int tar_tree(struct tarw *t, int fd, const char *prefix)
{
    DIR *d = fdopendir(fd);
    struct dirent *e;
    int rc = 0;

    if (!d) {
        close(fd);
        snprintf(t->what, sizeof(t->what), "list %.140s", prefix[0] ? prefix : "/");
        return -1;
    }
    while (rc == 0 && (e = readdir(d))) {
        char rel[4096];

        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (snprintf(rel, sizeof(rel), "%s%s%s", prefix, prefix[0] ? "/" : "", e->d_name) >= (int)sizeof(rel))
            continue;
        if (tar_skipped(t, rel))
            continue;
        rc = tar_entry(t, dirfd(d), e->d_name, rel);
    }
    closedir(d);
    return rc;
}

/* Hold every process but the agent still while the writable layer is
 * walked (on = 1) or let them go on (on = 0). By the cgroup freezer, as a
 * container's snapshot freezes its cgroup: the processes see nothing (a
 * stop by signal is seen by the process, a SIGCONT handler, its parent's
 * waitpid and a shell's job control, and a SIGCONT after would go on with
 * a process its user had stopped). Without the cgroup: SIGSTOP to all,
 * SIGCONT after. A freeze still not complete after 10 s (a process in an
 * uninterruptible sleep) is logged and the walk goes on. */
static void hold_still(int on)
{
    static int by_signal; /* the hold under way is by signals: so is its end */
    char ev[256];

    if (on && cg_freeze >= 0) {
        /* Not in the cgroup it freezes, wherever the guest's root moved it
         * (it may mount cgroup2 too): a frozen agent would thaw nothing. */
        ssize_t ignored = write(cg_top, "0", 1);
        (void)ignored;
    }
    if (on)
        by_signal = cg_freeze < 0 || pwrite(cg_freeze, "1", 1, 0) != 1;
    else if (!by_signal && pwrite(cg_freeze, "0", 1, 0) != 1)
        say("thaw the guest's processes: %s", strerror(errno));
    if (by_signal) {
        kill(-1, on ? SIGSTOP : SIGCONT); /* every process but PID 1 */
        return;
    }
    struct timespec t0, now;

    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (on) {
        ssize_t n = pread(cg_events, ev, sizeof(ev) - 1, 0);

        if (n < 0)
            break;
        ev[n] = 0;
        if (strstr(ev, "frozen 1"))
            return;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - t0.tv_sec >= 10) {
            say("the guest's processes are not all frozen after 10 s; the writable layer is read anyway");
            return;
        }
        /* cgroup.events signals a change as POLLPRI */
        struct pollfd pf = {.fd = cg_events, .events = POLLPRI};
        poll(&pf, 1, 50);
    }
}

static void do_tar(uint32_t id, struct rd *r)
{
    struct tarw t = {.id = id, .outfd = -1};
    struct stat st;
    unsigned char zeros[1024] = {0};
    int fd, rc;

    t.max_bytes = get_u64(r);
    /* The paths a snapshot excludes (relative, normalised by the host: as
     * mkfs.erofs matches them), so that neither the tar nor the bound on
     * its files' bytes holds them. A host that sends none ends here. */
    uint64_t nskip = r->p < r->end ? get_u64(r) : 0;
    if (!r->bad && nskip <= MAX_SKIP && (!nskip || (t.skip = calloc(nskip, sizeof(*t.skip)))))
        for (; t.nskip < nskip && !r->bad; t.nskip++)
            t.skip[t.nskip] = get_str(r);
    if (r->bad || nskip > MAX_SKIP || (nskip && !t.skip)) {
        tar_free(&t);
        send_err(id, EINVAL, "malformed tar request");
        return;
    }
    /* A description of its own: a dup() would share the directory position
     * with upperfd, which the walk leaves at the end, and the next snapshot
     * would find the layer empty. */
    fd = openat(upperfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        int err = errno;

        if (fd >= 0)
            close(fd);
        tar_free(&t);
        send_err(id, err, "open the writable layer");
        return;
    }
    hold_still(1); /* every process but PID 1: the tree holds still */
    tar_send(&t); /* (nothing yet: starts the first frame) */
    {
        /* the layer's root: its mode, owner and xattrs (an opaque root too) */
        struct buf pax = {0};

        tar_xattrs(fd, &pax);
        tar_header(&t, "./", '5', &st, 0, NULL, &pax);
        free(pax.p);
    }
    rc = tar_tree(&t, fd, "");
    hold_still(0);
    tar_free(&t);
    if (rc < 0) {
        int err = errno;

        free(t.data.p);
        send_err(id, err, t.what);
        return;
    }
    tar_put(&t, zeros, sizeof(zeros)); /* the end: two zero blocks */
    tar_send(&t);
    free(t.data.p);
    begin(&out, A_OK, id);
    put_u64(&out, t.entries);
    put_u64(&out, t.file_bytes);
    put_u64(&out, t.skipped);
    send_msg(&out);
}


/* ---- directory copies (file_tar_get, file_tar_put) ------------------------- */

/* Each runs in a child of the agent started like an exec (M_EXEC with
 * EXEC_TAR_GET or EXEC_TAR_PUT, argv[0] the directory), so its bytes flow
 * through the exec's pipes with their flow control and the agent's loop
 * never waits on a tree. The rules are the container backend's
 * (dsecd/fs/tarcopy.py): out, symlinks stored and never followed, FIFOs,
 * sockets, devices and kernel filesystems skipped and reported; in, every
 * entry made under a new directory beside the destination with
 * RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS (no symlink, the archive's or one
 * planted meanwhile, is followed), renamed into place at the end, removed
 * on any failure. The host checks the archive (dsecd/tarsafe.py) and sends
 * the entries as records (dsecd/engine/vmfiles.py). Reports go to stderr
 * as NUL-separated fields: "skip" type reason path, "done" entries bytes,
 * "err" errno what. */

static void report(const char *a, const char *b, const char *c, const char *d)
{
    struct buf b2 = {0};
    const char *f[4] = {a, b, c, d};

    for (int i = 0; i < 4 && f[i]; i++) { /* each field and its NUL, as they are */
        size_t n = strlen(f[i]) + 1;

        buf_need(&b2, n);
        memcpy(b2.p + b2.len, f[i], n);
        b2.len += n;
    }
    write_all(2, b2.p, b2.len); /* one write: the reports of one entry stay whole */
    free(b2.p);
}

static void report_err(int err, const char *what)
{
    char num[16];

    snprintf(num, sizeof(num), "%d", err);
    report("err", num, what, NULL);
}

static int kernel_fs(int fd)
{
    static const long magics[] = {0x9fa0, 0x62656572, 0x64626720, 0x74726163, 0x73636673, 0x27e0eb, 0x63677270,
                                  (long)0xcafe4a11, 0x1cd1, 0x6e736673, (long)0xde5e81e4, 0x6165676c, 0x42494e4d,
                                  (long)0xf97cff8c, 0x43415d53};
    struct statfs sf;

    if (fstatfs(fd, &sf) < 0)
        return 0;
    for (size_t i = 0; i < sizeof(magics) / sizeof(magics[0]); i++)
        if ((long)sf.f_type == magics[i])
            return 1;
    return 0;
}

static int copy_count(struct tarw *t, const char *rel, uint64_t size)
{
    t->copied++;
    t->file_bytes += size;
    if (t->copied > t->max_entries || t->file_bytes > t->max_bytes) {
        errno = EFBIG;
        snprintf(t->what, sizeof(t->what), "at %.100s: the tree has more than %llu entries or %llu bytes",
                 rel[0] ? rel : ".", (unsigned long long)t->max_entries, (unsigned long long)t->max_bytes);
        return -1;
    }
    return 0;
}

/* As the copy stores it: owner 0:0, permission bits and sticky only. */
static struct stat copy_stat(const struct stat *st)
{
    struct stat c = *st;

    c.st_uid = c.st_gid = 0;
    c.st_mode &= 01777;
    return c;
}

static int copy_entry(struct tarw *t, int dfd, const char *name, const char *rel)
{
    struct stat st, cs;
    int fd;

    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
        return 0; /* removed while we walked */
    if (S_ISLNK(st.st_mode)) {
        char target[4096];
        ssize_t n = readlinkat(dfd, name, target, sizeof(target) - 1);

        if (n < 0) {
            report("skip", "unknown", "replaced while copied", rel);
            return 0;
        }
        target[n] = 0;
        if (copy_count(t, rel, 0) < 0)
            return -1;
        cs = copy_stat(&st);
        tar_header(t, rel, '2', &cs, 0, target, NULL);
        return 0;
    }
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode)) {
        report("skip", type_of(st.st_mode), "not a file, directory or symlink: not copied", rel);
        return 0;
    }
    fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC |
                (S_ISDIR(st.st_mode) ? O_DIRECTORY : 0));
    if (fd < 0 || fstat(fd, &st) < 0 || (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))) {
        if (fd >= 0)
            close(fd);
        report("skip", "unknown", "replaced while copied", rel);
        return 0;
    }
    if (kernel_fs(fd)) {
        close(fd);
        report("skip", S_ISDIR(st.st_mode) ? "dir" : "file", "on a kernel filesystem, a kernel interface", rel);
        return 0;
    }
    cs = copy_stat(&st);
    if (S_ISDIR(st.st_mode)) {
        if (copy_count(t, rel, 0) < 0) {
            close(fd);
            return -1;
        }
        tar_header(t, rel, '5', &cs, 0, NULL, NULL);
        return tar_tree(t, fd, rel); /* closes fd */
    }
    if (st.st_nlink > 1) {
        /* A file of several names comes once; its other names are hard
         * links to the first, as tar(1) and docker cp give them (and as the
         * container backend's copy does, dsecd/fs/tarcopy.py). */
        const char *first = link_first(t, st.st_dev, st.st_ino);

        if (first) {
            close(fd);
            if (copy_count(t, rel, 0) < 0)
                return -1;
            tar_header(t, rel, '1', &cs, 0, first, NULL);
            return 0;
        }
        link_remember(t, st.st_dev, st.st_ino, rel);
    }
    {
        static unsigned char chunk[1 << 16];
        uint64_t left = (uint64_t)st.st_size;
        int shrank = 0;

        if (copy_count(t, rel, left) < 0) {
            close(fd);
            return -1;
        }
        tar_header(t, rel, '0', &cs, left, NULL, NULL);
        while (left) {
            ssize_t n = read(fd, chunk, left < sizeof(chunk) ? left : sizeof(chunk));
            if (n <= 0) { /* shrank while copied: the header's size still holds */
                memset(chunk, 0, sizeof(chunk));
                n = (ssize_t)(left < sizeof(chunk) ? left : sizeof(chunk));
                shrank = 1;
            }
            tar_put(t, chunk, (size_t)n);
            left -= (uint64_t)n;
        }
        memset(chunk, 0, 512);
        tar_put(t, chunk, (512 - (size_t)(st.st_size % 512)) % 512);
        if (shrank)
            report("skip", "file", "shrank while copied: zero-padded", rel);
    }
    close(fd);
    return 0;
}

/* The tar of directory `path` to stdout; exit 0, 1 on an error, 3 past the limits. */
static int tar_get_main(const char *path, uint64_t max_entries, uint64_t max_bytes)
{
    struct tarw t = {.outfd = 1, .copy = 1, .max_entries = max_entries, .max_bytes = max_bytes};
    unsigned char zeros[1024] = {0};
    struct stat st, cs;
    char num[2][24];
    int fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);

    if (fd < 0 || fstat(fd, &st) < 0) {
        report_err(errno, "open");
        return 1;
    }
    tar_send(&t); /* starts the buffer */
    cs = copy_stat(&st);
    if (copy_count(&t, "", 0) < 0)
        goto fail;
    tar_header(&t, ".", '5', &cs, 0, NULL, NULL);
    if (tar_tree(&t, fd, "") < 0)
        goto fail;
    tar_put(&t, zeros, sizeof(zeros));
    tar_send(&t);
    snprintf(num[0], sizeof(num[0]), "%llu", (unsigned long long)t.copied);
    snprintf(num[1], sizeof(num[1]), "%llu", (unsigned long long)t.file_bytes);
    report("done", num[0], num[1], NULL);
    return 0;
fail:
    report_err(errno, t.what);
    return errno == EFBIG ? 3 : 1;
}

/* Exactly n bytes of stdin; 0 at its end before any, -1 cut short or failed. */
static int read_in(void *p, size_t n)
{
    size_t got = 0;

    while (got < n) {
        ssize_t k = read(0, (char *)p + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return got || k < 0 ? -1 : 0;
        got += (size_t)k;
    }
    return 1;
}

static uint64_t be64(const unsigned char *p)
{
    uint64_t v = 0;

    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* The directory holding `rel` below topfd (no symlink followed) and its last name. */
static int put_parent(int topfd, char *rel, const char **leaf)
{
    struct {
        uint64_t flags, mode, resolve;
    } how = {.flags = O_PATH | O_DIRECTORY | O_CLOEXEC, .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS};
    char *slash = strrchr(rel, '/');
    int fd;

    if (!slash) {
        *leaf = rel;
        return dup(topfd);
    }
    *slash = 0;
    fd = (int)syscall(__NR_openat2, topfd, rel, &how, sizeof(how));
    *slash = '/';
    *leaf = slash + 1;
    return fd;
}

/* One record: kind, rel, mode, mtime, size, then size bytes (a file's
 * data, a link's target). The mtime (put_times): PUT_SECONDS a u64 of
 * seconds (none: 2^64-1); PUT_NS signed nanoseconds in a u64 (none:
 * PUT_NO_MTIME); PUT_TS signed seconds in a u64 and nanoseconds in a u32
 * (none: PUT_TS_NONE), 4 bytes more. Kinds: d a directory (mode 0700 until
 * its D), f a file, s a symlink, h a hard link to a file made before, D a
 * directory's mode and mtime (it may have none; sent last, deepest first),
 * r the removal of what an earlier record made at the name, which a later
 * entry of the archive replaces (mode 1: an empty directory; else a file or
 * symlink, never followed), E the end: rename into place. */
#define PUT_NO_MTIME (1ull << 63) /* a PUT_NS put's "no mtime": INT64_MIN ns, no time a tar holds */
#define PUT_TS_NONE 0xffffffffu   /* a PUT_TS put's "no mtime" in its nanoseconds field */

static int put_times(const char *word)
{
    return !strcmp(word, "ts") ? PUT_TS : !strcmp(word, "ns") ? PUT_NS : PUT_SECONDS;
}

static int put_record(int topfd, int pfd, const char *tmp, const char *name, int *ended, int times)
{
    unsigned char head[5];
    unsigned char nums[24];
    size_t nums_len = times == PUT_TS ? 24 : 20;
    char rel[4097], *data = NULL;
    const char *leaf, *what = "read the copy's input";
    uint32_t rlen;
    uint64_t size, mode, mtime;
    int dfd = -1, fd = -1, rc = -1;

    int k = read_in(head, 5);
    if (k <= 0) {
        errno = k == 0 ? ECONNABORTED : errno ? errno : EIO;
        report_err(errno, k == 0 ? "the copy's input ended before its archive did" : what);
        return -1;
    }
    rlen = (uint32_t)head[1] << 24 | (uint32_t)head[2] << 16 | (uint32_t)head[3] << 8 | head[4];
    if (rlen >= sizeof(rel) || (rlen && read_in(rel, rlen) <= 0)) {
        report_err(EINVAL, what);
        return -1;
    }
    rel[rlen] = 0;
    if (read_in(nums, nums_len) <= 0) {
        report_err(EINVAL, what);
        return -1;
    }
    mode = (uint64_t)nums[0] << 24 | (uint64_t)nums[1] << 16 | (uint64_t)nums[2] << 8 | nums[3];
    mtime = be64(nums + 4);
    uint32_t nsec = 0;
    if (times == PUT_TS)
        nsec = (uint32_t)nums[12] << 24 | (uint32_t)nums[13] << 16 | (uint32_t)nums[14] << 8 | nums[15];
    size = be64(nums + nums_len - 8);
    if (times == PUT_TS && nsec >= 1000000000u && nsec != PUT_TS_NONE) {
        report_err(EINVAL, "an mtime's nanoseconds past a second in the copy's input");
        return -1;
    }
    if (head[0] == 'E') {
        if (syscall(SYS_renameat2, pfd, tmp, pfd, name, RENAME_NOREPLACE) < 0) {
            report_err(errno, "rename the copy into place");
            return -1;
        }
        *ended = 1;
        return 0;
    }
    if (head[0] != 'f' && size) {
        if (size > 4096 || !(data = calloc(1, size + 1)) || read_in(data, size) <= 0) {
            report_err(EINVAL, what);
            goto done;
        }
    }
    if (head[0] == 'D' && !rlen) {
        dfd = dup(topfd);
        leaf = ".";
    } else {
        dfd = put_parent(topfd, rel, &leaf);
    }
    what = rel;
    if (dfd < 0)
        goto err;
    struct timespec ts[2] = {{.tv_sec = (time_t)mtime}, {.tv_sec = (time_t)mtime}};
    int no_mtime = times == PUT_TS ? nsec == PUT_TS_NONE : mtime == (times == PUT_NS ? PUT_NO_MTIME : UINT64_MAX);

    if (times == PUT_NS)
        ts[0] = ts[1] = ns_time(mtime);
    else if (times == PUT_TS)
        ts[0].tv_nsec = ts[1].tv_nsec = no_mtime ? UTIME_OMIT : (long)nsec;
    switch (head[0]) {
    case 'd':
        if (mkdirat(dfd, leaf, 0700) < 0)
            goto err;
        break;
    case 'r':
        if (unlinkat(dfd, leaf, mode == 1 ? AT_REMOVEDIR : 0) < 0)
            goto err;
        break;
    case 'D':
        fd = openat(dfd, leaf, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 || fchmod(fd, (mode_t)(mode & 01777)) < 0 || (!no_mtime && futimens(fd, ts) < 0))
            goto err;
        break;
    case 'f': {
        static unsigned char chunk[1 << 16];

        fd = openat(dfd, leaf, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0)
            goto err;
        while (size) {
            size_t n = size < sizeof(chunk) ? (size_t)size : sizeof(chunk);
            if (read_in(chunk, n) <= 0) {
                report_err(ECONNABORTED, "the copy's input ended inside a file");
                goto done;
            }
            const unsigned char *p = chunk;
            size_t left = n;
            while (left) {
                ssize_t w = write(fd, p, left);
                if (w < 0 && errno == EINTR)
                    continue;
                if (w < 0)
                    goto err;
                p += w;
                left -= (size_t)w;
            }
            size -= n;
        }
        if (fchmod(fd, (mode_t)(mode & 01777)) < 0 || futimens(fd, ts) < 0)
            goto err;
        break;
    }
    case 's':
        if (!data || symlinkat(data, dfd, leaf) < 0 || utimensat(dfd, leaf, ts, AT_SYMLINK_NOFOLLOW) < 0)
            goto err;
        break;
    case 'h': {
        const char *sleaf;
        int sfd = data ? put_parent(topfd, data, &sleaf) : -1;

        if (sfd < 0)
            goto err;
        int l = linkat(sfd, sleaf, dfd, leaf, 0);
        int e = errno;
        close(sfd);
        errno = e;
        if (l < 0)
            goto err;
        break;
    }
    default:
        report_err(EINVAL, "unknown record in the copy's input");
        goto done;
    }
    rc = 0;
    goto done;
err:
    report_err(errno, what);
done:
    if (fd >= 0)
        close(fd);
    if (dfd >= 0)
        close(dfd);
    free(data);
    return rc;
}

static int tar_put_main(const char *path, int times)
{
    const char *name;
    char tmp[64];
    struct stat st;
    int pfd = open_parent(path, &name), topfd = -1, ended = 0;
    uint64_t removed = 0;
    unsigned char rnd[6];

    if (pfd < 0) {
        report_err(errno, "open the parent directory");
        return 1;
    }
    if (fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        report_err(EEXIST, "exists; remove it first or copy to a new path");
        return 1;
    }
    if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd))
        memset(rnd, 0, sizeof(rnd));
    snprintf(tmp, sizeof(tmp), ".dsec-put-%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    if (mkdirat(pfd, tmp, 0700) < 0) {
        report_err(errno, "make the copy's directory");
        return 1;
    }
    topfd = openat(pfd, tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (topfd < 0) {
        report_err(errno, "open the copy's directory");
        remove_at(pfd, tmp, 1, &removed);
        return 1;
    }
    while (!ended)
        if (put_record(topfd, pfd, tmp, name, &ended, times) < 0) {
            remove_at(pfd, tmp, 1, &removed);
            return 1;
        }
    report("done", NULL, NULL, NULL);
    return 0;
}

/* ---- file_watch --------------------------------------------------------------- */

/* A watch runs in a child of the agent started like an exec (M_EXEC with
 * EXEC_WATCH; argv: the directory, "1" for recursive, the most directories),
 * by the container backend's rules (dsecd/fs/watch.py): the top resolved in
 * the root (symlinks inside it followed, kernel filesystems refused), every
 * directory below it opened relative to the top with RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS (no symlink followed, nothing outside watched) and
 * given to inotify as /proc/self/fd/N (the inode opened, no path resolved
 * again); the top reopened for each new directory and still the same inode;
 * no directory kept open (its IN_DELETE_SELF would wait for the close).
 * Records go to stdout, each a u32 length (big-endian) and NUL-terminated
 * fields: "ready" dirs; "ev" kind is_dir cookie scanned rel; "overflow";
 * "stopped" reason; "err" errno what; "kernel" magic; "limit" which rel
 * (which: dirs, inotify, instances, depth). The child ends after stopped,
 * err, kernel or limit; the host kills it when the request is cancelled. */

#define WATCH_MASK (IN_CREATE | IN_MODIFY | IN_ATTRIB | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | \
                    IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)
#define WATCH_DEPTH 900 /* the container backend walks by recursion in Python: about as deep */

struct wdir {
    int wd;
    char *rel; /* relative to the top, "" the top */
};
static struct wdir *wdirs;
static size_t nwdirs, capwdirs;
static int wifd = -1, wrecursive;
static const char *wtop;
static dev_t wdev;
static ino_t wino;
static uint64_t wmax;
static struct buf wout;

static void wflush(void)
{
    size_t off = 0;

    while (off < wout.len) {
        ssize_t w = write(1, wout.p + off, wout.len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            _exit(0); /* the host is gone */
        off += (size_t)w;
    }
    wout.len = 0;
}

static void wrec(const char *a, const char *b, const char *c, const char *d, const char *e, const char *g)
{
    const char *f[6] = {a, b, c, d, e, g};
    size_t start = wout.len;

    put_u32(&wout, 0);
    for (int i = 0; i < 6 && f[i]; i++) {
        size_t n = strlen(f[i]) + 1;

        buf_need(&wout, n);
        memcpy(wout.p + wout.len, f[i], n);
        wout.len += n;
    }
    uint32_t n = (uint32_t)(wout.len - start - 4);
    wout.p[start] = (unsigned char)(n >> 24);
    wout.p[start + 1] = (unsigned char)(n >> 16);
    wout.p[start + 2] = (unsigned char)(n >> 8);
    wout.p[start + 3] = (unsigned char)n;
    if (wout.len >= OUT_CHUNK)
        wflush();
}

static void wend(int code, const char *a, const char *b, const char *c)
{
    wrec(a, b, c, NULL, NULL, NULL);
    wflush();
    _exit(code);
}

static void wfail(int err, const char *what)
{
    char num[16];

    snprintf(num, sizeof(num), "%d", err);
    wend(1, "err", num, what[0] ? what : ".");
}

static int wfind_rel(const char *rel)
{
    for (size_t i = 0; i < nwdirs; i++)
        if (!strcmp(wdirs[i].rel, rel))
            return (int)i;
    return -1;
}

static int wfind(int wd)
{
    for (size_t i = 0; i < nwdirs; i++)
        if (wdirs[i].wd == wd)
            return (int)i;
    return -1;
}

/* Stop watching rel and everything under it ("" everything). */
static void wforget(const char *rel, int remove)
{
    size_t n = strlen(rel);

    for (size_t i = 0; i < nwdirs;) {
        const char *r = wdirs[i].rel;

        if (!n || !strcmp(r, rel) || (!strncmp(r, rel, n) && r[n] == '/')) {
            if (remove)
                inotify_rm_watch(wifd, wdirs[i].wd);
            free(wdirs[i].rel);
            wdirs[i] = wdirs[--nwdirs];
            continue;
        }
        i++;
    }
}

/* Directory rel under the top; -2 if the top is no longer the one watched. */
static int wopen(const char *rel)
{
    struct {
        uint64_t flags, mode, resolve;
    } how = {.flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC,
             .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS};
    struct stat st;
    int top = open_in_root(wtop, O_RDONLY | O_DIRECTORY, 0), fd, err;

    if (top < 0)
        return -1;
    if (fstat(top, &st) < 0 || st.st_dev != wdev || st.st_ino != wino) {
        close(top);
        return -2;
    }
    if (!rel[0])
        return top;
    fd = (int)syscall(__NR_openat2, top, rel, &how, sizeof(how));
    err = errno;
    close(top);
    errno = err;
    return fd;
}

static void wwatch(int fd, const char *rel)
{
    char proc[64];
    int wd, old;

    if (wfind_rel(rel) < 0 && nwdirs >= wmax)
        wend(3, "limit", "dirs", rel);
    snprintf(proc, sizeof(proc), "/proc/self/fd/%d", fd);
    wd = inotify_add_watch(wifd, proc, WATCH_MASK);
    if (wd < 0) {
        if (errno == ENOSPC)
            wend(3, "limit", "inotify", rel);
        wfail(errno, rel);
    }
    old = wfind(wd);
    if (old >= 0) { /* the same directory under a new name (moved in the tree) */
        free(wdirs[old].rel);
        wdirs[old].rel = strdup(rel);
        return;
    }
    if (nwdirs == capwdirs) {
        capwdirs = capwdirs ? 2 * capwdirs : 64;
        wdirs = realloc(wdirs, capwdirs * sizeof(*wdirs));
        if (!wdirs)
            wfail(ENOMEM, rel);
    }
    wdirs[nwdirs].wd = wd;
    wdirs[nwdirs].rel = strdup(rel);
    if (!wdirs[nwdirs].rel)
        wfail(ENOMEM, rel);
    nwdirs++;
}

/* Watch directory rel (recursive: and every one below it); with report, the
 * entries found are sent as created (scanned): inotify told nobody of them. */
static void wadd_tree(const char *rel, int report, unsigned depth)
{
    struct dirent *e;
    DIR *d;
    char **names = NULL;
    unsigned char *dirs = NULL;
    size_t n = 0, cap = 0;
    int fd = wopen(rel);

    if (fd == -2)
        return; /* the top itself was replaced: its IN_DELETE/MOVE_SELF ends the watch */
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP || errno == EXDEV || errno == EACCES)
            return; /* gone, replaced by a file or symlink, or a mount: not watched */
        wfail(errno, rel);
    }
    if (rel[0] && kernel_fs(fd)) {
        close(fd);
        return; /* /proc, /sys and friends: no inotify events */
    }
    if (depth > WATCH_DEPTH)
        wend(3, "limit", "depth", rel);
    wwatch(fd, rel);
    if (!wrecursive || !(d = fdopendir(fd))) {
        close(fd);
        return;
    }
    while ((e = readdir(d))) {
        struct stat st;
        int is_dir;

        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        is_dir = e->d_type == DT_DIR;
        if (e->d_type == DT_UNKNOWN)
            is_dir = fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            names = realloc(names, cap * sizeof(*names));
            dirs = realloc(dirs, cap);
            if (!names || !dirs)
                wfail(ENOMEM, rel);
        }
        names[n] = strdup(e->d_name);
        if (!names[n])
            wfail(ENOMEM, rel);
        dirs[n++] = (unsigned char)is_dir;
    }
    closedir(d);
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(rel) + strlen(names[i]) + 2;
        char *sub = malloc(len);

        if (!sub)
            wfail(ENOMEM, rel);
        snprintf(sub, len, "%s%s%s", rel, rel[0] ? "/" : "", names[i]);
        if (report)
            wrec("ev", "create", dirs[i] ? "1" : "0", "0", "1", sub);
        if (dirs[i])
            wadd_tree(sub, report, depth + 1);
        free(sub);
        free(names[i]);
    }
    free(names);
    free(dirs);
}

static unsigned wdepth(const char *rel)
{
    unsigned n = 1;

    for (; *rel; rel++)
        n += *rel == '/';
    return n;
}

/* Watch directory `path` until it goes; 0 stopped, 1 an error, 3 past a limit. */
static int watch_main(const char *path, int recursive, uint64_t max_dirs)
{
    static const struct {
        uint32_t bit;
        const char *kind;
    } kinds[] = {{IN_CREATE, "create"}, {IN_MODIFY, "modify"}, {IN_ATTRIB, "attrib"},
                 {IN_DELETE, "delete"}, {IN_MOVED_FROM, "move_from"}, {IN_MOVED_TO, "move_to"}};
    static char ibuf[1 << 16] __attribute__((aligned(__alignof__(struct inotify_event))));
    const char *stopped = NULL;
    struct statfs sf;
    struct stat st;
    char num[24];
    int fd = open_in_root(path, O_RDONLY | O_DIRECTORY, 0);

    wtop = path;
    wrecursive = recursive;
    wmax = max_dirs;
    if (fd < 0 || fstat(fd, &st) < 0)
        wfail(errno, "");
    if (kernel_fs(fd) && fstatfs(fd, &sf) == 0) {
        snprintf(num, sizeof(num), "%lu", (unsigned long)sf.f_type);
        wend(1, "kernel", num, NULL);
    }
    wdev = st.st_dev;
    wino = st.st_ino;
    close(fd);
    wifd = inotify_init1(IN_CLOEXEC);
    if (wifd < 0) {
        if (errno == EMFILE || errno == ENFILE)
            wend(3, "limit", "instances", "");
        wfail(errno, "");
    }
    wadd_tree("", 0, 0);
    snprintf(num, sizeof(num), "%zu", nwdirs);
    wrec("ready", num, NULL, NULL, NULL, NULL);
    wflush();
    while (!stopped) {
        ssize_t got = read(wifd, ibuf, sizeof(ibuf));
        char last[4096 + 64] = ""; /* a run of writes to one file is one modify */

        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            wfail(got < 0 ? errno : EIO, "read inotify");
        for (char *p = ibuf; p < ibuf + got && !stopped;) {
            const struct inotify_event *ev = (const struct inotify_event *)p;
            const char *kind = NULL;
            char *rel, *child, cookie[16], sig[sizeof(last)];
            int i, is_dir;

            p += sizeof(*ev) + ev->len;
            if (ev->mask & IN_Q_OVERFLOW) {
                wrec("overflow", NULL, NULL, NULL, NULL, NULL);
                last[0] = 0;
                continue;
            }
            if ((i = wfind(ev->wd)) < 0)
                continue; /* a watch removed a moment ago */
            rel = strdup(wdirs[i].rel);
            if (!rel)
                wfail(ENOMEM, "");
            if (ev->mask & IN_IGNORED) {
                wforget(rel, 0);
                if (!rel[0])
                    stopped = "gone";
                free(rel);
                continue;
            }
            if (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT)) {
                if (!rel[0]) /* below the top the parent's delete / move_from says it */
                    stopped = ev->mask & IN_DELETE_SELF ? "deleted" : ev->mask & IN_MOVE_SELF ? "moved" : "unmounted";
                free(rel);
                continue;
            }
            for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]) && !kind; k++)
                if (ev->mask & kinds[k].bit)
                    kind = kinds[k].kind;
            if (!kind || !ev->len) {
                free(rel);
                continue;
            }
            size_t len = strlen(rel) + strlen(ev->name) + 2;
            if (!(child = malloc(len)))
                wfail(ENOMEM, rel);
            snprintf(child, len, "%s%s%s", rel, rel[0] ? "/" : "", ev->name);
            free(rel);
            is_dir = (ev->mask & IN_ISDIR) != 0;
            snprintf(cookie, sizeof(cookie), "%u", ev->cookie);
            snprintf(sig, sizeof(sig), "%s %d %s %s", kind, is_dir, cookie, child);
            if (strcmp(sig, last)) {
                wrec("ev", kind, is_dir ? "1" : "0", cookie, "0", child);
                memcpy(last, sig, sizeof(last));
            }
            if (is_dir && (ev->mask & (IN_DELETE | IN_MOVED_FROM)))
                wforget(child, 1);
            if (is_dir && recursive && (ev->mask & (IN_CREATE | IN_MOVED_TO))) {
                wadd_tree(child, 1, wdepth(child));
            }
            free(child);
        }
        wflush();
    }
    wend(0, "stopped", stopped, NULL);
    return 0;
}

static void dispatch(uint8_t type, uint32_t id, const unsigned char *body, size_t n)
{
    struct rd r = {.p = body, .end = body + n};

    switch (type) {
    case M_HELLO: do_hello(id, &r); break;
    case M_EXEC: do_exec(id, &r); break;
    case M_STDIN: do_stdin(id, &r); break;
    case M_KILL: do_kill(id, &r); break;
    case M_CREDIT: do_credit(id, &r); break;
    case M_RESIZE: do_resize(id, &r); break;
    case M_PROC_START: do_proc_start(id, &r); break;
    case M_PROC_LIST: do_proc_list(id); break;
    case M_PROC_ATTACH: do_proc_attach(id, &r); break;
    case M_PROC_INPUT: do_proc_input(id, &r); break;
    case M_PROC_KILL: do_proc_kill(id, &r); break;
    case M_PROC_FORGET: do_proc_forget(id, &r); break;
    case M_READ: do_read(id, &r); break;
    case M_WRITE: do_write(id, &r); break;
    case M_STAT: do_stat(id, &r); break;
    case M_LIST: do_list(id, &r); break;
    case M_MKDIR: do_mkdir(id, &r); break;
    case M_REMOVE: do_remove(id, &r); break;
    case M_RENAME: do_rename(id, &r); break;
    case M_SETATTR: do_setattr(id, &r); break;
    case M_NET: do_net(id, &r); break;
    case M_TAR: do_tar(id, &r); break;
    case M_PING:
        begin(&out, A_OK, id);
        send_msg(&out);
        break;
    case M_SYNC:
        sync();
        begin(&out, A_OK, id);
        send_msg(&out);
        break;
    default: send_err(id, ENOSYS, "unknown request type");
    }
}

/* Incoming bytes: frames may arrive in pieces. */
static unsigned char *inb;
static size_t in_len, in_cap;

/* Where in p[0..n) a HELLO frame plausibly starts (its length, type, and a
 * hostname that fits; the host's first frame on a channel is its HELLO): 1
 * and *off; else 0 and *off the first byte that could still start one once
 * more has come (what precedes it is not a HELLO). */
static int find_hello(const unsigned char *p, size_t n, size_t *off)
{
    size_t i = 0;

    for (; i + 13 <= n; i++) {
        uint32_t len = (uint32_t)p[i] << 24 | (uint32_t)p[i + 1] << 16 | (uint32_t)p[i + 2] << 8 | p[i + 3];
        uint32_t host = (uint32_t)p[i + 9] << 24 | (uint32_t)p[i + 10] << 16 | (uint32_t)p[i + 11] << 8 | p[i + 12];

        if (p[i + 4] == M_HELLO && len >= HELLO_MIN && len <= HELLO_MAX && host <= HOST_NAME_MAX &&
            host <= len - HELLO_MIN) {
            *off = i;
            return 1;
        }
    }
    *off = i;
    return 0;
}

static int read_channel(void)
{
    if (in_cap - in_len < 65536) {
        size_t cap = in_cap ? in_cap * 2 : 1 << 20;
        unsigned char *p = realloc(inb, cap);
        if (!p)
            return -1;
        inb = p;
        in_cap = cap;
    }
    ssize_t n = read(chan, inb + in_len, in_cap - in_len);
    if (n < 0)
        return errno == EINTR || errno == EAGAIN ? 0 : -1;
    if (n == 0)
        return 0; /* the host side is not connected: poll says POLLHUP, retry later */
    in_len += (size_t)n;
    size_t at = 0;
    for (;;) {
        if (input_stale) { /* the host went (maybe while it was answered): on to the next one's HELLO */
            size_t skip;
            int found = find_hello(inb + at, in_len - at, &skip);

            if (skip)
                say("skipped %zu bytes the host that went left on the channel", skip);
            at += skip;
            if (!found)
                break;
            input_stale = 0;
        }
        if (in_len - at < 9)
            break;
        uint32_t len = (uint32_t)inb[at] << 24 | (uint32_t)inb[at + 1] << 16 | (uint32_t)inb[at + 2] << 8 |
                       inb[at + 3];
        if (len < 5 || len > MAX_MSG) {
            say("bad frame length %u: dropping the input", len);
            in_len = 0;
            return 0;
        }
        if (in_len - at < 4 + (size_t)len)
            break;
        uint32_t id = (uint32_t)inb[at + 5] << 24 | (uint32_t)inb[at + 6] << 16 | (uint32_t)inb[at + 7] << 8 |
                      inb[at + 8];
        dispatch(inb[at + 4], id, inb + at + 9, len - 5);
        at += 4 + (size_t)len;
    }
    memmove(inb, inb + at, in_len - at);
    in_len -= at;
    return 0;
}

/* ---- boot ------------------------------------------------------------------- */

static char cmdline[4096];

static const char *param(const char *name)
{
    size_t n = strlen(name);

    for (char *p = cmdline; (p = strstr(p, name)); p += n)
        if ((p == cmdline || p[-1] == ' ') && p[n] == '=')
            return p + n + 1;
    return NULL;
}

static uint64_t param_u64(const char *name, uint64_t dflt)
{
    const char *v = param(name);
    return v ? strtoull(v, NULL, 10) : dflt;
}

static int read_file(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n;

    if (fd < 0)
        return -1;
    n = read(fd, buf, cap - 1);
    close(fd);
    if (n < 0)
        return -1;
    buf[n] = 0;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
        buf[--n] = 0;
    return (int)n;
}

static void load_modules(void)
{
    char list[8192], *save = NULL;

    if (read_file("/modules.order", list, sizeof(list)) < 0)
        return;
    for (char *name = strtok_r(list, "\n", &save); name; name = strtok_r(NULL, "\n", &save)) {
        char path[256];

        snprintf(path, sizeof(path), "/modules/%s", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST))
            say("load module %s: %s", name, strerror(errno));
        if (fd >= 0)
            close(fd);
        unlink(path); /* its memory is the kernel's now: free the initramfs copy */
    }
}

/* /dev/pmemN by the PCI address of its device (the host's layer order). */
static int pmem_devices(char names[][16], int want)
{
    char links[64][256];
    int n = 0;

    for (int i = 0; i < 64 && n < want; i++) {
        char p[64];
        ssize_t k;

        snprintf(p, sizeof(p), "/sys/block/pmem%d", i);
        k = readlink(p, links[n], sizeof(links[n]) - 1);
        if (k < 0)
            continue;
        links[n][k] = 0;
        /* "../devices/pci0000:00/0000:00:05.0/virtio3/ndbus0/region0/namespace0.0/block/pmem0":
         * keep the path for sorting, the name after the last slash */
        n++;
    }
    /* insertion sort by the sysfs path (fixed-width hex PCI addresses) */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(links[j - 1], links[j]) > 0; j--) {
            char t[256];
            memcpy(t, links[j], sizeof(t));
            memcpy(links[j], links[j - 1], sizeof(t));
            memcpy(links[j - 1], t, sizeof(t));
        }
    for (int i = 0; i < n; i++)
        snprintf(names[i], 16, "%s", strrchr(links[i], '/') + 1);
    return n;
}

static void die(const char *what)
{
    say("FATAL: %s: %s", what, strerror(errno));
    sync();
    /* PID 1 exits: the guest kernel panics, QEMU exits (-no-reboot), and the
     * host reports the create failed, with this serial log */
    _exit(1);
}

static void mkdirs(const char *const *dirs)
{
    for (; *dirs; dirs++)
        mkdir(*dirs, 0755);
}

/* The cgroup of the guest's processes (cg_procs): cgroup2 mounted in the
 * initramfs, so that no process of the sandbox sees it once the overlay is
 * the root. A guest without it still works; its snapshots stop processes
 * by signals. */
static void make_cgroup(void)
{
    mkdir("/cgroup", 0755);
    if (mount("cgroup2", "/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 ||
        (mkdir("/cgroup/sandbox", 0755) < 0 && errno != EEXIST) ||
        (cg_procs = open("/cgroup/sandbox/cgroup.procs", O_WRONLY | O_CLOEXEC)) < 0 ||
        (cg_freeze = open("/cgroup/sandbox/cgroup.freeze", O_WRONLY | O_CLOEXEC)) < 0 ||
        (cg_events = open("/cgroup/sandbox/cgroup.events", O_RDONLY | O_CLOEXEC)) < 0 ||
        (cg_top = open("/cgroup/cgroup.procs", O_WRONLY | O_CLOEXEC)) < 0) {
        say("no cgroup for the guest's processes (%s): snapshots stop them by signals", strerror(errno));
        close_fd(&cg_top);
        close_fd(&cg_procs);
        close_fd(&cg_freeze);
        close_fd(&cg_events);
    }
}

/* The EROFS uuid of the layer on `dev` (16 bytes at 48 into the superblock,
 * which is at byte 1024), which overlayfs puts in a copied-up file's origin
 * handle: tar_origin_xattrs. Unreadable, it stays null, as a layer built
 * without one: a renamed file of it may then go without its user.* xattrs,
 * which is no reason not to boot. (This kernel has no FS_IOC_GETFSUUID.) */
static void read_layer_uuid(const char *dev, unsigned char uuid[16])
{
    int fd = open(dev, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : pread(fd, uuid, 16, 1024 + 48);

    if (n != 16) {
        if (n >= 0)
            errno = EIO; /* the device ends inside its superblock */
        say("read the uuid of layer %s: %s; its renamed files lose their user.* xattrs in a snapshot", dev,
            strerror(errno));
        memset(uuid, 0, 16);
    }
    if (fd >= 0)
        close(fd);
}

static void mount_root(void)
{
    int nlayers = (int)param_u64("dsec.layers", 0);
    uint64_t disk = param_u64("dsec.disk", 1ull << 30), tmp = param_u64("dsec.tmp", 64ull << 20);
    uint64_t shm = param_u64("dsec.shm", 64ull << 20), inodes = param_u64("dsec.inodes", 0);
    char devs[64][16], opt[8192], lower[4096] = "";
    int found = 0;

    if (nlayers < 1 || nlayers > 64) {
        errno = EINVAL;
        die("dsec.layers must be 1..64");
    }
    /* the pmem namespaces appear asynchronously after the driver loads */
    for (int tries = 0; tries < 500 && (found = pmem_devices(devs, nlayers)) < nlayers; tries++)
        usleep(10000);
    if (found < nlayers) {
        errno = ENODEV;
        die("pmem devices for every layer");
    }
    mkdir("/layers", 0755);
    for (int i = 0; i < nlayers; i++) {
        char dev[64], dir[64];

        snprintf(dev, sizeof(dev), "/dev/%.15s", devs[i]); /* (a devs[] name is at most 15) */
        snprintf(dir, sizeof(dir), "/layers/%d", i);
        mkdir(dir, 0755);
        if (mount(dev, dir, "erofs", MS_RDONLY | MS_NODEV, "dax=always") < 0 &&
            mount(dev, dir, "erofs", MS_RDONLY | MS_NODEV, NULL) < 0)
            die(dev);
        /* not O_PATH: open_by_handle_at takes no O_PATH fd for its mount (EBADF) */
        layerfds[i] = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (layerfds[i] < 0)
            die(dir);
        read_layer_uuid(dev, layer_uuids[i]);
        nlayerfds = i + 1;
        /* overlay's lowerdir: top first, so layer N-1 leads */
        char tmpl[4096];
        snprintf(tmpl, sizeof(tmpl), "%s%s%s", dir, lower[0] ? ":" : "", lower);
        snprintf(lower, sizeof(lower), "%s", tmpl);
    }
    mkdir("/rw", 0755);
    /* nr_inodes=0 would be no cap at all: without the parameter, the kernel's default */
    if (inodes)
        snprintf(opt, sizeof(opt), "size=%llu,nr_inodes=%llu,mode=0755", (unsigned long long)disk,
                 (unsigned long long)inodes);
    else
        snprintf(opt, sizeof(opt), "size=%llu,mode=0755", (unsigned long long)disk);
    if (mount("tmpfs", "/rw", "tmpfs", 0, opt) < 0)
        die("mount the writable tmpfs");
    mkdirs((const char *const[]){"/rw/upper", "/rw/work", "/newroot", NULL});
    upperfd = open("/rw/upper", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (upperfd < 0)
        die("open the writable layer");
    /* redirect_dir=follow, metacopy=off whatever the guest kernel defaults
     * to (CONFIG_OVERLAY_FS_REDIRECT_DIR, _METACOPY): the upper dir becomes
     * a layer (a snapshot's tar, M_TAR), which keeps no redirect and no
     * metacopy (tar_xattr_kept), so a renamed image directory would lose
     * its unchanged files and a chmod'ed image file its data. With these, a
     * rename of an image directory gets EXDEV (mv copies) and a chmod copies
     * the data up, as in a container's overlay (dsecd/native.py). */
    snprintf(opt, sizeof(opt), "lowerdir=%s,upperdir=/rw/upper,workdir=/rw/work,redirect_dir=follow,metacopy=off",
             lower);
    if (mount("overlay", "/newroot", "overlay", 0, opt) < 0)
        die("mount the overlay root");
    mkdirs((const char *const[]){"/newroot/proc", "/newroot/dev", "/newroot/tmp", "/newroot/sys", NULL});
    if (mount("proc", "/newroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        die("mount /proc");
    if (mount("devtmpfs", "/newroot/dev", "devtmpfs", MS_NOSUID, "mode=0755") < 0)
        die("mount /dev");
    mkdirs((const char *const[]){"/newroot/dev/pts", "/newroot/dev/shm", NULL});
    mount("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666");
    snprintf(opt, sizeof(opt), "size=%llu", (unsigned long long)shm);
    mount("tmpfs", "/newroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, opt);
    snprintf(opt, sizeof(opt), "size=%llu,mode=1777", (unsigned long long)tmp);
    if (mount("tmpfs", "/newroot/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opt) < 0)
        die("mount /tmp");
    /* switch_root: the overlay becomes / (the initramfs stays below it) */
    if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
        die("switch to the overlay root");
    rootfd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0)
        die("open /");
}

static int open_channel(void)
{
    for (int tries = 0; tries < 500; tries++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *e;

        while (d && (e = readdir(d))) {
            char p[300], name[64];

            snprintf(p, sizeof(p), "/sys/class/virtio-ports/%s/name", e->d_name);
            if (read_file(p, name, sizeof(name)) < 0 || strcmp(name, "dsec.agent"))
                continue;
            snprintf(p, sizeof(p), "/dev/%s", e->d_name);
            closedir(d);
            int fd = open(p, O_RDWR | O_NONBLOCK | O_CLOEXEC);
            if (fd < 0)
                die(p);
            return fd;
        }
        if (d)
            closedir(d);
        usleep(10000);
    }
    errno = ENODEV;
    die("the virtio-serial port dsec.agent");
    return -1;
}

int main(void)
{
    sigset_t all;
    int sfd;

    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    mkdirs((const char *const[]){"/dev", "/proc", "/sys", NULL});
    mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount("proc", "/proc", "proc", 0, NULL);
    mount("sysfs", "/sys", "sysfs", 0, NULL);
    read_file("/proc/cmdline", cmdline, sizeof(cmdline));
    say("booted; loading modules");
    load_modules();
    chan = open_channel(); /* before the switch: /sys and /dev are the initramfs' */
    make_cgroup();
    mount_root();
    umount2("/sys", MNT_DETACH);
    {
        /* lo, as a container's: the sandbox's own loopback always works */
        int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);

        if (s < 0 || if_flags(s, "lo", IFF_UP) < 0)
            say("set lo up: %s", strerror(errno));
        if (s >= 0)
            close(s);
    }
    say("root mounted; serving");
    sfd = signalfd(-1, &all, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        die("signalfd");
    for (;;) {
        static struct pollfd *p;
        static void **who;        /* the exec or background process of each entry */
        static int *kind;         /* 1, 2: its stdout, stderr; 0: its stdin; +3: of a background process;
                                     -1: an exec's tracer records */
        static size_t room;
        size_t want = 2 + 4 * MAX_EXECS + 3 * nprocs;
        int n = 2;

        if (room < want) {
            p = realloc(p, want * sizeof(*p));
            who = realloc(who, want * sizeof(*who));
            kind = realloc(kind, want * sizeof(*kind));
            if (!p || !who || !kind)
                die("grow the poll set");
            room = want;
        }

        p[0] = (struct pollfd){.fd = sfd, .events = POLLIN};
        p[1] = (struct pollfd){.fd = chan, .events = POLLIN};
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec *x = &execs[i];

            if (!x->pid)
                continue;
            /* A full window: its pipes wait for M_CREDIT (the process blocks
             * on its write); an exited exec's are read by exec_settle, but for
             * the tracer's end. */
            int room = exec_room(x) > 0;
            for (int k = 1; k <= 2; k++)
                if (x->out[k] >= 0 && room && !x->reaped) {
                    p[n] = (struct pollfd){.fd = x->out[k], .events = POLLIN};
                    who[n] = x;
                    kind[n++] = k;
                }
            if (x->out[3] >= 0 && room) {
                p[n] = (struct pollfd){.fd = x->out[3], .events = POLLIN};
                who[n] = x;
                kind[n++] = -1;
            }
            if (x->in >= 0 && x->pend_len) {
                p[n] = (struct pollfd){.fd = x->in, .events = POLLOUT};
                who[n] = x;
                kind[n++] = 0;
            }
        }
        for (size_t i = 0; i < nprocs; i++) {
            struct proc *x = &procs[i];

            if (!x->pid)
                continue;
            for (int k = 1; k <= 2; k++)
                if (x->out[k] >= 0) {
                    p[n] = (struct pollfd){.fd = x->out[k], .events = POLLIN};
                    who[n] = x;
                    kind[n++] = 3 + k;
                }
            if (x->in >= 0 && x->pend_len) {
                p[n] = (struct pollfd){.fd = x->in, .events = POLLOUT};
                who[n] = x;
                kind[n++] = 3;
            }
        }
        if (poll(p, (nfds_t)n, trace_wait_ms()) < 0)
            continue;
        if (p[0].revents) {
            struct signalfd_siginfo si;

            while (read(sfd, &si, sizeof(si)) == sizeof(si))
                ;
            reap();
        }
        for (int i = 2; i < n; i++) {
            if (!p[i].revents)
                continue;
            if (kind[i] >= 3) {
                struct proc *x = who[i];

                if (!x->pid || x->exited)
                    continue; /* freed or ended (its fds closed) in this round */
                if (kind[i] > 3 && x->out[kind[i] - 3] == p[i].fd)
                    proc_read(x, kind[i] - 3, 0);
                else if (kind[i] == 3 && x->in == p[i].fd)
                    proc_flush_stdin(x);
                continue;
            }
            struct exec *x = who[i];

            if (!x->pid)
                continue;
            if (kind[i] < 0 && x->out[3] == p[i].fd)
                forward(x, 3, 0);
            else if (kind[i] > 0 && x->out[kind[i]] == p[i].fd)
                forward(x, kind[i], 0);
            else if (kind[i] == 0 && x->in == p[i].fd)
                flush_stdin(x);
        }
        for (int i = 0; i < MAX_EXECS; i++)
            if (execs[i].pid && execs[i].reaped)
                exec_settle(&execs[i]); /* the tracer's end came, or its wait ran out */
        if (p[1].revents & POLLHUP) {
            /* No host connected. What the port still holds is the rest of
             * what the host that went sent: skipped when the next host's
             * data is read, up to its HELLO (input_stale). */
            host_gone();
            usleep(20000); /* wait for the next host */
        } else if (p[1].revents & POLLIN) {
            if (read_channel() < 0)
                die("read the channel");
        }
        reap(); /* a child may have exited while its pipes were read */
    }
}
