// ctest-label: cuda
// test_cuda_policy.c - the policy kernels (ggml-cuda/kv-gather.cu, window-scores.cu, topk.cu)
// against their CPU twins on random inputs, one line per case:
//  * cuda_gather_rows vs kv_compact_rows on a copy: rows of 4 (positions), 128 (f16, head 64),
//    272 (q8_0, head 128), 68, 34, 6 and 3 bytes, a misaligned destination, 1 to 70000 rows,
//    keep lists of every row, none but one, random subsets; equal bytes;
//  * cuda_move_rows vs kv_drop_row (one row, tails 0 to 40) and kv_compact_rows (random
//    subsets, many launches of runs), rows of 3 bytes to 2 KiB; equal bytes;
//  * cuda_window_scores with per-row limits (vis) vs take_layer_scores (TAKE's probe, rows
//    after the list or causal at its end; rows weighted by the entries they see, as FINCH's),
//    the means vs ws_softmax_row's rows averaged, the
//    entropy terms vs sum p log(p + 1e-10); one row (a decode step's attention); NMSE <= 1e-6;
//  * cuda_decode_probs vs attention_weights (a decode step's attention sums): keys f32, f16,
//    q8_0, head_dim 64 and 128, GQA groups 1, 3, 4, lists of 0 to 20000 entries, lengths on
//    the host or in device memory, with and without merged entries (EMS's); NMSE <= 1e-6 and
//    nothing written past a list's length;
//  * cuda_value_l1_max vs ws_value_l1_max: values f32, f16, q8_0, head_dim 64 and 128, up
//    to 8 lists of up to 3000 rows, no candidates to all; equal bits;
//  * cuda_window_scores vs ws_stats_compute (mean, variance) and ws_layer_scores: keys f32,
//    f16, q8_0; head_dim 64 and 128; GQA groups 1, 3, 4; ragged lists from 1 to 20000 entries
//    (one without candidates), rows < protect < T, rows past one chunk of 32, pool max and
//    avg with kernels 1 to 9, gqa mean and max; NMSE <= 1e-6; and the scores alone (mean and
//    var not asked for) equal to the scores with them;
//  * cuda_select_top vs ws_select_top: many lists at once (n from 0 to 131072, k = -1, 0, 1,
//    n - 1, n, n + 3 and random), scores uniform, from a few values (ties), with NaN, inf,
//    zeros of both signs and subnormals; the same index sets, and the counts; then on the
//    window scores of a layer.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "ggml-cuda/policy-kernels.h"
#include "kv/kv-cache.h"
#include "kv/kv-device.h"
#include "kv/policies/common/window-scores.h"
#include "kv/policies/take/take-score.h"
#include "cpu/attention.h"
#include "model/model.h"

#define CUDA_CHECK_SEED 0x9E3779B97F4A7C15ull
#include "cuda-check.h"

// A layer of n_kv lists of head size d stored as fmt, every list empty.
static void empty_layer(struct cuda_kv_layer *layer, int n_kv, int d, int fmt) {
    memset(layer, 0, sizeof(*layer));
    layer->n_head_kv = n_kv;
    layer->head_dim = d;
    layer->fmt_k = layer->fmt_v = fmt;
}

// ---- gather ----

// kind: 0 every row, 1 one row, 2 a random ascending subset.
static void test_gather(size_t row_bytes, int32_t n, int kind, int misalign) {
    const size_t bytes = (size_t)n * row_bytes;
    unsigned char *src = malloc(bytes), *want = malloc(bytes), *got = malloc(bytes + 1);
    int32_t *keep = malloc((size_t)n * sizeof(int32_t)), n_keep = 0;
    for (size_t i = 0; i < bytes; i++) src[i] = (unsigned char)next_u32();
    for (int32_t j = 0; j < n; j++)
        if (kind == 0 || (kind == 1 && j == n / 2) || (kind == 2 && next_int(3) != 0)) keep[n_keep++] = j;
    memcpy(want, src, bytes);
    kv_compact_rows(want, row_bytes, keep, n_keep);
    unsigned char *dsrc = dev_upload(src, bytes), *ddst = dev_upload(NULL, bytes + 1);
    int32_t *dkeep = dev_upload(keep, (size_t)n_keep * sizeof(int32_t));
    cuda_gather_rows(NULL, ddst + misalign, dsrc, row_bytes, dkeep, n_keep);
    dev_download(got, ddst + misalign, (size_t)n_keep * row_bytes);
    const int same = memcmp(got, want, (size_t)n_keep * row_bytes) == 0;
    printf("gather row_bytes=%zu n=%d keep=%d%s: %s\n", row_bytes, n, n_keep, misalign ? " misaligned" : "",
           same ? "equal" : "DIFFERENT");
    CHECK(same);
    cuda_free(dsrc); cuda_free(ddst); cuda_free(dkeep);
    free(src); free(want); free(got); free(keep);
}

