// test_cuda_policy_host.cu - the host twins of the policy kernels' math (ggml-cuda/
// topk-radix.cuh, window-math.cuh, window-scores.cu's layout) against the CPU policies'
// code, no GPU needed:
//  * top-k keys: key order equals ws_select_top's ranking (higher score, then lower index;
//    NaN as -inf, -0 as +0) on every pair of special values (NaN, inf, zeros, subnormals,
//    extremes) and on random bit patterns; keys are unique per list;
//  * the radix select as topk.cu runs it (8 digit passes with topk_pick_digit, then key >= the
//    k-th key in index order), emulated serially, against ws_select_top: n from 1 to 131072,
//    k = -1, 0, 1, n - 5 .. n + 3, scores from a few values (ties), with NaN, inf, -0 and
//    subnormals; the same set, bit for bit;
//  * GQA reduce and pooling per element (win_gqa_at, win_pool_at) against ws_gqa_reduce and
//    ws_pool1d: groups 1, 2, 3, 4, 8, mean and max; kernels 1 to 2n + 1, max and avg; n = 1
//    and odd sizes; equal bits;
//  * the window scores as window-scores.cu computes them (tiles of entries, chunks of rows,
//    the warp's dot product, per-tile softmax sums merged in tile order, Welford per column),
//    emulated serially with window-math.cuh, against ws_stats_compute (mean, variance) and
//    ws_layer_scores: keys f32, f16, q8_0; head_dim 64 and 128; GQA groups 1, 3, 4; ragged
//    lists, one without candidates, lists past one tile, rows < protect < T, rows > WIN_RC;
//    NMSE <= 1e-9; and cuda_window_layout against ws_stats's offsets.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// kv-cache.h is C11: its counters are `_Atomic int64_t`, which C++ does not spell. A plain
// volatile int64_t has the same size and alignment, so the struct's layout is the C one.
#define _Atomic volatile
extern "C" {
#include "core/threadpool.h"
#include "kv/kv-cache.h"
#include "kv/policies/common/window-scores.h"
#include "model/model.h"
}
#undef _Atomic

#include "ggml-cuda/policy-kernels.h"
#include "ggml-cuda/topk-radix.cuh"
#include "ggml-cuda/window-math.cuh"

#define CUDA_CHECK_SEED 0x2545F4914F6CDD1Dull
#include "cuda-check.h"

static_assert(CUDA_KV_F32 == KV_F32 && CUDA_KV_F16 == KV_F16 && CUDA_KV_Q8_0 == KV_Q8_0, "the formats' numbers");
static_assert(WS_POOL_MAX == 0 && WS_POOL_AVG == 1 && WS_GQA_MEAN == 0 && WS_GQA_MAX == 1, "the option numbers");
static_assert(WIN_MAX_D == PYKV_MAX_HEAD_DIM, "the longest head");

// ---- top-k keys ----

// ws_select_top's ranking (window-select.c's ranks_below, turned round).
static int outranks(float a, int64_t ia, float b, int64_t ib) {
    if (isnan(a)) a = -INFINITY;
    if (isnan(b)) b = -INFINITY;
    return a > b || (a == b && ia < ib);
}

static int key_mismatches;
static void check_key_pair(float a, uint32_t ia, float b, uint32_t ib) {
    const uint64_t ka = topk_key(a, ia), kb = topk_key(b, ib);
    const int want = outranks(a, ia, b, ib), got = ka > kb;
    const int want_eq = ia == ib && !want && !outranks(b, ib, a, ia);   // unique per index
    if ((want != got || want_eq != (ka == kb)) && key_mismatches++ < 10)
        fprintf(stderr, "key order: %a@%u vs %a@%u: CPU %d, key %d\n", a, ia, b, ib, want, got);
}

static void test_key_order(void) {
    key_mismatches = 0;
    const float special[] = { NAN, -NAN, u2f(0x7F800001u), u2f(0xFFC12345u), INFINITY, -INFINITY, 0.0f, -0.0f,
                              1e-40f, -1e-40f, u2f(1), u2f(0x80000001u), 1.17549435e-38f, -1.17549435e-38f,
                              1.0f, -1.0f, 0.5f, -0.5f, 3.4028235e38f, -3.4028235e38f, 1.0000001f, 0.99999994f };
    const int ns = (int)(sizeof(special) / sizeof(special[0]));
    const uint32_t ids[] = { 0, 1, 2, 7, 131071, 0xFFFFFFFEu };
    long pairs = 0;
    for (int a = 0; a < ns; a++)
        for (int b = 0; b < ns; b++)
            for (int i = 0; i < 6; i++)
                for (int j = 0; j < 6; j++, pairs++) check_key_pair(special[a], ids[i], special[b], ids[j]);
    for (int rep = 0; rep < 1000000; rep++, pairs++) {
        const uint32_t ua = next_u32() ^ (next_u32() << 16);
        const uint32_t ub = rep % 3 == 0 ? ua ^ (next_u32() & 0x80000000u) : next_u32() ^ (next_u32() << 16);
        check_key_pair(u2f(ua), (uint32_t)next_int(1000), u2f(ub), (uint32_t)next_int(1000));
    }
    printf("key order: %ld pairs, %d mismatches\n", pairs, key_mismatches);
    CHECK(key_mismatches == 0);
}

