/* store.c - reading chunks from the blob store, the optional throttle that
 * makes a local store behave like a remote one, and the read-ahead workers.
 *
 * The throttle models one link to the store shared by all fetches: each fetch
 * first waits latency_us (fetches overlap in that wait, as requests to a
 * remote server would), then reserves len / bw_bps seconds of the link after
 * every transfer already reserved, and sleeps until its transfer would end.
 * The local store file is read during that time, not after it: the local
 * read stands for the remote server's own disk time, which the emulated
 * latency already covers. Adding it on top made a throttled fetch cost
 * latency + transfer + a cold local read (~0.5-1 ms more per 64 KiB chunk on
 * the bench VM), slower than the link it emulates (bench/images.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "pager.h"

#define RA_QUEUE_LEN 1024

static pthread_mutex_t g_link_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_link_free_ns;

struct ra_item {
    struct blob *b;
    uint64_t c;
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct ra_item items[RA_QUEUE_LEN];
    unsigned head, len;
    int stop;
    pthread_t *threads;
    unsigned nthreads;
} g_ra = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

const uint64_t pager_lat_bounds_ns[PAGER_LAT_BOUNDS] = {
    10000,     25000,     50000,     100000,     250000,     500000,     1000000,
    2500000,   5000000,   10000000,  25000000,   50000000,   100000000,  250000000,
    500000000, 1000000000, 2500000000, 5000000000, 10000000000,
};
struct lat_hist g_fetch_latency;

uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Relaxed: each counter is exact on its own; a .stats snapshot taken while a
 * fetch is counted may see its bucket and not yet its sum (or the reverse). */
