// ctest-label: cuda
// test_cuda_ops.c - the CUDA element-wise, KV-append and attention kernels (ggml-cuda/
// elementwise.cu, kv-append.cu, attention-decode.cu, attention-prefill.cu) against their CPU
// twins on random inputs, one line per case with its NMSE = sum((gpu - cpu)^2) / sum(cpu^2):
//  * rmsnorm, rope (full and partial rotary), swiglu, add: lengths with odd tails, in place
//    and not; NMSE <= 1e-7;
//  * kv_append: the stored bytes equal kv_list_push's, every key/value format pair, after
//    entries already in the lists, with an inf and a NaN among the values; the same with the
//    RoPE of the queries and keys in the launch (rope_kv_append), full and partial rotary;
//  * decode attention vs attention_group over the same stored cache: head_dim 64 and 128
//    (and 96, 256), n_rep 1, 3, 4, 8 (and 6, 16), n from 1 to 5000 (and 70000: the segment
//    cap; 8 KV heads past 8192: blocks that take two segments), every format pair, lists of
//    different lengths per KV head; NMSE <= 1e-6; the outputs' Q8_1 blocks (xq) the CPU's
//    quantize_row_q8_act_scalar of the output floats, byte for byte;
//  * prefill attention vs attention_flash: T = 1, 5, 64, 130, 512 after n_before = 0, 3,
//    1000 entries, per-head n_before differing by one; NMSE <= 1e-6;
//  * merged entries (EMS: one logit per member, sharing the value): decode and prefill vs
//    attention_group, every format, up to 20000 entries; NMSE <= 1e-6.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/attention.h"
#include "cpu/ops.h"
#include "cpu/quant-q8.h"
#include "ggml-cuda/kernels.h"
#include "kv/kv-cache.h"

// This test's uniforms take the state's top 24 bits.
#define CUDA_CHECK_SEED 0x9E3779B97F4A7C15ull
#define CUDA_CHECK_UNIFORM_SHIFT 40
#include "cuda-check.h"

static void report(const char *what, double e, double limit) {
    printf("%-60s NMSE %.3e\n", what, e);
    CHECK(e <= limit);   // also false for NaN
}

// ---- element-wise ----

static void test_rmsnorm(int n, int n_rows, int in_place) {
    const size_t total = (size_t)n * n_rows;
    float *x = malloc(total * sizeof(float)), *w = malloc((size_t)n * sizeof(float));
    float *want = malloc(total * sizeof(float)), *got = malloc(total * sizeof(float));
    fill(x, total, -3.0f, 3.0f);
    fill(w, n, 0.5f, 1.5f);
    const float eps = 1e-5f;
    for (int r = 0; r < n_rows; r++) rmsnorm_scalar(want + (size_t)r * n, x + (size_t)r * n, w, n, eps);
    float *dx = dev_upload(x, total * sizeof(float)), *dw = dev_upload(w, (size_t)n * sizeof(float));
    float *dout = in_place ? dx : dev_upload(NULL, total * sizeof(float));
    cuda_rmsnorm(NULL, dout, dx, dw, n, n_rows, eps);
    dev_download(got, dout, total * sizeof(float));
    char what[96];
    snprintf(what, sizeof(what), "rmsnorm n=%d rows=%d%s", n, n_rows, in_place ? " in place" : "");
    report(what, nmse(got, want, total), 1e-7);
    cuda_free(dx); cuda_free(dw);
    if (!in_place) cuda_free(dout);
    free(x); free(w); free(want); free(got);
}

