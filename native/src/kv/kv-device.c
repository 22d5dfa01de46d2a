// kv-device.c - device memory for offloaded KV lists (kv-device.h).
#include "kv/kv-device.h"
#include "core/error.h"

#ifdef PYKV_CUDA
#include "ggml-cuda/device.h"
#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/timing.h"
#include "kv/kv-cache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

// ---- held-back row moves (kv_device_hold_moves) ----

#define HELD_STREAMS 16

struct held_moves {
    int                     used;
    void                   *s;          // the stream
    struct cuda_list_moves *jobs;       // one per buffer (no two share one)
    int32_t                 n, cap;
    void                  **bases;      // open addressing, 2 * cap slots: the buffers of jobs
    pykv_status             err;        // of a send made where no status could be returned
};

static struct held_moves g_held[HELD_STREAMS];
static pthread_mutex_t g_held_lock = PTHREAD_MUTEX_INITIALIZER;

static struct held_moves *held_of(void *s) {
    for (int i = 0; i < HELD_STREAMS; i++)
        if (g_held[i].used && g_held[i].s == s) return &g_held[i];
    return NULL;
}

// Sends what h holds: the jobs staged through pinned memory, one launch.
static pykv_status send_held(struct held_moves *h) {
    if (h->n == 0) return PYKV_OK;
    const cuda_stream st = (cuda_stream)h->s;
    const size_t bytes = (size_t)h->n * sizeof(struct cuda_list_moves);
    void *d_jobs = NULL;
    pykv_status err = cuda_alloc_async(&d_jobs, bytes, st, "the KV cache's row moves");
    if (err == PYKV_OK) err = cuda_upload_staged(d_jobs, h->jobs, bytes, st);
    if (err == PYKV_OK) {
        cuda_timing_mark(st, "kv compaction");
        cuda_move_rows_many(st, (const struct cuda_list_moves *)d_jobs, h->n);
        err = cuda_check("moving KV entries on the GPU");
    }
    cuda_free_async(d_jobs, st);
    h->n = 0;
    if (h->bases) memset(h->bases, 0, 2 * (size_t)h->cap * sizeof(void *));
    return err;
}

// The slot of base in h->bases: where it is, or the empty one where it would go.
static size_t base_slot(const struct held_moves *h, const void *base) {
    const size_t mask = 2 * (size_t)h->cap - 1;   // cap is a power of two
    size_t i = (size_t)(((uintptr_t)base >> 4) * 0x9E3779B97F4A7C15ull >> 20) & mask;
    while (h->bases[i] && h->bases[i] != base) i = (i + 1) & mask;
    return i;
}

// Before any other work on the lists of stream s: what is held goes first.
pykv_status kv_device_flush_moves(void *s) {
    pthread_mutex_lock(&g_held_lock);
    struct held_moves *h = held_of(s);
    const pykv_status err = h ? send_held(h) : PYKV_OK;
    pthread_mutex_unlock(&g_held_lock);
    return err;
}

void kv_device_hold_moves(void *s) {
    pthread_mutex_lock(&g_held_lock);
    for (int i = 0; !held_of(s) && i < HELD_STREAMS; i++)   // no free slot: the moves go as they come
        if (!g_held[i].used) {
            memset(&g_held[i], 0, sizeof(g_held[i]));
            g_held[i].used = 1;
            g_held[i].s = s;
        }
    pthread_mutex_unlock(&g_held_lock);
}

pykv_status kv_device_send_moves(void *s) {
    pthread_mutex_lock(&g_held_lock);
    struct held_moves *h = held_of(s);
    pykv_status err = PYKV_OK;
    if (h) {
        err = send_held(h);
        if (h->err != PYKV_OK && err == PYKV_OK) err = h->err;
        free(h->jobs);
        free(h->bases);
        memset(h, 0, sizeof(*h));
    }
    pthread_mutex_unlock(&g_held_lock);
    return err;
}