void lat_observe(struct lat_hist *h, uint64_t ns)
{
    unsigned i = 0;

    while (i < PAGER_LAT_BOUNDS && ns > pager_lat_bounds_ns[i])
        i++;
    atomic_fetch_add_explicit(&h->counts[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
}

static void sleep_until_ns(uint64_t t)
{
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000ull),
                          .tv_nsec = (long)(t % 1000000000ull)};

    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* When a fetch of len bytes starting now ends on the emulated link (0: no
 * throttle). The link is reserved now, from the end of the latency on. */
static uint64_t throttle_deadline(uint64_t len)
{
    uint64_t start, end;

    if (!g_cfg.latency_us && !g_cfg.bw_bps)
        return 0;
    start = now_ns() + g_cfg.latency_us * 1000ull;
    if (!g_cfg.bw_bps)
        return start;
    pthread_mutex_lock(&g_link_lock);
    if (g_link_free_ns > start)
        start = g_link_free_ns;
    end = start + (uint64_t)((double)len * 1e9 / (double)g_cfg.bw_bps);
    g_link_free_ns = end;
    pthread_mutex_unlock(&g_link_lock);
    return end;
}

/* Errors of a read through an open store file that a fresh open of the same
 * path may cure: the file system lost the open file, not the blob. On a
 * shared store another host may have replaced the blob's file (gc, then the
 * same layer stored again: same bytes, new file), and the file system's
 * client cannot bring back an fd on the old one after a reconnect (NFS:
 * ESTALE; GlusterFS 10: ENOENT from pread once the brick restarted, or
 * ENOTCONN for good on that fd when this host's client had also looked the
 * old file up by its path; seen in tests/integration/test_shared_store.py).
 * While the store is down the reopen fails too, and the read is EIO. */
static int stale_handle(int err)
{
    return err == ESTALE || err == ENOENT || err == EBADF || err == EBADFD || err == ENOTCONN;
}

/* Open the blob's store path again and put the new file under b->store_fd's
 * number (dup2 swaps it atomically: a concurrent pread on the old file
 * finishes on it, and the number is never free for another file to take).
 * Only a file of the blob's size is taken: the path names immutable bytes. */
static int reopen_store(struct blob *b)
{
    char path[4096];
    struct stat st;
    int fd, rc = 0;

    snprintf(path, sizeof(path), "%s/%s", g_cfg.store_dir, b->hex);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    if (fstat(fd, &st) < 0)
        rc = -errno;
    else if ((uint64_t)st.st_size != b->size)
        rc = -EIO;
    else if (dup2(fd, b->store_fd) < 0)
        rc = -errno;
    else if (g_cfg.direct_io)
        posix_fadvise(b->store_fd, 0, 0, POSIX_FADV_RANDOM);
    close(fd);
    return rc;
}

/* Read chunk c of b from the store. A short read means the store file is
 * shorter than when the blob was opened (truncated or being replaced): EIO,
 * like any store error, so that a reader never sees zeros for missing bytes.
 * A stale handle (stale_handle) gets one reopen of the path and a retry. */
int store_fetch(struct blob *b, uint64_t c, char *buf, uint64_t len)
{
    uint64_t off = c * g_cfg.chunk_size, done = 0;
    uint64_t deadline = throttle_deadline(len);
    int reopened = 0;

    while (done < len) {
        ssize_t n = pread(b->store_fd, buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && stale_handle(errno) && !reopened) {
            int err = errno, rc = reopen_store(b);
            reopened = 1;
            fprintf(stderr, "dsec-pager: read store blob %s: %s: reopened its store file: %s\n", b->hex,
                    strerror(err), rc < 0 ? strerror(-rc) : "ok");
            if (rc == 0)
                continue;
            errno = err;
        }
        if (n < 0) {
            fprintf(stderr, "dsec-pager: read store blob %s at %llu: %s\n", b->hex,
                    (unsigned long long)(off + done), strerror(errno));
            return -EIO;
        }
        if (n == 0) {
            fprintf(stderr, "dsec-pager: store blob %s ends at %llu, expected %llu bytes\n", b->hex,
                    (unsigned long long)(off + done), (unsigned long long)b->size);
            return -EIO;
        }
        done += (uint64_t)n;
    }
    if (blob_verify(b, off, buf, len) < 0)
        return -EIO;
    /* The chunk now lives in .data (and the EROFS page cache above): with
     * direct_io, the one-copy mode, drop the store file's pages too (a local
     * or NFS-like store keeps them otherwise: ~the fetched bytes again). */
    if (g_cfg.direct_io)
        posix_fadvise(b->store_fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
    if (deadline)
        sleep_until_ns(deadline);
    return 0;
}

static void *ra_worker(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g_ra.lock);
    for (;;) {
        while (!g_ra.stop && g_ra.len == 0)
            pthread_cond_wait(&g_ra.cond, &g_ra.lock);
        if (g_ra.stop)
            break;
        struct ra_item it = g_ra.items[g_ra.head];
        g_ra.head = (g_ra.head + 1) % RA_QUEUE_LEN;
        g_ra.len--;
        pthread_mutex_unlock(&g_ra.lock);
        chunk_fill(it.b, it.c, 1, NULL);
        pthread_mutex_lock(&g_ra.lock);
    }
    pthread_mutex_unlock(&g_ra.lock);
    return NULL;
}

/* Queue the absent chunks of [first, first+count). They turn FETCHING here, so
 * a reader that needs one meanwhile waits for the worker instead of fetching
 * it a second time. Lock order: blob lock, then queue lock. */
void readahead_queue(struct blob *b, uint64_t first, uint64_t count)
{
    if (!g_ra.nthreads || now_ns() < atomic_load(&g_cache_full_until_ns))
        return;
    pthread_mutex_lock(&b->lock);
    pthread_mutex_lock(&g_ra.lock);
    for (uint64_t c = first; c < first + count && c < b->nchunks; c++) {
        if (b->state[c] != CHUNK_ABSENT)
            continue;
        if (g_ra.len == RA_QUEUE_LEN || g_ra.stop)
            break;
        b->state[c] = CHUNK_FETCHING;
        g_ra.items[(g_ra.head + g_ra.len) % RA_QUEUE_LEN] = (struct ra_item){b, c};
        g_ra.len++;
    }
    pthread_cond_broadcast(&g_ra.cond);
    pthread_mutex_unlock(&g_ra.lock);
    pthread_mutex_unlock(&b->lock);
}

int readahead_start(void)
{
    if (!g_cfg.readahead || !g_cfg.ra_threads)
        return 0;
    g_ra.threads = calloc(g_cfg.ra_threads, sizeof(pthread_t));
    if (!g_ra.threads)
        return -ENOMEM;
    for (unsigned i = 0; i < g_cfg.ra_threads; i++) {
        int rc = pthread_create(&g_ra.threads[i], NULL, ra_worker, NULL);
        if (rc)
            return -rc;
        g_ra.nthreads++;
    }
    return 0;
}

/* Stop the workers; chunks still queued go back to ABSENT. */
void readahead_stop(void)
{
    pthread_mutex_lock(&g_ra.lock);
    g_ra.stop = 1;
    pthread_cond_broadcast(&g_ra.cond);
    pthread_mutex_unlock(&g_ra.lock);
    for (unsigned i = 0; i < g_ra.nthreads; i++)
        pthread_join(g_ra.threads[i], NULL);
    while (g_ra.len) {
        struct ra_item it = g_ra.items[g_ra.head];
        g_ra.head = (g_ra.head + 1) % RA_QUEUE_LEN;
        g_ra.len--;
        pthread_mutex_lock(&it.b->lock);
        it.b->state[it.c] = CHUNK_ABSENT;
        pthread_cond_broadcast(&it.b->cond);
        pthread_mutex_unlock(&it.b->lock);
    }
    free(g_ra.threads);
    g_ra.threads = NULL;
    g_ra.nthreads = 0;
}
