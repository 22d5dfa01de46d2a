// test_cuda_blocks.cu - the host twins of the CUDA matrix kernels' block math
// (ggml-cuda/quant-blocks.cuh), run on the CPU, against the CPU's own code: each weight type's
// group decoder against pykv_dequantize (bit for bit), the Q8_1 activation quantiser against
// quantize_row_q8_act_scalar (bit for bit), and the integer group dot products against a
// float sum over the dequantised weights and activations and against the CPU's integer dots.
// The kernels' per-thread pieces (matmul-tiles.cuh) are then run for every thread of a launch,
// as the kernels would run them, so their indexing and tails are checked too: the few-row
// path against the CPU's q8 dots, the tensor-core path (its wmma products done as plain float
// sums over the f16 tiles) against the exact product. The kernels that quantise straight from
// an RMSNorm or a SwiGLU (norm-quant.cu) are run the same way, their warp quantiser's lanes
// one after another, against rmsnorm_scalar / swiglu_scalar and quantize_row_q8_act_scalar,
// bit for bit. No GPU needed.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-cuda/matmul-tiles.cuh"
#include "ggml-cuda/norm-quant.cuh"
#include "ggml-cuda/quant-blocks.cuh"

// The CPU's private headers are C11: their _Static_assert is C++'s static_assert.
#define _Static_assert static_assert
extern "C" {
#include "cpu/ops.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant-q8.h"
#include "cpu/quant.h"
#include "model/types.h"
}
#undef _Static_assert

#define CUDA_CHECK_SEED 0x9E3779B97F4A7C15ull
#include "cuda-check.h"

static_assert(sizeof(dev_block_q4_0) == sizeof(block_q4_0), "q4_0");
static_assert(sizeof(dev_block_q4_1) == sizeof(block_q4_1), "q4_1");
static_assert(sizeof(dev_block_q5_0) == sizeof(block_q5_0), "q5_0");
static_assert(sizeof(dev_block_q5_1) == sizeof(block_q5_1), "q5_1");
static_assert(sizeof(dev_block_q8_0) == sizeof(block_q8_0), "q8_0");
static_assert(sizeof(dev_block_q4_K) == sizeof(block_q4_K), "q4_K");
static_assert(sizeof(dev_block_q5_K) == sizeof(block_q5_K), "q5_K");
static_assert(sizeof(dev_block_q6_K) == sizeof(block_q6_K), "q6_K");
static_assert(sizeof(dev_block_q8_1) == sizeof(block_q8_act), "q8_1");
static_assert(offsetof(dev_block_q8_1, qs) == offsetof(block_q8_act, qs), "q8_1 qs");

// About normal: a sum of four uniforms in [-1, 1), scaled to variance 1.
static float rnd_normal(void) {
    float s = 0.0f;
    for (int i = 0; i < 4; i++) s += uniform(-1.0f, 1.0f);
    return s * 0.866f;
}

// A random finite f16 scale: mostly ordinary magnitudes of either sign, sometimes zero or an
// f16 subnormal (small models' scales can be).
static uint16_t rnd_scale(void) {
    const uint32_t k = next_u32() % 16;
    if (k == 0) return 0;
    if (k == 1) return (uint16_t)((1 + next_u32() % 0x3FF) | (next_u32() & 1) << 15);   // subnormal
    float v = 0.001f + 0.05f * uniform(0.0f, 1.0f);
    if (next_u32() & 1) v = -v;
    return fp32_to_fp16(v);
}

static void put_f16(uint8_t *p, uint16_t h) { memcpy(p, &h, 2); }

struct type_case {
    int32_t type;
    const char *name;
    int qk, bytes;
    int f16_at[2];   // offsets of the block's f16 fields (-1: none)
};

static const type_case TYPES[] = {
    { PYKV_TYPE_Q4_0, "q4_0", 32, 18, { 0, -1 } },
    { PYKV_TYPE_Q4_1, "q4_1", 32, 20, { 0, 2 } },
    { PYKV_TYPE_Q5_0, "q5_0", 32, 22, { 0, -1 } },
    { PYKV_TYPE_Q5_1, "q5_1", 32, 24, { 0, 2 } },
    { PYKV_TYPE_Q8_0, "q8_0", 32, 34, { 0, -1 } },
    { PYKV_TYPE_Q4_K, "q4_K", 256, 144, { 0, 2 } },
    { PYKV_TYPE_Q5_K, "q5_K", 256, 176, { 0, 2 } },
    { PYKV_TYPE_Q6_K, "q6_K", 256, 210, { 208, -1 } },
};

