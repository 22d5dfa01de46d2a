// window-scores-gpu.c - the policies' reads of a layer on the GPU: one run of the window
// kernel with its outputs brought back (ws_window_run, which TAKE's probe uses too), the
// window's scores kept on the device for the selections there (ws_device_scores: SnapKV's and
// PyramidKV's top-k per list, Ada-KV's joint count across heads), the chunk's query rows, the
// statistics of ws_stats_compute (the window's attention over the lists runs there, ggml-cuda/
// window-scores.cu, the twin of the CPU's stats_head), the attention sums and LAVa's value
// norms. What comes back is per-entry statistics, counts or chosen indices, so everything the
// policies do with them after is the CPU's code.
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"

pykv_status ws_window_run(const struct kv_cache *c, const struct cuda_kv_layer *kl, struct cuda_window_args a,
                          const struct ws_device_run *r) {
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int64_t total = cuda_window_layout(kl, a.protect, NULL, NULL);
    if (total == 0) return PYKV_OK;
    const size_t n_out = (size_t)total * (size_t)(a.n_head / kl->n_head_kv);
    const size_t work = cuda_align(cuda_window_work_bytes(kl, &a));   // a host vis is as good as a device one here
    if (work == 0)
        return pykv_error(PYKV_ERR_INTERNAL, "the GPU's window kernel cannot take %d rows of a %d-token chunk", a.rows,
                          a.T);
    const size_t vis_b = a.vis ? cuda_align((size_t)a.rows * kl->n_head_kv * sizeof(int32_t)) : 0;
    const size_t q_bytes = (size_t)a.rows * a.n_head * kl->head_dim * sizeof(float), q_b = r->q ? cuda_align(q_bytes) : 0;
    const size_t scores_b = r->scores ? cuda_align((size_t)total * sizeof(float)) : 0;
    const size_t mean_b = r->mean ? cuda_align(n_out * sizeof(float)) : 0, var_b = r->var ? cuda_align(n_out * sizeof(float)) : 0;
    const size_t ent_b = r->ent ? n_out * sizeof(double) : 0;
    PYKV_TRY(cuda_set_device(c->device));
    char *d = NULL;
    PYKV_TRY(cuda_alloc_async((void **)&d, work + vis_b + q_b + scores_b + mean_b + var_b + ent_b, s,
                              "the observation window's scores"));
    char *at = d + work;
    const int32_t *vis = a.vis;
    a.vis = vis ? (const int32_t *)at : NULL;
    const float *d_q = r->q ? (const float *)(at + vis_b) : r->d_q;
    at += vis_b + q_b;
    float *d_scores = r->scores ? (float *)at : NULL;
    float *d_mean = r->mean ? (float *)(at + scores_b) : NULL;
    float *d_var = r->var ? (float *)(at + scores_b + mean_b) : NULL;
    a.ent = r->ent ? (double *)(at + scores_b + mean_b + var_b) : NULL;
    pykv_status err = PYKV_OK;
    if (vis) err = cuda_upload_staged((void *)a.vis, vis, (size_t)a.rows * kl->n_head_kv * sizeof(int32_t), s);
    if (err == PYKV_OK && r->q) err = cuda_upload_staged((void *)d_q, r->q, q_bytes, s);
    if (err == PYKV_OK) {
        cuda_timing_mark(s, "policy: window scores");
        cuda_window_scores(s, kl, d_q, &a, d_scores, d_mean, d_var, d);
        err = cuda_check("the observation window's scores on the GPU");
    }
    if (err == PYKV_OK && r->scores) err = cuda_download_async(r->scores, d_scores, (size_t)total * sizeof(float), s);
    if (err == PYKV_OK && r->mean) err = cuda_download_async(r->mean, d_mean, n_out * sizeof(float), s);
    if (err == PYKV_OK && r->var) err = cuda_download_async(r->var, d_var, n_out * sizeof(float), s);
    if (err == PYKV_OK && r->ent) err = cuda_download_async(r->ent, a.ent, n_out * sizeof(double), s);
    cuda_free_async(d, s);
    const pykv_status done = cuda_stream_sync(s);
    return err != PYKV_OK ? err : done;
}

