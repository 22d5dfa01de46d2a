// take-score-gpu.c - TAKE's probe for a layer on the GPU: the EMA of its query rows runs there
// (the rows un-rotated and rotated again by the forward pass's RoPE kernel with tables made on
// the host, mixed by cuda_take_ema into a state kept in device memory), and the mixed probe is
// scored by the observation-window kernel (ws_window_run) with each row's causal limit by
// position given per row (and its weight, for FINCH's rows weighted by the entries they see);
// only the per-entry scores come back.
//
// The kernel sums over the rows in double where take_layer_scores sums floats: the scores
// agree to float rounding, so only near-ties can rank differently.
#include "kv/policies/take/take-score.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>
#include <string.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"

void take_ema_free(struct take_ema *e) {
    free(e->q);
    cuda_free(e->d_q[0]);
    cuda_free(e->d_q[1]);
    memset(e, 0, sizeof(*e));
}

pykv_status take_ema_update_device(struct take_ema *e, int32_t rows, int32_t pos0, double alpha,
                                   const struct policy_event *ev, float *d_out) {
    const struct hparams *hp = ev->hp;
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    const size_t width = (size_t)hp->n_head * hp->head_dim, n_rot = (size_t)hp->n_rot;
    PYKV_TRY(cuda_set_device(ev->cache->device));
    if (rows > e->d_cap_rows) {   // both buffers grow (rarely: plain allocations, freed without a stream)
        float *q[2] = { NULL, NULL };   // the kept rows move to the new current one
        pykv_status st = cuda_alloc((void **)&q[0], (size_t)rows * width * sizeof(float), "the TAKE probe");
        if (st == PYKV_OK) st = cuda_alloc((void **)&q[1], (size_t)rows * width * sizeof(float), "the TAKE probe");
        if (st == PYKV_OK && e->rows > 0)
            st = cuda_copy_d2d(q[0], e->d_q[e->d_cur], (size_t)e->rows * width * sizeof(float), s);
        if (st != PYKV_OK) {
            cuda_free(q[0]);
            cuda_free(q[1]);
            return st;
        }
        cuda_free(e->d_q[0]);   // waits for the copy and the work that read them
        cuda_free(e->d_q[1]);
        e->d_q[0] = q[0];
        e->d_q[1] = q[1];
        e->d_cur = 0;
        e->d_cap_rows = rows;
    }
    // the RoPE tables of the rows' positions: undoing (sines negated), then redoing
    float *cs = malloc(2 * (size_t)rows * n_rot * sizeof(float) + 1), *d_cs = NULL;
    if (!cs) return pykv_error(PYKV_ERR_NOMEM, "out of memory for the TAKE probe");
    for (int32_t r = 0; r < rows; r++) {
        take_rope_angles(cs + (size_t)r * n_rot, hp->n_rot, pos0 + r, -1, ev->probe.rope_inv_freq);
        take_rope_angles(cs + ((size_t)rows + r) * n_rot, hp->n_rot, pos0 + r, +1, ev->probe.rope_inv_freq);
    }
    pykv_status st = cuda_alloc_async((void **)&d_cs, 2 * (size_t)rows * n_rot * sizeof(float) + 4, s, "the TAKE probe");
    if (st == PYKV_OK) st = cuda_upload_staged(d_cs, cs, 2 * (size_t)rows * n_rot * sizeof(float), s);
    free(cs);
    if (st == PYKV_OK)
        st = cuda_copy_d2d(d_out, ev->q_device + (size_t)(ev->T - rows) * width, (size_t)rows * width * sizeof(float), s);
    if (st == PYKV_OK) {
        float *next = e->d_q[1 - e->d_cur];
        cuda_timing_mark(s, "policy: probe average");
        cuda_rope(s, d_out, rows, hp->n_head, hp->head_dim, hp->n_rot, d_cs);   // pre-RoPE
        cuda_take_ema(s, d_out, next, e->d_q[e->d_cur], rows, e->rows - rows, (int64_t)width, (float)alpha,
                      (float)(1.0 - alpha));
        cuda_rope(s, d_out, rows, hp->n_head, hp->head_dim, hp->n_rot, d_cs + (size_t)rows * n_rot);
        st = cuda_check("TAKE's probe average on the GPU");
        if (st == PYKV_OK) {
            e->d_cur = 1 - e->d_cur;
            e->rows = rows;
        }
    }
    cuda_free_async(d_cs, s);
    return st;
}

pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int qa_on_device, int32_t rows,
                                     int32_t pos0, const int32_t *n_cols, int32_t kernel,
                                     enum take_row_weight weight, float *scores) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    int32_t *vis = malloc((size_t)rows * hkv * sizeof(int32_t));
    if (!vis) return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring the TAKE probe");
    for (int g = 0; g < hkv; g++) kl.n[g] = n_cols[g];   // the appended probe's own keys are not scored
    take_probe_visible(ev, rows, pos0, n_cols, vis);
    struct cuda_window_args a = { .n_head = hp->n_head, .T = rows, .rows = rows, .protect = 0, .pool = WS_POOL_AVG,
                                  .kernel = kernel, .gqa = WS_GQA_MEAN, .weight_seen = weight == TAKE_ROWS_BY_SEEN };
    a.vis = vis;
    const struct ws_device_run run = { .q = qa_on_device ? NULL : qa, .d_q = qa_on_device ? qa : NULL,
                                       .scores = scores };
    const pykv_status err = ws_window_run(ev->cache, &kl, a, &run);
    free(vis);
    return err;
}

#else

void take_ema_free(struct take_ema *e) {
    free(e->q);
    memset(e, 0, sizeof(*e));
}
static pykv_status no_cuda(void) { return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend"); }
pykv_status take_ema_update_device(struct take_ema *e, int32_t rows, int32_t pos0, double alpha,
                                   const struct policy_event *ev, float *d_out) {
    (void)e; (void)rows; (void)pos0; (void)alpha; (void)ev; (void)d_out;
    return no_cuda();
}
pykv_status take_layer_scores_device(const struct policy_event *ev, const float *qa, int qa_on_device, int32_t rows,
                                     int32_t pos0, const int32_t *n_cols, int32_t kernel,
                                     enum take_row_weight weight, float *scores) {
    (void)ev; (void)qa; (void)qa_on_device; (void)rows; (void)pos0; (void)n_cols; (void)kernel; (void)weight;
    (void)scores;
    return no_cuda();
}

#endif
