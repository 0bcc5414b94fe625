/* fuse.c - dsec-pager's file system (libfuse3 low-level API, multithreaded)
 * and its main.
 *
 *   <mnt>/<hex>    blob <hex> of the store, read-only, paged in by chunks
 *   <mnt>/.stats   JSON counters of every blob opened since start (a snapshot
 *                  taken at open(2); read it to EOF)
 *
 * Usage: dsec-pager --store DIR --cache DIR [options] MOUNTPOINT (see usage()).
 * Runs in the foreground; SIGTERM/SIGINT unmount and close the cache cleanly.
 * With --log PATH, SIGUSR1 reopens PATH as its stdout and stderr (the log
 * was renamed away: rotated). SIGUSR2 sets the cache cap to the number in
 * <cache>/.cache-max (the daemon's, when it adopts a pager started with
 * another).
 * Exit status: 0 after a clean stop, 1 on a start-up error (said on stderr).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pager.h"

#define BLOB_TIMEOUT 3600.0 /* blobs are immutable: cache their entries and attributes */

struct pager_cfg g_cfg = {
    .chunk_size = 1 << 20,
    .readahead = 4,
    .ra_threads = 2,
    .max_threads = 16,
    .ready_fd = -1,
};

static struct timespec g_start;

struct open_blob {
    struct blob *b;
    _Atomic uint64_t next_off;  /* where the last read on this open file ended */
    _Atomic uint64_t seq_start; /* where the current sequential run began */
};

struct mem_file {
    char *data;
    size_t len;
};

static void fill_attr(fuse_ino_t ino, struct stat *st)
{
    struct blob *b;

    memset(st, 0, sizeof(*st));
    st->st_ino = ino;
    st->st_nlink = 1;
    st->st_atim = st->st_mtim = st->st_ctim = g_start;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else if (ino == PAGER_INO_STATS) {
        st->st_mode = S_IFREG | 0444;
    } else if ((b = blob_by_ino(ino))) {
        st->st_mode = S_IFREG | 0444;
        st->st_size = (off_t)b->size;
        st->st_blocks = (blkcnt_t)((b->size + 511) / 512);
        st->st_atim = st->st_mtim = st->st_ctim = b->mtime;
    }
    st->st_blksize = 4096;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param e = {0};
    struct blob *b;
    int rc;

    if (parent != FUSE_ROOT_ID)
        return (void)fuse_reply_err(req, ENOENT);
    if (strcmp(name, ".stats") == 0) {
        e.ino = PAGER_INO_STATS;
        e.attr_timeout = e.entry_timeout = 1.0;
    } else {
        rc = blob_get(name, &b);
        if (rc < 0) {
            if (rc != -ENOENT)
                fprintf(stderr, "dsec-pager: open blob %s: %s\n", name, strerror(-rc));
            return (void)fuse_reply_err(req, -rc);
        }
        e.ino = b->ino;
        e.attr_timeout = e.entry_timeout = BLOB_TIMEOUT;
    }
    fill_attr(e.ino, &e.attr);
    fuse_reply_entry(req, &e);
}

static int known_ino(fuse_ino_t ino)
{
    return ino == FUSE_ROOT_ID || ino == PAGER_INO_STATS || blob_by_ino(ino);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;

    (void)fi;
    if (!known_ino(ino))
        return (void)fuse_reply_err(req, ENOENT);
    fill_attr(ino, &st);
    fuse_reply_attr(req, &st, ino == PAGER_INO_STATS ? 1.0 : BLOB_TIMEOUT);
}

static void json_blob(FILE *f, struct blob *b, int first)
{
    struct blob_stats *s = &b->st;

    fprintf(
        f,
        "%s\n  \"%s\": {\"size\": %" PRIu64 ", \"chunks\": %" PRIu64 ", \"cached_chunks\": %" PRIu64
        ", \"kernel_read_bytes\": %" PRIu64 ", \"reads\": %" PRIu64 ", \"fetched_bytes\": %" PRIu64
        ", \"fetches\": %" PRIu64 ", \"chunk_hits\": %" PRIu64 ", \"chunk_misses\": %" PRIu64
        ", \"readahead_chunks\": %" PRIu64 ", \"evictions\": %" PRIu64 ", \"errors\": %" PRIu64
        ", \"uncached\": %" PRIu64 ", \"verified\": %s"
        ", \"verified_bytes\": %" PRIu64 ", \"corrupt\": %" PRIu64 "}",
        first ? "" : ",", b->hex, b->size, b->nchunks, (uint64_t)b->cached_chunks,
        (uint64_t)s->kernel_read_bytes, (uint64_t)s->reads, (uint64_t)s->fetched_bytes,
        (uint64_t)s->fetches, (uint64_t)s->hits, (uint64_t)s->misses, (uint64_t)s->readahead,
        (uint64_t)s->evictions, (uint64_t)s->errors, (uint64_t)s->uncached, b->index ? "true" : "false",
        (uint64_t)s->verified_bytes, (uint64_t)s->corrupt);
}

