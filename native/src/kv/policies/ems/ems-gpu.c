// ems-gpu.c - EMS's decode steps on the lists of layers offloaded to a GPU (docs/policies.md#ems):
// the rule of ems-decode.c, with the lists' rows left in device memory. A recorded decode step
// brings every layer's attention sums back at once (their merged entries expanded), and the
// hooks run once it is done; a list's step is then queued here (decode_list: its scores, on
// the host as on the CPU) and done for every list together (after_step), in rounds of three
// waits on the GPU rather than a few per list:
//  1. each list's weakest centre on the host, then one launch for the redundancy of every
//     list's weakest centre to its other centres (ems-redundancy.cu), brought back;
//  2. the most similar centre on the host; for each list that merges, the rows of its two
//     entries brought back (kv-device-batch.h);
//  3. the merges on the host (ems_merge_rows), then in one batch: the merged rows written,
//     the evicted entries dropped (the same row moves as kv_list_drop), the merged-entry
//     blocks sent.
// A list still over its budget after a round (a budget that fell) goes round again, as the
// CPU's loop does. Near-ties aside (R is summed in another order), the kept entries and
// merges are the CPU's.
#include "kv/policies/ems/ems.h"
#include "core/error.h"
#include "kv/kv-device-batch.h"
#include "model/model.h"

#include <stdlib.h>
#include <string.h>

struct ems_pending {
    int32_t          layer, g;
    struct ems_list *s;
    double           sum_glo, sum_loc;   // as ems_decode_list keeps them through its loop
    int64_t          members;
    int32_t          weak, nc, best;     // best: the most similar centre, -1 when none
    int32_t          considered;         // a merge was considered (R computed)
    int64_t          r_at;               // its R at h_r[r_at ..]
    int64_t          rows_at[4];         // where its rows came back: key, value of best, then of weak
};

struct ems_gpu {
    struct ems_pending *pend;
    int32_t             n_pend, cap_pend;
    struct kv_batch     batch;
    void               *h_jobs, *d_jobs;   // pinned / device: the redundancy launch's jobs
    float              *h_r, *d_r;         // pinned / device: its results
    size_t              jobs_cap, r_cap;   // bytes of each
};

pykv_status ems_gpu_decode_list(struct ems_gpu **gp, const struct policy_event *ev, int32_t B, int32_t g,
                                struct ems_list *s, int roll) {
    struct kv_list *l = kv_cache_list(ev->cache, ev->layer, g);
    const int G = ev->hp->n_head / ev->hp->n_head_kv;
    struct ems_pending p = { .layer = ev->layer, .g = g, .s = s, .best = -1 };
    ems_step_scores(s, ev->attn_colsum + (size_t)g * G * ev->attn_colsum_stride, ev->attn_colsum_stride, G, roll,
                    &p.sum_glo, &p.sum_loc);
    if (B <= 0 || l->n <= B) return PYKV_OK;
    if (!*gp) {
        if (!(*gp = calloc(1, sizeof(struct ems_gpu)))) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory");
        kv_batch_init(&(*gp)->batch, ev->cache->device, ev->cache->device_stream);
    }
    struct ems_gpu *e = *gp;
    if (e->n_pend == e->cap_pend) {
        const int32_t cap = e->cap_pend ? 2 * e->cap_pend : 64;
        struct ems_pending *x = realloc(e->pend, (size_t)cap * sizeof(*x));
        if (!x) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory");
        e->pend = x;
        e->cap_pend = cap;
    }
    p.members = ems_member_count(l);
    e->pend[e->n_pend++] = p;
    return PYKV_OK;
}

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"

void ems_gpu_free(struct ems_gpu *e) {
    if (!e) return;
    kv_batch_free(&e->batch);
    cuda_host_free(e->h_jobs);
    cuda_host_free(e->h_r);
    cuda_free(e->d_jobs);
    cuda_free(e->d_r);
    free(e->pend);
    free(e);
}

// Pinned and device buffers of at least `bytes` (contents not kept).
static pykv_status pair_room(void **h, void **d, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return PYKV_OK;
    bytes = bytes > 2 * *cap ? bytes : 2 * *cap;
    cuda_host_free(*h);
    cuda_free(*d);
    *h = *d = NULL;
    *cap = 0;
    PYKV_TRY(cuda_host_alloc(h, bytes));
    PYKV_TRY(cuda_alloc(d, bytes, "EMS's redundancy scores"));
    *cap = bytes;
    return PYKV_OK;
}