pykv_status ws_stats_device(const struct policy_event *ev, struct ws_window w, struct ws_stats *st) {
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    // the statistics alone: the policy reduces and pools them on the host, as on the CPU
    const struct cuda_window_args a = { .n_head = ev->hp->n_head, .T = ev->T, .rows = w.rows, .protect = w.protect,
                                        .pool = WS_POOL_MAX, .kernel = 1, .gqa = WS_GQA_MEAN };
    const struct ws_device_run r = { .d_q = ev->q_device, .mean = st->mean, .var = st->var };
    return ws_window_run(ev->cache, &kl, a, &r);
}

pykv_status ws_device_scores_alloc(const struct policy_event *ev, int32_t protect, size_t work,
                                   struct ws_device_scores *ds) {
    const struct kv_cache *c = ev->cache;
    const int hkv = c->n_head_kv;
    memset(ds, 0, sizeof(*ds));
    ds->ev = ev;
    ds->n_head_kv = hkv;
    struct cuda_kv_layer kl;
    kv_device_layer(c, ev->layer, NULL, &kl);
    int32_t n_cand[CUDA_MAX_KV_HEADS];
    int64_t off[CUDA_MAX_KV_HEADS];
    ds->total = cuda_window_layout(&kl, protect, n_cand, off);
    ds->n_cand = malloc((size_t)hkv * sizeof(int32_t));
    ds->offset_kv = malloc((size_t)hkv * sizeof(int64_t));
    if (!ds->n_cand || !ds->offset_kv) {
        ws_device_scores_free(ds);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d", ev->layer);
    }
    memcpy(ds->n_cand, n_cand, (size_t)hkv * sizeof(int32_t));
    memcpy(ds->offset_kv, off, (size_t)hkv * sizeof(int64_t));
    if (ds->total > INT32_MAX) {
        ws_device_scores_free(ds);
        return pykv_error(PYKV_ERR_UNSUPPORTED, "layer %d has more candidates than the GPU's selection takes", ev->layer);
    }
    // one block: the kernel's work, the scores, the chosen indices and the selection's lists
    work = cuda_align(work);
    const size_t list_b = cuda_align(ds->total * sizeof(float));
    const size_t lists = (size_t)hkv * (sizeof(int64_t) + 2 * sizeof(int32_t));
    const cuda_stream s = (cuda_stream)c->device_stream;
    pykv_status err = cuda_set_device(c->device);
    char *d = NULL;
    if (err == PYKV_OK) err = cuda_alloc_async((void **)&d, work + 2 * list_b + lists, s, "the layer's selection");
    if (err != PYKV_OK) {
        ws_device_scores_free(ds);
        return err;
    }
    ds->d = d;
    ds->d_scores = d + work;
    ds->d_idx = d + work + list_b;
    ds->d_lists = d + work + 2 * list_b;
    return PYKV_OK;
}

pykv_status ws_device_scores_make(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                  struct ws_device_scores *ds) {
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    const struct cuda_window_args a = { .n_head = ev->hp->n_head, .T = ev->T, .rows = w.rows, .protect = w.protect,
                                        .pool = o->pool, .kernel = o->kernel, .gqa = o->gqa };
    const size_t work = cuda_window_work_bytes(&kl, &a);
    if (work == 0) {
        memset(ds, 0, sizeof(*ds));
        return pykv_error(PYKV_ERR_INTERNAL, "the GPU cannot score layer %d's window (rows=%d, chunk=%d)", ev->layer,
                          w.rows, ev->T);
    }
    PYKV_TRY(ws_device_scores_alloc(ev, w.protect, work, ds));
    cuda_timing_mark((cuda_stream)ev->cache->device_stream, "policy: window scores");
    cuda_window_scores((cuda_stream)ev->cache->device_stream, &kl, ev->q_device, &a, ds->d_scores, NULL, NULL, ds->d);
    const pykv_status err = cuda_check("the window's scores on the GPU");
    if (err != PYKV_OK) ws_device_scores_free(ds);
    return err;
}

void ws_device_scores_free(struct ws_device_scores *ds) {
    if (ds->d) cuda_free_async(ds->d, (cuda_stream)ds->ev->cache->device_stream);
    free(ds->n_cand);
    free(ds->offset_kv);
    memset(ds, 0, sizeof(*ds));
}

