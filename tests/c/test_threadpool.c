// test_threadpool.c - every thread runs each task once, over many short back-to-back runs.
#include "check.h"
#include "core/threadpool.h"

#include <stdatomic.h>

struct job {
    atomic_long sum;
    long        items[1000];
};

static void add_slice(void *arg, int ith, int nth) {
    struct job *j = arg;
    long b, e, s = 0;
    split_range(1000, ith, nth, &b, &e);
    for (long i = b; i < e; i++) s += j->items[i];
    atomic_fetch_add(&j->sum, s);
}

int main(void) {
    static struct job j;
    for (int i = 0; i < 1000; i++) j.items[i] = i;
    for (int n = 1; n <= 4; n++) {
        struct threadpool *pool = threadpool_create(n);
        CHECK(pool != NULL && threadpool_size(pool) == n);
        int all_ok = 1;
        for (int rep = 0; rep < 2000; rep++) {
            atomic_store(&j.sum, 0);
            threadpool_run(pool, add_slice, &j);
            if (atomic_load(&j.sum) != 499500) all_ok = 0;
        }
        CHECK(all_ok);
        threadpool_free(pool);
    }
    long b, e, covered = 0;
    for (int ith = 0; ith < 7; ith++) { split_range(10, ith, 7, &b, &e); covered += e - b; }
    CHECK(covered == 10);
    return check_report("test_threadpool");
}
