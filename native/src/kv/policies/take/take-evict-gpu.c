// take-evict-gpu.c - TAKE's eviction of a layer on the GPU, queued without waiting
// (take-evict-gpu.h). On the stream: the window kernel with each probe row's causal limit
// (the scores stay in device memory), the radix select of each list's top k (cuda_select_top:
// ws_select_top's sets), the kept indices followed by the probe's gathered into new buffers
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
#include "kv/kv-device.h"
#include "kv/policies/common/window-scores.h"

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

static size_t aligned(size_t b) { return (b + 255) / 256 * 256; }

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

// The scores of every candidate of the layer and each list's top k into d_idx (list g's at
// off[g]), queued.
static pykv_status queue_selection(const struct policy_event *ev, const float *d_qa, int32_t rows, int32_t pos0,
                                   int32_t kernel, const int32_t *n_cand, const int64_t *off, const int32_t *k,
                                   int64_t total, char **block, int32_t **d_idx) {
    struct kv_cache *c = ev->cache;
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int hkv = c->n_head_kv;
    struct cuda_kv_layer kl;
    kv_device_layer(c, ev->layer, NULL, &kl);
    int32_t *vis = malloc((size_t)rows * hkv * sizeof(int32_t));
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe");
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(c, ev->layer, g);
        kl.n[g] = n_cand[g];   // the appended probe's own keys are not scored
        int32_t v = n_cand[g];
        for (int32_t r = rows - 1; r >= 0; r--) {   // causal by position, as take_layer_scores
            while (v > 0 && l->pos[v - 1] > pos0 + r) v--;
            vis[(size_t)r * hkv + g] = v;
        }
    }
    struct cuda_window_args a = { .n_head = ev->hp->n_head, .T = rows, .rows = rows, .protect = 0,
                                  .pool = WS_POOL_AVG, .kernel = kernel, .gqa = WS_GQA_MEAN };
    a.vis = vis;
    const size_t work = aligned(cuda_window_work_bytes(&kl, &a)), vis_b = aligned((size_t)rows * hkv * sizeof(int32_t));
    const size_t scores_b = aligned((size_t)total * sizeof(float)), idx_b = aligned((size_t)total * sizeof(int32_t));
    const size_t lists_b = (size_t)hkv * (sizeof(int64_t) + 2 * sizeof(int32_t));
    pykv_status err = work ? PYKV_OK
                    : pykv_error(PYKV_ERR_INTERNAL, "the GPU's window kernel cannot take TAKE's %d probe rows", rows);
    char *d = NULL;
    if (err == PYKV_OK) err = cuda_alloc_async((void **)&d, work + vis_b + scores_b + idx_b + lists_b, s, "TAKE's eviction");
    if (err == PYKV_OK) {
        float *d_scores = (float *)(d + work + vis_b);
        *d_idx = (int32_t *)(d + work + vis_b + scores_b);
        int64_t *d_off = (int64_t *)(d + work + vis_b + scores_b + idx_b);
        int32_t *d_n = (int32_t *)(d_off + hkv), *d_k = d_n + hkv;
        err = cuda_upload_staged(d + work, vis, (size_t)rows * hkv * sizeof(int32_t), s);
        a.vis = (const int32_t *)(d + work);
        if (err == PYKV_OK) err = cuda_upload_staged(d_off, off, (size_t)hkv * sizeof(int64_t), s);
        if (err == PYKV_OK) err = cuda_upload_staged(d_n, n_cand, (size_t)hkv * sizeof(int32_t), s);
        if (err == PYKV_OK) err = cuda_upload_staged(d_k, k, (size_t)hkv * sizeof(int32_t), s);
        if (err == PYKV_OK) {
            cuda_window_scores(s, &kl, d_qa, &a, d_scores, NULL, NULL, d);
            cuda_select_top(s, d_scores, d_off, d_n, d_k, hkv, *d_idx, NULL);
            err = cuda_check("TAKE's scores and selection on the GPU");
        }
    }
    free(vis);
    if (err != PYKV_OK && d) {
        cuda_free_async(d, s);
        d = NULL;
    }
    *block = d;
    return err;
}

pykv_status take_deferred_evict(struct take_deferred **dp, const struct policy_event *ev, const float *d_qa,
                                int32_t rows, int32_t pos0, int32_t kernel, int32_t k, int *done) {
    struct kv_cache *c = ev->cache;
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int hkv = c->n_head_kv, probe = ev->probe.n;
    int32_t n_cand[CUDA_MAX_KV_HEADS], kk[CUDA_MAX_KV_HEADS];
    int64_t off[CUDA_MAX_KV_HEADS], total = 0, kept = 0;
    *done = 0;
    if (hkv > CUDA_MAX_KV_HEADS) return PYKV_OK;
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(c, ev->layer, g);
        n_cand[g] = l->n - probe;
        kk[g] = n_cand[g] > k ? k : n_cand[g];
        off[g] = total;
        total += n_cand[g];
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
    char *block = NULL, *keep_block = NULL;
    int32_t *d_idx = NULL;
    pykv_status err = queue_selection(ev, d_qa, rows, pos0, kernel, n_cand, off, kk, total, &block, &d_idx);
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
        err = cuda_copy_d2d(d_keep, d_idx + off[g], (size_t)k * sizeof(int32_t), s);
        if (err == PYKV_OK && probe) err = cuda_upload_staged(d_keep + k, tail, (size_t)probe * sizeof(int32_t), s);
        if (err == PYKV_OK) err = cuda_download_async(d->h_idx + d->h_used, d_idx + off[g], (size_t)k * sizeof(int32_t), s);
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
    cuda_free_async(block, s);
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