// n_blocks random blocks: random bytes, then valid finite f16 fields.
static void random_blocks(const type_case &tc, uint8_t *buf, int n_blocks) {
    for (int i = 0; i < n_blocks * tc.bytes; i++) buf[i] = (uint8_t)next_u32();
    for (int b = 0; b < n_blocks; b++)
        for (int f = 0; f < 2; f++)
            if (tc.f16_at[f] >= 0) put_f16(buf + b * tc.bytes + tc.f16_at[f], rnd_scale());
}

// Decoding: every group, through the run-time dispatch and through the type's block decoder,
// against pykv_dequantize.
static void test_decode(const type_case &tc, const uint8_t *w, int n_blocks) {
    const int64_t n = (int64_t)n_blocks * tc.qk;
    float *ref = (float *)malloc((size_t)n * sizeof(float));
    float *got = (float *)malloc((size_t)n * sizeof(float));
    CHECK(pykv_dequantize(tc.type, w, n, ref) == PYKV_OK);

    int64_t bad = 0, first = -1;
    for (int64_t gi = 0; gi < n / 32; gi++) {
        qgroup g;
        CHECK(qgroup_unpack(tc.type, w, gi, g) == 1);
        qgroup_decode(g, got + 32 * gi);
    }
    for (int64_t i = 0; i < n; i++)
        if (f2u(got[i]) != f2u(ref[i])) { bad++; if (first < 0) first = i; }
    if (bad) fprintf(stderr, "%s: group decode: %lld of %lld differ, first at %lld: %g vs %g\n", tc.name, (long long)bad,
                     (long long)n, (long long)first, got[first], ref[first]);
    CHECK(bad == 0);

    memset(got, 0, (size_t)n * sizeof(float));
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t *blk = w + (size_t)b * tc.bytes;
        float *y = got + (size_t)b * tc.qk;
        switch (tc.type) {
        case PYKV_TYPE_Q4_0: block_decode<qt_q4_0>(blk, y); break;
        case PYKV_TYPE_Q4_1: block_decode<qt_q4_1>(blk, y); break;
        case PYKV_TYPE_Q5_0: block_decode<qt_q5_0>(blk, y); break;
        case PYKV_TYPE_Q5_1: block_decode<qt_q5_1>(blk, y); break;
        case PYKV_TYPE_Q8_0: block_decode<qt_q8_0>(blk, y); break;
        case PYKV_TYPE_Q4_K: block_decode<qt_q4_K>(blk, y); break;
        case PYKV_TYPE_Q5_K: block_decode<qt_q5_K>(blk, y); break;
        case PYKV_TYPE_Q6_K: block_decode<qt_q6_K>(blk, y); break;
        }
    }
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += f2u(got[i]) != f2u(ref[i]);
    CHECK(bad == 0);
    printf("%-5s decode: %lld values of %d blocks, %lld differ\n", tc.name, (long long)n, n_blocks, (long long)bad);
    free(ref);
    free(got);
}

// n activations with a spread of block magnitudes, an all-zero block and an outlier.
static void random_acts(float *x, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float scale = b % 5 == 3 ? 0.0f : powf(10.0f, 2.0f * uniform(-1.0f, 1.0f));
        for (int j = 0; j < 32; j++) x[32 * b + j] = scale * rnd_normal();
        if (b % 7 == 2) x[32 * b + next_u32() % 32] = 40.0f * scale;
    }
}

// Blocks a[0..n) against the CPU's b[0..n): d, s and the quants bit for bit (NaN d and s where
// both are NaN); returns how many differ.
static int blocks_differ(const dev_block_q8_1 *a, const block_q8_act *b, int64_t n, const char *what) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const bool nan_ok = isnan(a[i].d) && isnan(b[i].d) && isnan(a[i].s) && isnan(b[i].s);
        const bool same = (nan_ok || (f2u(a[i].d) == f2u(b[i].d) && f2u(a[i].s) == f2u(b[i].s))) &&
                          memcmp(a[i].qs, b[i].qs, 32) == 0;
        if (!same && bad++ < 3)
            fprintf(stderr, "%s block %lld: d %g vs %g, s %g vs %g\n", what, (long long)i, a[i].d, b[i].d, a[i].s, b[i].s);
    }
    return bad;
}

