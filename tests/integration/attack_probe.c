/* attack_probe.c - one attack (or its allowed neighbour) per invocation, run
 * inside a sandbox by the adversarial suite (tests/integration/test_attack_*.py).
 *
 * Busybox's applets report failures as free text, if at all; the suite needs
 * the exact errno of the one syscall that matters. Each action does that
 * syscall and prints `ok` or the errno's name (EPERM, ENOENT, ...) as its
 * last line, sometimes preceded by key=value facts. Built static, so it runs
 * in any image. Exit status 0 unless the arguments are wrong (2).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/io_uring.h>
#include <linux/perf_event.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <dirent.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#define XFS_IOC_SWAPEXT 0xC0C0586Du   /* _IOWR('X', 109, struct xfs_swapext) */
#define EXT4_IOC_MOVE_EXT 0xC028660Fu /* _IOWR('f', 15, struct move_extent) */

static int report(long rc)
{
    if (rc < 0)
        printf("%s\n", strerrorname_np(errno));
    else
        printf("ok\n");
    return 0;
}

static int a_mount(char **v) { return report(mount("none", v[0], "tmpfs", 0, NULL)); }
static int a_umount(char **v) { return report(umount2(v[0], MNT_DETACH)); }
static int a_pivot_root(char **v) { return report(syscall(SYS_pivot_root, v[0], v[1])); }
static int a_open(char **v) { return report(open(v[0], O_RDONLY | O_NONBLOCK)); }
static int a_open_rw(char **v) { return report(open(v[0], O_RDWR | O_NONBLOCK)); }
static int a_stat(char **v)
{
    struct stat st;

    return report(stat(v[0], &st));
}

/* The classic: chroot into a subdir, walk `..` far past it, chroot there.
 * Works against a plain chroot(2) jail; a pivot_root'ed sandbox whose old
 * root is detached has nothing above its /. Prints what the escaped process
 * sees at v[1] (a host-only path). */
static int a_chroot_escape(char **v)
{
    mkdir(v[0], 0755);
    if (chroot(v[0]) < 0) {
        printf("chroot=%s\n", strerrorname_np(errno));
        return report(-1);
    }
    printf("chroot=ok\n");
    for (int i = 0; i < 256; i++)
        if (chdir("..") < 0)
            break;
    if (chroot(".") < 0)
        return report(-1);
    return a_stat(v + 1);
}

static int a_ptrace(char **v) { return report(ptrace(PTRACE_ATTACH, atoi(v[0]), 0, 0)); }

static int a_vm_read(char **v)
{
    char buf[8];
    struct iovec local = {buf, sizeof(buf)}, remote = {(void *)0x400000, sizeof(buf)};

    return report(process_vm_readv(atoi(v[0]), &local, 1, &remote, 1, 0));
}

static int a_kill(char **v) { return report(kill(atoi(v[0]), atoi(v[1]))); }

static int a_socket(char **v)
{
    static const struct { const char *name; int domain, type, proto; } kinds[] = {
        {"raw_icmp", AF_INET, SOCK_RAW, IPPROTO_ICMP},
        {"raw6", AF_INET6, SOCK_RAW, IPPROTO_ICMPV6},
        {"packet", AF_PACKET, SOCK_RAW, 0},
        {"udp", AF_INET, SOCK_DGRAM, 0},
        {"tcp", AF_INET, SOCK_STREAM, 0},
        {"vsock", AF_VSOCK, SOCK_STREAM, 0},
    };

    /* The family with bits above the 32 the kernel reads (it takes an int). */
    if (!strcmp(v[0], "vsock_high_bits"))
        return report(syscall(SYS_socket, (1L << 32) | AF_VSOCK, SOCK_STREAM, 0));

    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if (!strcmp(v[0], kinds[i].name))
            return report(socket(kinds[i].domain, kinds[i].type, kinds[i].proto));
    return 2;
}

