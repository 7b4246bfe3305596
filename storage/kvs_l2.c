/* L2 tier over LMDB: the queues, the writer thread (group commits, the
 * map-full path), the reader thread (checksummed reads into L1), opening and
 * closing, and the owner's API. Records and eviction live in kvs_l2_db.c,
 * crash-loop detection in kvs_l2_env.c, the disk under the map in
 * kvs_l2_disk.c. See kvs_l2.h for the contract and docs/architecture.md §6
 * for the design. */
#include "kvs_l2.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "kvs_cq.h"
#include "kvs_error.h"

#define KVS_LOG_COMPONENT "l2"
#include "kvs_dirlock.h"
#include "kvs_l2_impl.h"

typedef struct l2_item {
	struct l2_item *next;
	int op;
	kvs_objkey key;
	uint64_t geom;
	const void *src; /* write */
	void *dst;       /* read */
	uint64_t len;
	void *cookie;
	int result;
	uint64_t group; /* write: its write-behind group (0 = none) and its place in it */
	uint32_t idx;
	uint8_t *owned; /* META: key (mkey bytes) then value, owned by the item */
	uint32_t mkey;
} l2_item;

void kvs_l2_config_defaults(kvs_l2_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->size = 16ull << 30;
	cfg->sync = KVS_L2_SYNC_FULL;
	cfg->queue_max = 65536; /* the byte bound (queue_max_bytes) usually binds first */
	cfg->queue_max_bytes = 1ull << 30;
	cfg->batch_max = 256;
	cfg->batch_bytes = 256ull << 20;
	cfg->batch_ms = 2;
	cfg->readers = 4;
	cfg->efd = -1;
	cfg->verify = true;
}

static void list_push(l2_list *l, l2_item *it)
{
	it->next = NULL;
	if (l->tail)
		l->tail->next = it;
	else
		l->head = it;
	l->tail = it;
	l->n++;
	l->bytes += it->len;
}

/* Removes it (whose predecessor is prev, NULL for the head) from l. */
static void list_unlink(l2_list *l, l2_item *prev, l2_item *it)
{
	if (prev)
		prev->next = it->next;
	else
		l->head = it->next;
	if (l->tail == it)
		l->tail = prev;
	it->next = NULL;
	l->n--;
	l->bytes -= it->len;
}

/* The pending write to drop next (mu held): the oldest group's tail. Writes
 * of one group (a job's objects) are queued together; the one with the
 * highest idx (latest chunk) goes first, so what reaches the disk of a
 * group is always a prefix of it, never a suffix without its head. */
static l2_item *drop_victim(l2_list *wq, l2_item **ret_prev)
{
	l2_item *head = wq->head, *best = NULL, *best_prev = NULL, *prev = NULL;
	if (!head || head->op != KVS_L2_WRITE)
		return NULL;
	for (l2_item *it = head; it; prev = it, it = it->next) {
		if (it->op != KVS_L2_WRITE || it->group != head->group || (it != head && !head->group))
			break;
		if (!best || it->idx >= best->idx)
			best = it, best_prev = prev;
	}
	*ret_prev = best_prev;
	return best;
}

static l2_item *list_pop(l2_list *l)
{
	l2_item *it = l->head;
	if (!it)
		return NULL;
	l->head = it->next;
	if (!l->head)
		l->tail = NULL;
	l->n--;
	l->bytes -= it->len;
	return it;
}

/* The completion-queue item (loop thread): completions go to on_done. */
static void l2_ready(kvs_cq_item *it)
{
	kvs_l2 *l2 = (kvs_l2 *)((char *)it - offsetof(kvs_l2, ready));
	atomic_store(&l2->ready_posted, false); /* before reaping: later ones post again */
	kvs_l2_done d[64];
	uint32_t n;
	while ((n = kvs_l2_reap(l2, d, 64)) > 0)
		for (uint32_t i = 0; i < n; i++)
			l2->cfg.on_done(l2->cfg.done_arg, &d[i]);
}

static void signal_owner(kvs_l2 *l2)
{
	if (l2->cfg.cq) {
		if (!atomic_exchange(&l2->ready_posted, true))
			kvs_cq_post(l2->cfg.cq, &l2->ready);
	} else if (l2->cfg.efd >= 0) {
		uint64_t one = 1;
		ssize_t w = write(l2->cfg.efd, &one, sizeof(one));
		(void)w;
	}
}

/* mu held */
static void complete(kvs_l2 *l2, l2_item *it, int result)
{
	it->result = result;
	list_push(&l2->done, it);
}

static int lmdb_err(int rc) { return rc > 0 ? -rc : rc; }

/* ---- writer ------------------------------------------------------------------- */

/* Puts one object into an MDB_RESERVEd value: the header bound to its key,
 * then the data, hashed as it is copied (writer transaction). */
