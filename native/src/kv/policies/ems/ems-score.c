// ems-score.c - EMS local score s_Loc at the end of a prefill call (docs/policies.md#ems).
//
// s_Loc[j] = sum over the last `rows` queries of the attention on entry j, fp32 logits and
// max-subtracted softmax (sums in double), causal inside the chunk (a query sees the list up
// to its own position: the chunk's tokens are the last T entries). Unlike window-scores.c it
// scores every entry (the window too: the mean alignment sums over all of them) and expands
// merged entries exactly like attention.c (member m of entry j: logit norm_m * q.k̂_j / sqrt(d),
// the entry's share = its members' total mass), so a second prefill over a compressed cache is
// scored correctly. Per KV head the G query-head rows are averaged in head order (GQA mean).
// Query heads are split across threads, each reduces in a fixed order: any thread count gives
// the same floats.
#include "kv/policies/ems/ems.h"
#include "core/error.h"
#include "model/model.h"
#include "cpu/quant.h"
#include "core/threadpool.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct loc_job {
    const struct policy_event *ev;
    int32_t rows, n_max;
    float  *z;      // (nth, n_max)
    double *acc;    // (n_head, n_max): per query head sums
};

static void loc_head(const struct loc_job *job, int hq, float *z, double *acc) {
    const struct policy_event *ev = job->ev;
    const struct hparams *hp = ev->hp;
    const int hd = hp->head_dim, T = ev->T, g = hq / (hp->n_head / hp->n_head_kv);
    const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const float scale = 1.0f / sqrtf((float)hd);
    memset(acc, 0, (size_t)l->n * sizeof(double));
    for (int r = 0; r < job->rows; r++) {
        const int t = T - job->rows + r;
        const float *q = ev->q + ((size_t)t * hp->n_head + hq) * hd;
        const int32_t n_vis = l->n - (T - 1 - t);
        float mx = -INFINITY;
        for (int32_t j = 0; j < n_vis; j++) {
            z[j] = kv_key_dot(l, j, q, hd) * scale;
            const float top = kv_member_logit_max(l, j, z[j]);
            if (top > mx) mx = top;
        }
        double sum = 0.0;
        for (int32_t j = 0; j < n_vis; j++) {
            const float *nm = kv_member_norms(l, j);
            double e = 0.0;
            if (!nm) e = exp((double)(z[j] - mx));
            else for (int32_t m = 0; m < l->n_members[j]; m++) e += exp((double)(nm[m] * z[j] - mx));
            z[j] = (float)e;
            sum += e;
        }
        for (int32_t j = 0; j < n_vis; j++) acc[j] += (double)z[j] / sum;
    }
}

static void loc_task(void *arg, int ith, int nth) {
    const struct loc_job *job = arg;
    long h0, h1;
    split_range(job->ev->hp->n_head, ith, nth, &h0, &h1);
    for (long hq = h0; hq < h1; hq++)
        loc_head(job, (int)hq, job->z + (size_t)ith * job->n_max, job->acc + (size_t)hq * job->n_max);
}

pykv_status ems_local_scores(const struct policy_event *ev, int32_t rows, float **out) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv, G = hp->n_head / hkv;
    if (!ev->q || rows < 1 || rows > ev->T)
        return pykv_error(PYKV_ERR_INTERNAL, "ems: local scores need the window's queries (rows=%d, chunk=%d)", rows, ev->T);
    struct loc_job job = { .ev = ev, .rows = rows };
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        if (l->n > job.n_max) job.n_max = l->n;
        out[g] = NULL;
    }
    int nth = threadpool_size(ev->pool);
    size_t nm = (size_t)(job.n_max ? job.n_max : 1);
    job.z = malloc((size_t)nth * nm * sizeof(float));
    job.acc = malloc((size_t)hp->n_head * nm * sizeof(double));
    pykv_status st = (job.z && job.acc) ? PYKV_OK : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for local scores");
    if (st == PYKV_OK) threadpool_run(ev->pool, loc_task, &job);
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        out[g] = malloc((size_t)(n ? n : 1) * sizeof(float));
        if (!out[g]) { st = pykv_error(PYKV_ERR_NOMEM, "ems: out of memory for local scores"); break; }
        for (int32_t j = 0; j < n; j++) {
            double s = 0.0;
            for (int r = 0; r < G; r++) s += job.acc[(size_t)(g * G + r) * nm + j];
            out[g][j] = (float)(s / G);
        }
    }
    if (st != PYKV_OK)
        for (int g = 0; g < hkv; g++) { free(out[g]); out[g] = NULL; }
    free(job.z);
    free(job.acc);
    return st;
}

void ems_global_local(const float *glo, const float *loc, int32_t n, int32_t n_cand, float *gl) {
    double sg = 0.0, sl = 0.0;
    for (int32_t j = 0; j < n; j++) { sg += glo[j]; sl += loc[j]; }
    const float a = ems_alignment(sl, sg);
    for (int32_t j = 0; j < n_cand; j++) {
        const float x = a * glo[j];
        gl[j] = x > loc[j] ? x : loc[j];
    }
}