static int a_mknod(char **v)
{
    mode_t type = v[1][0] == 'b' ? S_IFBLK : v[1][0] == 'c' ? S_IFCHR : S_IFIFO;

    return report(mknod(v[0], type | 0600, makedev(atoi(v[2]), atoi(v[3]))));
}

static int a_setns(char **v)
{
    int fd = open(v[0], O_RDONLY);

    if (fd < 0)
        return report(-1);
    return report(setns(fd, 0));
}

static int a_unshare(char **v)
{
    int flag = !strcmp(v[0], "user") ? CLONE_NEWUSER : !strcmp(v[0], "net") ? CLONE_NEWNET
             : !strcmp(v[0], "mnt") ? CLONE_NEWNS : !strcmp(v[0], "files") ? CLONE_FILES : -1;

    if (flag < 0)
        return 2;
    return report(unshare(flag));
}

static int a_init_module(char **v)
{
    (void)v;
    return report(syscall(SYS_init_module, "\x7f" "ELF", 4, ""));
}

static int a_finit_module(char **v)
{
    int fd = open("/bin/sh", O_RDONLY);

    (void)v;
    return report(syscall(SYS_finit_module, fd, "", 0));
}

static int a_delete_module(char **v) { return report(syscall(SYS_delete_module, v[0], O_NONBLOCK)); }

static int a_bpf(char **v)
{
    union bpf_attr attr;

    (void)v;
    memset(&attr, 0, sizeof(attr));
    attr.map_type = BPF_MAP_TYPE_ARRAY;
    attr.key_size = 4;
    attr.value_size = 4;
    attr.max_entries = 1;
    return report(syscall(SYS_bpf, BPF_MAP_CREATE, &attr, sizeof(attr)));
}

static int a_perf(char **v)
{
    struct perf_event_attr attr;

    (void)v;
    memset(&attr, 0, sizeof(attr));
    attr.size = sizeof(attr);
    attr.type = PERF_TYPE_SOFTWARE;
    attr.config = PERF_COUNT_SW_TASK_CLOCK;
    attr.exclude_kernel = 1;
    return report(syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
}

static int a_io_uring(char **v)
{
    struct io_uring_params p;

    (void)v;
    memset(&p, 0, sizeof(p));
    return report(syscall(SYS_io_uring_setup, 8, &p));
}

/* A pty of the sandbox's own devpts: TIOCSTI pushes input into it (into
 * another session's terminal, in the attack); TCGETS is the neighbour. */
static int a_tty_ioctl(char **v)
{
    int fd = open("/dev/ptmx", O_RDWR | O_NOCTTY);
    struct termios t;
    char c = 'x';

    if (fd < 0)
        return report(-1);
    if (!strcmp(v[0], "tiocsti"))
        return report(ioctl(fd, TIOCSTI, &c));
    return report(ioctl(fd, TCGETS, &t));
}

/* Extent-swapping ioctls on a file of the sandbox: the filter refuses them
 * before the file system looks at the (garbage) argument; FIONREAD is the
 * neighbour. */
static int a_file_ioctl(char **v)
{
    char buf[256] = {0};
    int fd = open(v[1], O_RDWR | O_CREAT, 0600), n;

    if (fd < 0)
        return report(-1);
    if (!strcmp(v[0], "xfs_swapext"))
        return report(ioctl(fd, XFS_IOC_SWAPEXT, buf));
    if (!strcmp(v[0], "ext4_move_ext"))
        return report(ioctl(fd, EXT4_IOC_MOVE_EXT, buf));
    return report(ioctl(fd, FIONREAD, &n));
}

static int a_open_by_handle(char **v)
{
    struct { struct file_handle h; unsigned char bytes[64]; } fh;

    (void)v;
    memset(&fh, 0, sizeof(fh));
    fh.h.handle_bytes = 8;
    fh.h.handle_type = 1;
    return report(syscall(SYS_open_by_handle_at, AT_FDCWD, &fh, O_RDONLY));
}

/* File descriptors a sandbox process inherits beyond stdio: any daemon fd
 * here (its socket, the journal) would be a way to speak for it. */
static int a_fds(char **v)
{
    int extra = 0;

    (void)v;
    for (int fd = 3; fd < 65536; fd++)
        if (fcntl(fd, F_GETFD) >= 0) {
            char link[64], target[512] = "";

            snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
            readlink(link, target, sizeof(target) - 1);
            printf("fd=%d target=%s\n", fd, target);
            extra++;
        }
    printf("extra=%d\n", extra);
    return report(0);
}

/* Fork until refused; the children wait for a pipe to close, then exit. */
static int a_forkbomb(char **v)
{
    int max = atoi(v[0]), n = 0, p[2];

    if (pipe(p) < 0)
        return report(-1);
    for (; n < max; n++) {
        pid_t pid = fork();

        if (pid < 0)
            break;
        if (pid == 0) {
            char c;

            close(p[1]);
            read(p[0], &c, 1);
            _exit(0);
        }
    }
    int err = errno;

    close(p[1]);
    while (wait(NULL) > 0)
        ;
    printf("forked=%d\n", n);
    errno = err;
    return report(n < max ? -1 : 0);
}

/* Touch MiB of anonymous memory one page at a time. */
static int a_alloc(char **v)
{
    size_t size = (size_t)atol(v[0]) << 20;
    char *p = malloc(size);

    if (p == NULL)
        return report(-1);
    for (size_t i = 0; i < size; i += 4096)
        p[i] = 1;
    return report(0);
}

/* Create empty files in a directory until refused (or max). */
static int a_files(char **v)
{
    int max = atoi(v[1]), n = 0;
    char path[4096];

    for (; n < max; n++) {
        snprintf(path, sizeof(path), "%s/f%d", v[0], n);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);

        if (fd < 0)
            break;
        close(fd);
    }
    int err = errno;

    printf("created=%d\n", n);
    errno = err;
    return report(n < max ? -1 : 0);
}

