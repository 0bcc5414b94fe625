/* policy_steps.h - a task policy (dsecd/policy.py) as a Landlock ruleset:
 * built (policy_build), and applied to the calling process before execve of
 * an exec (policy_restrict). Shared by dsec-init (init.c: it builds a plan's
 * ruleset once and keeps it while policy_sign says its paths are unchanged;
 * each exec child then only restricts itself) and the daemon's exec helper
 * (spawn.c: policy_apply, a build per exec).
 *
 * The daemon compiles a policy into a plan (struct dsec_policy_head, its
 * ports, then its paths; dsec_native.h): the rights the ruleset handles, one
 * rule per TCP port, and path entries of two kinds:
 *
 *   DSEC_POLICY_RULE      grant `access` on `path` (on all beneath it, for a
 *                         directory)
 *   DSEC_POLICY_CHILDREN  grant `access` on every entry of the directory
 *                         `path` but the names that follow it: how a path gets
 *                         fewer rights than its parent (a hidden /grader under
 *                         a read-only /), since a Landlock rule on a directory
 *                         can never be taken back below it
 *
 * Every path is resolved from the process's root (the sandbox's) with
 * RESOLVE_NO_SYMLINKS: a named path, or an excepted name, that is a symlink
 * fails the exec with ELOOP, because granting its target instead of it could
 * give a hidden path's rights away (a hidden /grader -> /opt/g whose
 * /opt got read_only). A path that does not exist is skipped: there is
 * nothing to grant, and its parent's rights say what may be made there.
 * Entries of a CHILDREN directory that are symlinks get no rule (a rule on
 * the link would be on the link's own inode; its target has its own).
 *
 * Everything here is async-signal-safe and allocation-free (init is static
 * and allocates nothing; the helper's child shares the daemon's memory): the plan is read with memcpy, the
 * directory with getdents64 into a stack buffer. The exec's later execve
 * must be allowed by the policy itself (EXECUTE on the program); everything
 * it forks inherits the domain. Needs no_new_privs (set for init and every
 * exec child) and a kernel with the Landlock ABI the daemon checked.
 */
#ifndef DSEC_POLICY_STEPS_H
#define DSEC_POLICY_STEPS_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

/* linux/landlock.h of Linux 6.12 (ABI 6), spelled out: Debian 12's headers
 * (Linux 6.1) lack the net and scope fields. */
struct dsec_landlock_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct dsec_landlock_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

struct dsec_landlock_net_port_attr {
    uint64_t allowed_access;
    uint64_t port;
};

#define DSEC_LANDLOCK_RULE_PATH_BENEATH 1
#define DSEC_LANDLOCK_RULE_NET_PORT 2
/* What a rule on a non-directory may carry: EXECUTE, WRITE_FILE, READ_FILE,
 * TRUNCATE (the kernel refuses directory rights there, EINVAL). */
#define DSEC_LANDLOCK_FS_FILE ((1ULL << 0) | (1ULL << 1) | (1ULL << 2) | (1ULL << 14))

struct dsec_open_how_policy {
    uint64_t flags;
    uint64_t mode;
    uint64_t resolve;
};

#define DSEC_POLICY_RESOLVE (RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH)

/* `path` (absolute) opened from the root fd, no symlink followed; "/" is the root itself. */
static inline int policy_open(int root, const char *path, uint64_t flags)
{
    struct dsec_open_how_policy how = {.flags = flags | O_CLOEXEC, .resolve = DSEC_POLICY_RESOLVE};
    const char *rel = path[1] ? path + 1 : ".";

    return (int)syscall(SYS_openat2, root, rel, &how, sizeof(how));
}

/* A path that is not there (or not a directory where one is needed) is
 * skipped; any other failure fails the exec. */
static inline int policy_absent(int err)
{
    return err == ENOENT || err == ENOTDIR;
}