// The quantisers' activations: random_acts' blocks, then one with a NaN, one with an -inf,
// one of float subnormals and one whose values are ties at .5 after scaling.
static void quantiser_inputs(float *x, int64_t n) {
    random_acts(x, n);
    x[32 * 5 + 3] = NAN;
    x[32 * 9 + 31] = -INFINITY;
    for (int j = 0; j < 32; j++) x[32 * 11 + j] = 1e-39f * (float)(j - 16);   // float subnormals
    for (int j = 0; j < 32; j++) x[32 * 13 + j] = (float)(j - 16) * 0.5f;      // ties at .5 after scaling
}

// The Q8_1 quantiser against the CPU's, bit for bit (also non-finite and tiny blocks).
static void test_quantize(void) {
    const int64_t n = 32 * 64;
    float *x = (float *)malloc(n * sizeof(float));
    quantiser_inputs(x, n);
    block_q8_act *ref = (block_q8_act *)malloc(Q8_ACT_BLOCKS(n) * sizeof(block_q8_act));
    quantize_row_q8_act_scalar(x, ref, n);
    dev_block_q8_1 *a = (dev_block_q8_1 *)malloc((size_t)(n / 32) * sizeof(dev_block_q8_1));
    for (int64_t b = 0; b < n / 32; b++) q8_1_quantize_block(x + 32 * b, a + b);
    const int bad = blocks_differ(a, ref, n / 32, "q8_1 quantise");
    CHECK(bad == 0);
    printf("q8_1 quantise: %lld blocks, %d differ from quantize_row_q8_act_scalar\n", (long long)(n / 32), bad);
    free(x);
    free(ref);
    free(a);
}

// Group dot products: each against the float sum over the dequantised weights and the
// dequantised activations (in double), and the row sum against the CPU's integer dot.
static void test_dot(const type_case &tc, const uint8_t *w, int n_blocks) {
    const int64_t n = (int64_t)n_blocks * tc.qk;
    float *wf = (float *)malloc((size_t)n * sizeof(float));
    float *x = (float *)malloc((size_t)n * sizeof(float));
    CHECK(pykv_dequantize(tc.type, w, n, wf) == PYKV_OK);
    random_acts(x, n);
    block_q8_act *xq = (block_q8_act *)malloc(Q8_ACT_BLOCKS(n) * sizeof(block_q8_act));
    quantize_row_q8_act_scalar(x, xq, n);

    double worst = 0.0, row_sum = 0.0, row_mag = 0.0;
    int bad = 0;
    for (int64_t gi = 0; gi < n / 32; gi++) {
        dev_block_q8_1 a;
        q8_1_quantize_block(x + 32 * gi, &a);
        qgroup g;
        qgroup_unpack(tc.type, w, gi, g);
        int32_t words[8];
        q8_1_words(&a, words);
        const float got = qgroup_dot_q8_1(g, words, a.d, a.s);

        double ref = 0.0, mag = 0.0;
        for (int j = 0; j < 32; j++) {
            const double av = (double)a.d * a.qs[j];
            ref += (double)wf[32 * gi + j] * av;
            mag += (fabs((double)g.d[j / 16] * (int8_t)(g.q[j / 4] >> (8 * (j % 4)))) + fabs((double)g.m)) * fabs(av);
        }
        const double err = fabs((double)got - ref), tol = 4e-6 * mag + 1e-30;
        if (!(err <= tol)) {
            if (bad++ < 5) fprintf(stderr, "%s group %lld: dot %.9g vs %.9g (mag %g)\n", tc.name, (long long)gi, got, ref, mag);
        } else if (mag > 0 && err / mag > worst) {
            worst = err / mag;
        }
        row_sum += got;
        row_mag += mag;
    }
    CHECK(bad == 0);

    const vec_dot_q8_fn cpu = vec_dot_q8_scalar_for(tc.type);
    CHECK(cpu != NULL);
    const double cpu_dot = cpu ? cpu(w, xq, n) : 0.0;
    const double row_err = fabs(row_sum - cpu_dot) / (row_mag > 0 ? row_mag : 1.0);
    CHECK(row_err < 1e-5);
    printf("%-5s dot: %lld groups, worst group error %.2e of its magnitude, row vs the CPU's q8 dot %.2e\n", tc.name,
           (long long)(n / 32), worst, row_err);
    free(wf);
    free(x);
    free(xq);
}