// ---- moves in place ----

// A decode step's eviction, as kv_list_retain and kv_list_drop send it: kind 0 drops one row
// keeping the last `tail` in order (kv_drop_row), kind 1 drops a random ascending few (the
// runs of kv_compact_rows, more than one launch's worth when many), on a buffer whose rows
// move at most MOVE_STAGE_BYTES at a time, so large rows and long runs take several pieces.
static void test_move(size_t row_bytes, int32_t n, int kind, int32_t tail) {
    const size_t bytes = (size_t)n * row_bytes;
    unsigned char *buf = malloc(bytes), *want = malloc(bytes), *got = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) buf[i] = (unsigned char)next_u32();
    memcpy(want, buf, bytes);
    struct cuda_row_moves m = { 0 };
    int32_t *keep = malloc((size_t)n * sizeof(int32_t)), n_keep = 0;
    if (kind == 0) {
        const int32_t j = next_int(n), h = n - tail > j + 1 ? n - tail : j + 1;
        kv_drop_row(want, row_bytes, n, j, tail);
        if (h - 1 > j) m = (struct cuda_row_moves){ .n = 1, .dst = { j }, .src = { h - 1 }, .len = { 1 } };
        m.dst[m.n] = h - 1; m.src[m.n] = h; m.len[m.n] = n - h; m.n++;
    } else {
        for (int32_t j = 0; j < n; j++) if (next_int(8) != 0 || j == 0) keep[n_keep++] = j;
        kv_compact_rows(want, row_bytes, keep, n_keep);
    }
    unsigned char *d = dev_upload(buf, bytes);
    if (kind == 0) cuda_move_rows(NULL, d, row_bytes, &m);
    for (int32_t j = 0, launches = 0; kind == 1 && j < n_keep; launches++) {   // runs, CUDA_MAX_ROW_MOVES a launch
        m.n = 0;
        for (; j < n_keep && m.n < CUDA_MAX_ROW_MOVES; j++) {
            int32_t end = j + 1;
            while (end < n_keep && keep[end] - end == keep[j] - j) end++;
            if (keep[j] != j) {
                m.dst[m.n] = j; m.src[m.n] = keep[j]; m.len[m.n] = end - j; m.n++;
            }
            j = end - 1;
        }
        cuda_move_rows(NULL, d, row_bytes, &m);
    }
    dev_download(got, d, bytes);
    const size_t cmp = (size_t)(kind == 0 ? n - 1 : n_keep) * row_bytes;
    const int same = memcmp(got, want, cmp) == 0;
    printf("move row_bytes=%zu n=%d kind=%d tail=%d: %s\n", row_bytes, n, kind, tail, same ? "equal" : "DIFFERENT");
    CHECK(same);
    cuda_free(d);
    free(buf); free(want); free(got); free(keep);
}

// Moves held back and sent in one launch (kv_device_hold_moves, cuda_move_rows_many): one
// drop in each of many buffers of different row sizes and alignments, and a second drop in
// some of them, which must first send what was held for its buffer: each buffer must end as
// the host's kv_drop_row leaves it.
static void test_move_many(void) {
    enum { BUFS = 100 };   // more than the first room for held jobs (64)
    const size_t sizes[] = { 272, 256, 130, 36, 7, 4096, 1 };
    const int32_t n = 300;
    unsigned char *want[BUFS], *d[BUFS];
    size_t rb[BUFS];
    cuda_stream s = NULL;
    if (!ok(cuda_stream_create(&s), "stream")) return;
    for (int b = 0; b < BUFS; b++) {
        rb[b] = sizes[b % (int)(sizeof(sizes) / sizeof(sizes[0]))];
        want[b] = malloc((size_t)n * rb[b]);
        for (size_t i = 0; i < (size_t)n * rb[b]; i++) want[b][i] = (unsigned char)next_u32();
        d[b] = dev_upload(want[b], (size_t)n * rb[b]);
    }
    kv_device_hold_moves(s);
    int32_t len[BUFS];
    for (int round = 0; round < 2; round++)
        for (int b = 0; b < BUFS; b++) {
            if (round == 1 && b % 3 != 0) continue;
            const int32_t m = round == 0 ? n : n - 1, j = next_int(m), tail = next_int(20);
            const int32_t h = m - tail > j + 1 ? m - tail : j + 1;
            const struct kv_row_move moves[2] = { { .dst = j, .src = h - 1, .len = h - 1 > j }, { .dst = h - 1, .src = h, .len = m - h } };
            kv_drop_row(want[b], rb[b], m, j, tail);
            CHECK(kv_device_move_rows(s, d[b], rb[b], moves, 2) == PYKV_OK);
            len[b] = m - 1;
        }
    CHECK(kv_device_send_moves(s) == PYKV_OK);
    int differ = 0;
    for (int b = 0; b < BUFS; b++) {
        unsigned char *got = malloc((size_t)n * rb[b]);
        CHECK(cuda_stream_sync(s) == PYKV_OK);
        dev_download(got, d[b], (size_t)n * rb[b]);
        differ += memcmp(got, want[b], (size_t)len[b] * rb[b]) != 0;
        free(got);
        free(want[b]);
        cuda_free(d[b]);
    }
    printf("moves held for %d buffers (a second drop in every third), sent in one launch: %d differ\n", BUFS, differ);
    CHECK(differ == 0);
    cuda_stream_destroy(s);
}