static void test_rope(int T, int n_heads, int head_dim, int n_rot) {
    const size_t total = (size_t)T * n_heads * head_dim;
    float *x = malloc(total * sizeof(float)), *want = malloc(total * sizeof(float)), *got = malloc(total * sizeof(float));
    float *inv_freq = malloc((size_t)n_rot / 2 * sizeof(float)), *cs = malloc((size_t)T * n_rot * sizeof(float));
    fill(x, total, -2.0f, 2.0f);
    memcpy(want, x, total * sizeof(float));
    rope_inv_freq(inv_freq, n_rot, 10000.0f, NULL);
    for (int t = 0; t < T; t++) {
        rope_angles(cs + (size_t)t * n_rot, n_rot, 17 + 1000 * t, inv_freq);
        rope_rotate(want + (size_t)t * n_heads * head_dim, n_heads, head_dim, n_rot, cs + (size_t)t * n_rot);
    }
    float *dx = dev_upload(x, total * sizeof(float)), *dcs = dev_upload(cs, (size_t)T * n_rot * sizeof(float));
    cuda_rope(NULL, dx, T, n_heads, head_dim, n_rot, dcs);
    dev_download(got, dx, total * sizeof(float));
    char what[96];
    snprintf(what, sizeof(what), "rope T=%d heads=%d head_dim=%d n_rot=%d", T, n_heads, head_dim, n_rot);
    report(what, nmse(got, want, total), 1e-7);
    cuda_free(dx); cuda_free(dcs);
    free(x); free(want); free(got); free(inv_freq); free(cs);
}

static void test_swiglu_add(int64_t n, int in_place) {
    float *g = malloc((size_t)n * sizeof(float)), *u = malloc((size_t)n * sizeof(float));
    float *want = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
    fill(g, (size_t)n, -20.0f, 20.0f);
    fill(u, (size_t)n, -2.0f, 2.0f);
    if (n > 3) { g[0] = -100.0f; g[1] = 100.0f; g[2] = 0.0f; }   // exp out of range both ways
    swiglu_scalar(want, g, u, (int)n);
    float *dg = dev_upload(g, (size_t)n * sizeof(float)), *du = dev_upload(u, (size_t)n * sizeof(float));
    float *dout = in_place ? dg : dev_upload(NULL, (size_t)n * sizeof(float));
    cuda_swiglu(NULL, dout, dg, du, n);
    dev_download(got, dout, (size_t)n * sizeof(float));
    char what[96];
    snprintf(what, sizeof(what), "swiglu n=%lld%s", (long long)n, in_place ? " in place" : "");
    report(what, nmse(got, want, (size_t)n), 1e-7);

    for (int64_t i = 0; i < n; i++) want[i] = u[i] + g[i];   // add: y = u, y += g
    CHECK(cuda_upload(dg, g, (size_t)n * sizeof(float)) == PYKV_OK);
    cuda_add(NULL, du, dg, n);
    dev_download(got, du, (size_t)n * sizeof(float));
    snprintf(what, sizeof(what), "add n=%lld", (long long)n);
    report(what, nmse(got, want, (size_t)n), 1e-7);
    cuda_free(dg); cuda_free(du);
    if (!in_place) cuda_free(dout);
    free(g); free(u); free(want); free(got);
}

// ---- lists on both sides ----

// A CPU cache of one layer with n_kv lists, list g holding n[g] random entries (keys in
// [-2, 2], values in [-1, 1]), and device copies of each list with room for cap entries.
struct lists {
    struct kv_cache      cache;
    struct cuda_kv_layer layer;   // device pointers, n[g] as on the CPU
    int                  n_kv, d;
};

static void lists_init(struct lists *L, int n_kv, int d, int fmt_k, int fmt_v, const int32_t *n, int cap) {
    memset(L, 0, sizeof(*L));
    L->n_kv = n_kv;
    L->d = d;
    CHECK(kv_cache_init(&L->cache, 1, n_kv, d, cap, fmt_k, fmt_v) == PYKV_OK);
    float *k = malloc((size_t)d * sizeof(float)), *v = malloc((size_t)d * sizeof(float));
    L->layer.n_head_kv = n_kv;
    L->layer.head_dim = d;
    L->layer.fmt_k = fmt_k;
    L->layer.fmt_v = fmt_v;
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(&L->cache, 0, g);
        CHECK(kv_list_reserve(&L->cache, l, cap) == PYKV_OK);
        for (int j = 0; j < n[g]; j++) {
            fill(k, d, -2.0f, 2.0f);
            fill(v, d, -1.0f, 1.0f);
            kv_list_push(&L->cache, l, k, v, j);
        }
        const size_t kb = kv_format_row_bytes(fmt_k, d), vb = kv_format_row_bytes(fmt_v, d);
        L->layer.k[g] = dev_upload(NULL, (size_t)cap * kb);
        L->layer.v[g] = dev_upload(NULL, (size_t)cap * vb);
        if (n[g] > 0) {
            CHECK(cuda_upload(L->layer.k[g], l->k, (size_t)n[g] * kb) == PYKV_OK);
            CHECK(cuda_upload(L->layer.v[g], l->v, (size_t)n[g] * vb) == PYKV_OK);
        }
        L->layer.n[g] = n[g];
    }
    free(k); free(v);
}

