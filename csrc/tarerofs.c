/* tarerofs.c - an OCI layer's tar stream straight into an uncompressed EROFS
 * image, in one pass (dsecd/fs/tarerofs.py drives it; docs/images-pull.md).
 *
 * Python decompresses the blob and hashes both streams; it feeds the tar's
 * bytes here in chunks. Each regular file's data is written to the image as
 * it arrives, from block 1 on, contiguous and padded to a whole block
 * (EROFS_INODE_FLAT_PLAIN: what a guest maps with DAX from virtio-pmem, as
 * mkfs.erofs -Enoinline_data lays it out). The names are kept in memory as
 * a tree; at the end the directory blocks, then the metadata area (inodes,
 * inline xattrs, inline tails of directories and symlinks) are written after
 * the data, and the superblock in block 0 points at it (meta_blkaddr).
 *
 * The tree follows dsecd/fs/oci.py's _Unpacker entry by entry, so that the
 * image reads as the directory that importer would have unpacked, once
 * mkfs.erofs -T0 built it: same checks (absolute names, `..`, a parent that
 * is a file or symlink, hard links only to non-directories made earlier,
 * whiteouts of "", ".", ".."), same replacement of a name that comes again,
 * OCI whiteouts as 0:0 character devices, `.wh..wh..opq` as
 * trusted.overlay.opaque=y, every time 0, xattrs of the tar not kept.
 *
 * The tar headers are read as Python's tarfile reads a stream (ustar, GNU
 * long names and links, PAX path/linkpath/size/uid/gid, base-256 numbers,
 * the end at the first zero block or at a bad header after the first).
 * What this writer does not serve (sparse files, PAX global headers) is
 * DSEC_TARFS_UNSERVED: the caller converts that layer the old way.
 *
 * Entry points return >= 0 or -errno (csrc/ERRORS.md); a content error is
 * -EINVAL with its message in dsec_tarfs_error().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "dsec_native.h"

#define BLK 4096u
#define BLKBITS 12
#define TARBLK 512u
#define OBUF_SIZE (1u << 20)
#define META_MAX (1u << 20)        /* a GNU long name or PAX header larger than this is refused */
#define EROFS_MAGIC 0xE0F5E1E2u
#define LAYOUT_PLAIN 0
#define LAYOUT_INLINE 2
#define XATTR_INDEX_TRUSTED 4
/* what this writer leaves to the unpack-and-mkfs path (the caller falls back) */
#define DSEC_TARFS_UNSERVED (-EOPNOTSUPP)

enum ft { FT_UNKNOWN, FT_REG, FT_DIR, FT_CHR, FT_BLK, FT_FIFO, FT_SOCK, FT_LNK };

struct inode {
    uint32_t mode, uid, gid, rdev, nlink;
    uint64_t size;
    uint64_t blkaddr;       /* first data block (regular files; dirs and long symlinks at the end) */
    char *link;             /* a symlink's target */
    struct node *dir;       /* a directory's node */
    uint8_t opaque;
    /* layout, filled at the end */
    uint8_t extended, layout, seen;
    uint32_t tail;          /* bytes inline after the inode */
    uint64_t nid;
    uint32_t ino;
    uint8_t *dirdata;       /* a directory's blocks */
};

struct node {
    struct node *parent, *hnext;
    char *name;
    uint16_t namelen;
    uint8_t removed;
    struct inode *ino;
    struct node **kids;     /* a directory's children, removed ones flagged */
    uint32_t nkids, capkids;
};

struct ptrvec { void **v; size_t n, cap; };

enum state { S_HEADER, S_DATA, S_SKIP, S_META, S_END };

struct dsec_tarfs {
    int fd;
    int failed;
    char err[512];
    enum state st;
    /* tar reading */
    uint8_t hdr[TARBLK];
    uint32_t hdrlen;
    uint64_t tarpos;            /* offset in the tar of the next byte fed */
    uint64_t left;              /* bytes of the current data / skip / meta */
    uint32_t pad;               /* padding after it, to a 512-byte boundary */
    char meta_type;
    uint8_t *meta; size_t metalen;
    /* what L, K and x headers said for the next member (first one wins, as tarfile applies them) */
    char *pend_name, *pend_link;
    int have_size, have_uid, have_gid;
    uint64_t pax_size, pax_uid, pax_gid;
    /* output */
    uint8_t *obuf; size_t olen;
    uint64_t opos;              /* image offset of obuf[0] */
    struct inode *cur;          /* the regular file whose data is arriving */
    uint64_t entries;
    /* the tree */
    struct node *root;
    struct node **hash; size_t hcap, hcount;
    struct ptrvec nodes, inodes;
    uint32_t owner_uid, owner_gid, implicit_dir_mode;
    uint64_t max_entries;       /* the tree lives in memory: a bound on what a layer makes it hold */
};

/* ------------------------------------------------------------ helpers */

static int fail(struct dsec_tarfs *w, int code, const char *fmt, ...)
{
    va_list ap;

    if (!w->failed) {
        va_start(ap, fmt);
        vsnprintf(w->err, sizeof(w->err), fmt, ap);
        va_end(ap);
        w->failed = code;
    }
    return -1;
}

/* A name for a message: printable ASCII as is, anything else \xNN, cut at
 * 160 bytes or when `out` (at least 8 bytes) is full, "..." saying so. */
static const char *shown(const char *s, size_t len, char *out, size_t outsz)
{
    size_t o = 0;

    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (i >= 160 || o + 8 > outsz) {        /* room for "..." and the NUL is left */
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out[o++] = (char)c;
        } else {
            snprintf(out + o, 5, "\\x%02x", c);
            o += 4;
        }
    }
    out[o] = 0;
    return out;
}

