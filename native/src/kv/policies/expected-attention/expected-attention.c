// expected-attention.c - Expected Attention (docs/policies.md#expected_attention): the
// attention that the queries still to come are expected to pay each entry, estimated from
// the statistics of the prompt's own queries. Question-agnostic: it needs no question at
// the end of the prompt. Paper: "Expected Attention: KV Cache Compression by Estimating
// Attention from Future Queries Distribution" (arXiv:2510.00636); kvpress's
// ExpectedAttentionPress.
//
// Per layer and query head, at the end of a prefill call:
//   mu, C  = mean and covariance (divided by n) of the call's queries before RoPE, the first
//            `sink` positions left out (outliers);
//   R      = the RoPE rotation averaged over the next n_future_positions positions (each pair
//            of dimensions: mean cos and mean sin of its angle at those positions), so
//            mu' = R mu and C' = R C R^T describe a future query in the keys' frame;
//   z_j    = mu' . k_j / sqrt(d) + k_j^T C' k_j / (2 d)   (log of E[exp(q . k_j / sqrt(d))] for
//            a Gaussian q);
//   a_j    = softmax over the list's entries past the sinks of z_j;
// then per KV head: s_j = the mean of a_j over its query heads, or with use_vnorm
// (s_j + epsilon) * ||v_j||_2. The `sink` first positions are always kept; every list keeps its
// B - sink best other entries.
//
// Options (defaults as kvpress): sink=4 (also the sink= constructor argument),
// n_future_positions=512, use_covariance=1, use_vnorm=1, epsilon=0. No window: the last
// tokens compete like the others.
//
// Choices:
//  * The statistics come from the chunk's post-RoPE queries (ev->q) with each row's rotation
//    undone, not from the hidden states: kvpress projects the hidden states with q_proj
//    (and q_norm where the model has one) to get exactly these queries, so it is the same
//    computation, whatever the projection (bias included).
//  * With chunked prefill the statistics are merged chunk by chunk over the whole call
//    (Chan's pairwise update, in double), so they equal those of the prompt read at once.
//    They take d * (d + 1) doubles per layer and query head while a prefill call runs.
//  * The sinks are the entries at positions below `sink`; the statistics leave out the
//    queries at those positions, and the future positions start at the end of the call
//    (n_past_end). For a first call that is kvpress's rule; on a later prefill call kvpress
//    leaves out the first `sink` tokens of its input and starts at the input's length.
//  * Runs in after_layer of the last chunk of a multi-token call (of every chunk with
//    evict_every_chunk, from the statistics of the call so far). Decode steps append
//    without eviction. No eviction while a list holds <= B entries; ties go to the lower
//    position.
#include "kv/policies/expected-attention/expected-attention.h"
#include "kv/policies/common/policy-make.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "cpu/gemm.h"
#include "cpu/ops.h"
#include "model/model.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

extern const struct policy_ops policy_expected_attention;

#define EA_KEYS "sink, n_future_positions, use_covariance (0|1), use_vnorm (0|1), epsilon"

static const struct policy_opt ea_opts[] = {
    { .key = "sink", .type = POLICY_OPT_INT, .offset = offsetof(struct expected_attention, sink), .lo = 0, .hi = 1 << 24 },
    { .key = "n_future_positions", .type = POLICY_OPT_INT, .offset = offsetof(struct expected_attention, n_future),
      .lo = 1, .hi = 1 << 24 },
    { .key = "use_covariance", .type = POLICY_OPT_INT, .offset = offsetof(struct expected_attention, use_cov), .lo = 0, .hi = 1 },
    { .key = "use_vnorm", .type = POLICY_OPT_INT, .offset = offsetof(struct expected_attention, use_vnorm), .lo = 0, .hi = 1 },
    { .key = "epsilon", .type = POLICY_OPT_DOUBLE, .offset = offsetof(struct expected_attention, epsilon), .lo = 0.0, .hi = 1e9 },
};

static void ea_defaults(struct kv_policy *base) {
    struct expected_attention *p = (struct expected_attention *)base;
    p->sink = -1;   // until finish: the constructor's sink=, else 4
    p->n_future = 512;
    p->use_cov = 1;
    p->use_vnorm = 1;
    p->epsilon = 0.0;
}