// The float weight types: every f16 and bf16 bit pattern.
static void test_float_types(void) {
    int bad16 = 0, badbf = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        const uint16_t v = (uint16_t)h;
        const float a = weight_f16_at(&v, 0), b = fp16_to_fp32(v);
        if (!(f2u(a) == f2u(b) || (isnan(a) && isnan(b)))) bad16++;
        const float c = weight_bf16_at(&v, 0), d = bf16_to_fp32(v);
        if (!(f2u(c) == f2u(d) || (isnan(c) && isnan(d)))) badbf++;
    }
    CHECK(bad16 == 0);
    CHECK(badbf == 0);
    const float f = 1.25f;
    CHECK(weight_f32_at(&f, 0) == 1.25f);
    printf("f16/bf16: all 65536 patterns, %d / %d differ\n", bad16, badbf);
}

static void test_row_bytes(void) {
    const int32_t types[] = { PYKV_TYPE_F32, PYKV_TYPE_F16, PYKV_TYPE_BF16, PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1,
                              PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K,
                              PYKV_TYPE_Q6_K };
    const int64_t cols[] = { 256, 768, 4096, 14336 };
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        for (size_t j = 0; j < 4; j++) CHECK(qtype_row_bytes(types[i], cols[j]) == type_row_bytes(types[i], cols[j]));
    CHECK(qtype_row_bytes(PYKV_TYPE_Q2_K, 256) == 0);
}

static void test_helpers(void) {
    // dp4a sign-extends each byte; vsub4 keeps the bytes apart.
    CHECK(dp4a((int)0x80FF017Fu, (int)0x02FF7F81u, 5) == 5 + 127 * -127 + 1 * 127 + -1 * -1 + -128 * 2);
    CHECK(vsub4(0x000F0803u, 0x08080808u) == 0xF80700FBu);
    CHECK(spread4_bit4(0xFu) == 0x10101010u);
    CHECK(spread4_bit4(0x5u) == 0x00100010u);
}

// ---- the fused RMSNorm / SwiGLU quantisers (norm-quant.cu), run on the CPU ----

// q8_1_quantize_warp with the 32 lanes run one after another: each shuffle reduction as the
// butterfly it is (lane l combines its value with lane l ^ o's, o = 16, 8, ..., 1), then
// lane l's own steps; lane 0 writes d and s.
static void emulate_quantize_warp(const float v[32], dev_block_q8_1 *y) {
    bool finite = true;
    for (int l = 0; l < 32; l++) finite = finite && isfinite(v[l]);
    float m[32], mt[32];
    for (int l = 0; l < 32; l++) m[l] = fabsf(v[l]);
    for (int o = 16; o > 0; o >>= 1) {
        for (int l = 0; l < 32; l++) mt[l] = fmaxf(m[l], m[l ^ o]);
        memcpy(m, mt, sizeof(m));
    }
    if (!finite) {
        for (int l = 0; l < 32; l++) y->qs[l] = 0;
        y->d = y->s = NAN;
        return;
    }
    int q[32], qt[32];
    float d0 = 0.0f;
    for (int l = 0; l < 32; l++) {
        float d, id;
        q8_1_scale(m[l], &d, &id);
        q[l] = q8_1_round(v[l], id);
        y->qs[l] = (int8_t)q[l];
        if (l == 0) d0 = d;
    }
    for (int o = 16; o > 0; o >>= 1) {
        for (int l = 0; l < 32; l++) qt[l] = q[l] + q[l ^ o];
        memcpy(q, qt, sizeof(q));
    }
    y->d = d0;
    y->s = d0 * (float)q[0];
}