static int vec_push(struct ptrvec *v, void *p)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 256;
        void **nv = realloc(v->v, cap * sizeof(*nv));
        if (!nv)
            return -1;
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = p;
    return 0;
}

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { put16(p, (uint16_t)v); put16(p + 2, (uint16_t)(v >> 16)); }
static void put64(uint8_t *p, uint64_t v) { put32(p, (uint32_t)v); put32(p + 4, (uint32_t)(v >> 32)); }

/* ------------------------------------------------------------ output */

static int write_at(struct dsec_tarfs *w, const uint8_t *p, size_t len, uint64_t off)
{
    while (len) {
        ssize_t n = pwrite(w->fd, p, len, (off_t)off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return fail(w, -errno, "write the EROFS image: %s", strerror(errno));
        }
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int flush_out(struct dsec_tarfs *w)
{
    if (write_at(w, w->obuf, w->olen, w->opos) < 0)
        return -1;
    w->opos += w->olen;
    w->olen = 0;
    return 0;
}

static int out_write(struct dsec_tarfs *w, const uint8_t *p, size_t len)
{
    while (len) {
        size_t n = OBUF_SIZE - w->olen;
        if (n > len)
            n = len;
        memcpy(w->obuf + w->olen, p, n);
        w->olen += n;
        p += n;
        len -= n;
        if (w->olen == OBUF_SIZE && flush_out(w))
            return -1;
    }
    return 0;
}

static uint64_t out_pos(struct dsec_tarfs *w) { return w->opos + w->olen; }

/* Zeros up to the next block boundary. */
static int out_pad_block(struct dsec_tarfs *w)
{
    static const uint8_t zeros[BLK];
    uint64_t rem = out_pos(w) % BLK;

    return rem ? out_write(w, zeros, BLK - rem) : 0;
}

/* ------------------------------------------------------------ the tree */

static uint64_t hash_of(const struct node *parent, const char *name, size_t len)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uintptr_t)parent;

    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)name[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static int hash_grow(struct dsec_tarfs *w)
{
    size_t cap = w->hcap ? w->hcap * 2 : 4096;
    struct node **nh = calloc(cap, sizeof(*nh));

    if (!nh)
        return fail(w, -ENOMEM, "out of memory for the layer's names");
    for (size_t i = 0; i < w->hcap; i++) {
        struct node *n = w->hash[i];
        while (n) {
            struct node *next = n->hnext;
            size_t b = hash_of(n->parent, n->name, n->namelen) & (cap - 1);
            n->hnext = nh[b];
            nh[b] = n;
            n = next;
        }
    }
    free(w->hash);
    w->hash = nh;
    w->hcap = cap;
    return 0;
}

static struct node *lookup(struct dsec_tarfs *w, struct node *dir, const char *name, size_t len)
{
    struct node *n = w->hash[hash_of(dir, name, len) & (w->hcap - 1)];

    for (; n; n = n->hnext)
        if (n->parent == dir && n->namelen == len && memcmp(n->name, name, len) == 0)
            return n;
    return NULL;
}

static struct inode *new_inode(struct dsec_tarfs *w, uint32_t mode, uint32_t uid, uint32_t gid)
{
    struct inode *ino = calloc(1, sizeof(*ino));

    if (!ino || vec_push(&w->inodes, ino)) {
        free(ino);
        fail(w, -ENOMEM, "out of memory for the layer's inodes");
        return NULL;
    }
    ino->mode = mode;
    ino->uid = uid;
    ino->gid = gid;
    return ino;
}

/* Drop the name from the tree (its subtree with it, when a directory): the
 * way _Unpacker._remove unlinks or rmtree()s what the layer made there. */
static void unhash(struct dsec_tarfs *w, struct node *n)
{
    struct node **pp = &w->hash[hash_of(n->parent, n->name, n->namelen) & (w->hcap - 1)];

    for (; *pp; pp = &(*pp)->hnext)
        if (*pp == n) {
            *pp = n->hnext;
            w->hcount--;
            break;
        }
    n->removed = 1;
}

static struct node *add_node(struct dsec_tarfs *w, struct node *dir, const char *name, size_t len,
                             struct inode *ino)
{
    struct node *n = calloc(1, sizeof(*n));
    size_t b;

    if (!n || vec_push(&w->nodes, n) || !(n->name = malloc(len ? len : 1))) {
        if (n && (!w->nodes.n || w->nodes.v[w->nodes.n - 1] != n))
            free(n);
        fail(w, -ENOMEM, "out of memory for the layer's names");
        return NULL;
    }
    memcpy(n->name, name, len);
    n->namelen = (uint16_t)len;
    n->parent = dir;
    n->ino = ino;
    if (S_ISDIR(ino->mode))
        ino->dir = n;
    if (dir->nkids == dir->capkids) {
        uint32_t cap = dir->capkids ? dir->capkids * 2 : 8;
        struct node **k = realloc(dir->kids, cap * sizeof(*k));
        if (!k) {
            fail(w, -ENOMEM, "out of memory for the layer's names");
            return NULL;
        }
        dir->kids = k;
        dir->capkids = cap;
    }
    dir->kids[dir->nkids++] = n;
    if ((w->hcount + 1) * 4 > w->hcap * 3 && hash_grow(w))
        return NULL;
    b = hash_of(dir, name, len) & (w->hcap - 1);
    n->hnext = w->hash[b];
    w->hash[b] = n;
    w->hcount++;
    return n;
}

/* ------------------------------------------------------------ one member */

struct member {
    char type;
    char *name, *link;          /* NUL-terminated */
    uint64_t mode, uid, gid, size, devmajor, devminor;
};

#define MAX_PARTS 2048

struct parts { const char *p[MAX_PARTS]; uint16_t len[MAX_PARTS]; int n; };

/* A member's name as path components ("" and "." dropped), as oci._entry_parts. */
static int split_name(struct dsec_tarfs *w, const char *name, struct parts *out, const char *what)
{
    char b[200];
    const char *s = name;

    out->n = 0;
    if (name[0] == '/')
        return fail(w, -EINVAL, "entry '%s' is absolute or has '..'", shown(name, strlen(name), b, sizeof(b)));
    while (*s) {
        const char *e = strchr(s, '/');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        if (!(len == 0 || (len == 1 && s[0] == '.'))) {
            if (len == 2 && s[0] == '.' && s[1] == '.')
                return fail(w, -EINVAL, "entry '%s' is absolute or has '..'", shown(name, strlen(name), b, sizeof(b)));
            if (len > 255)
                return fail(w, -EINVAL, "%s '%s' has a part longer than NAME_MAX (255 bytes)", what,
                            shown(name, strlen(name), b, sizeof(b)));
            if (out->n == MAX_PARTS)
                return fail(w, -EINVAL, "%s '%s' is nested deeper than %d directories", what,
                            shown(name, strlen(name), b, sizeof(b)), MAX_PARTS);
            out->p[out->n] = s;
            out->len[out->n++] = (uint16_t)len;
        }
        if (!e)
            break;
        s = e + 1;
    }
    return 0;
}

/* The directory holding the last part, missing ancestors made as the
 * importer's os.mkdir(0o755) makes them (owned by the daemon, its umask applied). */
static struct node *parent_of(struct dsec_tarfs *w, const struct parts *pp, const char *name)
{
    struct node *dir = w->root;
    char b1[200], b2[300];

    for (int i = 0; i < pp->n - 1; i++) {
        struct node *c = lookup(w, dir, pp->p[i], pp->len[i]);
        if (!c) {
            struct inode *ino = new_inode(w, S_IFDIR | w->implicit_dir_mode, w->owner_uid, w->owner_gid);
            if (!ino || !(c = add_node(w, dir, pp->p[i], pp->len[i], ino)))
                return NULL;
        } else if (!S_ISDIR(c->ino->mode)) {
            fail(w, -EINVAL, "entry '%s': parent '%s' is not a directory (symlink or file)",
                 shown(name, strlen(name), b1, sizeof(b1)), shown(pp->p[i], pp->len[i], b2, sizeof(b2)));
            return NULL;
        }
        dir = c;
    }
    return dir;
}

static void remove_name(struct dsec_tarfs *w, struct node *dir, const char *name, size_t len)
{
    struct node *n = lookup(w, dir, name, len);

    if (n)
        unhash(w, n);
}

static int hard_link(struct dsec_tarfs *w, struct node *dir, const char *base, size_t blen,
                     const struct member *m)
{
    struct parts *tp = malloc(sizeof(*tp));
    struct node *n = w->root;
    char b1[200], b2[200];
    int rc = -1;

    if (!tp)
        return fail(w, -ENOMEM, "out of memory");
    if (split_name(w, m->link, tp, "hard link target"))
        goto out;
    for (int i = 0; n && i < tp->n - 1; i++) {
        n = lookup(w, n, tp->p[i], tp->len[i]);
        if (n && !S_ISDIR(n->ino->mode))
            n = NULL;
    }
    if (n && tp->n)
        n = lookup(w, n, tp->p[tp->n - 1], tp->len[tp->n - 1]);
    if (!tp->n || !n || S_ISDIR(n->ino->mode)) {
        fail(w, -EINVAL, "hard link '%s' -> '%s': the target is not a file, symlink or device this "
             "layer made earlier", shown(m->name, strlen(m->name), b1, sizeof(b1)),
             shown(m->link, strlen(m->link), b2, sizeof(b2)));
        goto out;
    }
    if (add_node(w, dir, base, blen, n->ino))
        rc = 0;
out:
    free(tp);
    return rc;
}

/* Apply one member to the tree, as _Unpacker.entry does to the disk. A
 * regular file's data then arrives through feed (w->cur). */
static int apply(struct dsec_tarfs *w, const struct member *m)
{
    static const char opq[] = ".wh..wh..opq";
    struct parts *pp = malloc(sizeof(*pp));
    struct node *dir, *n;
    struct inode *ino;
    const char *base;
    size_t blen;
    char b1[200], b2[200];
    uint32_t perm = (uint32_t)(m->mode & 07777);
    int rc = -1;

    if (!pp)
        return fail(w, -ENOMEM, "out of memory");
    if (split_name(w, m->name, pp, "entry"))
        goto out;
    if (!pp->n) {               /* the layer's root: the importer keeps its own */
        rc = 0;
        goto out;
    }
    base = pp->p[pp->n - 1];
    blen = pp->len[pp->n - 1];
    if (!(dir = parent_of(w, pp, m->name)))
        goto out;
    if (blen == sizeof(opq) - 1 && memcmp(base, opq, blen) == 0) {
        dir->ino->opaque = 1;
        rc = 0;
        goto out;
    }
    if (blen >= 4 && memcmp(base, ".wh.", 4) == 0) {
        const char *hidden = base + 4;
        size_t hlen = blen - 4;
        if (hlen == 0 || (hlen == 1 && hidden[0] == '.') || (hlen == 2 && hidden[0] == '.' && hidden[1] == '.')) {
            fail(w, -EINVAL, "entry '%s' is a whiteout of '%s', which names no file",
                 shown(m->name, strlen(m->name), b1, sizeof(b1)), shown(hidden, hlen, b2, sizeof(b2)));
            goto out;
        }
        remove_name(w, dir, hidden, hlen);
        if (!(ino = new_inode(w, S_IFCHR, w->owner_uid, w->owner_gid)) || !add_node(w, dir, hidden, hlen, ino))
            goto out;
        rc = 0;
        goto out;
    }
    n = lookup(w, dir, base, blen);
    if (m->type == '5') {
        if (n && S_ISDIR(n->ino->mode)) {
            ino = n->ino;
        } else {
            if (n)
                unhash(w, n);
            if (!(ino = new_inode(w, S_IFDIR, 0, 0)) || !add_node(w, dir, base, blen, ino))
                goto out;
        }
        ino->mode = S_IFDIR | perm;
    } else {
        if (n)
            unhash(w, n);
        switch (m->type) {
        case '0': case '\0': case '7':
            if (!(ino = new_inode(w, S_IFREG | perm, 0, 0)))
                goto out;
            ino->size = m->size;
            ino->blkaddr = m->size ? out_pos(w) / BLK : 0;
            w->cur = ino;
            break;
        case '2': {
            size_t len = strlen(m->link);
            if (len == 0 || len > 4095) {
                fail(w, -EINVAL, "symlink '%s' has %s target", shown(m->name, strlen(m->name), b1, sizeof(b1)),
                     len ? "a longer than PATH_MAX (4095 bytes)" : "an empty");
                goto out;
            }
            if (!(ino = new_inode(w, S_IFLNK | 0777, 0, 0)) || !(ino->link = strdup(m->link))) {
                fail(w, -ENOMEM, "out of memory");
                goto out;
            }
            ino->size = len;
            break;
        }
        case '1':
            rc = hard_link(w, dir, base, blen, m);      /* the target's inode, owner and mode */
            goto out;
        case '3': case '4':
            if (m->devmajor > 0xfff || m->devminor > 0xfffff) {
                fail(w, -EINVAL, "device '%s' has a number %llu:%llu past what Linux encodes (4095:1048575)",
                     shown(m->name, strlen(m->name), b1, sizeof(b1)),
                     (unsigned long long)m->devmajor, (unsigned long long)m->devminor);
                goto out;
            }
            if (!(ino = new_inode(w, (m->type == '3' ? S_IFCHR : S_IFBLK) | perm, 0, 0)))
                goto out;
            /* the kernel's new_encode_dev, as EROFS stores i_u.rdev */
            ino->rdev = (uint32_t)((m->devminor & 0xff) | (m->devmajor << 8) | ((m->devminor & ~0xffull) << 12));
            break;
        case '6':
            if (!(ino = new_inode(w, S_IFIFO | perm, 0, 0)))
                goto out;
            break;
        default:
            fail(w, -EINVAL, "entry '%s' has an unsupported type '%s'", shown(m->name, strlen(m->name), b1, sizeof(b1)),
                 shown(&m->type, 1, b2, sizeof(b2)));
            goto out;
        }
        if (!add_node(w, dir, base, blen, ino))
            goto out;
    }
    ino->uid = (uint32_t)m->uid;
    ino->gid = (uint32_t)m->gid;
    rc = 0;
out:
    free(pp);
    return rc;
}

/* ------------------------------------------------------------ tar headers */

/* tarfile's nts: the bytes up to the first NUL. */
static char *nts(const uint8_t *p, size_t len)
{
    size_t n = strnlen((const char *)p, len);
    char *s = malloc(n + 1);

    if (s) {
        memcpy(s, p, n);
        s[n] = 0;
    }
    return s;
}

/* tarfile's nti: octal text (spaces and NULs around it) or base-256. */
static int nti(const uint8_t *p, size_t len, uint64_t *out)
{
    uint64_t v = 0;
    size_t i = 0, end;

    if (p[0] == 0x80 || p[0] == 0xff) {
        if (p[0] == 0xff)
            return -1;          /* negative */
        for (i = 1; i < len; i++) {
            if (v >> 56)
                return -1;
            v = (v << 8) | p[i];
        }
        *out = v;
        return 0;
    }
    end = strnlen((const char *)p, len);
    while (i < end && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r' || p[i] == '\v' || p[i] == '\f'))
        i++;
    while (end > i && (p[end - 1] == ' ' || p[end - 1] == '\t' || p[end - 1] == '\n' || p[end - 1] == '\r' ||
                       p[end - 1] == '\v' || p[end - 1] == '\f'))
        end--;
    for (; i < end; i++) {
        if (p[i] < '0' || p[i] > '7' || (v >> 60))
            return -1;
        v = v * 8 + (uint64_t)(p[i] - '0');
    }
    *out = v;
    return 0;
}

static int checksum_ok(const uint8_t *h)
{
    uint64_t want;
    int64_t s_signed = 256;
    uint64_t s_unsigned = 256;

    if (nti(h + 148, 8, &want))
        return 0;
    for (int i = 0; i < 512; i++) {
        if (i >= 148 && i < 156)
            continue;
        s_unsigned += h[i];
        s_signed += (int8_t)h[i];
    }
    return want == s_unsigned || (int64_t)want == s_signed;
}

static void clear_pending(struct dsec_tarfs *w)
{
    free(w->pend_name);
    free(w->pend_link);
    w->pend_name = w->pend_link = NULL;
    w->have_size = w->have_uid = w->have_gid = 0;
}

static int pending_any(const struct dsec_tarfs *w)
{
    return w->pend_name || w->pend_link || w->have_size || w->have_uid || w->have_gid;
}

/* The records of a PAX extended header ("LEN KEY=VALUE\n"); the keys that
 * tarfile applies to a member and the importer uses are kept. */
static int parse_pax(struct dsec_tarfs *w)
{
    size_t pos = 0;

    while (pos < w->metalen && w->meta[pos]) {
        size_t len = 0, i = pos, klen;
        const uint8_t *key, *val, *eq;
        uint64_t num = 0;
        int numok = 1;

        while (i < w->metalen && w->meta[i] >= '0' && w->meta[i] <= '9' && len < (1u << 30))
            len = len * 10 + (size_t)(w->meta[i++] - '0');
        if (i == pos || i >= w->metalen || w->meta[i] != ' ' || len < 5 || pos + len > w->metalen ||
            i + 1 > pos + len - 1 || w->meta[pos + len - 1] != '\n')
            return fail(w, -EINVAL, "a PAX header at tar offset %llu has a malformed record",
                        (unsigned long long)w->tarpos);
        key = w->meta + i + 1;
        eq = memchr(key, '=', (size_t)(w->meta + pos + len - 1 - key));
        if (!eq)
            return fail(w, -EINVAL, "a PAX header at tar offset %llu has a record without '='",
                        (unsigned long long)w->tarpos);
        klen = (size_t)(eq - key);
        val = eq + 1;
        size_t vlen = (size_t)(w->meta + pos + len - 1 - val);
#define KEY(s) (klen == sizeof(s) - 1 && memcmp(key, s, klen) == 0)
        if (KEY("size") || KEY("uid") || KEY("gid")) {
            /* tarfile: int(value), 0 when that fails */
            if (vlen == 0 || vlen > 19)
                numok = 0;
            for (size_t j = 0; numok && j < vlen; j++) {
                if (val[j] < '0' || val[j] > '9')
                    numok = 0;
                else
                    num = num * 10 + (uint64_t)(val[j] - '0');
            }
            if (!numok)
                num = 0;
        }
        if (klen > 11 && memcmp(key, "GNU.sparse.", 11) == 0)
            return fail(w, DSEC_TARFS_UNSERVED, "a PAX sparse file at tar offset %llu",
                        (unsigned long long)w->tarpos);
        if (KEY("path") && !w->pend_name) {
            if (!(w->pend_name = nts(val, vlen)))
                return fail(w, -ENOMEM, "out of memory");
        } else if (KEY("linkpath") && !w->pend_link) {
            if (!(w->pend_link = nts(val, vlen)))
                return fail(w, -ENOMEM, "out of memory");
        } else if (KEY("size") && !w->have_size) {
            w->have_size = 1;
            w->pax_size = num;
        } else if (KEY("uid") && !w->have_uid) {
            w->have_uid = 1;
            w->pax_uid = num;
        } else if (KEY("gid") && !w->have_gid) {
            w->have_gid = 1;
            w->pax_gid = num;
        }
#undef KEY
        pos += len;
    }
    return 0;
}

static uint64_t padded(uint64_t n) { return (n + TARBLK - 1) / TARBLK * TARBLK; }

/* A complete 512-byte header in w->hdr. */
static int on_header(struct dsec_tarfs *w)
{
    const uint8_t *h = w->hdr;
    struct member m = {0};
    int zero = 1, rc = -1, first = w->tarpos == TARBLK && !pending_any(w);
    char b[200];

    for (unsigned i = 0; i < TARBLK; i++)
        if (h[i]) {
            zero = 0;
            break;
        }
    if (zero) {                       /* the end of the archive (tarfile's EOFHeaderError) */
        if (pending_any(w))
            return fail(w, -EINVAL, "the archive ends right after a long-name or PAX header");
        w->st = S_END;
        return 0;
    }
    if (!checksum_ok(h) || nti(h + 100, 8, &m.mode) || nti(h + 108, 8, &m.uid) || nti(h + 116, 8, &m.gid) ||
        nti(h + 124, 12, &m.size) || nti(h + 329, 8, &m.devmajor) || nti(h + 337, 8, &m.devminor)) {
        /* tarfile ends a stream at a bad header, but for the first one and one after a long-name or PAX header */
        if (first || pending_any(w))
            return fail(w, -EINVAL, "bad tar header at offset %llu (checksum or number fields)",
                        (unsigned long long)(w->tarpos - TARBLK));
        w->st = S_END;
        return 0;
    }
    m.type = (char)h[156];
    if (m.type == 'L' || m.type == 'K' || m.type == 'x' || m.type == 'X') {
        if (m.size > META_MAX)
            return fail(w, -EINVAL, "a long-name or PAX header of %llu bytes at tar offset %llu (over %u)",
                        (unsigned long long)m.size, (unsigned long long)(w->tarpos - TARBLK), META_MAX);
        w->meta_type = m.type;
        w->metalen = 0;
        w->left = m.size;
        w->pad = (uint32_t)(padded(m.size) - m.size);
        w->st = S_META;
        return 0;
    }
    if (m.type == 'g')
        return fail(w, DSEC_TARFS_UNSERVED, "a PAX global header at tar offset %llu",
                    (unsigned long long)(w->tarpos - TARBLK));
    if (m.type == 'S')
        return fail(w, DSEC_TARFS_UNSERVED, "a GNU sparse file at tar offset %llu",
                    (unsigned long long)(w->tarpos - TARBLK));
    {
        char *name = nts(h, 100), *prefix = nts(h + 345, 155);
        size_t nl = name ? strlen(name) : 0;
        if (!name || !prefix) {
            free(name);
            free(prefix);
            return fail(w, -ENOMEM, "out of memory");
        }
        if (m.type == '\0' && nl && name[nl - 1] == '/')
            m.type = '5';          /* an old V7 directory */
        if (w->pend_name) {
            m.name = w->pend_name;
            w->pend_name = NULL;
            free(name);
        } else if (*prefix) {
            m.name = malloc(strlen(prefix) + nl + 2);
            if (m.name)
                sprintf(m.name, "%s/%s", prefix, name);
            free(name);
        } else {
            m.name = name;
        }
        free(prefix);
    }
    if (w->pend_link) {
        m.link = w->pend_link;
        w->pend_link = NULL;
    } else {
        m.link = nts(h + 157, 100);
    }
    if (!m.name || !m.link) {
        fail(w, -ENOMEM, "out of memory");
        goto out;
    }
    if (w->have_size)
        m.size = w->pax_size;
    if (w->have_uid)
        m.uid = w->pax_uid;
    if (w->have_gid)
        m.gid = w->pax_gid;
    clear_pending(w);
    if (m.uid > 0xfffffffeull || m.gid > 0xfffffffeull) {
        fail(w, -EINVAL, "entry '%s' has a uid or gid past 32 bits (%llu:%llu)",
             shown(m.name, strlen(m.name), b, sizeof(b)), (unsigned long long)m.uid, (unsigned long long)m.gid);
        goto out;
    }
    if (++w->entries > w->max_entries) {
        fail(w, -EINVAL, "the layer has more than %llu entries (the writer keeps every name in memory)",
             (unsigned long long)w->max_entries);
        goto out;
    }
    w->cur = NULL;
    if (apply(w, &m))
        goto out;
    /* tarfile skips a member's data only for regular files (and unknown
     * types, refused above); the next header follows at once otherwise */
    if (m.type == '0' || m.type == '\0' || m.type == '7') {
        w->left = m.size;
        w->pad = (uint32_t)(padded(m.size) - m.size);
        w->st = S_DATA;
    }
    rc = 0;
out:
    free(m.name);
    free(m.link);
    return rc;
}

static int on_meta_done(struct dsec_tarfs *w)
{
    if (w->meta_type == 'x' || w->meta_type == 'X')
        return parse_pax(w);
    char **slot = w->meta_type == 'L' ? &w->pend_name : &w->pend_link;
    if (!*slot && !(*slot = nts(w->meta, w->metalen)))
        return fail(w, -ENOMEM, "out of memory");
    return 0;
}

/* ------------------------------------------------------------ entry points */

struct dsec_tarfs *dsec_tarfs_new(int out_fd, uint32_t root_mode, uint32_t implicit_dir_mode,
                                  uint32_t owner_uid, uint32_t owner_gid, uint64_t max_entries)
{
    struct dsec_tarfs *w = calloc(1, sizeof(*w));
    struct inode *ino;

    if (!w)
        return NULL;
    w->fd = out_fd;
    w->owner_uid = owner_uid;
    w->owner_gid = owner_gid;
    w->implicit_dir_mode = implicit_dir_mode & 07777;
    w->max_entries = max_entries;
    w->opos = BLK;             /* block 0: the superblock */
    w->obuf = malloc(OBUF_SIZE);
    w->meta = malloc(META_MAX + 1);
    if (!w->obuf || !w->meta || hash_grow(w))
        goto fail;
    ino = new_inode(w, S_IFDIR | (root_mode & 07777), owner_uid, owner_gid);
    if (!ino || !(w->root = calloc(1, sizeof(*w->root))) || vec_push(&w->nodes, w->root))
        goto fail;
    w->root->parent = w->root;
    w->root->ino = ino;
    ino->dir = w->root;
    return w;
fail:
    dsec_tarfs_free(w);
    return NULL;
}

const char *dsec_tarfs_error(struct dsec_tarfs *w) { return w->err; }
uint64_t dsec_tarfs_entries(struct dsec_tarfs *w) { return w->entries; }

/* Where the image's final bytes end while it is fed: file data is written
 * front to back from block 1 and never again, so [BLK, opos) is final once
 * flushed. Only block 0 (the superblock) and what lies past opos (data
 * still buffered, then directories and metadata) are written by finish. */
uint64_t dsec_tarfs_final_bytes(struct dsec_tarfs *w) { return w->opos; }

int dsec_tarfs_feed(struct dsec_tarfs *w, const char *data, size_t len)
{
    const uint8_t *p = (const uint8_t *)data;

    if (w->failed)
        return w->failed;
    while (len && w->st != S_END) {
        size_t n;
        switch (w->st) {
        case S_HEADER:
            n = TARBLK - w->hdrlen;
            if (n > len)
                n = len;
            memcpy(w->hdr + w->hdrlen, p, n);
            w->hdrlen += (uint32_t)n;
            w->tarpos += n;
            p += n;
            len -= n;
            if (w->hdrlen == TARBLK) {
                w->hdrlen = 0;
                if (on_header(w))
                    return w->failed;
                if (w->st == S_DATA && !w->left) {
                    w->st = S_HEADER;
                    w->cur = NULL;
                }
            }
            continue;
        case S_DATA:
        case S_META:
            n = w->left < len ? (size_t)w->left : len;
            if (w->st == S_DATA) {
                if (out_write(w, p, n))
                    return w->failed;
            } else {
                memcpy(w->meta + w->metalen, p, n);
                w->metalen += n;
            }
            w->left -= n;
            w->tarpos += n;
            p += n;
            len -= n;
            if (w->left)
                continue;
            if (w->st == S_DATA) {
                if (out_pad_block(w))
                    return w->failed;
                w->cur = NULL;
            } else if (on_meta_done(w)) {
                return w->failed;
            }
            w->left = w->pad;
            w->st = S_SKIP;
            /* fallthrough */
        case S_SKIP:
            n = w->left < len ? (size_t)w->left : len;
            w->left -= n;
            w->tarpos += n;
            p += n;
            len -= n;
            if (!w->left)
                w->st = S_HEADER;
            continue;
        case S_END:
            break;
        }
    }
    return w->st == S_END ? 1 : 0;
}

/* ------------------------------------------------------------ the metadata */

static uint8_t ftype(uint32_t mode)
{
    switch (mode & S_IFMT) {
    case S_IFREG: return FT_REG;
    case S_IFDIR: return FT_DIR;
    case S_IFCHR: return FT_CHR;
    case S_IFBLK: return FT_BLK;
    case S_IFIFO: return FT_FIFO;
    case S_IFSOCK: return FT_SOCK;
    case S_IFLNK: return FT_LNK;
    }
    return FT_UNKNOWN;
}

struct dent { const char *name; uint16_t len; struct inode *ino; };

static int cmp_dent(const void *a, const void *b)
{
    const struct dent *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->name, y->name, n);

    return c ? c : (int)x->len - (int)y->len;
}

/* A directory's entries, live ones, sorted with "." and "..": its size is
 * then fixed by the names alone (nids are filled in later). */
static struct dent *dir_entries(struct node *d, size_t *count)
{
    struct dent *e = malloc(((size_t)d->nkids + 2) * sizeof(*e));
    size_t n = 0;

    if (!e)
        return NULL;
    e[n++] = (struct dent){".", 1, d->ino};
    e[n++] = (struct dent){"..", 2, d->parent->ino};
    for (uint32_t i = 0; i < d->nkids; i++)
        if (!d->kids[i]->removed)
            e[n++] = (struct dent){d->kids[i]->name, d->kids[i]->namelen, d->kids[i]->ino};
    qsort(e, n, sizeof(*e), cmp_dent);
    *count = n;
    return e;
}

/* The size of a directory: blocks of dirents then names, an entry never split across blocks. */
static uint64_t dir_size(const struct dent *e, size_t n)
{
    uint64_t full = 0, used = 0;

    for (size_t i = 0; i < n; i++) {
        uint32_t need = 12u + e[i].len;
        if (used + need > BLK) {
            full++;
            used = 0;
        }
        used += need;
    }
    return full * BLK + used;
}

static void dir_fill(uint8_t *buf, const struct dent *e, size_t n)
{
    size_t i = 0;
    uint8_t *blk = buf;

    while (i < n) {
        size_t j = i, used = 0;
        while (j < n && used + 12u + e[j].len <= BLK)
            used += 12u + e[j++].len;
        size_t nameoff = (j - i) * 12, k = 0;
        for (size_t x = i; x < j; x++, k++) {
            uint8_t *de = blk + k * 12;
            put64(de, e[x].ino->nid);
            put16(de + 8, (uint16_t)nameoff);
            de[10] = ftype(e[x].ino->mode);
            de[11] = 0;
            memcpy(blk + nameoff, e[x].name, e[x].len);
            nameoff += e[x].len;
        }
        i = j;
        blk += BLK;
    }
}

static const uint8_t OPAQUE_XATTR[32] = {
    /* erofs_xattr_ibody_header: h_name_filter 0, no shared xattrs */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    /* erofs_xattr_entry: name "overlay.opaque" (14) in the trusted. index, value "y" (1) */
    14, XATTR_INDEX_TRUSTED, 1, 0, 'o', 'v', 'e', 'r', 'l', 'a', 'y', '.', 'o', 'p', 'a', 'q', 'u', 'e', 'y', 0,
};

int dsec_tarfs_finish(struct dsec_tarfs *w)
{
    struct ptrvec order = {0};          /* inodes in metadata order */
    struct ptrvec dirs = {0};
    struct dent **dents = NULL;
    size_t *ndents = NULL;
    uint8_t *meta = NULL;
    uint64_t off = 0, metasz, next_blk, meta_blk;
    int rc;

    if (w->failed)
        return w->failed;
    if (w->st == S_DATA || w->st == S_META || (w->st == S_SKIP && w->left) || pending_any(w))
        return fail(w, -EINVAL, "the archive ends inside a member (truncated at tar offset %llu)",
                    (unsigned long long)w->tarpos), w->failed;
    if (w->st == S_HEADER && w->hdrlen && w->tarpos == w->hdrlen)
        return fail(w, -EINVAL, "the archive is shorter than one tar header"), w->failed;
    if (w->tarpos == 0)
        return fail(w, -EINVAL, "empty file: no tar header"), w->failed;
    if (flush_out(w))
        return w->failed;
    next_blk = w->opos / BLK;

    /* the live tree, breadth first from the root: directories and the
     * inodes they name (a hard-linked inode once, nlink its live names) */
    if (vec_push(&dirs, w->root) || vec_push(&order, w->root->ino))
        goto nomem;
    w->root->ino->seen = 1;
    for (size_t di = 0; di < dirs.n; di++) {
        struct node *d = dirs.v[di];
        uint32_t subdirs = 0;
        for (uint32_t i = 0; i < d->nkids; i++) {
            struct node *k = d->kids[i];
            if (k->removed)
                continue;
            k->ino->nlink++;
            if (S_ISDIR(k->ino->mode)) {
                subdirs++;
                if (vec_push(&dirs, k))
                    goto nomem;
            }
            if (!k->ino->seen) {
                k->ino->seen = 1;
                if (vec_push(&order, k->ino))
                    goto nomem;
            }
        }
        d->ino->nlink = 2 + subdirs;
    }
    dents = calloc(dirs.n, sizeof(*dents));
    ndents = calloc(dirs.n, sizeof(*ndents));
    if (!dents || !ndents)
        goto nomem;
    for (size_t di = 0; di < dirs.n; di++) {
        struct node *d = dirs.v[di];
        if (!(dents[di] = dir_entries(d, &ndents[di])))
            goto nomem;
        d->ino->size = dir_size(dents[di], ndents[di]);
    }

    /* inode records in the metadata area; an inline tail stays in its inode's block */
    for (size_t i = 0; i < order.n; i++) {
        struct inode *ino = order.v[i];
        uint32_t isz, xsz = ino->opaque ? sizeof(OPAQUE_XATTR) : 0, rec;
        int has_data = S_ISDIR(ino->mode) || S_ISLNK(ino->mode);

        ino->extended = ino->uid > 0xffff || ino->gid > 0xffff || ino->size > 0xffffffffull || ino->nlink > 0xffff;
        isz = ino->extended ? 64 : 32;
        ino->layout = LAYOUT_PLAIN;
        ino->tail = 0;
        if (has_data && ino->size % BLK && isz + xsz + ino->size % BLK <= BLK) {
            ino->layout = LAYOUT_INLINE;
            ino->tail = (uint32_t)(ino->size % BLK);
        }
        rec = isz + xsz + ino->tail;
        if (off % BLK + rec > BLK)
            off = (off + BLK - 1) / BLK * BLK;
        ino->nid = off / 32;
        ino->ino = (uint32_t)(i + 1);
        off += (rec + 31) / 32 * 32;
        if (has_data) {           /* the whole blocks of a directory or symlink, after the file data */
            uint64_t blocks = ino->layout == LAYOUT_INLINE ? ino->size / BLK : (ino->size + BLK - 1) / BLK;
            ino->blkaddr = blocks ? next_blk : 0;
            next_blk += blocks;
        }
    }
    if (w->root->ino->nid > 0xffff)
        return fail(w, -EINVAL, "internal: the root inode is not first"), w->failed;
    meta_blk = next_blk;
    metasz = (off + BLK - 1) / BLK * BLK;
    if (!(meta = calloc(1, metasz ? metasz : BLK)))
        goto nomem;

    /* directory blocks: whole ones in the data area, the tail inline */
    for (size_t di = 0; di < dirs.n; di++) {
        struct inode *ino = ((struct node *)dirs.v[di])->ino;
        uint64_t full = (ino->size + BLK - 1) / BLK;
        uint8_t *buf = calloc(full, BLK);
        if (!buf)
            goto nomem;
        dir_fill(buf, dents[di], ndents[di]);
        uint64_t whole = ino->layout == LAYOUT_INLINE ? ino->size / BLK : full;
        rc = whole ? write_at(w, buf, whole * BLK, ino->blkaddr * BLK) : 0;
        if (!rc && ino->tail) {
            uint64_t at = ino->nid * 32 + (ino->extended ? 64 : 32) + (ino->opaque ? sizeof(OPAQUE_XATTR) : 0);
            memcpy(meta + at, buf + whole * BLK, ino->tail);
        }
        free(buf);
        if (rc)
            goto out;
    }
    for (size_t i = 0; i < order.n; i++) {
        struct inode *ino = order.v[i];
        uint8_t *r = meta + ino->nid * 32;
        uint32_t xsz = ino->opaque ? sizeof(OPAQUE_XATTR) : 0;
        uint32_t iu = (S_ISCHR(ino->mode) || S_ISBLK(ino->mode)) ? ino->rdev : (uint32_t)ino->blkaddr;

        put16(r, (uint16_t)(ino->extended | (ino->layout << 1)));
        put16(r + 2, (uint16_t)(xsz ? 1 + (xsz - 12) / 4 : 0));
        put16(r + 4, (uint16_t)ino->mode);
        if (ino->extended) {
            put64(r + 8, ino->size);
            put32(r + 16, iu);
            put32(r + 20, ino->ino);
            put32(r + 24, ino->uid);
            put32(r + 28, ino->gid);
            /* i_mtime 0, as mkfs.erofs -T0 */
            put32(r + 44, ino->nlink);
        } else {
            put16(r + 6, (uint16_t)ino->nlink);
            put32(r + 8, (uint32_t)ino->size);
            put32(r + 16, iu);
            put32(r + 20, ino->ino);
            put16(r + 24, (uint16_t)ino->uid);
            put16(r + 26, (uint16_t)ino->gid);
        }
        if (xsz)
            memcpy(r + (ino->extended ? 64 : 32), OPAQUE_XATTR, xsz);
        if (S_ISLNK(ino->mode)) {
            if (ino->layout == LAYOUT_INLINE) {
                memcpy(r + (ino->extended ? 64 : 32) + xsz, ino->link, ino->tail);
            } else {
                uint8_t blk[BLK] = {0};
                memcpy(blk, ino->link, ino->size);
                if (write_at(w, blk, BLK, ino->blkaddr * BLK))
                    goto out;
            }
        }
    }
    if (metasz && write_at(w, meta, metasz, meta_blk * BLK))
        goto out;

    /* the superblock, last: an image cut short on the way has none */
    {
        uint8_t sb[128] = {0};
        uint64_t blocks = meta_blk + metasz / BLK;
        if (blocks > 0xffffffffull) {
            fail(w, -EFBIG, "the layer needs %llu blocks, over EROFS's 2^32", (unsigned long long)blocks);
            goto out;
        }
        put32(sb, EROFS_MAGIC);
        sb[12] = BLKBITS;
        put16(sb + 14, (uint16_t)w->root->ino->nid);
        put64(sb + 16, order.n);
        put32(sb + 36, (uint32_t)blocks);
        put32(sb + 40, (uint32_t)meta_blk);
        if (write_at(w, sb, sizeof(sb), 1024))
            goto out;
        if (ftruncate(w->fd, (off_t)(blocks * BLK))) {
            fail(w, -errno, "size the EROFS image: %s", strerror(errno));
            goto out;
        }
    }
    goto out;
nomem:
    fail(w, -ENOMEM, "out of memory laying out the layer's metadata");
out:
    if (dents)
        for (size_t di = 0; di < dirs.n; di++)
            free(dents[di]);
    free(dents);
    free(ndents);
    free(meta);
    free(order.v);
    free(dirs.v);
    return w->failed ? w->failed : 0;
}

void dsec_tarfs_free(struct dsec_tarfs *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->nodes.n; i++) {
        struct node *n = w->nodes.v[i];
        free(n->name);
        free(n->kids);
        free(n);
    }
    for (size_t i = 0; i < w->inodes.n; i++) {
        struct inode *ino = w->inodes.v[i];
        free(ino->link);
        free(ino);
    }
    free(w->nodes.v);
    free(w->inodes.v);
    free(w->hash);
    free(w->obuf);
    free(w->meta);
    clear_pending(w);
    free(w);
}
