// window-scores.c - observation-window attention statistics (docs/policies.md#the-observation-window).
//
// For every query head, the last `rows` queries of the chunk attend over their KV head's
// whole list (causal: a query sees the entries up to its own position), softmax in fp32
// with the max subtracted, and each candidate column's mean (and unbiased variance) over
// the rows is accumulated on the fly (Welford, in double): one score row per thread is
// alive at a time, so the memory is O(n_head * n) for the output only. Query heads are
// split across threads; each head's reduction runs in a fixed order, so the result does
// not depend on the thread count.
#include "kv/policies/common/window-scores.h"
#include "cpu/attention.h"
#include "core/error.h"
#include "model/model.h"
#include "cpu/quant.h"
#include "core/threadpool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int ws_is_prefill_end(const struct policy_event *ev) {
    return ev->layer >= 0 && ev->n_prompt > 1 && ev->is_last_chunk;
}

struct ws_window ws_window_of(const struct policy_event *ev, int32_t W) {
    struct ws_window w;
    w.protect = W < ev->n_prompt ? W : ev->n_prompt;
    w.rows = w.protect < ev->T ? w.protect : ev->T;
    return w;
}

struct stats_job {
    const struct policy_event *ev;
    struct ws_window           w;
    struct ws_stats           *st;
    int                        want_var;
    int32_t                    n_max;    // longest list
    int32_t                    nc_max;   // most candidates
    float                     *z;        // (nth, n_max)
    double                    *acc;      // (nth, 2 * nc_max)
};

void ws_softmax_row(const struct policy_event *ev, const struct kv_list *l, int hq, int t, float *p) {
    const struct hparams *hp = ev->hp;
    const float *q = ev->q + ((size_t)t * hp->n_head + hq) * hp->head_dim;
    const int32_t n = l->n - (ev->T - 1 - t);   // entries up to this query's position
    attention_weights(q, 1, l, n, hp->head_dim, p);
}

static void stats_head(const struct stats_job *job, int hq, float *z, double *mean, double *m2) {
    const struct policy_event *ev = job->ev;
    struct ws_stats *st = job->st;
    const int g = hq / st->group, T = ev->T;
    const int32_t nc = st->n_cand[g];
    if (nc <= 0) return;
    const struct kv_list *l = &ev->cache->lists[(size_t)ev->layer * ev->cache->n_head_kv + g];
    memset(mean, 0, (size_t)nc * sizeof(double));
    memset(m2, 0, (size_t)nc * sizeof(double));
    for (int r = 0; r < job->w.rows; r++) {
        ws_softmax_row(ev, l, hq, T - job->w.rows + r, z);
        const double k = r + 1;
        for (int32_t j = 0; j < nc; j++) {                  // candidates: every row sees them
            const double p = (double)z[j];
            const double d = p - mean[j];
            mean[j] += d / k;
            m2[j] += d * (p - mean[j]);
        }
    }
    const int64_t row = st->offset[g] + (int64_t)(hq - g * st->group) * nc;
    for (int32_t j = 0; j < nc; j++) st->mean[row + j] = (float)mean[j];
    if (job->want_var)
        for (int32_t j = 0; j < nc; j++)
            st->var[row + j] = job->w.rows > 1 ? (float)(m2[j] / (job->w.rows - 1)) : 0.0f;
}

static void stats_task(void *arg, int ith, int nth) {
    const struct stats_job *job = arg;
    long h0, h1;
    split_range(job->ev->hp->n_head, ith, nth, &h0, &h1);
    float *z = job->z + (size_t)ith * job->n_max;
    double *acc = job->acc + (size_t)ith * 2 * job->nc_max;
    for (long hq = h0; hq < h1; hq++) stats_head(job, (int)hq, z, acc, acc + job->nc_max);
}

void ws_stats_free(struct ws_stats *s) {
    free(s->n_cand); free(s->offset); free(s->offset_kv); free(s->mean); free(s->var);
    memset(s, 0, sizeof(*s));
}