static int put_object(kvs_l2 *l2, MDB_txn *txn, const l2_item *it)
{
	MDB_val k = {sizeof(it->key), (void *)&it->key}, v = {HDR_BYTES + it->len, NULL};
	int rc = mdb_put(txn, l2->obj, &k, &v, MDB_RESERVE);
	if (rc)
		return rc;
	/* the space LMDB reserved must lie in the map: on a damaged free list
	 * or page it can point anywhere (chaos scenario 4 met a pwrite at an
	 * offset outside data.mdb, EINVAL on every commit of every start, so
	 * the file was never set aside); damage, not an I/O error */
	if (l2->map_base && ((uint8_t *)v.mv_data < l2->map_base ||
			     (uint64_t)((uint8_t *)v.mv_data - l2->map_base) + HDR_BYTES + it->len > l2->map_now))
		return MDB_CORRUPTED;
	l2_hdr h;
	kvs_record_init(&h, &it->key, it->geom, it->len);
	uint64_t seed = kvs_record_seed(&h, &it->key);
	/* copy in slices and hash what was just copied, while it is in cache */
	uint8_t *dst = (uint8_t *)v.mv_data + HDR_BYTES;
	const uint8_t *src = it->src;
	kvs_record_hasher *xs = l2->wxs;
	kvs_record_hasher_reset(xs, seed);
	if (l2->map_base) {
		/* MDB_RESERVE gave space in the map; fill it with pwrite at the
		 * same file offset rather than memcpy into the mapping: the page
		 * cache is shared, so the map sees the bytes, and the kernel's
		 * write path avoids a page fault (read of a hole + mkwrite) per
		 * 4 KiB page, 2x faster here. The commit's msync flushes them
		 * before the meta page, as with memcpy. Each slice is hashed
		 * just before it is written, while its source is in cache
		 * (issue 18). */
		off_t foff = (off_t)(dst - l2->map_base);
		for (uint64_t off = 0; off < it->len;) {
			uint64_t n = it->len - off < WRITE_SLICE ? it->len - off : WRITE_SLICE;
			kvs_record_hasher_update(xs, src + off, n);
			for (uint64_t done = 0; done < n;) {
				ssize_t w = pwrite(l2->fd, src + off + done, n - done, foff + (off_t)(off + done));
				if (w <= 0) {
					/* the errno itself (ENOSPC: "No space left on
					 * device"), not a blanket EIO */
					rc = w < 0 ? errno : ENOSPC;
					if (rc == EINTR)
						continue;
					return rc;
				}
				done += (uint64_t)w;
			}
			off += n;
		}
	} else {
		for (uint64_t off = 0; off < it->len;) {
			uint64_t n = it->len - off < WRITE_SLICE ? it->len - off : WRITE_SLICE;
			memcpy(dst + off, src + off, n);
			kvs_record_hasher_update(xs, dst + off, n);
			off += n;
		}
	}
	h.checksum = kvs_record_hasher_digest(xs);
	memcpy(v.mv_data, &h, HDR_BYTES);
	if (l2->map_base)
		kvs__l2_writeback_kick(l2, (uint64_t)((uint8_t *)v.mv_data - l2->map_base), HDR_BYTES + it->len, false);
	return 0;
}

/* One group commit: the batch's objects, pending stamps and drops, evicting
 * down to the watermarks or to evict_target (at most evict_max bytes).
 * Returns 0 or an LMDB error (nothing of the batch committed). */
