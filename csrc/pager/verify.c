/* verify.c - checking fetched chunks against the layer's chunk index.
 *
 * The store is a shared, remote file system: a blob in it can rot or be
 * replaced after it was written. The whole-blob sha256 cannot be checked
 * lazily (that needs every byte), so each layer carries a chunk index: the
 * sha256 of every 64 KiB block of the blob, written when the layer is built
 * (dsecd/fs/store.py) and referenced, by its own digest, from the image
 * manifest. The daemon checks the index against that digest and places it
 * in the cache dir as <hex>.idx before it mounts the layer; the pager loads
 * it when the blob is opened and checks every block it fetches from the
 * store. A block that does not match is EIO to the reader (never wrong
 * bytes), is not cached, and is counted in the blob's "corrupt" counter.
 *
 * Format (little endian):
 *   0  "DSECIDX1"
 *   8  u32 block size (a power of two; the chunk size must be a multiple)
 *  12  u32 0
 *  16  u64 blob size
 *  24  sha256 of each block, ceil(size / block) x 32 bytes
 */
#define _GNU_SOURCE
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "pager.h"

#define INDEX_MAGIC "DSECIDX1"
#define INDEX_HEADER 24
#define SHA256_LEN 32

/* Parse a whole index file; on success *out owns the hashes. */
static int parse_index(struct blob *b, int fd, const char *path, uint8_t **out, uint32_t *block_out)
{
    uint8_t head[INDEX_HEADER];
    struct stat st;
    uint32_t block;
    uint64_t size, nblocks;
    uint8_t *hashes;
    int rc;

    if (fstat(fd, &st) < 0)
        return -errno;
    if ((rc = pread_full(fd, head, sizeof(head), 0)) < 0) {
        fprintf(stderr, "dsec-pager: chunk index %s: short header\n", path);
        return -EIO;
    }
    memcpy(&block, head + 8, 4);
    memcpy(&size, head + 16, 8);
    block = le32toh(block);
    size = le64toh(size);
    if (memcmp(head, INDEX_MAGIC, 8) != 0 || block < 4096 || (block & (block - 1))) {
        fprintf(stderr, "dsec-pager: chunk index %s: not an index (bad magic or block size)\n", path);
        return -EIO;
    }
    if (size != b->size) {
        fprintf(stderr, "dsec-pager: chunk index %s is for %llu bytes, the store blob has %llu\n", path,
                (unsigned long long)size, (unsigned long long)b->size);
        return -EIO;
    }
    if (g_cfg.chunk_size % block) {
        fprintf(stderr, "dsec-pager: chunk index %s has %u-byte blocks; the chunk size %llu is "
                "not a multiple of it, so fetched chunks cannot be checked\n", path, block,
                (unsigned long long)g_cfg.chunk_size);
        return -EINVAL;
    }
    nblocks = (size + block - 1) / block;
    if ((uint64_t)st.st_size != INDEX_HEADER + nblocks * SHA256_LEN) {
        fprintf(stderr, "dsec-pager: chunk index %s: %lld bytes, expected %llu\n", path,
                (long long)st.st_size, (unsigned long long)(INDEX_HEADER + nblocks * SHA256_LEN));
        return -EIO;
    }
    if (!(hashes = malloc(nblocks * SHA256_LEN + 1)))
        return -ENOMEM;
    if ((rc = pread_full(fd, hashes, nblocks * SHA256_LEN, INDEX_HEADER)) < 0) {
        free(hashes);
        return -EIO;
    }
    *out = hashes;
    *block_out = block;
    return 0;
}

int blob_index_load(struct blob *b)
{
    char path[4096];
    uint8_t *hashes = NULL;
    uint32_t block = 0;
    int fd, rc;

    if (atomic_load_explicit(&b->index, memory_order_acquire))
        return 0;
    snprintf(path, sizeof(path), "%s/%s.idx", g_cfg.cache_dir, b->hex);
    pthread_mutex_lock(&b->attach_lock);
    rc = 0;
    if (!b->index) {
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            /* No index (yet): the daemon places one before it mounts a layer
             * that has one; until then fetches are not checked. */
            rc = errno == ENOENT ? 0 : -errno;
        } else {
            rc = parse_index(b, fd, path, &hashes, &block);
            close(fd);
            if (rc == 0) {
                b->index_block = block;
                atomic_store_explicit(&b->index, hashes, memory_order_release);
            }
        }
    }
    pthread_mutex_unlock(&b->attach_lock);
    return rc;
}

int blob_verify(struct blob *b, uint64_t off, const char *buf, uint64_t len)
{
    const uint8_t *hashes = atomic_load_explicit(&b->index, memory_order_acquire);
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned mdlen;

    if (!hashes)
        return 0;
    for (uint64_t pos = 0; pos < len; pos += b->index_block) {
        uint64_t n = len - pos < b->index_block ? len - pos : b->index_block;
        uint64_t blk = (off + pos) / b->index_block;

        if (EVP_Digest(buf + pos, n, md, &mdlen, EVP_sha256(), NULL) != 1 || mdlen != SHA256_LEN) {
            fprintf(stderr, "dsec-pager: sha256 of %s block %llu failed\n", b->hex,
                    (unsigned long long)blk);
            return -EIO;
        }
        if (memcmp(md, hashes + blk * SHA256_LEN, SHA256_LEN) != 0) {
            b->st.corrupt++;
            fprintf(stderr, "dsec-pager: store blob %s: block %llu (bytes %llu-%llu) does not match "
                    "the layer's chunk index: the store copy is corrupt; readers get EIO\n",
                    b->hex, (unsigned long long)blk, (unsigned long long)(off + pos),
                    (unsigned long long)(off + pos + n));
            return -EIO;
        }
    }
    b->st.verified_bytes += len;
    return 0;
}
