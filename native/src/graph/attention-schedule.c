// attention-schedule.c - how a layer's attention is spread over the thread pool: prefill
// blocks of (KV head, tokens) claimed one at a time, a decode step's lists cut into segments
// (the policy's decode_list runs on each list as it finishes), and the accumulated-attention
// pass of the policies that read every entry's attention. The kernels themselves are in
// cpu/attention.c and cpu/attention-flash.c.
#include "graph/attention-schedule.h"
#include "cpu/attention.h"
#include "core/error.h"
#include "core/threadpool.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

struct attention_job {
    pykv_context *ctx;
    int           layer;
    int           T;
};

// The query heads of token t that share KV head g, in tiles of ATTENTION_TILE: each tile
// reads the list once. Without each_tile it computes their attention output
// (attention_group: lists with merged entries); with it, only the weights, handed to
// each_tile (policies that read every entry's attention).
static void attend_group(pykv_context *ctx, int layer, int T, int g, int t, float *scores,
                         void (*each_tile)(pykv_context *, int h0, int nq, int n, const float *w)) {
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv, hd = hp->head_dim;
    const struct kv_list *l = kv_cache_list(&ctx->cache, layer, g);
    const int n = l->n - (T - 1 - t);   // this token and everything before it
    for (int r0 = 0; r0 < n_rep; r0 += ATTENTION_TILE) {
        const int nq = n_rep - r0 < ATTENTION_TILE ? n_rep - r0 : ATTENTION_TILE;
        const size_t row = ((size_t)t * hp->n_head + (size_t)g * n_rep + r0) * hd;
        if (!each_tile) {
            attention_group(ctx->buf.q + row, nq, l, n, hd, scores, ctx->buf.att + row);
            continue;
        }
        attention_weights(ctx->buf.q + row, nq, l, n, hd, scores);
        each_tile(ctx, g * n_rep + r0, nq, n, scores);
    }
}

// Prefill: items of (KV head, block of consecutive tokens), claimed one at a time so the
// causal blocks' uneven costs spread over the threads; the latest (costliest) blocks go
// first. A list with merged entries (EMS) takes the token-by-token path.
struct flash_job {
    pykv_context *ctx;
    int           layer, T, tok_per_item, n_items;
    atomic_int    next;
};

static void flash_task(void *arg, int ith, int nth) {
    struct flash_job *job = arg;
    pykv_context *ctx = job->ctx;
    const struct hparams *hp = &ctx->model->hp;
    const int n_kv = hp->n_head_kv, n_rep = hp->n_head / n_kv, hd = hp->head_dim, T = job->T;
    const size_t tok_stride = (size_t)hp->n_head * hd;
    const int n_blocks = (T + job->tok_per_item - 1) / job->tok_per_item;
    float *work = ctx->buf.flash_work + (size_t)ith * ctx->buf.flash_work_stride;
    float *scores = ctx->buf.scores + (size_t)ith * ctx->buf.scores_stride;
    (void)nth;
    for (int it; (it = atomic_fetch_add(&job->next, 1)) < job->n_items;) {
        const int g = it % n_kv, t0 = (n_blocks - 1 - it / n_kv) * job->tok_per_item;
        const int nt = T - t0 < job->tok_per_item ? T - t0 : job->tok_per_item;
        const struct kv_list *l = kv_cache_list(&ctx->cache, job->layer, g);
        if (l->n_members) {
            for (int t = t0; t < t0 + nt; t++) attend_group(ctx, job->layer, T, g, t, scores, NULL);
            continue;
        }
        const size_t off = (size_t)t0 * tok_stride + (size_t)g * n_rep * hd;
        attention_flash(ctx->buf.q + off, tok_stride, nt, n_rep, l->n - (T - 1 - t0), l, hd, ctx->buf.att + off,
                        tok_stride, work);
    }
}

// Decode: each list is cut into segments that the threads take separately (a few KV heads
// would not keep the threads busy); the segment count depends only on the list's length, so
// the result does not depend on the thread count.
static int decode_segments(int n) {
    const int s = (n + DECODE_SEGMENT - 1) / DECODE_SEGMENT;
    return s < 1 ? 1 : s > DECODE_MAX_SEGMENTS ? DECODE_MAX_SEGMENTS : s;
}
_Static_assert(DECODE_MAX_SEGMENTS <= ATTENTION_MAX_PARTS, "attention_merge takes every segment");

