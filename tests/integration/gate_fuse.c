/* gate_fuse.c - a FUSE file system of one file whose reads can be held.
 *
 *   gate_fuse MOUNTPOINT SIZE GATE_OPEN GATE_OFFSET GATE_FILE
 *
 * MOUNTPOINT shows one regular file, `big`, of SIZE bytes (byte i is
 * i % 251), read with direct I/O: every read of it reaches this process.
 * Opens are numbered from 1. A read of open GATE_OPEN or later at
 * GATE_OFFSET or past it waits until GATE_FILE exists (0: forever).
 * Standard output gets one line per event, flushed at once:
 *   open N | read N OFFSET SIZE | held N OFFSET | release N
 * The tests use it as a slow or stuck file system in a client's build
 * context (tests/integration/test_image_build.py). Runs until unmounted.
 */
#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define BIG_INO 2

static off_t size;
static unsigned long gate_open;
static off_t gate_offset;
static const char *gate_file;
static unsigned long opens;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...)
{
    va_list ap;
    pthread_mutex_lock(&lock);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
    pthread_mutex_unlock(&lock);
}

static void attr(fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0644;
        st->st_nlink = 1;
        st->st_size = size;
    }
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param e = {0};
    if (parent != FUSE_ROOT_ID || strcmp(name, "big") != 0)
        return (void)fuse_reply_err(req, ENOENT);
    e.ino = BIG_INO;
    attr(BIG_INO, &e.attr);
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;
    (void)fi;
    if (ino != FUSE_ROOT_ID && ino != BIG_INO)
        return (void)fuse_reply_err(req, ENOENT);
    attr(ino, &st);
    fuse_reply_attr(req, &st, 0);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t max, off_t off, struct fuse_file_info *fi)
{
    char buf[512];
    size_t used = 0;
    struct stat st;
    (void)fi;
    if (ino != FUSE_ROOT_ID)
        return (void)fuse_reply_err(req, ENOTDIR);
    const char *names[] = {".", "..", "big"};
    fuse_ino_t inos[] = {FUSE_ROOT_ID, FUSE_ROOT_ID, BIG_INO};
    for (off_t i = off; i < 3; i++) {
        attr(inos[i], &st);
        size_t n = fuse_add_direntry(req, buf + used, sizeof(buf) - used, names[i], &st, i + 1);
        if (used + n > max || used + n > sizeof(buf))
            break;
        used += n;
    }
    fuse_reply_buf(req, buf, used);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (ino != BIG_INO)
        return (void)fuse_reply_err(req, EISDIR);
    if ((fi->flags & O_ACCMODE) != O_RDONLY)
        return (void)fuse_reply_err(req, EROFS);
    pthread_mutex_lock(&lock);
    fi->fh = ++opens;
    pthread_mutex_unlock(&lock);
    fi->direct_io = 1;
    say("open %lu\n", (unsigned long)fi->fh);
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t n, off_t off, struct fuse_file_info *fi)
{
    (void)ino;
    if (gate_open && fi->fh >= gate_open && off >= gate_offset) {
        say("held %lu %lld\n", (unsigned long)fi->fh, (long long)off);
        while (access(gate_file, F_OK) != 0)
            usleep(10000);
    }
    say("read %lu %lld %zu\n", (unsigned long)fi->fh, (long long)off, n);
    if (off >= size)
        return (void)fuse_reply_buf(req, NULL, 0);
    if ((off_t)n > size - off)
        n = size - off;
    char *buf = malloc(n ? n : 1);
    if (!buf)
        return (void)fuse_reply_err(req, ENOMEM);
    for (size_t i = 0; i < n; i++)
        buf[i] = (char)((off + (off_t)i) % 251);
    fuse_reply_buf(req, buf, n);
    free(buf);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    say("release %lu\n", (unsigned long)fi->fh);
    fuse_reply_err(req, 0);
}

static const struct fuse_lowlevel_ops ops = {
    .lookup = op_lookup,
    .getattr = op_getattr,
    .readdir = op_readdir,
    .open = op_open,
    .read = op_read,
    .release = op_release,
};

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: %s MOUNTPOINT SIZE GATE_OPEN GATE_OFFSET GATE_FILE\n", argv[0]);
        return 2;
    }
    size = strtoll(argv[2], NULL, 0);
    gate_open = strtoul(argv[3], NULL, 0);
    gate_offset = strtoll(argv[4], NULL, 0);
    gate_file = argv[5];
    char *fargv[] = {argv[0], "-o", "fsname=gate_fuse,subtype=gate", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!se)
        return 1;
    if (fuse_session_mount(se, argv[1]) != 0)
        return 1;
    say("mounted\n");
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    int rc = fuse_session_loop_mt(se, cfg);
    fuse_loop_cfg_destroy(cfg);
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