// ---- window scores ----

struct win_case {
    int     fmt, d, n_kv, group, T, rows, protect, pool, kernel, gqa;
    int32_t n[8];
};

// The layer's scores on the device (left in *d_scores, total in *total) after checking them
// against the CPU.
static void test_window(const struct win_case *wc, struct threadpool *pool, float **d_scores_out, int64_t *total_out,
                        float **cpu_scores_out) {
    const int d = wc->d, n_head = wc->n_kv * wc->group;
    int32_t n_max = 0;
    for (int g = 0; g < wc->n_kv; g++) n_max = wc->n[g] > n_max ? wc->n[g] : n_max;
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, wc->n_kv, d, n_max, wc->fmt, wc->fmt) == PYKV_OK);
    struct cuda_kv_layer layer;
    empty_layer(&layer, wc->n_kv, d, wc->fmt);
    float *k = malloc((size_t)d * sizeof(float)), *v = calloc((size_t)d, sizeof(float));
    for (int g = 0; g < wc->n_kv; g++) {
        struct kv_list *l = kv_cache_list(&c, 0, g);
        CHECK(kv_list_reserve(&c, l, wc->n[g]) == PYKV_OK);
        for (int32_t j = 0; j < wc->n[g]; j++) {
            for (int i = 0; i < d; i++) k[i] = uniform(-2.0f, 2.0f);
            kv_list_push(&c, l, k, v, j);
        }
        const size_t kb = kv_format_row_bytes(wc->fmt, d) * (size_t)wc->n[g];
        layer.k[g] = dev_upload(l->k, kb);
        layer.v[g] = NULL;   // the scores read keys only
        layer.n[g] = wc->n[g];
    }
    const size_t nq = (size_t)wc->T * n_head * d;
    float *q = malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = uniform(-1.0f, 1.0f);

    struct hparams hp = { .n_layer = 1, .n_head = n_head, .n_head_kv = wc->n_kv, .head_dim = d };
    struct policy_event ev = { .cache = &c, .hp = &hp, .pool = pool, .layer = 0, .q = q, .T = wc->T,
                               .n_prompt = wc->T, .is_last_chunk = 1 };
    const struct ws_window w = { .protect = wc->protect, .rows = wc->rows };
    const struct ws_opts o = { .window = wc->protect, .pool = (enum ws_pool)wc->pool, .kernel = wc->kernel,
                               .gqa = (enum ws_gqa)wc->gqa };
    struct ws_stats st, st2;
    float *want = NULL;
    CHECK(ws_stats_compute(&ev, w, 1, &st) == PYKV_OK);
    CHECK(ws_layer_scores(&ev, &o, w, &st2, &want) == PYKV_OK);

    const struct cuda_window_args a = { n_head, wc->T, wc->rows, wc->protect, wc->pool, wc->kernel, wc->gqa };
    const int64_t total = cuda_window_layout(&layer, wc->protect, NULL, NULL);
    CHECK(total == st.total);
    const size_t n_out = (size_t)total * wc->group;
    float *dq = dev_upload(q, nq * sizeof(float));
    void *work = dev_upload(NULL, cuda_window_work_bytes(&layer, &a));
    float *dscores = dev_upload(NULL, (size_t)total * sizeof(float)), *dscores2 = dev_upload(NULL, (size_t)total * sizeof(float));
    float *dmean = dev_upload(NULL, n_out * sizeof(float)), *dvar = dev_upload(NULL, n_out * sizeof(float));
    cuda_window_scores(NULL, &layer, dq, &a, dscores, dmean, dvar, work);
    float *mean = malloc((n_out ? n_out : 1) * sizeof(float)), *var = malloc((n_out ? n_out : 1) * sizeof(float));
    float *scores = malloc((size_t)(total ? total : 1) * sizeof(float)), *scores2 = malloc((size_t)(total ? total : 1) * sizeof(float));
    dev_download(mean, dmean, n_out * sizeof(float));
    dev_download(var, dvar, n_out * sizeof(float));
    dev_download(scores, dscores, (size_t)total * sizeof(float));
    cuda_window_scores(NULL, &layer, dq, &a, dscores2, NULL, NULL, work);   // the scores alone
    dev_download(scores2, dscores2, (size_t)total * sizeof(float));
    const double e_mean = nmse(mean, st.mean, n_out), e_var = nmse(var, st.var, n_out);
    const double e_scores = nmse(scores, want, (size_t)total);
    const int alone_same = memcmp(scores, scores2, (size_t)total * sizeof(float)) == 0;
    printf("window k=%s d=%d G=%d n=%d..%d T=%d rows=%d protect=%d %s%d gqa=%s: NMSE mean %.2e var %.2e scores %.2e%s\n",
           kv_format_name(wc->fmt), d, wc->group, wc->n[0], wc->n[wc->n_kv - 1], wc->T, wc->rows, wc->protect,
           wc->pool ? "avg" : "max", wc->kernel, wc->gqa ? "max" : "mean", e_mean, e_var, e_scores,
           alone_same ? "" : " (scores alone DIFFER)");
    CHECK(e_mean <= 1e-6);
    CHECK(e_var <= 1e-6);
    CHECK(e_scores <= 1e-6);
    CHECK(alone_same);

    cuda_free(dq); cuda_free(work); cuda_free(dscores2); cuda_free(dmean); cuda_free(dvar);
    for (int g = 0; g < wc->n_kv; g++) cuda_free(layer.k[g]);
    if (d_scores_out) {
        *d_scores_out = dscores;
        *total_out = total;
        *cpu_scores_out = scores;
    } else {
        cuda_free(dscores);
        free(scores);
    }
    free(mean); free(var); free(scores2); free(want); free(q); free(k); free(v);
    ws_stats_free(&st);
    ws_stats_free(&st2);
    kv_cache_free(&c);
}