// First entry of segment p of a list of n entries cut into n_seg (p = n_seg: n).
static int segment_start(int n, int n_seg, int p) {
    return (int)((long)n * p / n_seg);
}

// A decode step's attention sums are its weights: the segments' unnormalised weights
// (colsum, n entries) scaled by exp(m_seg - max) / total, as attention_merge combines them.
static void normalize_colsum(float *colsum, int n, const float *m, const float *lsum) {
    const int n_seg = decode_segments(n);
    float f[DECODE_MAX_SEGMENTS];
    const double total = attention_merge_scales(n_seg, m, lsum, f);
    for (int p = 0; p < n_seg; p++) {
        const float scale = (float)(f[p] / total);
        for (int j = segment_start(n, n_seg, p); j < segment_start(n, n_seg, p + 1); j++) colsum[j] *= scale;
    }
}

// A decode step's job: the lists' segments, and what finishing a list takes.
struct decode_job {
    pykv_context              *ctx;
    int                        layer;
    const struct policy_event *ev;   // the policy's decode_list runs per list, or NULL
    atomic_int                 failed;
    pykv_status                st;
    char                       msg[256];
};

// List g's segments are all done: its query heads' outputs and attention sums, then the
// policy's work on the list (no other thread reads it any more in this layer).
static void finish_list(struct decode_job *job, int g) {
    pykv_context *ctx = job->ctx;
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv, hd = hp->head_dim;
    struct scratch *b = &ctx->buf;
    const struct kv_list *l = kv_cache_list(&ctx->cache, job->layer, g);
    for (int h = g * n_rep; h < (g + 1) * n_rep; h++) {
        const size_t slot = (size_t)h * DECODE_MAX_SEGMENTS;
        attention_merge(b->segments[g], b->part_m + slot, b->part_l + slot, b->part_o + slot * hd, hd,
                        b->att + (size_t)h * hd);
        if (b->attn_colsum)
            normalize_colsum(b->attn_colsum + (size_t)h * b->colsum_stride, l->n, b->part_m + slot, b->part_l + slot);
    }
    if (!job->ev) return;
    const pykv_status st = ctx->policy->ops->decode_list(ctx->policy, job->ev, g);
    if (st != PYKV_OK && !atomic_exchange(&job->failed, 1)) {   // the first failure's message
        job->st = st;
        snprintf(job->msg, sizeof(job->msg), "%s", pykv_last_error());
    }
}

// Segment seg of list g: its query heads' partial outputs and unnormalised weights. The
// thread that attends a list's last segment finishes the list (the decrement orders every
// segment's results before it).
static void attend_segment(struct decode_job *job, float *scores, int g, int seg) {
    pykv_context *ctx = job->ctx;
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv, hd = hp->head_dim;
    struct scratch *b = &ctx->buf;
    // the count fixed before the threads started: another thread may already have finished
    // list g and let its policy shrink it
    const int n_seg = b->segments[g];
    const struct kv_list *l = kv_cache_list(&ctx->cache, job->layer, g);
    const int j0 = segment_start(l->n, n_seg, seg), j1 = segment_start(l->n, n_seg, seg + 1);
    for (int r0 = 0; r0 < n_rep; r0 += ATTENTION_TILE) {
        const int nq = n_rep - r0 < ATTENTION_TILE ? n_rep - r0 : ATTENTION_TILE;
        const int h0 = g * n_rep + r0;
        float part_o[ATTENTION_TILE * PYKV_MAX_HEAD_DIM], part_m[ATTENTION_TILE], part_l[ATTENTION_TILE];
        attention_group_partial(b->q + (size_t)h0 * hd, nq, l, j0, j1, hd, scores, part_o, part_m, part_l);
        for (int r = 0; r < nq; r++) {
            const size_t slot = (size_t)(h0 + r) * DECODE_MAX_SEGMENTS + seg;
            if (b->attn_colsum)   // unnormalised; finish_list scales them
                memcpy(b->attn_colsum + (size_t)(h0 + r) * b->colsum_stride + j0, scores + (size_t)r * (j1 - j0),
                       (size_t)(j1 - j0) * sizeof(float));
            b->part_m[slot] = part_m[r];
            b->part_l[slot] = part_l[r];
            memcpy(b->part_o + slot * hd, part_o + (size_t)r * hd, (size_t)hd * sizeof(float));
        }
    }
    if (atomic_fetch_sub(&b->segments_left[g], 1) == 1) finish_list(job, g);
}

