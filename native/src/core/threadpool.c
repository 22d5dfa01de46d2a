// threadpool.c - persistent workers that claim the slices of each task dynamically.
//
// A task has nth slices (ith = 0..nth-1, nth = pool size). The caller and the workers claim
// slices from one atomic word that holds (job generation, next slice), so a worker that the
// OS has not scheduled yet never holds up the caller: the caller simply runs the unclaimed
// slices itself and only waits for slices already being run. On a busy machine this keeps a
// many-op-per-token forward pass from paying a scheduler time slice per op.
#include "core/threadpool.h"
#include "core/error.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Polling budgets before sleeping (a pause is some tens of cycles).
#define WORKER_SPIN_ROUNDS 20000
#define CALLER_SPIN_ROUNDS 4000

struct threadpool {
    int              n_threads;
    pthread_t       *threads;
    pthread_mutex_t  mutex;
    pthread_cond_t   wake;              // workers sleep here between jobs
    pthread_cond_t   done;              // the caller sleeps here for running slices
    _Atomic uint64_t claim;             // generation << 32 | next slice to claim
    atomic_int       completed;         // slices finished in the current job
    atomic_int       caller_sleeping;
    atomic_int       stop;
    threadpool_task  task;
    void            *arg;
};

struct worker_start {
    struct threadpool *pool;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline void spin_pause(int spins) {
    if (spins % 64 == 0) sched_yield();
    else cpu_relax();
}

static inline uint32_t generation_of(uint64_t claim) { return (uint32_t)(claim >> 32); }

// Claim and run slices of job `gen` until none is left or a newer job has started.
static void run_slices(struct threadpool *pool, uint32_t gen) {
    const int nth = pool->n_threads;
    uint64_t cur = atomic_load(&pool->claim);
    for (;;) {
        if (generation_of(cur) != gen || (int)(uint32_t)cur >= nth) return;
        if (!atomic_compare_exchange_weak(&pool->claim, &cur, cur + 1)) continue;
        // The job cannot finish before this slice does, so task/arg are still this job's.
        pool->task(pool->arg, (int)(uint32_t)cur, nth);
        if (atomic_fetch_add(&pool->completed, 1) + 1 == nth && atomic_load(&pool->caller_sleeping)) {
            pthread_mutex_lock(&pool->mutex);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mutex);
        }
        cur = atomic_load(&pool->claim);
    }
}

static void *worker_main(void *p) {
    struct threadpool *pool = ((struct worker_start *)p)->pool;
    free(p);
    uint32_t seen = generation_of(atomic_load(&pool->claim));
    for (;;) {
        uint32_t gen;
        int spins = 0;
        while ((gen = generation_of(atomic_load(&pool->claim))) == seen && !atomic_load(&pool->stop)) {
            if (++spins < WORKER_SPIN_ROUNDS) { spin_pause(spins); continue; }
            pthread_mutex_lock(&pool->mutex);
            while (generation_of(atomic_load(&pool->claim)) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        run_slices(pool, gen);
    }
}

struct threadpool *threadpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    struct threadpool *pool = calloc(1, sizeof(*pool));
    if (!pool) { pykv_error(PYKV_ERR_NOMEM, "out of memory creating the thread pool"); return NULL; }
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) { threadpool_free(pool); pykv_error(PYKV_ERR_NOMEM, "out of memory creating the thread pool"); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        struct worker_start *s = malloc(sizeof(*s));
        if (s) s->pool = pool;
        int rc = s ? pthread_create(&pool->threads[i], NULL, worker_main, s) : ENOMEM;
        if (rc != 0) {
            free(s);
            pool->n_threads = i;
            threadpool_free(pool);
            // the system's limits (threads, memory for their stacks): the caller reports NOMEM
            pykv_error(PYKV_ERR_NOMEM, "could not start worker thread %d of %d (%s); try fewer threads",
                       i, n_threads, strerror(rc));
            return NULL;
        }
    }
    return pool;
}

void threadpool_free(struct threadpool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 1; i < pool->n_threads; i++)
        if (pool->threads && pool->threads[i]) pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool);
}

int threadpool_size(const struct threadpool *pool) { return pool->n_threads; }

void threadpool_run(struct threadpool *pool, threadpool_task task, void *arg) {
    const int nth = pool->n_threads;
    if (nth == 1) {
        task(arg, 0, 1);
        return;
    }
    pool->task = task;
    pool->arg = arg;
    atomic_store(&pool->completed, 0);
    uint32_t gen = generation_of(atomic_load(&pool->claim)) + 1;
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->claim, (uint64_t)gen << 32);   // publishes task and arg
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);

    run_slices(pool, gen);

    // Every slice is claimed; wait for those still running on workers.
    for (int spins = 1; spins < CALLER_SPIN_ROUNDS; spins++) {
        if (atomic_load(&pool->completed) == nth) return;
        spin_pause(spins);
    }
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->caller_sleeping, 1);
    while (atomic_load(&pool->completed) != nth) pthread_cond_wait(&pool->done, &pool->mutex);
    atomic_store(&pool->caller_sleeping, 0);
    pthread_mutex_unlock(&pool->mutex);
}