// rmsnorm_q8_1_kernel, thread block (row) by thread block, warp by warp. The sum of squares is
// the CPU's (in double): the kernel's float sum follows rmsnorm_kernel's order instead, which
// the GPU test compares; this checks the scale, the values and the blocks each warp writes.
static void emulate_rmsnorm_q8_1(const float *x, const float *w, int n, int T, float eps, dev_block_q8_1 *y) {
    for (int row = 0; row < T; row++) {
        const float *xr = x + (size_t)row * n;
        double ss = 0.0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        const float scale = rms_scale(ss, n, eps);
        for (int warp = 0; warp < RMSNORM_THREADS / CUDA_WARP; warp++)
            for (int b = warp; b < n / 32; b += RMSNORM_THREADS / CUDA_WARP) {
                float v[32];
                for (int lane = 0; lane < 32; lane++) v[lane] = rms_apply(xr[32 * b + lane], scale, w[32 * b + lane]);
                emulate_quantize_warp(v, y + (size_t)row * (n / 32) + b);
            }
    }
}

// swiglu_q8_1_kernel over its whole grid, warp by warp.
static void emulate_swiglu_q8_1(const float *gate, const float *up, int n, int T, dev_block_q8_1 *y) {
    const int64_t n_blocks = (int64_t)T * (n / 32);
    const int grid = cuda_blocks_for(n_blocks, SWIGLU_Q8_THREADS / CUDA_WARP);
    for (int blk = 0; blk < grid; blk++)
        for (int tid0 = 0; tid0 < SWIGLU_Q8_THREADS; tid0 += CUDA_WARP) {
            const int64_t b = ((int64_t)blk * SWIGLU_Q8_THREADS + tid0) / CUDA_WARP;
            if (b >= n_blocks) continue;
            float v[32];
            for (int lane = 0; lane < 32; lane++) v[lane] = silu_mul(gate[32 * b + lane], up[32 * b + lane]);
            emulate_quantize_warp(v, y + b);
        }
}

// The warp quantiser against the one-thread one on the blocks test_quantize uses.
static void test_quantize_warp(void) {
    const int64_t n = 32 * 64;
    float *x = (float *)malloc(n * sizeof(float));
    quantiser_inputs(x, n);
    for (int j = 0; j < 32; j++) x[32 * 17 + j] = -0.0f;
    block_q8_act *ref = (block_q8_act *)malloc(Q8_ACT_BLOCKS(n) * sizeof(block_q8_act));
    quantize_row_q8_act_scalar(x, ref, n);
    dev_block_q8_1 *a = (dev_block_q8_1 *)malloc((size_t)(n / 32) * sizeof(dev_block_q8_1));
    dev_block_q8_1 *c = (dev_block_q8_1 *)malloc((size_t)(n / 32) * sizeof(dev_block_q8_1));
    for (int64_t b = 0; b < n / 32; b++) {
        emulate_quantize_warp(x + 32 * b, a + b);
        q8_1_quantize_block(x + 32 * b, c + b);
    }
    const int bad = blocks_differ(a, ref, n / 32, "warp quantiser");
    CHECK(bad == 0);
    CHECK(memcmp(a, c, (size_t)(n / 32) * sizeof(dev_block_q8_1)) == 0);   // NaN blocks included
    printf("q8_1 warp quantise: %lld blocks, %d differ from quantize_row_q8_act_scalar\n", (long long)(n / 32), bad);
    free(x);
    free(ref);
    free(a);
    free(c);
}