static void lists_free(struct lists *L) {
    for (int g = 0; g < L->n_kv; g++) { cuda_free(L->layer.k[g]); cuda_free(L->layer.v[g]); }
    kv_cache_free(&L->cache);
}

// The chunk's keys and values stored by cuda_kv_append (n_rep 0), or by cuda_rope_kv_append
// with n_rep query heads a KV head and n_rot rotated values: its queries and keys against the
// CPU's rope_rotate (NMSE 1e-7), and the stored bytes against kv_list_push of the keys it
// turned, byte for byte.
static void test_kv_append(int fmt_k, int fmt_v, int d, int n_kv, int n0, int T, int n_rep, int n_rot) {
    struct lists L;
    int32_t n[CUDA_MAX_KV_HEADS];
    for (int g = 0; g < n_kv; g++) n[g] = n0 + g;   // ragged
    lists_init(&L, n_kv, d, fmt_k, fmt_v, n, n0 + n_kv + T);
    const int n_head = n_kv * n_rep;
    const size_t rows = (size_t)T * n_kv * d, q_rows = (size_t)T * n_head * d;
    float *k = malloc(rows * sizeof(float)), *v = malloc(rows * sizeof(float));
    fill(k, rows, -3.0f, 3.0f);
    fill(v, rows, -1.0f, 1.0f);
    if (!n_rep) k[5] = INFINITY;   // token 0, head 0: a q8_0 block of zeros with an inf scale
    v[d + 3] = NAN;             // token 0, head 1 (or token 1): a NaN value stores 0 in q8_0
    for (int i = 0; i < d; i++) v[rows - d + i] *= 1e-6f;   // the last row: a subnormal-half scale
    float *dk = dev_upload(k, rows * sizeof(float)), *dv = dev_upload(v, rows * sizeof(float));
    if (n_rep) {
        float *q = malloc(q_rows * sizeof(float)), *got = malloc(q_rows * sizeof(float));
        float *inv_freq = malloc((size_t)n_rot / 2 * sizeof(float)), *cs = malloc((size_t)T * n_rot * sizeof(float));
        fill(q, q_rows, -2.0f, 2.0f);
        rope_inv_freq(inv_freq, n_rot, 10000.0f, NULL);
        for (int t = 0; t < T; t++) rope_angles(cs + (size_t)t * n_rot, n_rot, 3 + 700 * t, inv_freq);
        float *dq = dev_upload(q, q_rows * sizeof(float)), *dcs = dev_upload(cs, (size_t)T * n_rot * sizeof(float));
        cuda_rope_kv_append(NULL, &L.layer, dq, n_head, dk, dv, T, n_rot, dcs);
        for (int t = 0; t < T; t++) {
            rope_rotate(q + (size_t)t * n_head * d, n_head, d, n_rot, cs + (size_t)t * n_rot);
            rope_rotate(k + (size_t)t * n_kv * d, n_kv, d, n_rot, cs + (size_t)t * n_rot);
        }
        char what[96];
        dev_download(got, dq, q_rows * sizeof(float));
        snprintf(what, sizeof(what), "rope_kv_append q: d=%d n_head=%d n_rot=%d T=%d", d, n_head, n_rot, T);
        report(what, nmse(got, q, q_rows), 1e-7);
        dev_download(got, dk, rows * sizeof(float));
        snprintf(what, sizeof(what), "rope_kv_append k: d=%d n_kv=%d n_rot=%d T=%d", d, n_kv, n_rot, T);
        report(what, nmse(got, k, rows), 1e-7);
        memcpy(k, got, rows * sizeof(float));   // the stored rows are checked against the turned keys
        cuda_free(dq); cuda_free(dcs);
        free(q); free(got); free(inv_freq); free(cs);
    } else {
        cuda_kv_append(NULL, &L.layer, dk, dv, T);
    }
    CHECK(cuda_stream_sync(NULL) == PYKV_OK);
    CHECK(cuda_check("cuda_kv_append") == PYKV_OK);
    for (int t = 0; t < T; t++)
        for (int g = 0; g < n_kv; g++) {
            const size_t off = ((size_t)t * n_kv + g) * d;
            kv_list_push(&L.cache, kv_cache_list(&L.cache, 0, g), k + off, v + off, n[g] + t);
        }
    long bad = 0;
    for (int g = 0; g < n_kv; g++) {
        const struct kv_list *l = kv_cache_list(&L.cache, 0, g);
        for (int kv = 0; kv < 2; kv++) {
            const size_t rb = kv_format_row_bytes(kv ? fmt_v : fmt_k, d), bytes = (size_t)(n[g] + T) * rb;
            unsigned char *got = malloc(bytes);
            CHECK(cuda_download(got, kv ? L.layer.v[g] : L.layer.k[g], bytes) == PYKV_OK);
            const unsigned char *want = kv ? l->v : l->k;
            for (size_t i = 0; i < bytes; i++) bad += got[i] != want[i];
            free(got);
        }
    }
    printf("%s k=%s v=%s d=%d n_kv=%d n0=%d T=%d: %ld bytes differ\n", n_rep ? "rope_kv_append" : "kv_append",
           kv_format_name(fmt_k), kv_format_name(fmt_v), d, n_kv, n0, T, bad);
    CHECK(bad == 0);
    cuda_free(dk); cuda_free(dv);
    free(k); free(v);
    lists_free(&L);
}

