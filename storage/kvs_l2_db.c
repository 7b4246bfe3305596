/* L2 records and databases: the object header (format version 2, bound to
 * its key), reading a record into L1, metadata counts, LRU stamps and
 * eviction — the work done inside a transaction. See kvs_l2_impl.h. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvs_error.h"

#define KVS_LOG_COMPONENT "l2"
#include "kvs_l2_impl.h"
#include "kvs_l2_verify.h"

/* ---- records ------------------------------------------------------------------ */

/* Fingerprint of a value as found: its size and header bytes. */
uint64_t kvs__l2_value_fp(const MDB_val *v)
{
	return XXH3_64bits(v->mv_data, v->mv_size < HDR_BYTES ? v->mv_size : HDR_BYTES) ^ v->mv_size;
}

/* Classifies a record found under key (kvs_record_check). */
int kvs__l2_check_hdr(const MDB_val *v, const kvs_objkey *key, uint64_t geom, l2_hdr *h)
{
	return kvs_record_check(v->mv_data, v->mv_size, key, geom, h);
}

/* A reader found the record under key unusable: count it, queue its
 * deletion (the writer deletes it only if it is still the same value). */
void kvs__l2_drop_found(kvs_l2 *l2, const kvs_objkey *key, const MDB_val *v, int why)
{
	uint64_t fp = kvs__l2_value_fp(v);
	pthread_mutex_lock(&l2->mu);
	if (why == HDR_KEY)
		l2->st.key_mismatches++;
	else if (why == HDR_BAD)
		l2->st.header_mismatches++;
	else
		l2->st.checksum_failures++;
	if (l2->n_drops < MAX_TOUCHES)
		l2->drops[l2->n_drops++] = (l2_drop){.key = *key, .fp = fp}; /* never served: delete it */
	pthread_cond_signal(&l2->wcv);
	pthread_mutex_unlock(&l2->mu);
	kvs_warn_rl(&l2->rl_bad, "%s: record dropped",
		    why == HDR_KEY ? "record found under another object's key"
		    : why == HDR_BAD ? "record of another format version or with a damaged header"
				     : "checksum mismatch");
}

/* ---- reading a record into L1 (reader thread, read txn) ----------------------- */

/* pread all of [buf, buf+n) from the data file at off; 0 or an errno. */
static int pread_full(int fd, void *buf, uint64_t n, off_t off)
{
	for (uint64_t done = 0; done < n;) {
		ssize_t r = pread(fd, (uint8_t *)buf + done, n - done, off + (off_t)done);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return r < 0 ? errno : EIO;
		done += (uint64_t)r;
	}
	return 0;
}

/* One object into its L1 reservation (dst, len bytes), checksum verified
 * (a reader thread, in a read transaction: the snapshot keeps the record's
 * pages from reuse). The header and the data are read with pread at the record's offset in
 * data.mdb (the map is the whole file from offset 0), not through the
 * mapping: touching the map costs a page fault per 4 KiB page in a process
 * that did not write it (a fresh map after a restart, or data the writer
 * put with pwrite), which made reads 0.15-0.25 of a plain read() (issue 18).
 * The data lands in the destination in slices of READ_SLICE bytes and each
 * slice is hashed right after, while it is in cache. Without a known map
 * base (no WRITEMAP mapping found) the same is done with memcpy from the
 * map. */