// List g of layer 0 of c (initialised with n_kv lists of head size d, stored as fmt): n[g]
// random keys (values 0) at positions 0, 1, ..., uniform in [-spread[g % 2], spread[g % 2]];
// the keys go up to the device as `layer` (its lengths n). Returns the longest list's length.
static int32_t random_keys(struct kv_cache *c, struct cuda_kv_layer *layer, int fmt, int d, int n_kv,
                           const int32_t *n, const float spread[2]) {
    empty_layer(layer, n_kv, d, fmt);
    float *k = malloc((size_t)d * sizeof(float)), *v = calloc((size_t)d, sizeof(float));
    int32_t n_max = 0;
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(c, 0, g);
        CHECK(kv_list_reserve(c, l, n[g]) == PYKV_OK);
        for (int32_t j = 0; j < n[g]; j++) {
            for (int i = 0; i < d; i++) k[i] = uniform(-spread[g % 2], spread[g % 2]);
            kv_list_push(c, l, k, v, j);
        }
        layer->k[g] = dev_upload(l->k, kv_format_row_bytes(fmt, d) * (size_t)(n[g] > 0 ? n[g] : 1));
        layer->n[g] = n[g];
        n_max = n[g] > n_max ? n[g] : n_max;
    }
    free(k);
    free(v);
    return n_max;
}

// ---- a decode step's attention probabilities ----

// cuda_decode_probs against attention_weights on one layer of n[g] entries per list, the
// lengths given on the host or read from device memory (a recorded decode step's); rows of
// `stride` floats whose entries past n must stay as they were.
// A quarter of every list's entries made merged entries of 2 to 6 members (norms 0.3 to 3),
// their block as kv_list_sync_members lays it out sent to the device.
static void merge_some(struct kv_cache *c, struct cuda_kv_layer *layer, int n_kv, void **blocks) {
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(c, 0, g);
        blocks[g] = NULL;
        if (l->n == 0) continue;
        CHECK(kv_list_enable_members(c, l) == PYKV_OK);
        for (int32_t j = 0; j < l->n; j++) {
            if (next_int(4) != 0) continue;
            float norms[6];
            const int m = 2 + next_int(5);
            for (int i = 0; i < m; i++) norms[i] = uniform(0.3f, 3.0f);
            CHECK(kv_list_set_members(c, l, j, norms, m) == PYKV_OK);
        }
        const size_t ints = (size_t)l->cap * sizeof(int32_t), bytes = 2 * ints + (size_t)l->pool_used * sizeof(float);
        char *block = malloc(bytes + 1);
        memcpy(block, l->n_members, ints);
        memcpy(block + ints, l->member_at, ints);
        memcpy(block + 2 * ints, l->member_pool, (size_t)l->pool_used * sizeof(float));
        blocks[g] = dev_upload(block, bytes);
        layer->members[g] = blocks[g];
        layer->members_cap[g] = l->cap;
        free(block);
    }
}