// ---- attention ----

// One decode step over lists of n[g] entries against attention_group (tiles of
// ATTENTION_TILE query heads).
static void check_decode(struct lists *L, const int32_t *n, int n_rep, const char *what) {
    const int n_kv = L->n_kv, d = L->d, n_head = n_kv * n_rep;
    int32_t max_n = 0;
    for (int g = 0; g < n_kv; g++) {
        L->layer.n[g] = n[g];
        if (n[g] > max_n) max_n = n[g];
    }
    float *q = malloc((size_t)n_head * d * sizeof(float)), *want = malloc((size_t)n_head * d * sizeof(float));
    float *got = malloc((size_t)n_head * d * sizeof(float)), *w = malloc((size_t)ATTENTION_TILE * max_n * sizeof(float));
    fill(q, (size_t)n_head * d, -1.0f, 1.0f);
    for (int g = 0; g < n_kv; g++)
        for (int r0 = 0; r0 < n_rep; r0 += ATTENTION_TILE) {
            const int nq = n_rep - r0 < ATTENTION_TILE ? n_rep - r0 : ATTENTION_TILE;
            const size_t off = (size_t)(g * n_rep + r0) * d;
            attention_group(q + off, nq, kv_cache_list(&L->cache, 0, g), n[g], d, w, want + off);
        }
    float *dq = dev_upload(q, (size_t)n_head * d * sizeof(float)), *dout = dev_upload(NULL, (size_t)n_head * d * sizeof(float));
    void *work = dev_upload(NULL, cuda_attention_decode_work_bytes(n_head, d, max_n));
    const int64_t cols = (int64_t)n_head * d;
    const size_t xq_bytes = cuda_q8_1_bytes(cols, 1);
    void *dxq = dev_upload(NULL, xq_bytes);
    cuda_attention_decode(NULL, &L->layer, dq, n_head, dout, dxq, work);
    dev_download(got, dout, (size_t)n_head * d * sizeof(float));
    report(what, nmse(got, want, (size_t)n_head * d), 1e-6);
    if (cols % 32 == 0) {   // the Q8_1 blocks: the CPU's quantiser of the floats, byte for byte
        unsigned char *xq = malloc(xq_bytes);
        block_q8_act *cpu = malloc(Q8_ACT_BLOCKS(cols) * sizeof(block_q8_act));
        dev_download(xq, dxq, xq_bytes);
        quantize_row_q8_act_scalar(got, cpu, cols);
        CHECK(xq_bytes == (size_t)(cols / 32) * sizeof(block_q8_act));
        CHECK(memcmp(xq, cpu, xq_bytes) == 0);
        free(xq); free(cpu);
    }
    cuda_free(dq); cuda_free(dout); cuda_free(work); cuda_free(dxq);
    free(q); free(want); free(got); free(w);
}