/* One path-beneath rule: access on fd (and beneath it); none if access is 0. */
static inline int policy_add(int ruleset, int fd, uint64_t access, const char *path, struct dsec_err *e)
{
    struct dsec_landlock_path_beneath_attr rule = {.allowed_access = access, .parent_fd = fd};

    if (!access)
        return 0;
    return check(syscall(SYS_landlock_add_rule, ruleset, DSEC_LANDLOCK_RULE_PATH_BENEATH, &rule, 0), e,
                 DSEC_STEP_LANDLOCK, path);
}

/* A rule on fd, whatever it is: access is narrowed to file rights for a
 * non-directory, a symlink gets none. Returns 0 or -1 with e filled. */
static inline int policy_grant(int ruleset, int fd, uint64_t access, const char *path, struct dsec_err *e)
{
    struct stat st;

    if (check(fstat(fd, &st), e, DSEC_STEP_LANDLOCK, path) < 0)
        return -1;
    if (S_ISLNK(st.st_mode))
        return 0;
    return policy_add(ruleset, fd, S_ISDIR(st.st_mode) ? access : access & DSEC_LANDLOCK_FS_FILE, path, e);
}

/* Like err_set, with "dir/name" as the path (cut at the buffer's size). */
static inline void policy_err_at(struct dsec_err *e, int err, const char *dir, const char *name)
{
    size_t i = 0;

    for (; dir[i] && i < sizeof(e->path) - 1; i++)
        e->path[i] = dir[i];
    if (i > 1 && i < sizeof(e->path) - 1) /* not after "/" */
        e->path[i++] = '/';
    for (; *name && i < sizeof(e->path) - 1; name++)
        e->path[i++] = *name;
    e->path[i] = '\0';
    e->err = err;
    e->step = DSEC_STEP_LANDLOCK;
}

/* Whether at least n NUL-terminated strings start at s within len bytes. */
static inline int policy_strings_fit(const char *s, size_t len, uint32_t n)
{
    for (size_t i = 0; n && i < len; i++)
        if (s[i] == '\0')
            n--;
    return n == 0;
}

/* Whether name is one of the n NUL-terminated names at names. */
static inline int policy_excepted(const char *name, const char *names, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++, names += strlen(names) + 1)
        if (strcmp(name, names) == 0)
            return 1;
    return 0;
}

/* The excepted names of a CHILDREN entry are named paths or lead to one:
 * none may be a symlink (see the top of this file). */