static pykv_status ea_finish(struct kv_policy *base, const struct policy_config *cfg) {
    struct expected_attention *p = (struct expected_attention *)base;
    if (cfg->sink >= 0) {
        if (p->sink >= 0 && p->sink != cfg->sink)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'expected_attention': sink=%d and the policy argument "
                              "sink=%d disagree", cfg->sink, p->sink);
        p->sink = cfg->sink;
    }
    if (p->sink < 0) p->sink = 4;
    if (cfg->window >= 0)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'expected_attention' has no window (window=%d): every entry "
                          "past the sinks is scored", cfg->window);
    if (cfg->budget > 0 && cfg->budget <= p->sink)
        return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'expected_attention': the budget (%d entries per layer and KV "
                          "head) must be larger than the %d sink tokens it includes", cfg->budget, p->sink);
    return PYKV_OK;
}

static const struct policy_maker ea_maker = {
    .ops = &policy_expected_attention,
    .size = sizeof(struct expected_attention),
    .accepted = EA_KEYS,
    .opts = ea_opts,
    .n_opts = (int)(sizeof(ea_opts) / sizeof(ea_opts[0])),
    .defaults = ea_defaults,
    .finish = ea_finish,
};

static pykv_status ea_init(const struct policy_config *cfg, struct kv_policy **out) {
    return policy_make(&ea_maker, cfg, out);
}

static void ea_free(struct kv_policy *base) {
    struct expected_attention *p = (struct expected_attention *)base;
    if (!p) return;
    for (int32_t l = 0; p->stats && l < p->n_layer; l++) {
        free(p->stats[l].mean);
        free(p->stats[l].m2);
        ea_stats_device_free(&p->stats[l]);
    }
    free(p->stats);
    free(p);
}

// The layer's statistics, emptied (allocated when absent).
static pykv_status ea_stats_begin(struct expected_attention *p, const struct hparams *hp, int layer) {
    if (!p->stats) {
        p->stats = calloc((size_t)hp->n_layer, sizeof(struct ea_stats));
        if (!p->stats) return pykv_error(PYKV_ERR_NOMEM, "out of memory for expected_attention's query statistics");
        p->n_layer = hp->n_layer;
        p->n_head = hp->n_head;
        p->d = hp->head_dim;
    }
    struct ea_stats *st = &p->stats[layer];
    const size_t n_mean = (size_t)p->n_head * p->d, n_m2 = n_mean * p->d;
    if (!st->mean) st->mean = malloc(n_mean * sizeof(double));
    if (!st->m2) st->m2 = malloc(n_m2 * sizeof(double));
    if (!st->mean || !st->m2)
        return pykv_error(PYKV_ERR_NOMEM, "out of memory for expected_attention's query statistics");
    st->count = 0;
    memset(st->mean, 0, n_mean * sizeof(double));
    memset(st->m2, 0, n_m2 * sizeof(double));
    return PYKV_OK;
}

static void ea_stats_end(struct expected_attention *p, int layer) {
    struct ea_stats *st = &p->stats[layer];
    free(st->mean);
    free(st->m2);
    ea_stats_device_free(st);
    memset(st, 0, sizeof(*st));
}

// ---- query statistics ----------------------------------------------------------------

struct stats_job {
    const struct policy_event *ev;
    struct expected_attention *p;
    int32_t                    t0, rows;    // chunk rows t0 .. t0 + rows - 1 count
    float                     *cs;          // (rows, n_rot): each row's RoPE cos and sin
    float                     *scratch;     // per thread: d * rows (the rows, transposed) + d * d
};

