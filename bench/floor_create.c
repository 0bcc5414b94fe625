/* floor_create.c - the kernel's part of a sandbox create and exec, without dsecd.
 *
 *   floor_create LEVEL N ROOTFS CGROUP_PARENTS SECCOMP MNT_DIR
 *
 * Makes N sandboxes one after the other, each the way csrc/spawn.c makes
 * one, up to LEVEL (each level adds to the ones before):
 *
 *   0 ns       a user namespace (dsec_userns_create of csrc/userns.c: a
 *              holder process, its id maps written, its fd kept) and a clone into new mount, pid, uts, ipc, net and
 *              cgroup namespaces; the child enters the user namespace and
 *              execs the host's /bin/true. The work of bench/floors.py's
 *              kernel floor (`unshare --user --map-root-user ...`) without
 *              bash and the unshare binary.
 *   1 cgroups  + a group in each hierarchy of CGROUP_PARENTS (a comma list of
 *              parent dirs, one per hierarchy dsecd uses), its limits written,
 *              joined by the child, removed after the child exited.
 *   2 mounts   + the sandbox's file system: a capped upper tmpfs (detached,
 *              csrc/upperfs.c), idmapped clones of the layer and of the upper
 *              tmpfs (csrc/userns.c), and in the child, under the sandbox
 *              root's fs ids, the clones attached on MNT_DIR and the overlay
 *              over them, /proc with its read-only binds and masks, one
 *              scratch tmpfs for /dev, /dev/shm and /tmp, the device binds,
 *              devpts, the hostname and loopback; nothing unmounted.
 *   3 root     + pivot_root into the overlay and the old root detached; the
 *              child execs /bin/true of ROOTFS (busybox) instead.
 *   4 seccomp  + no_new_privs, capabilities dropped and dsecd's seccomp
 *              profile installed (csrc/seccomp.c, linked in) when SECCOMP
 *              is 1.
 *
 * What dsecd adds on top of level 4: dsec-init's exec and its fork of the
 * exec, the daemon's Python, the client. Prints one line: N, the wall
 * seconds and the CPU seconds of this process and every child it reaped.
 * Everything it mounts is in a mount namespace of its own (gone with it);
 * every cgroup it makes it removes. Built by bench/floors.py with csrc/
 * userns.c, upperfs.c and seccomp.c (-lseccomp).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

#define MAX_GROUPS 8
#define USERNS_BASE 1900000000u /* far above dsecd's default ranges */
#define USERNS_SIZE 65536u

static int level;
static const char *rootfs;
static int use_seccomp;
static char *parents[MAX_GROUPS];
static int n_parents;
static const char *mnt_dir;

static void die(const char *what)
{
    fprintf(stderr, "floor_create: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int userns_make(void)
{
    struct dsec_err err;
    int fd = dsec_userns_create(USERNS_BASE, USERNS_BASE, USERNS_SIZE, &err);

    if (fd < 0) {
        errno = -fd;
        die("user namespace");
    }
    return fd;
}

static int idmapped(const char *path, int userns)
{
    int fd = dsec_mount_idmapped(path, userns);

    if (fd < 0) {
        errno = -fd;
        die(path);
    }
    return fd;
}

static int upper_tmpfs(void)
{
    int mfd = dsec_upperfs_create(1ull << 30, 65536);

    if (mfd < 0) {
        errno = -mfd;
        die("upper tmpfs");
    }
    if (mkdirat(mfd, "upper", 0755) < 0 || mkdirat(mfd, "work", 0755) < 0)
        die("upper dirs");
    return mfd;
}

/* ---- one sandbox -------------------------------------------------------- */

struct one {
    int userns;
    int park[2]; /* the idmapped clones (level 2), attached under the overlay */
    int cg[MAX_GROUPS];
    char overlay[512];
    char hostname[32];
};

/* A failed child step: exit 1 (the parent counts it as a failure). */
#define STEP(x)                                                                                    \
    do {                                                                                           \
        if ((x) < 0)                                                                               \
            _exit(100 + __LINE__ % 100);                                                           \
    } while (0)

static void ro_bind(const char *path)
{
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0) {
        if (errno == ENOENT)
            return;
        _exit(2);
    }
    STEP(mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
               NULL));
}