static void test_decode_kv(int n_kv, int d, int fmt_k, int fmt_v, const int *reps, int n_reps, const int *ns, int n_ns) {
    int max_n = 0;
    for (int i = 0; i < n_ns; i++) max_n = ns[i] > max_n ? ns[i] : max_n;
    struct lists L;
    int32_t full[CUDA_MAX_KV_HEADS], n[CUDA_MAX_KV_HEADS];
    for (int g = 0; g < n_kv; g++) full[g] = max_n;
    lists_init(&L, n_kv, d, fmt_k, fmt_v, full, max_n);
    for (int a = 0; a < n_reps; a++)
        for (int b = 0; b < n_ns; b++) {
            // the odd lists a little shorter (the prefix of what is stored): ragged lengths
            for (int g = 0; g < n_kv; g++) n[g] = g % 2 && ns[b] > 8 ? ns[b] - 5 : ns[b];
            char what[112];
            snprintf(what, sizeof(what), "decode k=%s v=%s d=%d n_kv=%d n_rep=%d n=%d,%d", kv_format_name(fmt_k),
                     kv_format_name(fmt_v), d, n_kv, reps[a], n[0], n[1]);
            check_decode(&L, n, reps[a], what);
        }
    lists_free(&L);
}
static void test_decode(int d, int fmt_k, int fmt_v, const int *reps, int n_reps, const int *ns, int n_ns) {
    test_decode_kv(2, d, fmt_k, fmt_v, reps, n_reps, ns, n_ns);
}

// Merged entries (EMS): every third entry of each list (and the first) stands for 2 to 9
// members with norms in [0.5, 2], its key a unit direction; the member bookkeeping goes to the
// device as kv_list holds it. Decode and prefill against attention_group, which expands them.
static void test_merged(int d, int fmt, int n_rep, int32_t n0, int T) {
    const int n_kv = 2, n_head = n_kv * n_rep;
    const int32_t n[2] = { n0 + T, n0 / 2 + T };
    struct lists L;
    lists_init(&L, n_kv, d, fmt, fmt, n, n[0]);
    float norms[9], *k = malloc((size_t)d * sizeof(float)), *v = malloc((size_t)d * sizeof(float));
    void *blocks[2];
    for (int g = 0; g < n_kv; g++) {
        struct kv_list *l = kv_cache_list(&L.cache, 0, g);
        CHECK(kv_list_enable_members(&L.cache, l) == PYKV_OK);
        for (int32_t j = 0; j < n[g] - T; j += 3) {
            fill(k, d, -1.0f, 1.0f);
            double sq = 0.0;
            for (int c = 0; c < d; c++) sq += (double)k[c] * k[c];
            for (int c = 0; c < d; c++) k[c] = (float)(k[c] / sqrt(sq));
            fill(v, d, -1.0f, 1.0f);
            kv_list_set_kv(l, j, k, v, d);
            const int m = 2 + (int)(next_u32() % 8);
            fill(norms, m, 0.5f, 2.0f);
            CHECK(kv_list_set_members(&L.cache, l, j, norms, m) == PYKV_OK);
        }
        const size_t kb = kv_format_row_bytes(fmt, d), vb = kv_format_row_bytes(fmt, d);
        CHECK(cuda_upload(L.layer.k[g], l->k, (size_t)n[g] * kb) == PYKV_OK);
        CHECK(cuda_upload(L.layer.v[g], l->v, (size_t)n[g] * vb) == PYKV_OK);
        const size_t ints = (size_t)l->cap * sizeof(int32_t), pool = (size_t)l->pool_used * sizeof(float);
        char *host = malloc(2 * ints + pool + 4);
        memcpy(host, l->n_members, ints);
        memcpy(host + ints, l->member_at, ints);
        memcpy(host + 2 * ints, l->member_pool, pool);
        blocks[g] = dev_upload(host, 2 * ints + pool + 4);
        L.layer.members[g] = blocks[g];
        L.layer.members_cap[g] = l->cap;
        free(host);
    }
    // decode: the last token's heads over every entry
    char what[112];
    snprintf(what, sizeof(what), "merged decode kv=%s d=%d n_rep=%d n=%d,%d", kv_format_name(fmt), d, n_rep, n[0], n[1]);
    check_decode(&L, n, n_rep, what);
    // prefill: T tokens, token t over the first n[g] - T + t + 1 entries
    const size_t stride = (size_t)n_head * d, total = (size_t)T * stride;
    float *q = malloc(total * sizeof(float)), *want = malloc(total * sizeof(float)), *got = malloc(total * sizeof(float));
    float *w = malloc((size_t)ATTENTION_TILE * n[0] * sizeof(float));
    fill(q, total, -1.0f, 1.0f);
    for (int g = 0; g < n_kv; g++)
        for (int t = 0; t < T; t++)
            for (int r0 = 0; r0 < n_rep; r0 += ATTENTION_TILE) {
                const int nq = n_rep - r0 < ATTENTION_TILE ? n_rep - r0 : ATTENTION_TILE;
                const size_t off = (size_t)t * stride + (size_t)(g * n_rep + r0) * d;
                attention_group(q + off, nq, kv_cache_list(&L.cache, 0, g), n[g] - T + t + 1, d, w, want + off);
            }
    float *dq = dev_upload(q, total * sizeof(float)), *dout = dev_upload(NULL, total * sizeof(float));
    cuda_attention_prefill(NULL, &L.layer, dq, n_head, T, dout);
    dev_download(got, dout, total * sizeof(float));
    snprintf(what, sizeof(what), "merged prefill kv=%s d=%d n_rep=%d T=%d n=%d,%d", kv_format_name(fmt), d, n_rep, T,
             n[0], n[1]);
    report(what, nmse(got, want, total), 1e-6);
    cuda_free(dq); cuda_free(dout);
    for (int g = 0; g < n_kv; g++) cuda_free(blocks[g]);
    free(q); free(want); free(got); free(w); free(k); free(v);
    lists_free(&L);
}