static inline int policy_check_excepted(int dir, const char *path, const char *names, uint32_t n,
                                        struct dsec_err *e)
{
    for (uint32_t i = 0; i < n; i++, names += strlen(names) + 1) {
        struct stat st;

        if (fstatat(dir, names, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            if (policy_absent(errno))
                continue;
            policy_err_at(e, errno, path, names);
            return -1;
        }
        if (S_ISLNK(st.st_mode)) {
            policy_err_at(e, ELOOP, path, names);
            return -1;
        }
    }
    return 0;
}

/* DSEC_POLICY_CHILDREN: access on every entry of path but the excepted names. */
static inline int policy_children(int ruleset, int root, const char *path, uint64_t access, const char *names,
                                  uint32_t n, struct dsec_err *e)
{
    char buf[2048] __attribute__((aligned(8)));
    int dir = policy_open(root, path, O_RDONLY | O_DIRECTORY), rc = 0, entries = 0;
    long got;

    if (dir < 0)
        return policy_absent(errno) ? 0 : check(-1, e, DSEC_STEP_LANDLOCK, path);
    if (policy_check_excepted(dir, path, names, n, e) < 0) {
        close(dir);
        return -1;
    }
    while (rc == 0 && (got = syscall(SYS_getdents64, dir, buf, sizeof(buf))) > 0) {
        for (long off = 0; rc == 0 && off < got;) {
            struct dirent64 *d = (struct dirent64 *)(buf + off);
            const char *name = d->d_name;
            int fd;

            off += d->d_reclen;
            if ((name[0] == '.' && (!name[1] || (name[1] == '.' && !name[2]))) || policy_excepted(name, names, n))
                continue;
            if (++entries > DSEC_POLICY_MAX_CHILDREN) {
                err_set(e, DSEC_STEP_LANDLOCK, E2BIG, path);
                rc = -1;
                break;
            }
            if (d->d_type == DT_LNK) /* the link's target has rules of its own, or its parent's */
                continue;
            fd = openat(dir, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0) {
                if (!policy_absent(errno)) { /* removed meanwhile: nothing to grant */
                    policy_err_at(e, errno, path, name);
                    rc = -1;
                }
                continue;
            }
            if (d->d_type == DT_UNKNOWN)     /* a file system without d_type: ask */
                rc = policy_grant(ruleset, fd, access, path, e);
            else
                rc = policy_add(ruleset, fd, d->d_type == DT_DIR ? access : access & DSEC_LANDLOCK_FS_FILE, path, e);
            close(fd);
        }
    }
    if (rc == 0 && got < 0)
        rc = check(-1, e, DSEC_STEP_LANDLOCK, path);
    close(dir);
    return rc;
}

/* The plan's head, checked; 0 or -1 with e filled (EINVAL: malformed). */
static inline int policy_head(const unsigned char *blob, size_t len, struct dsec_policy_head *head,
                              struct dsec_err *e)
{
    if (len < sizeof(*head) || len > DSEC_POLICY_MAX_BYTES)
        goto bad;
    memcpy(head, blob, sizeof(*head));
    if (head->magic != DSEC_POLICY_MAGIC ||
        head->n_ports > (len - sizeof(*head)) / sizeof(struct dsec_policy_port))
        goto bad;
    return 0;
bad:
    err_set(e, DSEC_STEP_LANDLOCK, EINVAL, "plan");
    return -1;
}

/* The path entry at *off (advanced past it): its head in *p, its path and the
 * names after it at *path. 1 for an entry, -1 with e filled if malformed. */
static inline int policy_entry(const unsigned char *blob, size_t len, size_t *off, struct dsec_policy_path *p,
                               const char **path, struct dsec_err *e)
{
    if (len - *off < sizeof(*p))
        goto bad;
    memcpy(p, blob + *off, sizeof(*p));
    *off += sizeof(*p);
    *path = (const char *)blob + *off;
    /* its strings: path, then n_except names, each NUL-terminated, within strings_len */
    if (p->strings_len > len - *off || !policy_strings_fit(*path, p->strings_len, 1 + p->n_except) ||
        (*path)[0] != '/')
        goto bad;
    *off += p->strings_len;
    return 1;
bad:
    err_set(e, DSEC_STEP_LANDLOCK, EINVAL, "plan");
    return -1;
}

/* The ruleset of the plan at blob (len bytes): an fd for
 * landlock_restrict_self, or -1 with e filled (step landlock, the path it
 * failed on; EINVAL for a malformed plan). */
static inline int policy_build(const unsigned char *blob, size_t len, struct dsec_err *e)
{
    struct dsec_policy_head head;
    struct dsec_landlock_ruleset_attr attr;
    size_t off = sizeof(head);
    int ruleset, root, rc = 0;

    if (policy_head(blob, len, &head, e) < 0)
        return -1;
    attr.handled_access_fs = head.handled_fs;
    attr.handled_access_net = head.handled_net;
    attr.scoped = head.scoped;
    ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof(attr), 0);
    if (check(ruleset, e, DSEC_STEP_LANDLOCK, "ruleset") < 0)
        return -1;
    root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (check(root, e, DSEC_STEP_LANDLOCK, "/") < 0) {
        close(ruleset);
        return -1;
    }
    for (uint32_t i = 0; rc == 0 && i < head.n_ports; i++, off += sizeof(struct dsec_policy_port)) {
        struct dsec_policy_port p;
        struct dsec_landlock_net_port_attr rule;

        memcpy(&p, blob + off, sizeof(p));
        rule.allowed_access = p.access;
        rule.port = p.port;
        rc = check(syscall(SYS_landlock_add_rule, ruleset, DSEC_LANDLOCK_RULE_NET_PORT, &rule, 0), e,
                   DSEC_STEP_LANDLOCK, "tcp port rule");
    }
    for (uint32_t i = 0; rc == 0 && i < head.n_paths; i++) {
        struct dsec_policy_path p;
        const char *path;

        if (policy_entry(blob, len, &off, &p, &path, e) < 0) {
            rc = -1;
            break;
        }
        if (p.kind == DSEC_POLICY_CHILDREN) {
            rc = policy_children(ruleset, root, path, p.access, path + strlen(path) + 1, p.n_except, e);
        } else {
            int fd = policy_open(root, path, O_PATH);

            if (fd < 0)
                rc = policy_absent(errno) ? 0 : check(-1, e, DSEC_STEP_LANDLOCK, path);
            else {
                rc = policy_grant(ruleset, fd, p.access, path, e);
                close(fd);
            }
        }
    }
    close(root);
    if (rc < 0) {
        close(ruleset);
        return -1;
    }
    return ruleset;
}