pykv_status ws_device_queue_select(const struct ws_device_scores *ds, int m, const int64_t *off, const int32_t *n,
                                   const int32_t *k) {
    const cuda_stream s = (cuda_stream)ds->ev->cache->device_stream;
    int64_t *d_off = ds->d_lists;
    int32_t *d_n = (int32_t *)(d_off + ds->n_head_kv), *d_k = d_n + ds->n_head_kv;
    pykv_status err = cuda_upload_staged(d_off, off, (size_t)m * sizeof(int64_t), s);
    if (err == PYKV_OK) err = cuda_upload_staged(d_n, n, (size_t)m * sizeof(int32_t), s);
    if (err == PYKV_OK) err = cuda_upload_staged(d_k, k, (size_t)m * sizeof(int32_t), s);
    if (err == PYKV_OK) {
        cuda_timing_mark(s, "policy: top-k");
        cuda_select_top(s, ds->d_scores, d_off, d_n, d_k, m, ds->d_idx, NULL);
        err = cuda_check("selecting the top entries on the GPU");
    }
    return err;
}

// ws_device_queue_select, then list i's ascending indices brought back to idx + off[i]
// (host memory).
static pykv_status device_select(const struct ws_device_scores *ds, int m, const int64_t *off, const int32_t *n,
                                 const int32_t *k, int32_t *idx) {
    const cuda_stream s = (cuda_stream)ds->ev->cache->device_stream;
    pykv_status err = ws_device_queue_select(ds, m, off, n, k);
    for (int i = 0; i < m && err == PYKV_OK; i++)
        if (k[i] > 0)
            err = cuda_download_async(idx + off[i], (const int32_t *)ds->d_idx + off[i], (size_t)k[i] * sizeof(int32_t), s);
    const pykv_status synced = cuda_stream_sync(s);
    return err != PYKV_OK ? err : synced;
}

pykv_status ws_device_joint_counts(const struct ws_device_scores *ds, int64_t K, int64_t *c) {
    const int hkv = ds->n_head_kv;
    if (K >= ds->total) {   // every candidate is in the top K
        for (int g = 0; g < hkv; g++) c[g] = ds->n_cand[g];
        return PYKV_OK;
    }
    for (int g = 0; g < hkv; g++) c[g] = 0;
    if (K <= 0) return PYKV_OK;
    int32_t *idx = malloc((size_t)K * sizeof(int32_t));
    if (!idx) return pykv_error(PYKV_ERR_NOMEM, "out of memory ranking layer %d's entries", ds->ev->layer);
    const int64_t off = 0;   // the layer's scores as one list: flat index = offset_kv[g] + j
    const int32_t n = (int32_t)ds->total, k = (int32_t)K;
    const pykv_status err = device_select(ds, 1, &off, &n, &k, idx);
    for (int64_t i = 0, g = 0; err == PYKV_OK && i < K; i++) {   // ascending: head by head
        while (g + 1 < hkv && idx[i] >= ds->offset_kv[g + 1]) g++;
        c[g]++;
    }
    free(idx);
    return err;
}

pykv_status ws_device_keep_top(const struct ws_device_scores *ds, const int64_t *b) {
    const int hkv = ds->n_head_kv;
    int32_t k[CUDA_MAX_KV_HEADS];
    int any = 0;
    for (int g = 0; g < hkv; g++) {
        k[g] = b[g] < 0 ? 0 : b[g] < ds->n_cand[g] ? (int32_t)b[g] : ds->n_cand[g];
        any |= k[g] < ds->n_cand[g];
    }
    if (!any) return PYKV_OK;
    int32_t *idx = malloc((size_t)ds->total * sizeof(int32_t) + 1);
    int64_t *chosen = malloc((size_t)ds->total * sizeof(int64_t) + 1);
    pykv_status err = idx && chosen ? device_select(ds, hkv, ds->offset_kv, ds->n_cand, k, idx)
                                    : pykv_error(PYKV_ERR_NOMEM, "out of memory selecting layer %d's entries", ds->ev->layer);
    for (int g = 0; g < hkv && err == PYKV_OK; g++) {   // the chosen candidates (ascending) and the window
        if (k[g] >= ds->n_cand[g]) continue;
        for (int32_t i = 0; i < k[g]; i++) chosen[i] = idx[ds->offset_kv[g] + i];
        err = ws_keep(ds->ev, g, chosen, k[g], ds->n_cand[g]);
    }
    free(idx);
    free(chosen);
    return err;
}

