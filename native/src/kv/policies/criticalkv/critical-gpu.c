// critical-gpu.c - CriticalKV's value weights for a layer on the GPU (critical.h): the layer's
// device copy of the output projection is read as floats (cuda_get_rows, every row), the
// device weighs every candidate's value where it is stored (ggml-cuda/value-weights.cu), and
// only the weights come back for the two-stage selection on the host.
#include "kv/policies/criticalkv/critical.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"
#include "model/offload.h"

pykv_status critical_value_weights_device(const struct policy_event *ev, const struct ws_stats *st, float *w,
                                          int *done) {
    const struct hparams *hp = ev->hp;
    const struct gpu_tensor *wo = ev->wo_device;
    *done = 0;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    struct cuda_vw_args a = { .n_head = hp->n_head, .n_embd = hp->n_embd };
    for (int g = 0; g < st->n_head_kv; g++) a.n_cand[g] = st->n_cand[g];
    if (!wo || !wo->data || wo->ne[0] != (int64_t)hp->n_head * hp->head_dim || wo->ne[1] != hp->n_embd ||
        !cuda_value_weights_supported(&kl, &a))
        return PYKV_OK;
    *done = 1;
    if (st->total == 0) return PYKV_OK;
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    const size_t wo_b = cuda_align((size_t)wo->ne[0] * (size_t)wo->ne[1] * sizeof(float));
    const size_t ids_b = cuda_align((size_t)hp->n_embd * sizeof(int32_t));
    const size_t work_b = cuda_align(cuda_value_weights_work_bytes(&kl, &a)), w_b = (size_t)st->total * sizeof(float);
    int32_t *ids = malloc((size_t)hp->n_embd * sizeof(int32_t));
    if (!ids) return pykv_error(PYKV_ERR_NOMEM, "out of memory weighing the values of layer %d", ev->layer);
    for (int32_t r = 0; r < hp->n_embd; r++) ids[r] = r;
    pykv_status err = cuda_set_device(ev->cache->device);
    char *d = NULL;
    if (err == PYKV_OK) err = cuda_alloc_async((void **)&d, wo_b + ids_b + work_b + w_b, s, "CriticalKV's value weights");
    if (err == PYKV_OK) err = cuda_upload_async(d + wo_b, ids, (size_t)hp->n_embd * sizeof(int32_t), s);
    if (err == PYKV_OK) {   // W_o as floats, every row
        cuda_timing_mark(s, "policy: value weights");
        cuda_get_rows(s, (float *)d, wo->data, wo->type, wo->ne[0], (const int32_t *)(d + wo_b), hp->n_embd);
        a.wo = (const float *)d;
        cuda_value_weights(s, &kl, &a, (float *)(d + wo_b + ids_b + work_b), d + wo_b + ids_b);
        err = cuda_check("CriticalKV's value weights on the GPU");
    }
    if (err == PYKV_OK) err = cuda_download_async(w, d + wo_b + ids_b + work_b, w_b, s);
    if (d) cuda_free_async(d, s);
    free(ids);
    const pykv_status synced = cuda_stream_sync(s);
    return err != PYKV_OK ? err : synced;
}

#else

pykv_status critical_value_weights_device(const struct policy_event *ev, const struct ws_stats *st, float *w,
                                          int *done) {
    (void)ev; (void)st; (void)w;
    *done = 0;
    return PYKV_OK;
}

#endif
