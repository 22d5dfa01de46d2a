// ems-gpu-prefill.c - EMS at the end of a prefill call on the lists of a layer offloaded to a
// GPU (docs/policies.md#ems): the rule of ems-prefill.c with the rows left in device memory.
// Merged entries left by an earlier prompt take part as on the CPU: their stored rows (the
// unit direction and mean value) in R, their member norms and weights (host memory) in the
// merges and the member cap. Per layer, three waits:
//  1. each list's partition on the host (ems_partition: the scores are host arrays), then
//     one launch for every TBM entry of every list: its most similar centre and R
//     (cuda_ems_most_similar, against the centres' original rows), brought back;
//  2. the rows that may merge (each TBM entry with R >= tau, and its centre) brought down in
//     one batch (kv-device-batch.h), a few times the budget instead of the whole list;
//  3. the merges on the host (ems_prefill_merge, ems_merge_rows), the merged rows sent up in
//     one batch; then each list keeps its centres and window (kv_list_retain: a gather on
//     the device) and its merged-entry block goes up.
// Near-ties aside (R's dots are summed in another order), the kept entries and merges are the
// CPU's.
#include "kv/policies/ems/ems.h"
#include "core/error.h"
#include "kv/kv-device-batch.h"
#include "model/model.h"

#include <stdlib.h>
#include <string.h>

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"

// Step 1: best and r of every list's TBM entries, from the device.
static pykv_status most_similar(struct kv_cache *c, int layer, struct ems_partition *pt, int64_t n_jobs) {
    const int hkv = c->n_head_kv;
    const cuda_stream s = (cuda_stream)c->device_stream;
    int64_t n_cent = 0;
    for (int g = 0; g < hkv; g++) if (pt[g].order) n_cent += pt[g].n_imp;
    const size_t jobs_b = (size_t)n_jobs * sizeof(struct cuda_ems_probe), cent_b = (size_t)n_cent * sizeof(int32_t);
    const size_t out_b = (size_t)n_jobs * (sizeof(int32_t) + sizeof(float));
    struct cuda_ems_probe *jobs = malloc(jobs_b);
    char *out = malloc(out_b);
    char *d = NULL;
    pykv_status st = jobs && out ? cuda_set_device(c->device) : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory");
    if (st == PYKV_OK) st = cuda_alloc_async((void **)&d, jobs_b + cent_b + out_b, s, "EMS's most similar centres");
    if (st != PYKV_OK) {
        free(jobs);
        free(out);
        return st;
    }
    int32_t *d_cent = (int32_t *)(d + jobs_b);
    int32_t *d_best = (int32_t *)(d + jobs_b + cent_b);
    float *d_r = (float *)(d_best + n_jobs);
    int64_t j = 0, at = 0;
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        if (!pt[g].order || pt[g].n_tbm == 0) continue;
        const struct kv_list *l = kv_cache_list(c, layer, g);
        st = cuda_upload_async(d_cent + at, pt[g].order, (size_t)pt[g].n_imp * sizeof(int32_t), s);
        for (int32_t t = 0; t < pt[g].n_tbm; t++, j++)
            jobs[j] = (struct cuda_ems_probe){ .k = l->k, .v = l->v, .centre = d_cent + at,
                                               .weak = pt[g].order[pt[g].n_imp + t], .nc = pt[g].n_imp, .out = j };
        at += pt[g].n_imp;
    }
    if (st == PYKV_OK) st = cuda_upload_async(d, jobs, jobs_b, s);
    if (st == PYKV_OK) {
        cuda_timing_mark(s, "policy: ems merge");
        cuda_ems_most_similar(s, (const struct cuda_ems_probe *)d, (int32_t)n_jobs, c->fmt_k, c->fmt_v, c->head_dim,
                              d_best, d_r);
        st = cuda_check("EMS's most similar centres on the GPU");
    }
    if (st == PYKV_OK) st = cuda_download_async(out, d_best, out_b, s);
    cuda_free_async(d, s);
    const pykv_status synced = cuda_stream_sync(s);
    if (st == PYKV_OK) st = synced;
    const int32_t *best = (const int32_t *)out;
    const float *r = (const float *)(best + n_jobs);
    for (int g = 0, k = 0; g < hkv && st == PYKV_OK; g++) {
        if (!pt[g].order || pt[g].n_tbm == 0) continue;
        memcpy(pt[g].best, best + k, (size_t)pt[g].n_tbm * sizeof(int32_t));
        memcpy(pt[g].r, r + k, (size_t)pt[g].n_tbm * sizeof(float));
        k += pt[g].n_tbm;
    }
    free(jobs);
    free(out);
    return st;
}

// A list's rows that came down: entry e's key at at[2 e], its value at at[2 e + 1] (-1: not
// brought).
struct list_rows {
    struct kv_cache *c;
    struct kv_list  *l;
    struct ems_list *s;
    struct kv_batch *b;
    int64_t         *at;
};