/* HOST (IPv4, or IPv6 with an optional %IFNAME scope) and PORT as a sockaddr;
 * its length. */
static socklen_t inet_addr_of(const char *host, const char *port, struct sockaddr_storage *ss)
{
    char buf[64];
    char *scope;

    memset(ss, 0, sizeof(*ss));
    if (!strchr(host, ':')) {
        struct sockaddr_in *sa = (struct sockaddr_in *)ss;

        sa->sin_family = AF_INET;
        sa->sin_port = htons(atoi(port));
        inet_pton(AF_INET, host, &sa->sin_addr);
        return sizeof(*sa);
    }
    struct sockaddr_in6 *sa6 = (struct sockaddr_in6 *)ss;

    snprintf(buf, sizeof(buf), "%s", host);
    scope = strchr(buf, '%');
    if (scope) {
        *scope++ = 0;
        sa6->sin6_scope_id = if_nametoindex(scope);
    }
    sa6->sin6_family = AF_INET6;
    sa6->sin6_port = htons(atoi(port));
    inet_pton(AF_INET6, buf, &sa6->sin6_addr);
    return sizeof(*sa6);
}

static int a_connect(char **v)
{
    struct sockaddr_storage ss;
    socklen_t len = inet_addr_of(v[0], v[1], &ss);
    int fd = socket(ss.ss_family, SOCK_STREAM, 0);

    return report(connect(fd, (struct sockaddr *)&ss, len));
}

/* One UDP datagram to HOST PORT, broadcast allowed (SO_BROADCAST). */
static int a_udp(char **v)
{
    struct sockaddr_storage ss;
    socklen_t len = inet_addr_of(v[0], v[1], &ss);
    int fd = socket(ss.ss_family, SOCK_DGRAM, 0), one = 1;

    setsockopt(fd, SOL_SOCKET, SO_BROADCAST, &one, sizeof(one));
    return report(sendto(fd, "probe", 5, 0, (struct sockaddr *)&ss, len));
}