static int write_batch(kvs_l2 *l2, l2_item *batch, uint32_t nb, const kvs_objkey *touches, uint32_t nt,
		       const l2_drop *drops, uint32_t nd, uint64_t evict_target, uint64_t evict_max)
{
	uint64_t incoming = 0, incoming_pages = 0, evicted = 0;
	uint32_t n_objects = 0;
	for (uint32_t i = 0; i < nb; i++)
		if (batch[i].op == KVS_L2_WRITE) {
			incoming += HDR_BYTES + batch[i].len;
			incoming_pages += kvs__l2_obj_pages(l2, batch[i].len);
			n_objects++;
		}
	kvs__l2_disk_reserve(l2, incoming_pages);
	if (l2->broken)
		return MDB_PANIC;
	MDB_txn *txn;
	l2->n_evicted = 0;
	l2->kick_lo = l2->kick_hi = 0;
	int rc = mdb_txn_begin(l2->env, NULL, 0, &txn);
	if (rc)
		return rc;
	kvs__l2_work_enter(l2, true);
	uint64_t bytes = kvs__l2_meta_get(txn, l2->meta, "bytes");
	uint64_t objects = kvs__l2_meta_get(txn, l2->meta, "objects");
	l2->clock = kvs__l2_meta_get(txn, l2->meta, "clock");
	uint64_t size = l2->capacity;
	uint64_t high = size / 100 * HIGH_PCT;
	for (uint32_t i = 0; i < nd; i++) {
		/* only the value the reader found: a record rewritten since stays */
		MDB_val k = {sizeof(drops[i].key), (void *)&drops[i].key}, v;
		if (mdb_get(txn, l2->obj, &k, &v) != 0 || kvs__l2_value_fp(&v) != drops[i].fp)
			continue;
		uint64_t f;
		if (kvs__l2_del_object(l2, txn, &drops[i].key, &f) == 0 && f) {
			bytes -= f < bytes ? f : bytes;
			objects -= objects ? 1 : 0;
		}
	}
	/* stamps before eviction: an access recorded before this batch must
	 * keep its object from counting as least recently used */
	for (uint32_t i = 0; i < nt; i++) {
		MDB_val k = {sizeof(touches[i]), (void *)&touches[i]}, v;
		if (mdb_get(txn, l2->obj, &k, &v) == 0 && (rc = kvs__l2_stamp(l2, txn, &touches[i])) != 0)
			goto abort;
	}
	/* watermarks over object bytes and over the pages actually in use: the
	 * page count is what runs the map full (issue 16: small objects whose
	 * pages cost 12 % more than their bytes wedged the map at 85 % bytes) */
	uint64_t used = kvs__l2_used_bytes(l2, txn);
	if (bytes + incoming > high || used + incoming_pages > size / 100 * PAGES_HIGH_PCT || evict_target < bytes ||
	    evict_target < used) {
		uint64_t target = size / 100 * LOW_PCT, ptarget = size / 100 * PAGES_LOW_PCT;
		if (evict_target < target)
			target = evict_target;
		if (evict_target < ptarget)
			ptarget = evict_target;
		ptarget = ptarget > incoming_pages ? ptarget - incoming_pages : 0;
		target = target > incoming ? target - incoming : 0;
		if ((rc = kvs__l2_evict_to(l2, txn, &bytes, &objects, target, ptarget, evict_max, &evicted)) != 0)
			goto abort;
	}
	for (uint32_t i = 0; i < nb; i++) {
		l2_item *it = &batch[i];
		if (it->op == KVS_L2_META) {
			uint8_t mk[2 + 64] = {'m', ':'};
			memcpy(mk + 2, it->owned, it->mkey);
			MDB_val k = {2 + it->mkey, mk}, v = {it->len, it->owned + it->mkey};
			if ((rc = mdb_put(txn, l2->meta, &k, &v, 0)) != 0)
				goto abort;
			continue;
		}
		/* overwrite = replace; a run LMDB would free by a damaged header
		 * fails the batch (kvs__l2_check_overflow) */
		uint64_t freed;
		if ((rc = kvs__l2_del_object(l2, txn, &it->key, &freed)) != 0)
			goto abort;
		if (freed) {
			bytes -= freed < bytes ? freed : bytes;
			objects -= objects ? 1 : 0;
		}
		if ((rc = put_object(l2, txn, it)) != 0)
			goto abort;
		bytes += HDR_BYTES + it->len;
		objects++;
		if ((rc = kvs__l2_stamp(l2, txn, &it->key)) != 0)
			goto abort;
	}
	if ((rc = kvs__l2_meta_put(txn, l2->meta, "bytes", bytes)) ||
	    (rc = kvs__l2_meta_put(txn, l2->meta, "objects", objects)) ||
	    (rc = kvs__l2_meta_put(txn, l2->meta, "clock", l2->clock)))
		goto abort;
	if (l2->map_base)
		kvs__l2_writeback_kick(l2, 0, 0, true);
	if (n_objects) {
		int f = atomic_exchange(&l2->inject, KVS_L2_INJECT_NONE);
		if (f == KVS_L2_INJECT_KILL)
			raise(SIGKILL);
		else if (f == KVS_L2_INJECT_SEGV)
			raise(SIGSEGV);
	}
	rc = mdb_txn_commit(txn);
	kvs__l2_work_leave(l2, true, rc == 0);
	if (rc)
		return rc;
	pthread_mutex_lock(&l2->mu);
	l2->st.bytes = bytes;
	l2->st.objects = objects;
	l2->st.evictions += evicted;
	/* report the evictions now that they are durable */
	for (uint32_t i = 0; i < l2->n_evicted; i++) {
		l2_item *it = calloc(1, sizeof(*it));
		if (!it)
			break;
		it->op = KVS_L2_EVICTED;
		it->key = l2->evicted[i];
		list_push(&l2->done, it);
	}
	pthread_mutex_unlock(&l2->mu);
	if (l2->n_evicted)
		signal_owner(l2);
	l2->n_evicted = 0;
	return 0;
abort:
	mdb_txn_abort(txn);
	kvs__l2_work_leave(l2, true, false);
	return rc;
}

/* MDB_MAP_FULL although the watermarks left room: the free pages are too
 * scattered for the batch (an object takes contiguous pages), or a full disk
 * capped the map. Evicts least-recently-used objects until twice the
 * batch's pages, and at least 1/32 of the capacity, are free — in small
 * transactions: the list of pages a transaction frees is itself an LMDB
 * record that needs contiguous pages, so one big eviction can fail where
 * small ones commit (issue 16: "evict to half" in one transaction wedged a
 * fragmented 256 MiB map for good). A step that fails is halved, one that
 * commits doubled (up to 32 MiB). Then one empty commit, because LMDB hands
 * out the pages a commit freed only from the second commit after it. */
