// take-evict-gpu.c - TAKE's eviction of a layer on the GPU, queued without waiting
// (take-evict-gpu.h). On the stream: the window kernel with each probe row's causal limit
// (the scores stay in device memory, ws_device_scores), the radix select of each list's top k
// (ws_device_queue_select: ws_select_top's sets), the kept indices followed by the probe's gathered into new buffers
// (kv_list_retain_device_indices), and the indices copied into pinned memory. The host knows
// each list's new length at once; the kept entries' positions follow at the chunk's end.
#include "kv/policies/take/take-evict-gpu.h"
#include "core/error.h"
#include "kv/kv-cache.h"
#include "model/model.h"

#include <stdlib.h>
#include <string.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"
#include "kv/policies/common/window-scores.h"
#include "kv/policies/take/take-score.h"

struct pending {            // one list evicted this chunk
    struct kv_list *l;
    int32_t         k;       // the candidates it kept
    int32_t         n_cand;  // the candidates it had
    int32_t        *old_pos; // their positions (n_cand)
    int64_t         at;      // their indices in h_idx
};

struct take_deferred {
    int32_t        *h_idx;   // pinned: the chosen indices, as the stream brings them
    int64_t         h_cap, h_used;
    struct pending *p;
    int             n, cap;
};

// Room for `more` indices in h_idx: a bigger buffer once the copies into the old one are done.
static pykv_status index_room(struct take_deferred *d, int64_t more, cuda_stream s) {
    if (d->h_used + more <= d->h_cap) return PYKV_OK;
    int64_t cap = d->h_cap ? 2 * d->h_cap : 4096;
    while (cap < d->h_used + more) cap *= 2;
    int32_t *h = NULL;
    PYKV_TRY(cuda_stream_sync(s));
    PYKV_TRY(cuda_host_alloc((void **)&h, (size_t)cap * sizeof(int32_t)));
    if (d->h_used) memcpy(h, d->h_idx, (size_t)d->h_used * sizeof(int32_t));
    cuda_host_free(d->h_idx);
    d->h_idx = h;
    d->h_cap = cap;
    return PYKV_OK;
}

static pykv_status pending_room(struct take_deferred *d, int more) {
    if (d->n + more <= d->cap) return PYKV_OK;
    const int cap = d->n + more > 2 * d->cap ? d->n + more : 2 * d->cap;
    struct pending *p = realloc(d->p, (size_t)cap * sizeof(*p));
    if (!p) return pykv_error(PYKV_ERR_NOMEM, "out of memory for TAKE's eviction");
    d->p = p;
    d->cap = cap;
    return PYKV_OK;
}

// The probe's scores of every candidate of the layer (each list's but the probe's own last
// entries) into ds, and each list's top k[g] into ds->d_idx at ds->offset_kv[g], queued.
static pykv_status queue_selection(const struct policy_event *ev, const float *d_qa, int32_t rows, int32_t pos0,
                                   int32_t kernel, const int32_t *k, struct ws_device_scores *ds) {
    struct kv_cache *c = ev->cache;
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int hkv = c->n_head_kv;
    memset(ds, 0, sizeof(*ds));
    struct cuda_kv_layer kl;
    kv_device_layer(c, ev->layer, NULL, &kl);
    for (int g = 0; g < hkv; g++) kl.n[g] -= ev->probe.n;   // the appended probe's own keys are not scored
    const size_t vis_b = (size_t)rows * hkv * sizeof(int32_t);
    int32_t *vis = malloc(vis_b);
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe");
    take_probe_visible(ev, rows, pos0, kl.n, vis);
    struct cuda_window_args a = { .n_head = ev->hp->n_head, .T = rows, .rows = rows, .protect = 0,
                                  .pool = WS_POOL_AVG, .kernel = kernel, .gqa = WS_GQA_MEAN };
    a.vis = vis;
    const size_t work = cuda_window_work_bytes(&kl, &a), vis_at = cuda_align(work);
    pykv_status err = work ? ws_device_scores_alloc(ev, ev->probe.n, vis_at + vis_b, ds)   // the probe as the window
                    : pykv_error(PYKV_ERR_INTERNAL, "the GPU's window kernel cannot take TAKE's %d probe rows", rows);
    if (err == PYKV_OK) {
        a.vis = (const int32_t *)((char *)ds->d + vis_at);
        err = cuda_upload_staged((void *)a.vis, vis, vis_b, s);
    }
    if (err == PYKV_OK) {
        cuda_timing_mark(s, "policy: window scores");
        cuda_window_scores(s, &kl, d_qa, &a, ds->d_scores, NULL, NULL, ds->d);
        err = cuda_check("TAKE's scores on the GPU");
    }
    if (err == PYKV_OK) err = ws_device_queue_select(ds, hkv, ds->offset_kv, ds->n_cand, k);
    free(vis);
    return err;
}