pykv_status ws_layer_keep_top_device(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                     int64_t b, int *done) {
    const int hkv = ev->cache->n_head_kv;
    *done = 0;
    int any = 0;
    for (int g = 0; g < hkv; g++) {
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n - w.protect, n_cand = n > 0 ? n : 0;
        // a decode step's one-entry eviction keeps ws_keep_top's own path (kv_list_drop's order)
        if (b > 0 && b == (int64_t)n_cand - 1) return PYKV_OK;
        any |= b < n_cand;
    }
    *done = 1;
    if (!any) return PYKV_OK;
    struct ws_device_scores ds;
    PYKV_TRY(ws_device_scores_make(ev, o, w, &ds));
    int64_t bs[CUDA_MAX_KV_HEADS];
    for (int g = 0; g < hkv; g++) bs[g] = b;
    const pykv_status err = ws_device_keep_top(&ds, bs);
    ws_device_scores_free(&ds);
    return err;
}

pykv_status ws_query_rows_device(const struct policy_event *ev, int32_t t0, int32_t rows, float *out) {
    const struct kv_cache *c = ev->cache;
    const size_t width = (size_t)ev->hp->n_head * ev->hp->head_dim;
    PYKV_TRY(cuda_set_device(c->device));
    PYKV_TRY(cuda_download_async(out, ev->q_device + (size_t)t0 * width, (size_t)rows * width * sizeof(float),
                                 (cuda_stream)c->device_stream));
    return cuda_stream_sync((cuda_stream)c->device_stream);
}

pykv_status ws_value_l1_max_device(const struct policy_event *ev, const int32_t *n_cand, float *vbar) {
    const struct kv_cache *c = ev->cache;
    const cuda_stream s = (cuda_stream)c->device_stream;
    struct cuda_kv_layer kl;
    kv_device_layer(c, ev->layer, NULL, &kl);
    PYKV_TRY(cuda_set_device(c->device));
    void *d = NULL;
    PYKV_TRY(cuda_alloc_async(&d, (size_t)c->n_head_kv * sizeof(float), s, "LAVa's value norms"));
    cuda_value_l1_max(s, &kl, n_cand, d);
    pykv_status err = cuda_check("LAVa's value norms on the GPU");
    if (err == PYKV_OK) err = cuda_download_async(vbar, d, (size_t)c->n_head_kv * sizeof(float), s);
    cuda_free_async(d, s);
    const pykv_status done = cuda_stream_sync(s);
    return err != PYKV_OK ? err : done;
}

// The window kernel over every entry of the layer's lists (vis mode) for the chunk's last
// `rows` queries, each seeing the entries up to its own (causal): means per query head and
// entry in the ws_stats layout, and the entropy terms when ent_out is set.
static pykv_status all_entries_stats(const struct policy_event *ev, int32_t rows, float *mean_out, double *ent_out) {
    const int hkv = ev->cache->n_head_kv;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    int32_t *vis = malloc((size_t)rows * hkv * sizeof(int32_t));
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the attention sums of layer %d", ev->layer);
    for (int32_t r = 0; r < rows; r++)
        for (int g = 0; g < hkv; g++) {
            const int32_t v = kl.n[g] - (rows - 1 - r);
            vis[(size_t)r * hkv + g] = v > 0 ? v : 0;
        }
    struct cuda_window_args a = { .n_head = ev->hp->n_head, .T = ev->T, .rows = rows, .protect = 0,
                                  .pool = WS_POOL_MAX, .kernel = 1, .gqa = WS_GQA_MEAN };
    a.vis = vis;
    const struct ws_device_run run = { .d_q = ev->q_device, .mean = mean_out, .ent = ent_out };
    const pykv_status err = ws_window_run(ev->cache, &kl, a, &run);
    free(vis);
    return err;
}

