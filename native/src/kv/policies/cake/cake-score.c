// cake-score.c - CAKE layer preference and eviction indicator (docs/policies.md#cake).
//
//   H_l = - sum_{hq, window row i, candidate j} A log(A + 1e-10)     (rows not renormalized)
//   V_l =   sum_{hq, candidate j} var_i(A)                           (unbiased, as torch.var)
//   I[hq, j] = mean_i A + gamma var_i A  ->  pool (max 7) per query head  ->  GQA mean
// The entropy needs every probability, not only the column moments, so it takes its own
// pass over the window rows with the softmax arithmetic of window-scores.c (fp32 scores,
// max subtracted, double sum). Query heads are split across threads; each head's sum runs
// in a fixed order and the heads are added in head order: thread-count independent.
#include "kv/policies/cake/cake-score.h"
#include "core/error.h"
#include "model/model.h"
#include "cpu/quant.h"
#include "core/threadpool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct ent_job {
    const struct policy_event *ev;
    struct ws_window           w;
    const int32_t             *n_cand;   // per KV head
    int32_t                    n_max;    // longest list
    float                     *z;        // (nth, n_max)
    double                    *ent;      // (n_head) sum of A log(A + 1e-10)
};

static double entropy_head(const struct ent_job *job, int hq, float *z) {
    const struct policy_event *ev = job->ev;
    const struct hparams *hp = ev->hp;
    const int group = hp->n_head / hp->n_head_kv, g = hq / group, T = ev->T;
    const int32_t nc = job->n_cand[g];
    if (nc <= 0) return 0.0;
    const struct kv_list *l = &ev->cache->lists[(size_t)ev->layer * ev->cache->n_head_kv + g];
    double acc = 0.0;
    for (int r = 0; r < job->w.rows; r++) {
        ws_softmax_row(ev, l, hq, T - job->w.rows + r, z);
        for (int32_t j = 0; j < nc; j++) {
            const double p = (double)z[j];
            acc += p * log(p + 1e-10);
        }
    }
    return acc;
}

static void entropy_task(void *arg, int ith, int nth) {
    struct ent_job *job = arg;
    long h0, h1;
    split_range(job->ev->hp->n_head, ith, nth, &h0, &h1);
    float *z = job->z + (size_t)ith * job->n_max;
    for (long hq = h0; hq < h1; hq++) job->ent[hq] = entropy_head(job, (int)hq, z);
}

static pykv_status layer_entropy(const struct policy_event *ev, struct ws_window w, const int32_t *n_cand, double *H) {
    const struct hparams *hp = ev->hp;
    if (ev->q_device) return ws_window_entropy_device(ev, w, n_cand, H);
    struct ent_job job = { .ev = ev, .w = w, .n_cand = n_cand };
    for (int g = 0; g < hp->n_head_kv; g++) {
        const struct kv_list *l = &ev->cache->lists[(size_t)ev->layer * ev->cache->n_head_kv + g];
        if (l->n > job.n_max) job.n_max = l->n;
    }
    const int nth = threadpool_size(ev->pool);
    job.z = malloc((size_t)nth * (job.n_max ? job.n_max : 1) * sizeof(float));
    job.ent = calloc((size_t)hp->n_head, sizeof(double));
    if (!job.z || !job.ent) {
        free(job.z); free(job.ent);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory computing the attention entropy of layer %d", ev->layer);
    }
    threadpool_run(ev->pool, entropy_task, &job);
    double s = 0.0;
    for (int hq = 0; hq < hp->n_head; hq++) s += job.ent[hq];
    *H = -s;
    free(job.z);
    free(job.ent);
    return PYKV_OK;
}

void cake_layer_free(struct cake_layer *cl, int32_t n_head_kv) {
    for (int g = 0; cl->heads && g < n_head_kv; g++) ws_cascade_free(&cl->heads[g]);
    free(cl->heads);
    memset(cl, 0, sizeof(*cl));
}

// I for KV head g: pool(mean + gamma var) for each of its query heads, then GQA reduce.
static void head_indicator(const struct ws_stats *st, int g, const struct ws_opts *o, double gamma,
                           float *row, float *block, float *out) {
    const int32_t nc = st->n_cand[g];
    for (int r = 0; r < st->group; r++) {
        const float *mu = st->mean + st->offset[g] + (int64_t)r * nc;
        const float *var = st->var + st->offset[g] + (int64_t)r * nc;
        for (int32_t j = 0; j < nc; j++) row[j] = (float)((double)mu[j] + gamma * (double)var[j]);
        ws_pool1d(row, nc, o->kernel, o->pool, block + (size_t)r * nc);
    }
    ws_gqa_reduce(block, nc, st->group, nc, o->gqa, out);
}

pykv_status cake_score_layer(const struct policy_event *ev, struct ws_window w, const struct ws_opts *o,
                             double gamma, double tau1, double tau2, struct cake_layer *out) {
    const int hkv = ev->hp->n_head_kv;
    memset(out, 0, sizeof(*out));
    struct ws_stats st;
    PYKV_TRY(ws_stats_compute(ev, w, 1, &st));
    pykv_status rc = PYKV_OK;
    float *row = NULL, *block = NULL;
    int32_t nc_max = 0;
    for (int g = 0; g < hkv; g++) if (st.n_cand[g] > nc_max) nc_max = st.n_cand[g];
    out->heads = calloc((size_t)hkv, sizeof(*out->heads));
    row = malloc((size_t)(nc_max ? nc_max : 1) * sizeof(float));
    block = malloc((size_t)(nc_max ? nc_max : 1) * st.group * sizeof(float));
    if (!out->heads || !row || !block) goto nomem;
    double V = 0.0;
    for (int g = 0; g < hkv; g++) {
        const int32_t nc = st.n_cand[g];
        if (ws_cascade_init(&out->heads[g], nc) != PYKV_OK) goto nomem;
        const float *var = st.var + st.offset[g];
        for (int64_t i = 0; i < (int64_t)nc * st.group; i++) V += var[i];
        if (nc > 0) head_indicator(&st, g, o, gamma, row, block, out->heads[g].s);
    }
    rc = layer_entropy(ev, w, st.n_cand, &out->H);
    if (rc != PYKV_OK) goto fail;
    out->V = V;
    out->log_pref = (out->H > 0.0 && V > 0.0) ? log(out->H) / tau1 + log(V) / tau2 : -INFINITY;
    free(row); free(block);
    ws_stats_free(&st);
    return PYKV_OK;
nomem:
    rc = pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d for CAKE", ev->layer);
fail:
    free(row); free(block);
    ws_stats_free(&st);
    cake_layer_free(out, hkv);
    return rc;
}