// Query head hq's rows t0.. of the chunk before RoPE, transposed into xt (d, rows).
static void unrotated_rows(const struct stats_job *job, int hq, float *xt) {
    const struct hparams *hp = job->ev->hp;
    const int d = hp->head_dim, n_rot = hp->n_rot, rows = job->rows;
    for (int r = 0; r < rows; r++) {
        const float *q = job->ev->q + ((size_t)(job->t0 + r) * hp->n_head + hq) * d;
        const float *cs = job->cs + (size_t)r * n_rot;
        for (int i = 0; i < n_rot / 2; i++) {   // the forward pass's rotation, undone
            const float c = cs[2 * i], s = cs[2 * i + 1];
            const float a = q[2 * i], b = q[2 * i + 1];
            xt[(size_t)(2 * i) * rows + r] = a * c + b * s;
            xt[(size_t)(2 * i + 1) * rows + r] = b * c - a * s;
        }
        for (int i = n_rot; i < d; i++) xt[(size_t)i * rows + r] = q[i];
    }
}

// Merge the chunk's rows of query head hq into the layer's running mean and m2.
static void stats_head(const struct stats_job *job, int hq, float *xt, float *outer) {
    struct expected_attention *p = job->p;
    const int d = p->d, rows = job->rows, layer = job->ev->layer;
    unrotated_rows(job, hq, xt);
    const struct ea_stats *st = &p->stats[layer];
    double *mean = st->mean + (size_t)hq * d;
    double *m2 = st->m2 + (size_t)hq * d * d;
    const double na = (double)st->count, nb = (double)rows, n = na + nb;
    double chunk_mean[PYKV_MAX_HEAD_DIM];
    for (int i = 0; i < d; i++) {
        float *x = xt + (size_t)i * rows;
        double s = 0.0;
        for (int r = 0; r < rows; r++) s += x[r];
        chunk_mean[i] = s / nb;
        for (int r = 0; r < rows; r++) x[r] = (float)(x[r] - chunk_mean[i]);
    }
    gemm_rows_f32(xt, d, xt, d, rows, outer, d);   // the chunk's own sum of outer products
    for (int i = 0; i < d; i++) {
        const double di = chunk_mean[i] - mean[i];
        for (int j = 0; j < d; j++) {
            const double dj = chunk_mean[j] - mean[j];
            m2[(size_t)i * d + j] += (double)outer[(size_t)i * d + j] + di * dj * na * nb / n;
        }
    }
    for (int i = 0; i < d; i++) mean[i] += (chunk_mean[i] - mean[i]) * nb / n;
}

static void stats_task(void *arg, int ith, int nth) {
    const struct stats_job *job = arg;
    const int d = job->p->d;
    float *xt = job->scratch + (size_t)ith * ((size_t)d * job->rows + (size_t)d * d);
    float *outer = xt + (size_t)d * job->rows;
    long h0, h1;
    split_range(job->p->n_head, ith, nth, &h0, &h1);
    for (long hq = h0; hq < h1; hq++) stats_head(job, (int)hq, xt, outer);
}

pykv_status ea_chunk_rows(const struct expected_attention *p, const struct policy_event *ev, int32_t *t0,
                          int32_t *rows, float **cs) {
    const int n_rot = ev->hp->n_rot;
    const int32_t T = ev->T - ev->probe.n, first_pos = ev->n_past - T;
    *t0 = first_pos >= p->sink ? 0 : (p->sink - first_pos < T ? p->sink - first_pos : T);
    *rows = T - *t0;
    *cs = NULL;
    if (*rows <= 0) return PYKV_OK;
    if (!(*cs = malloc((size_t)*rows * (n_rot ? n_rot : 1) * sizeof(float))))
        return pykv_error(PYKV_ERR_NOMEM, "out of memory for expected_attention's query statistics");
    for (int32_t r = 0; r < *rows; r++)   // the angles the forward pass rotated by
        rope_angles(*cs + (size_t)r * n_rot, n_rot, first_pos + *t0 + r, ev->probe.rope_inv_freq);
    return PYKV_OK;
}

