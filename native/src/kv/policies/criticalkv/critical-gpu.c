// critical-gpu.c - CriticalKV's value weights for a layer on the GPU (critical.h): the output
// projection, dequantized to floats on the host as for the CPU path, goes up; the device
// weighs every candidate's value where it is stored (ggml-cuda/value-weights.cu), and only the
// weights come back for the two-stage selection on the host.
#include "kv/policies/criticalkv/critical.h"
#include "core/error.h"
#include "model/model.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-device.h"

static size_t aligned(size_t b) { return (b + 255) / 256 * 256; }

pykv_status critical_value_weights_device(const struct policy_event *ev, const struct ws_stats *st, const float *wo,
                                          float *w, int *done) {
    const struct hparams *hp = ev->hp;
    *done = 0;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    struct cuda_vw_args a = { .n_head = hp->n_head, .n_embd = hp->n_embd };
    for (int g = 0; g < st->n_head_kv; g++) a.n_cand[g] = st->n_cand[g];
    if (!cuda_value_weights_supported(&kl, &a)) return PYKV_OK;
    *done = 1;
    if (st->total == 0) return PYKV_OK;
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    const size_t wo_b = aligned((size_t)hp->n_embd * hp->n_head * hp->head_dim * sizeof(float));
    const size_t work_b = aligned(cuda_value_weights_work_bytes(&kl, &a)), w_b = (size_t)st->total * sizeof(float);
    PYKV_TRY(cuda_set_device(ev->cache->device));
    char *d = NULL;
    PYKV_TRY(cuda_alloc_async((void **)&d, wo_b + work_b + w_b, s, "CriticalKV's value weights"));
    a.wo = (const float *)d;
    pykv_status err = cuda_upload_async(d, wo, (size_t)hp->n_embd * hp->n_head * hp->head_dim * sizeof(float), s);
    if (err == PYKV_OK) {
        cuda_value_weights(s, &kl, &a, (float *)(d + wo_b + work_b), d + wo_b);
        err = cuda_check("CriticalKV's value weights on the GPU");
    }
    if (err == PYKV_OK) err = cuda_download_async(w, d + wo_b + work_b, w_b, s);
    cuda_free_async(d, s);
    const pykv_status synced = cuda_stream_sync(s);
    return err != PYKV_OK ? err : synced;
}

#else

pykv_status critical_value_weights_device(const struct policy_event *ev, const struct ws_stats *st, const float *wo,
                                          float *w, int *done) {
    (void)ev; (void)st; (void)wo; (void)w;
    *done = 0;
    return PYKV_OK;
}

#endif