static void test_decode_probs(int fmt, int d, int n_kv, int group, const int32_t *n, int lengths_on_device,
                              int merged) {
    const int n_head = n_kv * group;
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, n_kv, d, 30000, fmt, fmt) == PYKV_OK);
    struct cuda_kv_layer layer;
    const float spread[2] = { 1.0f, 6.0f };   // flat and peaked rows
    const int32_t n_max = random_keys(&c, &layer, fmt, d, n_kv, n, spread);
    void *blocks[CUDA_MAX_KV_HEADS] = { 0 };
    if (merged) merge_some(&c, &layer, n_kv, blocks);
    int32_t *d_n = NULL;
    if (lengths_on_device) {   // the host's lengths wrong on purpose: the kernel must read the device's
        d_n = dev_upload(layer.n, (size_t)n_kv * sizeof(int32_t));
        layer.n_dev = d_n;
        layer.n_bound = n_max;
        for (int g = 0; g < n_kv; g++) layer.n[g] = 1;
    }
    const int64_t stride = n_max + 5;
    const size_t nq = (size_t)n_head * d, n_out = (size_t)n_head * (size_t)stride;
    float *q = malloc(nq * sizeof(float)), *want = malloc(n_out * sizeof(float)), *got = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = uniform(-1.0f, 1.0f);
    for (size_t i = 0; i < n_out; i++) want[i] = -7.0f;   // everywhere before the kernel; past n after it
    float *dq = dev_upload(q, nq * sizeof(float)), *dout = dev_upload(want, n_out * sizeof(float));
    for (int h = 0; h < n_head; h++) {
        const int g = h / group;
        if (n[g] > 0) attention_weights(q + (size_t)h * d, 1, kv_cache_list(&c, 0, g), n[g], d, want + (size_t)h * stride);
    }
    cuda_decode_probs(NULL, &layer, dq, n_head, dout, stride);
    CHECK(cuda_check("cuda_decode_probs") == PYKV_OK);
    dev_download(got, dout, n_out * sizeof(float));
    int untouched = 1;
    double e = 0.0;   // the worst row's
    for (int h = 0; h < n_head; h++) {
        const int32_t nh = n[h / group];
        for (int64_t j = nh; j < stride; j++) untouched &= got[(size_t)h * stride + j] == -7.0f;
        if (nh > 0) {
            const double eh = nmse(got + (size_t)h * stride, want + (size_t)h * stride, (size_t)nh);
            e = eh > e ? eh : e;
        }
    }
    printf("decode probs k=%s d=%d G=%d n=%d..%d%s%s: NMSE %.2e%s\n", kv_format_name(fmt), d, group, n[0],
           n[n_kv - 1], lengths_on_device ? " (lengths on the device)" : "", merged ? " (merged entries)" : "", e,
           untouched ? "" : ", past n written");
    CHECK(e <= 1e-6);
    CHECK(untouched);
    cuda_free(dq); cuda_free(dout); cuda_free(d_n);
    for (int g = 0; g < n_kv; g++) {
        cuda_free(layer.k[g]);
        cuda_free(blocks[g]);
    }
    free(q); free(want); free(got);
    kv_cache_free(&c);
}

// ---- every entry, each row up to its own limit (vis): TAKE's probe and the attention sums ----

