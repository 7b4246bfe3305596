/* kvs_l1_check: every invariant of the L1 structures (kvs_l1_impl.h),
 * walked in full; the unit tests run it after every step. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "kvs_l1_impl.h"

/* ---- consistency check ------------------------------------------------ */

#define CHECK(cond)                                                                    \
	do {                                                                           \
		if (!(cond)) {                                                         \
			fprintf(stderr, "kvs_l1_check: %s:%d: %s\n", __FILE__, __LINE__, \
				#cond);                                                \
			return -EUCLEAN;                                               \
		}                                                                      \
	} while (0)

#define VALID(r) ((r) > 0 && (r) < l1->rec_hwm)

static int check_list(const kvs_l1 *l1, const struct list *L, bool busy, uint32_t *count,
		      uint64_t *pages)
{
	ref prev = 0;
	for (ref r = L->first; r; r = l1->recs[r].u.o.cnext) {
		CHECK(VALID(r));
		const kvs_l1_obj *h = &l1->recs[r];
		CHECK(h->state == KVS_L1_RESERVED || h->state == KVS_L1_COMMITTED);
		CHECK(h->head);
		CHECK(h->u.o.cprev == prev);
		CHECK(busy ? h->u.o.nbusy > 0 : h->u.o.nbusy == 0);
		CHECK(++*count <= l1->nchunks);
		*pages += h->u.o.cpages;
		prev = r;
	}
	CHECK(L->last == prev);
	return 0;
}

int kvs_l1_check(const kvs_l1 *l1)
{
	CHECK(l1->rec_hwm >= 2 && l1->rec_hwm <= l1->nrecs);

	/* extents in address order */
	uint64_t pages = 0, free_pages = 0, nfree = 0, nrec = 0;
	uint64_t used = 0, reserved = 0, nobj = 0, nres = 0, pused = 0, nheads = 0;
	ref prev = 0;
	for (ref r = l1->afirst; r; r = l1->recs[r].anext) {
		CHECK(VALID(r));
		CHECK(++nrec < l1->rec_hwm);
		const kvs_l1_obj *o = &l1->recs[r];
		CHECK(o->aprev == prev);
		CHECK(o->npages >= 1);
		CHECK(o->data == l1->arena + (pages << PAGE_SHIFT));
		pages += o->npages;
		CHECK(pages <= l1->npages);
		if (o->state == REC_WITHHELD) {
			CHECK(r == l1->wh && !o->anext && o->npages == l1->wh_pages);
			prev = r;
			continue;
		}
		if (o->state == KVS_L1_FREE) {
			CHECK(!prev || l1->recs[prev].state != KVS_L1_FREE);
			CHECK(!o->head);
			free_pages += o->npages;
			nfree++;
			prev = r;
			continue;
		}
		CHECK(o->state == KVS_L1_RESERVED || o->state == KVS_L1_COMMITTED);
		CHECK(o->slack < KVS_L1_PAGE);
		CHECK(obj_len(o) >= 1);
		CHECK(kvs_htab_get(l1->objs, &o->key) == o);
		used += obj_len(o);
		pused += o->npages;
		nobj++;
		if (o->state == KVS_L1_RESERVED) {
			CHECK(o->u.o.pins == 0);
			reserved += obj_len(o);
			nres++;
		}
		/* chunk membership */
		const kvs_l1_obj *h = kvs_htab_get(l1->chunks, &o->key);
		CHECK(h != NULL);
		CHECK(h->head);
		CHECK(o->head == (h == o));
		if (!o->head)
			CHECK(!o->u.o.cprev && !o->u.o.cnext && !o->u.o.nbusy && !o->u.o.cpages);
		bool found = false;
		uint64_t k = 0;
		ref m = ref_of(l1, h);
		do {
			CHECK(VALID(m));
			CHECK(++k <= l1->objects);
			found |= m == r;
			m = l1->recs[m].u.o.sib;
		} while (m != ref_of(l1, h));
		CHECK(found);
		if (o->head) {
			uint32_t busy = 0, cpages = 0;
			m = r;
			do {
				const kvs_l1_obj *x = &l1->recs[m];
				CHECK(x->state == KVS_L1_RESERVED || x->state == KVS_L1_COMMITTED);
				CHECK(memcmp(&x->key, &o->key, KVS_L1_CHUNK_KEY_BYTES) == 0);
				busy += x->state == KVS_L1_RESERVED || x->u.o.pins > 0;
				cpages += x->npages;
				m = x->u.o.sib;
			} while (m != r);
			CHECK(o->u.o.nbusy == busy);
			CHECK(o->u.o.cpages == cpages);
			nheads++;
		}
		prev = r;
	}
	CHECK(pages == l1->npages);
	CHECK(free_pages == l1->free_pages && nfree == l1->nfree);
	CHECK(used == l1->bytes_used && reserved == l1->bytes_reserved);
	CHECK(nobj == l1->objects && nres == l1->objects_reserved);
	CHECK(pused == l1->pages_used && pused + free_pages + l1->wh_pages == l1->npages);
	CHECK(!l1->wh == !l1->wh_pages && l1->ceiling <= l1->npages);
	CHECK(kvs_htab_count(l1->objs) == nobj);
	CHECK(nheads == l1->nchunks && kvs_htab_count(l1->chunks) == nheads);

	/* unused records */
	uint64_t nunused = 0;
	for (ref r = l1->rec_free; r; r = l1->recs[r].anext) {
		CHECK(VALID(r));
		CHECK(l1->recs[r].state == REC_UNUSED);
		CHECK(++nunused < l1->rec_hwm);
	}
	CHECK(nrec + nunused + 1 == l1->rec_hwm);

	/* size-class bins */
	uint64_t binned = 0, binned_pages = 0;
	for (unsigned fl = 0; fl < FL_N; fl++) {
		CHECK(!!(l1->fl_map & (1u << fl)) == !!l1->sl_map[fl]);
		for (unsigned sl = 0; sl < SL_N; sl++) {
			CHECK(!!(l1->sl_map[fl] & (1u << sl)) == !!l1->bins[fl][sl]);
			ref bprev = 0;
			for (ref r = l1->bins[fl][sl]; r; r = l1->recs[r].u.f.next) {
				CHECK(VALID(r));
				const kvs_l1_obj *f = &l1->recs[r];
				CHECK(f->state == KVS_L1_FREE);
				CHECK(f->u.f.prev == bprev);
				unsigned efl, esl;
				size_class(f->npages, &efl, &esl);
				CHECK(efl == fl && esl == sl);
				CHECK(++binned <= l1->nfree);
				binned_pages += f->npages;
				bprev = r;
			}
		}
	}
	CHECK(binned == l1->nfree && binned_pages == l1->free_pages);
	CHECK(l1->fl_map >> FL_N == 0);

	/* chunk lists */
	uint32_t nlisted = 0;
	uint64_t lru_pages = 0, busy_pages = 0;
	if (check_list(l1, &l1->lru, false, &nlisted, &lru_pages) < 0)
		return -EUCLEAN;
	if (check_list(l1, &l1->busy, true, &nlisted, &busy_pages) < 0)
		return -EUCLEAN;
	CHECK(nlisted == l1->nchunks);
	CHECK(lru_pages == l1->evictable_pages);
	CHECK(l1->nchunks <= l1->peak_chunks && l1->objects <= l1->peak_objects);
	return 0;
}
