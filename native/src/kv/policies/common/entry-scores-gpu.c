// entry-scores-gpu.c - the entry scorers' step for a layer on the GPU (entry-scores.h): the
// device's twin of the scorer (ggml-cuda/entry-scores.cu) scores every list there, the
// device's radix select picks each list's top B, and only the chosen indices come back; the
// lists are then compacted in GPU memory. Nothing of the layer comes down.
#include "kv/policies/common/entry-scores.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"

static int32_t kernel_rule(enum es_device_rule rule) {
    switch (rule) {
    case ES_KNORM: return CUDA_ENTRY_KNORM;
    case ES_KEYDIFF: return CUDA_ENTRY_KEYDIFF;
    case ES_LAGKV: return CUDA_ENTRY_LAGKV;
    default: return 0;
    }
}

pykv_status es_layer_keep_top_device(const struct policy_event *ev, int32_t B, const struct es_device *dev, int *done) {
    *done = 0;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    const struct cuda_entry_args a = { .rule = kernel_rule(dev->rule), .budget = B, .sink = dev->sink, .lag = dev->lag,
                                       .cross = dev->cross };
    if (!cuda_entry_supported(&kl, &a)) return PYKV_OK;   // the host's scorer over a copy of the lists
    *done = 1;
    int any = 0;
    for (int g = 0; g < kl.n_head_kv; g++) any |= kl.n[g] > B;
    if (!any) return PYKV_OK;
    struct ws_device_scores ds;
    PYKV_TRY(ws_device_scores_alloc(ev, 0, cuda_entry_work_bytes(&kl, &a), &ds));   // every entry a candidate
    cuda_timing_mark((cuda_stream)ev->cache->device_stream, "policy: entry scores");
    cuda_entry_scores((cuda_stream)ev->cache->device_stream, &kl, &a, ds.d_scores, ds.d);
    pykv_status err = cuda_check("scoring the KV entries on the GPU");
    int64_t b[CUDA_MAX_KV_HEADS];
    for (int g = 0; g < kl.n_head_kv; g++) b[g] = B;
    if (err == PYKV_OK) err = ws_device_keep_top(&ds, b);   // lists of at most B entries stay as they are
    ws_device_scores_free(&ds);
    return err;
}

#else

pykv_status es_layer_keep_top_device(const struct policy_event *ev, int32_t B, const struct es_device *dev, int *done) {
    (void)ev; (void)B; (void)dev;
    *done = 0;
    return PYKV_OK;
}

#endif