static void evict_for(kvs_l2 *l2, uint64_t incoming_pages)
{
	uint64_t want = 2 * incoming_pages > l2->capacity / 32 ? 2 * incoming_pages : l2->capacity / 32;
	uint64_t step = 2ull << 20, freed = 0;
	while (freed < want) {
		pthread_mutex_lock(&l2->mu);
		uint64_t before = l2->st.bytes;
		pthread_mutex_unlock(&l2->mu);
		int rc = write_batch(l2, NULL, 0, NULL, 0, NULL, 0, 0, step);
		if (rc == MDB_MAP_FULL && step > l2->psize) {
			step /= 2;
			continue;
		}
		/* a transaction that only deletes a page's worth needs a few
		 * pages for its copies of the B-tree path, which the map's
		 * reserve above the capacity always has in a healthy
		 * environment; on a damaged free list or tree it runs the map
		 * full on every start (chaos scenario 4): set it aside next. Not
		 * with the map capped by a full disk (map_now < map_full): the
		 * reserve may be what the disk lacks */
		if (rc == MDB_MAP_FULL && l2->map_now >= l2->map_full && l2->suspect_fails++ == 0)
			kvs__l2_note_error(l2, MDB_CORRUPTED, "an eviction alone ran the map full");
		pthread_mutex_lock(&l2->mu);
		uint64_t after = l2->st.bytes;
		pthread_mutex_unlock(&l2->mu);
		if (rc || after >= before)
			break; /* nothing more to evict, or not even one object can go */
		freed += before - after;
		if (step < (32ull << 20))
			step *= 2;
	}
	write_batch(l2, NULL, 0, NULL, 0, NULL, 0, UINT64_MAX, UINT64_MAX);
}

static void *writer_main(void *arg)
{
	kvs_l2 *l2 = arg;
	void *alt = kvs__l2_thread_begin(l2);
	pthread_setname_np(pthread_self(), "kvs-l2-writer"); /* for top, perf */
	l2_item *batch = calloc(l2->cfg.batch_max, sizeof(*batch));
	l2_item **orig = calloc(l2->cfg.batch_max, sizeof(*orig));
	kvs_objkey *touches = calloc(MAX_TOUCHES, sizeof(*touches));
	l2_drop *drops = calloc(MAX_TOUCHES, sizeof(*drops));
	l2->wxs = kvs_record_hasher_new();
	if (!batch || !orig || !touches || !drops || !l2->wxs) {
		kvs_err("writer cannot start: out of memory");
		free(batch);
		free(orig);
		free(touches);
		free(drops);
		kvs_record_hasher_free(l2->wxs);
		l2->wxs = NULL;
		kvs__l2_thread_end(alt);
		return NULL;
	}
	pthread_mutex_lock(&l2->mu);
	const char *hold = getenv("KVS_TEST_L2_WRITER_HOLD_MS"); /* test hook: a backlog builds meanwhile */
	if (hold) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		uint64_t ns = (uint64_t)ts.tv_nsec + strtoull(hold, NULL, 10) * 1000000ull;
		ts.tv_sec += (time_t)(ns / 1000000000ull);
		ts.tv_nsec = (long)(ns % 1000000000ull);
		while (!l2->stop && pthread_cond_timedwait(&l2->wcv, &l2->mu, &ts) != ETIMEDOUT)
			;
	}
	for (;;) {
		while (!l2->wq.n && !l2->n_touches && !l2->n_drops && !l2->stop)
			pthread_cond_wait(&l2->wcv, &l2->mu);
		if (l2->stop && !l2->wq.n && !l2->n_touches && !l2->n_drops)
			break;
		/* group commit: wait briefly for the batch to fill */
		if (l2->wq.n < l2->cfg.batch_max && l2->wq.bytes < l2->cfg.batch_bytes && !l2->stop &&
		    l2->cfg.batch_ms) {
			struct timespec ts;
			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_sec += l2->cfg.batch_ms / 1000; /* tv_nsec must stay below 1 s */
			ts.tv_nsec += (long)(l2->cfg.batch_ms % 1000) * 1000000L;
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			pthread_cond_timedwait(&l2->wcv, &l2->mu, &ts);
		}
		/* the batch stays small against the capacity (see kvs_l2_open),
		 * which a full disk may have lowered */
		uint64_t bmax = l2->cfg.batch_bytes < l2->capacity / 32 ? l2->cfg.batch_bytes : l2->capacity / 32;
		uint32_t nb = 0;
		uint64_t bb = 0;
		while (nb < l2->cfg.batch_max && l2->wq.head && (nb == 0 || bb + l2->wq.head->len <= bmax)) {
			l2_item *it = list_pop(&l2->wq);
			orig[nb] = it;
			batch[nb++] = *it;
			bb += it->len;
		}
		uint32_t nt = l2->n_touches, nd = l2->n_drops;
		memcpy(touches, l2->touches, nt * sizeof(*touches));
		memcpy(drops, l2->drops, nd * sizeof(*drops));
		l2->n_touches = l2->n_drops = 0;
		l2->st.queue_depth = l2->wq.n;
		l2->st.queue_bytes = l2->wq.bytes;
		pthread_mutex_unlock(&l2->mu);

		int rc = write_batch(l2, batch, nb, touches, nt, drops, nd, UINT64_MAX, UINT64_MAX);
		if (rc == MDB_MAP_FULL) {
			pthread_mutex_lock(&l2->mu);
			l2->st.map_full_retries++;
			pthread_mutex_unlock(&l2->mu);
			uint64_t pages = 0;
			for (uint32_t i = 0; i < nb; i++)
				if (batch[i].op == KVS_L2_WRITE)
					pages += kvs__l2_obj_pages(l2, batch[i].len);
			evict_for(l2, pages);
			rc = write_batch(l2, batch, nb, touches, nt, drops, nd, UINT64_MAX, UINT64_MAX);
		}
		if (rc == MDB_MAP_FULL && l2->map_now < l2->map_full)
			rc = ENOSPC; /* the map is what the full disk holds: say so */
		if (rc) {
			kvs__l2_note_error(l2, rc, "group commit");
			kvs_warn_rl(&l2->rl_commit, "L2 %s: group commit of %u objects failed: %s", l2->path, nb,
				    mdb_strerror(rc));
		}
		/* a page with no room or a cursor stack too deep (LMDB's internal
		 * errors), a transaction LMDB itself invalidated, or a size it
		 * refuses (every key and value this writer passes is within
		 * LMDB's limits, and no database is DUPSORT, so only a damaged
		 * node can make it say so): a healthy environment never answers a
		 * group commit so (the map-full path aborts and retries cleanly);
		 * after random B-tree damage it answers so on every commit of
		 * every start (chaos scenario 4): the next start sets it aside */
		if ((rc == MDB_PAGE_FULL || rc == MDB_BAD_TXN || rc == MDB_BAD_VALSIZE || rc == MDB_CURSOR_FULL) &&
		    l2->suspect_fails++ == 0) {
			char what[160];
			snprintf(what, sizeof(what), "a group commit failed with %s", mdb_strerror(rc));
			kvs__l2_note_error(l2, MDB_CORRUPTED, what);
		}

		pthread_mutex_lock(&l2->mu);
		l2->st.write_batches++;
		for (uint32_t i = 0; i < nb; i++) {
			if (orig[i]->op == KVS_L2_META) {
				free(orig[i]->owned);
				free(orig[i]);
				continue;
			}
			if (rc)
				l2->st.write_errors++;
			else
				l2->st.writes++, l2->st.writes_committed++;
			complete(l2, orig[i], rc ? KVS_E_NOSPACE : 0);
		}
		if (nb)
			signal_owner(l2);
	}
	pthread_mutex_unlock(&l2->mu);
	free(batch);
	free(orig);
	free(touches);
	free(drops);
	kvs_record_hasher_free(l2->wxs);
	l2->wxs = NULL;
	kvs__l2_thread_end(alt);
	return NULL;
}