int kvs__l2_read_record(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key, uint64_t geom, void *dst_, uint64_t len,
			kvs_record_hasher *xs)
{
	MDB_val k = {sizeof(*key), (void *)key}, v;
	int rc = mdb_get(txn, l2->obj, &k, &v);
	if (rc) {
		if (rc != MDB_NOTFOUND)
			kvs__l2_note_error(l2, rc, "read");
		return KVS_E_MISS;
	}
	const uint8_t *rec = v.mv_data;
	bool by_file = l2->map_base && l2->fd >= 0;
	off_t foff = by_file ? (off_t)(rec - l2->map_base) : 0;
	l2_hdr h;
	uint8_t hb[HDR_BYTES];
	int c;
	if (by_file && v.mv_size >= HDR_BYTES) {
		if ((rc = pread_full(l2->fd, hb, HDR_BYTES, foff)) != 0) {
			kvs_warn_rl(&l2->rl_bad, "L2 %s: read failed: %s", l2->path, strerror(rc));
			return KVS_E_MISS;
		}
		c = kvs_record_check(hb, v.mv_size, key, geom, &h);
	} else {
		c = kvs__l2_check_hdr(&v, key, geom, &h);
	}
	if (c == HDR_BAD || c == HDR_KEY) {
		kvs__l2_drop_found(l2, key, &v, c);
		return KVS_E_MISS;
	}
	if (c == HDR_GEOM || h.len != len) {
		pthread_mutex_lock(&l2->mu);
		l2->st.header_mismatches++;
		pthread_mutex_unlock(&l2->mu);
		return KVS_E_MISS;
	}
	uint8_t *dst = dst_;
	kvs_record_hasher_reset(xs, kvs_record_seed(&h, key));
	for (uint64_t off = 0; off < h.len;) {
		uint64_t n = h.len - off < READ_SLICE ? h.len - off : READ_SLICE;
		if (by_file) {
			if ((rc = pread_full(l2->fd, dst + off, n, foff + HDR_BYTES + (off_t)off)) != 0) {
				kvs_warn_rl(&l2->rl_bad, "L2 %s: read failed: %s", l2->path, strerror(rc));
				return KVS_E_MISS;
			}
		} else {
			memcpy(dst + off, rec + HDR_BYTES + off, n);
		}
		kvs_record_hasher_update(xs, dst + off, n);
		off += n;
	}
	if (kvs_record_hasher_digest(xs) != h.checksum) {
		kvs__l2_drop_found(l2, key, &v, HDR_OK);
		return KVS_E_MISS;
	}
	return 0;
}

/* ---- metadata, stamps, eviction (writer txn) ------------------------------------ */

uint64_t kvs__l2_meta_get(MDB_txn *txn, MDB_dbi dbi, const char *name)
{
	MDB_val k = {strlen(name), (void *)name}, v;
	uint64_t x = 0;
	if (mdb_get(txn, dbi, &k, &v) == 0 && v.mv_size == 8)
		memcpy(&x, v.mv_data, 8);
	return x;
}

int kvs__l2_meta_put(MDB_txn *txn, MDB_dbi dbi, const char *name, uint64_t x)
{
	MDB_val k = {strlen(name), (void *)name}, v = {8, &x};
	return mdb_put(txn, dbi, &k, &v, 0);
}

static void lru_key(uint8_t out[8 + sizeof(kvs_objkey)], uint64_t stamp, const kvs_objkey *key)
{
	for (int i = 0; i < 8; i++)
		out[i] = (uint8_t)(stamp >> (56 - 8 * i)); /* big-endian: cursor order = age */
	memcpy(out + 8, key, sizeof(*key));
}

int kvs__l2_check_overflow(kvs_l2 *l2, const MDB_val *v)
{
	if (!l2->map_base || (uint8_t *)v->mv_data < l2->map_base + KVS_L2_PAGE_HDR)
		return 0; /* no map known: nothing to check against */
	uint64_t off = (uint64_t)((uint8_t *)v->mv_data - l2->map_base);
	if (off % l2->psize != KVS_L2_PAGE_HDR)
		return 0; /* inside a leaf page: no run of its own */
	if (kvs_l2_overflow_ok((const uint8_t *)v->mv_data - KVS_L2_PAGE_HDR, off / l2->psize, v->mv_size,
			       (uint32_t)l2->psize, l2->map_now / l2->psize))
		return 0;
	kvs__l2_note_error(l2, MDB_CORRUPTED, "an object's overflow run is damaged (left in place, not freed)");
	return MDB_CORRUPTED;
}

/* Removes an object and its stamps; *freed: the value bytes freed (0 if
 * absent). MDB_CORRUPTED if its overflow run is damaged: then it stays, and
 * the file is set aside at the next start. */
int kvs__l2_del_object(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key, uint64_t *freed)
{
	MDB_val k = {sizeof(*key), (void *)key}, v;
	*freed = 0;
	if (mdb_get(txn, l2->obj, &k, &v) == 0) {
		if (kvs__l2_check_overflow(l2, &v) != 0)
			return MDB_CORRUPTED;
		*freed = v.mv_size;
		mdb_del(txn, l2->obj, &k, NULL);
	}
	if (mdb_get(txn, l2->atime, &k, &v) == 0 && v.mv_size == 8) {
		uint64_t stamp;
		memcpy(&stamp, v.mv_data, 8);
		uint8_t lk[8 + sizeof(kvs_objkey)];
		lru_key(lk, stamp, key);
		MDB_val lv = {sizeof(lk), lk};
		mdb_del(txn, l2->lru, &lv, NULL);
		mdb_del(txn, l2->atime, &k, NULL);
	}
	return 0;
}

