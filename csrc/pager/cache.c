/* cache.c - the local chunk cache of dsec-pager.
 *
 * Per blob: <cache>/<hex>.data, a sparse file the size of the blob holding the
 * chunks fetched so far, and <cache>/<hex>.bitmap, a 4 KiB header plus one bit
 * per chunk, mmapped shared. A bit is set only after its chunk's bytes are in
 * the data file and cleared before the chunk is punched out, so after a crash
 * of the pager (page cache intact) a set bit always means valid data. After a
 * crash of the host the page cache is gone and bits may have reached the disk
 * before data: the header records the boot id and whether the last close was
 * clean (data fsynced first), and a bitmap that is neither from this boot nor
 * cleanly closed is discarded with its data.
 *
 * Chunk states live in memory: ABSENT -> FETCHING (one thread fetches, the
 * others wait on the blob's condvar) -> PRESENT. Readers pin a chunk while
 * they copy it out; the CLOCK evictor skips pinned and in-flight chunks.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pager.h"

#define BM_MAGIC "DSECPGB1"
#define BM_VERSION 1
#define BM_HDR_SIZE 4096
#define DIO_ALIGN 4096

struct bm_hdr {
    char magic[8];
    uint32_t version;
    uint32_t clean;
    uint64_t chunk_size;
    uint64_t blob_size;
    char boot_id[40];
};

static struct blob *g_blobs[PAGER_MAX_BLOBS];
static _Atomic unsigned g_nblobs;
static pthread_mutex_t g_table_lock = PTHREAD_MUTEX_INITIALIZER;

/* Eviction state; lock order: g_cache_lock before any blob lock. */
static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_used;
static unsigned g_hand_blob;
static uint64_t g_hand_chunk;

int valid_hex(const char *s)
{
    size_t i;

    for (i = 0; s[i]; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return i == PAGER_HEX_LEN;
}

unsigned blob_count(void)
{
    return atomic_load_explicit(&g_nblobs, memory_order_acquire);
}

struct blob *blob_at(unsigned i)
{
    return i < blob_count() ? g_blobs[i] : NULL;
}

struct blob *blob_by_ino(fuse_ino_t ino)
{
    if (ino < PAGER_INO_BASE)
        return NULL;
    return blob_at((unsigned)(ino - PAGER_INO_BASE));
}

uint64_t chunk_len(const struct blob *b, uint64_t c)
{
    uint64_t start = c * g_cfg.chunk_size;
    uint64_t end = start + g_cfg.chunk_size;

    return (end > b->size ? b->size : end) - start;
}

static int bit_get(const struct blob *b, uint64_t c)
{
    return b->map[BM_HDR_SIZE + c / 8] & (1u << (c % 8));
}

static void bit_set(struct blob *b, uint64_t c, int on)
{
    if (on)
        b->map[BM_HDR_SIZE + c / 8] |= (uint8_t)(1u << (c % 8));
    else
        b->map[BM_HDR_SIZE + c / 8] &= (uint8_t) ~(1u << (c % 8));
}

static int cache_path(char *out, size_t n, const char *hex, const char *suffix)
{
    int len = snprintf(out, n, "%s/%s.%s", g_cfg.cache_dir, hex, suffix);

    return len < 0 || (size_t)len >= n ? -ENAMETOOLONG : 0;
}

/* Trust the bitmap only if its geometry matches and its bits are known to be
 * backed by data: from this boot (page cache survived a pager crash) or closed
 * cleanly (data fsynced before the clean flag was written). */
static int bitmap_trusted(const struct bm_hdr *h, const struct blob *b)
{
    return memcmp(h->magic, BM_MAGIC, 8) == 0 && h->version == BM_VERSION &&
           h->chunk_size == g_cfg.chunk_size && h->blob_size == b->size &&
           (h->clean || strncmp(h->boot_id, g_cfg.boot_id, sizeof(h->boot_id)) == 0);
}

static int open_cache_files(struct blob *b)
{
    char path[4096];
    int fresh_data = 0, map_fd, rc;
    struct bm_hdr *h;

    if ((rc = cache_path(path, sizeof(path), b->hex, "data")) < 0)
        return rc;
    b->data_fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (b->data_fd >= 0)
        fresh_data = 1;
    else if (errno == EEXIST)
        b->data_fd = open(path, O_RDWR | O_CLOEXEC);
    if (b->data_fd < 0)
        return -errno;
    /* --direct-io: the layer above keeps the only page-cache copy of the data;
     * ours would be another one. A file system without O_DIRECT (EINVAL) gets
     * buffered I/O and fadvise(DONTNEED) instead. */
    if (g_cfg.direct_io)
        b->data_dfd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);

    if ((rc = cache_path(path, sizeof(path), b->hex, "bitmap")) < 0)
        return rc;
    map_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (map_fd < 0)
        return -errno;
    b->map_len = BM_HDR_SIZE + (b->nchunks + 7) / 8;
    if (ftruncate(map_fd, (off_t)b->map_len) < 0) {
        rc = -errno;
        close(map_fd);
        return rc;
    }
    b->map = mmap(NULL, b->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, map_fd, 0);
    rc = -errno;
    close(map_fd);
    if (b->map == MAP_FAILED) {
        b->map = NULL;
        return rc;
    }

    h = (struct bm_hdr *)b->map;
    if (fresh_data || !bitmap_trusted(h, b)) {
        memset(b->map + BM_HDR_SIZE, 0, b->map_len - BM_HDR_SIZE);
        if (ftruncate(b->data_fd, 0) < 0)
            return -errno;
    }
    if (ftruncate(b->data_fd, (off_t)b->size) < 0)
        return -errno;
    /* Mark the bitmap in use (not clean) on disk before any new bit is set. */
    memcpy(h->magic, BM_MAGIC, 8);
    h->version = BM_VERSION;
    h->clean = 0;
    h->chunk_size = g_cfg.chunk_size;
    h->blob_size = b->size;
    memcpy(h->boot_id, g_cfg.boot_id, sizeof(h->boot_id));
    if (msync(b->map, BM_HDR_SIZE, MS_SYNC) < 0)
        return -errno;
    return 0;
}