// T rows of n through the fused kernels' host runs against rmsnorm_scalar / swiglu_scalar and
// quantize_row_q8_act_scalar. Row 1 (when there is one) has an inf in it (its norm and its
// products come out NaN), row 2 is all zeros; the others vary in magnitude by block.
static void test_norm_quant(int n, int T) {
    const float eps = 1e-5f;
    const int64_t nb = n / 32;
    float *x = (float *)malloc((size_t)n * T * sizeof(float));
    float *w = (float *)malloc((size_t)n * sizeof(float));
    float *up = (float *)malloc((size_t)n * T * sizeof(float));
    float *f = (float *)malloc((size_t)n * sizeof(float));
    block_q8_act *ref = (block_q8_act *)malloc(Q8_ACT_BLOCKS(n) * sizeof(block_q8_act));
    dev_block_q8_1 *y = (dev_block_q8_1 *)malloc((size_t)(nb * T) * sizeof(dev_block_q8_1));
    random_acts(x, (int64_t)n * T);
    for (int i = 0; i < n; i++) w[i] = 1.0f + 0.5f * uniform(-1.0f, 1.0f);
    for (int64_t i = 0; i < (int64_t)n * T; i++) up[i] = 3.0f * rnd_normal();
    for (int i = 0; i < n; i++) x[i] *= 30.0f;   // gates far out on both sides of silu (row 0)
    if (T > 1) x[n + n / 2] = INFINITY;
    if (T > 2) memset(x + 2 * n, 0, (size_t)n * sizeof(float));

    int bad_norm = 0, bad_swiglu = 0, bad_vals = 0;
    memset(y, 0xAB, (size_t)(nb * T) * sizeof(dev_block_q8_1));   // a block left unwritten differs
    emulate_rmsnorm_q8_1(x, w, n, T, eps, y);
    for (int t = 0; t < T; t++) {
        rmsnorm_scalar(f, x + (size_t)t * n, w, n, eps);
        double ss = 0.0;
        for (int i = 0; i < n; i++) ss += (double)x[(size_t)t * n + i] * x[(size_t)t * n + i];
        const float scale = rms_scale(ss, n, eps);
        for (int i = 0; i < n; i++) {
            const float v = rms_apply(x[(size_t)t * n + i], scale, w[i]);
            bad_vals += !(f2u(v) == f2u(f[i]) || (isnan(v) && isnan(f[i])));
        }
        quantize_row_q8_act_scalar(f, ref, n);
        bad_norm += blocks_differ(y + t * nb, ref, nb, "rmsnorm_q8_1");
    }
    memset(y, 0xAB, (size_t)(nb * T) * sizeof(dev_block_q8_1));
    emulate_swiglu_q8_1(x, up, n, T, y);
    for (int t = 0; t < T; t++) {
        swiglu_scalar(f, x + (size_t)t * n, up + (size_t)t * n, n);
        for (int i = 0; i < n; i++) {
            const float v = silu_mul(x[(size_t)t * n + i], up[(size_t)t * n + i]);
            bad_vals += !(f2u(v) == f2u(f[i]) || (isnan(v) && isnan(f[i])));
        }
        quantize_row_q8_act_scalar(f, ref, n);
        bad_swiglu += blocks_differ(y + t * nb, ref, nb, "swiglu_q8_1");
    }
    CHECK(bad_vals == 0);
    CHECK(bad_norm == 0);
    CHECK(bad_swiglu == 0);
    printf("norm-quant n=%-5d T=%d: values %d differ, rmsnorm_q8_1 %d and swiglu_q8_1 %d of %lld blocks differ\n", n, T,
           bad_vals, bad_norm, bad_swiglu, (long long)(nb * T));
    free(x);
    free(w);
    free(up);
    free(f);
    free(ref);
    free(y);
}

// ---- the kernels' threads, run one after another ----

// matvec_q8_kernel / matvec_f_kernel: every lane of each row's warp, the lanes' sums added.
template <class Q, int FLOAT_W>
static void emulate_matvec(const uint8_t *w, int64_t cols, int64_t rows, const float *x, int T, float *out) {
    const int n_groups = (int)(cols / 32);
    const int64_t row_bytes = qtype_row_bytes(Q::TYPE, cols);
    dev_block_q8_1 *a = (dev_block_q8_1 *)malloc((size_t)T * n_groups * sizeof(dev_block_q8_1) + 1);
    if (!FLOAT_W)
        for (int64_t i = 0; i < (int64_t)T * n_groups; i++) q8_1_quantize_block(x + 32 * i, a + i);
    for (int64_t r = 0; r < rows; r++) {
        float sum[CUDA_MATVEC_MAX_T] = { 0 };
        for (int lane = 0; lane < CUDA_WARP; lane++) {
            float acc[CUDA_MATVEC_MAX_T] = { 0 };
            if constexpr (FLOAT_W) mv_f_lane<Q>(w + r * row_bytes, x, cols, lane, T, acc);
            else                   mv_q8_lane<Q>(w + r * row_bytes, a, n_groups, lane, T, acc);
            for (int t = 0; t < T; t++) sum[t] += acc[t];
        }
        for (int t = 0; t < T; t++) out[t * rows + r] = sum[t];
    }
    free(a);
}