// A prefill chunk of T tokens after n_before[g] entries (the chunk's own entries appended)
// against attention_flash in blocks of flash_tokens_per_block tokens.
static void test_prefill(int d, int fmt_k, int fmt_v, int n_rep, int T, int n_before) {
    const int n_kv = 2, n_head = n_kv * n_rep;
    int32_t n[2] = { n_before + T, n_before + 1 + T };
    struct lists L;
    lists_init(&L, n_kv, d, fmt_k, fmt_v, n, n[1]);
    const size_t stride = (size_t)n_head * d, total = (size_t)T * stride;
    float *q = malloc(total * sizeof(float)), *want = malloc(total * sizeof(float)), *got = malloc(total * sizeof(float));
    float *work = malloc(flash_work_floats(d, n_rep) * sizeof(float));
    fill(q, total, -1.0f, 1.0f);
    const int tpb = flash_tokens_per_block(n_rep);
    for (int g = 0; g < n_kv; g++) {
        const int nb = n[g] - T;
        for (int t0 = 0; t0 < T; t0 += tpb) {
            const int nt = T - t0 < tpb ? T - t0 : tpb;
            const size_t off = (size_t)t0 * stride + (size_t)g * n_rep * d;
            attention_flash(q + off, stride, nt, n_rep, nb + t0 + 1, kv_cache_list(&L.cache, 0, g), d, want + off,
                            stride, work);
        }
    }
    float *dq = dev_upload(q, total * sizeof(float)), *dout = dev_upload(NULL, total * sizeof(float));
    cuda_attention_prefill(NULL, &L.layer, dq, n_head, T, dout);
    dev_download(got, dout, total * sizeof(float));
    char what[96];
    snprintf(what, sizeof(what), "prefill k=%s v=%s d=%d n_rep=%d T=%d n_before=%d,%d", kv_format_name(fmt_k),
             kv_format_name(fmt_v), d, n_rep, T, n_before, n_before + 1);
    report(what, nmse(got, want, total), 1e-6);
    cuda_free(dq); cuda_free(dout);
    free(q); free(want); free(got); free(work);
    lists_free(&L);
}