/* landlock_restrict_self with the plan's flags on a built ruleset. */
static inline int policy_restrict(int ruleset, const unsigned char *blob, struct dsec_err *e)
{
    struct dsec_policy_head head;

    memcpy(&head, blob, sizeof(head));
    return check(syscall(SYS_landlock_restrict_self, ruleset, head.restrict_flags), e, DSEC_STEP_LANDLOCK,
                 "restrict_self");
}

/* Build the plan's ruleset and restrict the calling process to it (the exec
 * helper, whose children are one-off). 0, or -1 with e filled. */
static inline int policy_apply(const unsigned char *blob, size_t len, struct dsec_err *e)
{
    int ruleset = policy_build(blob, len, e), rc;

    if (ruleset < 0)
        return -1;
    rc = policy_restrict(ruleset, blob, e);
    close(ruleset);
    return rc;
}

/* What a built ruleset depends on, per path entry of its plan: whether the
 * path is there, what it is (its inode: Landlock binds rules to inodes), and
 * for a listed directory its change times (an entry added, removed or
 * renamed in it changes them). A ruleset whose plan's paths still give the
 * same signature grants exactly what a new build would, so it may be used
 * again (init.c keeps a few: a build is ~30 syscalls, this one per path). */
struct dsec_policy_sig {
    uint64_t dev, ino;
    int64_t mtime_sec, mtime_nsec, ctime_sec, ctime_nsec;
    uint32_t mode;
    int32_t err;
};

/* The signature of every path entry of the plan into sig[0..max); how many,
 * or -1 if the plan is malformed or has more than max entries (then it is
 * built each time). */
static inline int policy_sign(const unsigned char *blob, size_t len, struct dsec_policy_sig *sig, int max)
{
    struct dsec_policy_head head;
    struct dsec_err e;
    size_t off;
    int n = 0;

    if (policy_head(blob, len, &head, &e) < 0 || head.n_paths > (uint32_t)max)
        return -1;
    off = sizeof(head) + head.n_ports * sizeof(struct dsec_policy_port);
    for (uint32_t i = 0; i < head.n_paths; i++, n++) {
        struct dsec_policy_path p;
        const char *path;
        struct stat st;

        if (policy_entry(blob, len, &off, &p, &path, &e) < 0)
            return -1;
        memset(&sig[n], 0, sizeof(sig[n]));
        if (fstatat(AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            sig[n].err = errno;
            continue;
        }
        sig[n].dev = st.st_dev;
        sig[n].ino = st.st_ino;
        sig[n].mode = st.st_mode;
        if (p.kind == DSEC_POLICY_CHILDREN) {
            sig[n].mtime_sec = st.st_mtim.tv_sec;
            sig[n].mtime_nsec = st.st_mtim.tv_nsec;
            sig[n].ctime_sec = st.st_ctim.tv_sec;
            sig[n].ctime_nsec = st.st_ctim.tv_nsec;
        }
    }
    return n;
}

#endif
