/* The completion queue; see kvs_cq.h. */
#include "kvs_cq.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct kvs_cq {
	pthread_mutex_t mu;
	kvs_cq_item *head; /* newest first; guarded by mu */
	int efd;
};

int kvs_cq_create(kvs_cq **ret)
{
	kvs_cq *q = calloc(1, sizeof(*q));
	if (!q)
		return -ENOMEM;
	q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (q->efd < 0) {
		int r = -errno;
		free(q);
		return r;
	}
	pthread_mutex_init(&q->mu, NULL);
	*ret = q;
	return 0;
}

void kvs_cq_destroy(kvs_cq *q)
{
	if (!q)
		return;
	close(q->efd);
	pthread_mutex_destroy(&q->mu);
	free(q);
}

int kvs_cq_fd(const kvs_cq *q) { return q->efd; }

void kvs_cq_post(kvs_cq *q, kvs_cq_item *it)
{
	pthread_mutex_lock(&q->mu);
	it->next = q->head;
	q->head = it;
	pthread_mutex_unlock(&q->mu);
	uint64_t one = 1;
	ssize_t w = write(q->efd, &one, sizeof(one)); /* only fails when the counter saturates */
	(void)w;
}

uint32_t kvs_cq_run(kvs_cq *q)
{
	uint64_t v;
	ssize_t rd = read(q->efd, &v, sizeof(v)); /* EAGAIN: nothing was signalled */
	(void)rd;
	pthread_mutex_lock(&q->mu);
	kvs_cq_item *it = q->head;
	q->head = NULL;
	pthread_mutex_unlock(&q->mu);
	kvs_cq_item *fifo = NULL; /* reverse: oldest first */
	while (it) {
		kvs_cq_item *next = it->next;
		it->next = fifo;
		fifo = it;
		it = next;
	}
	uint32_t n = 0;
	while (fifo) {
		kvs_cq_item *next = fifo->next;
		fifo->next = NULL;
		fifo->done(fifo);
		fifo = next;
		n++;
	}
	return n;
}