// Add this chunk's queries (positions >= sink) to the layer's statistics.
static pykv_status ea_add_chunk(struct expected_attention *p, const struct policy_event *ev) {
    const int layer = ev->layer;
    const int d = p->d;
    struct stats_job job = { .ev = ev, .p = p };
    PYKV_TRY(ea_chunk_rows(p, ev, &job.t0, &job.rows, &job.cs));
    if (job.rows <= 0) return PYKV_OK;
    const int nth = threadpool_size(ev->pool);
    job.scratch = malloc((size_t)nth * ((size_t)d * job.rows + (size_t)d * d) * sizeof(float));
    if (!job.scratch) {
        free(job.cs);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory for expected_attention's query statistics");
    }
    threadpool_run(ev->pool, stats_task, &job);
    free(job.cs);
    free(job.scratch);
    p->stats[layer].count += job.rows;
    return PYKV_OK;
}

// ---- scores ----------------------------------------------------------------------------

void ea_average_rotation(const float *inv_freq, int n_rot, int32_t first, int32_t n, double *c, double *s) {
    for (int i = 0; i < n_rot / 2; i++) {
        double sc = 0.0, ss = 0.0;
        for (int32_t t = 0; t < n; t++) {
            const double theta = (double)(first + t) * (double)inv_freq[i];
            sc += cos(theta);
            ss += sin(theta);
        }
        c[i] = sc / n;
        s[i] = ss / n;
    }
}

// x <- R x for a vector whose elements sit `stride` apart (R: the averaged rotation).
static void rotate(double *x, size_t stride, int n_rot, const double *c, const double *s) {
    for (int i = 0; i < n_rot / 2; i++) {
        double *a = x + (size_t)(2 * i) * stride, *b = x + (size_t)(2 * i + 1) * stride;
        const double a0 = *a, b0 = *b;
        *a = c[i] * a0 - s[i] * b0;
        *b = s[i] * a0 + c[i] * b0;
    }
}

struct score_job {
    const struct policy_event       *ev;
    const struct expected_attention *p;
    const double                    *cos_avg, *sin_avg;
    float                          **keys;    // per KV head: (n, d) floats
    const int32_t                   *first;   // per KV head: the first entry past the sinks
    int32_t                          n_max;
    float                           *prob;    // (n_head, n_max): each query head's a_j
    float                           *scratch; // per thread: d (mean) + d * d (C') + n_max * d
    double                          *dscratch;// per thread: d + d * d
};

void ea_future_query(const struct expected_attention *p, const struct ea_stats *st, int n_rot, const double *cos_avg,
                     const double *sin_avg, int hq, float *m, float *A, double *dm, double *dC) {
    const int d = p->d;
    const int64_t count = st->count;
    const double *mean = st->mean + (size_t)hq * d;
    const double *m2 = st->m2 + (size_t)hq * d * d;
    memcpy(dm, mean, (size_t)d * sizeof(double));
    rotate(dm, 1, n_rot, cos_avg, sin_avg);
    for (int i = 0; i < d; i++) m[i] = (float)(dm[i] / sqrt((double)d));
    if (!p->use_cov) return;
    for (size_t i = 0; i < (size_t)d * d; i++) dC[i] = count > 0 ? m2[i] / (double)count : 0.0;
    for (int j = 0; j < d; j++) rotate(dC + j, (size_t)d, n_rot, cos_avg, sin_avg);   // R C
    for (int i = 0; i < d; i++) rotate(dC + (size_t)i * d, 1, n_rot, cos_avg, sin_avg); // (R C) R^T
    for (size_t i = 0; i < (size_t)d * d; i++) A[i] = (float)(dC[i] / (2.0 * d));
}