int main(void) {
    if (!cuda_test_start("test_cuda_ops")) return CHECK_SKIP;
    CHECK(cuda_set_device(0) == PYKV_OK);

    const int lengths[] = { 1, 31, 256, 4096, 5003 };
    for (size_t i = 0; i < sizeof(lengths) / sizeof(lengths[0]); i++) {
        test_rmsnorm(lengths[i], 1, 0);
        test_rmsnorm(lengths[i], 7, i % 2);
    }
    test_rope(1, 4, 128, 128);
    test_rope(5, 3, 64, 64);
    test_rope(33, 8, 128, 64);   // partial rotary: the second half untouched
    test_rope(2, 2, 80, 32);
    const int64_t sw[] = { 1, 7, 1000, 3 * 11008 + 5 };
    for (size_t i = 0; i < sizeof(sw) / sizeof(sw[0]); i++) test_swiglu_add(sw[i], (int)(i % 2));

    for (int fk = 0; fk < KV_N_FORMATS; fk++)
        for (int fv = 0; fv < KV_N_FORMATS; fv++) {
            test_kv_append(fk, fv, 128, 2, 5, 7, 0, 0);
            test_kv_append(fk, fv, 64, 8, 0, 33, 0, 0);
            if (fk != KV_Q8_0 && fv != KV_Q8_0) test_kv_append(fk, fv, 40, 3, 2, 4, 0, 0);
            // with the RoPE: a decode step (SmolLM2's heads), a chunk (8 KV heads of 128,
            // n_rep 4), partial rotary
            test_kv_append(fk, fv, 64, 3, 9, 1, 3, 64);
            test_kv_append(fk, fv, 128, 8, 4, 21, 4, 128);
            test_kv_append(fk, fv, 64, 2, 0, 5, 2, 32);
        }

    const int reps[] = { 1, 3, 4, 8 };
    const int ns[] = { 1, 7, 255, 256, 257, 1000, 5000 };
    for (int fk = 0; fk < KV_N_FORMATS; fk++)
        for (int fv = 0; fv < KV_N_FORMATS; fv++) {
            test_decode(64, fk, fv, reps, 4, ns, 7);
            test_decode(128, fk, fv, reps, 4, ns, 7);
        }
    const int reps_more[] = { 6, 16 }, ns_more[] = { 33, 700, 3000 }, ns_long[] = { 70000 };
    test_decode(96, KV_F16, KV_Q8_0, reps_more, 2, ns_more, 3);
    test_decode(256, KV_Q8_0, KV_F16, reps_more, 2, ns_more, 3);
    test_decode(128, KV_F16, KV_F16, reps, 4, ns_long, 1);   // 256 segments of ~273
    // 8 KV heads: 128 blocks a head, so past 8192 entries a block takes a second segment
    const int reps_8b[] = { 1, 4 }, ns_8b[] = { 8200, 9000, 20000 };
    test_decode_kv(8, 128, KV_F16, KV_F16, reps_8b, 2, ns_8b, 3);

    const int Ts[] = { 1, 5, 64, 130, 512 }, nbs[] = { 0, 3, 1000 };
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 3; b++) {
            for (int fk = 0; fk < KV_N_FORMATS; fk++)
                for (int fv = 0; fv < KV_N_FORMATS; fv++) test_prefill(128, fk, fv, 4, Ts[a], nbs[b]);
            test_prefill(64, KV_F16, KV_F16, 1, Ts[a], nbs[b]);
            test_prefill(64, KV_Q8_0, KV_Q8_0, 8, Ts[a], nbs[b]);
            test_prefill(128, KV_F16, KV_F16, 3, Ts[a], nbs[b]);
            test_prefill(256, KV_F16, KV_F32, 2, Ts[a], nbs[b]);
            test_prefill(96, KV_F32, KV_F16, 6, Ts[a], nbs[b]);
        }
    test_prefill(128, KV_F16, KV_F16, 16, 70, 40);   // head groups: 16 heads of 128 > one block's rows
    // head sizes the tiles read a value at a time (34: not a multiple of 4, nor a divisor of
    // the block's threads) and a block of many rows (16)
    const int reps_small[] = { 1, 6 }, ns_small[] = { 5, 300 };
    test_decode(34, KV_F32, KV_F16, reps_small, 2, ns_small, 2);
    test_decode(16, KV_F16, KV_F16, reps_small, 2, ns_small, 2);
    test_prefill(34, KV_F16, KV_F32, 3, 70, 5);
    test_prefill(16, KV_F16, KV_F16, 6, 130, 40);
    for (int fmt = 0; fmt < KV_N_FORMATS; fmt++) {
        test_merged(64, fmt, 4, 300, 9);
        test_merged(128, fmt, 1, 2000, 40);
    }
    test_merged(128, KV_F16, 8, 20000, 3);   // many decode segments
    return check_report("test_cuda_ops");
}
