// threadpool.h - a persistent pool of worker threads for data-parallel kernels.
//
// threadpool_run() hands the same task to every thread (the caller is thread 0) and returns
// when all have finished. Idle workers spin for a short while before sleeping, because the
// forward pass of a small model issues hundreds of short parallel ops per token.
#pragma once

struct threadpool;

// ith in [0, nth): which slice of the work this thread takes.
typedef void (*threadpool_task)(void *arg, int ith, int nth);

// NULL on failure, with the message set; every failure is a lack of resources (memory, or
// the system's limit on threads), so callers return PYKV_ERR_NOMEM.
struct threadpool *threadpool_create(int n_threads);
void               threadpool_free(struct threadpool *pool);
int                threadpool_size(const struct threadpool *pool);
void               threadpool_run(struct threadpool *pool, threadpool_task task, void *arg);

// Split n items into nth near-equal ranges; thread ith gets [*begin, *end).
static inline void split_range(long n, int ith, int nth, long *begin, long *end) {
    long per = n / nth, extra = n % nth;
    *begin = ith * per + (ith < extra ? ith : extra);
    *end = *begin + per + (ith < extra ? 1 : 0);
}
