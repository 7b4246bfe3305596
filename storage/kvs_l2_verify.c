/* A structural check of an L2 data.mdb before LMDB maps it: the walk LMDB
 * itself never makes. LMDB trusts every page number, node offset and count
 * it reads; a damaged branch or leaf page sends it outside the map (SIGSEGV),
 * makes a write assert, or hands its writer a page that is still in use, so
 * that a later start dies while taking stores (issue 33 #1). This walk reads
 * the file with pread only, checks every bound before it uses it, and so
 * cannot fault on any file: it either passes or names the first damage.
 *
 * What it checks, against LMDB 0.9's on-disk format (lmdb.h 0.9.x, mdb.c's
 * MDB_page, MDB_node, MDB_db, MDB_meta; 64-bit pgno_t):
 *   - both meta pages: flags, magic, version, page size; the one LMDB will
 *     use (the higher txnid) in detail: last page inside the file, the free
 *     and main databases' records;
 *   - every tree (the free list, the main database, the four named ones
 *     kvside creates: obj, lru, atime, meta): each page's number in its
 *     header equals its place, its flags are a branch at every level but the
 *     last and a leaf there, its bounds and every node lie inside the page,
 *     keys ascend (within the page and within the bounds of the parent), no
 *     page is reached twice, the counts of branch, leaf and overflow pages
 *     and of entries equal those the database records (overflow pages: at
 *     most the recorded count);
 *   - every big value: its overflow run lies inside the used range and
 *     overlaps nothing else (its first page's header is checked by the
 *     writer before LMDB frees or reuses the run: kvs__l2_check_overflow);
 *   - the free list: every page number in it is inside the used range and
 *     neither in a tree nor listed twice (LMDB would hand it out again).
 * Object data (overflow page contents) is not read: the record checksum
 * covers it when it is served. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvs_l2_verify.h"
#include "kvs_time.h"

/* LMDB 0.9 on-disk format (mdb.c) */
#define PAGEHDRSZ 16u
#define NODESIZE 8u
#define P_BRANCH 0x01
#define P_LEAF 0x02
#define P_OVERFLOW 0x04
#define P_META 0x08
#define F_BIGDATA 0x01
#define F_SUBDATA 0x02
#define MDB_MAGIC 0xBEEFC0DEu
#define MDB_DATA_VERSION 1u
#define MDB_INTEGERKEY 0x08
#define P_INVALID (~(uint64_t)0)
#define DB_BYTES 48u
#define MAX_DEPTH 32
#define MAX_KEY 511u

typedef struct db_rec {
	uint32_t pad; /* in the free database of a meta: the page size */
	uint16_t flags, depth;
	uint64_t branch, leaf, overflow, entries, root;
} db_rec;

typedef struct walk {
	int fd;
	uint32_t psize;
	uint64_t npages; /* last_pg + 1: pages in use */
	uint8_t *seen;   /* a bit per page: in a tree, an overflow run or the free list */
	uint8_t *bufs[MAX_DEPTH + 1]; /* one page per level of the tree being walked */
	uint8_t *val;    /* a free-list record (grown as needed) */
	size_t val_cap;
	kvs_l2_verify_report *rep;
	char *why;
	size_t why_cap;
	/* the tree being walked */
	const char *tree;
	bool intkey;
	uint64_t n_branch, n_leaf, n_overflow, n_entries;
	/* the main database's named databases, found while walking it */
	struct {
		char name[16];
		db_rec db;
	} named[8];
	int n_named;
} walk;

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t rd32(const uint8_t *p) { return rd16(p) | (uint32_t)rd16(p + 2) << 16; }
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }

static int damaged(walk *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int damaged(walk *w, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(w->why, w->why_cap, fmt, ap);
	va_end(ap);
	return KVS_L2_VERIFY_DAMAGED;
}

static int read_at(walk *w, void *buf, size_t len, uint64_t off)
{
	size_t got = 0;
	while (got < len) {
		ssize_t r = pread(w->fd, (uint8_t *)buf + got, len - got, (off_t)(off + got));
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (r == 0)
			return damaged(w, "data.mdb ends inside page %llu", (unsigned long long)((off + got) / w->psize));
		got += (size_t)r;
	}
	return 0;
}

static void db_parse(const uint8_t *p, db_rec *d)
{
	d->pad = rd32(p);
	d->flags = rd16(p + 4);
	d->depth = rd16(p + 6);
	d->branch = rd64(p + 8);
	d->leaf = rd64(p + 16);
	d->overflow = rd64(p + 24);
	d->entries = rd64(p + 32);
	d->root = rd64(p + 40);
}

/* Marks pages [pg, pg + n) in use; a page marked before is damage. */
static int mark(walk *w, uint64_t pg, uint64_t n, const char *what)
{
	if (pg < 2 || n == 0 || n > w->npages || pg > w->npages - n)
		return damaged(w, "%s: %s at page %llu (+%llu) outside the %llu pages in use", w->tree, what,
			       (unsigned long long)pg, (unsigned long long)n, (unsigned long long)w->npages);
	for (uint64_t i = pg; i < pg + n; i++) {
		if (w->seen[i >> 3] & (1u << (i & 7)))
			return damaged(w, "%s: %s: page %llu is reached twice (a cycle, or a page both in use and "
				       "free)", w->tree, what, (unsigned long long)i);
		w->seen[i >> 3] |= (uint8_t)(1u << (i & 7));
	}
	w->rep->pages_marked += n;
	return 0;
}

/* LMDB's orders: memcmp then length (default), or native integers. */
static int key_cmp(const walk *w, const uint8_t *a, size_t na, const uint8_t *b, size_t nb)
{
	if (w->intkey && na == 8 && nb == 8) {
		uint64_t x = rd64(a), y = rd64(b);
		return x < y ? -1 : x > y;
	}
	int c = memcmp(a, b, na < nb ? na : nb);
	return c ? c : na < nb ? -1 : na > nb;
}

typedef struct bound {
	const uint8_t *k;
	size_t n;
} bound;

/* The node at slot i of page p: checks it lies inside the page. */
static int node_at(walk *w, const uint8_t *p, uint64_t pg, unsigned i, unsigned upper, bool leaf,
		   const uint8_t **ret)
{
	unsigned off = rd16(p + PAGEHDRSZ + 2 * i);
	if (off < upper || off + NODESIZE > w->psize)
		return damaged(w, "%s: page %llu: node %u at offset %u outside the page's nodes", w->tree,
			       (unsigned long long)pg, i, off);
	const uint8_t *n = p + off;
	unsigned ksize = rd16(n + 6), flags = rd16(n + 4);
	uint64_t size = NODESIZE + (uint64_t)ksize;
	if (leaf) {
		uint32_t dsize = rd16(n) | (uint32_t)rd16(n + 2) << 16;
		size += (flags & F_BIGDATA) ? 8 : dsize;
	}
	if (ksize > MAX_KEY || off + size > w->psize)
		return damaged(w, "%s: page %llu: node %u (key %u bytes) runs past the page", w->tree,
			       (unsigned long long)pg, i, ksize);
	*ret = n;
	return 0;
}

static int walk_free_record(walk *w, const uint8_t *data, uint64_t dsize);

/* A leaf's value: a big one's overflow run, a named database, a free-list
 * record. */
static int leaf_value(walk *w, const uint8_t *n, uint64_t pg, unsigned i, bool main_db)
{
	unsigned flags = rd16(n + 4), ksize = rd16(n + 6);
	uint64_t dsize = rd16(n) | (uint64_t)rd16(n + 2) << 16;
	const uint8_t *data = n + NODESIZE + ksize;
	if (flags & ~(unsigned)(F_BIGDATA | F_SUBDATA))
		return damaged(w, "%s: page %llu: node %u has flags 0x%x", w->tree, (unsigned long long)pg, i, flags);
	if ((flags & F_SUBDATA) != (main_db ? F_SUBDATA : 0) || (main_db && (flags & F_BIGDATA)))
		return damaged(w, "%s: page %llu: node %u is %s a named database", w->tree, (unsigned long long)pg, i,
			       main_db ? "not" : "");
	if (main_db) {
		if (dsize != DB_BYTES)
			return damaged(w, "main: page %llu: named database of %llu bytes", (unsigned long long)pg,
				       (unsigned long long)dsize);
		if (w->n_named >= (int)(sizeof(w->named) / sizeof(w->named[0])) || ksize == 0 ||
		    ksize >= sizeof(w->named[0].name))
			return damaged(w, "main: page %llu: an unexpected named database (key %u bytes)",
				       (unsigned long long)pg, ksize);
		memcpy(w->named[w->n_named].name, n + NODESIZE, ksize);
		w->named[w->n_named].name[ksize] = 0;
		db_parse(data, &w->named[w->n_named].db);
		w->n_named++;
		return 0;
	}
	if (!(flags & F_BIGDATA))
		return strcmp(w->tree, "free") == 0 ? walk_free_record(w, data, dsize) : 0;
	uint64_t opg = rd64(data);
	uint64_t need = (PAGEHDRSZ - 1 + dsize) / w->psize + 1;
	if (opg < 2 || opg >= w->npages)
		return damaged(w, "%s: page %llu: node %u's value at page %llu outside the %llu pages in use", w->tree,
			       (unsigned long long)pg, i, (unsigned long long)opg, (unsigned long long)w->npages);
	/* the run's first page (its own number, flags, page count) is not read
	 * here: one read per big value is most of the walk's cost on a cold
	 * disk. LMDB only uses that header to free or reuse the run, and the
	 * writer checks it before any delete or overwrite of an object
	 * (kvs__l2_check_overflow); the free list's records are read below */
	int rc = mark(w, opg, need, "overflow run");
	if (rc)
		return rc;
	w->n_overflow += need;
	if (strcmp(w->tree, "free") == 0) {
		if (dsize > w->val_cap) {
			uint8_t *v = realloc(w->val, dsize);
			if (!v)
				return -ENOMEM;
			w->val = v;
			w->val_cap = dsize;
		}
		if ((rc = read_at(w, w->val, dsize, opg * w->psize + PAGEHDRSZ)) != 0)
			return rc;
		return walk_free_record(w, w->val, dsize);
	}
	return 0;
}

/* A free-list record: a count, then that many page numbers, each marked
 * (the trees are walked before the free list). */
static int walk_free_record(walk *w, const uint8_t *data, uint64_t dsize)
{
	if (dsize < 8 || dsize % 8)
		return damaged(w, "free: a free-list record of %llu bytes", (unsigned long long)dsize);
	uint64_t n = rd64(data);
	if (n != dsize / 8 - 1)
		return damaged(w, "free: a free-list record of %llu bytes counts %llu pages", (unsigned long long)dsize,
			       (unsigned long long)n);
	for (uint64_t i = 1; i <= n; i++) {
		int rc = mark(w, rd64(data + 8 * i), 1, "free-list page");
		if (rc)
			return rc;
	}
	w->rep->free_pages += n;
	return 0;
}

/* Walks the subtree at pg, level depth (1 = root) of a tree of `want`
 * levels; its keys must lie in [lo, hi). */
static int walk_page(walk *w, uint64_t pg, unsigned depth, unsigned want, bound lo, bound hi, bool main_db)
{
	if (depth > want || depth > MAX_DEPTH)
		return damaged(w, "%s: deeper than its %u levels at page %llu", w->tree, want, (unsigned long long)pg);
	int rc = mark(w, pg, 1, depth == want ? "leaf page" : "branch page");
	if (rc)
		return rc;
	uint8_t *p = w->bufs[depth];
	if ((rc = read_at(w, p, w->psize, pg * w->psize)) != 0)
		return rc;
	w->rep->pages_read++;
	bool leaf = depth == want;
	unsigned flags = rd16(p + 10); /* P_DIRTY and P_KEEP never reach a committed page */
	if (rd64(p) != pg)
		return damaged(w, "%s: page %llu says it is page %llu", w->tree, (unsigned long long)pg,
			       (unsigned long long)rd64(p));
	if (flags != (leaf ? P_LEAF : P_BRANCH))
		return damaged(w, "%s: page %llu has flags 0x%x where a %s page belongs", w->tree,
			       (unsigned long long)pg, rd16(p + 10), leaf ? "leaf" : "branch");
	unsigned lower = rd16(p + 12), upper = rd16(p + 14);
	if (lower < PAGEHDRSZ + 2 || (lower - PAGEHDRSZ) % 2 || lower > upper || upper > w->psize)
		return damaged(w, "%s: page %llu: bounds %u..%u", w->tree, (unsigned long long)pg, lower, upper);
	unsigned nkeys = (lower - PAGEHDRSZ) / 2;
	if (leaf)
		w->n_leaf++;
	else
		w->n_branch++;
	bound prev = lo;
	bool first = true; /* the first key may equal the parent's bound */
	for (unsigned i = 0; i < nkeys; i++) {
		const uint8_t *n;
		if ((rc = node_at(w, p, pg, i, upper, leaf, &n)) != 0)
			return rc;
		bound k = {n + NODESIZE, rd16(n + 6)};
		/* a branch's first key is not used (it stands for "below the second") */
		bool keyed = leaf || i > 0;
		if (keyed) {
			if (prev.k && key_cmp(w, prev.k, prev.n, k.k, k.n) >= (first ? 1 : 0))
				return damaged(w, "%s: page %llu: key %u out of order", w->tree, (unsigned long long)pg, i);
			if (hi.k && key_cmp(w, k.k, k.n, hi.k, hi.n) >= 0)
				return damaged(w, "%s: page %llu: key %u beyond its parent's bound", w->tree,
					       (unsigned long long)pg, i);
			prev = k;
			first = false;
		}
		if (leaf) {
			w->n_entries++;
			if ((rc = leaf_value(w, n, pg, i, main_db)) != 0)
				return rc;
			continue;
		}
		uint64_t child = rd16(n) | (uint64_t)rd16(n + 2) << 16 | (uint64_t)rd16(n + 4) << 32;
		bound clo = keyed ? k : lo, chi = hi;
		if (i + 1 < nkeys) {
			const uint8_t *nx;
			if ((rc = node_at(w, p, pg, i + 1, upper, false, &nx)) != 0)
				return rc;
			chi = (bound){nx + NODESIZE, rd16(nx + 6)};
		}
		if ((rc = walk_page(w, child, depth + 1, want, clo, chi, main_db)) != 0)
			return rc;
	}
	return 0;
}

static int walk_tree(walk *w, const char *name, const db_rec *d, bool main_db)
{
	w->tree = name;
	w->intkey = (d->flags & MDB_INTEGERKEY) != 0;
	w->n_branch = w->n_leaf = w->n_overflow = w->n_entries = 0;
	if (d->root == P_INVALID) {
		if (d->depth || d->branch || d->leaf || d->overflow || d->entries)
			return damaged(w, "%s: empty, yet it counts %u levels, %llu entries", name, d->depth,
				       (unsigned long long)d->entries);
		return 0;
	}
	if (d->depth == 0 || d->depth > MAX_DEPTH)
		return damaged(w, "%s: %u levels", name, d->depth);
	int rc = walk_page(w, d->root, 1, d->depth, (bound){0}, (bound){0}, main_db);
	if (rc)
		return rc;
	/* overflow pages: those the values need, at most what is recorded (a
	 * run reused in its transaction for a smaller value keeps its pages) */
	if (w->n_branch != d->branch || w->n_leaf != d->leaf || w->n_overflow > d->overflow ||
	    w->n_entries != d->entries)
		return damaged(w, "%s: found %llu branch, %llu leaf, %llu overflow pages and %llu entries; the "
			       "database records %llu, %llu, %llu and %llu", name, (unsigned long long)w->n_branch,
			       (unsigned long long)w->n_leaf, (unsigned long long)w->n_overflow,
			       (unsigned long long)w->n_entries, (unsigned long long)d->branch,
			       (unsigned long long)d->leaf, (unsigned long long)d->overflow,
			       (unsigned long long)d->entries);
	w->rep->entries += w->n_entries;
	return 0;
}

/* The meta page LMDB will use: both must be meta pages of this format, the
 * one with the higher txnid is taken (mdb_env_pick_meta). */
static int pick_meta(walk *w, uint64_t file_bytes, uint64_t *last_pg, db_rec *free_db, db_rec *main_db)
{
	uint8_t m[2][PAGEHDRSZ + 136];
	uint32_t psize = 0;
	for (int i = 0; i < 2; i++) {
		/* the second meta page sits one page size on: the first one says
		 * how large a page is */
		int rc = read_at(w, m[i], sizeof(m[i]), (uint64_t)i * psize);
		if (rc)
			return rc;
		const uint8_t *mm = m[i] + PAGEHDRSZ;
		if (!(rd16(m[i] + 10) & P_META) || rd32(mm) != MDB_MAGIC || rd32(mm + 4) != MDB_DATA_VERSION)
			return damaged(w, "meta page %d: not an LMDB 0.9 meta page (flags 0x%x, magic 0x%x, version %u)",
				       i, rd16(m[i] + 10), rd32(mm), rd32(mm + 4));
		uint32_t ps = rd32(mm + 24); /* mm_dbs[FREE_DBI].md_pad */
		if (i == 0)
			psize = ps;
		if (ps != psize || ps < 512 || ps > 65536 || (ps & (ps - 1)))
			return damaged(w, "meta page %d: page size %u", i, ps);
	}
	w->psize = psize;
	/* MDB_meta: magic 4, version 4, address 8, mapsize 8, dbs 2 x 48,
	 * last_pg 8, txnid 8 */
	int pick = rd64(m[0] + PAGEHDRSZ + 128) < rd64(m[1] + PAGEHDRSZ + 128);
	const uint8_t *mm = m[pick] + PAGEHDRSZ;
	db_parse(mm + 24, free_db);
	db_parse(mm + 24 + DB_BYTES, main_db);
	*last_pg = rd64(mm + 120);
	if (*last_pg < 1 || *last_pg >= file_bytes / psize)
		return damaged(w, "meta page %d: last page %llu, the file holds %llu pages", pick,
			       (unsigned long long)*last_pg, (unsigned long long)(file_bytes / psize));
	if (!(free_db->flags & MDB_INTEGERKEY) || main_db->flags)
		return damaged(w, "meta page %d: database flags 0x%x / 0x%x", pick, free_db->flags, main_db->flags);
	return 0;
}

int kvs_l2_verify(const char *file, kvs_l2_verify_report *rep, char *why, size_t why_cap)
{
	memset(rep, 0, sizeof(*rep));
	if (why_cap)
		why[0] = 0;
	uint64_t t0 = kvs_now_ns();
	walk w = {.rep = rep, .why = why, .why_cap = why_cap};
	w.fd = open(file, O_RDONLY | O_CLOEXEC);
	if (w.fd < 0)
		return -errno;
	struct stat sb;
	int rc = fstat(w.fd, &sb) < 0 ? -errno : 0;
	if (rc)
		goto out;
	if (sb.st_size < 2 * 512) {
		rc = sb.st_size == 0 ? 0 : damaged(&w, "data.mdb has %lld bytes", (long long)sb.st_size);
		goto out;
	}
	posix_fadvise(w.fd, 0, 0, POSIX_FADV_RANDOM);
	uint64_t last_pg = 0;
	db_rec free_db, main_db;
	if ((rc = pick_meta(&w, (uint64_t)sb.st_size, &last_pg, &free_db, &main_db)) != 0)
		goto out;
	w.npages = last_pg + 1;
	rep->used_bytes = w.npages * w.psize;
	w.seen = calloc(w.npages / 8 + 1, 1);
	for (int i = 0; i <= MAX_DEPTH && w.seen; i++)
		if (!(w.bufs[i] = malloc(w.psize)))
			break;
	if (!w.seen || !w.bufs[MAX_DEPTH]) {
		rc = -ENOMEM;
		goto out;
	}
	if ((rc = walk_tree(&w, "main", &main_db, true)) != 0)
		goto out;
	for (int i = 0; i < w.n_named; i++)
		if ((rc = walk_tree(&w, w.named[i].name, &w.named[i].db, false)) != 0)
			goto out;
	/* the free list last: a page it lists must be in no tree */
	rc = walk_tree(&w, "free", &free_db, false);
out:
	free(w.seen);
	for (int i = 0; i <= MAX_DEPTH; i++)
		free(w.bufs[i]);
	free(w.val);
	close(w.fd);
	rep->us = (kvs_now_ns() - t0) / 1000u;
	return rc;
}

bool kvs_l2_overflow_ok(const uint8_t *hdr, uint64_t pgno, uint64_t dsize, uint32_t psize, uint64_t map_pages)
{
	uint64_t count = rd32(hdr + 12), need = (PAGEHDRSZ - 1 + dsize) / psize + 1;
	return rd64(hdr) == pgno && rd16(hdr + 10) == P_OVERFLOW && count >= need && pgno + count <= map_pages;
}