static void json_latency(FILE *f, const char *name, struct lat_hist *h)
{
    fprintf(f, "\"%s\": {\"bounds_ns\": [", name);
    for (unsigned i = 0; i < PAGER_LAT_BOUNDS; i++)
        fprintf(f, "%s%" PRIu64, i ? ", " : "", pager_lat_bounds_ns[i]);
    fprintf(f, "], \"counts\": [");
    for (unsigned i = 0; i <= PAGER_LAT_BOUNDS; i++)
        fprintf(f, "%s%" PRIu64, i ? ", " : "", (uint64_t)h->counts[i]);
    fprintf(f, "], \"sum_ns\": %" PRIu64 "}", (uint64_t)h->sum_ns);
}

static int stats_snapshot(struct mem_file *m)
{
    FILE *f = open_memstream(&m->data, &m->len);
    unsigned n = blob_count();

    if (!f)
        return -errno;
    fprintf(f,
            "{\"version\": 1, \"pid\": %d, \"chunk_size\": %" PRIu64 ", \"cache_max\": %" PRIu64
            ", \"cache_used\": %" PRIu64 ", \"readahead\": %u, \"bandwidth\": %" PRIu64
            ", \"latency_us\": %" PRIu64 ", \"log_reopen\": %s, \"cache_max_settable\": true, ",
            (int)getpid(), g_cfg.chunk_size, cache_max(), cache_used(), g_cfg.readahead,
            g_cfg.bw_bps, g_cfg.latency_us, g_cfg.log_path ? "true" : "false");
    json_latency(f, "fetch_latency", &g_fetch_latency);
    fprintf(f, ", \"blobs\": {");
    for (unsigned i = 0; i < n; i++)
        json_blob(f, blob_at(i), i == 0);
    fprintf(f, "}}\n");
    return fclose(f) == 0 ? 0 : -EIO;
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct blob *b;

    if ((fi->flags & O_ACCMODE) != O_RDONLY)
        return (void)fuse_reply_err(req, EROFS);
    if (ino == PAGER_INO_STATS) {
        struct mem_file *m = calloc(1, sizeof(*m));
        int rc = m ? stats_snapshot(m) : -ENOMEM;
        if (rc < 0) {
            free(m);
            return (void)fuse_reply_err(req, -rc);
        }
        fi->fh = (uint64_t)(uintptr_t)m;
        fi->direct_io = 1; /* size unknown to stat: read to EOF */
        return (void)fuse_reply_open(req, fi);
    }
    if (!(b = blob_by_ino(ino)))
        return (void)fuse_reply_err(req, ino == FUSE_ROOT_ID ? EISDIR : ENOENT);
    int rc = blob_attach(b);
    if (rc < 0) {
        fprintf(stderr, "dsec-pager: attach blob %s: %s\n", b->hex, strerror(-rc));
        return (void)fuse_reply_err(req, rc == -ENOENT ? ENOENT : -rc);
    }
    /* A bad index fails the open: serving the layer unchecked is not an option. */
    if ((rc = blob_index_load(b)) < 0)
        return (void)fuse_reply_err(req, EIO);
    struct open_blob *ob = calloc(1, sizeof(*ob));
    if (!ob)
        return (void)fuse_reply_err(req, ENOMEM);
    ob->b = b;
    fi->fh = (uint64_t)(uintptr_t)ob;
    if (g_cfg.direct_io)
        fi->direct_io = 1;
    else
        fi->keep_cache = 1; /* immutable content: page cache stays valid across opens */
    fuse_reply_open(req, fi);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (ino == PAGER_INO_STATS) {
        struct mem_file *m = (struct mem_file *)(uintptr_t)fi->fh;
        free(m->data);
        free(m);
    } else {
        free((void *)(uintptr_t)fi->fh);
    }
    fuse_reply_err(req, 0);
}

