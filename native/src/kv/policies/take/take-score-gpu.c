// take-score-gpu.c - TAKE's probe scores for a layer on the GPU: the probe's query rows come
// down to the host (ws_query_rows; the EMA runs there, on rows * n_head * head_dim floats), and
// the mixed probe goes up to be scored by the observation-window kernel (ggml-cuda/window-scores.cu) with each
// row's causal limit by position given per row (and its weight, for FINCH's rows weighted by
// the entries they see); the per-entry scores come back.
//
// The kernel sums over the rows in double where take_layer_scores sums floats: the scores
// agree to float rounding, so only near-ties can rank differently.
#include "kv/policies/take/take-score.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-device.h"

pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int32_t rows, int32_t pos0,
                                     const int32_t *n_cols, int32_t kernel, enum take_row_weight weight,
                                     float *scores) {
    const struct kv_cache *c = ev->cache;
    const struct hparams *hp = ev->hp;
    const cuda_stream s = (cuda_stream)c->device_stream;
    const int hkv = hp->n_head_kv;
    struct cuda_kv_layer kl;
    kv_device_layer(c, ev->layer, NULL, &kl);
    int32_t *vis = malloc((size_t)rows * hkv * sizeof(int32_t));
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe");
    int64_t total = 0;
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        kl.n[g] = n_cols[g];   // the appended probe's own keys are not scored
        total += n_cols[g];
        int32_t v = n_cols[g];
        for (int32_t r = rows - 1; r >= 0; r--) {   // causal by position, as score_head
            while (v > 0 && l->pos[v - 1] > pos0 + r) v--;
            vis[(size_t)r * hkv + g] = v;
        }
    }
    struct cuda_window_args a = { .n_head = hp->n_head, .T = rows, .rows = rows, .protect = 0, .pool = WS_POOL_AVG,
                                  .kernel = kernel, .gqa = WS_GQA_MEAN, .weight_seen = weight == TAKE_ROWS_BY_SEEN };
    a.vis = vis;   // the size of the work does not depend on where vis is
    const size_t work = (cuda_window_work_bytes(&kl, &a) + 255) / 256 * 256;
    const size_t q_bytes = ((size_t)rows * hp->n_head * hp->head_dim * sizeof(float) + 255) / 256 * 256;
    const size_t vis_bytes = ((size_t)rows * hkv * sizeof(int32_t) + 255) / 256 * 256;
    if (total == 0) {
        free(vis);
        return PYKV_OK;
    }
    if (work == 0) {
        free(vis);
        return pykv_error(PYKV_ERR_INTERNAL, "the GPU cannot score layer %d's TAKE probe (%d rows)", ev->layer, rows);
    }
    pykv_status err = cuda_set_device(c->device);
    char *d = NULL;
    if (err == PYKV_OK)
        err = cuda_alloc_async((void **)&d, work + q_bytes + vis_bytes + (size_t)total * sizeof(float), s,
                               "the TAKE probe's scores");
    if (err == PYKV_OK) {
        float *d_q = (float *)(d + work), *d_scores = (float *)(d + work + q_bytes + vis_bytes);
        a.vis = (const int32_t *)(d + work + q_bytes);
        err = cuda_upload_async(d_q, qa, (size_t)rows * hp->n_head * hp->head_dim * sizeof(float), s);
        if (err == PYKV_OK) err = cuda_upload_async((void *)a.vis, vis, (size_t)rows * hkv * sizeof(int32_t), s);
        if (err == PYKV_OK) {
            cuda_window_scores(s, &kl, d_q, &a, d_scores, NULL, NULL, d);
            err = cuda_check("scoring the TAKE probe on the GPU");
        }
        if (err == PYKV_OK) err = cuda_download_async(scores, d_scores, (size_t)total * sizeof(float), s);
        cuda_free_async(d, s);
        const pykv_status done = cuda_stream_sync(s);
        if (err == PYKV_OK) err = done;
    }
    free(vis);
    return err;
}

#else

pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int32_t rows, int32_t pos0,
                                     const int32_t *n_cols, int32_t kernel, enum take_row_weight weight,
                                     float *scores) {
    (void)ev; (void)qa; (void)rows; (void)pos0; (void)n_cols; (void)kernel; (void)weight; (void)scores;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}

#endif
