// test_quant_q8.c - the fast decode path: 8-bit activation quantisation and the integer dot
// products of each weight type with it.
//
// The integer kernels must equal (within float rounding, 1e-5 * sum|terms|) a double dot of
// the dequantised weights with the dequantised activations q * d: the quantisation is the
// only approximation, and it is bounded separately (|x - q d| <= d / 2 per element).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/quant-blocks.h"
#include "cpu/quant-q8.h"
#include "random-rows.h"

static void random_activations(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = uniform(-3, 3);
    for (int64_t i = 0; i < n && n >= 64; i++) if (i / 32 == 1) x[i] = 0.0f;   // an all-zero block
    if (n >= 96) for (int j = 64; j < 96; j++) x[j] = (float)(j % 5 - 2) * 0.5f;   // exact halves: ties
}

static void test_quantize(void) {
    const int64_t n = 1536;
    float *x = malloc(n * sizeof(float));
    block_q8_act *a = malloc(Q8_ACT_BYTES(n)), *b = malloc(Q8_ACT_BYTES(n));
    const q8_act_side side = q8_side(a, n);
    for (int rep = 0; rep < 20; rep++) {
        random_activations(x, n);
        quantize_row_q8_act_scalar(x, a, n);
        quantize_row_q8_act(x, b, n);
        CHECK(memcmp(a, b, Q8_ACT_BYTES(n)) == 0);   // SIMD and scalar give the same bits, side arrays too
        for (int64_t i = 0; i < n / 32; i++) {
            int sum = 0, amax = 0, half[2] = { 0, 0 };
            for (int j = 0; j < 32; j++) {
                const float xi = x[i * 32 + j];
                const int q = a[i].qs[j];
                sum += q;
                half[j / 16] += q;
                if (abs(q) > amax) amax = abs(q);
                CHECK(fabsf(xi - (float)q * a[i].d) <= 0.5f * a[i].d * 1.0001f);
            }
            CHECK(amax <= 127);
            CHECK(a[i].d == 0.0f || amax == 127);   // the largest element maps to +-127
            CHECK(a[i].s == a[i].d * (float)sum);
            CHECK(side.d[i] == a[i].d && side.s[i] == a[i].s);
            CHECK(side.sum16[2 * i] == half[0] && side.sum16[2 * i + 1] == half[1]);
        }
    }
    free(x); free(a); free(b);
}

static const int32_t q8_types[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0,
                                    PYKV_TYPE_Q2_K, PYKV_TYPE_Q3_K, PYKV_TYPE_Q4_K, PYKV_TYPE_Q5_K, PYKV_TYPE_Q6_K,
                                    PYKV_TYPE_IQ4_NL, PYKV_TYPE_IQ4_XS };

// The double dot of a weight row with the dequantised activations, and the tolerance of
// the integer kernels against it; *exact: with the float activations, *qerr: its bound.
struct dot_ref { double ref, tol, exact, qerr; };

static struct dot_ref reference_dot(int32_t type, const uint8_t *row, const float *x, const block_q8_act *xq,
                                    float *w, int64_t n) {
    struct dot_ref d = { 0 };
    double mag = 0;
    CHECK(dequant_row(type, row, w, n) == PYKV_OK);
    for (int64_t i = 0; i < n; i++) {
        const double xd = (double)xq[i / 32].qs[i % 32] * xq[i / 32].d;
        d.ref += (double)w[i] * xd;
        mag += fabs((double)w[i] * xd);
        d.exact += (double)w[i] * x[i];
        d.qerr += fabs((double)w[i]) * 0.5 * xq[i / 32].d;
    }
    d.tol = 1e-5 * mag + 1e-30;
    return d;
}