// Round step 1: each list's weakest centre, and R of it to every centre where a merge is
// considered (computed on the device, brought back into h_r).
static pykv_status weakest_and_redundancy(struct ems_gpu *e, struct kv_cache *c, const struct ems_opts *o,
                                          int32_t B) {
    int32_t n_jobs = 0, max_nc = 0;
    int64_t r_total = 0;
    for (int32_t i = 0; i < e->n_pend; i++) {
        struct ems_pending *p = &e->pend[i];
        const struct kv_list *l = kv_cache_list(c, p->layer, p->g);
        const int32_t n = l->n, P = o->window < n ? o->window : n;
        p->nc = n - P;
        p->best = -1;
        p->considered = 0;
        if (p->nc < 1) continue;
        p->weak = ems_weakest_centre(p->s, l->pos, p->nc, ems_alignment(p->sum_loc, p->sum_glo));
        p->considered = o->tau < 1.0 && p->members <= (int64_t)o->gamma * B && p->nc > 1;
        if (!p->considered) continue;
        p->r_at = r_total;
        r_total += p->nc;
        max_nc = p->nc > max_nc ? p->nc : max_nc;
        n_jobs++;
    }
    if (n_jobs == 0) return PYKV_OK;
    const cuda_stream s = (cuda_stream)c->device_stream;
    PYKV_TRY(cuda_set_device(c->device));
    PYKV_TRY(pair_room(&e->h_jobs, &e->d_jobs, &e->jobs_cap, (size_t)n_jobs * sizeof(struct cuda_ems_probe)));
    PYKV_TRY(pair_room((void **)&e->h_r, (void **)&e->d_r, &e->r_cap, (size_t)r_total * sizeof(float)));
    struct cuda_ems_probe *jobs = e->h_jobs;
    for (int32_t i = 0, j = 0; i < e->n_pend; i++) {
        const struct ems_pending *p = &e->pend[i];
        if (!p->considered) continue;
        const struct kv_list *l = kv_cache_list(c, p->layer, p->g);
        jobs[j++] = (struct cuda_ems_probe){ .k = l->k, .v = l->v, .weak = p->weak, .nc = p->nc, .out = p->r_at };
    }
    cuda_timing_mark(s, "policy: ems redundancy");
    for (int32_t j0 = 0; j0 < n_jobs; j0 += 65535) {   // the launch's limit on jobs
        const int32_t m = n_jobs - j0 < 65535 ? n_jobs - j0 : 65535;
        PYKV_TRY(cuda_upload_async((struct cuda_ems_probe *)e->d_jobs + j0, jobs + j0, (size_t)m * sizeof(*jobs), s));
        cuda_ems_redundancy(s, (const struct cuda_ems_probe *)e->d_jobs + j0, m, max_nc, c->fmt_k, c->fmt_v,
                            c->head_dim, e->d_r);
    }
    PYKV_TRY(cuda_check("EMS's redundancy on the GPU"));
    PYKV_TRY(cuda_download_async(e->h_r, e->d_r, (size_t)r_total * sizeof(float), s));
    return cuda_stream_sync(s);
}

// Round step 2: the most similar centre, and the rows of the lists that merge brought back.
static pykv_status merge_rows_down(struct ems_gpu *e, struct kv_cache *c, const struct ems_opts *o) {
    const size_t kb = kv_cache_key_bytes(c), vb = kv_cache_value_bytes(c);
    int any = 0;
    for (int32_t i = 0; i < e->n_pend; i++) {
        struct ems_pending *p = &e->pend[i];
        if (!p->considered) continue;
        struct kv_list *l = kv_cache_list(c, p->layer, p->g);
        const float *r = e->h_r + p->r_at;
        const int32_t best = ems_most_similar_pick(r, l->pos, p->nc, p->weak);
        if (best < 0 || !((double)r[best] >= o->tau)) continue;
        p->best = best;
        const int64_t at[4] = { kv_batch_download(&e->batch, &l->k, (int64_t)best * (int64_t)kb, kb),
                                kv_batch_download(&e->batch, &l->v, (int64_t)best * (int64_t)vb, vb),
                                kv_batch_download(&e->batch, &l->k, (int64_t)p->weak * (int64_t)kb, kb),
                                kv_batch_download(&e->batch, &l->v, (int64_t)p->weak * (int64_t)vb, vb) };
        for (int k = 0; k < 4; k++) {
            if (at[k] < 0) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory bringing KV rows to the host");
            p->rows_at[k] = at[k];
        }
        any = 1;
    }
    return any ? kv_batch_run(&e->batch) : PYKV_OK;
}