// The kernel in vis mode against the host on one layer of n[g] entries: with TAKE's
// arguments (avg pooling, GQA mean) its scores against take_layer_scores, whose rows see the
// entries up to their positions; its means against ws_softmax_row averaged over the rows
// (unseen entries 0); its entropy terms against sum p log(p + 1e-10) over the same rows.
static void test_visible(int fmt, int d, int n_kv, int group, int rows, int kernel, const int32_t *n, int causal,
                         enum take_row_weight weight, struct threadpool *pool) {
    const int n_head = n_kv * group;
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, n_kv, d, 30000, fmt, fmt) == PYKV_OK);
    struct cuda_kv_layer layer;
    const float spread[2] = { 2.0f, 2.0f };
    const int32_t n_max = random_keys(&c, &layer, fmt, d, n_kv, n, spread);   // position j: the probe's
    int64_t total = 0, offset[8];                                             // rows are causal by index too
    for (int g = 0; g < n_kv; g++) {
        offset[g] = total;
        total += n[g];
    }
    // causal: the rows are the list's last entries (pos0 = n - rows); else they all come after
    const int32_t pos0 = causal ? n_max - rows : n_max;
    int32_t *vis = malloc((size_t)rows * n_kv * sizeof(int32_t));
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < n_kv; g++) {
            int32_t x = n[g];
            while (x > 0 && x - 1 > pos0 + r) x--;
            vis[(size_t)r * n_kv + g] = x;
        }
    const size_t nq = (size_t)rows * n_head * d;
    float *q = malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = uniform(-1.0f, 1.0f);
    struct hparams hp = { .n_layer = 1, .n_head = n_head, .n_head_kv = n_kv, .head_dim = d };
    struct policy_event ev = { .cache = &c, .hp = &hp, .pool = pool, .layer = 0, .q = q, .T = rows, .n_prompt = rows,
                               .is_last_chunk = 1 };
    const size_t n_out = (size_t)total * group;
    float *want = malloc((size_t)total * sizeof(float)), *want_mean = calloc(n_out, sizeof(float));
    double *want_ent = calloc(n_out, sizeof(double));
    CHECK(take_layer_scores(&ev, q, 0, rows, pos0, n, offset, kernel, weight, want) == PYKV_OK);
    float *z = malloc((size_t)n_max * sizeof(float));
    for (int h = 0; h < n_head; h++) {   // the means and entropy terms of every entry, on the host
        const int g = h / group;
        const struct kv_list *l = kv_cache_list(&c, 0, g);
        const size_t row = (size_t)offset[g] * group + (size_t)(h % group) * n[g];
        for (int r = 0; r < rows; r++) {
            const int32_t seen = vis[(size_t)r * n_kv + g];
            if (seen == 0) continue;
            attention_weights(q + ((size_t)r * n_head + h) * d, 1, l, seen, d, z);
            const float w = weight == TAKE_ROWS_BY_SEEN ? (float)seen : 1.0f;
            for (int32_t j = 0; j < seen; j++) {
                want_mean[row + j] += w * z[j] / (float)rows;
                want_ent[row + j] += (double)z[j] * log((double)z[j] + 1e-10);
            }
        }
    }
    struct cuda_window_args a = { n_head, rows, rows, 0, WS_POOL_AVG, kernel, WS_GQA_MEAN };
    a.weight_seen = weight == TAKE_ROWS_BY_SEEN;
    a.vis = dev_upload(vis, (size_t)rows * n_kv * sizeof(int32_t));
    a.ent = dev_upload(NULL, n_out * sizeof(double));
    float *dq = dev_upload(q, nq * sizeof(float)), *dscores = dev_upload(NULL, (size_t)total * sizeof(float));
    float *dmean = dev_upload(NULL, n_out * sizeof(float));
    void *work = dev_upload(NULL, cuda_window_work_bytes(&layer, &a));
    cuda_window_scores(NULL, &layer, dq, &a, dscores, dmean, NULL, work);
    float *got = malloc((size_t)total * sizeof(float)), *mean = malloc(n_out * sizeof(float));
    double *ent = malloc(n_out * sizeof(double));
    dev_download(got, dscores, (size_t)total * sizeof(float));
    dev_download(mean, dmean, n_out * sizeof(float));
    dev_download(ent, a.ent, n_out * sizeof(double));
    float *entf = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++) entf[i] = (float)ent[i];
    const double e_scores = nmse(got, want, (size_t)total), e_mean = nmse(mean, want_mean, n_out);
    const double e_ent = nmse_d(entf, want_ent, (int64_t)n_out);
    printf("visible k=%s d=%d G=%d n=%d..%d rows=%d %s kernel=%d%s: NMSE take scores %.2e means %.2e entropy %.2e\n",
           kv_format_name(fmt), d, group, n[0], n[n_kv - 1], rows, causal ? "causal" : "after", kernel,
           weight == TAKE_ROWS_BY_SEEN ? " rows by seen" : "", e_scores, e_mean, e_ent);
    CHECK(e_scores <= 1e-6);
    CHECK(e_mean <= 1e-6);
    CHECK(e_ent <= 1e-6);
    cuda_free(dq); cuda_free(dscores); cuda_free(dmean); cuda_free(work); cuda_free((void *)a.vis); cuda_free(a.ent);
    for (int g = 0; g < n_kv; g++) cuda_free(layer.k[g]);
    free(vis); free(q); free(want); free(want_mean); free(want_ent); free(z); free(got); free(mean);
    free(ent); free(entf);
    kv_cache_free(&c);
}

// ---- value norms ----

// LAVa's vbar of every list on the device against ws_value_l1_max on the host: equal bits.
// Values uniform with a few large rows (the maximum away from the end), one list empty of
// candidates, one whose candidates are all its rows.
static void test_value_norms(int fmt, int d, int n_kv) {
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, n_kv, d, 3000, fmt, fmt) == PYKV_OK);
    struct cuda_kv_layer layer;
    empty_layer(&layer, n_kv, d, fmt);
    int32_t n_cand[8];
    float *k = calloc((size_t)d, sizeof(float)), *v = malloc((size_t)d * sizeof(float));
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(&c, 0, g);
        const int32_t n = 1 + next_int(3000);
        CHECK(kv_list_reserve(&c, l, n) == PYKV_OK);
        for (int32_t j = 0; j < n; j++) {
            const float scale = next_int(50) == 0 ? 8.0f : 1.0f;
            for (int i = 0; i < d; i++) v[i] = uniform(-scale, scale);
            kv_list_push(&c, l, k, v, j);
        }
        n_cand[g] = g == 0 ? 0 : g == 1 ? n : next_int(n + 1);
        layer.v[g] = dev_upload(l->v, kv_format_row_bytes(fmt, d) * (size_t)n);
        layer.n[g] = n;
    }
    struct hparams hp = { .n_layer = 1, .n_head = n_kv, .n_head_kv = n_kv, .head_dim = d };
    struct policy_event ev = { .cache = &c, .hp = &hp, .layer = 0 };
    float want[8], got[8];
    CHECK(ws_value_l1_max(&ev, n_cand, want) == PYKV_OK);
    float *dout = dev_upload(NULL, sizeof(got));
    cuda_value_l1_max(NULL, &layer, n_cand, dout);
    dev_download(got, dout, (size_t)n_kv * sizeof(float));
    const int same = memcmp(got, want, (size_t)n_kv * sizeof(float)) == 0;
    printf("value norms v=%s d=%d lists=%d: %s\n", kv_format_name(fmt), d, n_kv, same ? "equal" : "DIFFERENT");
    CHECK(same);
    cuda_free(dout);
    for (int g = 0; g < n_kv; g++) cuda_free(layer.v[g]);
    free(k); free(v);
    kv_cache_free(&c);
}