static void score_head(const struct score_job *job, int hq, float *scratch, double *dscratch) {
    const struct expected_attention *p = job->p;
    const int d = p->d, g = hq / (p->n_head / job->ev->hp->n_head_kv);
    const struct kv_list *l = kv_cache_list(job->ev->cache, job->ev->layer, g);
    const int32_t n = l->n, first = job->first[g];
    float *m = scratch, *A = m + d, *Y = A + (size_t)d * d;
    float *z = job->prob + (size_t)hq * job->n_max;
    if (first >= n) return;
    ea_future_query(p, &p->stats[job->ev->layer], job->ev->hp->n_rot, job->cos_avg, job->sin_avg, hq, m, A, dscratch,
                    dscratch + d);
    const float *K = job->keys[g] + (size_t)first * d;
    const int32_t nc = n - first;
    if (p->use_cov) gemm_rows_f32(A, d, K, nc, d, Y, d);   // Y[j] = C' k_j / (2d)
    float zmax = -INFINITY;
    for (int32_t j = 0; j < nc; j++) {
        const float *k = K + (size_t)j * d;
        double v = 0.0;
        for (int i = 0; i < d; i++) v += (double)m[i] * k[i];
        if (p->use_cov)
            for (int i = 0; i < d; i++) v += (double)Y[(size_t)j * d + i] * k[i];
        z[first + j] = (float)v;
        if (z[first + j] > zmax) zmax = z[first + j];
    }
    double sum = 0.0;
    for (int32_t j = first; j < n; j++) {
        z[j] = expf(z[j] - zmax);
        sum += z[j];
    }
    for (int32_t j = first; j < n; j++) z[j] = (float)(z[j] / sum);
}

static void score_task(void *arg, int ith, int nth) {
    const struct score_job *job = arg;
    const int d = job->p->d;
    float *scratch = job->scratch + (size_t)ith * ((size_t)d + (size_t)d * d + (size_t)job->n_max * d);
    double *dscratch = job->dscratch + (size_t)ith * ((size_t)d + (size_t)d * d);
    long h0, h1;
    split_range(job->p->n_head, ith, nth, &h0, &h1);
    for (long hq = h0; hq < h1; hq++) score_head(job, (int)hq, scratch, dscratch);
}

// KV head g's scores (group mean of a_j, value norms) and its B best, the sinks kept.
static pykv_status keep_list(const struct policy_event *ev, const struct expected_attention *p,
                             const struct score_job *job, int g, int32_t B, float *s) {
    const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int group = p->n_head / ev->hp->n_head_kv, d = p->d;
    float *values = NULL;   // the list's values as floats, wherever they are stored
    if (p->use_vnorm) {
        if (!(values = malloc((size_t)(l->n ? l->n : 1) * d * sizeof(float))))
            return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d (expected_attention)", ev->layer);
        const pykv_status rc = kv_list_rows_f32(ev->cache, l, 1, l->n, values);
        if (rc != PYKV_OK) {
            free(values);
            return rc;
        }
    }
    for (int32_t j = 0; j < l->n; j++) {
        if (j < job->first[g]) {
            s[j] = INFINITY;
            continue;
        }
        float sum = 0.0f;
        for (int r = 0; r < group; r++) sum += job->prob[(size_t)(g * group + r) * job->n_max + j];
        s[j] = sum / (float)group;
        if (p->use_vnorm) {
            const float *v = values + (size_t)j * d;
            double vv = 0.0;
            for (int i = 0; i < d; i++) vv += (double)v[i] * v[i];
            s[j] = (float)(((double)s[j] + p->epsilon) * sqrt(vv));
        }
    }
    free(values);
    return ws_keep_top(ev, g, s, l->n, B);
}

int32_t ea_first_past_sinks(const struct kv_list *l, int32_t sink) {
    int32_t j = 0;
    while (j < l->n && l->pos[j] < sink) j++;
    return j;
}