// Queues the moves of d_base if s holds moves (1), after sending what was held for the same
// buffer; 0 when they are to be launched now.
static int hold(void *s, void *d_base, size_t row_bytes, const struct cuda_row_moves *m, pykv_status *err) {
    pthread_mutex_lock(&g_held_lock);
    struct held_moves *h = held_of(s);
    int held = 0;
    *err = PYKV_OK;
    if (h) {
        if (h->n > 0 && h->bases[base_slot(h, d_base)]) *err = send_held(h);   // the buffer's earlier moves first
        if (*err == PYKV_OK && h->n == h->cap) {
            const int32_t cap = h->cap ? 2 * h->cap : 64;
            struct cuda_list_moves *jobs = realloc(h->jobs, (size_t)cap * sizeof(*jobs));
            void **bases = jobs ? calloc(2 * (size_t)cap, sizeof(void *)) : NULL;
            if (jobs) h->jobs = jobs;
            if (bases) {
                free(h->bases);
                h->bases = bases;
                h->cap = cap;
                for (int32_t i = 0; i < h->n; i++) h->bases[base_slot(h, h->jobs[i].base)] = h->jobs[i].base;
            } else {
                *err = send_held(h);   // out of host memory: these go now, alone
            }
        }
        if (*err == PYKV_OK && h->n < h->cap) {
            h->jobs[h->n++] = (struct cuda_list_moves){ .base = d_base, .row_bytes = (int64_t)row_bytes, .m = *m };
            h->bases[base_slot(h, d_base)] = d_base;
            held = 1;
        }
    }
    pthread_mutex_unlock(&g_held_lock);
    return held;
}

// Stream-ordered on the context's stream: the copy and the free come after the kernels queued
// there that read the old buffer, the kernels queued after them see the new one, and nothing
// waits on the host.
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes) {
    const cuda_stream st = (cuda_stream)s;
    PYKV_TRY(cuda_set_device(device));   // the thread growing the list may not have chosen it
    PYKV_TRY(kv_device_flush_moves(s));
    if (new_bytes == 0) {
        cuda_free_async(*p, st);
        *p = NULL;
        return PYKV_OK;
    }
    cuda_timing_mark(st, "kv list growth");
    void *q = NULL;
    PYKV_TRY(cuda_alloc_async(&q, new_bytes, st, "the KV cache"));
    const size_t keep = old_bytes < new_bytes ? old_bytes : new_bytes;
    if (*p && keep) {
        const pykv_status err = cuda_copy_d2d(q, *p, keep, st);
        if (err != PYKV_OK) {
            cuda_free_async(q, st);
            return err;
        }
    }
    cuda_free_async(*p, st);
    *p = q;
    return PYKV_OK;
}

pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes) {
    PYKV_TRY(kv_device_flush_moves(s));
    PYKV_TRY(cuda_download_async(dst, d_src, bytes, (cuda_stream)s));
    return cuda_stream_sync((cuda_stream)s);
}
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes) {
    PYKV_TRY(kv_device_flush_moves(s));
    PYKV_TRY(cuda_upload_async(d_dst, src, bytes, (cuda_stream)s));
    return cuda_stream_sync((cuda_stream)s);
}

pykv_status kv_device_move_rows(void *s, void *d_base, size_t row_bytes, const struct kv_row_move *moves, int n) {
    for (int i = 0; i < n;) {   // launches of up to CUDA_MAX_ROW_MOVES moves, in order on the stream
        struct cuda_row_moves m = { 0 };
        for (; i < n && m.n < CUDA_MAX_ROW_MOVES; i++) {
            if (moves[i].len <= 0 || moves[i].dst == moves[i].src) continue;
            m.dst[m.n] = moves[i].dst;
            m.src[m.n] = moves[i].src;
            m.len[m.n] = moves[i].len;
            m.n++;
        }
        pykv_status err;
        if (m.n == 0) continue;
        if (!hold(s, d_base, row_bytes, &m, &err)) {
            PYKV_TRY(err);
            cuda_timing_mark((cuda_stream)s, "kv compaction");
            cuda_move_rows((cuda_stream)s, d_base, row_bytes, &m);
        }
    }
    return cuda_check("moving KV entries on the GPU");
}

// The compaction of kv_device_gather_indices, on the current device.
static pykv_status gather_indices(cuda_stream st, void **k, size_t kb, void **v, size_t vb, const int32_t *d_keep,
                                  int32_t n_keep, int32_t rows);

pykv_status kv_device_gather(int device, void *s, void **k, size_t kb, void **v, size_t vb, const int32_t *keep,
                             int32_t n_keep, int32_t rows) {
    const cuda_stream st = (cuda_stream)s;
    PYKV_TRY(cuda_set_device(device));
    PYKV_TRY(kv_device_flush_moves(s));
    cuda_timing_mark(st, "kv compaction");
    void *d_keep = NULL;
    pykv_status err = cuda_alloc_async(&d_keep, (size_t)(n_keep > 0 ? n_keep : 1) * sizeof(int32_t), st, "the KV cache");
    // staged through pinned memory: the caller may free keep at once, and the stream's queue
    // is not drained for it
    if (err == PYKV_OK && n_keep > 0) err = cuda_upload_staged(d_keep, keep, (size_t)n_keep * sizeof(int32_t), st);
    if (err == PYKV_OK) err = gather_indices(st, k, kb, v, vb, (const int32_t *)d_keep, n_keep, rows);
    cuda_free_async(d_keep, st);
    return err;
}