/* A blob is known from its first lookup (stat of the store file: the kernel
 * needs its size) but attached - store fd, chunk states, cache files - only
 * at its first open(2): listing the mount with ls -l must not create cache
 * files for every blob of a large shared store. */
static int blob_open(const char *hex, unsigned index, struct blob **out)
{
    char path[4096];
    struct stat st;
    struct blob *b;
    int rc;

    rc = snprintf(path, sizeof(path), "%s/%s", g_cfg.store_dir, hex);
    if (rc < 0 || (size_t)rc >= sizeof(path))
        return -ENAMETOOLONG;
    if (stat(path, &st) < 0)
        return -errno;
    if (!S_ISREG(st.st_mode))
        return -ENOENT;
    b = calloc(1, sizeof(*b));
    if (!b)
        return -ENOMEM;
    memcpy(b->hex, hex, PAGER_HEX_LEN + 1);
    b->ino = PAGER_INO_BASE + index;
    b->data_fd = b->data_dfd = b->store_fd = -1;
    pthread_mutex_init(&b->lock, NULL);
    pthread_mutex_init(&b->attach_lock, NULL);
    pthread_cond_init(&b->cond, NULL);
    b->size = (uint64_t)st.st_size;
    b->mtime = st.st_mtim;
    b->nchunks = (b->size + g_cfg.chunk_size - 1) / g_cfg.chunk_size;
    *out = b;
    return 0;
}

static void blob_detach(struct blob *b)
{
    if (b->map)
        munmap(b->map, b->map_len);
    b->map = NULL;
    if (b->data_fd >= 0)
        close(b->data_fd);
    if (b->data_dfd >= 0)
        close(b->data_dfd);
    if (b->store_fd >= 0)
        close(b->store_fd);
    b->data_fd = b->data_dfd = b->store_fd = -1;
    free(b->state);
    free(b->ref);
    free(b->pins);
    b->state = b->ref = NULL;
    b->pins = NULL;
}