// topk.cu's select_top_kernel on one list, serially: the same passes, the same steps.
static int64_t emulate_select(const float *s, int32_t n, int32_t k, int32_t *out) {
    if (n < 0) n = 0;
    k = k < 0 ? 0 : k > n ? n : k;
    if (k == 0) return 0;
    if (k == n) {
        for (int32_t j = 0; j < n; j++) out[j] = j;
        return k;
    }
    uint64_t prefix = 0, mask = 0;
    uint32_t need = (uint32_t)k, hist[TOPK_BINS];
    for (int shift = 64 - TOPK_RADIX_BITS; shift >= 0; shift -= TOPK_RADIX_BITS) {
        memset(hist, 0, sizeof(hist));
        for (int32_t j = 0; j < n; j++) {
            const uint64_t key = topk_key(s[j], (uint32_t)j);
            if ((key & mask) == prefix) hist[topk_digit(key, shift)]++;
        }
        prefix |= (uint64_t)topk_pick_digit(hist, &need) << shift;
        mask |= (uint64_t)(TOPK_BINS - 1) << shift;
    }
    CHECK(need == 1);
    int64_t m = 0;
    for (int32_t j = 0; j < n; j++)
        if (topk_key(s[j], (uint32_t)j) >= prefix) out[m++] = j;
    return m;
}

static int select_cases, select_bad;
static void check_select(const float *s, int32_t n, int32_t k) {
    int64_t *want = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t)), n_want = -1;
    int32_t *got = (int32_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    CHECK(ws_select_top(s, n, k, want, &n_want) == PYKV_OK);
    const int64_t n_got = emulate_select(s, n, k, got);
    int bad = n_got != n_want;
    for (int64_t j = 0; !bad && j < n_got; j++) bad = got[j] != want[j];
    select_cases++;
    if (bad && select_bad++ < 10) fprintf(stderr, "select n=%d k=%d: CPU %lld entries, radix %lld\n", n, k,
                                          (long long)n_want, (long long)n_got);
    free(want);
    free(got);
}

static void test_select(void) {
    select_cases = select_bad = 0;
    const int32_t ns[] = { 1, 2, 3, 5, 6, 17, 255, 256, 257, 1000, 4099 };
    float *s = (float *)malloc(131072 * sizeof(float));
    for (size_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++)
        for (int kind = 0; kind < 4; kind++) {
            const int32_t n = ns[a];
            fill_scores(s, n, kind);
            const int32_t ks[] = { -1, 0, 1, 2, n / 2, n / 3 + 1, n - 5, n - 4, n - 1, n, n + 3 };
            for (size_t b = 0; b < sizeof(ks) / sizeof(ks[0]); b++) check_select(s, n, ks[b]);
        }
    for (int kind = 0; kind < 4; kind++) {   // the longest lists
        fill_scores(s, 131072, kind);
        check_select(s, 131072, 4096);
        check_select(s, 131072, 131071);
        check_select(s, 131072, 65537);
    }
    printf("radix select: %d lists, %d differ from ws_select_top\n", select_cases, select_bad);
    CHECK(select_bad == 0);
    free(s);
}

// ---- GQA reduce and pooling ----

