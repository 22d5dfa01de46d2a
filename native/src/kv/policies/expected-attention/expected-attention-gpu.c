// expected-attention-gpu.c - Expected Attention's step at the end of a prefill call for a layer
// on the GPU: the future queries from the statistics on the host (ea_future_query, as on the
// CPU), sent up; the logits, softmax, group means and value norms over the lists in place
// (ggml-cuda/expected-attention.cu); the device's radix select of each list's top B (the
// sinks score +inf, so they stay); only the chosen indices come back. No key or value of the
// layer comes down.
#include "kv/policies/expected-attention/expected-attention.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-device.h"

static size_t aligned(size_t b) { return (b + 255) / 256 * 256; }

pykv_status ea_compress_layer_device(struct expected_attention *p, const struct policy_event *ev, int32_t B, int *done) {
    const struct hparams *hp = ev->hp;
    const int hkv = hp->n_head_kv, d = p->d;
    *done = 0;
    struct cuda_kv_layer kl;
    kv_device_layer(ev->cache, ev->layer, NULL, &kl);
    struct cuda_ea_args a = { .n_head = hp->n_head, .use_vnorm = p->use_vnorm, .epsilon = p->epsilon };
    if (!cuda_ea_supported(&kl, &a)) return PYKV_OK;
    *done = 1;
    for (int g = 0; g < hkv; g++) a.first[g] = ea_first_past_sinks(kv_cache_list(ev->cache, ev->layer, g), p->sink);
    // the future queries, in one host block: m (n_head, d), then A (n_head, d, d) with use_covariance
    const size_t m_n = (size_t)hp->n_head * d, a_n = p->use_cov ? m_n * d : 0;
    float *host = malloc((m_n + a_n) * sizeof(float));
    double *dm = malloc((size_t)d * (d + 1) * sizeof(double));
    if (!host || !dm) {
        free(host); free(dm);
        return pykv_error(PYKV_ERR_NOMEM, "out of memory scoring layer %d (expected_attention)", ev->layer);
    }
    double cos_avg[PYKV_MAX_HEAD_DIM / 2], sin_avg[PYKV_MAX_HEAD_DIM / 2];
    ea_average_rotation(ev->probe.rope_inv_freq, hp->n_rot, ev->n_past_end, p->n_future, cos_avg, sin_avg);
    for (int hq = 0; hq < hp->n_head; hq++)
        ea_future_query(p, &p->stats[ev->layer], hp->n_rot, cos_avg, sin_avg, hq, host + (size_t)hq * d,
                        p->use_cov ? host + m_n + (size_t)hq * d * d : NULL, dm, dm + d);
    free(dm);
    const size_t z_b = aligned(cuda_ea_work_bytes(&kl, &a)), up_b = (m_n + a_n) * sizeof(float);
    struct ws_device_scores ds;
    pykv_status st = ws_device_scores_alloc(ev, 0, z_b + up_b, &ds);   // every entry a candidate
    if (st != PYKV_OK) {
        free(host);
        return st;
    }
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    float *d_up = (float *)((char *)ds.d + z_b);
    a.m = d_up;
    a.A = p->use_cov ? d_up + m_n : NULL;
    st = cuda_upload_async(d_up, host, up_b, s);
    if (st == PYKV_OK) {
        cuda_ea_scores(s, &kl, &a, ds.d_scores, ds.d);
        st = cuda_check("expected_attention's scores on the GPU");
    }
    int64_t b[CUDA_MAX_KV_HEADS];
    for (int g = 0; g < hkv; g++) b[g] = B;
    if (st == PYKV_OK) st = ws_device_keep_top(&ds, b);   // lists of at most B entries stay as they are
    ws_device_scores_free(&ds);
    free(host);
    return st;
}

#else

pykv_status ea_compress_layer_device(struct expected_attention *p, const struct policy_event *ev, int32_t B, int *done) {
    (void)p; (void)ev; (void)B;
    *done = 0;
    return PYKV_OK;
}

#endif