static pykv_status bring_row(struct list_rows *lr, int32_t e) {
    if (lr->at[2 * e] >= 0) return PYKV_OK;
    const size_t kb = kv_cache_key_bytes(lr->c), vb = kv_cache_value_bytes(lr->c);
    lr->at[2 * e] = kv_batch_download(lr->b, &lr->l->k, (int64_t)e * (int64_t)kb, kb);
    lr->at[2 * e + 1] = kv_batch_download(lr->b, &lr->l->v, (int64_t)e * (int64_t)vb, vb);
    return lr->at[2 * e] >= 0 && lr->at[2 * e + 1] >= 0 ? PYKV_OK
         : pykv_error(PYKV_ERR_NOMEM, "ems: out of memory bringing KV rows to the host");
}

static const float *brought_row(const void *arg, int32_t e, int values, float *tmp) {
    const struct list_rows *lr = arg;
    return kv_row_f32(kv_batch_downloaded(lr->b, lr->at[2 * e + (values ? 1 : 0)]),
                      values ? lr->c->fmt_v : lr->c->fmt_k, lr->c->head_dim, tmp);
}

// Merges entries src into centre c from the rows brought down, and queues the centre's new
// rows to go up.
static pykv_status merge_brought(void *arg, int32_t c, const int32_t *src, int32_t n_src) {
    struct list_rows *lr = arg;
    const struct ems_rows rows = { brought_row, lr };
    const int32_t d = lr->c->head_dim;
    float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM];
    PYKV_TRY(ems_merge_rows(lr->c, lr->l, lr->s, d, c, src, n_src, &rows, k, v));
    const size_t kb = kv_cache_key_bytes(lr->c), vb = kv_cache_value_bytes(lr->c);
    void *kr = kv_batch_upload(lr->b, &lr->l->k, (int64_t)c * (int64_t)kb, kb);   // valid until the next call
    if (!kr) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory sending a merged entry");
    kv_row_store(kr, lr->c->fmt_k, k, d);
    void *vr = kv_batch_upload(lr->b, &lr->l->v, (int64_t)c * (int64_t)vb, vb);
    if (!vr) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory sending a merged entry");
    kv_row_store(vr, lr->c->fmt_v, v, d);
    return PYKV_OK;
}

pykv_status ems_gpu_prefill_layer(const struct policy_event *ev, const struct ems_opts *o, int32_t B,
                                  struct ems_list *lists, float *const *loc) {
    struct kv_cache *c = ev->cache;
    const int hkv = c->n_head_kv;
    struct ems_partition pt[CUDA_MAX_KV_HEADS];
    struct list_rows lr[CUDA_MAX_KV_HEADS];
    memset(pt, 0, sizeof(pt));
    memset(lr, 0, sizeof(lr));
    struct kv_batch b;
    kv_batch_init(&b, c->device, c->device_stream);
    pykv_status st = PYKV_OK;
    int64_t n_jobs = 0;
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        st = ems_partition(o, B, kv_cache_list(c, ev->layer, g), &lists[g], loc[g], &pt[g]);
        if (st == PYKV_OK && pt[g].order && o->tau < 1.0) n_jobs += pt[g].n_tbm;
    }
    if (st == PYKV_OK && n_jobs > 0) st = most_similar(c, ev->layer, pt, n_jobs);
    // the rows of the entries that may merge (R >= tau) and of their centres, in one batch
    int brought = 0;
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        struct kv_list *l = kv_cache_list(c, ev->layer, g);
        lr[g] = (struct list_rows){ c, l, &lists[g], &b, NULL };
        if (!pt[g].order) continue;
        if (!(lr[g].at = malloc((size_t)l->n * 2 * sizeof(int64_t)))) {
            st = pykv_error(PYKV_ERR_NOMEM, "ems: out of memory");
            break;
        }
        for (int32_t j = 0; j < 2 * l->n; j++) lr[g].at[j] = -1;
        for (int32_t t = 0; t < pt[g].n_tbm && st == PYKV_OK; t++) {
            if (pt[g].best[t] < 0 || !((double)pt[g].r[t] >= o->tau)) continue;
            st = bring_row(&lr[g], pt[g].order[pt[g].n_imp + t]);
            if (st == PYKV_OK) st = bring_row(&lr[g], pt[g].best[t]);
            brought = 1;
        }
    }
    if (st == PYKV_OK && brought) st = kv_batch_run(&b);
    // the merges, whose rows go up in one batch (queuing uploads leaves the rows brought down
    // in place: kv-device-batch.h grows its download room only for downloads)
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        if (!pt[g].order) continue;
        const struct ems_merger m = { merge_brought, &lr[g] };
        st = ems_prefill_merge(lr[g].l, o, B, &pt[g], &m);
    }
    if (st == PYKV_OK) st = kv_batch_run(&b);
    for (int g = 0; g < hkv && st == PYKV_OK; g++) {
        if (!pt[g].order) continue;
        st = ems_prefill_keep(c, lr[g].l, &lists[g], &pt[g]);
        if (st == PYKV_OK) st = kv_list_sync_members(c, lr[g].l);
    }
    for (int g = 0; g < hkv; g++) {
        ems_partition_free(&pt[g]);
        free(lr[g].at);
    }
    kv_batch_free(&b);
    return st;
}

#else   // no device lists without CUDA

pykv_status ems_gpu_prefill_layer(const struct policy_event *ev, const struct ems_opts *o, int32_t B,
                                  struct ems_list *lists, float *const *loc) {
    (void)ev; (void)o; (void)B; (void)lists; (void)loc;
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}

#endif