pykv_status take_deferred_evict(struct take_deferred **dp, const struct policy_event *ev, const float *d_qa,
                                int32_t rows, int32_t pos0, int32_t kernel, int32_t k, int *done) {
    struct kv_cache *c = ev->cache;
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int hkv = c->n_head_kv, probe = ev->probe.n;
    int32_t n_cand[CUDA_MAX_KV_HEADS], kk[CUDA_MAX_KV_HEADS];
    int64_t kept = 0;
    *done = 0;
    if (hkv > CUDA_MAX_KV_HEADS) return PYKV_OK;
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(c, ev->layer, g);
        n_cand[g] = l->n - probe;
        kk[g] = n_cand[g] > k ? k : n_cand[g];
        if (n_cand[g] > k && !kv_list_retain_gathers(l, k + probe)) return PYKV_OK;
        if (n_cand[g] > k) kept += k + probe;
    }
    *done = 1;
    if (kept == 0) return PYKV_OK;
    if (!*dp && !(*dp = calloc(1, sizeof(**dp)))) return pykv_error(PYKV_ERR_NOMEM, "out of memory for TAKE's eviction");
    struct take_deferred *d = *dp;
    PYKV_TRY(cuda_set_device(c->device));
    PYKV_TRY(pending_room(d, hkv));
    PYKV_TRY(index_room(d, kept, s));
    struct ws_device_scores ds;
    char *keep_block = NULL;
    pykv_status err = queue_selection(ev, d_qa, rows, pos0, kernel, kk, &ds);
    const int32_t *d_idx = ds.d_idx;
    if (err == PYKV_OK) err = cuda_alloc_async((void **)&keep_block, (size_t)kept * sizeof(int32_t), s, "TAKE's eviction");
    int32_t *tail = malloc((size_t)(probe ? probe : 1) * 2 * sizeof(int32_t));   // the probe's indices, then positions
    if (err == PYKV_OK && !tail) err = pykv_error(PYKV_ERR_NOMEM, "out of memory for TAKE's eviction");
    int32_t *d_keep = (int32_t *)keep_block;
    for (int g = 0; g < hkv && err == PYKV_OK; g++) {
        if (n_cand[g] <= k) continue;   // no-op rule: everything kept
        struct kv_list *l = kv_cache_list(c, ev->layer, g);
        struct pending *pd = &d->p[d->n];
        *pd = (struct pending){ .l = l, .k = k, .n_cand = n_cand[g], .at = d->h_used };
        if (!(pd->old_pos = malloc((size_t)n_cand[g] * sizeof(int32_t)))) {
            err = pykv_error(PYKV_ERR_NOMEM, "out of memory for TAKE's eviction");
            break;
        }
        memcpy(pd->old_pos, l->pos, (size_t)n_cand[g] * sizeof(int32_t));
        for (int32_t i = 0; i < probe; i++) {
            tail[i] = n_cand[g] + i;
            tail[probe + i] = l->pos[n_cand[g] + i];
        }
        // the kept candidates, then the probe's entries (which the forward pass drops)
        err = cuda_copy_d2d(d_keep, d_idx + ds.offset_kv[g], (size_t)k * sizeof(int32_t), s);
        if (err == PYKV_OK && probe) err = cuda_upload_staged(d_keep + k, tail, (size_t)probe * sizeof(int32_t), s);
        if (err == PYKV_OK)
            err = cuda_download_async(d->h_idx + d->h_used, d_idx + ds.offset_kv[g], (size_t)k * sizeof(int32_t), s);
        if (err == PYKV_OK) err = kv_list_retain_device_indices(c, l, d_keep, k + probe);
        if (err != PYKV_OK) {
            free(pd->old_pos);
            break;
        }
        memcpy(l->pos + k, tail + probe, (size_t)probe * sizeof(int32_t));
        d->n++;
        d->h_used += k;
        d_keep += k + probe;
    }
    free(tail);
    cuda_free_async(keep_block, s);
    ws_device_scores_free(&ds);   // on the stream, after the copies that read it
    return err;
}

pykv_status take_deferred_finish(struct take_deferred *d, struct kv_cache *c) {
    if (!d || d->n == 0) return PYKV_OK;
    pykv_status err = cuda_set_device(c->device);
    if (err == PYKV_OK) err = cuda_stream_sync((cuda_stream)c->device_stream);
    for (int i = 0; i < d->n; i++) {
        struct pending *pd = &d->p[i];
        for (int32_t j = 0; j < pd->k && err == PYKV_OK; j++) {
            const int32_t x = d->h_idx[pd->at + j];
            if (x < 0 || x >= pd->n_cand || (j > 0 && x <= d->h_idx[pd->at + j - 1]))
                err = pykv_error(PYKV_ERR_INTERNAL, "TAKE: the GPU's selection gave index %d of %d", x, pd->n_cand);
            else
                pd->l->pos[j] = pd->old_pos[x];
        }
        free(pd->old_pos);
    }
    d->n = 0;
    d->h_used = 0;
    return err;
}

void take_deferred_free(struct take_deferred *d) {
    if (!d) return;
    for (int i = 0; i < d->n; i++) free(d->p[i].old_pos);
    free(d->p);
    cuda_host_free(d->h_idx);
    free(d);
}

#else   // no device lists without CUDA

pykv_status take_deferred_evict(struct take_deferred **dp, const struct policy_event *ev, const float *d_qa,
                                int32_t rows, int32_t pos0, int32_t kernel, int32_t k, int *done) {
    (void)dp; (void)ev; (void)d_qa; (void)rows; (void)pos0; (void)kernel; (void)k;
    *done = 0;
    return PYKV_OK;
}
pykv_status take_deferred_finish(struct take_deferred *d, struct kv_cache *c) {
    (void)d; (void)c;
    return PYKV_OK;
}
void take_deferred_free(struct take_deferred *d) { (void)d; }

#endif