/* ---- reader ------------------------------------------------------------------- */

/* A read transaction on a thread other than the writer: holds the map lock
 * (no resize meanwhile) and marks L2 work for the fault handler. */
static int rtxn_begin(kvs_l2 *l2, MDB_txn **txn)
{
	pthread_rwlock_rdlock(&l2->maplock);
	int rc = l2->broken ? MDB_PANIC : mdb_txn_begin(l2->env, NULL, MDB_RDONLY, txn);
	if (rc) {
		pthread_rwlock_unlock(&l2->maplock);
		return rc;
	}
	kvs__l2_work_enter(l2, false);
	return 0;
}

static void rtxn_end(kvs_l2 *l2, MDB_txn *txn)
{
	mdb_txn_abort(txn);
	kvs__l2_work_leave(l2, false, false);
	pthread_rwlock_unlock(&l2->maplock);
}

static void *reader_main(void *arg)
{
	kvs_l2 *l2 = arg;
	void *alt = kvs__l2_thread_begin(l2);
	pthread_setname_np(pthread_self(), "kvs-l2-reader");
	kvs_record_hasher *xs = kvs_record_hasher_new();
	pthread_mutex_lock(&l2->mu);
	for (;;) {
		while (!l2->rq.n && !l2->stop)
			pthread_cond_wait(&l2->rcv, &l2->mu);
		if (!l2->rq.n)
			break;
		l2_item *it = list_pop(&l2->rq);
		pthread_mutex_unlock(&l2->mu);
		MDB_txn *txn;
		int r = xs ? rtxn_begin(l2, &txn) : KVS_E_INTERNAL;
		if (r == 0) {
			r = kvs__l2_read_record(l2, txn, &it->key, it->geom, it->dst, it->len, xs);
			rtxn_end(l2, txn);
		} else {
			r = KVS_E_MISS;
		}
		pthread_mutex_lock(&l2->mu);
		l2->st.reads++;
		if (r)
			l2->st.read_misses++;
		complete(l2, it, r);
		signal_owner(l2);
	}
	pthread_mutex_unlock(&l2->mu);
	kvs_record_hasher_free(xs);
	kvs__l2_thread_end(alt);
	return NULL;
}

/* ---- open and close ------------------------------------------------------------- */