pykv_status ws_attention_sums_device(const struct policy_event *ev, int32_t rows, float *out, size_t stride) {
    const struct kv_cache *c = ev->cache;
    const int hkv = c->n_head_kv;
    const int32_t G = ev->hp->n_head / hkv;
    int64_t total = 0;
    for (int g = 0; g < hkv; g++) total += kv_cache_list(ev->cache, ev->layer, g)->n;
    float *mean = malloc((size_t)(total * G > 0 ? total * G : 1) * sizeof(float));
    if (!mean) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the attention sums of layer %d", ev->layer);
    pykv_status err = all_entries_stats(ev, rows, mean, NULL);
    for (int g = 0, off = 0; err == PYKV_OK && g < hkv; g++) {   // KV head g's block of G rows
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        for (int32_t i = 0; i < G; i++) {
            float *row = out + (size_t)(g * G + i) * stride;
            const float *m = mean + (size_t)off * G + (size_t)i * n;
            for (int32_t j = 0; j < n; j++) row[j] = m[j] * (float)rows;   // the mean over the rows back to their sum
        }
        off += n;
    }
    free(mean);
    return err;
}

pykv_status ws_window_entropy_device(const struct policy_event *ev, struct ws_window w, const int32_t *n_cand,
                                     double *H) {
    const int hkv = ev->cache->n_head_kv;
    const int32_t G = ev->hp->n_head / hkv;
    int64_t total = 0;
    for (int g = 0; g < hkv; g++) total += kv_cache_list(ev->cache, ev->layer, g)->n;
    float *mean = malloc((size_t)(total * G > 0 ? total * G : 1) * sizeof(float));
    double *ent = malloc((size_t)(total * G > 0 ? total * G : 1) * sizeof(double));
    pykv_status err = mean && ent ? all_entries_stats(ev, w.rows, mean, ent)
                                  : pykv_error(PYKV_ERR_NOMEM, "out of memory for the entropy of layer %d", ev->layer);
    double sum = 0.0;
    for (int g = 0, off = 0; err == PYKV_OK && g < hkv; g++) {   // the candidates' terms, head by head
        const int32_t n = kv_cache_list(ev->cache, ev->layer, g)->n;
        for (int32_t i = 0; i < G; i++)
            for (int32_t j = 0; j < n_cand[g]; j++) sum += ent[(size_t)off * G + (size_t)i * n + j];
        off += n;
    }
    *H = -sum;
    free(mean);
    free(ent);
    return err;
}

#else

pykv_status ws_attention_sums_device(const struct policy_event *ev, int32_t rows, float *out, size_t stride) {
    (void)ev; (void)rows; (void)out; (void)stride;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_window_entropy_device(const struct policy_event *ev, struct ws_window w, const int32_t *n_cand,
                                     double *H) {
    (void)ev; (void)w; (void)n_cand; (void)H;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_layer_keep_top_device(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                     int64_t b, int *done) {
    (void)ev; (void)o; (void)w; (void)b;
    *done = 0;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_device_scores_make(const struct policy_event *ev, const struct ws_opts *o, struct ws_window w,
                                  struct ws_device_scores *ds) {
    (void)ev; (void)o; (void)w;
    memset(ds, 0, sizeof(*ds));
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_device_scores_alloc(const struct policy_event *ev, int32_t protect, size_t work,
                                   struct ws_device_scores *ds) {
    (void)ev; (void)protect; (void)work;
    memset(ds, 0, sizeof(*ds));
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
void ws_device_scores_free(struct ws_device_scores *ds) { (void)ds; }
pykv_status ws_device_joint_counts(const struct ws_device_scores *ds, int64_t K, int64_t *c) {
    (void)ds; (void)K; (void)c;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_device_keep_top(const struct ws_device_scores *ds, const int64_t *b) {
    (void)ds; (void)b;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_query_rows_device(const struct policy_event *ev, int32_t t0, int32_t rows, float *out) {
    (void)ev; (void)t0; (void)rows; (void)out;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_value_l1_max_device(const struct policy_event *ev, const int32_t *n_cand, float *vbar) {
    (void)ev; (void)n_cand; (void)vbar;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ws_stats_device(const struct policy_event *ev, struct ws_window w, struct ws_stats *st) {
    (void)ev; (void)w; (void)st;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}

#endif