static void mounts(const struct one *o)
{
    static const char *const masks[] = {
        "proc/kcore", "proc/kpagecount", "proc/kpageflags", "proc/kpagecgroup", "proc/kallsyms",
        "proc/kmsg", "proc/keys", "proc/key-users", "proc/timer_list", "proc/timer_stats",
        "proc/sched_debug", "proc/latency_stats", "proc/vmallocinfo", "proc/slabinfo",
        "proc/config.gz"};
    static const char *const ro[] = {"proc/sys", "proc/sysrq-trigger", "proc/irq", "proc/bus",
                                     "proc/fs"};
    static const char *const nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    char host[32], target[32];
    struct ifreq ifr = {.ifr_name = "lo"};
    int dev, shm, s;

    STEP(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL));
    STEP(dsec_fsids_set(USERNS_BASE, USERNS_BASE));
    /* As csrc/spawn.c: the clones go under the overlay, the scratch's root
     * stays under /dev's clone; nothing is unmounted (each unmount waits for
     * an expedited RCU grace period). */
    for (int i = 0; i < 2; i++)
        STEP((int)syscall(SYS_move_mount, o->park[i], "", AT_FDCWD, mnt_dir, MOVE_MOUNT_F_EMPTY_PATH));
    STEP(mount("overlay", mnt_dir, "overlay", MS_NODEV, o->overlay));
    STEP(chdir(mnt_dir));
    mkdir("proc", 0555);
    mkdir("dev", 0755);
    mkdir("tmp", 01777);
    STEP(mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL));
    STEP(mount("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=134217728"));
    STEP(mkdir("dev/dev", 0755));
    STEP(mkdir("dev/shm", 01777));
    STEP(mkdir("dev/tmp", 01777));
    STEP(mkdir("dev/empty", 0555));
    STEP(mount("dev/tmp", "tmp", NULL, MS_BIND, NULL));
    dev = (int)syscall(SYS_open_tree, AT_FDCWD, "dev/dev", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    shm = (int)syscall(SYS_open_tree, AT_FDCWD, "dev/shm", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    STEP(dev);
    STEP(shm);
    STEP((int)syscall(SYS_move_mount, dev, "", AT_FDCWD, "dev", MOVE_MOUNT_F_EMPTY_PATH));
    for (size_t i = 0; i < sizeof(nodes) / sizeof(nodes[0]); i++) {
        int fd;

        snprintf(host, sizeof(host), "/dev/%s", nodes[i]);
        snprintf(target, sizeof(target), "dev/%s", nodes[i]);
        fd = open(target, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        STEP(fd);
        close(fd);
        STEP(mount(host, target, NULL, MS_BIND, NULL));
    }
    STEP(mkdir("dev/pts", 0755));
    STEP(mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"));
    STEP(mkdir("dev/shm", 01777));
    STEP((int)syscall(SYS_move_mount, shm, "", AT_FDCWD, "dev/shm", MOVE_MOUNT_F_EMPTY_PATH));
    STEP(symlink("pts/ptmx", "dev/ptmx"));
    STEP(symlink("/proc/self/fd", "dev/fd"));
    for (size_t i = 0; i < sizeof(ro) / sizeof(ro[0]); i++)
        ro_bind(ro[i]);
    for (size_t i = 0; i < sizeof(masks) / sizeof(masks[0]); i++)
        if (mount("dev/null", masks[i], NULL, MS_BIND, NULL) < 0 && errno != ENOENT)
            _exit(3);
    STEP(sethostname(o->hostname, strlen(o->hostname)));
    s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    STEP(s);
    STEP(ioctl(s, SIOCGIFFLAGS, &ifr));
    ifr.ifr_flags |= IFF_UP;
    STEP(ioctl(s, SIOCSIFFLAGS, &ifr));
    close(s);
}

static void privileges_drop(void)
{
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3};
    struct __user_cap_data_struct data[2] = {{0}};

    STEP(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0));
    for (int cap = 0; cap <= 40; cap++)
        if (cap != 0 && cap != 1 && cap != 3 && cap != 5 && cap != 6 && cap != 7 && cap != 8)
            prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
    data[0].permitted = (1u << 0) | (1u << 1) | (1u << 3) | (1u << 5) | (1u << 6) | (1u << 7) | (1u << 8);
    STEP((int)syscall(SYS_capset, &hdr, data));
    if (use_seccomp && dsec_seccomp_install(0) < 0)
        _exit(4);
}

static int child(void *arg)
{
    const struct one *o = arg;
    static char *const argv[] = {"true", NULL};
    static char *const envp[] = {NULL};

    for (int i = 0; level >= 1 && i < n_parents; i++)
        STEP((int)write(o->cg[i], "0", 1));
    STEP(unshare(CLONE_NEWCGROUP));
    if (level >= 2)
        mounts(o);
    if (level >= 3) {
        STEP((int)syscall(SYS_pivot_root, ".", "."));
        STEP(umount2(".", MNT_DETACH));
        STEP(chdir("/"));
    }
    STEP(setns(o->userns, CLONE_NEWUSER));
    STEP((int)syscall(SYS_setgroups, 0, NULL));
    STEP((int)syscall(SYS_setresgid, 0, 0, 0));
    STEP((int)syscall(SYS_setresuid, 0, 0, 0));
    if (level >= 4)
        privileges_drop();
    execve("/bin/true", argv, envp);
    _exit(5);
}

static void write_file(const char *dir, const char *name, const char *value)
{
    char path[512];
    int fd;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return; /* e.g. memsw without swap accounting */
        die(path);
    }
    if (write(fd, value, strlen(value)) < 0)
        die(path);
    close(fd);
}