/* Reads must run sequentially over this many bytes (and at least a chunk)
 * before read-ahead starts: a layer's small and medium files are read whole
 * in shorter runs, and read-ahead past them fetches chunks nobody reads
 * (bench/pager.py: fetched/read 2.36 with 64 KiB chunks when any 64 KiB run
 * triggered it, 1.83 with read-ahead off). */
#define RA_MIN_RUN (512 * 1024)

/* Copy [off, off+size) out of the cache, chunk by chunk, fetching what is
 * missing. Then read-ahead: once reads on this open file have run
 * sequentially long enough, queue the chunks after this read. */
static int blob_read(struct open_blob *ob, char *buf, uint64_t off, uint64_t size)
{
    struct blob *b = ob->b;
    uint64_t cs = g_cfg.chunk_size, first = off / cs, last = (off + size - 1) / cs;
    uint64_t prev = atomic_exchange(&ob->next_off, off + size);
    int rc = 0;

    for (uint64_t c = first; c <= last && rc == 0; c++) {
        uint64_t s = c * cs > off ? c * cs : off;
        uint64_t e = (c + 1) * cs < off + size ? (c + 1) * cs : off + size;
        struct chunk_copy copy = {buf + (s - off), s, e - s, 0};
        if ((rc = chunk_acquire(b, c, &copy)) < 0)
            break;
        if (rc == CHUNK_SERVED_UNCACHED) {       /* nothing pinned */
            rc = 0;
            continue;
        }
        if (!copy.done)
            rc = cache_read(b, buf + (s - off), s, e - s);
        chunk_release(b, c);
    }
    if (prev != off)
        atomic_store(&ob->seq_start, off);
    if (rc == 0 && g_cfg.readahead && prev == off &&
        off + size - ob->seq_start >= (cs > RA_MIN_RUN ? cs : RA_MIN_RUN))
        readahead_queue(b, last + 1, g_cfg.readahead);
    return rc < 0 ? -EIO : 0;
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi)
{
    if (ino == PAGER_INO_STATS) {
        struct mem_file *m = (struct mem_file *)(uintptr_t)fi->fh;
        if ((size_t)off >= m->len)
            return (void)fuse_reply_buf(req, NULL, 0);
        return (void)fuse_reply_buf(req, m->data + off,
                                    m->len - (size_t)off < size ? m->len - (size_t)off : size);
    }
    struct open_blob *ob = (struct open_blob *)(uintptr_t)fi->fh;
    struct blob *b = ob->b;
    if ((uint64_t)off >= b->size || size == 0)
        return (void)fuse_reply_buf(req, NULL, 0);
    if ((uint64_t)off + size > b->size)
        size = (size_t)(b->size - (uint64_t)off);
    char *buf = malloc(size);
    if (!buf)
        return (void)fuse_reply_err(req, ENOMEM);
    int rc = blob_read(ob, buf, (uint64_t)off, size);
    if (rc < 0) {
        free(buf);
        return (void)fuse_reply_err(req, -rc);
    }
    b->st.reads++;
    b->st.kernel_read_bytes += size;
    fuse_reply_buf(req, buf, size);
    free(buf);
}

/* The root lists .stats and the blob files of the store (a snapshot taken at
 * opendir); lookups of names not listed work too. */