static void test_reduce_pool(void) {
    const int32_t ns[] = { 1, 2, 3, 7, 100, 1001 };
    const int32_t groups[] = { 1, 2, 3, 4, 8 };
    long bad_reduce = 0, bad_pool = 0, n_checked = 0;
    for (size_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++) {
        const int32_t n = ns[a];
        for (size_t b = 0; b < sizeof(groups) / sizeof(groups[0]); b++) {
            const int32_t G = groups[b];
            const int64_t stride = n + (b % 2 ? 5 : 0);   // the stats' layout, and a wider one
            float *rows = (float *)malloc((size_t)stride * G * sizeof(float));
            float *want = (float *)malloc((size_t)n * sizeof(float)), *got = (float *)malloc((size_t)n * sizeof(float));
            for (int64_t i = 0; i < stride * G; i++)   // probabilities, with ties and exact zeros
                rows[i] = next_int(7) == 0 ? 0.0f : next_int(5) == 0 ? 0.25f : uniform(0.0f, 1e-2f);
            for (int mode = 0; mode < 2; mode++) {
                ws_gqa_reduce(rows, stride, G, n, (enum ws_gqa)mode, want);
                for (int32_t j = 0; j < n; j++) got[j] = win_gqa_at(rows, stride, G, j, mode == WS_GQA_MAX);
                bad_reduce += memcmp(got, want, (size_t)n * sizeof(float)) != 0;
                n_checked++;
                // pool the reduced row as ws_layer_scores does
                const int32_t kernels[] = { 1, 3, 5, 7, 9, 15, 2 * n + 1 };
                float *x = (float *)malloc((size_t)n * sizeof(float));
                memcpy(x, want, (size_t)n * sizeof(float));
                if (n > 3) x[n / 2] = -x[n / 2] - 1.0f;   // a negative value inside
                for (size_t c = 0; c < sizeof(kernels) / sizeof(kernels[0]); c++)
                    for (int type = 0; type < 2; type++) {
                        ws_pool1d(x, n, kernels[c], (enum ws_pool)type, want);
                        for (int32_t j = 0; j < n; j++) got[j] = win_pool_at(x, n, kernels[c], type == WS_POOL_AVG, j);
                        bad_pool += memcmp(got, want, (size_t)n * sizeof(float)) != 0;
                        n_checked++;
                    }
                free(x);
            }
            free(rows); free(want); free(got);
        }
    }
    printf("GQA reduce and pooling: %ld rows, %ld reduce and %ld pooling rows differ\n", n_checked, bad_reduce,
           bad_pool);
    CHECK(bad_reduce == 0);
    CHECK(bad_pool == 0);
}

// ---- window scores ----

// The warp's butterfly (warp_sum) over 32 lane values.
static float warp_sum_host(float *v) {
    for (int o = CUDA_WARP / 2; o > 0; o >>= 1) {
        float t[CUDA_WARP];
        for (int l = 0; l < CUDA_WARP; l++) t[l] = v[l] + v[l ^ o];
        memcpy(v, t, sizeof(t));
    }
    return v[0];
}

// The logit tile_logits gives query q and stored key krow.
static float emulate_logit(const float *q, const void *krow, int fmt, int d, float scale) {
    float part[CUDA_WARP];
    for (int lane = 0; lane < CUDA_WARP; lane++) {
        float kreg[WIN_KREG];
        win_lane_key(krow, fmt, d, lane, kreg);
        part[lane] = win_lane_dot(q, kreg, d, lane);
    }
    return warp_sum_host(part) * scale;
}

struct win_case {
    int     fmt, d, n_kv, group, T, rows, protect, pool, kernel, gqa;
    int32_t n[8];
};

