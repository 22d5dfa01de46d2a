// threadpool.c - persistent workers woken by a generation counter: spin first, then sleep.
#include "threadpool.h"
#include "error.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#define SPIN_ROUNDS 100000   // about a millisecond of polling before sleeping

struct threadpool {
    int              n_threads;
    pthread_t       *threads;
    pthread_mutex_t  mutex;
    pthread_cond_t   wake;
    atomic_int       generation;   // bumped for each task
    atomic_int       pending;      // workers still running the current task
    atomic_int       stop;
    threadpool_task  task;
    void            *arg;
};

struct worker_start {
    struct threadpool *pool;
    int                ith;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// Poll politely: mostly pause, but yield the core now and then so that a thread we wait
// for can run when the machine is busier than the pool assumes.
static inline void spin_pause(int spins) {
    if (spins % 64 == 0) sched_yield();
    else cpu_relax();
}

static void *worker_main(void *p) {
    struct worker_start start = *(struct worker_start *)p;
    free(p);
    struct threadpool *pool = start.pool;
    int seen = 0;
    for (;;) {
        int gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < SPIN_ROUNDS) { spin_pause(spins); continue; }
            pthread_mutex_lock(&pool->mutex);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        pool->task(pool->arg, start.ith, pool->n_threads);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel);
    }
}

struct threadpool *threadpool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    struct threadpool *pool = calloc(1, sizeof(*pool));
    if (!pool) { pykv_error(PYKV_ERR_NOMEM, "out of memory creating the thread pool"); return NULL; }
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) { threadpool_free(pool); pykv_error(PYKV_ERR_NOMEM, "out of memory"); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        struct worker_start *s = malloc(sizeof(*s));
        if (!s) { pool->n_threads = i; threadpool_free(pool); pykv_error(PYKV_ERR_NOMEM, "out of memory"); return NULL; }
        s->pool = pool;
        s->ith = i;
        if (pthread_create(&pool->threads[i], NULL, worker_main, s) != 0) {
            free(s);
            pool->n_threads = i;
            threadpool_free(pool);
            pykv_error(PYKV_ERR_INTERNAL, "could not start worker thread %d", i);
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
    free(pool->threads);
    free(pool);
}

int threadpool_size(const struct threadpool *pool) { return pool->n_threads; }

void threadpool_run(struct threadpool *pool, threadpool_task task, void *arg) {
    if (pool->n_threads == 1) {
        task(arg, 0, 1);
        return;
    }
    pool->task = task;
    pool->arg = arg;
    atomic_store_explicit(&pool->pending, pool->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    task(arg, 0, pool->n_threads);
    for (int spins = 1; atomic_load_explicit(&pool->pending, memory_order_acquire) != 0; spins++) spin_pause(spins);
}