static void add_entry(fuse_req_t req, struct mem_file *m, size_t *cap, const char *name,
                      fuse_ino_t ino, mode_t mode)
{
    struct stat st = {.st_ino = ino, .st_mode = mode};
    size_t need = fuse_add_direntry(req, NULL, 0, name, NULL, 0);

    if (m->len + need > *cap) {
        size_t ncap = (*cap + need) * 2;
        char *p = realloc(m->data, ncap);
        if (!p)
            return;
        m->data = p;
        *cap = ncap;
    }
    fuse_add_direntry(req, m->data + m->len, need, name, &st, (off_t)(m->len + need));
    m->len += need;
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct mem_file *m;
    size_t cap = 0;
    DIR *d;
    struct dirent *de;

    if (ino != FUSE_ROOT_ID)
        return (void)fuse_reply_err(req, ENOTDIR);
    if (!(m = calloc(1, sizeof(*m))))
        return (void)fuse_reply_err(req, ENOMEM);
    add_entry(req, m, &cap, ".", FUSE_ROOT_ID, S_IFDIR);
    add_entry(req, m, &cap, "..", FUSE_ROOT_ID, S_IFDIR);
    add_entry(req, m, &cap, ".stats", PAGER_INO_STATS, S_IFREG);
    if ((d = opendir(g_cfg.store_dir))) {
        while ((de = readdir(d)))
            if (valid_hex(de->d_name) && (de->d_type == DT_REG || de->d_type == DT_UNKNOWN))
                add_entry(req, m, &cap, de->d_name, 0xffffffff, S_IFREG);
        closedir(d);
    }
    fi->fh = (uint64_t)(uintptr_t)m;
    fuse_reply_open(req, fi);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi)
{
    struct mem_file *m = (struct mem_file *)(uintptr_t)fi->fh;

    (void)ino;
    if ((size_t)off >= m->len)
        return (void)fuse_reply_buf(req, NULL, 0);
    /* As libfuse's hello_ll: entries carry their end as offset, so a reply may
     * start at off and end mid-entry; the kernel drops the partial entry and
     * asks again from the last whole one. */
    size_t len = m->len - (size_t)off;
    fuse_reply_buf(req, m->data + off, len < size ? len : size);
}

static void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct mem_file *m = (struct mem_file *)(uintptr_t)fi->fh;

    (void)ino;
    free(m->data);
    free(m);
    fuse_reply_err(req, 0);
}

static const struct fuse_lowlevel_ops pager_ops = {
    .lookup = op_lookup,
    .getattr = op_getattr,
    .open = op_open,
    .read = op_read,
    .release = op_release,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .releasedir = op_releasedir,
};

static void usage(FILE *f)
{
    fprintf(f, "usage: dsec-pager --store DIR --cache DIR [options] MOUNTPOINT\n"
               "  --store DIR           directory of blobs named by sha256 hex digest\n"
               "  --cache DIR           chunk cache (created if missing)\n"
               "  --chunk-size BYTES    power of two >= 4096 (default 1048576)\n"
               "  --cache-max BYTES     cap on cached chunk bytes, 0 = none (default 0)\n"
               "  --readahead CHUNKS    chunks fetched ahead of sequential reads (default 4)\n"
               "  --readahead-threads N (default 2)\n"
               "  --threads N           max FUSE worker threads (default 16)\n"
               "  --bandwidth BYTES/S   store throttle, 0 = none (default 0)\n"
               "  --latency-us US       store throttle per fetch (default 0)\n"
               "  --ready-fd FD         write \"ready\\n\" to FD once mounted, then close it\n"
               "  --log PATH            SIGUSR1 reopens PATH (appending) as stdout and stderr,\n"
               "                        after the log was renamed away\n"
               "  (SIGUSR2 sets the cache cap to the number in DIR/.cache-max of --cache)\n"
               "  --direct-io           blob files bypass the page cache of the FUSE inode\n"
               "                        (the EROFS mount above caches); cache file pages are\n"
               "                        dropped after use\n"
               "  --debug               libfuse debug output on stderr\n");
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;

    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || *s == '-')
        return -1;
    *out = v;
    return 0;
}

static void read_boot_id(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");

    if (f) {
        if (!fgets(g_cfg.boot_id, sizeof(g_cfg.boot_id), f))
            g_cfg.boot_id[0] = 0;
        fclose(f);
    }
}

/* Every blob opened stays open (store fd, cache fds: 2-3 per blob), far past
 * the usual soft limit of 1024 on a host with many layers. */