// f16_rows_kernel then matmul_mma_kernel: x's f16 rows by every thread of the first (into
// rows first filled with NaN), each tile's loads by its 128 threads (into tiles filled with
// NaN too, so a value no thread writes shows), the 64 x 64 x 64 products in float, the stores.
template <class Q, int FLOAT_W>
static void emulate_mma(const uint8_t *w, int64_t cols, int64_t rows, const float *x, int T, float *out) {
    alignas(16) static half xs[MM_TM * MM_LDH], ws[MM_TN * MM_LDH];
    static float cs[MM_TM * MM_LDC], acc[MM_TM * MM_TN];
    const int64_t row_bytes = qtype_row_bytes(Q::TYPE, cols), ld = mm_ld(cols);
    const half nan_h = __float2half_rn(NAN);
    half *xh = (half *)aligned_alloc(16, (size_t)(T * ld) * sizeof(half) + 16);
    for (int64_t i = 0; i < T * ld; i++) xh[i] = nan_h;
    for (int t = 0; t < T; t++)
        for (int64_t j = 0; j < ld / 2; j++) mm_f16_pair((half2 *)(xh + t * ld), x + t * cols, cols, j);
    for (int64_t t0 = 0; t0 < T; t0 += MM_TM)
        for (int64_t r0 = 0; r0 < rows; r0 += MM_TN) {
            for (int i = 0; i < MM_TM * MM_TN; i++) acc[i] = 0.0f;
            for (int64_t k0 = 0; k0 < cols; k0 += MM_TK) {
                for (int i = 0; i < MM_TM * MM_LDH; i++) xs[i] = ws[i] = nan_h;
                for (int tid = 0; tid < MM_THREADS; tid++) {
                    mm_load_x_tile(xs, xh, ld, T, t0, k0, tid);
                    if constexpr (FLOAT_W) mm_load_w_tile_f<Q>(ws, w, cols, rows, r0, k0, tid);
                    else                   mm_load_w_tile<Q>(ws, w, row_bytes, cols, rows, r0, k0, tid);
                }
                for (int m = 0; m < MM_TM; m++)
                    for (int n = 0; n < MM_TN; n++) {
                        float s = 0.0f;
                        for (int k = 0; k < MM_TK; k++) s += __half2float(xs[m * MM_LDH + k]) * __half2float(ws[n * MM_LDH + k]);
                        acc[m * MM_TN + n] += s;
                    }
            }
            for (int m = 0; m < MM_TM; m++)
                for (int n = 0; n < MM_TN; n++) cs[m * MM_LDC + n] = acc[m * MM_TN + n];
            for (int tid = 0; tid < MM_THREADS; tid++) mm_store_tile(out, cs, rows, T, t0, r0, tid);
        }
    free(xh);
}