// window-scores.cu's steps for one layer, serially; mean, var in the ws_stats layout, scores
// per KV head.
static void emulate_window(const struct kv_cache *c, const float *q, const struct win_case *wc, float *mean,
                           float *var, float *scores) {
    const int d = wc->d, n_head = wc->n_kv * wc->group, rows = wc->rows;
    const float scale = 1.0f / sqrtf((float)d);
    int32_t n_cand[8];
    int64_t off[8];
    struct cuda_kv_layer layer;
    memset(&layer, 0, sizeof(layer));
    layer.n_head_kv = wc->n_kv;
    for (int g = 0; g < wc->n_kv; g++) layer.n[g] = wc->n[g];
    cuda_window_layout(&layer, wc->protect, n_cand, off);
    for (int h = 0; h < n_head; h++) {
        const int g = h / wc->group;
        const int32_t n = wc->n[g], nc = n_cand[g];
        if (nc <= 0) continue;
        const struct kv_list *l = &c->lists[g];
        const int n_tiles = (n + WIN_TJ - 1) / WIN_TJ;
        float2 *part = (float2 *)malloc((size_t)rows * n_tiles * sizeof(float2));
        float *P = (float *)malloc((size_t)rows * n * sizeof(float));   // every logit, [r][j]
        for (int r = 0; r < rows; r++)
            for (int32_t j = 0; j < n; j++)
                P[(size_t)r * n + j] = emulate_logit(q + ((size_t)win_token(wc->T, rows, r) * n_head + h) * d,
                                                     kv_key_row(l, j, d), l->fmt_k, d, scale);
        // step 1: per (row, tile) max and sum, lanes over the tile's entries
        for (int tile = 0; tile < n_tiles; tile++) {
            const int j0 = tile * WIN_TJ, kt = n - j0 < WIN_TJ ? n - j0 : WIN_TJ;
            for (int r = 0; r < rows; r++) {
                int vis = win_visible(n, rows, r) - j0;
                vis = vis < kt ? vis : kt;
                const float *x = P + (size_t)r * n + j0;
                float m = -INFINITY, lanes[CUDA_WARP];
                for (int jl = 0; jl < vis; jl++) m = fmaxf(m, x[jl]);
                for (int lane = 0; lane < CUDA_WARP; lane++) {
                    lanes[lane] = 0.0f;
                    if (m != -INFINITY)
                        for (int jl = lane; jl < vis; jl += CUDA_WARP) lanes[lane] += expf(x[jl] - m);
                }
                part[(size_t)r * n_tiles + tile] = make_float2(m, warp_sum_host(lanes));
            }
        }
        // steps 2 and 3: merge the tiles a row sees, then Welford over the rows
        float2 *ml = (float2 *)malloc((size_t)rows * sizeof(float2));
        for (int r = 0; r < rows; r++) {
            const int32_t vis = win_visible(n, rows, r);
            float M, L;
            win_combine(part + (size_t)r * n_tiles, (vis + WIN_TJ - 1) / WIN_TJ, &M, &L);
            ml[r] = make_float2(M, L > 0.0f ? 1.0f / L : 0.0f);
        }
        for (int32_t j = 0; j < nc; j++) {
            double mu = 0.0, m2 = 0.0;
            for (int r = 0; r < rows; r++) win_welford(&mu, &m2, win_prob(P[(size_t)r * n + j], ml[r].x, ml[r].y), r + 1);
            const int64_t at = off[g] * wc->group + (int64_t)(h - g * wc->group) * nc + j;
            mean[at] = (float)mu;
            var[at] = win_variance(m2, rows);
        }
        free(part); free(P); free(ml);
    }
    // step 4
    for (int g = 0; g < wc->n_kv; g++) {
        const int32_t nc = n_cand[g];
        float *red = (float *)malloc((size_t)(nc > 0 ? nc : 1) * sizeof(float));
        for (int32_t j = 0; j < nc; j++) red[j] = win_gqa_at(mean + off[g] * wc->group, nc, wc->group, j, wc->gqa == 1);
        for (int32_t j = 0; j < nc; j++) scores[off[g] + j] = win_pool_at(red, nc, wc->kernel, wc->pool == 1, j);
        free(red);
    }
}