static void blob_free(struct blob *b)
{
    blob_detach(b);
    pthread_mutex_destroy(&b->lock);
    pthread_mutex_destroy(&b->attach_lock);
    pthread_cond_destroy(&b->cond);
    free(b);
}

static int attach_files(struct blob *b, uint64_t *bytes)
{
    char path[4096];
    int rc;

    snprintf(path, sizeof(path), "%s/%s", g_cfg.store_dir, b->hex);
    b->store_fd = open(path, O_RDONLY | O_CLOEXEC);
    if (b->store_fd < 0)
        return -errno;
    /* The pager reads whole chunks and does its own read-ahead: the kernel's
     * on the store file read past each chunk into pages nobody asked for,
     * which the DONTNEED after a fetch (store.c) does not cover (bench/images.py:
     * ~140 MiB of store pages left per 180 MiB fetched with 64 KiB chunks). */
    if (g_cfg.direct_io)
        posix_fadvise(b->store_fd, 0, 0, POSIX_FADV_RANDOM);
    b->state = calloc(b->nchunks + 1, 1);
    b->ref = calloc(b->nchunks + 1, 1);
    b->pins = calloc(b->nchunks + 1, sizeof(uint16_t));
    if (!b->state || !b->ref || !b->pins)
        return -ENOMEM;
    if ((rc = open_cache_files(b)) < 0)
        return rc;
    *bytes = 0;
    for (uint64_t c = 0; c < b->nchunks; c++) {
        if (bit_get(b, c)) {
            b->state[c] = CHUNK_PRESENT;
            b->cached_chunks++;
            *bytes += chunk_len(b, c);
        }
    }
    return 0;
}

/* Attach b on first use (idempotent, concurrent callers wait for the first).
 * Lock order: attach_lock, then the blob lock or the cache lock, never both. */
int blob_attach(struct blob *b)
{
    uint64_t bytes = 0;
    int rc = 0;

    if (atomic_load_explicit(&b->attached, memory_order_acquire))
        return 0;
    pthread_mutex_lock(&b->attach_lock);
    if (!b->attached) {
        rc = attach_files(b, &bytes);
        if (rc < 0) {
            blob_detach(b);
            b->cached_chunks = 0;
        } else {
            pthread_mutex_lock(&b->lock); /* the evictor checks attached under it */
            atomic_store_explicit(&b->attached, 1, memory_order_release);
            pthread_mutex_unlock(&b->lock);
            pthread_mutex_lock(&g_cache_lock);
            g_used += bytes;
            pthread_mutex_unlock(&g_cache_lock);
        }
    }
    pthread_mutex_unlock(&b->attach_lock);
    return rc;
}

/* Find the blob named hex, opening it on first use. Blobs stay open for the
 * life of the pager: their inode numbers are their table slots. */
int blob_get(const char *hex, struct blob **out)
{
    unsigned n;
    int rc;

    if (!valid_hex(hex))
        return -ENOENT;
    pthread_mutex_lock(&g_table_lock);
    n = blob_count();
    for (unsigned i = 0; i < n; i++) {
        if (memcmp(g_blobs[i]->hex, hex, PAGER_HEX_LEN) == 0) {
            *out = g_blobs[i];
            pthread_mutex_unlock(&g_table_lock);
            return 0;
        }
    }
    if (n == PAGER_MAX_BLOBS) {
        pthread_mutex_unlock(&g_table_lock);
        return -ENFILE;
    }
    rc = blob_open(hex, n, out);
    if (rc == 0) {
        g_blobs[n] = *out;
        atomic_store_explicit(&g_nblobs, n + 1, memory_order_release);
    }
    pthread_mutex_unlock(&g_table_lock);
    return rc;
}

/* Evict one chunk: clear its bit first, then free its blocks. Both locks held. */
static void chunk_evict(struct blob *b, uint64_t c)
{
    uint64_t len = chunk_len(b, c);

    b->state[c] = CHUNK_ABSENT;
    bit_set(b, c, 0);
    if (fallocate(b->data_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)(c * g_cfg.chunk_size), (off_t)len) < 0)
        fprintf(stderr, "dsec-pager: punch hole in %s.data chunk %llu: %s\n", b->hex,
                (unsigned long long)c, strerror(errno));
    b->cached_chunks--;
    b->st.evictions++;
    g_used -= len;
}