static void raise_fd_limit(void)
{
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static int parse_args(int argc, char **argv, int *debug)
{
    static const struct option opts[] = {
        {"store", required_argument, 0, 's'},
        {"cache", required_argument, 0, 'c'},
        {"chunk-size", required_argument, 0, 'k'},
        {"cache-max", required_argument, 0, 'm'},
        {"readahead", required_argument, 0, 'r'},
        {"readahead-threads", required_argument, 0, 'R'},
        {"threads", required_argument, 0, 't'},
        {"bandwidth", required_argument, 0, 'b'},
        {"latency-us", required_argument, 0, 'l'},
        {"ready-fd", required_argument, 0, 'f'},
        {"log", required_argument, 0, 'L'},
        {"debug", no_argument, 0, 'd'},
        {"direct-io", no_argument, 0, 'D'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    uint64_t v;
    int o;

    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (o == 'd' || o == 'D' || o == 'h' || o == 's' || o == 'c' || o == 'L') {
            if (o == 'L')
                g_cfg.log_path = optarg;
            else if (o == 'D')
                g_cfg.direct_io = 1;
            else if (o == 'd')
                *debug = 1;
            else if (o == 'h')
                return usage(stdout), 1;
            else if (o == 's')
                g_cfg.store_dir = optarg;
            else
                g_cfg.cache_dir = optarg;
            continue;
        }
        if (o == '?' || parse_u64(optarg, &v) < 0) {
            if (o != '?')
                fprintf(stderr, "dsec-pager: not a number: %s\n", optarg);
            return -1;
        }
        switch (o) {
        case 'k':
            g_cfg.chunk_size = v;
            break;
        case 'm':
            g_cfg.cache_max = v;
            break;
        case 'r':
            g_cfg.readahead = (unsigned)v;
            break;
        case 'R':
            g_cfg.ra_threads = (unsigned)v;
            break;
        case 't':
            g_cfg.max_threads = (unsigned)v;
            break;
        case 'b':
            g_cfg.bw_bps = v;
            break;
        case 'l':
            g_cfg.latency_us = v;
            break;
        case 'f':
            g_cfg.ready_fd = (int)v;
            break;
        }
    }
    if (optind != argc - 1 || !g_cfg.store_dir || !g_cfg.cache_dir) {
        usage(stderr);
        return -1;
    }
    g_cfg.mountpoint = argv[optind];
    if (g_cfg.chunk_size < 4096 || (g_cfg.chunk_size & (g_cfg.chunk_size - 1)) ||
        g_cfg.chunk_size > (1u << 30)) {
        fprintf(stderr, "dsec-pager: --chunk-size must be a power of two in [4096, 1 GiB]\n");
        return -1;
    }
    if (g_cfg.max_threads < 1 || g_cfg.readahead > 1024) {
        fprintf(stderr, "dsec-pager: --threads must be >= 1, --readahead <= 1024\n");
        return -1;
    }
    return 0;
}

static void signal_ready(void)
{
    if (g_cfg.ready_fd < 0)
        return;
    if (write(g_cfg.ready_fd, "ready\n", 6) != 6)
        fprintf(stderr, "dsec-pager: write ready fd: %s\n", strerror(errno));
    close(g_cfg.ready_fd);
    g_cfg.ready_fd = -1;
}

/* Reopen --log's path as stdout and stderr: the log was renamed (rotated),
 * and every line until now went to the renamed file, none lost. A path
 * that is no regular file now (or cannot be opened) is said and the old
 * log kept: a FIFO nobody reads would block the open, one read would kill
 * us with SIGPIPE once its reader went. */
static void reopen_log(void)
{
    struct stat st;
    int fd = open(g_cfg.log_path, O_WRONLY | O_APPEND | O_CREAT | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0640);

    if (fd < 0) {
        fprintf(stderr, "dsec-pager: reopen log %s: %s (writing on here)\n", g_cfg.log_path, strerror(errno));
        return;
    }
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        fprintf(stderr, "dsec-pager: reopen log %s: not a regular file (writing on here)\n", g_cfg.log_path);
        close(fd);
        return;
    }
    fcntl(fd, F_SETFL, O_APPEND);
    /* dup2 swaps the fd atomically: a line being written goes whole to one file. */
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
}

/* Set the cache cap to the number <cache>/.cache-max holds (a line). */
static void reload_cache_max(void)
{
    char path[4096], buf[32];
    uint64_t v, was = cache_max();
    ssize_t n = -1;
    int fd = -1;

    if (snprintf(path, sizeof(path), "%s/.cache-max", g_cfg.cache_dir) < (int)sizeof(path))
        fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
    }
    if (n <= 0) {
        fprintf(stderr, "dsec-pager: SIGUSR2: read %s/.cache-max: %s (cache cap kept at %" PRIu64 ")\n",
                g_cfg.cache_dir, n < 0 ? strerror(errno) : "empty", was);
        return;
    }
    buf[n] = 0;
    if (buf[n - 1] == '\n')
        buf[n - 1] = 0;
    if (parse_u64(buf, &v) < 0) {
        fprintf(stderr, "dsec-pager: SIGUSR2: %s/.cache-max holds no number (cache cap kept at %" PRIu64 ")\n",
                g_cfg.cache_dir, was);
        return;
    }
    cache_set_max(v);
    fprintf(stderr, "dsec-pager: cache cap set to %" PRIu64 " bytes (was %" PRIu64 "; 0 = none)\n", v, was);
}