/* A UDP echo server on PORT of every address, for good: each datagram goes
 * back to its sender from PORT (unconnected: a sendto per datagram, which the
 * sandbox's sendmsg hook decides on). Prints the errno of the sendto that
 * failed, if one did, and goes on. */
static int udp_echo_on(int fd, struct sockaddr *me, socklen_t me_len)
{
    int one = 1;

    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));   /* udp_from may send from PORT too */
    if (fd < 0 || bind(fd, me, me_len) < 0)
        return report(-1);
    for (;;) {
        char buf[2048];
        struct sockaddr_storage peer;
        socklen_t len = sizeof(peer);
        ssize_t n = recvfrom(fd, buf, sizeof(buf), 0, (struct sockaddr *)&peer, &len);

        if (n >= 0 && sendto(fd, buf, n, 0, (struct sockaddr *)&peer, len) < 0) {
            printf("%s\n", strerrorname_np(errno));
            fflush(stdout);
        }
    }
}

static int a_udp_echo(char **v)
{
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(atoi(v[0]))};

    return udp_echo_on(socket(AF_INET, SOCK_DGRAM, 0), (struct sockaddr *)&me, sizeof(me));
}

/* udp_echo over IPv6 only (IPV6_V6ONLY), on every IPv6 address. */
static int a_udp6_echo(char **v)
{
    struct sockaddr_in6 me = {.sin6_family = AF_INET6, .sin6_port = htons(atoi(v[0])), .sin6_addr = IN6ADDR_ANY_INIT};
    int fd = socket(AF_INET6, SOCK_DGRAM, 0), one = 1;

    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    return udp_echo_on(fd, (struct sockaddr *)&me, sizeof(me));
}

/* A UDP server on PORT that answers its first client over a connected
 * socket (connect() to the client, then send(): what udpsvd and `nc -u -l`
 * do), once; prints the errno of the connect or send that failed, else ok. */
static int a_udp_echo_connected(char **v)
{
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(atoi(v[0]))};
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    char buf[2048];
    struct sockaddr_storage peer;
    socklen_t len = sizeof(peer);

    if (fd < 0 || bind(fd, (struct sockaddr *)&me, sizeof(me)) < 0)
        return report(-1);
    ssize_t n = recvfrom(fd, buf, sizeof(buf), 0, (struct sockaddr *)&peer, &len);
    if (n < 0 || connect(fd, (struct sockaddr *)&peer, len) < 0)
        return report(-1);
    return report(send(fd, buf, n, 0));
}

/* One UDP datagram from the sandbox's port SRC (shared with a udp_echo server
 * there: SO_REUSEPORT) to HOST PORT. */
static int a_udp_from(char **v)
{
    struct sockaddr_storage ss;
    socklen_t len = inet_addr_of(v[1], v[2], &ss);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(atoi(v[0]))};
    int fd = socket(AF_INET, SOCK_DGRAM, 0), one = 1;

    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&me, sizeof(me)) < 0)
        return report(-1);
    return report(sendto(fd, "probe", 5, 0, (struct sockaddr *)&ss, len));
}

/* Task policies (test_task_policies.py): the file operations Landlock checks, one
 * syscall each. */
static int a_list(char **v)
{
    DIR *d = opendir(v[0]);

    if (!d)
        return report(-1);
    errno = 0;
    while (readdir(d))
        ;
    closedir(d);
    return report(errno ? -1 : 0);
}
static int a_rename(char **v) { return report(rename(v[0], v[1])); }
static int a_link(char **v) { return report(link(v[0], v[1])); }
static int a_symlink(char **v) { return report(symlink(v[0], v[1])); }
static int a_truncate(char **v) { return report(truncate(v[0], 0)); }
static int a_mkdir(char **v) { return report(mkdir(v[0], 0755)); }