static void check_dot(int32_t type, int64_t n) {
    uint8_t *row = malloc((size_t)type_row_bytes(type, n));
    float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
    block_q8_act *xq = malloc(Q8_ACT_BYTES(n));
    for (int rep = 0; rep < 5; rep++) {
        random_row(type, row, n);
        random_activations(x, n);
        // Last: same-signed activations, where the super-block kernels' centre and min terms
        // (taken off once per super-block, in float) are as large as they get.
        if (rep == 4) for (int64_t i = 0; i < n; i++) x[i] = 0.5f + 0.1f * fabsf(x[i]);
        quantize_row_q8_act(x, xq, n);
        const struct dot_ref d = reference_dot(type, row, x, xq, w, n);
        const float simd = vec_dot_q8_for(type)(row, xq, n);
        const float scal = vec_dot_q8_scalar_for(type)(row, xq, n);
        CHECK_NEAR(simd, d.ref, d.tol);
        CHECK_NEAR(scal, d.ref, d.tol);
        CHECK_NEAR(simd, d.exact, d.qerr + d.tol);   // against float activations: the quantisation bound
        if (!(fabs(simd - d.ref) <= d.tol)) fprintf(stderr, "  type %s n=%lld\n", pykv_type_name(type), (long long)n);
    }
    free(row); free(x); free(w); free(xq);
}

// The four-row kernel: each output against its own row's reference, the rows two bytes off
// any wider alignment (blocks are 18 to 34 bytes, so rows are 2-byte aligned, no more).
static void check_dot4(int32_t type, int64_t n) {
    const vec_dot4_q8_fn dot4 = vec_dot4_q8_for(type);
    if (!dot4) return;
    const int64_t rb = type_row_bytes(type, n);
    uint8_t *buf = malloc((size_t)(4 * rb + 2)), *rows = buf + 2;
    float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
    block_q8_act *xq = malloc(Q8_ACT_BYTES(n));
    for (int rep = 0; rep < 3; rep++) {
        for (int r = 0; r < 4; r++) random_row(type, rows + r * rb, n);
        random_activations(x, n);
        quantize_row_q8_act(x, xq, n);
        float out[4];
        dot4(rows, rb, xq, n, out);
        for (int r = 0; r < 4; r++) {
            const struct dot_ref d = reference_dot(type, rows + r * rb, x, xq, w, n);
            CHECK_NEAR(out[r], d.ref, d.tol);
            if (!(fabs(out[r] - d.ref) <= d.tol))
                fprintf(stderr, "  four rows: type %s n=%lld row %d\n", pykv_type_name(type), (long long)n, r);
        }
    }
    free(buf); free(x); free(w); free(xq);
}

static void test_dots(void) {
    const int64_t ns[] = { 32, 64, 96, 576, 1536 };   // odd block counts reach the tail
    const int64_t ns_k[] = { 256, 768, 1536, 2816 };  // super-blocks of 256
    for (size_t k = 0; k < sizeof(q8_types) / sizeof(q8_types[0]); k++) {
        CHECK(vec_dot_q8_for(q8_types[k]) != NULL);
        CHECK(vec_dot_q8_scalar_for(q8_types[k]) != NULL);
        if (pykv_type_block_size(q8_types[k]) == 256)
            for (int i = 0; i < 4; i++) check_dot(q8_types[k], ns_k[i]);
        else
            for (int i = 0; i < 5; i++) check_dot(q8_types[k], ns[i]);
    }
    // The four-row kernels, where the CPU has them: the 32-element types.
    const int32_t four[] = { PYKV_TYPE_Q4_0, PYKV_TYPE_Q4_1, PYKV_TYPE_Q5_0, PYKV_TYPE_Q5_1, PYKV_TYPE_Q8_0,
                             PYKV_TYPE_IQ4_NL };
    for (size_t k = 0; k < sizeof(four) / sizeof(four[0]); k++)
        for (int i = 0; i < 5; i++) check_dot4(four[k], ns[i]);
    CHECK(vec_dot4_q8_for(PYKV_TYPE_Q4_K) == NULL);
    CHECK(vec_dot4_q8_for(PYKV_TYPE_F32) == NULL);
    CHECK(vec_dot4_q8_for(-1) == NULL);
    // Types without an integer kernel fall back to the float path.
    CHECK(vec_dot_q8_for(PYKV_TYPE_F32) == NULL);
    CHECK(vec_dot_q8_for(PYKV_TYPE_F16) == NULL);
    CHECK(vec_dot_q8_for(PYKV_TYPE_BF16) == NULL);
    CHECK(vec_dot_q8_for(-1) == NULL);
    CHECK(vec_dot_q8_for(99) == NULL);
}

