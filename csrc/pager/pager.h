/* pager.h - dsec-pager: a FUSE file system that pages content-addressed blobs
 * in from a blob store, chunk by chunk, through a persistent local cache.
 *
 * Three parts, one file each: fuse.c (the file system and main), cache.c (per
 * blob chunk state, the sparse cache file and its bitmap, eviction), store.c
 * (fetching from the store, the throttle, read-ahead workers). docs/pager.md
 * describes the behaviour the daemon relies on.
 */
#ifndef DSEC_PAGER_H
#define DSEC_PAGER_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#define PAGER_HEX_LEN 64
#define PAGER_MAX_BLOBS 65536
/* Inode numbers: 1 is the root, 2 the .stats file, blob i is PAGER_INO_BASE + i. */
#define PAGER_INO_STATS 2
#define PAGER_INO_BASE 16

enum chunk_state { CHUNK_ABSENT = 0, CHUNK_FETCHING = 1, CHUNK_PRESENT = 2 };

struct pager_cfg {
    const char *store_dir; /* holds the blobs, one file per digest: <store_dir>/<hex> */
    const char *cache_dir; /* <hex>.data (sparse) and <hex>.bitmap per blob */
    const char *mountpoint;
    uint64_t chunk_size; /* power of two, >= 4096 */
    uint64_t cache_max;  /* bytes of chunks kept; 0 = unlimited */
    uint64_t bw_bps;     /* store throttle: bytes per second, 0 = none */
    uint64_t latency_us; /* store throttle: added to every fetch */
    unsigned readahead;  /* chunks fetched ahead of a sequential reader */
    unsigned ra_threads;
    unsigned max_threads; /* FUSE worker threads */
    int direct_io;        /* blob files bypass the kernel page cache of the FUSE inode */
    int ready_fd;         /* written "ready\n" and closed once mounted; -1 = none */
    const char *log_path; /* --log: reopened as stdout and stderr on SIGUSR1; NULL = none */
    char boot_id[40];
};

/* Counters are atomics: read without locks by the .stats file. */
struct blob_stats {
    _Atomic uint64_t kernel_read_bytes; /* bytes returned to the kernel by read */
    _Atomic uint64_t reads;             /* read requests */
    _Atomic uint64_t fetched_bytes;     /* bytes read from the store */
    _Atomic uint64_t fetches;           /* chunks read from the store */
    _Atomic uint64_t hits;              /* chunk needed by a read and already cached */
    _Atomic uint64_t misses;    /* chunk needed by a read and not cached (fetched or waited) */
    _Atomic uint64_t readahead; /* chunks fetched by read-ahead */
    _Atomic uint64_t evictions; /* chunks evicted */
    _Atomic uint64_t errors;    /* failed fetches (store I/O, truncated blob) */
    _Atomic uint64_t uncached;  /* fetched chunks the cache could not keep (its disk full): served if read */
    _Atomic uint64_t verified_bytes; /* fetched bytes checked against the chunk index */
    _Atomic uint64_t corrupt;        /* fetched blocks that did not match it (EIO) */
};

/* Wall time of each successful fetch, read-ahead's included: from the start
 * of chunk_fill (cache room made, evicting if need be) to the chunk written
 * to the cache file (store read, check against the chunk index, throttle,
 * cache write), which is what a reader that misses waits for. Buckets with
 * fixed log-spaced bounds (1-2.5-5 per decade, 10 us to 10 s) and an
 * overflow bucket; counts per bucket (not cumulative) and the sum in ns,
 * atomics: the fetching threads add, .stats reads without locks. */
#define PAGER_LAT_BOUNDS 19
struct lat_hist {
    _Atomic uint64_t counts[PAGER_LAT_BOUNDS + 1]; /* [i]: <= bounds[i]; last: above them all */
    _Atomic uint64_t sum_ns;
};
extern const uint64_t pager_lat_bounds_ns[PAGER_LAT_BOUNDS];
extern struct lat_hist g_fetch_latency;

/* Until this time (now_ns) read-ahead is not queued: the cache could not keep
 * a chunk, and more read-ahead would fetch chunks only to drop them. */
extern _Atomic uint64_t g_cache_full_until_ns;

struct blob {
    char hex[PAGER_HEX_LEN + 1];
    fuse_ino_t ino;
    uint64_t size;
    uint64_t nchunks;
    struct timespec mtime;
    int store_fd;
    int data_fd;
    int data_dfd; /* the same file O_DIRECT (--direct-io, if the fs allows), else -1 */
    uint8_t *map; /* the bitmap file, mmapped shared: header then one bit per chunk */
    size_t map_len;
    _Atomic int attached; /* the fields below are set up (blob_attach) */
    pthread_mutex_t attach_lock;
    pthread_mutex_t lock; /* guards state/ref/pins and the bitmap bits */
    pthread_cond_t cond;  /* broadcast whenever a fetch of this blob ends */
    uint8_t *state;       /* enum chunk_state per chunk */
    uint8_t *ref;         /* CLOCK reference bit per chunk */
    uint16_t *pins;       /* readers copying the chunk out of the cache file */
    _Atomic uint64_t cached_chunks;
    uint8_t *_Atomic index; /* sha256 per index_block of the blob (verify.c); NULL = unchecked */
    uint32_t index_block;
    struct blob_stats st;
};

extern struct pager_cfg g_cfg;

/* cache.c */
int cache_init(void);
int cache_open_existing(void);
int blob_get(const char *hex, struct blob **out);
int blob_attach(struct blob *b);
struct blob *blob_by_ino(fuse_ino_t ino);
unsigned blob_count(void);
struct blob *blob_at(unsigned i);
uint64_t chunk_len(const struct blob *b, uint64_t c);
/* A reader's range of a chunk, copied out of the fetch buffer when that reader
 * fetches the chunk itself (done = 1), which saves re-reading it from .data. */
struct chunk_copy {
    char *dst;
    uint64_t off, len; /* blob offset and length, within the chunk */
    int done;
};
/* chunk_acquire and chunk_fill: the reader's copy was served from the fetch,
 * but the cache could not keep the chunk (no pin is held). */
#define CHUNK_SERVED_UNCACHED 1
int chunk_acquire(struct blob *b, uint64_t c, struct chunk_copy *copy);
void chunk_release(struct blob *b, uint64_t c);
int chunk_fill(struct blob *b, uint64_t c, int readahead, struct chunk_copy *copy);
int cache_read(struct blob *b, char *dst, uint64_t off, uint64_t len);
/* pread exactly len bytes at off (EINTR retried; EOF: -EIO). */
int pread_full(int fd, void *buf, uint64_t len, uint64_t off);
uint64_t cache_used(void);
uint64_t cache_max(void);
void cache_set_max(uint64_t max);
void cache_close_all(void);
int valid_hex(const char *s);

/* verify.c */
int blob_index_load(struct blob *b);
int blob_verify(struct blob *b, uint64_t off, const char *buf, uint64_t len);

/* store.c */
uint64_t now_ns(void); /* CLOCK_MONOTONIC */
void lat_observe(struct lat_hist *h, uint64_t ns);
int store_fetch(struct blob *b, uint64_t c, char *buf, uint64_t len);
int readahead_start(void);
void readahead_stop(void);
void readahead_queue(struct blob *b, uint64_t first, uint64_t count);

#endif