pykv_status ws_stats_compute(const struct policy_event *ev, struct ws_window w, int want_var, struct ws_stats *st) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv;
    memset(st, 0, sizeof(*st));
    if ((!ev->q && !ev->q_device) || w.rows < 1 || w.rows > ev->T)
        return pykv_error(PYKV_ERR_INTERNAL, "window scores need the window's queries (rows=%d, chunk=%d)", w.rows, ev->T);
    st->n_head_kv = hkv;
    st->group = hp->n_head / hkv;
    st->n_cand = calloc((size_t)hkv, sizeof(int32_t));
    st->offset = calloc((size_t)hkv, sizeof(int64_t));
    st->offset_kv = calloc((size_t)hkv, sizeof(int64_t));
    if (!st->n_cand || !st->offset || !st->offset_kv) goto nomem;
    struct stats_job job = { .ev = ev, .w = w, .st = st, .want_var = want_var };
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = &ev->cache->lists[(size_t)ev->layer * ev->cache->n_head_kv + g];
        st->n_cand[g] = l->n > w.protect ? l->n - w.protect : 0;
        st->offset_kv[g] = st->total;
        st->offset[g] = st->total * st->group;
        st->total += st->n_cand[g];
        if (l->n > job.n_max) job.n_max = l->n;
        if (st->n_cand[g] > job.nc_max) job.nc_max = st->n_cand[g];
    }
    size_t n_out = (size_t)st->total * st->group;
    st->mean = malloc((n_out ? n_out : 1) * sizeof(float));
    if (want_var) st->var = malloc((n_out ? n_out : 1) * sizeof(float));
    if (ev->q_device) {
        if (!st->mean || (want_var && !st->var)) goto nomem;
        const pykv_status err = ws_stats_device(ev, w, st);
        if (err != PYKV_OK) ws_stats_free(st);
        return err;
    }
    int nth = threadpool_size(ev->pool);
    job.z = malloc((size_t)nth * (job.n_max ? job.n_max : 1) * sizeof(float));
    job.acc = malloc((size_t)nth * 2 * (job.nc_max ? job.nc_max : 1) * sizeof(double));
    if (!st->mean || (want_var && !st->var) || !job.z || !job.acc) {
        free(job.z); free(job.acc);
        goto nomem;
    }
    if (st->total > 0) threadpool_run(ev->pool, stats_task, &job);
    free(job.z);
    free(job.acc);
    return PYKV_OK;
nomem:
    ws_stats_free(st);
    return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the observation window of layer %d", ev->layer);
}

pykv_status ws_query_rows(const struct policy_event *ev, int32_t t0, int32_t rows, float *out) {
    if (ev->q_device) return ws_query_rows_device(ev, t0, rows, out);
    const size_t width = (size_t)ev->hp->n_head * ev->hp->head_dim;
    if (!ev->q) return pykv_error(PYKV_ERR_INTERNAL, "layer %d's event has no queries", ev->layer);
    memcpy(out, ev->q + (size_t)t0 * width, (size_t)rows * width * sizeof(float));
    return PYKV_OK;
}

pykv_status ws_host_event(const struct policy_event *ev, struct policy_event *host, float **q_host) {
    *host = *ev;
    *q_host = NULL;
    if (!ev->q_device) return PYKV_OK;
    const size_t width = (size_t)ev->hp->n_head * ev->hp->head_dim;
    float *q = malloc((size_t)ev->T * width * sizeof(float) + 1);
    if (!q) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the queries of layer %d", ev->layer);
    const pykv_status rc = ws_query_rows(ev, 0, ev->T, q);
    if (rc != PYKV_OK) {
        free(q);
        return rc;
    }
    host->q = q;
    host->q_device = NULL;
    host->probe.q = ev->probe.n ? q + (size_t)(ev->T - ev->probe.n) * width : NULL;
    *q_host = q;
    return PYKV_OK;
}

pykv_status ws_value_l1_max(const struct policy_event *ev, const int32_t *n_cand, float *vbar) {
    const int hkv = ev->hp->n_head_kv, hd = ev->hp->head_dim;
    if (kv_cache_list(ev->cache, ev->layer, 0)->on_device) return ws_value_l1_max_device(ev, n_cand, vbar);
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        vbar[g] = 0.0f;
        for (int32_t j = 0; j < n_cand[g]; j++) {
            float n1 = 0.0f, tmp[PYKV_MAX_HEAD_DIM];
            const float *v = kv_value_f32(l, j, hd, tmp);
            for (int d = 0; d < hd; d++) n1 += fabsf(v[d]);
            if (n1 > vbar[g]) vbar[g] = n1;
        }
    }
    return PYKV_OK;
}

pykv_status ws_layer_scores(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                            struct ws_stats *st, float **scores) {
    *scores = NULL;
    PYKV_TRY(ws_stats_compute(ev, w, 0, st));
    int32_t nc_max = 0;
    for (int g = 0; g < st->n_head_kv; g++) if (st->n_cand[g] > nc_max) nc_max = st->n_cand[g];
    float *s = malloc((size_t)(st->total ? st->total : 1) * sizeof(float));
    float *tmp = malloc((size_t)(nc_max ? nc_max : 1) * sizeof(float));
    if (!s || !tmp) {
        free(s); free(tmp);
        ws_stats_free(st);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d", ev->layer);
    }
    for (int g = 0; g < st->n_head_kv; g++) {
        int32_t nc = st->n_cand[g];
        if (nc == 0) continue;
        ws_gqa_reduce(st->mean + st->offset[g], nc, st->group, nc, o->gqa, tmp);
        ws_pool1d(tmp, nc, o->kernel, o->pool, s + st->offset_kv[g]);
    }
    free(tmp);
    *scores = s;
    return PYKV_OK;
}
