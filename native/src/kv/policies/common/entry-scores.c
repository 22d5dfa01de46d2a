// entry-scores.c - score every entry of a layer's lists, keep each list's top B
// (entry-scores.h).
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "model/model.h"

#include <stdlib.h>

struct score_job {
    const struct kv_policy    *p;
    const struct policy_event *ev;
    es_score_fn                score;
    int32_t                    B;
    int64_t                   *offset;   // (n_head_kv) start of list g's scores in s; -1: not scored
    float                     *s;
    float                     *tmp;      // (nth, 2 * longest list)
    int32_t                    n_max;
    const struct kv_list      *views;    // (n_head_kv) host copies of lists in GPU memory, or NULL
};

static void score_task(void *arg, int ith, int nth) {
    const struct score_job *job = arg;
    const int32_t n_head_kv = job->ev->hp->n_head_kv;
    long g0, g1;
    split_range(n_head_kv, ith, nth, &g0, &g1);
    float *tmp = job->tmp + (size_t)ith * 2 * (size_t)job->n_max;
    for (long g = g0; g < g1; g++) {
        if (job->offset[g] < 0) continue;
        const struct kv_list *l = job->views ? &job->views[g] : kv_cache_list(job->ev->cache, job->ev->layer, (int)g);
        job->score(job->p, job->ev, (int32_t)g, l, job->s + job->offset[g], tmp);
    }
}

pykv_status es_layer_keep_top(const struct kv_policy *p, const struct policy_event *ev, int32_t B, es_score_fn score,
                              const struct es_device *dev) {
    const int32_t n_head_kv = ev->hp->n_head_kv;
    const int on_device = kv_cache_list(ev->cache, ev->layer, 0)->on_device;
    const enum es_device_rule rule = on_device && dev ? dev->rule : ES_ON_HOST;
    if (rule != ES_ON_HOST && rule != ES_POSITIONS) {
        int done = 0;
        PYKV_TRY(es_layer_keep_top_device(ev, B, dev, &done));
        if (done) return PYKV_OK;
    }
    const int nth = threadpool_size(ev->pool);
    int64_t total = 0;
    int32_t n_max = 0;
    int64_t *offset = malloc((size_t)n_head_kv * sizeof(int64_t));
    if (!offset) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring KV entries");
    for (int32_t g = 0; g < n_head_kv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        offset[g] = l->n > B ? total : -1;
        if (l->n > B) total += l->n;
        if (l->n > n_max) n_max = l->n;
    }
    if (total == 0) {
        free(offset);
        return PYKV_OK;
    }
    struct score_job job = { p, ev, score, B, offset, malloc((size_t)total * sizeof(float)),
                             malloc((size_t)nth * 2 * (size_t)n_max * sizeof(float)), n_max, NULL };
    struct kv_list *views = NULL;
    pykv_status st = job.s && job.tmp ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "out of memory scoring KV entries");
    if (st == PYKV_OK && on_device && rule != ES_POSITIONS) {
        // a layer on the GPU is scored from a copy in host memory (each entry is read once; the
        // eviction then moves the rows on the device)
        views = calloc((size_t)n_head_kv, sizeof(*views));
        st = views ? kv_layer_host_copy(ev->cache, ev->layer, 1, views)
                   : pykv_error(PYKV_ERR_NOMEM, "out of memory scoring KV entries");
        job.views = views;
    }
    if (st == PYKV_OK) threadpool_run(ev->pool, score_task, &job);
    kv_layer_host_copy_free(ev->cache, views);
    free(views);
    for (int32_t g = 0; g < n_head_kv && st == PYKV_OK; g++) {
        if (offset[g] < 0) continue;
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        st = ws_keep_top(ev, g, job.s + offset[g], n, B);   // no protected tail: every entry a candidate
    }
    free(job.s);
    free(job.tmp);
    free(offset);
    return st;
}