int kvs_l2_open(const kvs_l2_config *cfg, kvs_l2 **ret)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	pthread_once(&once, kvs__l2_install_fatal);
	int rc;
	kvs_l2 *l2 = calloc(1, sizeof(*l2));
	if (!l2)
		return -ENOMEM;
	l2->cfg = *cfg;
	l2->ready.done = l2_ready;
	l2->state_fd = -1;
	l2->dir_lock = -1;
	l2->fd = -1;
	if (!l2->cfg.batch_max)
		l2->cfg.batch_max = 256;
	if (!l2->cfg.queue_max)
		l2->cfg.queue_max = 4096;
	if (!l2->cfg.readers)
		l2->cfg.readers = 1;
	if (l2->cfg.readers > KVS_L2_MAX_READERS)
		l2->cfg.readers = KVS_L2_MAX_READERS;
	snprintf(l2->path, sizeof(l2->path), "%s", cfg->path);
	pthread_mutex_init(&l2->mu, NULL);
	pthread_mutex_init(&l2->state_mu, NULL);
	pthread_cond_init(&l2->wcv, NULL);
	pthread_cond_init(&l2->rcv, NULL);
	pthread_rwlockattr_t ra;
	pthread_rwlockattr_init(&ra);
	/* a resize must not wait behind a stream of reads */
	pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
	pthread_rwlock_init(&l2->maplock, &ra);
	pthread_rwlockattr_destroy(&ra);
	l2->rl_commit.interval_ms = l2->rl_disk.interval_ms = KVS_RATELIMIT_MS;
	l2->rl_bad.interval_ms = l2->rl_corrupt.interval_ms = KVS_RATELIMIT_MS;
	l2->map_full = cfg->size + cfg->size / 100 * RESERVE_PCT;
	l2->touches = calloc(MAX_TOUCHES, sizeof(*l2->touches));
	l2->drops = calloc(MAX_TOUCHES, sizeof(*l2->drops));
	if (!l2->touches || !l2->drops) {
		rc = -ENOMEM;
		goto err_free;
	}
	struct stat sb;
	if (mkdir(cfg->path, 0700) < 0 && errno != EEXIST) {
		rc = -errno;
		kvs_err("cannot create %s: %s", cfg->path, strerror(errno));
		goto err_free;
	}
	rc = stat(cfg->path, &sb) < 0 ? -errno : !S_ISDIR(sb.st_mode) ? -ENOTDIR : 0;
	if (rc) {
		kvs_err("cannot open L2 at %s: %s", cfg->path, strerror(-rc));
		goto err_free;
	}
	/* two servers on one environment would each take the other for a
	 * crashed run and keep their own LRU and byte accounts */
	char lockwhy[600];
	if ((rc = kvs_dirlock_take(cfg->path, "l2.lock", "L2 directory", lockwhy, sizeof(lockwhy))) < 0) {
		kvs_err("%s", lockwhy);
		goto err_free;
	}
	l2->dir_lock = rc;
	/* a corrupt environment never crash-loops: set it aside when the last
	 * run(s) died in L2 work, or when it fails to open as damaged */
	const char *why = NULL;
	char whybuf[300];
	kvs__l2_state_open(l2, &why, whybuf, sizeof(whybuf));
	if (why && (rc = kvs__l2_set_aside(l2, why)) != 0)
		goto err_free;
	rc = kvs__l2_env_open(l2);
	if (rc && kvs__l2_corrupt_err(rc) && !l2->st.corrupt_recoveries) {
		if (l2->damage[0])
			snprintf(whybuf, sizeof(whybuf), "its structure is damaged: %s", l2->damage);
		else
			snprintf(whybuf, sizeof(whybuf), "opening it failed: %s", mdb_strerror(rc));
		if ((rc = kvs__l2_set_aside(l2, whybuf)) != 0)
			goto err_free;
		rc = kvs__l2_env_open(l2);
	}
	if (rc)
		goto err_lmdb;
	MDB_envinfo info;
	mdb_env_info(l2->env, &info);
	/* an existing environment may be larger: its capacity is its map less
	 * the reserve */
	if (info.me_mapsize > l2->map_full + l2->psize) {
		l2->cfg.size = info.me_mapsize - info.me_mapsize * RESERVE_PCT / (100 + RESERVE_PCT);
		l2->map_full = info.me_mapsize;
		kvs_warn("L2 %s: l2-size is %llu MiB but the existing file already holds data up to %llu MiB: kept at "
			 "that size (LMDB does not move data down to shrink a file); to shrink it, stop the server and "
			 "remove %s/data.mdb (its objects are lost), then start with the smaller l2-size",
			 cfg->path, (unsigned long long)(cfg->size >> 20), (unsigned long long)(l2->cfg.size >> 20),
			 cfg->path);
	}
	l2->map_now = info.me_mapsize;
	kvs__l2_set_capacity(l2);
	/* blocks allocated ahead of LMDB's next page: a fraction of the size,
	 * more than the B-tree pages an evicting transaction touches */
	l2->slack = kvs__l2_round_pages(l2, l2->cfg.size / 64 < (1u << 20) ? (1u << 20)
				    : l2->cfg.size / 64 > (1ull << 30) ? (1ull << 30) : l2->cfg.size / 64);
	if (mdb_env_get_fd(l2->env, &l2->fd) == 0) {
		kvs__l2_find_map_base(l2, info.me_mapsize);
		kvs__l2_disk_open(l2);
	}
	/* A commit needs free pages for its batch beside those of the last
	 * snapshot and those the previous commit freed (LMDB reuses freed pages
	 * only two transactions later), so a batch must stay small against the
	 * map, or it fails with MDB_MAP_FULL however much is evicted. */
	if (l2->cfg.batch_bytes > l2->cfg.size / 32)
		l2->cfg.batch_bytes = l2->cfg.size / 32;
	if ((rc = pthread_create(&l2->writer, NULL, writer_main, l2)) != 0) {
		rc = -rc;
		goto err_env;
	}
	l2->writer_started = true;
	for (uint32_t i = 0; i < l2->cfg.readers; i++) {
		if ((rc = pthread_create(&l2->readers[i], NULL, reader_main, l2)) != 0) {
			rc = -rc;
			kvs_l2_close(l2);
			return rc;
		}
		l2->n_readers++;
	}
	kvs_info("L2 %s: %llu objects, %llu MiB of %llu MiB, sync %s", cfg->path,
		 (unsigned long long)l2->st.objects, (unsigned long long)(l2->st.bytes >> 20),
		 (unsigned long long)(l2->capacity >> 20),
		 cfg->sync == KVS_L2_SYNC_FULL ? "full" : cfg->sync == KVS_L2_SYNC_NOMETA ? "nometa" : "none");
	*ret = l2;
	return 0;