/* CLOCK sweep over every chunk of every blob until need more bytes fit under
 * the cap. Two full turns at most: the first may only clear reference bits.
 * When everything left is pinned or in flight the cap is exceeded by those
 * chunks (bounded by the FUSE and read-ahead threads) rather than failing. */
static void evict_for(uint64_t need)
{
    uint64_t total = 0, budget;
    unsigned n = blob_count();

    if (!g_cfg.cache_max || n == 0)
        return;
    for (unsigned i = 0; i < n; i++)
        total += g_blobs[i]->nchunks + 1;
    budget = 2 * total;
    while (g_used + need > g_cfg.cache_max && budget--) {
        if (g_hand_blob >= n)
            g_hand_blob = 0;
        struct blob *b = g_blobs[g_hand_blob];
        if (g_hand_chunk >= b->nchunks || !atomic_load(&b->attached)) {
            g_hand_blob++;
            g_hand_chunk = 0;
            continue;
        }
        uint64_t c = g_hand_chunk++;
        pthread_mutex_lock(&b->lock);
        if (b->state[c] == CHUNK_PRESENT && b->pins[c] == 0) {
            if (b->ref[c])
                b->ref[c] = 0;
            else
                chunk_evict(b, c);
        }
        pthread_mutex_unlock(&b->lock);
    }
}

static void cache_reserve(uint64_t len)
{
    pthread_mutex_lock(&g_cache_lock);
    evict_for(len);
    g_used += len;
    pthread_mutex_unlock(&g_cache_lock);
}

static void cache_unreserve(uint64_t len)
{
    pthread_mutex_lock(&g_cache_lock);
    g_used -= len;
    pthread_mutex_unlock(&g_cache_lock);
}

/* A new cap, from now on (SIGUSR2: fuse.c); a lower one evicts down to it
 * at once, as the start does for the chunks cached before it. */
void cache_set_max(uint64_t max)
{
    pthread_mutex_lock(&g_cache_lock);
    g_cfg.cache_max = max;
    evict_for(0);
    pthread_mutex_unlock(&g_cache_lock);
}

uint64_t cache_max(void)
{
    uint64_t max;

    pthread_mutex_lock(&g_cache_lock);
    max = g_cfg.cache_max;
    pthread_mutex_unlock(&g_cache_lock);
    return max;
}

uint64_t cache_used(void)
{
    uint64_t used;

    pthread_mutex_lock(&g_cache_lock);
    used = g_used;
    pthread_mutex_unlock(&g_cache_lock);
    return used;
}

