// expected-attention-gpu.c - Expected Attention on a layer on the GPU: each chunk's queries are
// merged into the layer's statistics in device memory (ggml-cuda/expected-attention.cu, the
// twin of stats_head); at the end of a prefill call the statistics come down, the future
// queries are made from them on the host (ea_future_query, as on the CPU) and sent up; the
// logits, softmax, group means and value norms run over the lists in place; the device's
// radix select picks each list's top B (the sinks score +inf, so they stay) and only the
// chosen indices come back. No query, key or value of the layer comes down.
#include "kv/policies/expected-attention/expected-attention.h"
#include "kv/policies/common/window-scores.h"
#include "core/error.h"
#include "model/model.h"

#include <stdlib.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-device.h"

static size_t stats_bytes(const struct expected_attention *p) {
    return (size_t)p->n_head * p->d * (p->d + 1) * sizeof(double);   // mean, then m2
}

pykv_status ea_add_chunk_device(struct expected_attention *p, const struct policy_event *ev) {
    struct ea_stats *st = &p->stats[ev->layer];
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    PYKV_TRY(cuda_set_device(ev->cache->device));
    if (!st->d_stats || ev->is_first_chunk) {   // a call starts its statistics afresh
        if (!st->d_stats) PYKV_TRY(cuda_alloc(&st->d_stats, stats_bytes(p), "expected_attention's query statistics"));
        PYKV_TRY(cuda_memset(st->d_stats, 0, stats_bytes(p), s));
    }
    const int n_rot = ev->hp->n_rot;
    int32_t t0, rows;
    float *cs;
    PYKV_TRY(ea_chunk_rows(p, ev, &t0, &rows, &cs));
    if (rows <= 0) return PYKV_OK;
    const size_t cs_b = cuda_align((size_t)rows * (n_rot ? n_rot : 1) * sizeof(float));
    struct cuda_ea_chunk c = { .n_head = p->n_head, .d = p->d, .n_rot = n_rot, .t0 = t0, .rows = rows,
                               .count = st->count };
    char *d = NULL;
    pykv_status err = cuda_alloc_async((void **)&d, cs_b + cuda_ea_chunk_work_bytes(&c), s,
                                       "expected_attention's query statistics");
    if (err == PYKV_OK) err = cuda_upload_async(d, cs, (size_t)rows * n_rot * sizeof(float), s);
    if (err == PYKV_OK) {
        c.cs = (const float *)d;
        double *mean = st->d_stats, *m2 = mean + (size_t)p->n_head * p->d;
        cuda_timing_mark(s, "policy: query statistics");
        cuda_ea_stats_chunk(s, ev->q_device, &c, mean, m2, d + cs_b);
        err = cuda_check("expected_attention's query statistics on the GPU");
    }
    if (d) cuda_free_async(d, s);
    free(cs);
    if (err == PYKV_OK) st->count += rows;
    return err;
}

pykv_status ea_stats_download(struct expected_attention *p, const struct policy_event *ev) {
    struct ea_stats *st = &p->stats[ev->layer];
    if (!st->d_stats) return PYKV_OK;   // no row counted yet: the host's zeros stand
    const cuda_stream s = (cuda_stream)ev->cache->device_stream;
    const size_t n_mean = (size_t)p->n_head * p->d;
    PYKV_TRY(cuda_download_async(st->mean, st->d_stats, n_mean * sizeof(double), s));
    PYKV_TRY(cuda_download_async(st->m2, (double *)st->d_stats + n_mean, n_mean * p->d * sizeof(double), s));
    return cuda_stream_sync(s);
}

void ea_stats_device_free(struct ea_stats *st) {
    cuda_free(st->d_stats);   // waits for the work queued with it (the context's stream may be gone)
    st->d_stats = NULL;
}

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
    const size_t z_b = cuda_align(cuda_ea_work_bytes(&kl, &a)), up_b = (m_n + a_n) * sizeof(float);
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
        cuda_timing_mark(s, "policy: expected attention");
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

pykv_status ea_add_chunk_device(struct expected_attention *p, const struct policy_event *ev) {
    (void)p; (void)ev;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status ea_stats_download(struct expected_attention *p, const struct policy_event *ev) {
    (void)p; (void)ev;
    return PYKV_OK;
}
void ea_stats_device_free(struct ea_stats *st) { (void)st; }

pykv_status ea_compress_layer_device(struct expected_attention *p, const struct policy_event *ev, int32_t B, int *done) {
    (void)p; (void)ev; (void)B;
    *done = 0;
    return PYKV_OK;
}

#endif