err_env:
	mdb_env_close(l2->env);
	goto err_state;
err_lmdb:
	kvs_err("cannot open L2 at %s: %s", cfg->path, mdb_strerror(rc));
	rc = lmdb_err(rc);
err_state:
	kvs__l2_state_close(l2);
err_free:
	if (l2->state_fd >= 0)
		close(l2->state_fd);
	kvs_dirlock_drop(l2->dir_lock);
	free(l2->touches);
	free(l2->drops);
	pthread_rwlock_destroy(&l2->maplock);
	pthread_cond_destroy(&l2->wcv);
	pthread_cond_destroy(&l2->rcv);
	pthread_mutex_destroy(&l2->state_mu);
	pthread_mutex_destroy(&l2->mu);
	free(l2);
	return rc;
}

void kvs_l2_close(kvs_l2 *l2)
{
	if (!l2)
		return;
	pthread_mutex_lock(&l2->mu);
	l2->stop = true;
	pthread_cond_broadcast(&l2->wcv);
	pthread_cond_broadcast(&l2->rcv);
	pthread_mutex_unlock(&l2->mu);
	if (l2->writer_started)
		pthread_join(l2->writer, NULL);
	for (uint32_t i = 0; i < l2->n_readers; i++)
		pthread_join(l2->readers[i], NULL);
	l2_item *it;
	while ((it = list_pop(&l2->done)) != NULL)
		free(it);
	mdb_env_close(l2->env);
	kvs__l2_state_close(l2);
	free(l2->touches);
	free(l2->evicted);
	free(l2->drops);
	pthread_rwlock_destroy(&l2->maplock);
	pthread_cond_destroy(&l2->wcv);
	pthread_cond_destroy(&l2->rcv);
	pthread_mutex_destroy(&l2->state_mu);
	pthread_mutex_destroy(&l2->mu);
	kvs_dirlock_drop(l2->dir_lock); /* last: the environment is closed */
	free(l2);
}

/* ---- owner API ----------------------------------------------------------------- */

int kvs_l2_contains(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, uint64_t *ret_len)
{
	MDB_txn *txn;
	if (rtxn_begin(l2, &txn) != 0)
		return KVS_E_MISS;
	MDB_val k = {sizeof(*key), (void *)key}, v;
	l2_hdr h;
	int r = KVS_E_MISS;
	int rc = mdb_get(txn, l2->obj, &k, &v);
	if (rc == 0) {
		int c = kvs__l2_check_hdr(&v, key, geom, &h);
		if (c == HDR_OK) {
			if (ret_len)
				*ret_len = h.len;
			r = 0;
		} else if (c == HDR_GEOM) {
			pthread_mutex_lock(&l2->mu);
			l2->st.header_mismatches++;
			pthread_mutex_unlock(&l2->mu);
			r = KVS_E_GEOMETRY;
		} else {
			kvs__l2_drop_found(l2, key, &v, c);
		}
	} else if (rc != MDB_NOTFOUND) {
		kvs__l2_note_error(l2, rc, "presence check");
	}
	rtxn_end(l2, txn);
	return r;
}

int kvs_l2_write(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		 void *cookie)
{
	return kvs_l2_write_in(l2, key, geom, data, len, cookie, 0, 0);
}