template <class Q, int FLOAT_W>
static void test_emulated(int32_t type, const char *name, int64_t cols, int64_t rows, int T) {
    const int64_t row_bytes = qtype_row_bytes(type, cols);
    uint8_t *w = (uint8_t *)malloc((size_t)(row_bytes * rows));
    float *wf = (float *)malloc((size_t)(cols * rows) * sizeof(float));
    float *x = (float *)malloc((size_t)(cols * T) * sizeof(float));
    float *out = (float *)malloc((size_t)(rows * T) * sizeof(float));
    double *ref = (double *)malloc((size_t)(rows * T) * sizeof(double));
    double *twin = (double *)malloc((size_t)(rows * T) * sizeof(double));
    if (FLOAT_W) {
        for (int64_t i = 0; i < cols * rows; i++) {
            const float v = uniform(-1.0f, 1.0f);
            if (type == PYKV_TYPE_F32) memcpy(w + 4 * i, &v, 4);
            else if (type == PYKV_TYPE_F16) put_f16(w + 2 * i, fp32_to_fp16(v));
            else put_f16(w + 2 * i, (uint16_t)(f2u(v) >> 16));
        }
    } else {
        for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
            if (TYPES[i].type == type) random_blocks(TYPES[i], w, (int)(cols / TYPES[i].qk * rows));
    }
    for (int64_t r = 0; r < rows; r++) CHECK(pykv_dequantize(type, w + r * row_bytes, cols, wf + r * cols) == PYKV_OK);
    for (int64_t i = 0; i < cols * T; i++) x[i] = rnd_normal();
    for (int t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0.0;
            for (int64_t c = 0; c < cols; c++) s += (double)x[t * cols + c] * wf[r * cols + c];
            ref[t * rows + r] = s;
        }

    // The few-row path, up to CUDA_MATVEC_MAX_T rows, against the CPU's own dots.
    const int Tv = T < CUDA_MATVEC_MAX_T ? T : CUDA_MATVEC_MAX_T;
    block_q8_act *xq = (block_q8_act *)malloc(Q8_ACT_BLOCKS(cols) * sizeof(block_q8_act));
    for (int t = 0; t < Tv; t++) {
        if (!FLOAT_W) quantize_row_q8_act_scalar(x + t * cols, xq, cols);
        for (int64_t r = 0; r < rows; r++)
            twin[t * rows + r] = FLOAT_W ? vec_dot_scalar_for(type)(w + r * row_bytes, x + t * cols, cols)
                                         : vec_dot_q8_scalar_for(type)(w + r * row_bytes, xq, cols);
    }
    for (int64_t i = 0; i < rows * T; i++) out[i] = NAN;
    emulate_matvec<Q, FLOAT_W>(w, cols, rows, x, Tv, out);
    const double e_twin = nmse_d(out, twin, rows * Tv), e_mv = nmse_d(out, ref, rows * Tv);
    CHECK(e_twin <= 1e-9);
    CHECK(e_mv <= (FLOAT_W ? 1e-7 : 5e-4));

    for (int64_t i = 0; i < rows * T; i++) out[i] = NAN;
    emulate_mma<Q, FLOAT_W>(w, cols, rows, x, T, out);
    const double e_mma = nmse_d(out, ref, rows * T);
    CHECK(e_mma <= 1e-5);
    printf("%-5s emulated cols=%lld rows=%lld: matvec T=%d NMSE %.2e (vs the CPU's dot %.2e), mma T=%d NMSE %.2e\n",
           name, (long long)cols, (long long)rows, Tv, e_mv, e_twin, T, e_mma);
    free(w);
    free(wf);
    free(x);
    free(out);
    free(ref);
    free(twin);
    free(xq);
}

static void test_kernels_emulated(void) {
    // Tails everywhere: rows and T not multiples of 64, a last column step of 32 of 64 (or of
    // 36 for the float types), a row count not a multiple of the 4 rows of a matvec block.
    test_emulated<ft_f32, 1>(PYKV_TYPE_F32, "f32", 100, 70, 67);
    test_emulated<ft_f16, 1>(PYKV_TYPE_F16, "f16", 100, 70, 67);
    test_emulated<ft_bf16, 1>(PYKV_TYPE_BF16, "bf16", 100, 70, 67);
    test_emulated<qt_q4_0, 0>(PYKV_TYPE_Q4_0, "q4_0", 96, 70, 67);
    test_emulated<qt_q4_1, 0>(PYKV_TYPE_Q4_1, "q4_1", 96, 70, 67);
    test_emulated<qt_q5_0, 0>(PYKV_TYPE_Q5_0, "q5_0", 96, 70, 67);
    test_emulated<qt_q5_1, 0>(PYKV_TYPE_Q5_1, "q5_1", 96, 70, 67);
    test_emulated<qt_q8_0, 0>(PYKV_TYPE_Q8_0, "q8_0", 1120, 70, 7);
    test_emulated<qt_q4_K, 0>(PYKV_TYPE_Q4_K, "q4_K", 768, 70, 67);
    test_emulated<qt_q5_K, 0>(PYKV_TYPE_Q5_K, "q5_K", 256, 65, 8);
    test_emulated<qt_q6_K, 0>(PYKV_TYPE_Q6_K, "q6_K", 1280, 33, 65);
}

int main(void) {
    test_helpers();
    test_float_types();
    test_row_bytes();
    test_quantize();
    for (size_t i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++) {
        const type_case &tc = TYPES[i];
        const int n_blocks = tc.qk == 32 ? 96 : 24;
        uint8_t *w = (uint8_t *)malloc((size_t)n_blocks * tc.bytes);
        random_blocks(tc, w, n_blocks);
        test_decode(tc, w, n_blocks);
        test_dot(tc, w, n_blocks);
        free(w);
    }
    test_kernels_emulated();
    test_quantize_warp();
    const int norm_n[] = { 32, 96, 576, 1536, 8192 };
    for (int i = 0; i < 5; i++) test_norm_quant(norm_n[i], i % 2 ? 8 : 3);
    test_norm_quant(4096, 1);
    return check_report("test_cuda_blocks");
}