pykv_status kv_device_gather_indices(int device, void *s, void **k, size_t kb, void **v, size_t vb,
                                     const int32_t *d_keep, int32_t n_keep, int32_t rows) {
    PYKV_TRY(cuda_set_device(device));
    PYKV_TRY(kv_device_flush_moves(s));
    cuda_timing_mark((cuda_stream)s, "kv compaction");
    return gather_indices((cuda_stream)s, k, kb, v, vb, d_keep, n_keep, rows);
}

static pykv_status gather_indices(cuda_stream st, void **k, size_t kb, void **v, size_t vb, const int32_t *d_keep,
                                  int32_t n_keep, int32_t rows) {
    void *nk = NULL, *nv = NULL;
    pykv_status err = cuda_alloc_async(&nk, (size_t)rows * kb, st, "the KV cache");
    if (err == PYKV_OK) err = cuda_alloc_async(&nv, (size_t)rows * vb, st, "the KV cache");
    if (err == PYKV_OK) {
        cuda_gather_rows(st, nk, *k, kb, d_keep, n_keep);
        cuda_gather_rows(st, nv, *v, vb, d_keep, n_keep);
        err = cuda_check("compacting KV entries on the GPU");
    }
    if (err != PYKV_OK) {
        cuda_free_async(nk, st);
        cuda_free_async(nv, st);
        return err;
    }
    cuda_free_async(*k, st);
    cuda_free_async(*v, st);
    *k = nk;
    *v = nv;
    return PYKV_OK;
}

void kv_device_layer(const struct kv_cache *c, int layer, const int32_t *d_lens, struct cuda_kv_layer *out) {
    // the kernels given this view read the lists as the held moves leave them
    pthread_mutex_lock(&g_held_lock);
    struct held_moves *h = held_of(c->device_stream);
    if (h) {
        const pykv_status err = send_held(h);
        if (h->err == PYKV_OK) h->err = err;
    }
    pthread_mutex_unlock(&g_held_lock);
    memset(out, 0, sizeof(*out));
    out->n_head_kv = c->n_head_kv;
    out->head_dim = c->head_dim;
    out->fmt_k = c->fmt_k;
    out->fmt_v = c->fmt_v;
    out->n_dev = d_lens;
    out->n_bound = c->max_entries;
    for (int h = 0; h < c->n_head_kv; h++) {
        const struct kv_list *l = &c->lists[(size_t)layer * c->n_head_kv + h];
        out->k[h] = l->k;
        out->v[h] = l->v;
        out->n[h] = l->n;
        if (l->n_members && l->member_block) {   // merged entries (kv_list_sync_members)
            out->members[h] = l->member_block;
            out->members_cap[h] = l->member_block_cap;
        }
    }
}

#else

static pykv_status no_cuda(void) {
    return pykv_error(PYKV_ERR_UNSUPPORTED, "this build of pykv has no CUDA backend");
}
pykv_status kv_device_resize(int device, void *s, void **p, size_t old_bytes, size_t new_bytes) {
    (void)device; (void)s; (void)p; (void)old_bytes; (void)new_bytes;
    return no_cuda();
}
pykv_status kv_device_read(void *s, void *dst, const void *d_src, size_t bytes) {
    (void)s; (void)dst; (void)d_src; (void)bytes;
    return no_cuda();
}
pykv_status kv_device_write(void *s, void *d_dst, const void *src, size_t bytes) {
    (void)s; (void)d_dst; (void)src; (void)bytes;
    return no_cuda();
}
pykv_status kv_device_move_rows(void *s, void *d_base, size_t row_bytes, const struct kv_row_move *moves, int n) {
    (void)s; (void)d_base; (void)row_bytes; (void)moves; (void)n;
    return no_cuda();
}
void kv_device_hold_moves(void *s) { (void)s; }
pykv_status kv_device_flush_moves(void *s) {
    (void)s;
    return PYKV_OK;
}
pykv_status kv_device_send_moves(void *s) {
    (void)s;
    return PYKV_OK;
}
pykv_status kv_device_gather(int device, void *s, void **k, size_t kb, void **v, size_t vb, const int32_t *keep,
                             int32_t n_keep, int32_t rows) {
    (void)device; (void)s; (void)k; (void)kb; (void)v; (void)vb; (void)keep; (void)n_keep; (void)rows;
    return no_cuda();
}
pykv_status kv_device_gather_indices(int device, void *s, void **k, size_t kb, void **v, size_t vb,
                                     const int32_t *d_keep, int32_t n_keep, int32_t rows) {
    (void)device; (void)s; (void)k; (void)kb; (void)v; (void)vb; (void)d_keep; (void)n_keep; (void)rows;
    return no_cuda();
}

#endif