int kvs_l2_write_in(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, const void *data, uint64_t len,
		    void *cookie, uint64_t group, uint32_t idx)
{
	l2_item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (l2_item){.op = KVS_L2_WRITE, .key = *key, .geom = geom, .src = data, .len = len,
			.cookie = cookie, .group = group, .idx = idx};
	pthread_mutex_lock(&l2->mu);
	bool dropped = false;
	/* the disk cannot keep up: drop the oldest pending writes (their
	 * group's tail first), never block */
	l2_item *prev, *old;
	while ((l2->wq.n >= l2->cfg.queue_max || l2->wq.bytes + len > l2->cfg.queue_max_bytes) &&
	       (old = drop_victim(&l2->wq, &prev)) != NULL) {
		list_unlink(&l2->wq, prev, old);
		l2->st.write_drops++;
		complete(l2, old, KVS_E_NOSPACE);
		dropped = true;
	}
	list_push(&l2->wq, it);
	l2->st.queue_depth = l2->wq.n;
	l2->st.queue_bytes = l2->wq.bytes;
	pthread_cond_signal(&l2->wcv);
	if (dropped)
		signal_owner(l2);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

uint32_t kvs_l2_shed(kvs_l2 *l2, uint64_t bytes, void **cookies, uint32_t cap)
{
	uint32_t n = 0;
	uint64_t freed = 0;
	pthread_mutex_lock(&l2->mu);
	l2_item *prev, *old;
	while (freed < bytes && n < cap && (old = drop_victim(&l2->wq, &prev)) != NULL) {
		list_unlink(&l2->wq, prev, old);
		l2->st.write_drops++;
		freed += old->len;
		cookies[n++] = old->cookie;
		free(old);
	}
	l2->st.queue_depth = l2->wq.n;
	l2->st.queue_bytes = l2->wq.bytes;
	pthread_mutex_unlock(&l2->mu);
	return n;
}

int kvs_l2_read(kvs_l2 *l2, const kvs_objkey *key, uint64_t geom, void *dst, uint64_t len, void *cookie)
{
	l2_item *it = calloc(1, sizeof(*it));
	if (!it)
		return -ENOMEM;
	*it = (l2_item){.op = KVS_L2_READ, .key = *key, .geom = geom, .dst = dst, .len = len, .cookie = cookie};
	pthread_mutex_lock(&l2->mu);
	list_push(&l2->rq, it);
	pthread_cond_signal(&l2->rcv);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

int kvs_l2_put_meta(kvs_l2 *l2, const void *key, uint32_t klen, const void *val, uint32_t vlen)
{
	if (klen > 64 || vlen > 4096)
		return -EINVAL;
	l2_item *it = calloc(1, sizeof(*it));
	uint8_t *buf = malloc(klen + vlen + 1);
	if (!it || !buf) {
		free(it);
		free(buf);
		return -ENOMEM;
	}
	memcpy(buf, key, klen);
	memcpy(buf + klen, val, vlen);
	*it = (l2_item){.op = KVS_L2_META, .owned = buf, .mkey = klen, .len = vlen};
	pthread_mutex_lock(&l2->mu);
	list_push(&l2->wq, it);
	pthread_cond_signal(&l2->wcv);
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

int kvs_l2_get_meta(kvs_l2 *l2, const void *key, uint32_t klen, void *buf, uint32_t cap, uint32_t *ret_len)
{
	if (klen > 64)
		return -EINVAL;
	uint8_t mk[2 + 64] = {'m', ':'};
	memcpy(mk + 2, key, klen);
	MDB_txn *txn;
	if (rtxn_begin(l2, &txn) != 0)
		return KVS_E_MISS;
	MDB_val k = {2 + klen, mk}, v;
	int r = KVS_E_MISS;
	if (mdb_get(txn, l2->meta, &k, &v) == 0) {
		uint32_t n = v.mv_size < cap ? (uint32_t)v.mv_size : cap;
		memcpy(buf, v.mv_data, n);
		*ret_len = (uint32_t)v.mv_size;
		r = 0;
	}
	rtxn_end(l2, txn);
	return r;
}

void kvs_l2_touch(kvs_l2 *l2, const kvs_objkey *key)
{
	pthread_mutex_lock(&l2->mu);
	if (l2->n_touches < MAX_TOUCHES)
		l2->touches[l2->n_touches++] = *key; /* beyond that, stamps are lost: LRU is approximate */
	pthread_mutex_unlock(&l2->mu);
}

uint32_t kvs_l2_reap(kvs_l2 *l2, kvs_l2_done *out, uint32_t cap)
{
	uint32_t n = 0;
	pthread_mutex_lock(&l2->mu);
	while (n < cap && l2->done.head) {
		l2_item *it = list_pop(&l2->done);
		out[n++] = (kvs_l2_done){.op = it->op, .key = it->key, .result = it->result, .cookie = it->cookie};
		free(it);
	}
	pthread_mutex_unlock(&l2->mu);
	return n;
}

int kvs_l2_clear(kvs_l2 *l2)
{
	MDB_txn *txn;
	/* a write transaction off the writer thread: it holds the map lock
	 * like a read, so that no resize happens under it */
	pthread_rwlock_rdlock(&l2->maplock);
	int rc = l2->broken ? MDB_PANIC : mdb_txn_begin(l2->env, NULL, 0, &txn);
	if (rc) {
		pthread_rwlock_unlock(&l2->maplock);
		return lmdb_err(rc);
	}
	kvs__l2_work_enter(l2, true);
	if ((rc = mdb_drop(txn, l2->obj, 0)) || (rc = mdb_drop(txn, l2->lru, 0)) ||
	    (rc = mdb_drop(txn, l2->atime, 0)) || (rc = kvs__l2_meta_put(txn, l2->meta, "bytes", 0)) ||
	    (rc = kvs__l2_meta_put(txn, l2->meta, "objects", 0)))
		mdb_txn_abort(txn);
	else
		rc = mdb_txn_commit(txn);
	kvs__l2_work_leave(l2, true, rc == 0);
	pthread_rwlock_unlock(&l2->maplock);
	if (rc) {
		kvs__l2_note_error(l2, rc, "clear");
		return lmdb_err(rc);
	}
	pthread_mutex_lock(&l2->mu);
	l2->st.bytes = l2->st.objects = 0;
	pthread_mutex_unlock(&l2->mu);
	return 0;
}

void kvs_l2_get_stats(kvs_l2 *l2, kvs_l2_stats *st)
{
	pthread_mutex_lock(&l2->mu);
	*st = l2->st;
	st->queue_depth = l2->wq.n;
	st->queue_bytes = l2->wq.bytes;
	pthread_mutex_unlock(&l2->mu);
}

const char *kvs_l2_path(const kvs_l2 *l2) { return l2->path; }

void kvs__l2_inject(kvs_l2 *l2, int what) { atomic_store(&l2->inject, what); }