// Q8_0 weights of -128 (outside what ggml writes, but valid bytes) must not overflow the
// 16-bit pair sums.
static void test_q8_0_extremes(void) {
    block_q8_0 b[2];
    block_q8_act x[Q8_ACT_BLOCKS(64)];
    float xf[64];
    for (int i = 0; i < 2; i++) {
        b[i].d = fp32_to_fp16(1.0f);
        for (int j = 0; j < 32; j++) b[i].qs[j] = -128;
    }
    for (int j = 0; j < 64; j++) xf[j] = -1.0f;
    quantize_row_q8_act(xf, x, 64);
    const double want = 64.0 * 128.0 * (127.0 * x[0].d);
    CHECK_NEAR(vec_dot_q8_for(PYKV_TYPE_Q8_0)(b, x, 64), want, 1e-3 * want);
    CHECK_NEAR(vec_dot_q8_scalar_for(PYKV_TYPE_Q8_0)(b, x, 64), want, 1e-3 * want);
    const vec_dot4_q8_fn dot4 = vec_dot4_q8_for(PYKV_TYPE_Q8_0);
    if (dot4) {   // four copies of the row, zero bytes apart
        float out[4];
        dot4(b, 0, x, 64, out);
        for (int r = 0; r < 4; r++) CHECK_NEAR(out[r], want, 1e-3 * want);
    }
}

// A model whose weights overflow feeds infs and NaNs to the quantizer: such a block gets
// zero quants and a NaN scale (no int conversion of a NaN: UBSan watches the sums), so
// every kernel's product with it is NaN, on both paths. Values so small that 1 / scale would
// overflow quantise to 0.
static void test_quantize_non_finite(void) {
    enum { N = 256 };
    const float bad[] = { INFINITY, -INFINITY, NAN };
    const int lanes[] = { 0, 7, 8, 17, 31 };
    float x[N];
    block_q8_act *a = malloc(Q8_ACT_BYTES(N)), *b = malloc(Q8_ACT_BYTES(N));
    uint8_t *row = malloc((size_t)type_row_bytes(PYKV_TYPE_Q2_K, N) * 8);
    for (int k = 0; k < 3; k++)
        for (int l = 0; l < 5; l++) {
            for (int i = 0; i < N; i++) x[i] = uniform(-3, 3);
            for (int j = 0; j < 32; j++) x[224 + j] = 1e-40f * (float)(j - 16);   // subnormal: 1 / scale = inf
            x[32 + lanes[l]] = bad[k];
            x[160 + lanes[4 - l]] = bad[2 - k];
            quantize_row_q8_act_scalar(x, a, N);
            quantize_row_q8_act(x, b, N);
            CHECK(memcmp(a, b, Q8_ACT_BYTES(N)) == 0);
            const q8_act_side side = q8_side(a, N);
            for (int blk = 0; blk < N / 32; blk++) {
                const int non_finite = blk == 1 || blk == 5, tiny = blk == 7;
                int nonzero = 0;
                for (int j = 0; j < 32; j++) nonzero += a[blk].qs[j] != 0;
                CHECK(non_finite ? isnan(a[blk].d) && isnan(a[blk].s) : isfinite(a[blk].d) && isfinite(a[blk].s));
                CHECK(memcmp(&side.d[blk], &a[blk].d, sizeof(float)) == 0 && memcmp(&side.s[blk], &a[blk].s, sizeof(float)) == 0);
                if (non_finite || tiny) CHECK(nonzero == 0 && side.sum16[2 * blk] == 0 && side.sum16[2 * blk + 1] == 0);
                else CHECK(nonzero > 0);
            }
            for (size_t t = 0; t < sizeof(q8_types) / sizeof(q8_types[0]); t++) {
                random_row(q8_types[t], row, N);
                CHECK(isnan(vec_dot_q8_for(q8_types[t])(row, a, N)));
                CHECK(isnan(vec_dot_q8_scalar_for(q8_types[t])(row, a, N)));
                const vec_dot4_q8_fn dot4 = vec_dot4_q8_for(q8_types[t]);
                if (dot4) {
                    float out[4];
                    dot4(row, 0, a, N, out);
                    for (int r = 0; r < 4; r++) CHECK(isnan(out[r]));
                }
            }
        }
    free(a); free(b); free(row);
}

int main(void) {
    test_quantize();
    test_quantize_non_finite();
    test_dots();
    test_q8_0_extremes();
    return check_report("test_quant_q8");
}