/* An abstract unix socket address "@NAME" (no file, no permission bits: what
 * LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET scopes). */
static socklen_t abstract_addr(struct sockaddr_un *sa, const char *name)
{
    size_t n = strlen(name);

    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    if (n > sizeof(sa->sun_path) - 1)
        n = sizeof(sa->sun_path) - 1;
    memcpy(sa->sun_path + 1, name, n);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* Listen on @NAME, say so, accept one connection and say that. */
static int a_ulisten(char **v)
{
    struct sockaddr_un sa;
    socklen_t len = abstract_addr(&sa, v[0]);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);

    if (bind(fd, (struct sockaddr *)&sa, len) < 0 || listen(fd, 8) < 0)
        return report(-1);
    printf("listening\n");
    fflush(stdout);
    int c = accept(fd, NULL, NULL);

    printf("accepted\n");
    return report(c);
}

static int a_uconnect(char **v)
{
    struct sockaddr_un sa;
    socklen_t len = abstract_addr(&sa, v[0]);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);

    return report(connect(fd, (struct sockaddr *)&sa, len));
}

/* Listen on @NAME and connect to it from the same process: a socket of the
 * caller's own is in its own scope. */
static int a_uself(char **v)
{
    struct sockaddr_un sa;
    socklen_t len = abstract_addr(&sa, v[0]);
    int l = socket(AF_UNIX, SOCK_STREAM, 0), c = socket(AF_UNIX, SOCK_STREAM, 0);

    if (bind(l, (struct sockaddr *)&sa, len) < 0 || listen(l, 1) < 0)
        return report(-1);
    return report(connect(c, (struct sockaddr *)&sa, len));
}

/* Fork a child that waits, then SIGTERM it: a process of the caller's own. */
static int a_fork_kill(char **v)
{
    (void)v;
    pid_t pid = fork();

    if (pid == 0) {
        pause();
        _exit(0);
    }
    int rc = kill(pid, SIGTERM);
    int err = errno;

    waitpid(pid, NULL, 0);
    errno = err;
    return report(rc);
}

/* N children made with clone(CLONE_PARENT): they are our parent's, not
 * ours. Each sleeps SECS seconds (0: exits at once), in a session of its
 * own if SETSID is 1. */
static int a_clone_parent(char **v)
{
    int n = atoi(v[0]), secs = atoi(v[1]), own_session = atoi(v[2]);

    for (int i = 0; i < n; i++) {
        long pid = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);

        if (pid < 0)
            return report(-1);
        if (pid == 0) {
            if (own_session)
                setsid();
            if (secs)
                sleep((unsigned)secs);
            _exit(0);
        }
    }
    return report(0);
}

/* Listen on PORT of every address of the sandbox, say so, then accept one
 * connection and say that. */
static int a_listen(char **v)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(v[0]))};
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;

    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 8) < 0)
        return report(-1);
    printf("listening\n");
    fflush(stdout);
    int c = accept(fd, NULL, NULL);

    printf("accepted\n");
    return report(c);
}

/* Take the fd of process PID whose /proc link names MATCH (pidfd_getfd:
 * what root in a microVM guest can do to its agent, PID 1, and the
 * virtio-serial port it holds), then write what stdin holds (at most 32 KiB,
 * one virtio-serial write: frames in it arrive whole, never split by the
 * agent's own writes) to it REPEAT times, 0: until a write fails. The bytes
 * go to the host as if the agent sent them. Prints fd=N, then written=BYTES. */