int kvs__l2_stamp(kvs_l2 *l2, MDB_txn *txn, const kvs_objkey *key)
{
	MDB_val k = {sizeof(*key), (void *)key}, v;
	uint8_t lk[8 + sizeof(kvs_objkey)];
	if (mdb_get(txn, l2->atime, &k, &v) == 0 && v.mv_size == 8) {
		uint64_t old;
		memcpy(&old, v.mv_data, 8);
		lru_key(lk, old, key);
		MDB_val lv = {sizeof(lk), lk};
		mdb_del(txn, l2->lru, &lv, NULL);
	}
	uint64_t now = ++l2->clock;
	lru_key(lk, now, key);
	MDB_val lv = {sizeof(lk), lk}, empty = {0, NULL};
	MDB_val sv = {8, &now};
	int rc = mdb_put(txn, l2->lru, &lv, &empty, 0);
	if (!rc)
		rc = mdb_put(txn, l2->atime, &k, &sv, 0);
	return rc;
}

/* Bytes of the map the databases occupy now (branch, leaf and overflow
 * pages; free pages not counted): what fills the map, whatever the objects'
 * byte count says (an object of 32 KiB + header takes 9 pages). */
uint64_t kvs__l2_used_bytes(kvs_l2 *l2, MDB_txn *txn)
{
	MDB_dbi dbs[4] = {l2->obj, l2->lru, l2->atime, l2->meta};
	uint64_t pages = 0;
	for (int i = 0; i < 4; i++) {
		MDB_stat st;
		if (mdb_stat(txn, dbs[i], &st) == 0)
			pages += st.ms_branch_pages + st.ms_leaf_pages + st.ms_overflow_pages;
	}
	return pages * l2->psize;
}

/* Map bytes one object of len data bytes takes (its overflow pages). */
uint64_t kvs__l2_obj_pages(const kvs_l2 *l2, uint64_t len)
{
	uint64_t need = HDR_BYTES + len + 16; /* node header */
	return (need + l2->psize - 1) / l2->psize * l2->psize;
}

/* Deletes least-recently-used objects until *bytes <= target and the pages
 * in use are at most page_target, or until they freed max_freed bytes; adds
 * their number to *evicted (counted by the caller once the transaction
 * commits). */
int kvs__l2_evict_to(kvs_l2 *l2, MDB_txn *txn, uint64_t *bytes, uint64_t *objects, uint64_t target,
		     uint64_t page_target, uint64_t max_freed, uint64_t *evicted)
{
	uint64_t start = *bytes;
	MDB_cursor *cur;
	int rc = mdb_cursor_open(txn, l2->lru, &cur);
	if (rc)
		return rc;
	uint64_t n = 0;
	MDB_val k, v;
	while ((*bytes > target || kvs__l2_used_bytes(l2, txn) > page_target) && start - *bytes < max_freed &&
	       (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST)) == 0) {
		kvs_objkey key;
		if (k.mv_size != 8 + sizeof(key)) {
			mdb_cursor_del(cur, 0);
			continue;
		}
		memcpy(&key, (uint8_t *)k.mv_data + 8, sizeof(key));
		mdb_cursor_del(cur, 0);
		MDB_val ok = {sizeof(key), &key}, ov;
		if (mdb_get(txn, l2->obj, &ok, &ov) == 0 && kvs__l2_check_overflow(l2, &ov) == 0) {
			*bytes -= ov.mv_size < *bytes ? ov.mv_size : *bytes;
			if (*objects)
				(*objects)--;
			mdb_del(txn, l2->obj, &ok, NULL);
			n++;
			if (l2->cfg.report_evictions && l2->n_evicted == l2->cap_evicted) {
				uint32_t cap = l2->cap_evicted ? 2 * l2->cap_evicted : 256;
				kvs_objkey *nk = realloc(l2->evicted, cap * sizeof(*nk));
				if (nk) {
					l2->evicted = nk;
					l2->cap_evicted = cap;
				}
			}
			if (l2->cfg.report_evictions && l2->n_evicted < l2->cap_evicted)
				l2->evicted[l2->n_evicted++] = key; /* reported once committed */
		}
		mdb_del(txn, l2->atime, &ok, NULL);
	}
	mdb_cursor_close(cur);
	*evicted += n;
	return rc == MDB_NOTFOUND ? 0 : rc;
}