static pykv_status ea_compress_layer(struct expected_attention *p, const struct policy_event *ev, int32_t B) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv, d = p->d, nth = threadpool_size(ev->pool);
    struct score_job job = { .ev = ev, .p = p };
    double cos_avg[PYKV_MAX_HEAD_DIM / 2], sin_avg[PYKV_MAX_HEAD_DIM / 2];
    ea_average_rotation(ev->probe.rope_inv_freq, hp->n_rot, ev->n_past_end, p->n_future, cos_avg, sin_avg);
    job.cos_avg = cos_avg;
    job.sin_avg = sin_avg;
    int32_t *first = calloc((size_t)hkv, sizeof(int32_t));
    float **keys = calloc((size_t)hkv, sizeof(float *));
    if (!first || !keys) {
        free(first); free(keys);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d (expected_attention)", ev->layer);
    }
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        first[g] = ea_first_past_sinks(l, p->sink);
        if (l->n > job.n_max) job.n_max = l->n;
    }
    job.keys = keys;
    job.first = first;
    pykv_status rc = PYKV_OK;
    job.prob = malloc((size_t)hp->n_head * job.n_max * sizeof(float));
    job.scratch = malloc((size_t)nth * ((size_t)d + (size_t)d * d + (size_t)job.n_max * d) * sizeof(float));
    job.dscratch = malloc((size_t)nth * ((size_t)d + (size_t)d * d) * sizeof(double));
    float *s = malloc((size_t)job.n_max * sizeof(float));
    int ok = job.prob && job.scratch && job.dscratch && s;
    for (int g = 0; g < hkv && ok && rc == PYKV_OK; g++) {   // the keys as floats, wherever they are stored
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        keys[g] = malloc((size_t)(l->n ? l->n : 1) * d * sizeof(float));
        ok = keys[g] != NULL;
        if (ok) rc = kv_list_rows_f32(ev->cache, l, 0, l->n, keys[g]);
    }
    if (!ok) rc = pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d (expected_attention)", ev->layer);
    if (rc == PYKV_OK) threadpool_run(ev->pool, score_task, &job);
    for (int g = 0; g < hkv && rc == PYKV_OK; g++) rc = keep_list(ev, p, &job, g, B, s);
    for (int g = 0; g < hkv; g++) free(keys[g]);
    free(keys); free(first);
    free(job.prob); free(job.scratch); free(job.dscratch); free(s);
    return rc;
}

static pykv_status ea_after_layer(struct kv_policy *base, const struct policy_event *ev) {
    struct expected_attention *p = (struct expected_attention *)base;
    if (ev->layer < 0 || ev->n_prompt <= 1 || (!ev->q && !ev->q_device)) return PYKV_OK;   // decode steps: no statistics
    // a call's first chunk starts the statistics afresh; a layer on the GPU keeps them there
    if (ev->is_first_chunk || !p->stats || !p->stats[ev->layer].mean) PYKV_TRY(ea_stats_begin(p, ev->hp, ev->layer));
    PYKV_TRY(ev->q_device ? ea_add_chunk_device(p, ev) : ea_add_chunk(p, ev));
    if (ws_is_prefill_end(ev)) {
        const int32_t B = ws_budget(&p->base.cfg, ev);
        if (B <= p->sink)
            return pykv_error(PYKV_ERR_INVALID_ARG, "policy 'expected_attention': the budget (%d entries per layer "
                              "and KV head) must be larger than the %d sink tokens it includes", B, p->sink);
        int any = 0;
        for (int g = 0; g < ev->hp->n_head_kv; g++) any |= kv_cache_list(ev->cache, ev->layer, g)->n > B;
        int done = 0;   // a layer on the GPU scores there, from its statistics brought down
        if (any && ev->q_device) PYKV_TRY(ea_stats_download(p, ev));
        if (any && ev->q_device) PYKV_TRY(ea_compress_layer_device(p, ev, B, &done));
        if (any && !done) PYKV_TRY(ea_compress_layer(p, ev, B));
    }
    if (ev->n_past >= ev->n_past_end) ea_stats_end(p, ev->layer);   // the call's last chunk
    return PYKV_OK;
}

static int32_t ea_min_budget(const struct kv_policy *base) {
    return ((const struct expected_attention *)base)->sink + 1;
}

const struct policy_ops policy_expected_attention = {
    .name = "expected_attention",
    .description = "Expected Attention: the attention future queries are expected to pay each entry, from the "
                   "statistics of the prompt's queries, weighted by value norms",
    .init = ea_init,
    .free = ea_free,
    .after_layer = ea_after_layer,
    .min_budget = ea_min_budget,
    .options = "sink=4, n_future_positions=512, use_covariance=1, use_vnorm=1, epsilon=0, evict_every_chunk=0",
    .choose = "the question is not known yet (a document cached once for many questions): no query at the end "
              "of the prompt is needed",
    .default_budget_frac = POLICY_DEFAULT_BUDGET_FRAC,
    .default_budget_min = POLICY_DEFAULT_BUDGET_MIN,
    .budget_floor = POLICY_BUDGET_FLOOR,
    .device_lists = 1,
};