static int a_fd_inject(char **v)
{
    char dir[64], path[320], link[256];
    int target = -1, pidfd = (int)syscall(SYS_pidfd_open, atoi(v[0]), 0);
    long repeat = atol(v[2]);

    if (pidfd < 0)
        return report(-1);
    snprintf(dir, sizeof(dir), "/proc/%s/fd", v[0]);
    DIR *d = opendir(dir);
    struct dirent *e;

    while (d && (e = readdir(d))) {
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        ssize_t n = readlink(path, link, sizeof(link) - 1);
        if (n > 0 && (link[n] = 0, strstr(link, v[1]))) {
            target = atoi(e->d_name);
            break;
        }
    }
    if (d)
        closedir(d);
    if (target < 0) {
        errno = ENOENT;
        return report(-1);
    }
    int fd = (int)syscall(SYS_pidfd_getfd, pidfd, target, 0);

    if (fd < 0)
        return report(-1);
    printf("fd=%d\n", target);
    fflush(stdout);
    static char buf[32768];
    size_t len = 0;
    ssize_t n;

    while (len < sizeof(buf) && (n = read(0, buf + len, sizeof(buf) - len)) > 0)
        len += (size_t)n;
    long long written = 0;
    /* The agent's file description is non-blocking (this fd shares it, so it
     * stays so): wait for room with poll. */
    for (long i = 0; repeat == 0 || i < repeat; i++) {
        ssize_t w;
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};

        while ((w = write(fd, buf, len)) < 0 && errno == EAGAIN)
            poll(&pfd, 1, 1000);
        if (w < 0)
            break;
        written += w;
    }
    int err = errno;

    printf("written=%lld\n", written);
    errno = err;
    return report(repeat == 0 || written < (long long)len * repeat ? -1 : 0);
}

static const struct { const char *name; int nargs; int (*fn)(char **); } actions[] = {
    {"mount", 1, a_mount}, {"umount", 1, a_umount}, {"pivot_root", 2, a_pivot_root},
    {"open", 1, a_open}, {"open_rw", 1, a_open_rw}, {"stat", 1, a_stat},
    {"chroot_escape", 2, a_chroot_escape}, {"ptrace", 1, a_ptrace}, {"vm_read", 1, a_vm_read},
    {"kill", 2, a_kill}, {"socket", 1, a_socket}, {"mknod", 4, a_mknod}, {"setns", 1, a_setns},
    {"unshare", 1, a_unshare}, {"init_module", 0, a_init_module},
    {"finit_module", 0, a_finit_module}, {"delete_module", 1, a_delete_module}, {"bpf", 0, a_bpf},
    {"perf_event_open", 0, a_perf}, {"io_uring", 0, a_io_uring}, {"tty_ioctl", 1, a_tty_ioctl},
    {"file_ioctl", 2, a_file_ioctl}, {"open_by_handle_at", 0, a_open_by_handle}, {"fds", 0, a_fds},
    {"forkbomb", 1, a_forkbomb}, {"alloc", 1, a_alloc}, {"files", 2, a_files},
    {"connect", 2, a_connect}, {"udp", 2, a_udp}, {"udp_echo", 1, a_udp_echo}, {"udp6_echo", 1, a_udp6_echo}, {"udp_from", 3, a_udp_from}, {"udp_echo_connected", 1, a_udp_echo_connected}, {"listen", 1, a_listen}, {"list", 1, a_list}, {"rename", 2, a_rename},
    {"link", 2, a_link}, {"symlink", 2, a_symlink}, {"truncate", 1, a_truncate}, {"mkdir", 1, a_mkdir},
    {"ulisten", 1, a_ulisten}, {"uconnect", 1, a_uconnect}, {"uself", 1, a_uself},
    {"fork_kill", 0, a_fork_kill}, {"fd_inject", 3, a_fd_inject}, {"clone_parent", 3, a_clone_parent},
};

int main(int argc, char **argv)
{
    for (size_t i = 0; argc > 1 && i < sizeof(actions) / sizeof(actions[0]); i++)
        if (!strcmp(argv[1], actions[i].name)) {
            if (argc - 2 != actions[i].nargs)
                break;
            return actions[i].fn(argv + 2);
        }
    fprintf(stderr, "usage: attack_probe ACTION ARGS... (see the table in attack_probe.c)\n");
    return 2;
}