static int one_sandbox(int i)
{
    static char stack[65536] __attribute__((aligned(16)));
    struct one o;
    char dirs[MAX_GROUPS][512];
    int fds[4], n_fds = 0, status;
    pid_t pid;

    snprintf(o.hostname, sizeof(o.hostname), "sb-floor-%d", i);
    o.userns = userns_make();
    fds[n_fds++] = o.userns;
    for (int g = 0; level >= 1 && g < n_parents; g++) {
        char procs[600];

        snprintf(dirs[g], sizeof(dirs[g]), "%s/c%d", parents[g], i);
        if (mkdir(dirs[g], 0755) < 0)
            die(dirs[g]);
        /* dsecd's limits of a burst sandbox (cpu 0.1, 64M); each hierarchy
         * has the files of its controllers only (the rest: ENOENT, skipped). */
        write_file(dirs[g], "cpu.shares", "102");
        write_file(dirs[g], "cpu.weight", "10");
        write_file(dirs[g], "memory.limit_in_bytes", "67108864");
        write_file(dirs[g], "memory.memsw.limit_in_bytes", "134217728");
        write_file(dirs[g], "memory.max", "67108864");
        write_file(dirs[g], "pids.max", "4096");
        snprintf(procs, sizeof(procs), "%s/cgroup.procs", dirs[g]);
        o.cg[g] = open(procs, O_WRONLY | O_CLOEXEC);
        if (o.cg[g] < 0)
            die(procs);
    }
    if (level >= 2) {
        char path[64];
        int up = upper_tmpfs(), low = idmapped(rootfs, o.userns), top;

        snprintf(path, sizeof(path), "/proc/self/fd/%d", up);
        top = idmapped(path, o.userns);

        close(up);
        fds[n_fds++] = o.park[0] = low;
        fds[n_fds++] = o.park[1] = top;
        snprintf(o.overlay, sizeof(o.overlay),
                 "lowerdir=/proc/self/fd/%d,upperdir=/proc/self/fd/%d/upper,workdir=/proc/self/fd/%d/work",
                 low, top, top);
    }
    pid = clone(child, stack + sizeof(stack),
                CLONE_VM | CLONE_VFORK | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC |
                    CLONE_NEWNET | SIGCHLD,
                &o);
    if (pid < 0)
        die("clone");
    if (waitpid(pid, &status, 0) < 0)
        die("waitpid");
    for (int f = 0; f < n_fds; f++)
        close(fds[f]);
    for (int g = 0; level >= 1 && g < n_parents; g++) {
        close(o.cg[g]);
        while (rmdir(dirs[g]) < 0) {
            if (errno != EBUSY)
                die(dirs[g]);
            usleep(100);
        }
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "floor_create: sandbox %d: child status %#x\n", i, status);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct timespec t0, t1;
    struct rusage self, kids;
    int n, failed = 0;
    char *list, *tok;

    if (argc != 7) {
        fprintf(stderr, "usage: floor_create LEVEL N ROOTFS CGROUP_PARENTS SECCOMP MNT_DIR\n");
        return 2;
    }
    level = atoi(argv[1]);
    n = atoi(argv[2]);
    rootfs = argv[3];
    use_seccomp = atoi(argv[5]);
    mnt_dir = argv[6];
    list = argv[4];
    for (tok = strtok(list, ","); tok && n_parents < MAX_GROUPS; tok = strtok(NULL, ","))
        parents[n_parents++] = tok;
    if (use_seccomp && dsec_seccomp_build(0) < 0)
        die("seccomp build");
    if (level >= 2) {
        /* A mount namespace of this process's own: the overlay is mounted
         * on MNT_DIR in each child's copy of it only. */
        if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
            die("private mount namespace");
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n; i++)
        if (one_sandbox(i) < 0 && ++failed > 3)
            break;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    getrusage(RUSAGE_SELF, &self);
    getrusage(RUSAGE_CHILDREN, &kids);
    printf("%d %.6f %.6f\n", failed ? -1 : n, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9,
           self.ru_utime.tv_sec + self.ru_stime.tv_sec + kids.ru_utime.tv_sec + kids.ru_stime.tv_sec +
               (self.ru_utime.tv_usec + self.ru_stime.tv_usec + kids.ru_utime.tv_usec +
                kids.ru_stime.tv_usec) / 1e6);
    return failed ? 1 : 0;
}