// Claims and attends list g's segments until none is left unclaimed.
static void attend_list(struct decode_job *job, float *scores, int g) {
    struct scratch *b = &job->ctx->buf;
    for (int seg; (seg = atomic_fetch_add(&b->segments_next[g], 1)) < b->segments[g];) attend_segment(job, scores, g, seg);
}

// Each thread first attends the lists it owns (g = ith, ith + nth, ...) segment by segment,
// then helps with the segments left of any list. A list's policy work then mostly reads rows
// its own thread has just read, from its own core's cache (with 2 threads and 3 KV heads,
// lists 0 and 1 stay on one core each; dealing out (list, segment) items in turn would put
// each list's rows half on either core).
// Which thread attends a segment does not change any result.
static void decode_split_task(void *arg, int ith, int nth) {
    struct decode_job *job = arg;
    pykv_context *ctx = job->ctx;
    const int n_kv = ctx->model->hp.n_head_kv;
    float *scores = ctx->buf.scores + (size_t)ith * ctx->buf.scores_stride;
    for (int g = ith; g < n_kv; g += nth) attend_list(job, scores, g);
    for (int g = 0; g < n_kv; g++) attend_list(job, scores, g);
}

// ev: the policy's decode_list runs on each list as soon as it has attended (NULL: none).
pykv_status decode_attention(pykv_context *ctx, int layer, const struct policy_event *ev) {
    const struct hparams *hp = &ctx->model->hp;
    struct decode_job job = { .ctx = ctx, .layer = layer, .ev = ev };
    atomic_init(&job.failed, 0);
    for (int g = 0; g < hp->n_head_kv; g++) {
        ctx->buf.segments[g] = decode_segments(kv_cache_list(&ctx->cache, layer, g)->n);
        atomic_init(&ctx->buf.segments_next[g], 0);
        atomic_init(&ctx->buf.segments_left[g], ctx->buf.segments[g]);
    }
    threadpool_run(ctx->pool, decode_split_task, &job);
    return atomic_load(&job.failed) ? pykv_error(job.st, "%s", job.msg) : PYKV_OK;
}

void prefill_attention(pykv_context *ctx, int layer, int T) {
    const struct hparams *hp = &ctx->model->hp;
    const int tpi = flash_tokens_per_block(hp->n_head / hp->n_head_kv);
    struct flash_job job = { .ctx = ctx, .layer = layer, .T = T, .tok_per_item = tpi,
                             .n_items = hp->n_head_kv * ((T + tpi - 1) / tpi) };
    atomic_init(&job.next, 0);
    threadpool_run(ctx->pool, flash_task, &job);
}

// colsum[h][j] += the attention query head h pays entry j.
static void add_colsums(pykv_context *ctx, int h0, int nq, int n, const float *w) {
    for (int r = 0; r < nq; r++) {
        float *colsum = ctx->buf.attn_colsum + (size_t)(h0 + r) * ctx->buf.colsum_stride;
        for (int j = 0; j < n; j++) colsum[j] += w[(size_t)r * n + j];
    }
}

// For policies that score by accumulated attention (H2O): one item per KV head, whose
// tokens run in order, summing the attention each entry receives into colsum[h][j]. The
// sums then do not depend on how the work is spread over threads.
static void attention_colsum_task(void *arg, int ith, int nth) {
    const struct attention_job *job = arg;
    pykv_context *ctx = job->ctx;
    const struct hparams *hp = &ctx->model->hp;
    const int n_rep = hp->n_head / hp->n_head_kv;
    float *scores = ctx->buf.scores + (size_t)ith * ctx->buf.scores_stride;
    long g0, g1;
    split_range(hp->n_head_kv, ith, nth, &g0, &g1);
    for (long g = g0; g < g1; g++) {
        const int n_list = kv_cache_list(&ctx->cache, job->layer, (int)g)->n;
        for (int r = 0; r < n_rep; r++)
            memset(ctx->buf.attn_colsum + ((size_t)g * n_rep + r) * ctx->buf.colsum_stride, 0, (size_t)n_list * sizeof(float));
        for (int t = 0; t < job->T; t++) attend_group(ctx, job->layer, job->T, (int)g, t, scores, add_colsums);
    }
}

void prefill_attention_sums(pykv_context *ctx, int layer, int T) {
    struct attention_job job = { ctx, layer, T };
    threadpool_run(ctx->pool, attention_colsum_task, &job);
}