static void test_window(const struct win_case *wc, struct threadpool *pool) {
    const int d = wc->d, n_head = wc->n_kv * wc->group;
    int32_t n_max = 0;
    for (int g = 0; g < wc->n_kv; g++) n_max = wc->n[g] > n_max ? wc->n[g] : n_max;
    struct kv_cache c;
    CHECK(kv_cache_init(&c, 1, wc->n_kv, d, n_max, wc->fmt, wc->fmt) == PYKV_OK);
    float *k = (float *)malloc((size_t)d * sizeof(float)), *v = (float *)malloc((size_t)d * sizeof(float));
    for (int g = 0; g < wc->n_kv; g++) {
        struct kv_list *l = kv_cache_list(&c, 0, g);
        CHECK(kv_list_reserve(&c, l, wc->n[g]) == PYKV_OK);
        for (int32_t j = 0; j < wc->n[g]; j++) {
            for (int i = 0; i < d; i++) { k[i] = uniform(-2.0f, 2.0f); v[i] = 0.0f; }
            kv_list_push(&c, l, k, v, j);
        }
    }
    const size_t nq = (size_t)wc->T * n_head * d;
    float *q = (float *)malloc(nq * sizeof(float));
    for (size_t i = 0; i < nq; i++) q[i] = uniform(-1.0f, 1.0f);

    struct hparams hp;
    memset(&hp, 0, sizeof(hp));
    hp.n_head = n_head;
    hp.n_head_kv = wc->n_kv;
    hp.head_dim = d;
    hp.n_layer = 1;
    struct policy_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.cache = &c;
    ev.hp = &hp;
    ev.pool = pool;
    ev.layer = 0;
    ev.q = q;
    ev.T = wc->T;
    ev.n_prompt = wc->T;
    ev.is_last_chunk = 1;
    struct ws_window w;
    w.protect = wc->protect;
    w.rows = wc->rows;
    struct ws_opts o;
    o.window = wc->protect;
    o.pool = (enum ws_pool)wc->pool;
    o.kernel = wc->kernel;
    o.gqa = (enum ws_gqa)wc->gqa;

    struct ws_stats st, st2;
    float *want_scores = NULL;
    CHECK(ws_stats_compute(&ev, w, 1, &st) == PYKV_OK);
    CHECK(ws_layer_scores(&ev, &o, w, &st2, &want_scores) == PYKV_OK);

    struct cuda_kv_layer layer;
    memset(&layer, 0, sizeof(layer));
    layer.n_head_kv = wc->n_kv;
    layer.head_dim = d;
    layer.fmt_k = layer.fmt_v = wc->fmt;
    for (int g = 0; g < wc->n_kv; g++) layer.n[g] = wc->n[g];
    int32_t n_cand[8];
    int64_t off[8];
    const int64_t total = cuda_window_layout(&layer, wc->protect, n_cand, off);
    int layout_ok = total == st.total && st.group == wc->group;
    for (int g = 0; g < wc->n_kv; g++)
        layout_ok &= n_cand[g] == st.n_cand[g] && off[g] == st.offset_kv[g] && off[g] * wc->group == st.offset[g];
    CHECK(layout_ok);
    struct cuda_window_args a = { n_head, wc->T, wc->rows, wc->protect, wc->pool, wc->kernel, wc->gqa };
    CHECK(cuda_window_work_bytes(&layer, &a) > 0);

    const size_t n_out = (size_t)total * wc->group;
    float *mean = (float *)calloc(n_out ? n_out : 1, sizeof(float)), *var = (float *)calloc(n_out ? n_out : 1, sizeof(float));
    float *scores = (float *)calloc(total ? total : 1, sizeof(float));
    emulate_window(&c, q, wc, mean, var, scores);
    const double e_mean = nmse(mean, st.mean, n_out), e_var = nmse(var, st.var, n_out);
    const double e_scores = nmse(scores, want_scores, (size_t)total);
    printf("window k=%s d=%d G=%d n_kv=%d T=%d rows=%d protect=%d %s%d gqa=%s: NMSE mean %.2e var %.2e scores %.2e\n",
           kv_format_name(wc->fmt), d, wc->group, wc->n_kv, wc->T, wc->rows, wc->protect, wc->pool ? "avg" : "max",
           wc->kernel, wc->gqa ? "max" : "mean", e_mean, e_var, e_scores);
    CHECK(e_mean <= 1e-9);
    CHECK(e_var <= 1e-9);
    CHECK(e_scores <= 1e-9);
    free(mean); free(var); free(scores); free(want_scores); free(q); free(k); free(v);
    ws_stats_free(&st);
    ws_stats_free(&st2);
    kv_cache_free(&c);
}

int main(void) {
    test_key_order();
    test_select();
    test_reduce_pool();

    struct threadpool *pool = threadpool_create(1);
    CHECK(pool != NULL);
    if (pool) {
        const struct win_case cases[] = {
            // fmt d n_kv G T rows protect pool kernel gqa, then n per KV head
            { KV_F32, 64, 2, 1, 8, 8, 8, WS_POOL_MAX, 7, WS_GQA_MEAN, { 100, 37 } },
            { KV_F16, 128, 2, 4, 32, 32, 32, WS_POOL_MAX, 7, WS_GQA_MEAN, { 300, 257 } },
            { KV_Q8_0, 128, 2, 3, 16, 16, 16, WS_POOL_AVG, 5, WS_GQA_MAX, { 129, 128 } },
            { KV_Q8_0, 64, 3, 4, 20, 12, 20, WS_POOL_AVG, 9, WS_GQA_MEAN, { 400, 20, 21 } },   // rows < protect < T; no candidates in list 1
            { KV_F16, 64, 1, 3, 50, 40, 48, WS_POOL_MAX, 1, WS_GQA_MAX, { 333 } },             // rows > WIN_RC
            { KV_F32, 128, 4, 1, 1, 1, 1, WS_POOL_AVG, 3, WS_GQA_MEAN, { 2, 5, 1, 130 } },    // one row: variance 0
            { KV_F16, 128, 2, 4, 64, 33, 40, WS_POOL_AVG, 7, WS_GQA_MEAN, { 41, 1000 } },      // a single candidate
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_window(&cases[i], pool);
        threadpool_free(pool);
    }
    return check_report("test_cuda_policy_host");
}
