// critical.c - CriticalKV's value weights and two-stage selection (critical.h).
//
// The weights: the layer's output projection is dequantized to floats once (rows split
// across the pool), then each query head's columns are copied out and multiplied with its
// KV head's candidate values in blocks of rows (gemm_rows_f32), summing absolute values;
// query heads are split across threads. The cost is one output projection of the prompt
// per query head's share, as kvpress's. A layer on the GPU weighs its values there, with the
// projection it holds (critical-gpu.c).
#include "kv/policies/criticalkv/critical.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "cpu/gemm.h"
#include "cpu/ops.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CRITICAL_ROW_BLOCK 64   // output rows per product block

struct weights_job {
    const struct policy_event *ev;
    const struct ws_stats     *st;
    float                     *wo;       // (n_embd, n_head * d) floats
    float                    **values;   // per KV head: its candidates' values, (n_cand, d)
    float                     *per_head; // (n_head, nc_max): each query head's L1 norms
    int32_t                    nc_max;
    float                     *scratch;  // per thread: n_embd * d + nc_max * CRITICAL_ROW_BLOCK
    int                       *failed;   // per thread: a row that did not dequantize
};

static void dequant_task(void *arg, int ith, int nth) {
    struct weights_job *job = arg;
    const struct tensor *t = job->ev->wo;
    long r0, r1;
    split_range((long)t->ne[1], ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++)
        if (tensor_get_row(t, r, job->wo + (size_t)r * t->ne[0]) != PYKV_OK) job->failed[ith] = 1;
}

// Query head hq: per candidate j of its KV head, sum_r |W_o[r, hq's columns] . v_j|.
static void head_weights(const struct weights_job *job, int hq, float *wh, float *out) {
    const struct hparams *hp = job->ev->hp;
    const int d = hp->head_dim, n_embd = hp->n_embd, g = hq / job->st->group;
    const int32_t nc = job->st->n_cand[g];
    float *acc = job->per_head + (size_t)hq * job->nc_max;
    memset(acc, 0, (size_t)nc * sizeof(float));
    if (nc == 0) return;
    const size_t row = (size_t)hp->n_head * d;
    for (int r = 0; r < n_embd; r++) memcpy(wh + (size_t)r * d, job->wo + r * row + (size_t)hq * d, (size_t)d * sizeof(float));
    for (int r0 = 0; r0 < n_embd; r0 += CRITICAL_ROW_BLOCK) {
        const int rows = n_embd - r0 < CRITICAL_ROW_BLOCK ? n_embd - r0 : CRITICAL_ROW_BLOCK;
        gemm_rows_f32(wh + (size_t)r0 * d, rows, job->values[g], nc, d, out, rows);   // out[j * rows + i]
        for (int32_t j = 0; j < nc; j++) {
            float s = 0.0f;
            for (int i = 0; i < rows; i++) s += fabsf(out[(size_t)j * rows + i]);
            acc[j] += s;
        }
    }
}

static void weights_task(void *arg, int ith, int nth) {
    struct weights_job *job = arg;
    const struct hparams *hp = job->ev->hp;
    float *wh = job->scratch + (size_t)ith * ((size_t)hp->n_embd * hp->head_dim + (size_t)job->nc_max * CRITICAL_ROW_BLOCK);
    float *out = wh + (size_t)hp->n_embd * hp->head_dim;
    long h0, h1;
    split_range(hp->n_head, ith, nth, &h0, &h1);
    for (long hq = h0; hq < h1; hq++) head_weights(job, (int)hq, wh, out);
}

// The candidates' values as floats (a layer on the GPU sends them down).
static pykv_status candidate_values(const struct policy_event *ev, const struct ws_stats *st, float **values) {
    const int d = ev->hp->head_dim;
    for (int g = 0; g < st->n_head_kv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        values[g] = malloc((size_t)(st->n_cand[g] ? st->n_cand[g] : 1) * d * sizeof(float));
        if (!values[g]) return pykv_error(PYKV_ERR_NOMEM, "out of memory weighing the values of layer %d", ev->layer);
        PYKV_TRY(kv_list_rows_f32(ev->cache, l, 1, st->n_cand[g], values[g]));
    }
    return PYKV_OK;
}

