// kvzip-gpu.c - KVzip's reconstruction pass for a layer on the GPU (kvzip.h): the pass's
// restricted softmax runs over the lists in place (ggml-cuda/kvzip-pass.cu) and only each
// query head's best weights of the chunk's entries come back; no query or key comes down.
#include "kv/policies/kvzip/kvzip.h"
#include "core/error.h"
#include "model/model.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"

pykv_status kvzip_pass_device(const struct policy_event *ev, const int32_t *sink, const int32_t *c0,
                              const int32_t *self0, int32_t width, float *best, int *done) {
    const struct hparams *hp = ev->hp;
    *done = 0;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    struct cuda_kvzip_args a = { .n_head = hp->n_head, .T = ev->T, .width = width };
    for (int g = 0; g < hp->n_head_kv; g++) {
        a.sink[g] = sink[g];
        a.c0[g] = c0[g];
        a.self0[g] = self0[g];
    }
    if (!cuda_kvzip_pass_supported(&kl, &a)) return PYKV_OK;
    *done = 1;
    if (width == 0) return PYKV_OK;
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    const size_t bytes = (size_t)hp->n_head * width * sizeof(float);
    PYKV_TRY(cuda_set_device(ev->cache->device));
    float *d = NULL;
    PYKV_TRY(cuda_alloc_async((void **)&d, bytes, s, "KVzip's pass"));
    cuda_timing_mark(s, "policy: kvzip pass");
    cuda_kvzip_pass(s, &kl, ev->q_device, &a, d);
    pykv_status err = cuda_check("KVzip's pass on the GPU");
    if (err == PYKV_OK) err = cuda_download_async(best, d, bytes, s);
    cuda_free_async(d, s);
    const pykv_status synced = cuda_stream_sync(s);
    return err != PYKV_OK ? err : synced;
}

#else

pykv_status kvzip_pass_device(const struct policy_event *ev, const int32_t *sink, const int32_t *c0,
                              const int32_t *self0, int32_t width, float *best, int *done) {
    (void)ev; (void)sink; (void)c0; (void)self0; (void)width; (void)best;
    *done = 0;
    return PYKV_OK;
}

#endif