struct downloaded_rows {
    const struct ems_gpu *e;
    const struct ems_pending *p;
    const struct kv_cache *c;
};

// Entry e (the merge's centre or its source) from the rows brought back.
static const float *downloaded_row(const void *arg, int32_t e, int values, float *tmp) {
    const struct downloaded_rows *r = arg;
    const int64_t at = r->p->rows_at[(e == r->p->best ? 0 : 2) + (values ? 1 : 0)];
    return kv_row_f32(kv_batch_downloaded(&r->e->batch, at), values ? r->c->fmt_v : r->c->fmt_k, r->c->head_dim, tmp);
}

// Round step 3: each list's merge or eviction, its row moves, merged rows and member blocks
// sent in one batch.
static pykv_status merge_or_evict(struct ems_gpu *e, struct kv_cache *c) {
    const int32_t d = c->head_dim;
    for (int32_t i = 0; i < e->n_pend; i++) {
        struct ems_pending *p = &e->pend[i];
        if (p->nc < 1) continue;
        struct kv_list *l = kv_cache_list(c, p->layer, p->g);
        struct ems_list *s = p->s;
        const int32_t P = l->n - p->nc;
        if (p->best >= 0) {   // the sums and the member count stay
            const struct downloaded_rows dr = { e, p, c };
            const struct ems_rows rows = { downloaded_row, &dr };
            float k[PYKV_MAX_HEAD_DIM], v[PYKV_MAX_HEAD_DIM];
            PYKV_TRY(ems_merge_rows(c, l, s, d, p->best, &p->weak, 1, &rows, k, v));
            void *kr = kv_batch_upload(&e->batch, &l->k, (int64_t)p->best * (int64_t)kv_cache_key_bytes(c),
                                       kv_cache_key_bytes(c));
            if (!kr) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory sending a merged entry");
            kv_row_store(kr, c->fmt_k, k, d);
            void *vr = kv_batch_upload(&e->batch, &l->v, (int64_t)p->best * (int64_t)kv_cache_value_bytes(c),
                                       kv_cache_value_bytes(c));
            if (!vr) return pykv_error(PYKV_ERR_NOMEM, "ems: out of memory sending a merged entry");
            kv_row_store(vr, c->fmt_v, v, d);
        } else {
            p->sum_glo -= s->glo[p->weak];
            p->sum_loc -= s->lp[p->weak] + s->lc[p->weak];
            p->members -= ems_members(l, p->weak);
        }
        ems_list_drop(s, p->weak, P);
        PYKV_TRY(kv_list_drop_batched(c, l, p->weak, P, &e->batch));
        PYKV_TRY(kv_list_sync_members_batched(c, l, &e->batch));
    }
    return kv_batch_run(&e->batch);
}

pykv_status ems_gpu_after_step(struct ems_gpu *e, struct kv_cache *c, const struct ems_opts *o, int32_t B,
                               int discard) {
    if (!e || e->n_pend == 0) return PYKV_OK;
    pykv_status st = PYKV_OK;
    while (!discard && st == PYKV_OK && e->n_pend > 0) {
        st = weakest_and_redundancy(e, c, o, B);
        if (st == PYKV_OK) st = merge_rows_down(e, c, o);
        if (st == PYKV_OK) st = merge_or_evict(e, c);
        int32_t left = 0;   // the lists still over the budget go round again
        for (int32_t i = 0; st == PYKV_OK && i < e->n_pend; i++) {
            const struct ems_pending *p = &e->pend[i];
            if (p->nc >= 1 && kv_cache_list(c, p->layer, p->g)->n > B) e->pend[left++] = *p;
        }
        e->n_pend = left;
    }
    e->n_pend = 0;
    return st;
}

#else   // no device lists without CUDA: nothing is ever pending

void ems_gpu_free(struct ems_gpu *e) {
    if (!e) return;
    free(e->pend);
    free(e);
}
pykv_status ems_gpu_after_step(struct ems_gpu *e, struct kv_cache *c, const struct ems_opts *o, int32_t B,
                               int discard) {
    (void)c; (void)o; (void)B; (void)discard;
    if (e) e->n_pend = 0;
    return PYKV_OK;
}

#endif