/* SIGUSR1 and SIGUSR2 are blocked in every thread (main blocks them before
 * any starts) and taken here by sigwait, so that no FUSE or read-ahead
 * thread's syscall is interrupted by them. */
static void *control_thread(void *arg)
{
    sigset_t *set = arg;
    int sig;

    for (;;) {
        if (sigwait(set, &sig) != 0)
            continue;
        if (sig == SIGUSR1 && g_cfg.log_path)
            reopen_log();
        else if (sig == SIGUSR2)
            reload_cache_max();
    }
    return NULL;
}

static int start_control_thread(void)
{
    static sigset_t set;
    pthread_t t;
    int rc;

    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    if ((rc = pthread_sigmask(SIG_BLOCK, &set, NULL)) != 0)
        return -rc;
    if ((rc = pthread_create(&t, NULL, control_thread, &set)) != 0)
        return -rc;
    pthread_detach(t);
    return 0;
}

static int start_session(struct fuse_session **out, int debug)
{
    struct fuse_args args = FUSE_ARGS_INIT(0, NULL);
    struct fuse_session *se;

    /* allow_other: the daemon's sandboxes and helpers are other users; the
     * permission bits (0444, default_permissions) still apply. */
    if (fuse_opt_add_arg(&args, "dsec-pager") || fuse_opt_add_arg(&args, "-o") ||
        fuse_opt_add_arg(&args, "ro,fsname=dsec-pager,subtype=dsec-pager,"
                                "default_permissions,allow_other") ||
        (debug && fuse_opt_add_arg(&args, "-d")))
        return -ENOMEM;
    se = fuse_session_new(&args, &pager_ops, sizeof(pager_ops), NULL);
    fuse_opt_free_args(&args);
    if (!se)
        return -EINVAL;
    if (fuse_set_signal_handlers(se) != 0) {
        fuse_session_destroy(se);
        return -EINVAL;
    }
    if (fuse_session_mount(se, g_cfg.mountpoint) != 0) {
        fuse_remove_signal_handlers(se);
        fuse_session_destroy(se);
        return -EIO;
    }
    *out = se;
    return 0;
}

int main(int argc, char **argv)
{
    struct fuse_session *se;
    struct fuse_loop_config *loop;
    int debug = 0, rc;

    rc = parse_args(argc, argv, &debug);
    if (rc)
        return rc > 0 ? 0 : 2;
    clock_gettime(CLOCK_REALTIME, &g_start);
    read_boot_id();
    raise_fd_limit();
    if ((rc = start_control_thread()) < 0) {
        fprintf(stderr, "dsec-pager: start the signal thread: %s\n", strerror(-rc));
        return 1;
    }
    if ((rc = cache_init()) < 0 || (rc = cache_open_existing()) < 0) {
        fprintf(stderr, "dsec-pager: cache %s: %s%s\n", g_cfg.cache_dir, strerror(-rc),
                rc == -EWOULDBLOCK ? " (another dsec-pager uses this cache)" : "");
        return 1;
    }
    if ((rc = readahead_start()) < 0) {
        fprintf(stderr, "dsec-pager: start read-ahead threads: %s\n", strerror(-rc));
        return 1;
    }
    if ((rc = start_session(&se, debug)) < 0) {
        fprintf(stderr, "dsec-pager: mount %s failed (see above)\n", g_cfg.mountpoint);
        readahead_stop();
        cache_close_all();
        return 1;
    }
    signal_ready();

    loop = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(loop, g_cfg.max_threads);
    fuse_loop_cfg_set_idle_threads(loop, g_cfg.max_threads / 2 ? g_cfg.max_threads / 2 : 1);
    rc = fuse_session_loop_mt(se, loop);
    fuse_loop_cfg_destroy(loop);

    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    readahead_stop();
    cache_close_all();
    /* libfuse returns a signal number (>0) after SIGTERM/SIGINT: a clean stop. */
    return rc >= 0 ? 0 : 1;
}