// ---- top-k ----

// m lists back to back in scores (list i at off[i], n[i] entries, k[i] wanted), selected on
// the device in one call; the CPU's set for each. d_scores: the scores already on the device,
// or NULL to upload them.
static void check_select(const char *what, const float *scores, const float *d_scores, int32_t m, const int64_t *off,
                         const int32_t *n, const int32_t *k) {
    const int64_t total = m > 0 ? off[m - 1] + n[m - 1] : 0;
    float *ds = d_scores ? (float *)d_scores : dev_upload(scores, (size_t)total * sizeof(float));
    int64_t *doff = dev_upload(off, (size_t)m * sizeof(int64_t));
    int32_t *dn = dev_upload(n, (size_t)m * sizeof(int32_t)), *dk = dev_upload(k, (size_t)m * sizeof(int32_t));
    int32_t *didx = dev_upload(NULL, (size_t)total * sizeof(int32_t)), *dcount = dev_upload(NULL, (size_t)m * sizeof(int32_t));
    cuda_select_top(NULL, ds, doff, dn, dk, m, didx, dcount);
    int32_t *idx = malloc((size_t)(total ? total : 1) * sizeof(int32_t)), *count = malloc((size_t)m * sizeof(int32_t));
    dev_download(idx, didx, (size_t)total * sizeof(int32_t));
    dev_download(count, dcount, (size_t)m * sizeof(int32_t));
    int bad = 0;
    for (int32_t i = 0; i < m; i++) {
        int64_t *want = malloc((size_t)(n[i] ? n[i] : 1) * sizeof(int64_t)), n_want = -1;
        CHECK(ws_select_top(scores + off[i], n[i], k[i], want, &n_want) == PYKV_OK);
        int list_bad = count[i] != n_want;
        for (int64_t j = 0; !list_bad && j < n_want; j++) list_bad = idx[off[i] + j] != want[j];
        if (list_bad && bad < 5)
            fprintf(stderr, "%s: list %d (n=%d k=%d): %d selected, CPU %lld, or a different set\n", what, i, n[i],
                    k[i], count[i], (long long)n_want);
        bad += list_bad;
        free(want);
    }
    printf("%s: %d lists, %d differ\n", what, m, bad);
    CHECK(bad == 0);
    if (!d_scores) cuda_free(ds);
    cuda_free(doff); cuda_free(dn); cuda_free(dk); cuda_free(didx); cuda_free(dcount);
    free(idx); free(count);
}

static void test_select(int kind) {
    const int32_t sizes[] = { 0, 1, 2, 3, 5, 6, 17, 255, 256, 257, 1000, 4099, 20000, 131072 };
    const int ns = (int)(sizeof(sizes) / sizeof(sizes[0]));
    int32_t m = 0, n[128], k[128];
    int64_t off[128], total = 0;
    for (int a = 0; a < ns; a++) {
        const int32_t len = sizes[a];
        const int32_t ks[] = { -1, 0, 1, len - 1, len, len + 3, len > 0 ? next_int(len + 1) : 0, len / 4 };
        for (int b = 0; b < 8; b++) {
            if (len > 20000 && b > 3) continue;   // the long lists: a few cases
            off[m] = total;
            n[m] = len;
            k[m] = ks[b];
            total += len;
            m++;
        }
    }
    float *s = malloc((size_t)total * sizeof(float));
    for (int32_t i = 0; i < m; i++) fill_scores(s + off[i], n[i], kind);
    char what[64];
    snprintf(what, sizeof(what), "select_top kind=%d", kind);
    check_select(what, s, NULL, m, off, n, k);
    free(s);
}