pykv_status critical_value_weights(const struct policy_event *ev, const struct ws_stats *st, float *w) {
    const struct hparams *hp = ev->hp;
    const struct tensor *t = ev->wo;
    if (!t || t->ne[0] != (int64_t)hp->n_head * hp->head_dim || t->ne[1] != hp->n_embd)
        return pykv_error(PYKV_ERR_INTERNAL, "layer %d: no output projection of the expected shape for the value "
                          "weights", ev->layer);
    if (ev->wo_device) {   // a layer on the GPU weighs its values there, with its own copy of W_o
        int on_gpu = 0;
        PYKV_TRY(critical_value_weights_device(ev, st, w, &on_gpu));
        if (on_gpu) return PYKV_OK;
    }
    const int nth = threadpool_size(ev->pool);
    struct weights_job job = { .ev = ev, .st = st };
    for (int g = 0; g < st->n_head_kv; g++) if (st->n_cand[g] > job.nc_max) job.nc_max = st->n_cand[g];
    job.wo = malloc((size_t)t->ne[0] * t->ne[1] * sizeof(float));
    job.failed = calloc((size_t)nth, sizeof(int));
    pykv_status rc = PYKV_OK;
    if (!job.wo || !job.failed) {
        rc = pykv_error(PYKV_ERR_NOMEM, "out of memory weighing the values of layer %d", ev->layer);
        goto done;
    }
    threadpool_run(ev->pool, dequant_task, &job);
    for (int i = 0; i < nth; i++)
        if (job.failed[i]) {
            rc = pykv_error(PYKV_ERR_UNSUPPORTED, "layer %d: the output projection's type %d does not dequantize",
                            ev->layer, (int)t->type);
            goto done;
        }
    job.values = calloc((size_t)(st->n_head_kv > 0 ? st->n_head_kv : 1), sizeof(float *));
    job.per_head = malloc((size_t)hp->n_head * (job.nc_max ? job.nc_max : 1) * sizeof(float));
    job.scratch = malloc((size_t)nth * ((size_t)hp->n_embd * hp->head_dim + (size_t)job.nc_max * CRITICAL_ROW_BLOCK)
                         * sizeof(float));
    if (!job.values || !job.per_head || !job.scratch) {
        rc = pykv_error(PYKV_ERR_NOMEM, "out of memory weighing the values of layer %d", ev->layer);
        goto done;
    }
    rc = candidate_values(ev, st, job.values);
    if (rc != PYKV_OK) goto done;
    threadpool_run(ev->pool, weights_task, &job);
    for (int g = 0; g < st->n_head_kv; g++)   // the mean over the KV head's query heads
        for (int32_t j = 0; j < st->n_cand[g]; j++) {
            float s = 0.0f;
            for (int r = 0; r < st->group; r++) s += job.per_head[(size_t)(g * st->group + r) * job.nc_max + j];
            w[st->offset_kv[g] + j] = s / (float)st->group;
        }
done:
    for (int g = 0; job.values && g < st->n_head_kv; g++) free(job.values[g]);
    free(job.values); free(job.wo); free(job.per_head); free(job.scratch); free(job.failed);
    return rc;
}

pykv_status critical_keep(const struct policy_event *ev, int32_t g, const float *s, const float *w, int32_t n_cand,
                          int64_t b, int32_t window, const struct critical_opts *o) {
    if (b >= n_cand) return PYKV_OK;
    int64_t b1 = (int64_t)floor((double)(b + window) * o->first_stage) - window;
    if (b1 < 0) b1 = 0;
    if (b1 > b) b1 = b;
    float *s2 = malloc((size_t)(n_cand ? n_cand : 1) * sizeof(float));
    int64_t *first = malloc((size_t)(b1 ? b1 : 1) * sizeof(int64_t));
    if (!s2 || !first) {
        free(s2); free(first);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory selecting KV entries");
    }
    for (int32_t j = 0; j < n_cand; j++) s2[j] = (float)(((double)s[j] + o->epsilon) * (double)w[j]);
    int64_t n1 = 0;
    pykv_status rc = ws_select_top(s, n_cand, b1, first, &n1);   // stage 1: the base score's own top
    for (int64_t i = 0; i < n1; i++) s2[first[i]] = INFINITY;
    if (rc == PYKV_OK) rc = ws_keep_top(ev, g, s2, n_cand, b);
    free(s2);
    free(first);
    return rc;
}