static int pwrite_full(int fd, const char *buf, uint64_t len, uint64_t off)
{
    uint64_t done = 0;

    while (done < len) {
        ssize_t n = pwrite(fd, buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return n < 0 ? -errno : -EIO;
        done += (uint64_t)n;
    }
    return 0;
}

int pread_full(int fd, void *buf, uint64_t len, uint64_t off)
{
    uint64_t done = 0;

    while (done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return n < 0 ? -errno : -EIO;
        done += (uint64_t)n;
    }
    return 0;
}

/* Copy [off, off+len) of a pinned chunk out of the cache file. O_DIRECT reads
 * the aligned span around it into a bounce buffer; the file may end inside the
 * span's last block (a short read there is fine). */
int cache_read(struct blob *b, char *dst, uint64_t off, uint64_t len)
{
    uint64_t as = off & ~(uint64_t)(DIO_ALIGN - 1);
    uint64_t ae = (off + len + DIO_ALIGN - 1) & ~(uint64_t)(DIO_ALIGN - 1);
    uint64_t need = off + len - as, done = 0;
    void *bounce;
    int rc;

    if (b->data_dfd < 0) {
        rc = pread_full(b->data_fd, dst, len, off);
        if (g_cfg.direct_io)
            posix_fadvise(b->data_fd, (off_t)off, (off_t)len, POSIX_FADV_DONTNEED);
        return rc;
    }
    if (posix_memalign(&bounce, DIO_ALIGN, ae - as) != 0)
        return -ENOMEM;
    rc = 0;
    while (done < need) {
        ssize_t n = pread(b->data_dfd, (char *)bounce + done, ae - as - done, (off_t)(as + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            rc = n < 0 ? -errno : -EIO;
            break;
        }
        done += (uint64_t)n;
    }
    if (rc == 0)
        memcpy(dst, (char *)bounce + (off - as), len);
    free(bounce);
    return rc;
}

/* Fetch chunk c, which the caller moved to FETCHING, into the cache file, and
 * publish it (bit, state, waiters). On failure the chunk goes back to ABSENT:
 * the next reader tries again (a store that was unreachable may be back).
 * copy (may be NULL): the fetching reader's range, served from the fetch
 * buffer; reading it back from .data cost one more disk read per miss
 * (O_DIRECT), ~1/3 of the pager's disk traffic in bench/images.py.
 * A fetch the cache cannot keep (its disk full, say) still serves copy:
 * the chunk stays ABSENT and CHUNK_SERVED_UNCACHED is returned, so a full
 * cache disk slows reads down instead of failing them (a failed read of a
 * mapped binary is a SIGBUS in the sandbox). */
/* How long read-ahead stays off after the cache could not keep a chunk. */
#define CACHE_FULL_PAUSE_NS (5ull * 1000000000ull)
_Atomic uint64_t g_cache_full_until_ns;

int chunk_fill(struct blob *b, uint64_t c, int readahead, struct chunk_copy *copy)
{
    uint64_t len = chunk_len(b, c), off = c * g_cfg.chunk_size;
    /* O_DIRECT wants aligned buffers and lengths: the last chunk's write is
     * rounded up with zeros past the blob's end (the file is cut back to the
     * blob's size when it is next opened). */
    uint64_t alen = (len + DIO_ALIGN - 1) & ~(uint64_t)(DIO_ALIGN - 1);
    uint64_t t0 = now_ns();
    void *buf = NULL;
    int rc, kept = 0;

    cache_reserve(len);
    if (posix_memalign(&buf, DIO_ALIGN, alen) != 0) {
        buf = NULL;
        rc = -ENOMEM;
    } else {
        memset((char *)buf + len, 0, alen - len);
        rc = store_fetch(b, c, buf, len);
    }
    if (rc == 0) {
        if (b->data_dfd >= 0)
            kept = pwrite_full(b->data_dfd, buf, alen, off);
        else
            kept = pwrite_full(b->data_fd, buf, len, off);
        if (kept < 0)
            fprintf(stderr, "dsec-pager: write %s.data chunk %llu: %s (served, not cached)\n", b->hex,
                    (unsigned long long)c, strerror(-kept));
        else if (b->data_dfd < 0 && g_cfg.direct_io)
            /* Start writeback, so that the pages are clean (droppable) by the
             * time cache_read copies them out. */
            sync_file_range(b->data_fd, (off_t)off, (off_t)len, SYNC_FILE_RANGE_WRITE);
    }
    if (rc == 0 && copy) {
        memcpy(copy->dst, (char *)buf + (copy->off - off), copy->len);
        copy->done = 1;
    }
    free(buf);
    if (rc == 0)
        lat_observe(&g_fetch_latency, now_ns() - t0);
    if (rc == 0 && kept < 0) {
        rc = copy ? CHUNK_SERVED_UNCACHED : kept;
        b->st.uncached++;
        atomic_store(&g_cache_full_until_ns, now_ns() + CACHE_FULL_PAUSE_NS);
    }

    pthread_mutex_lock(&b->lock);
    if (rc == 0) {
        bit_set(b, c, 1);
        b->state[c] = CHUNK_PRESENT;
        b->ref[c] = 1;
        b->cached_chunks++;
        b->st.fetches++;
        b->st.fetched_bytes += len;
        if (readahead)
            b->st.readahead++;
    } else {
        b->state[c] = CHUNK_ABSENT;
        if (kept >= 0)        /* the fetch failed; one the cache could not keep is counted as uncached */
            b->st.errors++;
    }
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
    if (rc != 0)
        cache_unreserve(len);
    return rc;
}

/* Make chunk c present and pin it. Exactly one caller fetches a missing chunk;
 * concurrent callers wait for that fetch instead of fetching again.
 * CHUNK_SERVED_UNCACHED: copy was served but the cache could not keep the
 * chunk; nothing is pinned. */
int chunk_acquire(struct blob *b, uint64_t c, struct chunk_copy *copy)
{
    int counted = 0, rc;

    pthread_mutex_lock(&b->lock);
    for (;;) {
        if (b->state[c] == CHUNK_PRESENT) {
            b->pins[c]++;
            b->ref[c] = 1;
            if (!counted)
                b->st.hits++;
            pthread_mutex_unlock(&b->lock);
            return 0;
        }
        if (!counted) {
            b->st.misses++;
            counted = 1;
        }
        if (b->state[c] == CHUNK_FETCHING) {
            pthread_cond_wait(&b->cond, &b->lock);
            continue;
        }
        b->state[c] = CHUNK_FETCHING;
        pthread_mutex_unlock(&b->lock);
        rc = chunk_fill(b, c, 0, copy);
        if (rc != 0)
            return rc;
        pthread_mutex_lock(&b->lock);
    }
}

void chunk_release(struct blob *b, uint64_t c)
{
    pthread_mutex_lock(&b->lock);
    b->pins[c]--;
    pthread_mutex_unlock(&b->lock);
}

/* Open the blobs cached by an earlier run, so that their chunks count against
 * the cap (and are evictable) from the start. A cache entry whose blob left
 * the store is deleted. */
int cache_open_existing(void)
{
    DIR *d = opendir(g_cfg.cache_dir);
    struct dirent *de;
    char hex[PAGER_HEX_LEN + 1], path[4096];
    struct blob *b;

    if (!d)
        return -errno;
    while ((de = readdir(d))) {
        const char *dot = strchr(de->d_name, '.');
        if (!dot || dot - de->d_name != PAGER_HEX_LEN || strcmp(dot, ".bitmap") != 0)
            continue;
        memcpy(hex, de->d_name, PAGER_HEX_LEN);
        hex[PAGER_HEX_LEN] = 0;
        int rc = blob_get(hex, &b);
        if (rc == 0)
            rc = blob_attach(b);
        if (rc == -ENOENT) {
            if (cache_path(path, sizeof(path), hex, "data") == 0)
                unlink(path);
            if (cache_path(path, sizeof(path), hex, "bitmap") == 0)
                unlink(path);
        } else if (rc < 0) {
            fprintf(stderr, "dsec-pager: reopen cached blob %s: %s\n", hex, strerror(-rc));
        }
    }
    closedir(d);
    pthread_mutex_lock(&g_cache_lock);
    evict_for(0);
    pthread_mutex_unlock(&g_cache_lock);
    return 0;
}

/* Clean close: data on disk first, then the bits, then the clean flag. */
void cache_close_all(void)
{
    unsigned n = blob_count();

    for (unsigned i = 0; i < n; i++) {
        struct blob *b = g_blobs[i];
        struct bm_hdr *h = (struct bm_hdr *)b->map;
        if (b->attached && fdatasync(b->data_fd) == 0 && msync(b->map, b->map_len, MS_SYNC) == 0) {
            h->clean = 1;
            msync(b->map, BM_HDR_SIZE, MS_SYNC);
        }
        blob_free(b);
        g_blobs[i] = NULL;
    }
    atomic_store(&g_nblobs, 0);
}

/* One pager per cache directory: two would fetch into the same files with
 * separate chunk states. The lock (held by an fd kept open for the life of
 * the process) goes with the process, kill -9 included. EWOULDBLOCK = busy. */
int cache_init(void)
{
    char path[4096];
    int fd;

    if (mkdir(g_cfg.cache_dir, 0700) < 0 && errno != EEXIST)
        return -errno;
    if (snprintf(path, sizeof(path), "%s/.lock", g_cfg.cache_dir) >= (int)sizeof(path))
        return -ENAMETOOLONG;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int err = errno;
        close(fd);
        return -err;
    }
    return 0;
}