int main(void) {
    if (!cuda_test_start("test_cuda_policy")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);

    const size_t row_bytes[] = { 4, 128, 272, 68, 34, 6, 3 };
    const int32_t rows[] = { 1, 7, 1000, 70000 };
    for (int a = 0; a < 7; a++)
        for (int b = 0; b < 4; b++)
            for (int kind = 0; kind < 3; kind++) test_gather(row_bytes[a], rows[b], kind, 0);
    test_gather(272, 1000, 2, 1);
    test_gather(128, 333, 2, 2);
    const size_t move_bytes[] = { 128, 272, 2048, 34, 6, 3 };
    for (int a = 0; a < 6; a++) {
        for (int32_t tail = 0; tail <= 40; tail += 8) test_move(move_bytes[a], 1000, 0, tail);
        test_move(move_bytes[a], 2, 0, 1);
        test_move(move_bytes[a], 300, 1, 0);
    }
    test_move_many();

    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++)
        for (int d = 64; d <= 128; d += 64) test_value_norms(fmt, d, fmt == KV_F16 ? 8 : 3);

    struct threadpool *pool = threadpool_create(2);
    CHECK(pool != NULL);
    if (!pool) return check_report("test_cuda_policy");
    const int groups[] = { 1, 3, 4 }, dims[] = { 64, 128 };
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++)
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 3; b++) {
                const struct win_case wc = { fmt, dims[a], 2, groups[b], 32, 32, 32, (a + b) % 2, 7, b % 2,
                                             { 1000 + 37 * b, 257 } };
                test_window(&wc, pool, NULL, NULL, NULL);
            }
    const struct win_case more[] = {
        // fmt d n_kv G T rows protect pool kernel gqa, then n per KV head
        { KV_F32, 64, 2, 1, 8, 8, 8, WS_POOL_MAX, 7, WS_GQA_MEAN, { 100, 37 } },
        { KV_Q8_0, 128, 2, 3, 16, 16, 16, WS_POOL_AVG, 5, WS_GQA_MAX, { 129, 128 } },
        { KV_Q8_0, 64, 3, 4, 20, 12, 20, WS_POOL_AVG, 9, WS_GQA_MEAN, { 400, 20, 21 } },
        { KV_F16, 64, 1, 3, 50, 40, 48, WS_POOL_MAX, 1, WS_GQA_MAX, { 333 } },
        { KV_F32, 128, 4, 1, 1, 1, 1, WS_POOL_AVG, 3, WS_GQA_MEAN, { 2, 5, 1, 130 } },
        { KV_F16, 128, 2, 4, 64, 33, 40, WS_POOL_AVG, 7, WS_GQA_MEAN, { 41, 1000 } },
        { KV_F16, 128, 8, 4, 512, 64, 64, WS_POOL_MAX, 7, WS_GQA_MEAN, { 20000, 19999, 5000, 64, 65, 3001, 7, 12345 } },
    };
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]) - 1; i++) test_window(&more[i], pool, NULL, NULL, NULL);
    const int32_t vis_n[][4] = { { 300, 41 }, { 1000, 999, 64, 7 }, { 33, 1 } };
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++) {
        test_visible(fmt, 64, 2, 3, 32, 7, vis_n[0], 0, TAKE_ROWS_EQUAL, pool);
        test_visible(fmt, 128, 4, 2, 40, 5, vis_n[1], 1, TAKE_ROWS_EQUAL, pool);
        test_visible(fmt, 64, 2, 1, 1, 1, vis_n[2], 1, TAKE_ROWS_EQUAL, pool);   // one row: a decode step's attention
        test_visible(fmt, 128, 2, 4, 32, 1, vis_n[0], 1, TAKE_ROWS_BY_SEEN, pool);   // FINCH's question
    }

    const int32_t probs_n[][4] = { { 1, 300 }, { 20000, 257, 0, 3 }, { 4097, 31 } };
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++) {
        test_decode_probs(fmt, 64, 2, 3, probs_n[0], 0, 0);
        test_decode_probs(fmt, 128, 4, 4, probs_n[1], 1, 0);
        test_decode_probs(fmt, 64, 2, 1, probs_n[2], 1, 0);
        test_decode_probs(fmt, 128, 2, 4, probs_n[0], 1, 1);   // EMS's merged entries
        test_decode_probs(fmt, 64, 4, 3, probs_n[1], 0, 1);
    }

    for (int kind = 0; kind < 4; kind++) test_select(kind);

    // the pipeline: top half of every KV head's candidates, from the device's own scores
    float *d_scores = NULL, *scores = NULL;
    int64_t total = 0;
    const struct win_case *big = &more[sizeof(more) / sizeof(more[0]) - 1];
    test_window(big, pool, &d_scores, &total, &scores);
    int32_t n_cand[8], k[8];
    int64_t off[8];
    struct cuda_kv_layer layer;
    memset(&layer, 0, sizeof(layer));
    layer.n_head_kv = big->n_kv;
    for (int g = 0; g < big->n_kv; g++) layer.n[g] = big->n[g];
    cuda_window_layout(&layer, big->protect, n_cand, off);
    for (int g = 0; g < big->n_kv; g++) k[g] = n_cand[g] / 2;
    check_select("select_top on window scores", scores, d_scores, big->n_kv, off, n_cand, k);
    cuda_free(d_scores);
    free(scores);
    threadpool_free(pool);
    return check_report("test_cuda_policy");
}
