// take-score-gpu.c - TAKE's probe scores for a layer on the GPU: the probe's query rows come
// down to the host (ws_query_rows; the EMA runs there, on rows * n_head * head_dim floats), and
// the mixed probe goes up to be scored by the observation-window kernel (ws_window_run) with
// each row's causal limit by position given per row (and its weight, for FINCH's rows weighted
// by the entries they see); the per-entry scores come back.
//
// The kernel sums over the rows in double where take_layer_scores sums floats: the scores
// agree to float rounding, so only near-ties can rank differently.
#include "kv/policies/take/take-score.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>

#ifdef PYKV_CUDA
#include "kv/kv-device.h"

pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int32_t rows, int32_t pos0,
                                     const int32_t *n_cols, int32_t kernel, enum take_row_weight weight,
                                     float *scores) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    int32_t *vis = malloc((size_t)rows * hkv * sizeof(int32_t));
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe");
    for (int g = 0; g < hkv; g++) {
        const struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
        kl.n[g] = n_cols[g];   // the appended probe's own keys are not scored
        int32_t v = n_cols[g];
        for (int32_t r = rows - 1; r >= 0; r--) {   // causal by position, as score_head
            while (v > 0 && l->pos[v - 1] > pos0 + r) v--;
            vis[(size_t)r * hkv + g] = v;
        }
    }
    struct cuda_window_args a = { .n_head = hp->n_head, .T = rows, .rows = rows, .protect = 0, .pool = WS_POOL_AVG,
                                  .kernel = kernel, .gqa = WS_GQA_MEAN, .weight_seen = weight == TAKE_ROWS_BY_SEEN };
    a.vis = vis;
    const struct ws_device_run run = { .q = qa, .scores = scores };
    const pykv_status err = ws_window_run(ev->cache, &kl, a, &run);
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
